"""Rolling out the current policy on built-in tasks: GRPO groups for training, held-out success.

Both go through the real rollout path (the `Engine` with the policy's current weights, driven by a
`RolloutRunner`: multi-turn, tools, rewards from the task's environment), so what is measured is
what the system trains on.

- `sample_groups`: G samples of each task, one GRPO group per task (the rollout loop gives each
  sample of a group its own sampling seed, from the config's seed, the task id and the sample index).
- `heldout_reward`: mean reward over the first N held-out tasks of a kind (generator seed `seed`,
  the "heldout" split, which no training step draws from), greedy (temperature 0) or sampled with
  `samples` responses per task. For binary rewards that is the success rate.

- `heldout_results`: per-task rewards on a pooled held-out set of several kinds (task i is kind
  i mod K), the unit the main job's before / after comparison pairs (`rl/stats.py`).

A fresh `RolloutRunner` per call keeps group ids and metrics per call; the engine (and its compiled
programs and prefix cache) is shared.
"""

from __future__ import annotations

import asyncio
import statistics
import zlib
from typing import Sequence

from tiderl_jax.agents import tasks
from tiderl_jax.agents.env import Task
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.agents.trajectory import Trajectory
from tiderl_jax.engine.engine import Engine
from tiderl_jax.model.tokenizer import Tokenizer


def _make_env(task: Task):
    return tasks.make_env(task, seed=zlib.crc32(task.task_id.encode()))


def sample_groups(engine: Engine, tokenizer: Tokenizer, group_tasks: Sequence[Task], group_size: int,
                  config: RolloutConfig, progress=None) -> list[Trajectory]:
    """`group_size` rollouts of every task (group id = the task's position); trajectories in order.
    `progress(n)` (optional) hears how many have finished."""
    work = [(task, g) for g, task in enumerate(group_tasks) for _ in range(group_size)]
    runner = RolloutRunner(engine, tokenizer, config)
    if progress is None:
        return asyncio.run(runner.run(work, _make_env))
    finished = 0

    async def one(task, g):
        nonlocal finished
        traj = await runner.submit(task, g)
        finished += 1
        progress(finished)
        return traj

    async def run_all():
        await runner.start(_make_env)
        try:
            return list(await asyncio.gather(*(one(t, g) for t, g in work)))
        finally:
            await runner.stop()
    return asyncio.run(run_all())


def heldout_reward(engine: Engine, tokenizer: Tokenizer, kind: str, num_tasks: int,
                   config: RolloutConfig, *, samples: int = 1, seed: int = 0) -> float:
    """Mean reward of the policy on held-out tasks 0..num_tasks-1 of `kind` (temperature and seed
    from `config`; with temperature 0 use samples=1: greedy rollouts of a task are identical)."""
    heldout = [tasks.make_task(kind, i, "heldout", seed) for i in range(num_tasks)]
    trajectories = sample_groups(engine, tokenizer, heldout, samples, config)
    return statistics.fmean(t.reward for t in trajectories)


def heldout_tasks(kinds: Sequence[str], num_tasks: int, seed: int = 0) -> list[Task]:
    """The pooled held-out set: task i is held-out task i // K of kind i mod K (K kinds)."""
    return [tasks.make_task(kinds[i % len(kinds)], i // len(kinds), "heldout", seed) for i in range(num_tasks)]


def heldout_results(engine: Engine, tokenizer: Tokenizer, kinds: Sequence[str], num_tasks: int,
                    config: RolloutConfig, *, seed: int = 0, progress=None) -> dict:
    """One rollout of each pooled held-out task (greedy when `config.temperature` is 0; sampled with
    the per-task seeds of `config.seed` otherwise, so two calls with the same config draw the same
    random numbers and a before / after difference is the policy's). Returns
    {"task_ids": [...], "kinds": [...], "rewards": [...], "turns": [...], "end_reasons": [...]}."""
    heldout = heldout_tasks(kinds, num_tasks, seed)
    trajectories = sample_groups(engine, tokenizer, heldout, 1, config, progress=progress)
    return {"task_ids": [t.task_id for t in heldout], "kinds": [t.kind for t in heldout],
            "rewards": [float(t.reward) for t in trajectories],
            "turns": [len(t.turns) for t in trajectories], "end_reasons": [t.end_reason for t in trajectories]}
