"""The configuration skeleton every `configs/*.py` file fills in, and its typed readers.

Configs are ml_collections ConfigDicts, read once at the entry point (`launch/`) and passed down as
typed values (`ModelConfig`, a mesh, a rule table). The skeleton is locked by the flag machinery, so
`--config.model.bogus=1` is an error; `model_config` also refuses keys a config file adds that
`ModelConfig` does not know.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from tiderl_jax.model.config import ConfigError, ModelConfig

# The model code (JAX, Flax) is imported where it is used, so that entry points without a model
# (launch/simulate.py) start without it.


def base_config() -> ConfigDict:
    from tiderl_jax.model.sharding import DEFAULT_RULES

    c = ConfigDict()
    c.seed = 0
    # CPU only: how many devices to fake on the host platform (0: leave JAX's default). Applied
    # before JAX starts; ignored on GPU/TPU. XLA_FLAGS=--xla_force_host_platform_device_count wins.
    c.cpu_devices = 0
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
    from tiderl_jax.model.sharding import rules_from_config

    return rules_from_config(c.sharding_rules)


def check_overrides(argv: list[str], default_path: str, flag: str = "config") -> None:
    """Refuses `--config.a.b=v` overrides whose key does not exist, naming the key and the choices.

    ml_collections also refuses them, but with a bare `AttributeError: 'b'`; this runs first, before
    flag parsing, so the user sees which key and what the valid keys at that level are.
    """
    import importlib.util

    path = default_path
    keys = []
    for arg in argv[1:]:
        if arg.startswith(f"--{flag}="):
            path = arg.split("=", 1)[1]
        elif arg.startswith(f"--{flag}."):
            keys.append(arg[len(flag) + 3:].split("=", 1)[0])
    if not keys:
        return
    spec = importlib.util.spec_from_file_location("_config_under_check", path.split(":", 1)[0])
    if spec is None or spec.loader is None:
        return  # the flag machinery reports a bad path itself
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for key in keys:
        node, walked = config, []
        for part in key.split("."):
            if not isinstance(node, ConfigDict) or part not in node:
                where = ".".join([flag] + walked)
                known = sorted(node.keys()) if isinstance(node, ConfigDict) else []
                raise ConfigError(f"--{flag}.{key}: {where} has no key {part!r}; known keys: {known}")
            node = node[part]
            walked.append(part)


def define_config_flag(default_path: str, flag: str = "config"):
    """`config_flags.DEFINE_config_file` for a launch script, with overrides checked first.

    The flag machinery applies `--config.*` overrides while the flag is defined (at import), so the
    check runs here; a bad key ends the program with exit status 2 and one clear line.
    """
    import sys

    from ml_collections import config_flags

    try:
        check_overrides(sys.argv, default_path, flag)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return config_flags.DEFINE_config_file(flag, default_path, "Path to an ml_collections config file.",
                                           lock_config=True)


def apply_platform_settings(c: ConfigDict) -> None:
    """Settings that must reach JAX before its first use (call at the top of `main`)."""
    import os

    import jax

    if c.cpu_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", int(c.cpu_devices))


def build(cfg):
    """(mesh, rules, tokenizer, model) from a config; raises ConfigError on bad input."""
    from flax import nnx

    from tiderl_jax.model.decoder import Decoder
    from tiderl_jax.model.hf_io import load_hf_checkpoint
    from tiderl_jax.model.sharding import init_sharded, make_mesh
    from tiderl_jax.model.tokenizer import Tokenizer

    rules = sharding_rules(cfg)
    mesh = make_mesh(cfg.mesh)
    tokenizer = (Tokenizer.from_file(cfg.tokenizer.path, eos_token=cfg.tokenizer.eos_token)
                 if cfg.tokenizer.path else Tokenizer.builtin())
    model_cfg = model_config(cfg)
    if cfg.checkpoint:  # the architecture comes from the checkpoint; config.model gives the dtypes
        model = load_hf_checkpoint(cfg.checkpoint, mesh=mesh, rules=rules, dtype=model_cfg.dtype,
                                   param_dtype=model_cfg.param_dtype)
    else:
        model = init_sharded(lambda: Decoder(model_cfg, rngs=nnx.Rngs(cfg.seed)), mesh, rules)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                          f"{model.cfg.vocab_size}; raise config.model.vocab_size")
    return mesh, rules, tokenizer, model
