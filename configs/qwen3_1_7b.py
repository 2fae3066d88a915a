"""Qwen3-1.7B: 1.72B parameters (1.41B without embeddings), tied embeddings, q/k RMSNorm.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 4 x tensor 2.
Set --config.checkpoint=/path/to/Qwen3-1.7B (an HF directory, or a .gguf file of
the same model): the tokenizer, chat template and stop tokens come from it.
"""

from tiderl_jax.config import base_config, main_job_sections, one_gpu_host


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
    one_gpu_host(c, tensor=2, context=4096)
    return c
