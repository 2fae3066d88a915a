"""Llama-3.1-8B(-Instruct): 8.03B parameters, untied embeddings, llama3 RoPE scaling.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 2 x tensor 4
(32 query / 8 KV heads split 4 ways). The Llama 3 chat markup differs from ChatML: load the
checkpoint's tokenizer.json; the ChatML template needs its special tokens added for now.
Set --config.checkpoint=/path/to/Llama-3.1-8B-Instruct and --config.tokenizer.path=<same dir>.
"""

from tiderl_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.tokenizer.eos_token = "<|eot_id|>"
    c.mesh.update(data=1, fsdp=-1, tensor=4)
    return c
