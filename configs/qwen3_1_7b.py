"""Qwen3-1.7B: 1.72B parameters (1.41B without embeddings), tied embeddings, q/k RMSNorm.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 4 x tensor 2.
Set --config.checkpoint=/path/to/Qwen3-1.7B (an HF directory, or a .gguf file of
the same model): the tokenizer, chat template and stop tokens come from it.
"""

from tiderl_jax.config import base_config, main_job_sections


def get_config():
    c = base_config()
    c.model.update(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=1, fsdp=-1, tensor=2)
    # every section launch/train.py reads (tiderl_jax/config.py, main_job_sections): RL from --config.checkpoint on
    # the built-in tool tasks (their tool calls in the checkpoint's own template), or on a dataset of your own
    # (--config.data.train_files=..., docs/data.md). One 8-GPU host: TideRL with device groups of 2 (rollout 2,
    # train 2), tensor parallelism 2 within a group.
    main_job_sections(c, logdir="runs/qwen3_1_7b")
    c.controller.update(mode="tiderl", steps=200, groups_per_step=32, group_size=8, max_concurrent=512,
                        device_group_size=2, rollout_groups=2, ref_groups=0, train_groups=2, tensor=2,
                        checkpoint_every=20)
    c.engine.update(page_size=16, num_pages=16384, max_seq_len=4096, max_running=256, prefill_chunk=1024,
                    prefill_budget=8192, decode_steps=8)
    c.rollout.update(max_turns=8, max_new_tokens=512, max_context=4096, temperature=1.0)
    c.trainer.update(learning_rate=1e-6, warmup_steps=10, row_len=4096, micro_rows=4, grad_clip=1.0, weight_decay=0.0)
    c.loss.update(advantage_estimator="grpo", kl_coef=0.0, clip_low=0.2, clip_high=0.28)
    c.eval.update(tasks=256, every=20, during_tasks=64)
    return c
