"""The CPU default: a ~3M-parameter Qwen3-style model that trains in minutes on 2 cores.

The vocabulary is the built-in byte tokenizer's 265 ids padded to 384 (a small vocabulary keeps the
logits cheap on a CPU, see docs/architecture.md, Conventions). Eight faked CPU devices form a 4 x 2 fsdp x tensor mesh.
"""

from tiderl_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        arch="qwen3",
        vocab_size=384,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        dtype="float32",
        param_dtype="float32",
    )
    c.cpu_devices = 8
    c.mesh.update(data=1, fsdp=-1, tensor=2)
    return c
