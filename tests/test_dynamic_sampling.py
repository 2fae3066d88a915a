"""Dynamic sampling (DAPO's group filter, `ControllerConfig.filter_groups`) in the sync, async and tiderl modes: a
complete group whose rewards are all equal is dropped and replaced, every update trains on informative groups only,
the ledger names the drops, and a policy that never yields an informative group stops the run with the reason."""

import json

import pytest

import tiderl_jax.sim as sim_py
from tiderl_jax import run_report
from tiderl_jax.model.config import ConfigError
from tiderl_jax.runtime.controller import ControllerConfig
from tiderl_jax.sim.backend import SimConfig


def informative(gid: int) -> bool:
    return gid % 3 != 0  # every third group's samples all get reward 0


def _run(tmp_path, monkeypatch, mode, *, filter_groups=True, rewards=None, steps=4, limit=64):
    python = sim_py.python_reference()  # (a compiled class cannot be patched)
    generate_group = python.SimBackend.generate_group

    async def scored(self, task, group, samples, expected_group_size):  # a reward per sample, by group
        out = await generate_group(self, task, group, samples, expected_group_size)
        for t in out:
            t.reward = (rewards or (lambda g, s: float(informative(g) and s == 0)))(group, t.info["sample"])
        return out
    monkeypatch.setattr(python.SimBackend, "generate_group", scored)
    config = ControllerConfig(mode=mode, steps=steps, groups_per_step=3, group_size=4, max_concurrent=12,
                              device_group_size=2, rollout_groups=2, ref_groups=0, train_groups=2, tensor=1,
                              filter_groups=filter_groups, filter_groups_limit=limit)
    summary, controller, _ = python.run(SimConfig(), config, num_devices=8, logdir=str(tmp_path / mode))
    return summary, controller


@pytest.mark.parametrize("mode", ["sync", "async", "tiderl"])
def test_every_update_trains_only_informative_groups_and_the_ledger_names_the_drops(tmp_path, monkeypatch, mode):
    summary, c = _run(tmp_path, monkeypatch, mode)
    assert c.step == 4 and len(c.consumed) == 4 * 3 * 4  # every update full: groups_per_step x group_size
    trained = {g for g, _ in c.consumed}
    assert trained and all(informative(g) for g in trained)
    ledger = summary["ledger"]
    assert ledger["dropped:zero_variance"] > 0 and ledger["dropped:zero_variance"] % 4 == 0  # whole groups
    acc = run_report.ledger_accounts(ledger, unfinished=c.unfinished(), trained=len(c.consumed),
                                     ready=sum(len(g.trajectories) for g in c.ready),
                                     waiting=sum(len(g.trajectories) for g in c.in_flight.values()))
    assert acc["unexplained"] == 0 and acc["completed_as"]["unexplained"] == 0
    assert acc["completed_as"]["dropped_zero_variance"] == ledger["dropped:zero_variance"]
    assert "dropped with all rewards equal" in run_report.ledger_lines(acc)[1]
    rows = [json.loads(line) for line in open(tmp_path / mode / "metrics.jsonl")]
    shares = [r["zero_variance_dropped"] for r in rows]  # the health metrics show the share dropped
    assert len(shares) == 4 and all(0.0 <= x <= 1.0 for x in shares) and max(shares) > 0
    assert all(r["zero_variance_groups"] == 0.0 for r in rows)  # and what was trained had none
    # the trained groups' reward is 1 of 4 samples; every sample drawn counts the dropped all-0 groups too
    for r in rows:
        assert r["reward"] == 0.25
        assert r["sampled_reward"] == pytest.approx(0.25 * (1 - r["zero_variance_dropped"]))
    assert c.metrics.rewards == [r["sampled_reward"] for r in rows]  # the summary's train-reward quarters


@pytest.mark.parametrize("mode", ["sync", "tiderl"])
def test_with_the_filter_off_all_equal_groups_are_trained(tmp_path, monkeypatch, mode):
    summary, c = _run(tmp_path, monkeypatch, mode, filter_groups=False)
    assert any(not informative(g) for g, _ in c.consumed)
    assert "dropped:zero_variance" not in summary["ledger"]


def test_a_policy_with_no_informative_group_stops_the_run_with_the_reason(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="dynamic sampling dropped the last 6 groups: each had one reward"):
        _run(tmp_path, monkeypatch, "tiderl", rewards=lambda g, s: 1.0, limit=6)
    with pytest.raises(ConfigError, match="filter_groups_limit=0 must be >= 1"):
        ControllerConfig(filter_groups_limit=0)


def test_the_rule_informative_groups_and_the_stop():
    from tiderl_jax.policies import dynamic_sampling
    assert dynamic_sampling.informative([0.0, 1.0, 0.0]) and not dynamic_sampling.informative([0.5, 0.5])
    assert not dynamic_sampling.informative([1.0])  # one sample left: no advantage either
    assert dynamic_sampling.exhausted(6, 6) and not dynamic_sampling.exhausted(5, 6)
