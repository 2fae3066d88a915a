"""The configuration skeleton every `configs/*.py` file fills in, and its typed readers.

Configs are ml_collections ConfigDicts, read once at the entry point (`launch/`) and passed down as
typed values (`ModelConfig`, a mesh, a rule table). The skeleton is locked by the flag machinery, so
`--config.model.bogus=1` is an error; `model_config` also refuses keys a config file adds that
`ModelConfig` does not know.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.sharding import DEFAULT_RULES, rules_from_config


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    # HF checkpoint directory (config.json + safetensors); empty: random initialisation from `model`.
    c.checkpoint = ""
    c.model = ConfigDict(vars(ModelConfig()) | {"rope_scaling": None})
    # One axis may be -1 (fills the remaining devices).
    c.mesh = ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.sharding_rules = DEFAULT_RULES
    # tokenizer.json path; empty: the built-in byte tokenizer of the CPU default.
    c.tokenizer = ConfigDict({"path": "", "eos_token": "<|im_end|>"})
    c.sample = ConfigDict({
        "prompt": "What is 12 + 30? Use the calc tool.",
        "system": "You are a helpful assistant with tools.",
        "batch_size": 8,
        "max_new_tokens": 32,
        "temperature": 1.0,
    })
    return c


def model_config(c: ConfigDict) -> ModelConfig:
    return ModelConfig.from_dict(c.model.to_dict(), source="config.model")


def sharding_rules(c: ConfigDict):
    return rules_from_config(c.sharding_rules)
