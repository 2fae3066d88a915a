"""Qwen2.5-0.5B(-Instruct): 494M parameters, tied embeddings, q/k/v bias.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 8 (14 query heads and 2
KV heads do not split 8 ways; tensor parallelism does not pay at this size).
Set --config.checkpoint=/path/to/Qwen2.5-0.5B-Instruct (an HF directory, or a .gguf file of
the same model): the tokenizer, chat template and stop tokens come from it.
"""

from tiderl_jax.config import base_config, main_job_sections, one_gpu_host


def get_config():
    c = base_config()
    c.model.update(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        qk_norm=False,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    # every section launch/train.py reads (tiderl_jax/config.py, main_job_sections): RL from --config.checkpoint on
    # the built-in tool tasks (their tool calls in the checkpoint's own template), or on a dataset of your own
    # (--config.data.train_files=..., docs/data.md). One 8-GPU host: TideRL with device groups of 2 (rollout 2,
    # train 2), tensor parallelism 1 within a group.
    main_job_sections(c, logdir="runs/qwen2_5_0_5b")
    one_gpu_host(c, tensor=1, context=4096)
    return c
