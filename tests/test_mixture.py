"""Workload classes mixed by the trainer's target: the mixed stream follows the target in every prefix, its tasks
carry their class and limits, the rollout honours them, the main job's `mixture` section builds it and names
bad values."""

import asyncio
import collections

import pytest
from test_main_job_config import _config  # the main job's config (configs/tiny_agentic.py) with overrides

from tiderl_jax import config as config_lib
from tiderl_jax import run_report
from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import StepResult, Task
from tiderl_jax.agents.rollout import RolloutConfig, turn_limits, workload_class
from tiderl_jax.data import mixture
from tiderl_jax.model.config import ConfigError
from tiderl_jax.policies import misa_t
from tiderl_jax.runtime.controller_config import ControllerConfig

PAPER = "agentic=48.6,rlvr=33.1,rlhf=18.2"


def test_parse_mixture_normalises_and_names_bad_input():
    t = mixture.parse_mixture(PAPER)
    assert list(t) == ["agentic", "rlvr", "rlhf"] and abs(sum(t.values()) - 1) < 1e-12
    assert t == pytest.approx({"agentic": 48.6 / 99.9, "rlvr": 33.1 / 99.9, "rlhf": 18.2 / 99.9})
    assert mixture.parse_mixture({"rlvr": 1, "agentic": 3}) == {"rlvr": 0.25, "agentic": 0.75}
    for bad, needle in [("agentic=1,chat=2", "unknown workload class 'chat'"), ("agentic", "is not class=share"),
                        ("rlvr=x", "share 'x' of 'rlvr' is not a number"), ("rlvr=-1", "must be >= 0"),
                        ("rlvr=1,rlvr=2", "given twice"), ("rlvr=0", "positive share"), ("", "positive share")]:
        with pytest.raises(ValueError, match=needle):
            mixture.parse_mixture(bad)


@pytest.mark.parametrize("spec", [PAPER, "agentic=1,rlvr=1", "rlhf=1,rlvr=9", "agentic=0.3,rlvr=0.3,rlhf=0.4"])
def test_every_prefix_of_the_mixed_stream_follows_the_target(spec):
    target = mixture.parse_mixture(spec)
    counts = collections.Counter()
    for n, cls in enumerate(mixture.class_order(target, 500), start=1):
        counts[cls] += 1
        assert all(abs(counts[b] - share * n) < 1.0 for b, share in target.items()), (n, counts)
    assert misa_t.mixture_deviation(target, counts) < 0.01


def test_mixed_tasks_stamp_their_class_and_limits_deterministically():
    def spec(cls, **kw):
        return mixture.ClassSpec(lambda j: Task(f"{cls}-{j}", cls, "p", "a", {"keep": j}), **kw)
    mixed = mixture.MixedTasks({"agentic": spec("agentic"), "rlvr": spec("rlvr", max_turns=1, max_new_tokens=160),
                                "rlhf": spec("rlhf", max_turns=1)}, PAPER)
    tasks = [mixed(i) for i in range(40)]
    assert [t.data["workload_class"] for t in tasks] == mixture.class_order(mixed.target, 40)
    for cls in ("agentic", "rlvr", "rlhf"):  # each class's own stream, in order, no task skipped or repeated
        ids = [t.task_id for t in tasks if t.kind == cls]
        assert ids == [f"{cls}-{j}" for j in range(len(ids))]
    rlvr = next(t for t in tasks if t.kind == "rlvr")
    assert rlvr.data["max_turns"] == 1 and rlvr.data["max_new_tokens"] == 160 and "keep" in rlvr.data
    assert "max_turns" not in next(t for t in tasks if t.kind == "agentic").data
    again = mixture.MixedTasks(mixed.classes, PAPER)
    assert again(37) == tasks[37] and again.class_of(3) == mixed.class_of(3)  # by index, in any order
    with pytest.raises(ValueError, match=r"classes \['rlhf'\] have a target share but no task stream"):
        mixture.MixedTasks({"agentic": spec("agentic")}, "agentic=1,rlhf=1")
    with pytest.raises(ValueError, match="max_turns=0 must be an int >= 1"):
        mixture.ClassSpec(lambda j: None, max_turns=0)


def test_the_rollout_reads_a_task_s_own_limits_and_class():
    cfg = RolloutConfig(max_turns=8, max_new_tokens=64)
    plain = Task("t", "k", "p", "a")
    assert turn_limits(plain, cfg) == (8, 64) and workload_class(plain, cfg) == "agentic"
    single = Task("t", "k", "p", "a", {"max_turns": 1, "max_new_tokens": 200})
    assert turn_limits(single, cfg) == (1, 200) and workload_class(single, cfg) == "rlvr"
    assert workload_class(Task("t", "k", "p", "a", {"workload_class": "rlhf", "max_turns": 1}), cfg) == "rlhf"
    with pytest.raises(ValueError, match="max_turns=0"):
        turn_limits(Task("t", "k", "p", "a", {"max_turns": 0}), cfg)


class _Echo:  # answers every turn until the task's own max_turns (the rollout must stop there)
    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        return StepResult("more", 0.0, False, {})


def test_a_task_s_turn_limits_bound_its_rollout():
    from test_serving import _engine, TOK  # the tiny model on a faked device

    from tiderl_jax.agents.rollout import RolloutRunner
    runner = RolloutRunner(_engine(0), TOK, RolloutConfig(max_turns=4, max_new_tokens=8, temperature=0.0))
    tasks = [(Task("one", "k", "hi", "", {"max_turns": 1, "max_new_tokens": 5}), 0),
             (Task("two", "k", "hi", "", {"max_turns": 2, "max_new_tokens": 3}), 1),
             (Task("bad", "k", "hi", "", {"max_new_tokens": -1}), 2),
             (Task("dflt", "k", "hi", "", {}), 3)]
    trajs = asyncio.run(runner.run(tasks, lambda task: _Echo()))
    assert [len(t.turns) for t in trajs[:2]] == [1, 2] and trajs[3].end_reason == "max_turns"
    assert [t.turns[0].end - t.turns[0].start for t in trajs[:2]] == [5, 3] and len(trajs[3].turns) == 4
    assert trajs[2].end_reason == "bad_task" and "max_new_tokens=-1" in trajs[2].failure


def test_the_main_job_s_mixture_section_builds_the_stream():
    c = _config()
    config_lib.check_main_job(c, num_devices=c.cpu_devices)
    assert config_lib.build_mixture(c) is None  # off by default
    c = _config(**{"mixture.target": PAPER, "mixture.rlvr.max_new_tokens": 96})
    config_lib.check_main_job(c, num_devices=c.cpu_devices)
    mixed = config_lib.build_mixture(c)
    tasks = [mixed(i) for i in range(30)]
    kinds = {cls: {t.kind for t in tasks if t.data["workload_class"] == cls} for cls in mixed.target}
    assert kinds == {"agentic": set(c.tasks), "rlvr": {"python"}, "rlhf": {"calculator"}}
    rlvr = next(t for t in tasks if t.data["workload_class"] == "rlvr")
    assert rlvr.data["max_turns"] == 1 and rlvr.data["max_new_tokens"] == 96
    assert "max_new_tokens" not in next(t for t in tasks if t.data["workload_class"] == "rlhf").data
    assert tasks[0].task_id == T.make_task(c.tasks[0], 0, "train", c.controller.data_seed).task_id
    controller = config_lib.rl_configs(c)[0]  # the router's MISA-T target is the mixture's
    assert controller.mixture_target == PAPER and controller.router_config().misa_t.target == pytest.approx(mixed.target)
    assert config_lib.rl_configs(_config())[0].router_config().misa_t.target == misa_t.MISATConfig().target
    with pytest.raises(ConfigError, match="controller.mixture_target: mixture: unknown workload class 'x'"):
        ControllerConfig(mixture_target="x=1")


@pytest.mark.parametrize("overrides, needle", [
    ({"mixture.target": "agentic=1,chat=1"}, "mixture.target: mixture: unknown workload class 'chat'"),
    ({"mixture.target": PAPER, "mixture.rlvr.kinds": "pythn"}, "mixture.rlvr.kinds: unknown kind(s) ['pythn']"),
    ({"mixture.target": PAPER, "mixture.rlhf.max_turns": -1}, "mixture.rlhf.max_turns=-1 must be >= 0"),
    ({"mixture.target": PAPER, "mixture.rlvr.max_new_tokens": 5000}, "mixture.rlvr.max_new_tokens=5000 leaves no"),
    ({"mixture.target": PAPER, "data.train_files": "x.jsonl"}, "cannot be combined with data.train_files"),
])
def test_bad_mixture_values_are_named(overrides, needle):
    with pytest.raises(ConfigError) as e:
        c = _config(**overrides)
        config_lib.check_main_job(c, num_devices=c.cpu_devices)
    assert needle in str(e.value)


def test_the_summary_shows_the_trained_mixture():
    target = mixture.parse_mixture(PAPER)
    trained = {"agentic": 8, "rlvr": 5, "rlhf": 3}
    line = run_report.mixture_line(dict(target=target, trained=trained,
                                        deviation=misa_t.mixture_deviation(target, trained)))
    assert line.startswith("target -> trained share: agentic 0.486 -> 0.500, rlvr 0.331 -> 0.312, rlhf 0.182 -> 0.188")
    assert "deviation 0.019" in line  # 0.5 * (0.0135 + 0.0188 + 0.0054)
