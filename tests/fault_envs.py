"""Test environments for the fault-tolerance tests, importable by environment subprocesses."""

from __future__ import annotations

import os
import pathlib
import random
import threading
import time

from tiderl_jax.agents.env import StepResult, Task


class CountingEnv:
    """Each observation shows the step count and a draw from a seeded RNG: a restore that lost
    either changes what the model sees. Answers "done" at step `task.data['steps']`. When
    `task.data['hang_marker']` names a file that does not exist yet, step `hang_at` creates it and
    then hangs (once per marker), to test timeouts."""

    def __init__(self, task: Task):
        self.rng = random.Random(task.task_id)
        self.count = 0
        self.task = task

    async def reset(self, task: Task) -> str:
        return f"start {task.task_id} {self.rng.randint(0, 10**6)}"

    async def step(self, action: str) -> StepResult:
        self.count += 1
        marker = self.task.data.get("hang_marker")
        if marker and self.count == self.task.data.get("hang_at") and not os.path.exists(marker):
            pathlib.Path(marker).touch()
            time.sleep(3600)  # noqa: ASYNC251 - a hung environment blocks its loop
        if action == "raise":
            raise KeyError("no such thing")
        done = self.count >= self.task.data.get("steps", 3)
        return StepResult(None if done else f"step {self.count} after {action!r} {self.rng.randint(0, 10**6)}",
                          float(self.count) if done else 0.0, done)


def make_counting(task: Task) -> CountingEnv:
    return CountingEnv(task)


class LockedEnv(CountingEnv):
    """Holds a lock: its state cannot be pickled."""

    def __init__(self, task: Task):
        super().__init__(task)
        self.guard = threading.Lock()


def make_locked(task: Task) -> LockedEnv:
    return LockedEnv(task)
