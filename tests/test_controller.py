"""The controller in its three modes on a tiny model: updates happen, weights reach the rollout
mesh, ERS moves devices, RA2P chooses, and a run resumes from its checkpoint."""

import asyncio
import json

import jax
import numpy as np
import pytest

from tiderl_jax.agents import tasks as task_lib
from tiderl_jax.agents.env import LatencyModel, StepResult
from tiderl_jax.agents.rollout import RolloutConfig
from tiderl_jax.engine.engine import EngineConfig
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.rl.losses import LossConfig
from tiderl_jax.rl.trainer_config import TrainerConfig, lr_schedule
from tiderl_jax.runtime import health
from tiderl_jax.runtime.controller import Controller, ControllerConfig
from tiderl_jax.runtime.group import Group
from tiderl_jax.runtime.metrics import tensorboard_tag

TOK = Tokenizer.builtin()
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")


class ParityEnv:
    """One turn; reward 1 when the reply has an even number of characters: rewards vary within a
    group (a random model never solves the real tasks), so GRPO has a signal to train on."""

    async def reset(self, task):
        await asyncio.sleep(0.01)
        return task.prompt

    async def step(self, action):
        await asyncio.sleep(0.02)
        return StepResult(None, float(len(action) % 2 == 0), True)


def _controller(tmp_path, mode, make_env=None, **kw):
    cfg = ControllerConfig(mode=mode, **{**dict(steps=3, groups_per_step=2, group_size=2, max_concurrent=8,
                                                ers_patience=1, ers_cooldown=0), **kw})
    return Controller(
        init_decoder(CFG, seed=0), TOK, config=cfg,
        engine_config=EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=16,
                                   prefill_chunk=256, decode_steps=4),
        rollout_config=RolloutConfig(max_turns=2, max_new_tokens=16, max_context=1024),
        trainer_config=TrainerConfig(loss=LossConfig(kl_coef=0.05), learning_rate=1e-3, warmup_steps=0,
                                     total_steps=10, row_len=1024, micro_rows=4),
        latency=LatencyModel(0.02, 0.5), logdir=str(tmp_path / mode), make_env=make_env or (lambda t: ParityEnv()))


@pytest.mark.parametrize("mode", ["sync", "async", "tiderl"])
def test_each_mode_trains_and_syncs(tmp_path, mode):
    c = _controller(tmp_path, mode)
    before = [np.asarray(x) for x in jax.tree.leaves(c.trainer.params)]
    summary = asyncio.run(c.run())
    assert summary["steps"] == 3 and c.version == 3 and c.engine.version == 3
    assert summary["syncs_failed"] == 0 and summary["goodput_tokens_per_s"] > 0
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(c.trainer.params)))
    for a, b in zip(jax.tree.leaves(c.engine.runner.params), jax.tree.leaves(c.trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the rollout serves the latest weights
    ledger = summary["ledger"]  # every admitted sample ended once, or is still running
    ended = sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    assert ledger["admitted"] == ledger.get("completed", 0) + ended + c.unfinished()
    assert summary["steps"] * c.cfg.batch_samples <= ledger["completed"] - ledger.get("dropped:stale", 0)
    lag = max(summary["staleness"])
    assert lag <= c.cfg.staleness.eta  # nothing staler than the bound was consumed
    if mode == "sync":
        assert summary["staleness"].keys() == {0}
    if mode == "tiderl":  # every move ERS made paid for itself by its prediction
        assert all(m["predicted_gain_s"] > m["predicted_cost_s"] for m in c.moves)


def test_each_update_logs_its_health_and_the_evaluation_of_its_hook(tmp_path):
    c = _controller(tmp_path, "tiderl", steps=2)
    heldout = [task_lib.make_task("calculator", i, "heldout") for i in range(3)]

    async def evaluate(step):  # greedy, through the running rollout loop, on the weights just published
        trajectories = await c.backend.run_tasks(heldout, temperature=0.0, seed=7)
        assert all(t.group < 0 for t in trajectories)
        return health.eval_stats(trajectories)
    asyncio.run(c.run(on_step=evaluate))
    rows = [json.loads(x) for x in open(tmp_path / "tiderl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and [r["eval_tasks"] for r in rows] == [3, 3]
    schedule = lr_schedule(c.trainer.config)
    assert [r["lr"] for r in rows] == pytest.approx([float(schedule(0)), float(schedule(1))])
    for r in rows:
        assert 0.0 <= r["eval_success"] <= 1.0 and r["eval_turns_mean"] == 1.0  # ParityEnv: one turn
        assert r["turns_mean"] == 1.0 and r["tool_calls_mean"] == 0.0 and np.isnan(r["tool_error_rate"])
        assert 0.0 <= r["zero_variance_groups"] <= 1.0 and 0.0 <= r["reward_std"] <= 0.5
        assert 0 < r["response_tokens_mean"] <= r["response_tokens_max"] <= 16  # max_new_tokens per turn
        assert r["kl"] >= 0.0 and 0.0 <= r["clip_fraction"] <= 1.0 and np.isfinite(r["grad_norm"])
        assert all(tensorboard_tag(k).split("/")[0] != "other" for k in r if k != "step")
    assert [name for name, _, _ in c.metrics.phases] == ["eval", "eval"]


def test_ers_moves_devices_and_results_stay_right(tmp_path):
    # without the cost-benefit gate, patience 1 moves a group at the first deficit
    c = _controller(tmp_path, "tiderl", ers_economics=False)
    summary = asyncio.run(c.run())
    assert summary["moves"] >= 1  # the engine moved with every move that changed the rollout devices
    assert c.engine.stats()["moves"] == sum("rollout" in (m["frm"], m["to"]) for m in c.moves) >= 1
    rollout = set(c.pool.devices_of("rollout"))
    assert set(jax.tree.leaves(c.engine.runner.params)[0].sharding.device_set) == rollout
    assert set(jax.tree.leaves(c.trainer.params)[0].sharding.device_set) == set(c.pool.devices_of("train"))
    for a, b in zip(jax.tree.leaves(c.engine.runner.params), jax.tree.leaves(c.trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert summary["steps"] == 3 and max(summary["staleness"]) <= c.cfg.staleness.eta


def test_a_ref_group_moved_to_rollout_leaves_the_ref_pass_colocated(tmp_path, monkeypatch):
    # ERS's generation deficit gives the ref group first (policies/ers.py); on the real backend the
    # engine grows onto its devices, the scorer goes, and the train step scores the ref itself
    from tiderl_jax.policies import ers
    moves = [ers.Move("ref", "rollout", "colocated", "generation deficit")]
    monkeypatch.setattr(ers, "decide", lambda *a, **k: (moves.pop() if moves else None, ers.ERSHistory()))
    c = _controller(tmp_path, "tiderl", steps=3)
    train_devices = set(jax.tree.leaves(c.trainer.params)[0].sharding.device_set)
    summary = asyncio.run(c.run())
    assert summary["steps"] == 3 and summary["moves"] == 1 and c.moves[0]["frm"] == "ref"
    assert c.backend.ref_scorer is None and not c.backend.has_ref_devices
    assert c.pool.num_groups("rollout") == 3 and c.pool.num_groups("ref") == 0
    rollout = set(c.pool.devices_of("rollout"))
    assert set(jax.tree.leaves(c.engine.runner.params)[0].sharding.device_set) == rollout
    assert set(jax.tree.leaves(c.trainer.params)[0].sharding.device_set) == train_devices  # not moved
    for a, b in zip(jax.tree.leaves(c.engine.runner.params), jax.tree.leaves(c.trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    last = [json.loads(x) for x in open(tmp_path / "tiderl" / "metrics.jsonl")][-1]
    assert last["time_ref_s"] > 0  # the last step scored the ref on the train devices


class BrokenEnv(ParityEnv):
    async def step(self, action):
        raise RuntimeError("tool crashed")


def test_failed_samples_are_dropped_with_their_reason_and_the_run_goes_on(tmp_path):
    made = []

    def make_env(task):  # every third environment fails its step
        made.append(task)
        return BrokenEnv() if len(made) % 3 == 0 else ParityEnv()
    c = _controller(tmp_path, "async", make_env=make_env)
    summary = asyncio.run(c.run())
    ledger = summary["ledger"]
    assert summary["steps"] == 3 and ledger["dropped:env_error"] >= 1
    assert ledger["admitted"] == ledger["completed"] + ledger["dropped:env_error"] + c.unfinished()
    assert all(t.failure is None for g in c.ready for t in g.trajectories)  # never trained on


def test_resume_continues_from_the_checkpoint(tmp_path):
    first = _controller(tmp_path, "async", steps=2)
    asyncio.run(first.run())
    assert first.checkpointer.latest_step() == 2
    saved_ready = len(first.ready)
    resumed = _controller(tmp_path, "async", steps=4)
    assert resumed.restore()
    assert resumed.step == 2 and resumed.version == 2 and len(resumed.ready) == saved_ready
    for a, b in zip(jax.tree.leaves(resumed.trainer.params), jax.tree.leaves(first.trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    summary = asyncio.run(resumed.run())
    assert summary["steps"] == 4 and resumed.engine.version == 4
    # stopped while an update was being assembled, and before a resume had admitted its in-flight groups again:
    # the update's groups go back to the front of the buffer, the groups not yet admitted stay in flight
    task = task_lib.make_task("calculator", 0, "train", 0)
    resumed.taking = [Group(100, task)]
    resumed.resume_groups = [Group(101, task, dropped=[1])]
    meta = resumed.checkpoint_meta()
    assert [g["gid"] for g in meta["ready"]] == [100] + [g.gid for g in resumed.ready]
    assert meta["in_flight"][-1]["gid"] == 101 and meta["in_flight"][-1]["dropped"] == [1]


def test_bad_controller_configs_are_named():
    with pytest.raises(ConfigError, match="controller.mode"):
        ControllerConfig(mode="fast")
    with pytest.raises(ConfigError, match="max_concurrent"):
        ControllerConfig(group_size=8, max_concurrent=4)
    with pytest.raises(ConfigError, match="task_kinds"):
        ControllerConfig(task_kinds=("chess",))


def _run_beside(c, fault_injector):
    """Runs the controller with a fault-injecting coroutine beside it; the controller's summary."""
    async def main():
        k = asyncio.create_task(fault_injector)
        try:
            return await c.run()
        finally:
            k.cancel()
    return asyncio.run(main())


def _dropped(ledger):
    return sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")


@pytest.mark.e2e
def test_environment_crashes_are_recovered_and_every_sample_is_accounted_for(tmp_path):
    # real built-in tasks in environment subprocesses (Belayer checkpoints); a killer SIGKILLs a
    # random live environment process every 0.2 s while the run goes on
    import os
    import random
    import signal

    c = Controller(
        init_decoder(CFG, seed=0), TOK,
        config=ControllerConfig(mode="tiderl", steps=3, groups_per_step=2, group_size=2, max_concurrent=8,
                                env_workers=True, env_checkpoint="always", task_kinds=("calculator",)),
        engine_config=EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=16,
                                   prefill_chunk=256, decode_steps=4),
        rollout_config=RolloutConfig(max_turns=3, max_new_tokens=16, max_context=1024),
        trainer_config=TrainerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10, row_len=1024,
                                     micro_rows=4),
        latency=LatencyModel(0.1, 0.5), logdir=str(tmp_path / "faults"))
    made, build = [], c._make_env
    c._make_env = lambda t: made.append(build(t)) or made[-1]
    kills = []

    async def killer():
        rng = random.Random(0)
        while True:
            await asyncio.sleep(0.2)
            live = [e for e in made if e.worker.alive()]
            if live:
                victim = rng.choice(live)
                os.kill(victim.worker.pid, signal.SIGKILL)
                kills.append(victim.worker.pid)

    summary = _run_beside(c, killer())
    ledger = summary["ledger"]
    assert summary["steps"] == 3 and len(kills) >= 3
    assert ledger["admitted"] == ledger["completed"] + _dropped(ledger) + c.unfinished()
    assert c.backend.runner.metrics["rewinds"] >= 1  # crashes mid-episode came back by restore
    assert all(np.isfinite(t.reward) for g in c.ready for t in g.trajectories)


@pytest.mark.e2e
def test_engine_worker_killed_mid_run_fails_over_and_the_run_completes(tmp_path):
    # the rollout engine in a worker process with a warm standby; SIGKILL the primary once
    # generations are in flight: the standby takes over from the token checkpoints
    import os
    import signal
    # programs compile lazily (no warmup: seconds, not minutes), so health checks must outlast a
    # compile; the SIGKILL is seen at once from the process exit
    c = _controller(tmp_path, "async", engine_workers=True, engine_worker_warmup=False,
                    engine_worker_health_checks=100)
    client = c.engine.client
    killed = []

    async def killer():
        while not killed:
            await asyncio.sleep(0.05)
            if c.engine.has_work() and client.standby is not None and client.standby.ready.is_set():
                killed.append(client.primary.pid)
                os.kill(client.primary.pid, signal.SIGKILL)

    summary = _run_beside(c, killer())
    ledger = summary["ledger"]
    assert summary["steps"] == 3 and killed and len(client.failovers) >= 1
    assert _dropped(ledger) == 0 and ledger["admitted"] == ledger["completed"] + c.unfinished()
    with pytest.raises(ConfigError, match="engine_workers"):
        ControllerConfig(mode="tiderl", engine_workers=True)
