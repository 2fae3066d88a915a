"""BiDiRL's hot switches on the real JAX backend (runtime/hot_switch.py), on the 8 faked CPU devices with a tiny
model: a trainer that borrows idle rollout replicas makes the same update as without them and gets its devices
(and programs) back; a rollout that borrows the train devices serves on them as a temporary replica whose
sessions finish on the other replicas once it leaves; the controller with borrows forced in both directions
accounts for every sample; bad settings are refused with their reasons."""

import asyncio
import contextlib

import jax
import numpy as np
import pytest

from tiderl_jax.agents.env import LatencyModel, StepResult
from tiderl_jax.agents.rollout import RolloutConfig
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.engine import EngineConfig
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.policies import bidirl
from tiderl_jax.rl.losses import LossConfig
from tiderl_jax.rl.trainer_config import TrainerConfig
from tiderl_jax.runtime.backend import JaxBackend
from tiderl_jax.runtime.controller import Controller, ControllerConfig
from tiderl_jax.runtime.pool import DevicePool

TOK = Tokenizer.builtin()
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")
ENGINE = EngineConfig(page_size=16, num_pages=128, max_seq_len=1024, max_running=8, prefill_chunk=256,
                      decode_steps=4)
ROLLOUT = RolloutConfig(max_turns=3, max_new_tokens=8, temperature=0.0, max_context=1024)
TRAINER = TrainerConfig(loss=LossConfig(kl_coef=0.05), learning_rate=1e-2, warmup_steps=0, total_steps=10,
                        row_len=1024, micro_rows=4)


def _backend(rollout: int, train: int, trainer: TrainerConfig = TRAINER) -> JaxBackend:
    pool = DevicePool.split(jax.devices(), group_size=2, rollout=rollout, ref=0, train=train, tensor=1)
    return JaxBackend(init_decoder(CFG, seed=0), TOK, kv_mode="ctb", pool=pool, engine_config=ENGINE,
                      rollout_config=ROLLOUT, trainer_config=trainer, replicas="group", tensor=1)


def _trajectories(n: int = 8) -> list[Trajectory]:
    """Two GRPO groups of made-up samples whose rewards differ (a non-zero update)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        t = Trajectory(task_id=f"t{i}", kind="made-up", group=i % 2, reward=float(rng.random()))
        t.extend(rng.integers(1, 300, 12).tolist(), generated=False)
        k = int(rng.integers(6, 20))
        t.extend(rng.integers(1, 300, k).tolist(), generated=True, logprobs=[-2.0] * k, model_logprobs=[-2.0] * k,
                 versions=[0] * k)
        t.info["sample"] = i // 2
        out.append(t)
    return out


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def _devices_of(tree) -> set:
    return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


def test_a_trainer_borrow_makes_the_same_update_and_gives_everything_back():
    b = _backend(rollout=3, train=1)
    trainer, trajs = b.trainer, _trajectories()
    home = _devices_of(trainer.params)
    start = _copy((trainer.params, trainer.opt_state))
    asyncio.run(b.train(trajs))  # the step on the trainer's own 2 devices
    alone = jax.tree.map(np.asarray, trainer.params)
    trainer.params, trainer.opt_state = _copy(start)
    trainer.policy_version = 0  # the same step again: the same on-policy batch (no proximal pass)
    costs_before = b.switch_costs(bidirl.ROLLOUT, bidirl.TRAIN)  # estimated from bytes
    assert b.idle_devices(bidirl.ROLLOUT) == 4  # three idle replicas, one keeps serving

    async def borrowed():
        await b.lend(bidirl.ROLLOUT, bidirl.TRAIN, 2)
        lent = [r for r in b.service.replicas if not r.alive]
        assert len(lent) == 1 and b.idle_devices(bidirl.ROLLOUT) == 0
        assert _devices_of(trainer.params) == home | set(b.pool.group_devices(b._group_of[lent[0].id]))
        assert _devices_of(trainer.opt_state) >= home and len(_devices_of(trainer.params)) == 4
        with pytest.raises(RuntimeError, match="already lent"):
            await b.lend(bidirl.ROLLOUT, bidirl.TRAIN, 2)
        out = await b.train(trajs)  # the same step on 4 devices: batch and weights split 4 ways
        await b.take_back()
        return out
    out = asyncio.run(borrowed())
    assert out["compile_s"] > 0  # the borrowed layout's programs, compiled once
    # the gradient's reduction order differs on 4 devices; Adam divides it by its own scale, so the float
    # tolerance is a fraction of one update's size (lr 1e-2): within 1e-5, 0.1% of a step
    for a, c in zip(jax.tree.leaves(alone), jax.tree.leaves(trainer.params)):
        np.testing.assert_allclose(np.asarray(c), a, rtol=1e-4, atol=1e-5)
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                   zip(jax.tree.leaves(start[0]), jax.tree.leaves(trainer.params)))  # the update did something
    # everything back: the trainer's devices, every replica serving, the home programs kept (no recompile)
    assert _devices_of(trainer.params) == home and _devices_of(trainer.opt_state) == home
    assert all(r.alive for r in b.service.replicas) and b._lent is None
    assert asyncio.run(b.train(trajs))["compile_s"] == 0
    # both switches measured and logged; the next decision weighs them (less the compile they did not spend)
    log_in, log_out = b.switch_log
    assert (log_in["phase"], log_out["phase"]) == ("in", "out") and log_in["borrower"] == bidirl.TRAIN
    assert log_in["seconds"] > 0 and log_out["seconds"] > 0 and log_in["bytes"] > 0
    costs = b.switch_costs(bidirl.ROLLOUT, bidirl.TRAIN)
    assert costs["switch_in_s"] == pytest.approx(log_in["seconds"] - log_in["compile_s"])
    assert costs["switch_out_s"] == pytest.approx(log_out["seconds"] - log_out["compile_s"])
    assert costs != costs_before and costs["merge_s"] > 0
    # a second borrow of the same replica compiles nothing: its layout's programs were kept
    asyncio.run(b.lend(bidirl.ROLLOUT, bidirl.TRAIN, 2))
    assert asyncio.run(b.train(trajs))["compile_s"] == 0
    asyncio.run(b.take_back())
    print("\nmeasured trainer borrow:", [(r["phase"], round(r["seconds"], 3), round(r["compile_s"], 3))
                                         for r in b.switch_log])


class TurnsEnv:
    """`turns` turns, each tool call taking `sleep_s` (a session's KV stays on its replica meanwhile); the reward
    varies with the reply's length (GRPO has a signal)."""

    def __init__(self, turns: int = 3, sleep_s: float = 0.2):
        self.turns, self.left, self.sleep_s = turns, turns, sleep_s

    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        self.left -= 1
        await asyncio.sleep(self.sleep_s)
        return StepResult(None if self.left <= 0 else " ok", float(len(action) % 2), self.left <= 0)


def test_c_a_rollout_borrow_serves_on_the_train_devices_and_its_sessions_finish_elsewhere():
    from tiderl_jax.agents import tasks as T

    b = _backend(rollout=1, train=3)
    own = [r.id for r in b.service.replicas]
    tasks = [(T.make_task("calculator", i), i) for i in range(4)]
    seen = {}

    async def main():
        await b.start(lambda t: TurnsEnv(), lambda t: LatencyModel(), contextlib.nullcontext)
        try:
            assert b.idle_devices(bidirl.TRAIN) == 6
            await b.lend(bidirl.TRAIN, bidirl.ROLLOUT, 2)
            (rid,) = b._lent["replicas"]
            rep = b.service.replica(rid)
            assert [r.id for r in b.service.replicas] == own + [rid]
            assert _devices_of(rep.engine.runner.params) == set(b.pool.group_devices(min(b.pool.roles["train"])))
            work = asyncio.gather(*(b.runner.submit(t, g) for t, g in tasks))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 90  # its first turn compiles its programs
            while not rep.sessions and loop.time() < deadline:  # until a session holds KV there between turns
                await asyncio.sleep(0.005)
            seen.update(sessions=len(rep.sessions), prompt_tokens=rep.stats()["prompt_tokens"])
            await b.take_back()
            return await asyncio.wait_for(work, 120)
        finally:
            await asyncio.wait_for(b.stop(), 30)
    trajs = asyncio.run(main())
    assert seen["sessions"] >= 1 and seen["prompt_tokens"] > 0  # it served
    assert [r.id for r in b.service.replicas] == own  # and left
    assert b.switch_log[-1]["sessions_moved"] >= 1
    assert all(t.failure is None and len(t.turns) == 3 for t in trajs)  # the moved sessions finished elsewhere
    # each moved session's next turn was submitted from its whole context (its KV recomputed) on the own replica
    c = b.service.counters
    assert c["submitted"] >= len(tasks) + b.switch_log[-1]["sessions_moved"] and c["rerouted"] == 0
    costs = b.switch_costs(bidirl.TRAIN, bidirl.ROLLOUT)
    assert costs["switch_in_s"] == pytest.approx(b.switch_log[0]["seconds"] - b.switch_log[0]["compile_s"])
    print("\nmeasured rollout borrow:", [(r["phase"], round(r["seconds"], 3), round(r["compile_s"], 3))
                                         for r in b.switch_log])


def test_b_a_controller_run_with_forced_borrows_accounts_for_every_sample(tmp_path, monkeypatch):
    def always(s):  # every borrow the controller considers is made
        devices = (s.idle_devices // s.borrower_unit) * s.borrower_unit
        lender = bidirl.TRAIN if s.borrower == bidirl.ROLLOUT else bidirl.ROLLOUT
        return bidirl.BorrowDecision(devices > 0, s.borrower, lender, devices, 1.0, 0.0, "forced")
    monkeypatch.setattr(bidirl, "decide_borrow", always)
    # step 1: the rollout borrows the train group while the trainer waits for its first batch; step 2 (with a
    # measured own step to weigh): the trainer borrows the rollout replicas idle while admission is held
    cfg = ControllerConfig(mode="async", bidirl=True, rollout_replicas="group", steps=2, groups_per_step=1,
                           group_size=2, max_concurrent=2, device_group_size=2, rollout_groups=3, ref_groups=0,
                           train_groups=1, tensor=1)
    c = Controller(init_decoder(CFG, seed=0), TOK, config=cfg, engine_config=ENGINE,
                   rollout_config=RolloutConfig(max_turns=1, max_new_tokens=8, max_context=1024),
                   trainer_config=TRAINER, logdir=str(tmp_path), make_env=lambda t: TurnsEnv(1, 0.01),
                   checkpoints=False)
    c._arrival_rate = lambda since=-float("inf"): 1.0  # the rollout borrows whenever the trainer waits
    own = [r.id for r in c.backend.service.replicas]
    summary = asyncio.run(c.run())
    assert summary["steps"] == 2 and summary["syncs_failed"] == 0
    assert {b["borrower"] for b in c.borrows} == {bidirl.ROLLOUT, bidirl.TRAIN}, c.borrows
    assert summary["borrows"] == len(c.borrows) == len(c.backend.switch_log) // 2
    for b in c.borrows:
        assert b["switch_in_s"] > 0 and b["switch_out_s"] > 0
        assert b["predicted_switch_in_s"] > 0 and b["predicted_switch_out_s"] > 0
    ledger = summary["ledger"]
    dropped = sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    assert ledger["admitted"] == ledger.get("completed", 0) + dropped + c.unfinished()
    # everything given back: the rollout's own replicas, all serving the trainer's weights on the trainer's devices
    assert [r.id for r in c.backend.service.replicas] == own and all(r.alive for r in c.backend.service.replicas)
    assert _devices_of(c.trainer.params) == set(c.pool.devices_of("train"))
    for engine in c.backend.engines:
        assert engine.version == c.version
        for a, p in zip(jax.tree.leaves(engine.runner.params), jax.tree.leaves(c.trainer.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(p))


def test_d_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="rollout_replicas='group'"):
        Controller(init_decoder(CFG, seed=0), TOK, config=ControllerConfig(mode="async", bidirl=True),
                   engine_config=ENGINE, rollout_config=ROLLOUT, trainer_config=TRAINER, logdir="/tmp/unused",
                   checkpoints=False)
    with pytest.raises(ConfigError, match="hot-switches"):
        Controller(config=ControllerConfig(mode="async", bidirl=True), logdir="/tmp/unused", backend=object(),
                   checkpoints=False)
    b = _backend(rollout=1, train=3)
    with pytest.raises(ValueError, match="no idle rollout replica"):  # the only replica keeps serving
        asyncio.run(b.lend(bidirl.ROLLOUT, bidirl.TRAIN, 2))
    with pytest.raises(ValueError, match="no whole device group"):
        asyncio.run(b.lend(bidirl.TRAIN, bidirl.ROLLOUT, 1))
    with pytest.raises(ValueError, match="cannot lend ref devices"):
        asyncio.run(b.lend("ref", bidirl.TRAIN, 2))
    b.replica_mode = "mesh"
    with pytest.raises(ConfigError, match="rollout_replicas='group'"):
        asyncio.run(b.lend(bidirl.TRAIN, bidirl.ROLLOUT, 2))
    with pytest.raises(ConfigError, match="rollout_replicas='group'"):
        Controller(config=ControllerConfig(mode="async", bidirl=True), logdir="/tmp/unused", backend=b,
                   checkpoints=False)
    assert b._lent is None and all(r.alive for r in b.service.replicas)
