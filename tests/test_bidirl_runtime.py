"""BiDiRL driven by the real controller on the simulator: the rollout borrows the train devices while
the trainer waits for data, the trainer borrows idle rollout replicas while admission is blocked, every
borrow is given back, no sample is lost, and bad settings are refused. The static planner of
launch/simulate.py picks the split its probes measure fastest."""

import os
import sys

import pytest

from tiderl_jax.model.config import ConfigError
from tiderl_jax.policies import bidirl
from tiderl_jax.runtime.controller import Controller, ControllerConfig
from tiderl_jax.sim import backend as sim_backend
from tiderl_jax.sim.backend import SimConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHEAP_SWITCH = SimConfig(switch_fixed_s=0.0)  # a hot switch costs only its state transfer


def _run(tmp_path, sim=CHEAP_SWITCH, **kw):
    base = dict(mode="async", bidirl=True, steps=5, groups_per_step=4, group_size=4, max_concurrent=32,
                device_group_size=2, tensor=1, rollout_groups=1, ref_groups=0, train_groups=3)
    return sim_backend.run(sim, ControllerConfig(**{**base, **kw}), num_devices=8, logdir=str(tmp_path))


def _accounted(summary, controller):
    ledger = summary["ledger"]
    ended = ledger["completed"] + sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    return ledger["admitted"] == ended + controller.unfinished()


def test_rollout_borrows_the_waiting_trainers_devices(tmp_path):
    # one rollout group against three train groups: the trainer waits for data most of the step
    summary, controller, backend = _run(tmp_path)
    rollout_borrows = [b for b in controller.borrows if b["borrower"] == bidirl.ROLLOUT]
    assert rollout_borrows and summary["borrows"] == len(controller.borrows)
    for b in rollout_borrows:
        assert b["devices"] == 6 and b["predicted_gain_s"] > b["predicted_cost_s"]
        assert b["switch_in_s"] > 0 and b["switch_out_s"] > 0 and b["held_s"] >= 0
    assert summary["steps"] == 5 and _accounted(summary, controller)
    # everything given back: the replicas are the rollout pool's own again
    assert len(backend.replicas) == 2 and not any(r.borrowed for r in backend.replicas.values())
    assert summary["sim"]["moved_tasks"] > 0  # queued work moved onto the borrowed replicas
    # the borrowed replicas' work counts as busy time of the train lane that owns the devices
    assert controller.metrics.busy_device_s["train"] > controller.metrics.busy_s["train"] * 6


def test_trainer_borrows_idle_rollout_replicas(tmp_path):
    # six rollout replicas, two samples in flight at most: most replicas idle while the producer is blocked
    summary, controller, backend = _run(tmp_path, rollout_groups=3, train_groups=1, groups_per_step=1,
                                        group_size=2, max_concurrent=2)
    train_borrows = [b for b in controller.borrows if b["borrower"] == bidirl.TRAIN]
    assert train_borrows
    for b in train_borrows:
        assert 1 <= b["devices"] <= 6 and b["predicted_gain_s"] > b["predicted_cost_s"]
    assert summary["steps"] == 5 and _accounted(summary, controller)
    assert len(backend.replicas) == 6 and backend._train_extra == 0 and not backend._lent


def test_costly_switches_are_refused(tmp_path):
    summary, controller, _ = _run(tmp_path, sim=SimConfig(switch_fixed_s=1000.0))
    assert summary["borrows"] == 0 and summary["borrows_refused"] > 0


def test_off_by_default_and_same_run_without_it(tmp_path):
    on, _, _ = _run(tmp_path / "on", sim=SimConfig(switch_fixed_s=1000.0))  # every borrow refused
    off, controller, _ = _run(tmp_path / "off", sim=SimConfig(switch_fixed_s=1000.0), bidirl=False)
    assert off["borrows"] == 0 and off["borrows_refused"] == 0 and not controller.borrows
    keys = ("wall_s", "goodput_tokens_per_s", "staleness")
    assert {k: on[k] for k in keys} == {k: off[k] for k in keys}


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="bidirl"):
        ControllerConfig(mode="sync", bidirl=True)
    with pytest.raises(ConfigError, match="bidirl_scaling"):
        ControllerConfig(mode="async", bidirl=True, bidirl_scaling=0.0)
    with pytest.raises(ConfigError, match="hot-switches"):
        Controller(config=ControllerConfig(mode="async", bidirl=True), logdir="/tmp/unused", backend=object(),
                   checkpoints=False)


def test_static_planner_picks_the_fastest_probed_split(tmp_path):
    from configs import sim_tiderl_text
    from launch import simulate

    assert simulate._interpolate({8: 10.0, 24: 2.0}, 16) == pytest.approx(6.0)
    assert simulate._interpolate({8: 10.0, 24: 2.0}, 4) == 10.0 and simulate._interpolate({8: 10.0}, 30) == 10.0
    cfg = sim_tiderl_text.get_config()
    cfg.logdir, cfg.bidirl_probes, cfg.bidirl_probe_steps = str(tmp_path), 3, 2
    groups, seen = simulate.plan_bidirl(cfg, 32)
    assert set(seen["probe_rollout_s"]) == {"8", "16", "24"}
    step = {int(d): max(seen["probe_rollout_s"][d], seen["probe_train_s"][str(32 - int(d))])
            for d in seen["probe_rollout_s"]}
    assert groups * 8 == seen["planned_rollout_devices"] == min(step, key=step.get)
