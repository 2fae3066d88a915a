"""The rollout service: sessions over N engine replicas behind the router policies, against one engine.

Every replica is the same tiny model on its own faked CPU device; greedy rollouts through any number of
replicas, any policy, a replica failing or leaving mid-run must give the trajectories one engine gives."""

import asyncio

import jax
import pytest
from flax import nnx

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.rollout import EngineFailed, RolloutConfig, RolloutRunner
from tiderl_jax.engine.engine import Engine, EngineConfig, Request
from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.policies import routing
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


def test_bad_service_configs_are_named():
    with pytest.raises(ValueError, match="serving policy 'nope' is not one of"):
        ServiceConfig(policy="nope")
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutService([])
