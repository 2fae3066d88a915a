"""A GRPO group as the controller tracks it (runtime/controller.py) and the processes exchange it
(runtime/multihost.py). JAX-free."""

from __future__ import annotations

import asyncio
import dataclasses

from tiderl_jax.agents.env import Task


@dataclasses.dataclass
class Group:
    """One GRPO group in flight: its task, its samples' trajectories and what became of each."""

    gid: int
    task: Task
    trajectories: list = dataclasses.field(default_factory=list)
    launched: int = 0  # samples started in this process (a resumed group keeps its finished ones)
    finished: int = 0  # of those, how many ended (completed or dropped)
    errors: int = 0  # of those, how many raised or could never run (`prompt_too_long`)
    dropped: list = dataclasses.field(default_factory=list)  # samples that ended without training data
    arrived: float = 0.0  # when its last sample finished
    ref_job: asyncio.Future | None = None  # decoupled ref scoring in flight
