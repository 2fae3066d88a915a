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
    import os

    file = path.split(":", 1)[0]
    if not os.path.isfile(file):
        raise ConfigError(f"--{flag}={path}: no such config file")
    if not keys:
        return
    spec = importlib.util.spec_from_file_location("_config_under_check", file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--{flag}={path}: not a Python config file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config()
    except Exception as e:  # noqa: BLE001 - the user's config file: name it, no traceback
        raise ConfigError(f"--{flag}={path}: loading it failed: {type(e).__name__}: {e}") from None
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


def rl_configs(c: ConfigDict):
    """The main job's typed configs from a ConfigDict (configs/tiny_agentic.py's sections):
    (controller, trainer, engine, rollout, warm-start trainer). ConfigError names a bad key or value."""
    import dataclasses

    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.engine.engine import EngineConfig
    from tiderl_jax.rl.losses import from_config_dict
    from tiderl_jax.rl.trainer import TrainerConfig
    from tiderl_jax.runtime.controller import ControllerConfig

    try:
        # config.seed is the run's seed: the train-task stream and the sampling seeds are offset by it
        ctl = c.controller.to_dict()
        controller = ControllerConfig(**{**ctl, "task_kinds": _kinds(c),
                                         "data_seed": ctl.get("data_seed", 0) + c.get("seed", 0)})
        values = c.trainer.to_dict()  # a run shorter than the warmup warms up over all but its last step
        total = max(controller.steps, 2)
        values["warmup_steps"] = min(values.get("warmup_steps", 0), total - 1)
        trainer = TrainerConfig(loss=from_config_dict(c.loss), total_steps=total,
                                temperature=c.rollout.temperature, **values)
        engine = EngineConfig(**c.engine.to_dict())
        values = c.rollout.to_dict()
        if isinstance(values.get("weights"), dict):
            from tiderl_jax.policies.ctb import CTBWeights
            values["weights"] = CTBWeights(**values["weights"])
        values["seed"] = values.get("seed", 0) + c.get("seed", 0)
        rollout = RolloutConfig(**values)
        warm = dataclasses.replace(trainer, learning_rate=c.sft.learning_rate, row_len=c.sft.row_len,
                                   warmup_steps=min(trainer.warmup_steps, max(c.sft.steps - 1, 0)),
                                   total_steps=max(c.sft.steps, 1))
    except (TypeError, ValueError) as e:  # an unknown key in a section, or a refused value
        raise ConfigError(f"config: {e}") from None
    return controller, trainer, engine, rollout, warm


WARM_STARTS = ("checkpoint", "scratch")


def section(cls, exclude: tuple[str, ...] = (), **values) -> ConfigDict:
    """A config section with every field of the dataclass `cls` (its defaults, then `values`), so each
    option can be set with `--config.<section>.<field>=v`; nested dataclasses become sub-sections."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            default = ConfigDict(dataclasses.asdict(default))
        out[f.name] = default
    unknown = set(values) - set(out)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    out.update(values)
    return ConfigDict(out)


def _kinds(c: ConfigDict) -> tuple[str, ...]:
    """`tasks` as a tuple of kinds; `--config.tasks=calculator,lookup` arrives as one string."""
    raw = c.tasks
    items = raw.split(",") if isinstance(raw, str) else [k for item in raw for k in str(item).split(",")]
    return tuple(k.strip() for k in items if k.strip())


def check_main_job(c: ConfigDict, num_devices: int | None = None) -> None:
    """Every check of the main job's config that needs no model: run it before anything is built.

    Normalises `tasks` (a comma-separated string becomes a tuple) and raises ConfigError naming the key
    (or file) for: unknown task kinds, sizes that are zero or negative, a warm start that is neither
    `checkpoint` nor `scratch`, a starting checkpoint that does not exist, device groups that do not fit
    the devices, and context limits that contradict each other (`rollout.max_context` must fit the
    engine's `max_seq_len`, the trainer's `row_len` and the model's `max_position_embeddings`).
    """
    import os

    from tiderl_jax.agents import tasks as task_lib
    from tiderl_jax.model.hf_io import read_hf_config

    kinds = _kinds(c)
    if not kinds:
        raise ConfigError("tasks is empty; give task kinds, e.g. --config.tasks=calculator,lookup")
    unknown = [k for k in kinds if k not in task_lib.GENERATORS]
    if unknown:
        raise ConfigError(f"tasks: unknown kind(s) {unknown}; known: {sorted(task_lib.GENERATORS)}")
    with c.unlocked():
        c.tasks = kinds
    sizes = {"sft": ("steps", "batch_size", "row_len", "probe_every", "probe_tasks", "probe_samples"),
             "eval": ("tasks",),
             "engine": ("page_size", "num_pages", "max_seq_len", "max_running", "prefill_chunk",
                        "prefill_budget", "max_prefill_rows", "decode_steps"),
             "rollout": ("max_turns", "max_new_tokens", "max_context"),
             "trainer": ("row_len", "micro_rows")}
    for section, keys in sizes.items():
        for key in keys:
            if key in c[section] and not c[section][key] >= 1:
                raise ConfigError(f"{section}.{key}={c[section][key]} must be >= 1")
    warm = c.get("warm_start", "scratch")
    if warm not in WARM_STARTS:
        raise ConfigError(f"warm_start={warm!r} is not one of {WARM_STARTS}")
    if warm == "checkpoint":
        if not c.checkpoint:
            raise ConfigError("warm_start='checkpoint' needs config.checkpoint (an HF checkpoint directory); "
                              "or set --config.warm_start=scratch")
        if not os.path.isdir(c.checkpoint):
            raise ConfigError(f"checkpoint={c.checkpoint!r}: no such directory")
    if warm == "scratch" and c.model.image_patch_dim > 0 and c.model.image_token_id is None:
        from tiderl_jax.model.tokenizer import IMAGE_TOKEN  # a vision model's image token: the tokenizer's
        with c.unlocked():
            c.model.image_token_id = build_tokenizer(c).token_id(IMAGE_TOKEN)
    model = read_hf_config(c.checkpoint) if warm == "checkpoint" else model_config(c)
    max_pos = model.max_position_embeddings
    try:  # a kind with images needs a model that reads them (ConfigError naming what to set)
        task_lib.image_patch_size(kinds, model.image_patch_dim)
    except ConfigError as e:
        where = f"the checkpoint {c.checkpoint}" if warm == "checkpoint" else "config.model"
        raise ConfigError(f"tasks {list(kinds)}: {e} ({where} has image_patch_dim={model.image_patch_dim})") from None
    ctx = c.rollout.max_context
    for key, limit in (("engine.max_seq_len", c.engine.max_seq_len), ("trainer.row_len", c.trainer.row_len),
                       ("the model's max_position_embeddings", max_pos)):
        if ctx > limit:
            raise ConfigError(f"rollout.max_context={ctx} exceeds {key}={limit}: a trajectory that long "
                              f"could not be {'generated' if 'engine' in key else 'trained' if 'row' in key else 'encoded'}; "
                              f"lower rollout.max_context or raise {key}")
    if c.rollout.max_new_tokens >= ctx:
        raise ConfigError(f"rollout.max_new_tokens={c.rollout.max_new_tokens} must be below "
                          f"rollout.max_context={ctx} (a prompt needs room too)")
    if c.engine.max_seq_len % c.engine.page_size:
        raise ConfigError(f"engine.max_seq_len={c.engine.max_seq_len} must be a multiple of "
                          f"engine.page_size={c.engine.page_size}")
    ctl = c.controller
    if ctl.mode != "sync":
        if num_devices is None:
            import jax
            num_devices = len(jax.devices())
        groups = ctl.rollout_groups + ctl.ref_groups + ctl.train_groups
        if ctl.device_group_size < 1 or groups * ctl.device_group_size != num_devices:
            raise ConfigError(
                f"controller: ({ctl.rollout_groups} rollout + {ctl.ref_groups} ref + {ctl.train_groups} train) "
                f"groups x device_group_size {ctl.device_group_size} = {groups * ctl.device_group_size} devices, "
                f"but there are {num_devices}")
    rl_configs(c)  # the typed sections' own checks


def apply_platform_settings(c: ConfigDict) -> None:
    """Settings that must reach JAX before its first use (call at the top of `main`)."""
    import os

    import jax

    if c.cpu_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", int(c.cpu_devices))


def build_tokenizer(cfg):
    """The tokenizer of a config: `tokenizer.path`, else the checkpoint's tokenizer.json, else the
    built-in byte tokenizer. ConfigError on a missing or malformed file."""
    import os

    from tiderl_jax.model.tokenizer import Tokenizer

    path = cfg.tokenizer.path
    if not path and cfg.checkpoint and os.path.exists(os.path.join(cfg.checkpoint, "tokenizer.json")):
        path = os.path.join(cfg.checkpoint, "tokenizer.json")  # the checkpoint's own
    return Tokenizer.from_file(path, eos_token=cfg.tokenizer.eos_token) if path else Tokenizer.builtin()


def build(cfg):
    """(mesh, rules, tokenizer, model) from a config; raises ConfigError on bad input."""
    from flax import nnx

    from tiderl_jax.model.decoder import Decoder
    from tiderl_jax.model.hf_io import load_hf_checkpoint
    from tiderl_jax.model.sharding import init_sharded, make_mesh

    rules = sharding_rules(cfg)
    mesh = make_mesh(cfg.mesh)
    tokenizer = build_tokenizer(cfg)
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
