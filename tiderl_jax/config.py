"""The configuration skeleton every `configs/*.py` file fills in, and its typed readers.

Configs are ml_collections ConfigDicts, read once at the entry point (`launch/`) and passed down as
typed values (`ModelConfig`, a mesh, a rule table). The skeleton is locked by the flag machinery, so
`--config.model.bogus=1` is an error; `model_config` also refuses keys a config file adds that
`ModelConfig` does not know.
"""

from __future__ import annotations

from typing import Sequence

from ml_collections import ConfigDict

from tiderl_jax.model.config import ConfigError, ModelConfig

# The model code (JAX, Flax) is imported where it is used, so that entry points without a model
# (launch/simulate.py) start without it.


def base_config() -> ConfigDict:
    from tiderl_jax.model.sharding import DEFAULT_RULES

    c = ConfigDict()
    c.seed = 0
    # CPU only: how many devices to fake on the host platform (0: leave JAX's default). Applied
    # before JAX starts (`apply_platform_settings`); the run uses a GPU / TPU instead when JAX finds
    # one. XLA_FLAGS=--xla_force_host_platform_device_count wins.
    c.cpu_devices = 0
    # HF checkpoint directory (config.json + safetensors); empty: random initialisation from `model`.
    c.checkpoint = ""
    # every field at its default; the ones off by default (`rope_scaling`, `image_token_id`) typed placeholders
    # (`section`), so that `--config.model.rope_scaling="{'factor': 8.0}"` can set them
    c.model = section(ModelConfig)
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


# The `data` section: a dataset of the user's instead of the built-in tasks (tiderl_jax/data/, docs/data.md)
DATA_DEFAULTS = {
    "train_files": "",  # one path or a comma list (.jsonl, .jsonl.gz, .parquet, reasoning_gym:NAME, ...); "": built-in tasks
    "heldout_files": "",  # the same; "": eval.tasks rows of the train files are held out (not trained on)
    "prompt_key": "",  # dotted key of the prompt; "": prompt, else messages
    "answer_key": "",  # dotted key of the answer; "": reward_model.ground_truth, answer, label
    "reward_fn": "auto",  # "module:function" / "file.py:function" (veRL's compute_score), or math, code, auto, ...
    "env": "",  # "module:Class" of a multi-turn environment; "": single-turn, the first reply is scored
    "reward_timeout_s": 10.0,
    "shuffle": True,  # a seeded permutation per epoch (False: file order)
    "system_prompt": "",  # the rollout's system message for dataset tasks; "": the project's tool-use prompt
}


# The `mixture` section: workload classes mixed by the target the trainer asks for (tiderl_jax/data/mixture.py,
# docs/data.md "Workload mixture"). Each class: its built-in task kinds ("" for agentic: config.tasks) and turn
# limits (0: the rollout's). The built-in streams give each class its shape (turns, output lengths); the rewards
# are the tasks' own (exact answers, the code's tests).
MIXTURE_DEFAULTS = {
    "target": "",  # e.g. "agentic=48.6,rlvr=33.1,rlhf=18.2" (the MISA-T paper's); "": config.tasks in turn
    "agentic": {"kinds": "", "max_turns": 0, "max_new_tokens": 0},  # multi-turn, tool gaps
    "rlvr": {"kinds": "python", "max_turns": 1, "max_new_tokens": 0},  # single turn, long outputs, verified
    "rlhf": {"kinds": "calculator", "max_turns": 1, "max_new_tokens": 0},  # single turn, medium outputs, a rule
}


def main_job_sections(c: ConfigDict, *, logdir: str) -> ConfigDict:
    """Every section `launch/train.py` reads, each key at its default, added to a model preset's config `c`
    (a preset then sets what it needs: `configs/tiny_agentic.py`, `configs/qwen2_5_0_5b.py`, ...). Each
    controller / engine / rollout / trainer / loss option is the typed config's field (`section`), so every
    one can be set with `--config.<section>.<key>=v`."""
    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.engine.engine import EngineConfig
    from tiderl_jax.rl.losses import LossConfig
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller_config import ControllerConfig

    c.logdir = logdir
    c.tasks = ("calculator", "lookup")  # the built-in task kinds (unused when data.train_files is set)
    # "checkpoint": RL starts from config.checkpoint (an HF directory or a .gguf file); "scratch": random
    # weights and the supervised warm start first (launch/sft.py's rule; the built-in tasks only)
    c.warm_start = "checkpoint"
    c.latency = ConfigDict({"median_s": 0.3, "sigma": 1.0, "max_s": 5.0})  # the built-in tools' waiting
    # the warm start stops once the sampled policy solves `target` of the probe tasks, probed every
    # `probe_every` steps from `min_steps` on; `steps` is the cap (and the learning-rate schedule's length)
    c.sft = ConfigDict({"steps": 1200, "batch_size": 32, "learning_rate": 3e-3, "row_len": 576,
                        "log_every": 25, "target": 0.2, "min_steps": 150, "probe_every": 25, "probe_tasks": 16,
                        "probe_samples": 4, "shortcut_rate": 0.0, "lr_schedule": "cosine"})
    # sft.shortcut_rate: the share of the calculator and lookup demonstrations in which the demonstrator skips its
    # last tool call (an imperfect demonstrator: tasks.demonstration, rl/sft.py's takes_shortcut); sft.lr_schedule:
    # the warm start's (trainer.lr_schedule's values; "constant" for a further stage, launch/sft.py --init)
    # held-out evaluation before and after RL: `tasks` held-out tasks (the kinds in turn, or the data's held-out
    # rows), greedy and (`sampled`) at the rollout temperature; during RL, every `every` updates (0: never), the
    # first `during_tasks` of them, greedy, on the latest weights (metrics.jsonl's eval_* keys, TensorBoard eval/,
    # reward_curve.png)
    c.eval = ConfigDict({"tasks": 128, "every": 4, "during_tasks": 32, "sampled": True})
    # the trained policy is exported in HF format to logdir/hf_export/ at the end; True also exports it at
    # every RL checkpoint (controller.checkpoint_every), to logdir/hf_export_steps/step_N/
    c.export_every_checkpoint = False
    c.data = ConfigDict(DATA_DEFAULTS)
    c.mixture = ConfigDict(MIXTURE_DEFAULTS)
    c.controller = section(ControllerConfig, exclude=("task_kinds", "mixture_target"))  # from tasks, mixture
    c.engine = section(EngineConfig)
    c.rollout = section(RolloutConfig, exclude=("mode", "kv_budget_tokens"))
    c.trainer = section(TrainerConfig, exclude=("loss", "total_steps", "temperature"))
    c.loss = section(LossConfig)
    return c


def one_gpu_host(c: ConfigDict, *, tensor: int, context: int) -> ConfigDict:
    """The real-model presets' main-job sizes for one 8-GPU host: TideRL with device groups of 2 (rollout 2,
    train 2), `tensor` parallelism within a group, contexts of `context` tokens."""
    c.controller.update(mode="tiderl", steps=200, groups_per_step=32, group_size=8, max_concurrent=512,
                        device_group_size=2, rollout_groups=2, ref_groups=0, train_groups=2, tensor=tensor,
                        checkpoint_every=20, filter_groups=True)
    c.engine.update(page_size=16, num_pages=16384, max_seq_len=context, max_running=256, prefill_chunk=1024,
                    prefill_budget=8192, decode_steps=8)
    c.rollout.update(max_turns=8, max_new_tokens=512, max_context=context, temperature=1.0)
    c.trainer.update(learning_rate=1e-6, warmup_steps=10, row_len=context, micro_rows=4, grad_clip=1.0,
                     weight_decay=0.0)
    c.loss.update(advantage_estimator="grpo", kl_coef=0.0, clip_low=0.2, clip_high=0.28)
    c.eval.update(tasks=256, every=20, during_tasks=64)
    return c


def model_config(c: ConfigDict) -> ModelConfig:
    return ModelConfig.from_dict(c.model.to_dict(), source="config.model")


def sharding_rules(c: ConfigDict):
    from tiderl_jax.model.sharding import rules_from_config

    return rules_from_config(c.sharding_rules)


def parse_tuple(text: str) -> tuple:
    """A tuple-valued key's command-line value: a comma list (`calculator,lookup` -> ('calculator',
    'lookup'); `32,1024` -> (32, 1024): each item a number, bool or None when it reads as one, else the
    text), or a Python tuple / list literal (`"(('batch', ('data', 'fsdp')),)"`, for nested values).
    One item is a one-item tuple; an empty value the empty tuple. ValueError for a malformed literal."""
    import ast

    s = text.strip()
    if s[:1] and s[:1] in "([":
        try:
            value = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            raise ValueError(f"{text!r} is not a Python tuple literal; give a comma list, e.g. a,b") from None
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return tuple(_scalar(item.strip()) for item in s.split(",") if item.strip())


def _scalar(item: str):
    import ast

    try:
        value = ast.literal_eval(item)
    except (ValueError, SyntaxError):
        return item
    return value if isinstance(value, (int, float, str, type(None))) else item


def _value_parsers() -> dict:
    """The parser of an override's value per the key's type (ml_collections' own for the scalars)."""
    from absl import flags
    from ml_collections.config_flags import tuple_parser

    class CommaTupleParser(tuple_parser.TupleParser):  # a TupleParser: ml_collections' multi-flag handling
        def parse(self, argument):
            return parse_tuple(argument) if isinstance(argument, str) else super().parse(argument)

    return {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser(),
            tuple: CommaTupleParser()}


def check_overrides(argv: list[str], default_path: str, flag: str = "config") -> None:
    """Refuses `--config.a.b=v` overrides whose key does not exist, naming the key and the choices, and
    values the key's type does not take (`--config.controller.steps=ten`), naming the key and the value.

    ml_collections also refuses them, but with a bare `AttributeError: 'b'` or a two-line flags error;
    this runs first, before flag parsing, so the user sees which key and what the valid keys at that
    level are.
    """
    path = default_path
    overrides = []
    for arg in argv[1:]:
        if arg.startswith(f"--{flag}="):
            path = arg.split("=", 1)[1]
        elif arg.startswith(f"--{flag}."):
            key, eq, value = arg[len(flag) + 3:].partition("=")
            overrides.append((key, value if eq else None))
    if not overrides:
        load_config_file(path, flag, run=False)  # it must exist
        return
    config = load_config_file(path, flag)
    parsers = _value_parsers()
    for key, value in overrides:
        node, walked, kind = config, [], None
        for part in key.split("."):
            where = ".".join([flag] + walked)
            if node is None:  # a placeholder block not yet set (`section`): it is set as a whole
                raise ConfigError(f"--{flag}.{key}: {where} is unset (None); set it whole, e.g. "
                                  f"--{where}=\"{{'{part}': ...}}\"")
            if not isinstance(node, ConfigDict) or part not in node:
                known = sorted(node.keys()) if isinstance(node, ConfigDict) else []
                raise ConfigError(f"--{flag}.{key}: {where} has no key {part!r}; known keys: {known}")
            kind = node.get_type(part)  # a placeholder's declared type, not its None
            node = node[part]
            walked.append(part)
        parser = parsers.get(kind)
        if value is not None and parser is not None:
            try:
                parser.parse(value)
            except ValueError as e:
                raise ConfigError(f"--{flag}.{key}={value}: {kind.__name__} expected ({e})") from None


def load_config_file(path: str, flag: str = "config", *, run: bool = True) -> ConfigDict | None:
    """The ConfigDict a config file's `get_config()` returns, before any override (`path` as `--config=`
    takes it: `file.py` or `file.py:arg`); with `run=False` only checks the file exists. ConfigError naming
    `--{flag}=path` when it does not, or when loading it fails."""
    import importlib.util
    import os

    file, colon, arg = path.partition(":")
    if not os.path.isfile(file):
        raise ConfigError(f"--{flag}={path}: no such config file")
    if not run:
        return None
    spec = importlib.util.spec_from_file_location("_config_under_check", file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--{flag}={path}: not a Python config file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.get_config(arg) if colon else module.get_config()
    except Exception as e:  # noqa: BLE001 - the user's config file: name it, no traceback
        raise ConfigError(f"--{flag}={path}: loading it failed: {type(e).__name__}: {e}") from None


def define_config_flag(default_path: str, flag: str = "config", *, flag_values=None, argv=None):
    """`config_flags.DEFINE_config_file` for a launch script, with overrides checked first, and the one
    place command-line values are read: a tuple-valued key takes a comma list (`parse_tuple`).

    The flag machinery applies `--config.*` overrides while the flags are parsed, so the check runs
    here, on `argv` (default: sys.argv); a bad key or value ends the program with exit status 2 and one
    clear line.
    """
    import sys

    from absl import flags
    from ml_collections import config_flags

    config_flags.register_flag_parser_for_type(tuple, _value_parsers()[tuple])
    try:
        check_overrides(sys.argv if argv is None else argv, default_path, flag)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return config_flags.DEFINE_config_file(flag, default_path, "Path to an ml_collections config file.",
                                           flag_values=flags.FLAGS if flag_values is None else flag_values,
                                           lock_config=True, sys_argv=argv)  # None: sys.argv


def rl_configs(c: ConfigDict):
    """The main job's typed configs from a ConfigDict (configs/tiny_agentic.py's sections):
    (controller, trainer, engine, rollout, warm-start trainer). ConfigError names a bad key or value as
    the user sets it (`tasks`, `sft.learning_rate`), not as the typed config calls it."""
    import dataclasses

    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.engine.engine import EngineConfig
    from tiderl_jax.rl.losses import LossConfig, from_config_dict
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller import ControllerConfig

    def typed(section, cls, build, renames=None):
        try:
            return build()
        except ValueError as e:  # a refused value (ConfigError is one)
            raise ConfigError(_user_keys(str(e), section, cls, renames or {})) from None
        except TypeError as e:  # an unknown key in a section (a config file's)
            raise ConfigError(f"{section}: {e}") from None

    # config.seed is the run's seed: the train-task stream and the sampling seeds are offset by it
    ctl = c.controller.to_dict()
    controller = typed("controller", ControllerConfig, lambda: ControllerConfig(
        **{**ctl, "task_kinds": _kinds(c), "data_seed": ctl.get("data_seed", 0) + c.get("seed", 0),
           "mixture_target": c.get("mixture", {}).get("target", "")}),
        {"task_kinds": "tasks"})
    loss = typed("loss", LossConfig, lambda: from_config_dict(c.loss))
    values = c.trainer.to_dict()  # a run shorter than the warmup warms up over all but its last step
    total = max(controller.steps, 2)
    values["warmup_steps"] = min(values.get("warmup_steps", 0), total - 1)
    derived = {"total_steps": "controller.steps", "temperature": "rollout.temperature",
               **{f.name: f"loss.{f.name}" for f in dataclasses.fields(LossConfig)}}
    trainer = typed("trainer", TrainerConfig, lambda: TrainerConfig(
        loss=loss, total_steps=total, temperature=c.rollout.temperature, **values), derived)
    engine = typed("engine", EngineConfig, lambda: EngineConfig(**c.engine.to_dict()))

    def rollout_config():
        values = c.rollout.to_dict()
        if isinstance(values.get("weights"), dict):
            from tiderl_jax.policies.ctb import CTBWeights
            values["weights"] = CTBWeights(**values["weights"])
        values["seed"] = values.get("seed", 0) + c.get("seed", 0)
        return RolloutConfig(**values)
    rollout = typed("rollout", RolloutConfig, rollout_config)
    warm = typed("trainer", TrainerConfig, lambda: dataclasses.replace(  # supervised: decays over its steps
        trainer, learning_rate=c.sft.learning_rate, row_len=c.sft.row_len, lr_schedule=c.sft.get("lr_schedule", "cosine"),
        warmup_steps=min(trainer.warmup_steps, max(c.sft.steps - 1, 0)), total_steps=max(c.sft.steps, 1)),
        {**derived, "learning_rate": "sft.learning_rate", "row_len": "sft.row_len", "total_steps": "sft.steps",
         "lr_schedule": "sft.lr_schedule"})
    return controller, trainer, engine, rollout, warm


def _user_keys(message: str, section: str, cls, renames: dict[str, str]) -> str:
    """A typed config's error with each field it names spelled as the key the user sets: `section.name`, or
    `renames[name]` for a field the main job derives from another key. A field is a name followed by `=`,
    prefixed with its section, or one with an underscore; other words (`mode`, `steps`) are left as prose."""
    import dataclasses
    import re

    names = {f.name for f in dataclasses.fields(cls)} | set(renames)
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    pattern = rf"(?<![\w.])({re.escape(section)}\.)?({alternatives})\b(=?)"

    def spell(m):
        prefixed, name, eq = m.groups()
        if not (prefixed or eq or "_" in name):
            return m.group(0)
        return renames.get(name, f"{section}.{name}") + eq
    return re.sub(pattern, spell, message)


WARM_STARTS = ("checkpoint", "scratch")


def section(cls, exclude: tuple[str, ...] = (), **values) -> ConfigDict:
    """A config section with every field of the dataclass `cls` (its defaults, then `values`), so each
    option can be set with `--config.<section>.<field>=v`; nested dataclasses become sub-sections, and a
    field whose default is None a placeholder of its annotated type (`placeholder`)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            default = ConfigDict(dataclasses.asdict(default))
        elif default is None:
            default = placeholder(cls, f.name)
        out[f.name] = default
    unknown = set(values) - set(out)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    out.update(values)
    return ConfigDict(out)


def placeholder(cls, name: str):
    """The config value of the dataclass field `cls.name` whose default is None ("off", "the mode's default"):
    an ml_collections placeholder (None, typed by the field's annotation) rather than a bare None, because a
    ConfigDict types a field by its value and the flag machinery refuses to override a NoneType field
    (`--config.loss.dual_clip=3` would be an error). `X | None` gives X; a dataclass (`RopeScaling`) a
    ConfigDict, set as a dict literal; any other annotation `object`, whose values are Python literals.
    A ConfigDict reads a placeholder as its value (None until set), and `to_dict()` gives that value."""
    import dataclasses
    import types
    import typing

    from ml_collections import config_dict

    try:
        hint = typing.get_type_hints(cls)[name]
    except (NameError, TypeError):  # an annotation that does not evaluate here
        hint = object
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
    kind = (typing.get_origin(kinds[0]) or kinds[0]) if len(kinds) == 1 else object  # tuple[int, ...]: tuple
    if dataclasses.is_dataclass(kind):
        kind = ConfigDict
    return config_dict.placeholder(kind if kind in (bool, int, float, str, tuple, ConfigDict) else object)


def _kinds(c: ConfigDict) -> tuple[str, ...]:
    """`tasks` as a tuple of kinds (a config file may give it as one comma-separated string)."""
    raw = parse_tuple(c.tasks) if isinstance(c.tasks, str) else c.tasks
    return tuple(str(k).strip() for k in raw if str(k).strip())


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

    kinds = _kinds(c)
    if not kinds:
        raise ConfigError("tasks is empty; give task kinds, e.g. --config.tasks=calculator,lookup")
    unknown = [k for k in kinds if k not in task_lib.GENERATORS]
    if unknown:
        raise ConfigError(f"tasks: unknown kind(s) {unknown}; known: {sorted(task_lib.GENERATORS)}")
    with c.unlocked():
        if isinstance(c.tasks, str):  # a config file's comma-separated string: the field becomes a tuple
            del c["tasks"]
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
    if not 0.0 <= c.sft.get("shortcut_rate", 0.0) <= 1.0:
        raise ConfigError(f"sft.shortcut_rate={c.sft.shortcut_rate} must be in [0, 1] (the share of demonstrations "
                          f"in which the demonstrator takes its shortcut)")
    evaluation = c.eval
    if evaluation.get("every", 0) < 0:
        raise ConfigError(f"eval.every={evaluation.every} must be >= 0 (0: no held-out evaluation during RL)")
    if evaluation.get("every", 0) and not 1 <= evaluation.get("during_tasks", 1) <= evaluation.tasks:
        raise ConfigError(f"eval.during_tasks={evaluation.during_tasks} must be >= 1 and <= eval.tasks="
                          f"{evaluation.tasks} (the evaluation during RL takes the first of the held-out tasks); "
                          f"set eval.during_tasks, or eval.every=0 for none during RL")
    warm = c.get("warm_start", "scratch")
    if warm not in WARM_STARTS:
        raise ConfigError(f"warm_start={warm!r} is not one of {WARM_STARTS}")
    if warm == "checkpoint":
        if not c.checkpoint:
            raise ConfigError("warm_start='checkpoint' needs config.checkpoint (an HF checkpoint directory or a "
                              ".gguf file); or set --config.warm_start=scratch")
        if not (os.path.isdir(c.checkpoint) or is_gguf(c.checkpoint)):
            raise ConfigError(f"checkpoint={c.checkpoint!r}: no such directory or .gguf file")
    data = c.get("data", None)
    if data is not None and data.get("train_files", ""):
        if warm == "scratch":
            raise ConfigError("warm_start='scratch' trains on the built-in tasks' demonstrations; with "
                              "data.train_files set, start from a checkpoint (--config.checkpoint=...)")
        if not data.get("reward_timeout_s", 1.0) > 0:
            raise ConfigError(f"data.reward_timeout_s={data.reward_timeout_s} must be > 0")
    _check_mixture(c, kinds)
    if warm == "scratch" and c.model.image_patch_dim > 0 and c.model.image_token_id is None:
        from tiderl_jax.model.tokenizer import IMAGE_TOKEN  # a vision model's image token: the tokenizer's
        with c.unlocked():
            c.model.image_token_id = build_tokenizer(c).token_id(IMAGE_TOKEN)
    model = checkpoint_config(c.checkpoint) if warm == "checkpoint" else model_config(c)
    max_pos = model.max_position_embeddings
    try:  # a kind with images needs a model that reads them (ConfigError naming what to set)
        task_lib.image_patch_size(kinds, model.image_patch_dim)
    except ConfigError as e:
        where = (f"the checkpoint {c.checkpoint} has image_patch_dim" if warm == "checkpoint"
                 else "model.image_patch_dim")
        raise ConfigError(f"tasks {list(kinds)}: {e} ({where}={model.image_patch_dim})") from None
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
                f"controller.rollout_groups={ctl.rollout_groups} + controller.ref_groups={ctl.ref_groups} + "
                f"controller.train_groups={ctl.train_groups} groups x controller.device_group_size="
                f"{ctl.device_group_size} = {groups * ctl.device_group_size} devices, but there are {num_devices}; "
                "change those keys to fit (docs/running.md), or on one device --config.controller.mode=sync "
                "--config.mesh.tensor=1")
    rl_configs(c)  # the typed sections' own checks


# JAX's platforms, accelerators first in the order a run prefers them; JAX_PLATFORMS's other names for them
PLATFORMS = ("tpu", "gpu", "cpu")
_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu"}


def choose_platform(found, requested: str = "") -> str:
    """The platform a run uses, from the platforms JAX found (`PLATFORMS`' names) and `requested` (the
    JAX_PLATFORMS variable: empty, or a comma list such as "cuda" or "cpu"): with nothing requested the
    first accelerator found (TPU, then GPU), else the CPU; with a request, its first platform JAX found.
    ConfigError, naming the variable and how to install JAX for it, when nothing usable was found."""
    wanted = [_PLATFORM_NAMES.get(p.strip(), p.strip()) for p in requested.split(",") if p.strip()]
    for platform in wanted or PLATFORMS:
        if platform in found:
            return platform
    install = {"gpu": ' (NVIDIA: pip install -U "jax[cuda12]")', "tpu": ' (pip install -U "jax[tpu]")'}
    if wanted:
        raise ConfigError(f"JAX_PLATFORMS={requested}: JAX found no {' or '.join(wanted)} device"
                          f"{''.join(install.get(p, '') for p in wanted)}; JAX found {list(found) or 'nothing'}; "
                          "unset JAX_PLATFORMS to use what there is")
    raise ConfigError("JAX found no device at all (not even the CPU); is jax installed?")


# XLA:CPU's memory-minimising scheduler in place of its concurrency-optimised default (with `trainer.remat`)
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def apply_platform_settings(c: ConfigDict) -> str:
    """The one place a launch script's platform is settled (call at the top of `main`, before any other
    use of JAX): the CPU default's faked device count (`cpu_devices`; the CPU only, and only unless
    XLA_FLAGS sets it), then `choose_platform` over what JAX found and JAX_PLATFORMS. JAX itself puts
    the accelerator first when one is there, so the run uses it; the Makefile no longer forces the CPU.
    Returns the platform ("tpu", "gpu" or "cpu"); ConfigError when a requested platform is missing."""
    import os

    import jax

    if c.get("cpu_devices", 0) and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", int(c.cpu_devices))
    trainer = c.get("trainer", None)
    if trainer is not None and trainer.get("remat", "none") != "none" and CPU_MEMORY_SCHEDULER.split("=")[0] \
            not in os.environ.get("XLA_FLAGS", ""):
        # XLA:CPU's default scheduler orders for concurrency and runs every layer's recomputation up front,
        # which keeps what rematerialisation frees (benchmarks/remat.py); the CPU's own flag, read when
        # its backend starts (below)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_MEMORY_SCHEDULER).strip()
    found, errors = [], []
    for platform in PLATFORMS:
        try:
            if jax.devices(platform):
                found.append(platform)
        except RuntimeError as e:  # not installed, not present, or it failed to start
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    try:
        platform = choose_platform(found, os.environ.get("JAX_PLATFORMS", ""))
    except ConfigError as e:
        raise ConfigError(f"{e} ({errors[0]})" if errors and not found else str(e)) from None
    if platform != jax.default_backend():  # JAX's own order is the same; say so if a plugin disagrees
        raise ConfigError(f"JAX's default platform is {jax.default_backend()}, but {platform} was chosen; "
                          f"set JAX_PLATFORMS={platform}")
    return platform


def build_tokenizer(cfg):
    """The tokenizer of a config: `tokenizer.path` (with `tokenizer.eos_token`), else the checkpoint's (a .gguf
    file's own: `gguf_io.read_gguf_tokenizer`; an HF directory's `Tokenizer.from_checkpoint` when it has a tokenizer_config.json: its special tokens and chat template,
    and the stop ids of its generation_config.json; a bare tokenizer.json with `tokenizer.eos_token`), else
    the built-in byte tokenizer. ConfigError on a missing or malformed file."""
    import os

    from tiderl_jax.model.tokenizer import Tokenizer

    path = cfg.tokenizer.path
    if path:
        return Tokenizer.from_file(path, eos_token=cfg.tokenizer.eos_token)
    if cfg.checkpoint and is_gguf(cfg.checkpoint):
        from tiderl_jax.model.gguf_io import open_gguf, read_gguf_tokenizer
        return read_gguf_tokenizer(open_gguf(cfg.checkpoint))  # with its template and stop ids
    if cfg.checkpoint and os.path.exists(os.path.join(cfg.checkpoint, "tokenizer.json")):
        if os.path.exists(os.path.join(cfg.checkpoint, "tokenizer_config.json")):
            return Tokenizer.from_checkpoint(cfg.checkpoint)  # with its template, special tokens and stop ids
        return Tokenizer.from_file(os.path.join(cfg.checkpoint, "tokenizer.json"), eos_token=cfg.tokenizer.eos_token)
    return Tokenizer.builtin()


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
    if cfg.checkpoint and is_gguf(cfg.checkpoint):  # dequantized onto the mesh
        from tiderl_jax.model.gguf_io import load_gguf_model, open_gguf, read_gguf_config
        reader = open_gguf(cfg.checkpoint)
        model = load_gguf_model(reader, read_gguf_config(reader, dtype=model_cfg.dtype,
                                                         param_dtype=model_cfg.param_dtype), mesh=mesh, rules=rules)
    elif cfg.checkpoint:  # the architecture comes from the checkpoint; config.model gives the dtypes
        model = load_hf_checkpoint(cfg.checkpoint, mesh=mesh, rules=rules, dtype=model_cfg.dtype,
                                   param_dtype=model_cfg.param_dtype)
    else:
        model = init_sharded(lambda: Decoder(model_cfg, rngs=nnx.Rngs(cfg.seed)), mesh, rules)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                          f"{model.cfg.vocab_size}; raise config.model.vocab_size")
    trainer = cfg.get("trainer", {})
    if trainer.get("lora_rank", 0):  # before anything copies the model: engines, trainer, reference share them
        from tiderl_jax.model.decoder import add_adapters
        from tiderl_jax.model.sharding import shard_model
        shard_model(add_adapters(model, int(trainer.lora_rank), float(trainer.lora_alpha),
                                 tuple(trainer.lora_targets), seed=cfg.seed), mesh, rules)
    return mesh, rules, tokenizer, model


def is_gguf(path: str) -> bool:
    """Whether a checkpoint path names a GGUF file (llama.cpp's format) rather than an HF directory."""
    import os

    return bool(path) and os.path.isfile(path) and path.endswith(".gguf")


def checkpoint_config(path: str) -> ModelConfig:
    """The architecture of a checkpoint: an HF directory's config.json or a GGUF file's metadata."""
    if is_gguf(path):
        from tiderl_jax.model.gguf_io import open_gguf, read_gguf_config
        return read_gguf_config(open_gguf(path))
    from tiderl_jax.model.hf_io import read_hf_config
    return read_hf_config(path)


def _mixture_classes(c: ConfigDict, kinds: Sequence[str]) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """{class: (kinds, max_turns, max_new_tokens)} of the classes with a target share (0: the rollout's)."""
    from tiderl_jax.data import mixture

    section = c.mixture
    try:
        target = mixture.parse_mixture(section.target)
    except ValueError as e:
        raise ConfigError(f"mixture.target: {e}") from None
    out = {}
    for cls, share in target.items():
        if share <= 0:
            continue
        spec = section.get(cls, None) or ConfigDict(MIXTURE_DEFAULTS[cls])
        out[cls] = (tuple(k.strip() for k in str(spec.get("kinds", "")).split(",") if k.strip()) or tuple(kinds),
                    int(spec.get("max_turns", 0)), int(spec.get("max_new_tokens", 0)))
    return out


def _check_mixture(c: ConfigDict, kinds: Sequence[str]) -> None:
    section = c.get("mixture", None)
    if section is None or not section.get("target", ""):
        return
    from tiderl_jax.agents import tasks as task_lib

    if c.get("data", None) is not None and c.data.get("train_files", ""):
        raise ConfigError("mixture.target mixes the built-in task streams; it cannot be combined with "
                          "data.train_files (unset one of them)")
    for cls, (class_kinds, turns, new) in _mixture_classes(c, kinds).items():
        unknown = [k for k in class_kinds if k not in task_lib.GENERATORS]
        if unknown:
            raise ConfigError(f"mixture.{cls}.kinds: unknown kind(s) {unknown}; known: {sorted(task_lib.GENERATORS)}")
        for key, v in (("max_turns", turns), ("max_new_tokens", new)):
            if v < 0:
                raise ConfigError(f"mixture.{cls}.{key}={v} must be >= 0 (0: the rollout's)")
        if new and new >= c.rollout.max_context:
            raise ConfigError(f"mixture.{cls}.max_new_tokens={new} leaves no room for a prompt in "
                              f"rollout.max_context={c.rollout.max_context}")


def build_mixture(cfg):
    """The train task stream of `mixture.target` (`data.mixture.MixedTasks` over the classes' built-in kinds, in
    turn within each class), or None when no target is set. Call after `check_main_job`."""
    section = cfg.get("mixture", None)
    if section is None or not section.get("target", ""):
        return None
    from tiderl_jax.agents import tasks as task_lib
    from tiderl_jax.data import mixture

    seed = cfg.controller.get("data_seed", 0)

    def stream(class_kinds):
        return lambda j: task_lib.make_task(class_kinds[j % len(class_kinds)], j // len(class_kinds), "train", seed)
    classes = {cls: mixture.ClassSpec(stream(k), max_turns=turns or None, max_new_tokens=new or None)
               for cls, (k, turns, new) in _mixture_classes(cfg, _kinds(cfg)).items()}
    return mixture.MixedTasks(classes, mixture.parse_mixture(section.target))


def build_data(cfg):
    """The `data` section's tasks (`tiderl_jax.data.env.build_data`), or None when it names no files (the
    built-in tasks). Without held-out files, `eval.tasks` rows of the train files are held out. A dataset or
    import path that cannot be used is a ConfigError naming the key."""
    data = cfg.get("data", None)
    if data is None or not (data.get("train_files", "") or data.get("heldout_files", "")):
        return None
    from tiderl_jax.data import datasets, env
    from tiderl_jax.import_path import ImportPathError

    try:
        return env.build_data(data, seed=cfg.get("seed", 0), holdout=cfg.eval.tasks)
    except datasets.DatasetError as e:
        raise ConfigError(f"data: {e}") from None
    except ImportPathError as e:
        raise ConfigError(f"data.reward_fn / data.env: {e}") from None
