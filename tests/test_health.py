"""Training health: the per-update stats of a batch against hand-computed values, the not-learning detector's
episodes, TensorBoard groups, the reward curve and the timeline's title and phases, tool errors as the
environment counts them, and all of it through the controller on the simulator (with an evaluation hook)."""

import asyncio
import json
import logging
import math
import os

import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.trajectory import Trajectory, Turn
from tiderl_jax.runtime import health, plots
from tiderl_jax.runtime.controller import ControllerConfig
from tiderl_jax.runtime.metrics import TAG_GROUPS, RunMetrics, tensorboard_tag
from tiderl_jax.sim import backend as sim_backend
from tiderl_jax.sim.config import SimConfig, SimTrajectory


def _traj(group, reward, generated, versions=None, turns=()):
    t = Trajectory(task_id=f"t{group}", kind="calculator", group=group, reward=reward)
    t.extend([1, 2, 3], generated=False)
    t.extend([5] * generated, generated=True, logprobs=[0.0] * generated, model_logprobs=[0.0] * generated,
             versions=versions or [0] * generated)
    t.turns = list(turns)
    return t


def _batch():
    # groups: 0 -> rewards (1, 0): signal; 1 -> (1, 1) and 2 -> (0, 0): all equal
    return [
        _traj(0, 1.0, 4, turns=[Turn(3, 5, 0.1, 0.1, tool_calls=2, tool_errors=1), Turn(6, 8, 0.1, 0.0)]),
        _traj(0, 0.0, 2, versions=[1, 1], turns=[Turn(3, 5, 0.1, 0.0, malformed=True)]),
        _traj(1, 1.0, 6, turns=[Turn(3, 9, 0.1, 0.1, tool_calls=1), Turn(9, 9, 0.1, 0.0)]),
        _traj(1, 1.0, 3, turns=[Turn(3, 6, 0.1, 0.0)]),
        _traj(2, 0.0, 8, turns=[Turn(3, 7, 0.1, 0.1, tool_calls=1, tool_errors=1), Turn(7, 11, 0.1, 0.0)]),
        _traj(2, 0.0, 1, turns=[Turn(3, 4, 0.1, 0.0)]),
    ]


def test_batch_stats_by_hand():
    batch = _batch()
    lags = health.version_lags(batch, 1)  # an update from version 1: version-0 tokens lag 1, version-1 ones 0
    assert lags == {1: 4 + 6 + 3 + 8 + 1, 0: 2}
    s = health.batch_stats(batch, lags)
    assert s["reward"] == 0.5 and s["reward_std"] == pytest.approx(0.5)  # 3 of 6 ones: population std 0.5
    assert s["zero_variance_groups"] == pytest.approx(2 / 3)
    assert s["response_tokens_mean"] == pytest.approx(24 / 6) and s["response_tokens_max"] == 8
    assert s["turns_mean"] == pytest.approx(9 / 6)  # 2 + 1 + 2 + 1 + 2 + 1 turns
    assert s["tool_calls_mean"] == pytest.approx(4 / 6) and s["tool_error_rate"] == pytest.approx(2 / 4)
    assert s["malformed_turn_rate"] == pytest.approx(1 / 9)
    assert s["staleness_mean"] == pytest.approx(22 / 24)
    # a group of one sample and a batch of different rewards: no zero-variance group but the single one
    s = health.batch_stats([_traj(0, 0.25, 1), _traj(0, 0.75, 1), _traj(1, 0.5, 1)])
    assert s["zero_variance_groups"] == 0.5 and s["reward_std"] == pytest.approx(math.sqrt(1 / 24))
    assert math.isnan(s["staleness_mean"])
    with pytest.raises(ValueError):
        health.batch_stats([])


def test_batch_stats_of_the_simulators_trajectories():
    # token counts and versions, no turns nor tool calls: those are NaN, not 0
    trajs = [SimTrajectory("a", "sim", 0, model_tokens=100, version_tokens={0: 60, 1: 40}),
             SimTrajectory("b", "sim", 0, model_tokens=300, version_tokens={1: 300})]
    s = health.batch_stats(trajs, health.version_lags(trajs, 1))
    assert s["response_tokens_mean"] == 200 and s["response_tokens_max"] == 300
    assert s["zero_variance_groups"] == 1.0 and s["reward"] == 0.0 and s["reward_std"] == 0.0
    assert s["staleness_mean"] == pytest.approx(60 / 400)
    assert all(math.isnan(s[k]) for k in ("turns_mean", "tool_calls_mean", "tool_error_rate", "malformed_turn_rate"))


def test_not_learning_warns_once_per_episode():
    h = health.LearningHistory()
    flat, signal = dict(zero_variance_groups=0.75, grad_norm=0.3), dict(zero_variance_groups=0.5, grad_norm=0.3)
    said = []
    for step, values in enumerate([flat, flat, flat, flat, signal, flat, flat, flat], start=1):
        h, warnings = health.check_learning(h, values, step)
        said += [(step, w) for w in warnings]
    # warned at the third update in a row, not at the fourth; exactly 50% is not "most"; again after it cleared
    assert [step for step, _ in said] == [3, 8]
    assert "updates 1-3" in said[0][1] and "updates 6-8" in said[1][1] and "75%" in said[0][1]
    # zero gradient, by itself, and a step without a gradient norm (nothing trained) changes nothing
    h, said = health.LearningHistory(), []
    for step, values in enumerate([dict(grad_norm=0.0), dict(grad_norm=0.0), {"loss": 0.0}, dict(grad_norm=0.0),
                                   dict(grad_norm=float("nan"))], start=1):
        h, warnings = health.check_learning(h, values, step, updates=3)
        said += [(step, w) for w in warnings]
    assert len(said) == 1 and said[0][0] == 4 and "gradient norm was 0 in each of updates 1-4" in said[0][1]
    assert h == health.LearningHistory()  # the non-finite norm (a skipped step) ended the episode


def test_monitor_logs_the_warning(caplog):
    m = health.Monitor(updates=2)
    flat = [_traj(0, 1.0, 2), _traj(0, 1.0, 2), _traj(1, 0.0, 2), _traj(1, 0.0, 2)]
    with caplog.at_level(logging.WARNING, logger="tiderl_jax.runtime.health"):
        for step in range(1, 5):
            stats = m.update(step, flat, {"grad_norm": 0.0})
    assert stats["zero_variance_groups"] == 1.0
    assert [step for step, _ in m.warnings] == [2, 2]  # both conditions, once each
    assert sum("not learning" in r.message for r in caplog.records) == 2


def test_eval_stats():
    s = health.eval_stats([_traj(0, 1.0, 4, turns=[Turn(3, 7, 0.1, 0.0)]), _traj(1, 0.5, 2), _traj(2, 1.0, 6)])
    assert s["success"] == pytest.approx(2 / 3) and s["solved"] == 2 and s["tasks"] == 3
    assert s["reward"] == pytest.approx(2.5 / 3) and s["response_tokens_mean"] == 4
    assert s["turns_mean"] == pytest.approx(1 / 3)


def test_tensorboard_tags_are_grouped():
    assert tensorboard_tag("loss") == "train/loss" and tensorboard_tag("hol_s") == "sched/hol_s"
    assert tensorboard_tag("turns_mean") == "rollout/turns_mean" and tensorboard_tag("ras") == "sched/ras"
    assert tensorboard_tag("eval_success") == "eval/success" and tensorboard_tag("sft_nll") == "sft/nll"
    assert tensorboard_tag("something_new") == "other/something_new"
    keys = [k for keys in TAG_GROUPS.values() for k in keys]
    assert len(keys) == len(set(keys))  # one group each


def test_tool_errors_are_counted_per_step():
    env = T.make_env(T.make_task("calculator", 0))
    calls = ['<tool_call>{"name": "calc", "arguments": {"expr": "1 + 1"}}</tool_call>',
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calc", "arguments": {"expr": "1 +"}}</tool_call>']

    async def go():
        await env.reset(T.make_task("calculator", 0))
        return await env.step("\n".join(calls)), await env.step(calls[0])
    both, ok = asyncio.run(go())
    assert both.info == {"tool_calls": 3, "tool_errors": 2} and ok.info == {"tool_calls": 1, "tool_errors": 0}


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_reward_curve_from_metrics_jsonl(tmp_path):
    rows = [dict(step=i, reward=0.1 * i, reward_std=0.2, zero_variance_groups=1.0 - 0.1 * i) for i in range(1, 9)]
    rows[3]["eval_success"] = 0.25
    rows[7]["eval_success"] = 0.5
    rows.append(dict(step=9, reward=0.0))  # a record without the health keys (an older run) still plots
    _write_rows(tmp_path / "metrics.jsonl", rows)
    png = plots.reward_curve(str(tmp_path / "metrics.jsonl"), str(tmp_path / "reward_curve.png"))
    assert png.endswith("reward_curve.png") and os.path.getsize(png) > 10_000


def test_timeline_title_and_phases(tmp_path):
    m = RunMetrics(str(tmp_path), total_steps=1, devices={"rollout": 2, "train": 2}, clock=lambda: 100.0)
    m.spans += [("rollout", "generate", 0.0, 3.0), ("train", "train", 3.0, 5.0)]
    m.phases.append(("eval", 104.0, 105.0))  # an evaluation during RL
    plain = m.plot_timeline(str(tmp_path / "plain.png"))
    marked = m.plot_timeline(str(tmp_path / "marked.png"), mode="tiderl", title="run x",
                             phases=[("warm start", 40.0, 80.0), ("held-out before", 80.0, 100.0),
                                     ("RL", 100.0, 105.0)])
    m.close()
    assert os.path.getsize(plain) > 1000 and os.path.getsize(marked) > os.path.getsize(plain)


def test_the_controller_logs_health_and_evaluations_on_the_simulator(tmp_path, caplog):
    cfg = ControllerConfig(mode="async", steps=4, groups_per_step=2, group_size=4, max_concurrent=16,
                           device_group_size=2, tensor=1, rollout_groups=2, ref_groups=0, train_groups=2)
    seen = []

    async def on_step(step):  # a coroutine hook, every 2 updates; the others return nothing
        seen.append(step)
        if step % 2 == 0:
            await asyncio.sleep(1.0)  # virtual seconds
            return {"success": step / 8}
    with caplog.at_level(logging.WARNING):
        summary, controller, _ = sim_backend.run(SimConfig(), cfg, num_devices=8, logdir=str(tmp_path),
                                                 on_step=on_step)
    assert summary["steps"] == 4 and seen == [1, 2, 3, 4]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("eval_success") for r in rows] == [None, 0.25, None, 0.5]
    assert [name for name, _, _ in controller.metrics.phases] == ["eval", "eval"]
    assert all(end - start == pytest.approx(1.0) for _, start, end in controller.metrics.phases)
    for r in rows:  # the simulator's samples: token counts, no rewards, no turns; its trainer has no gradient
        assert r["response_tokens_mean"] > 0 and r["response_tokens_max"] >= r["response_tokens_mean"]
        assert r["zero_variance_groups"] == 1.0 and math.isnan(r["turns_mean"]) and r["step_time_s"] > 0
        assert all(tensorboard_tag(k).split("/")[0] != "other" for k in r if k != "step")
    assert not any("not learning" in rec.message for rec in caplog.records)  # nothing trained: nothing checked
    assert summary["not_learning"] == 0
    assert os.path.getsize(plots.reward_curve(str(tmp_path / "metrics.jsonl"), str(tmp_path / "r.png"))) > 10_000
