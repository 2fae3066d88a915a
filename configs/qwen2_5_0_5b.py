"""Qwen2.5-0.5B(-Instruct): 494M parameters, tied embeddings, q/k/v bias.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 8 (14 query heads and 2
KV heads do not split 8 ways; tensor parallelism does not pay at this size).
Set --config.checkpoint=/path/to/Qwen2.5-0.5B-Instruct and --config.tokenizer.path=<same dir>.
"""

from tiderl_jax.config import base_config


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
    return c
