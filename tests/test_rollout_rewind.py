"""An environment that crashes and comes back at an earlier turn (EnvRewound): the rollout cuts its
trajectory back to that turn and generates from there, ending exactly as a run without the crash."""

import asyncio
import copy

import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import EnvRewound, LatencyModel
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import Tokenizer

TOK = Tokenizer.builtin()
MODEL = init_decoder(ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True), seed=3)


class CrashingEnv:
    """The task's real environment, snapshotted (deep copy) after every step; at step `crash_at` it
    "crashes", restores the snapshot of turn `back_to` and raises EnvRewound, once."""

    def __init__(self, task, crash_at: int, back_to: int):
        self.env = T.make_env(task, latency=LatencyModel(0.0, 0.0))
        self.crash_at, self.back_to = crash_at, back_to
        self.snapshots, self.steps, self.crashed = [], 0, False

    async def reset(self, task):
        obs = await self.env.reset(task)
        self.snapshots = [copy.deepcopy(self.env)]
        return obs

    async def step(self, action):
        self.steps += 1
        if self.steps == self.crash_at and not self.crashed:
            self.crashed = True
            self.env = copy.deepcopy(self.snapshots[self.back_to])
            del self.snapshots[self.back_to + 1:]
            raise EnvRewound(self.back_to, None, 1, RuntimeError("sandbox died"))
        result = await self.env.step(action)
        self.snapshots.append(copy.deepcopy(self.env))
        return result


def _run(mode, make_env, temperature):
    engine = Engine(MODEL, EngineConfig(page_size=16, num_pages=512, max_seq_len=2048, max_running=8,
                                        prefill_chunk=256, decode_steps=4))
    runner = RolloutRunner(engine, TOK, RolloutConfig(max_turns=4, max_new_tokens=12, max_context=2048,
                                                      temperature=temperature, mode=mode))
    tasks = [(T.make_task("calculator", i), i) for i in range(3)]
    trajs = asyncio.run(runner.run(tasks, make_env))
    return trajs, runner.metrics


@pytest.mark.parametrize("mode", ["ctb", "request"])
@pytest.mark.parametrize("crash_at, back_to", [(3, 1), (2, 0)])
def test_a_rewound_task_ends_as_without_the_crash(mode, crash_at, back_to):
    clean, _ = _run(mode, lambda t: CrashingEnv(t, crash_at=99, back_to=0), temperature=1.0)
    faulted, metrics = _run(mode, lambda t: CrashingEnv(t, crash_at, back_to), temperature=1.0)
    assert metrics["rewinds"] == 3 and metrics["failed"] == 0
    for a, b in zip(clean, faulted):
        assert len(a.turns) >= crash_at  # the crash happened inside the task
        assert (a.tokens, a.loss_mask, a.end_reason, a.reward) == (b.tokens, b.loss_mask, b.end_reason, b.reward)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert len(b.turns) == len(a.turns)


def test_a_rewind_past_the_task_is_a_named_failure():
    class Bad(CrashingEnv):
        async def step(self, action):
            raise EnvRewound(7, None, 1, RuntimeError("bad restore"))
    trajs, metrics = _run("ctb", lambda t: Bad(t, 1, 0), temperature=0.0)
    assert metrics["failed"] == 3
    assert all(t.failure and "rewound to turn 7" in t.failure for t in trajs)
