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
  i mod K), the unit the main job's before / after comparison pairs (`rl/stats.py`);
  `heldout_trajectories` and `results_of` are its two halves, for a caller that keeps the rollouts.
- `save_readable`: rollouts as JSONL a person can read (decoded text, turns, reward, end reason).

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
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.engine import Engine
from tiderl_jax.serving.service import RolloutService
from tiderl_jax.model.tokenizer import Tokenizer


def _make_env(task: Task):
    return tasks.make_env(task, seed=zlib.crc32(task.task_id.encode()))


def sample_groups(engine: "Engine | RolloutService", tokenizer: Tokenizer, group_tasks: Sequence[Task], group_size: int,
                  config: RolloutConfig, progress=None, make_env=None) -> list[Trajectory]:
    """`group_size` rollouts of every task (group id = the task's position) on `engine` (one engine, or a rollout
    service of several replicas); trajectories in order.
    `progress(n)` (optional) hears how many have finished. `make_env`: the tasks' environments
    (a dataset's, `data/env.py`); the built-in kinds' by default."""
    make_env = make_env or _make_env
    work = [(task, g) for g, task in enumerate(group_tasks) for _ in range(group_size)]
    runner = RolloutRunner(engine, tokenizer, config)
    if progress is None:
        return asyncio.run(runner.run(work, make_env))
    finished = 0

    async def one(task, g):
        nonlocal finished
        traj = await runner.submit(task, g)
        finished += 1
        progress(finished)
        return traj

    async def run_all():
        await runner.start(make_env)
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
    return results_of(heldout_trajectories(engine, tokenizer, kinds, num_tasks, config, seed=seed,
                                           progress=progress))


def heldout_trajectories(engine: Engine, tokenizer: Tokenizer, kinds: Sequence[str], num_tasks: int,
                         config: RolloutConfig, *, seed: int = 0, progress=None, dataset_tasks: Sequence[Task] = (),
                         make_env=None) -> list[Trajectory]:
    """`heldout_results`' rollouts themselves, one per pooled held-out task, in task order. `dataset_tasks`
    (a dataset's held-out split, `data/env.py`'s `build_data`): its first `num_tasks` instead of the
    built-in kinds', with their `make_env`."""
    heldout = list(dataset_tasks)[:num_tasks] if dataset_tasks else heldout_tasks(kinds, num_tasks, seed)
    return sample_groups(engine, tokenizer, heldout, 1, config, progress=progress, make_env=make_env)


def results_of(trajectories: Sequence[Trajectory]) -> dict:
    """`heldout_results`' per-task lists from its rollouts."""
    return {"task_ids": [t.task_id for t in trajectories], "kinds": [t.kind for t in trajectories],
            "rewards": [float(t.reward) for t in trajectories],
            "turns": [len(t.turns) for t in trajectories], "end_reasons": [t.end_reason for t in trajectories]}


def readable(traj: Trajectory, tokenizer: Tokenizer) -> dict:
    """A rollout for a person: the whole text decoded (prompt, the model's turns, tool results), each
    turn's generated text, the token ids, reward, turns and end reason. Ids past the tokenizer's vocabulary
    (a model's padded rows) are decoded as nothing."""
    def text(ids):
        return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
    return {"task_id": traj.task_id, "kind": traj.kind, "reward": float(traj.reward), "end_reason": traj.end_reason,
            "failure": traj.failure, "num_turns": len(traj.turns), "text": text(traj.tokens),
            "turns": [{"text": text(traj.tokens[t.start:t.end]), "tokens": t.end - t.start,
                       "generate_s": t.generate_s, "env_s": t.env_s, "malformed": t.malformed} for t in traj.turns],
            "tokens": list(traj.tokens), "model_written": [int(m) for m in traj.loss_mask]}


def save_readable(trajectories: Sequence[Trajectory], tokenizer: Tokenizer, path: str) -> str:
    """Writes `readable` rollouts as JSONL (one per line; a temporary file renamed into place)."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for t in trajectories:
            f.write(json.dumps(readable(t, tokenizer)) + "\n")
    os.replace(tmp, path)
    return path
