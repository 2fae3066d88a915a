"""Llama-3.1-8B(-Instruct): 8.03B parameters, untied embeddings, llama3 RoPE scaling.

Dimensions from the published config.json. Mesh for one 8-GPU host: fsdp 2 x tensor 4
(32 query / 8 KV heads split 4 ways). Its chat template (Llama 3.1 JSON tool calls) is the
checkpoint's own (model/chat_template.py).
Set --config.checkpoint=/path/to/Llama-3.1-8B-Instruct (an HF directory, or a .gguf file of
the same model): the tokenizer, chat template and stop tokens come from it.
"""

from ml_collections import ConfigDict

from tiderl_jax.config import base_config, main_job_sections, one_gpu_host


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
        # a ConfigDict: the key is a typed placeholder (off by default), which takes no plain dict
        rope_scaling=ConfigDict(dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)),
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
    # every section launch/train.py reads (tiderl_jax/config.py, main_job_sections): RL from --config.checkpoint on
    # the built-in tool tasks (their tool calls in the checkpoint's own template), or on a dataset of your own
    # (--config.data.train_files=..., docs/data.md). One 8-GPU host: TideRL with device groups of 2 (rollout 2,
    # train 2), tensor parallelism 2 within a group.
    main_job_sections(c, logdir="runs/llama3_1_8b")
    one_gpu_host(c, tensor=2, context=8192)
    return c
