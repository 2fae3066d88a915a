"""The rollout service: sessions over N engine replicas behind the router policies, against one engine.

Every replica is the same tiny model on its own faked CPU device; greedy rollouts through any number of
replicas, any policy, a replica failing or leaving mid-run must give the trajectories one engine gives."""

import asyncio
import dataclasses

import jax
import pytest
from flax import nnx

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import StepResult, Task
from tiderl_jax.agents.rollout import EngineFailed, RolloutConfig, RolloutRunner
from tiderl_jax.engine.engine import Engine, EngineConfig, Request
from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.policies import routing
from tiderl_jax.policies.misa_t import MISATConfig
from tiderl_jax.runtime.devices import model_on
from tiderl_jax.serving.service import RolloutService, ServiceConfig

TOK = Tokenizer.builtin()
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")
GRAPHDEF, PARAMS = nnx.split(init_decoder(CFG, seed=0))
ENGINE = EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=16, prefill_chunk=256,
                      decode_steps=4)
TASKS = [(T.make_task(k, i), i) for i in range(3) for k in ("calculator", "lookup")]
ROLLOUT = RolloutConfig(max_turns=3, max_new_tokens=16, temperature=0.0, max_context=1024)


def _engine(device: int, config: EngineConfig = ENGINE) -> Engine:
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, [jax.devices()[device]])
    return Engine(model_on(GRAPHDEF, PARAMS, mesh, DEFAULT_RULES), config)


def _run(engine_or_service, tasks=TASKS, rollout=ROLLOUT, during=None):
    runner = RolloutRunner(engine_or_service, TOK, rollout)

    async def main():
        await runner.start(T.make_env)
        try:
            work = asyncio.gather(*(runner.submit(t, g) for t, g in tasks))
            if during is not None:
                await during(runner)
            return await asyncio.wait_for(work, 120)
        finally:
            await asyncio.wait_for(runner.stop(), 30)
    return runner, asyncio.run(main())


@pytest.fixture(scope="module")
def reference():
    """The trajectories of one engine (CTB, greedy): what every service run must give."""
    return {mode: [t.tokens for t in _run(_engine(0), rollout=ROLLOUT.__class__(**{**ROLLOUT.__dict__, "mode": mode})
                                          )[1]]
            for mode in ("ctb", "request")}


def _service(n: int, policy: str = "least_loaded", **kw) -> RolloutService:
    return RolloutService([_engine(i) for i in range(n)], ServiceConfig(policy=policy, **kw))


def _break_after(engine: Engine, calls: int, error: Exception = MemoryError("RESOURCE_EXHAUSTED: injected")):
    step, done = engine.step, []

    def broken():
        if len(done) < calls:
            done.append(1)
            return step()
        raise error
    engine.step = broken


# ---------------------------------------------------------------- the engine's face to the router

def test_cached_prefix_tokens_is_what_a_submit_finds_and_load_counts_the_queue():
    engine = _engine(0)
    prompt = list(range(1, 101))
    engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4))  # its full blocks stay cached
    assert engine.cached_prefix_tokens(prompt) == 96  # 6 whole blocks; never the last token
    assert engine.cached_prefix_tokens(prompt[:40] + [7] * 60) == 32  # the blocks before the first change
    assert engine.cached_prefix_tokens([5, 6, 7] * 40) == 0
    before = engine.stats()["prompt_tokens_cached"]
    free = engine.free_kv_tokens()
    h = engine.submit(Request(prompt + [200] * 20, SamplingParams(temperature=0.0, max_new_tokens=4)))
    g = engine.submit(Request([9] * 30, SamplingParams(temperature=0.0, max_new_tokens=4)))
    assert engine.free_kv_tokens() == free  # the lookup took nothing
    assert engine.load() == dict(running=0, waiting=2, queued_tokens=120 + 30, pinned_kv_tokens=0)
    engine.step()
    assert engine.stats()["prompt_tokens_cached"] - before == 96
    engine.run([h, g])
    engine.pin(h)
    assert engine.load()["pinned_kv_tokens"] == 0  # finished: it holds no KV


# ---------------------------------------------------------------- sessions over replicas

@pytest.mark.parametrize("policy", sorted(routing.POLICIES))
def test_every_policy_over_three_replicas_gives_the_single_engine_trajectories(policy, reference):
    service = _service(3, policy)
    runner, trajs = _run(service)
    assert [t.tokens for t in trajs] == reference["ctb"]
    c = service.counters
    assert c["turns"] == sum(len(t.turns) for t in trajs) and c["rerouted"] == 0
    assert c["resumed"] + c["submitted"] == c["turns"]
    if policy in ("round_robin", "least_loaded"):  # light load: every continuation stays with its KV
        assert c["moved"] == 0 and c["submitted"] == len(TASKS)
        assert all(s["prompt_tokens"] > 0 for s in service.stats())  # every replica served sessions
    stats = service.stats()
    assert [s["replica"] for s in stats] == [0, 1, 2] and all(s["alive"] for s in stats)
    assert all(s["sessions"] == 0 and s["running"] == 0 and s["kv_pinned_tokens"] == 0 for s in stats)
    assert sum(s["steps"] for s in stats) > 0 and any(s["tokens_per_s"] > 0 for s in stats)
    assert 0.0 <= service.kv_hit_rate() <= 1.0


def test_request_level_turns_follow_their_prefix_with_the_cache_aware_router(reference):
    service = _service(2, "cache_aware")
    _, trajs = _run(service, rollout=RolloutConfig(**{**ROLLOUT.__dict__, "mode": "request"}))
    assert [t.tokens for t in trajs] == reference["request"]
    # each later turn resubmits the whole context; its prefix is cached where its last turn ran
    assert service.counters["moved"] == 0 and service.counters["resumed"] == 0
    assert service.kv_hit_rate() > 0.3


def test_a_failed_replica_s_sessions_finish_on_the_others(reference):
    service = _service(3)
    _break_after(service.engines[1], 3)
    runner, trajs = _run(service)
    assert [t.tokens for t in trajs] == reference["ctb"]  # nothing lost: the turns ran again elsewhere
    assert all(t.failure is None for t in trajs)
    c = service.counters
    assert c["replica_failures"] == 1 and c["rerouted"] >= 1
    assert [s["alive"] for s in service.stats()] == [True, False, True]


def test_with_every_replica_failed_every_turn_fails_with_the_engine_error():
    service = _service(2)
    for engine in service.engines:
        _break_after(engine, 1)
    runner = RolloutRunner(service, TOK, ROLLOUT)

    async def main():
        await runner.start(T.make_env)
        try:
            return await asyncio.wait_for(asyncio.gather(*(runner.submit(t, g) for t, g in TASKS),
                                                         return_exceptions=True), 60)
        finally:
            await asyncio.wait_for(runner.stop(), 10)
    results = asyncio.run(main())
    assert all(isinstance(r, EngineFailed) for r in results), results
    assert all("MemoryError: RESOURCE_EXHAUSTED: injected" in str(r) for r in results)
    assert service.counters["replica_failures"] == 2


def test_a_replica_removed_and_one_added_mid_run_lose_nothing(reference):
    service = _service(2)
    moved = []

    async def during(runner):
        while service.counters["turns"] < 4:
            await asyncio.sleep(0.01)
        new = service.add_replica(_engine(5))
        moved.append(await service.remove_replica(0))
        assert [r.id for r in service.replicas] == [1, new]
    _, trajs = _run(service, during=during)
    assert [t.tokens for t in trajs] == reference["ctb"]
    assert moved and service.counters["rerouted"] == 0
    with pytest.raises(KeyError, match="no replica 0"):
        service.replica(0)


class _Answer:  # a single-turn environment: the first reply ends the session
    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        return StepResult(None, 1.0, True, {})


def test_misa_t_admits_a_starved_class_within_its_bound_through_the_service(monkeypatch):
    """One session fits at a time and the target is 99% rlhf: mixture steering alone would hold the second
    agentic session until every rlhf session ran. The starvation bound admits it first once it has been held
    max_hold_epochs epochs (MISA-T's rule; an epoch is one routing call of the service)."""
    hold = 4
    cfg = MISATConfig(target={"agentic": 1.0, "rlhf": 99.0}, prior_kv_tokens={"agentic": 111, "rlhf": 111},
                      prior_residency_s={"agentic": 1.0, "rlhf": 1.0}, max_hold_epochs=hold)
    # every session holds 111 tokens of KV (a 107-token prompt, 4 new); the replica holds 160: one at a time
    small = dataclasses.replace(ENGINE, num_pages=11, max_seq_len=160)
    service = RolloutService([_engine(0, small)], ServiceConfig(policy="misa_t", router=routing.RouterConfig(misa_t=cfg)))
    decisions = []  # (epoch, {session: "placed" | "held"}) of every routing call that saw a new session
    route = routing.route

    def recording(policy, requests, replicas, state, config, **kw):
        out = route(policy, requests, replicas, state, config, **kw)
        placed = {p.request_id for p in out.placements}
        seen = {(r.cls, r.session): "placed" if r.request_id in placed else "held" for r in requests if r.turn == 0}
        if seen:
            decisions.append((state.misa_t.epoch, seen))
        return out
    monkeypatch.setattr(routing, "route", recording)

    def task(cls, i):
        return Task(f"{cls}-{i}", cls, "hello", "", {"workload_class": cls, "max_turns": 1, "max_new_tokens": 4})
    tasks = [task("rlhf", 0), task("agentic", 0), task("agentic", 1)] + [task("rlhf", i) for i in range(1, 12)]
    # the runner's own CTB admission out of the way: the router is the admission point
    runner = RolloutRunner(service, TOK, dataclasses.replace(ROLLOUT, max_context=160, kv_budget_tokens=10**9))

    async def main():
        await runner.start(lambda t: _Answer())
        try:
            return await asyncio.wait_for(asyncio.gather(*(runner.submit(t, g) for g, t in enumerate(tasks))), 120)
        finally:
            await asyncio.wait_for(runner.stop(), 30)
    trajs = asyncio.run(main())
    assert all(t.failure is None and t.reward == 1.0 for t in trajs)  # nothing lost
    order = [(epoch, session) for epoch, seen in decisions for session, what in seen.items() if what == "placed"]
    first_held = {}
    for epoch, seen in decisions:
        for session, what in seen.items():
            if what == "held":
                first_held.setdefault(session, epoch)
    sessions = [session for _, session in order]
    assert len(set(sessions)) == len(sessions) == len(tasks)  # each admitted once
    late = [s for s in sessions if s[0] == "agentic"][1]  # the first one is the mixture's pick; this one starves
    overdue_at = first_held[late] + hold
    admitted_at = next(epoch for epoch, s in order if s == late)
    # once overdue, only sessions held before it (older, overdue first) went ahead of it: it did not wait for the
    # rlhf stream to drain
    assert not [s for epoch, s in order if overdue_at <= epoch < admitted_at and s != late
                and first_held.get(s, epoch) >= first_held[late]]
    assert sessions.index(late) < len(sessions) - 1, sessions


def test_bad_service_configs_are_named():
    with pytest.raises(ValueError, match="serving policy 'nope' is not one of"):
        ServiceConfig(policy="nope")
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutService([])


# ---------------------------------------------------------------- the controller through the service

class ParityEnv:
    """One turn; reward 1 for a reply of even length (rewards vary within a group: GRPO has a signal)."""

    async def reset(self, task):
        return task.prompt

    async def step(self, action):
        await asyncio.sleep(0.01)
        from tiderl_jax.agents.env import StepResult
        return StepResult(None, float(len(action) % 2 == 0), True)


def _controller(tmp_path, mode="tiderl", **kw):
    from tiderl_jax.rl.losses import LossConfig
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller import Controller, ControllerConfig

    cfg = ControllerConfig(mode=mode, **{**dict(steps=2, groups_per_step=2, group_size=2, max_concurrent=8,
                                                rollout_replicas="group", ers_patience=1, ers_cooldown=0), **kw})
    return Controller(init_decoder(CFG, seed=0), TOK, config=cfg, engine_config=ENGINE,
                      rollout_config=RolloutConfig(max_turns=1, max_new_tokens=12, max_context=1024),
                      trainer_config=TrainerConfig(loss=LossConfig(kl_coef=0.05), learning_rate=1e-3, warmup_steps=0,
                                                   total_steps=10, row_len=1024, micro_rows=4),
                      logdir=str(tmp_path / mode), make_env=lambda t: ParityEnv())


def _serves_the_trainer_s_weights(c):
    import numpy as np

    for engine in c.backend.engines:
        assert engine.version == c.version
        for a, b in zip(jax.tree.leaves(engine.runner.params), jax.tree.leaves(c.trainer.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _device_set(engine):
    return set(jax.tree.leaves(engine.runner.params)[0].sharding.device_set)


@pytest.mark.parametrize("mode,router", [("tiderl", "misa_t"), ("sync", "least_loaded")])
def test_the_controller_rolls_out_through_one_replica_per_device_group(tmp_path, mode, router):
    c = _controller(tmp_path, mode, router=router, ers=False)
    summary = asyncio.run(c.run())
    assert summary["steps"] == 2 and summary["syncs_failed"] == 0
    service = c.backend.service
    groups = 2 if mode == "tiderl" else 4  # tiderl: the pool's 2 rollout groups; sync: 8 devices / 2
    assert len(service.replicas) == groups and all(s["prompt_tokens"] > 0 for s in service.stats())
    if mode == "tiderl":
        assert [_device_set(e) for e in c.backend.engines] == [
            set(c.pool.group_devices(g)) for g in sorted(c.pool.roles["rollout"])]
    _serves_the_trainer_s_weights(c)
    ledger = summary["ledger"]
    ended = sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    assert ledger["admitted"] == ledger.get("completed", 0) + ended + c.unfinished()


def test_ers_moves_whole_replicas_between_rollout_and_training(tmp_path, monkeypatch):
    from tiderl_jax.policies import ers
    moves = [ers.Move("train", "rollout", "decoupled", "generation deficit"),
             ers.Move("rollout", "train", "decoupled", "consumption deficit")]
    monkeypatch.setattr(ers, "decide", lambda *a, **k: (moves.pop() if moves else None, ers.ERSHistory()))
    c = _controller(tmp_path, steps=3)
    first = [r.id for r in c.backend.service.replicas]
    summary = asyncio.run(c.run())
    assert summary["steps"] == 3 and [(m["frm"], m["to"]) for m in c.moves] == [("rollout", "train"),
                                                                              ("train", "rollout")]
    service = c.backend.service
    # the rollout's highest group left as a replica, then the train's came back as a new one
    assert [r.id for r in service.replicas] == [first[0], first[-1] + 1]
    assert c.pool.num_groups("rollout") == 2 and c.pool.num_groups("train") == 1
    assert [_device_set(e) for e in c.backend.engines] == [
        set(c.pool.group_devices(g)) for g in sorted(c.pool.roles["rollout"])]
    assert set(jax.tree.leaves(c.trainer.params)[0].sharding.device_set) == set(c.pool.devices_of("train"))
    _serves_the_trainer_s_weights(c)
    assert service.counters["rerouted"] == 0


@pytest.mark.e2e
def test_each_replica_s_worker_fails_over_to_its_own_standby(tmp_path):
    """Belayer per replica: every rollout device group's replica is an engine worker with a warm standby; SIGKILL
    one replica's primary mid-run: its standby takes over (token checkpoints), the other replica never notices,
    and every sample is accounted for."""
    import os
    import signal

    c = _controller(tmp_path, "async", engine_workers=True, engine_worker_warmup=False,
                    engine_worker_health_checks=100, steps=2)
    engines = c.backend.engines
    assert len(engines) == 2 and len({e.client.primary.pid for e in engines}) == 2  # one worker per replica
    killed = []

    async def killer():
        client = engines[0].client
        while not killed:
            await asyncio.sleep(0.05)
            if engines[0].has_work() and client.standby is not None and client.standby.ready.is_set():
                killed.append(client.primary.pid)
                os.kill(client.primary.pid, signal.SIGKILL)

    async def main():
        k = asyncio.create_task(killer())
        try:
            return await c.run()
        finally:
            k.cancel()
    summary = asyncio.run(main())
    assert summary["steps"] == 2 and killed
    assert len(engines[0].client.failovers) >= 1 and not engines[1].client.failovers
    assert c.backend.service.counters["replica_failures"] == 0  # the standby promoted inside the replica
    ledger = summary["ledger"]
    dropped = sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    assert dropped == 0 and ledger["admitted"] == ledger["completed"] + c.unfinished()
    assert all(e.version == c.version for e in engines)


def test_bad_replica_settings_are_named():
    from tiderl_jax.model.config import ConfigError
    from tiderl_jax.runtime.controller import ControllerConfig

    with pytest.raises(ConfigError, match="controller.rollout_replicas='each' is not 'mesh'"):
        ControllerConfig(rollout_replicas="each")
    with pytest.raises(ConfigError, match="controller.router='fastest' is not one of"):
        ControllerConfig(router="fastest")
    with pytest.raises(ConfigError, match="engine_workers serve request-level rollouts"):
        ControllerConfig(mode="tiderl", engine_workers=True, rollout_replicas="group")
