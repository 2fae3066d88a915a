"""Qwen3-1.7B: 1.72B parameters (1.41B without embeddings), tied embeddings, q/k RMSNorm.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 4 x tensor 2.
Set --config.checkpoint=/path/to/Qwen3-1.7B and --config.tokenizer.path=<same dir>.
"""

from tiderl_jax.config import base_config


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
    return c
