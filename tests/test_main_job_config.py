"""The main job's configuration checks: every one runs before a model is built, and every bad input ends
the job with status 2 and one line naming the key or file (no traceback)."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ROOT
from ml_collections import ConfigDict

from tiderl_jax import config as config_lib
from tiderl_jax.model.config import ConfigError


def _config(**overrides):
    spec = importlib.util.spec_from_file_location("tiny_agentic", ROOT / "configs" / "tiny_agentic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    with c.unlocked():
        c.checkpoint = str(ROOT / c.checkpoint)
        for key, value in overrides.items():
            node = c
            *path, last = key.split(".")
            for part in path:
                node = node[part]
            node[last] = value
    return c


def _error(**overrides) -> str:
    with pytest.raises(ConfigError) as e:
        c = _config(**overrides)
        config_lib.check_main_job(c, num_devices=c.cpu_devices)
    return str(e.value)


def test_the_default_config_passes_and_every_section_option_is_settable():
    c = _config()
    config_lib.check_main_job(c, num_devices=c.cpu_devices)
    controller, trainer, engine, rollout, warm = config_lib.rl_configs(_config(**{
        "engine.prefill_policy": "ppas", "controller.env_workers": True, "controller.engine_workers": False,
        "rollout.readiness_aware": True, "rollout.weights.is_active": 5.0, "trainer.b2": 0.99,
        "loss.kl_coef": 0.01}))
    assert engine.prefill_policy == "ppas" and controller.env_workers and rollout.readiness_aware
    assert rollout.weights.is_active == 5.0 and trainer.b2 == 0.99 and trainer.loss.kl_coef == 0.01
    assert warm.learning_rate == c.sft.learning_rate


def _parsed(*args, path="configs/tiny_agentic.py"):
    """The config as a launch script reads it from its command line (`define_config_flag`)."""
    from absl import flags
    values = flags.FlagValues()
    argv = ["launch/train.py", f"--config={path}", *args]
    holder = config_lib.define_config_flag(path, flag_values=values, argv=argv)
    values(argv)
    return holder.value


def _tuple_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, ConfigDict):
            yield from _tuple_keys(value, f"{prefix}{key}.")
        elif isinstance(value, tuple):
            yield f"{prefix}{key}", value


def _get(config, key):
    for part in key.split("."):
        config = config[part]
    return config


def test_every_tuple_valued_key_takes_a_comma_list(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert _parsed("--config.tasks=calculator,lookup").tasks == ("calculator", "lookup")
    assert _parsed("--config.tasks=lookup").tasks == ("lookup",)
    assert _parsed("--config.tasks= calculator , lookup").tasks == ("calculator", "lookup")
    as_lists = set()
    for path in sorted((ROOT / "configs").glob("*.py")):
        file = f"configs/{path.name}"
        for key, value in _tuple_keys(_parsed(path=file)):
            if value and all(isinstance(v, (int, float, str)) for v in value):  # given as a comma list
                text = ",".join(map(str, value))
                as_lists.add(key)
            else:  # nested (sharding_rules) or empty: a Python literal
                text = repr(value)
            assert _get(_parsed(f"--config.{key}={text}", path=file), key) == value, (file, key, text)
    assert {"tasks", "sizes", "modes"} <= as_lists  # ints stay ints (sizes), strings strings
    assert config_lib.parse_tuple("32, 1024") == (32, 1024) and config_lib.parse_tuple("") == ()
    assert config_lib.parse_tuple("async@0.125,tiderl") == ("async@0.125", "tiderl")


def test_tasks_in_a_config_file_as_one_string_are_kinds():
    c = _config()
    with c.unlocked():
        del c["tasks"]
        c.tasks = "calculator, lookup"  # a config file's own get_config may say it so
    config_lib.check_main_job(c, num_devices=c.cpu_devices)
    assert tuple(c.tasks) == ("calculator", "lookup")
    assert "unknown kind(s) ['lokup']" in _error(tasks=("calculator", "lokup"))


@pytest.mark.parametrize("key, value, needle", [
    ("sft.learning_rate", 0.0, "sft.learning_rate=0.0 must be > 0"),
    ("trainer.learning_rate", -1.0, "trainer.learning_rate=-1.0 must be > 0"),
    ("trainer.micro_rows", 0, "trainer.micro_rows=0 must be >= 1"),
    ("rollout.temperature", 0.0, "rollout.temperature=0.0 must be > 0"),
    ("loss.clip_low", 1.5, "loss.clip_low=1.5 must be in [0, 1)"),
    ("rollout.footprint_horizon", "step", "rollout.footprint_horizon 'step'"),
])
def test_errors_name_the_key_the_user_sets(key, value, needle):
    assert needle in _error(**{key: value})


def test_tasks_are_named_as_the_user_sets_them_in_the_typed_configs():
    c = _config(tasks=("calculator", "nope"))
    with pytest.raises(ConfigError) as e:
        config_lib.rl_configs(c)  # without check_main_job's own check first
    message = str(e.value)
    assert message.startswith("tasks=('calculator', 'nope') must be non-empty") and "task_kinds" not in message


@pytest.mark.parametrize("found, requested, chosen", [
    (["cpu"], "", "cpu"), (["gpu", "cpu"], "", "gpu"), (["tpu", "cpu"], "", "tpu"),
    (["gpu", "cpu"], "cpu", "cpu"), (["gpu", "cpu"], "cuda", "gpu"), (["cpu", "gpu"], "rocm,cpu", "gpu"),
])
def test_the_platform_is_the_accelerator_when_there_is_one(found, requested, chosen):
    assert config_lib.choose_platform(found, requested) == chosen


def test_a_requested_platform_that_is_missing_is_named_with_its_install_line():
    with pytest.raises(ConfigError) as e:
        config_lib.choose_platform(["cpu"], "cuda")
    assert "JAX_PLATFORMS=cuda" in str(e.value) and 'jax[cuda12]' in str(e.value) and "['cpu']" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_lib.choose_platform(["cpu"], "tpu")
    assert 'jax[tpu]' in str(e.value)


@pytest.mark.parametrize("key, value, needle", [
    ("engine.page_size", 0, "engine.page_size=0 must be >= 1"),
    ("sft.steps", 0, "sft.steps=0 must be >= 1"),
    ("eval.tasks", -1, "eval.tasks=-1 must be >= 1"),
    ("eval.every", -1, "eval.every=-1 must be >= 0 (0: no held-out evaluation during RL)"),
    ("eval.during_tasks", 0, "eval.during_tasks=0 must be >= 1 and <= eval.tasks=128"),
    ("eval.during_tasks", 129, "eval.during_tasks=129 must be >= 1 and <= eval.tasks=128"),
    ("trainer.row_len", 512, "rollout.max_context=1024 exceeds trainer.row_len=512"),
    ("engine.max_seq_len", 512, "rollout.max_context=1024 exceeds engine.max_seq_len=512"),
    ("model.max_position_embeddings", 256, "exceeds the model's max_position_embeddings=256"),
    ("rollout.max_new_tokens", 2048, "rollout.max_new_tokens=2048 must be below rollout.max_context=1024"),
    ("controller.rollout_groups", 3, "= 5 devices, but there are 4"),
    ("controller.mode", "sync", "controller.eta=1 with mode 'sync': synchronous training has no staleness"),
    ("warm_start", "pretrained", "warm_start='pretrained' is not one of"),
    ("checkpoint", "/nonexistent/ckpt", "checkpoint='/nonexistent/ckpt': no such directory"),
    ("controller.mode", "fast", "controller.mode='fast' is not one of"),
    ("engine.prefill_policy", "greedy", "prefill_policy='greedy'"),
    ("trainer.shared_prompt", "always", "shared_prompt='always' is not one of"),
])
def test_bad_values_are_named(key, value, needle):
    overrides = {key: value}
    if key == "model.max_position_embeddings":
        overrides["warm_start"] = "scratch"  # the config's model (the checkpoint's has its own)
    assert needle in _error(**overrides)


def test_the_visual_task_needs_a_vision_model():
    assert "image_patch_dim" in _error(tasks=("visual",))
    assert "image_patch_dim" in _error(tasks=("visual",), warm_start="scratch")


def _train(*args, timeout=120):
    return subprocess.run([sys.executable, "launch/train.py", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == errors[0]  # nothing after it (a multi-line dump)
    assert "Traceback" not in r.stderr


def test_entry_point_errors_exit_2_with_one_line(tmp_path):
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.engine.page_size=0"), "engine.page_size=0")
    _one_line_error(_train("--config=configs/nope.py"), "configs/nope.py")
    _one_line_error(_train("--config=configs/nope.py", "--config.controller.steps=2"), "configs/nope.py")
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.rollout.max_context=192",
                           "--config.rollout.max_new_tokens=64"), "prompt")


def test_a_checkpoint_that_does_not_match_the_model_is_refused_by_name(tmp_path):
    import jax.numpy as jnp

    from tiderl_jax.rl.checkpoint import Checkpointer
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)  # another model's arrays under the run's names
    ckpt.save(0, {"params": {"w": jnp.zeros((3, 5))}, "opt_state": {"m": jnp.zeros(2)}, "ref": {"w": jnp.zeros(3)}}, {})
    ckpt.close()
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.controller.steps=2"), "cannot restore step 0")


def test_a_bad_value_for_a_key_is_one_line_naming_it(tmp_path):
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.controller.steps=ten"),
                    "--config.controller.steps=ten: int expected")
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.eval.tasks=16"),
                    "eval.during_tasks=32 must be >= 1 and <= eval.tasks=16")
    c = _config(**{"eval.tasks": 16, "eval.every": 0})
    assert (config_lib.check_main_job(c, num_devices=c.cpu_devices)
            is None)  # no evaluation during RL: eval.during_tasks is not used
    with pytest.raises(ConfigError, match=r"sft.shortcut_rate=1.5 must be in \[0, 1\]"):
        config_lib.check_main_job(_config(**{"sft.shortcut_rate": 1.5}), num_devices=c.cpu_devices)
    assert config_lib.rl_configs(_config(**{"sft.lr_schedule": "constant"}))[4].lr_schedule == "constant"
    assert config_lib.rl_configs(_config())[4].lr_schedule == "cosine"  # the warm start's default
    with pytest.raises(ConfigError, match="sft.lr_schedule='steady' is not one of"):
        config_lib.rl_configs(_config(**{"sft.lr_schedule": "steady"}))
    _one_line_error(_train(f"--config.logdir={tmp_path}", "--config.tasks=calculator,lokup"),
                    "tasks: unknown kind(s) ['lokup']")


# ------------------------------------------------------------------ a log directory that holds a run

RUN = ["--config.controller.steps=3", "--config.eval.tasks=4", "--config.eval.during_tasks=2"]


def _finished_run(logdir, monkeypatch):
    """A log directory as a finished run of `RUN` leaves it (the state train.py reads, its outputs)."""
    from tiderl_jax.run_state import RunState

    monkeypatch.chdir(ROOT)
    cfg = _parsed(f"--config.logdir={logdir}", *RUN)
    config_lib.check_main_job(cfg, num_devices=cfg.cpu_devices)
    heldout = {name: {"task_ids": list("abcd"), "kinds": ["calculator", "lookup"] * 2, "rewards": [1.0, 0, 0, 0],
                      "turns": [1] * 4, "end_reasons": ["answered"] * 4} for name in ("greedy", "sampled")}
    outputs = {"summary.json": b'{"steps": 3}', "timeline.png": b"png 1", "learning.png": b"png 2"}
    for name, data in outputs.items():
        (logdir / name).write_bytes(data)
    RunState(str(logdir), cfg.to_dict()).save(heldout_before=heldout, rl_summary={"steps": 3}, heldout_after=heldout,
                                              finished={"steps": 3, "summary": str(logdir / "summary.json")})
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in logdir.iterdir()}


def test_a_finished_run_says_so_and_overwrites_nothing(tmp_path, monkeypatch):
    files = _finished_run(tmp_path, monkeypatch)
    for steps in ("3", "2"):  # the same command, or a smaller budget: nothing to do
        r = _train(f"--config.logdir={tmp_path}", *RUN, f"--config.controller.steps={steps}")
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"{tmp_path} holds a finished run (3 RL steps" in r.stdout
        assert "nothing was run or overwritten" in r.stdout
        assert f"its summary is {tmp_path / 'summary.json'}" in r.stdout and "above 3" in r.stdout
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == files


def test_another_configuration_in_a_run_directory_is_refused_naming_every_key(tmp_path, monkeypatch):
    files = _finished_run(tmp_path, monkeypatch)
    r = _train(f"--config.logdir={tmp_path}", *RUN, "--config.controller.mode=sync", "--config.controller.eta=0",
               "--config.controller.group_size=4", "--config.tasks=lookup", "--config.eval.tasks=8")
    _one_line_error(r, "holds a run of another configuration (controller.eta: 1 -> 0, controller.group_size: 8 -> 4, "
                       "controller.mode: "
                       "'tiderl' -> 'sync', eval.tasks: 4 -> 8, tasks: ('calculator', 'lookup') -> ('lookup',))")
    assert "another --config.logdir" in r.stderr and f"deleting {tmp_path}" in r.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == files


def test_a_raised_step_budget_continues_a_finished_run(tmp_path, monkeypatch):
    import json

    _finished_run(tmp_path, monkeypatch)
    proc = subprocess.Popen([sys.executable, "launch/train.py", f"--config.logdir={tmp_path}", *RUN,
                             "--config.controller.steps=5"], cwd=ROOT, env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # it goes on to build the model: stop it there (SIGKILL: a SIGINT this early was
        seen.append(line)       # once not acted on and the run went to its end; what is checked is on disk by now)
        if "continuing the finished run" in line:
            proc.kill()
            break
    proc.communicate(timeout=120)
    out = "".join(seen)
    assert f"continuing the finished run in {tmp_path} from 3 to 5 RL steps" in out, out[-2000:]
    assert (tmp_path / "summary.3_steps.json").read_bytes() == b'{"steps": 3}'
    assert not (tmp_path / "summary.json").exists()
    state = json.loads((tmp_path / "run_state.json").read_text())
    assert "finished" not in state and "heldout_after" not in state and "heldout_before" in state
    assert json.loads((tmp_path / "config.json").read_text())["controller"]["steps"] == 5


def test_a_config_that_does_not_fit_the_devices_memory_is_refused_naming_the_keys():
    """On a GPU or TPU the main job checks its train step and a rollout replica against the device's memory
    before loading weights (runtime/memory.py; on the CPU only with a limit given, as here)."""
    import numpy as np

    from tiderl_jax.runtime import memory

    c = config_lib.load_config_file(str(ROOT / "configs" / "tiny_agentic.py"))
    controller, trainer, engine, _, _ = config_lib.rl_configs(c)
    model, rules = config_lib.model_config(c), config_lib.sharding_rules(c)
    train = memory.train_step_bytes(model, trainer, controller, rules)
    kv, weights = memory.engine_bytes(model, engine, controller, rules)
    assert controller.device_group_size == 1  # a replica on one device: its pool and weights whole
    assert kv == 2 * model.num_layers * engine.num_pages * model.num_kv_heads * engine.page_size * model.head_dim * \
        np.dtype(model.dtype).itemsize
    assert weights == np.dtype(model.param_dtype).itemsize * model.num_params
    assert train > 3 * weights  # the weights, their gradient and both Adam moments at least
    memory.check_fits(c, "cpu", limit=max(train, kv + weights) + 1)  # fits: nothing raised
    memory.check_fits(c, "cpu")  # the CPU: not checked
    with pytest.raises(ConfigError, match=r"the train step needs .* set trainer.remat=full, lower trainer.micro_rows"):
        memory.check_fits(c, "cpu", limit=train - 1)
    c.engine.num_pages = engine.num_pages * (train // kv + 2)  # a pool larger than the train step
    kv, weights = memory.engine_bytes(model, config_lib.rl_configs(c)[2], controller, rules)
    with pytest.raises(ConfigError, match=r"a rollout replica needs .* lower engine.num_pages"):
        memory.check_fits(c, "cpu", limit=kv + weights - 1)


def test_a_deep_models_train_step_plan_is_the_line_through_two_shallow_compiles():
    """runtime/memory.py plans a deep model's update from compiles at 4 and 8 layers (a whole-depth compile takes
    minutes on a CPU): on a 12-layer model the line's value is the whole compile's, within 2%."""
    import dataclasses

    from tiderl_jax.runtime import memory

    c = config_lib.load_config_file(str(ROOT / "configs" / "tiny_agentic.py"))
    controller, trainer, _, _, _ = config_lib.rl_configs(c)
    model = dataclasses.replace(config_lib.model_config(c), num_layers=12)
    trainer = dataclasses.replace(trainer, row_len=256, micro_rows=2)
    rules = config_lib.sharding_rules(c)
    line = memory.train_step_bytes(model, trainer, controller, rules)
    whole = memory.train_step_bytes(model, trainer, controller, rules, exact=True)
    assert abs(line - whole) <= 0.02 * whole, (line, whole)
