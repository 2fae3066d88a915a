"""Failures that no later sample can escape end the run with their error named, instead of hanging or
going on quietly: an exception in the engine's step (every waiting turn and later command fails with
`EngineFailed`), weight syncs failing SYNC_FAILURES_LIMIT times in a row, and a prompt longer than
the context allows (`prompt_too_long`)."""

import asyncio
import logging
import time

import pytest

import tiderl_jax.sim as sim_py
from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import LatencyModel, StepResult
from tiderl_jax.agents.rollout import EngineFailed, RolloutConfig, RolloutRunner
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.rl.losses import LossConfig
from tiderl_jax.rl.trainer_config import TrainerConfig
from tiderl_jax.runtime import controller as controller_lib
from tiderl_jax.runtime.controller import Controller, ControllerConfig
from tiderl_jax.sim.backend import SimConfig

TOK = Tokenizer.builtin()
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")
ENGINE = EngineConfig(page_size=16, num_pages=256, max_seq_len=1024, max_running=16, prefill_chunk=256,
                      decode_steps=4)
TASKS = [(T.make_task("calculator", i), i) for i in range(4)]
INJECTED = "injected: attention_impl 'nope' is not one of ('xla', 'pallas')"


def _break_after(engine, calls: int, error: Exception = ValueError(INJECTED)) -> list:
    """The engine's step works `calls` times, then raises `error`; returns the times it raised."""
    step, done, raised = engine.step, [], []

    def broken():
        if len(done) < calls:
            done.append(1)
            return step()
        raised.append(time.perf_counter())
        raise error
    engine.step = broken
    return raised


# ---------------------------------------------------------------- the rollout loop


def _runner(engine, **kw):
    return RolloutRunner(engine, TOK, RolloutConfig(**{**dict(max_turns=2, max_new_tokens=16, temperature=1.0,
                                                              max_context=1024), **kw}))


def test_an_engine_step_error_makes_rollout_runner_run_raise_not_hang():
    # evaluation runs `RolloutRunner.run`: it must raise the engine's error, not wait forever
    engine = Engine(init_decoder(CFG, seed=0), ENGINE)
    raised = _break_after(engine, 2)
    runner = _runner(engine)
    with pytest.raises(EngineFailed, match="rollout engine step failed: ValueError: injected") as e:
        asyncio.run(asyncio.wait_for(runner.run(TASKS, T.make_env), 60))
    assert isinstance(e.value.__cause__, ValueError) and raised


@pytest.mark.parametrize("mode", ["ctb", "request"])
def test_every_pending_turn_and_every_later_command_fails_with_the_engine_error(mode):
    engine = Engine(init_decoder(CFG, seed=0), ENGINE)
    _break_after(engine, 0, MemoryError("RESOURCE_EXHAUSTED: out of device memory"))
    runner = _runner(engine, mode=mode, kv_budget_tokens=200)  # (ctb: some tasks queue for admission)

    async def main():
        await runner.start(T.make_env)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(runner.submit(t, g) for t, g in TASKS),
                                                            return_exceptions=True), 60)
            later = runner.command(lambda: "never runs")
            assert later.done()  # failed at once: nobody is left to run it
            with pytest.raises(EngineFailed, match="MemoryError: RESOURCE_EXHAUSTED"):
                await later
            return results
        finally:
            await asyncio.wait_for(runner.stop(), 10)
    results = asyncio.run(main())
    assert len(results) == len(TASKS) and all(isinstance(r, EngineFailed) for r in results)
    assert all("rollout engine step failed: MemoryError: RESOURCE_EXHAUSTED" in str(r) for r in results)


def test_a_prompt_longer_than_the_context_is_a_named_failure(caplog):
    engine = Engine(init_decoder(CFG, seed=0), ENGINE)
    runner = _runner(engine, max_context=64, max_new_tokens=20)
    with caplog.at_level(logging.WARNING, logger="tiderl_jax.agents.rollout"):
        trajs = asyncio.run(runner.run(TASKS[:2], T.make_env))
    for (task, _), t in zip(TASKS, trajs):
        n = len(t.tokens)
        assert n + 20 > 64 and t.num_generated == 0 and t.reward == 0.0
        assert t.end_reason == "prompt_too_long"
        assert t.failure == (f"the prompt is {n} tokens; rollout.max_context=64 leaves room for at most 44 "
                             f"with max_new_tokens=20")
        assert any(task.task_id in r.getMessage() for r in caplog.records)
    assert runner.metrics["failed"] == 2 and runner.metrics["completed"] == 0
    assert not engine.has_work()  # nothing reached the engine


# ---------------------------------------------------------------- the controller (real backend)


class ParityEnv:
    """One turn; reward 1 when the reply has an even number of characters."""

    async def reset(self, task):
        await asyncio.sleep(0.01)
        return task.prompt

    async def step(self, action):
        await asyncio.sleep(0.02)
        return StepResult(None, float(len(action) % 2 == 0), True)


def _controller(tmp_path, mode="async", rollout=None, **kw):
    cfg = ControllerConfig(mode=mode, **{**dict(steps=3, groups_per_step=2, group_size=2, max_concurrent=8), **kw})
    return Controller(
        init_decoder(CFG, seed=0), TOK, config=cfg, engine_config=ENGINE,
        rollout_config=rollout or RolloutConfig(max_turns=1, max_new_tokens=16, max_context=1024),
        trainer_config=TrainerConfig(loss=LossConfig(kl_coef=0.05), learning_rate=1e-3, warmup_steps=0,
                                     total_steps=10, row_len=1024, micro_rows=4),
        latency=LatencyModel(), logdir=str(tmp_path / mode), make_env=lambda t: ParityEnv())


@pytest.mark.timeout(120)
def test_an_engine_step_error_ends_the_controller_run_promptly_with_the_error(tmp_path):
    c = _controller(tmp_path)
    raised = _break_after(c.engine, 2)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(asyncio.wait_for(c.run(), 60))
    ended = time.perf_counter()
    assert not isinstance(e.value, asyncio.TimeoutError)
    assert "ValueError: " + INJECTED in str(e.value) and "rollout engine step failed" in str(e.value)
    assert raised and ended - raised[0] < 10.0  # seconds after the failure, not groups or forever later
    assert c.step == 0 and c.checkpointer.latest_step() == 0  # the run's `finally` still saved


@pytest.mark.timeout(120)
def test_a_context_too_small_for_any_prompt_ends_the_run_with_the_reason(tmp_path):
    c = _controller(tmp_path, rollout=RolloutConfig(max_turns=1, max_new_tokens=16, max_context=48))
    with pytest.raises(RuntimeError) as e:
        asyncio.run(asyncio.wait_for(c.run(), 60))
    message = str(e.value)
    assert f"every sample of the last {controller_lib.FAILED_GROUPS_LIMIT} groups failed" in message
    assert "prompt_too_long: the prompt is" in message and "rollout.max_context=48" in message
    assert c.ledger["dropped:prompt_too_long"] >= controller_lib.FAILED_GROUPS_LIMIT * 2
    assert c.ledger.get("completed", 0) == 0


@pytest.mark.timeout(120)
def test_repeated_weight_sync_failures_stop_the_run_with_the_sync_error(tmp_path, monkeypatch):
    # the real sync path (WeightSync: prepare, drain, move, publish) fails at its publish stage every
    # time; the train step itself is stubbed out (its compile is not what this tests). eta=3: a
    # rollout up to 3 versions behind still makes fresh samples, so SYNC_FAILURES_LIMIT is what stops
    c = _controller(tmp_path, steps=6, eta=3)

    def refuse(params, version):
        raise RuntimeError("injected sync failure")
    c.engine.update_params = refuse

    async def train(trajectories):
        return dict(tokens=sum(t.num_generated for t in trajectories), reward=0.0)
    monkeypatch.setattr(c.backend, "train", train)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(asyncio.wait_for(c.run(), 60))
    limit = controller_lib.SYNC_FAILURES_LIMIT
    assert f"{limit} weight syncs in a row failed" in str(e.value)
    assert "RuntimeError: injected sync failure (at the publish stage)" in str(e.value)
    assert c.syncs_failed == limit and c.step == limit and c.version == limit and c.engine.version == 0
    assert c.backend.last_sync_error == "RuntimeError: injected sync failure (at the publish stage)"


# ---------------------------------------------------------------- the controller (simulated backend)


def _sim_run(tmp_path, monkeypatch, outcomes, mode="async", eta=3):
    """A simulated run whose weight syncs succeed or fail by `outcomes` (one per version, one per step)."""
    python = sim_py.python_reference()  # (a compiled class cannot be patched)
    publish = python.SimBackend.publish

    async def flaky(self, version):
        if outcomes[version - 1]:
            return await publish(self, version)
        self.last_sync_error = f"device_put to version {version} timed out"
        return False
    monkeypatch.setattr(python.SimBackend, "publish", flaky)
    config = ControllerConfig(mode=mode, eta=eta, steps=len(outcomes), groups_per_step=2, group_size=2,
                              max_concurrent=8, device_group_size=2, rollout_groups=2, ref_groups=0, train_groups=2,
                              tensor=1)
    return python.run(SimConfig(), config, num_devices=8, logdir=str(tmp_path / "sim"))


def test_a_successful_sync_resets_the_count_of_failures(tmp_path, monkeypatch):
    limit = controller_lib.SYNC_FAILURES_LIMIT
    outcomes = ([False] * (limit - 1) + [True]) * 2
    summary, _, _ = _sim_run(tmp_path, monkeypatch, outcomes)
    assert summary["steps"] == len(outcomes) and summary["syncs_failed"] == 2 * (limit - 1)


def test_sync_failures_in_a_row_stop_the_simulated_run(tmp_path, monkeypatch):
    limit = controller_lib.SYNC_FAILURES_LIMIT
    outcomes = [True] + [False] * 10
    with pytest.raises(RuntimeError, match=f"{limit} weight syncs in a row failed") as e:
        _sim_run(tmp_path, monkeypatch, outcomes)
    assert f"to version {limit + 1}: device_put to version {limit + 1} timed out" in str(e.value)


@pytest.mark.parametrize("mode,eta", [("sync", 0), ("async", 1)])
def test_sync_failures_past_the_staleness_bound_stop_the_run_sooner(tmp_path, monkeypatch, mode, eta):
    # a rollout more than eta versions behind makes only samples the staleness bound drops: waiting
    # for SYNC_FAILURES_LIMIT would wait forever (no step, so no sync is tried again)
    with pytest.raises(RuntimeError, match=f"{eta + 1} weight syncs in a row failed") as e:
        _sim_run(tmp_path, monkeypatch, [True] + [False] * 6, mode=mode, eta=eta)
    assert f"to version {eta + 2}: device_put" in str(e.value) and f"eta={eta}" in str(e.value)
