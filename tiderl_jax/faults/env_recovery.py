"""Recovery from an environment's crash by restore and rewind (Belayer, environment failure: docs/mechanisms.md),
and the pool of environment processes the controller reuses across tasks.

`CheckpointingEnv`: an `EnvWorker` (`env_worker.py`) that snapshots at safe turn boundaries and recovers. Before a
step it decides with `belayer.should_checkpoint(p_fail, redo_cost, checkpoint_s, overlap_s)`
whether the boundary after it gets a snapshot; if so the child replies to the step first, then
snapshots while the model generates its next turn and pushes the state unasked (no extra request:
a round trip costs the event loop two syscalls, and on a loaded host each one a GIL hand-back).
The parent picks the pushed state up during its next call to that child; a next request that
arrives before the snapshot is done waits (`checkpoint_wait_s`: only what outlasts the generation
is visible). `redo_cost` is the measured environment plus generation seconds of the turns since
the last snapshot (the coming step's environment time taken as the mean so far),
`checkpoint_s` the last snapshot's measured time, `overlap_s` the mean generation time so far.
When a step (or a pending snapshot) finds the child dead or hung, it asks `belayer.decide_retry`
(the budget is `max_retries` recoveries per episode): it restarts the child, restores the last
snapshot (or resets the task: turn 0) and raises `EnvRewound(turn, observation, attempt)`; the caller cuts its
trajectory back to just after that turn's observation and generates from there. Past the budget
it raises `TaskDropped` with the reason. A crash during `reset` is retried the same way, silently
(there is nothing to rewind).

`EnvPool` hands out `CheckpointingEnv`s (each one process) to tasks and takes them back when a task ends.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from tiderl_jax.agents import tasks
from tiderl_jax.agents.env import EnvRewound, Environment, Observation, StepResult, Task
from tiderl_jax.faults.env_worker import EnvSnapshot, EnvWorker
from tiderl_jax.faults.errors import SnapshotError, TaskDropped, WorkerCrashed, WorkerTimeout
from tiderl_jax.policies import belayer

CHECKPOINT_MODES = ("belayer", "always", "never")


# ----------------------------------------------------------------------------------- CheckpointingEnv


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    mode: str = "belayer"  # "belayer": the cost rule; "always" / "never": every boundary / none
    p_fail: float = 0.05  # probability that the environment fails before the next turn boundary
    max_retries: int = 3  # recoveries (restore or redo) per episode before the task is dropped
    step_timeout_s: float = 30.0  # a reset / step / snapshot / restore outliving this is a failure
    checkpoint_s_guess: float = 0.005  # snapshot seconds assumed until one is measured

    def __post_init__(self):
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(f"CheckpointConfig.mode={self.mode!r} is not one of {CHECKPOINT_MODES}")
        if not 0.0 <= self.p_fail <= 1.0:
            raise ValueError(f"CheckpointConfig.p_fail={self.p_fail} must be in [0, 1]")
        if self.max_retries < 0:
            raise ValueError(f"CheckpointConfig.max_retries={self.max_retries} must be >= 0")
        if not self.step_timeout_s > 0 or not self.checkpoint_s_guess >= 0:
            raise ValueError(f"CheckpointConfig: step_timeout_s={self.step_timeout_s} must be > 0 and "
                             f"checkpoint_s_guess={self.checkpoint_s_guess} >= 0")


class CheckpointingEnv:
    """An `Environment` in a subprocess with Belayer checkpoints and crash recovery (module docstring)."""

    def __init__(self, make_env: Callable[[Task], Environment] = tasks.make_env,
                 config: CheckpointConfig = CheckpointConfig(), *, start_method: str = "forkserver"):
        self.config = config
        self.worker = EnvWorker(make_env, timeout_s=config.step_timeout_s, start_method=start_method)
        self.worker.on_snapshot = self._pushed
        self.task: Task | None = None
        self.turn = 0  # completed steps of the current episode
        self.attempts = 0  # recoveries so far in this episode
        self.snapshot: EnvSnapshot | None = None  # the latest good snapshot
        self._asked: tuple[int, int, Any] | None = None  # (request seq, turn, observation) of a snapshot on its way
        self._snapshot_error: str | None = None
        self._last_obs: str | Observation | None = None
        self._first_obs: str | Observation | None = None
        self._env_since: list[float] = []  # per turn since the last snapshot: environment seconds
        self._gen_since: list[float] = []  # and generation seconds (between a step's return and the next call)
        self._gen_all: list[float] = []
        self._env_all: list[float] = []
        self._last_return = 0.0
        self._checkpoint_s: float | None = None  # the last measured snapshot time
        self.stats = {"checkpoints": 0, "checkpoint_s": 0.0, "checkpoint_wait_s": 0.0,
                      "checkpoint_failures": 0, "restores": 0, "redos": 0, "failures": 0, "rewound_turns": 0}
        self.failures: list[tuple[int, str, str]] = []  # (turn, kind, message) of each failure

    # ------------------------------------------------------------------ Environment

    async def reset(self, task: Task) -> str | Observation:
        self.task, self.turn, self.attempts, self.snapshot = task, 0, 0, None
        self._asked, self._snapshot_error = None, None  # a snapshot of the previous episode is ignored
        self._env_since, self._gen_since, self._gen_all, self._env_all = [], [], [], []
        while True:
            try:
                obs = await self.worker.reset(task)
                break
            except (WorkerCrashed, WorkerTimeout) as e:
                self._count_failure(e)
                self.worker.restart()
        self._first_obs = self._last_obs = obs
        self._last_return = time.perf_counter()
        return obs

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("CheckpointingEnv: reset(task) before step")
        t0 = time.perf_counter()
        gen_s = t0 - self._last_return
        want = self._want_checkpoint(gen_s)
        try:
            result = await self.worker.step(action, snapshot=want)
        except (WorkerCrashed, WorkerTimeout) as e:
            await self._recover(e)  # raises EnvRewound or TaskDropped
        if self._snapshot_error is not None:  # pushed while this step ran
            raise SnapshotError(self._snapshot_error)
        env_s = time.perf_counter() - t0
        self.turn += 1
        self._env_since.append(env_s)
        self._env_all.append(env_s)
        self._gen_since.append(gen_s)
        self._gen_all.append(gen_s)
        self._last_obs = result.observation
        if want and not result.done:  # the child snapshots now; the state arrives with a later call
            self._asked = (self.worker.last_seq, self.turn, result.observation)
        self._last_return = time.perf_counter()
        return result

    async def settle(self) -> None:
        """Waits for a snapshot being taken in the background (e.g. before a planned shutdown)."""
        if self._asked is not None:
            try:
                await self.worker.ping()
            except (WorkerCrashed, WorkerTimeout):
                self.stats["checkpoint_failures"] += 1  # the step that follows finds the child dead

    def close(self) -> None:
        self.worker.close()

    # ------------------------------------------------------------------ checkpoints

    def _want_checkpoint(self, gen_s: float) -> bool:
        """Belayer's rule for a snapshot after the coming step: the redo cost counts the turns since
        the last snapshot plus this one (its generation measured, its environment time expected)."""
        if self.config.mode != "belayer":
            return self.config.mode == "always"
        checkpoint_s = self._checkpoint_s if self._checkpoint_s is not None else self.config.checkpoint_s_guess
        overlap_s = statistics.fmean(self._gen_all) if self._gen_all else 0.0
        env_next = statistics.fmean(self._env_all) if self._env_all else 0.0
        return belayer.should_checkpoint(self.config.p_fail,
                                         belayer.redo_cost(self._env_since + [env_next], self._gen_since + [gen_s]),
                                         checkpoint_s, overlap_s)

    def _pushed(self, seq: int, ok: bool, payload) -> None:
        """A snapshot the child pushed after the step of request `seq`."""
        if self._asked is None or seq != self._asked[0]:
            return  # a previous episode's
        _, turn, observation = self._asked
        self._asked = None
        if not ok:
            self.stats["checkpoint_failures"] += 1
            self._snapshot_error = payload
            return
        state, seconds, end = payload
        self._checkpoint_s = seconds
        self.snapshot = EnvSnapshot(self.task, turn, state, observation)
        self._env_since, self._gen_since = [], []  # the turns up to `turn`; the current one is added after
        self.stats["checkpoints"] += 1
        self.stats["checkpoint_s"] += seconds
        self.stats["checkpoint_wait_s"] += max(0.0, end - self.worker.sent_at)  # the next request waited

    # ------------------------------------------------------------------ recovery

    def _count_failure(self, e: WorkerCrashed | WorkerTimeout) -> None:
        self.stats["failures"] += 1
        self.failures.append((self.turn, e.kind, str(e)))
        decision = belayer.decide_retry(e.kind, self.attempts, self.config.max_retries, str(e))
        if decision.action == belayer.DROP:
            self.worker.kill()
            raise TaskDropped(decision.reason, e.kind) from e
        self.attempts += 1

    async def _recover(self, cause: WorkerCrashed | WorkerTimeout):
        """Restarts the child at the last snapshot (or turn 0) and raises EnvRewound."""
        self._asked = None  # a snapshot the child did not push is lost with it
        while True:
            self._count_failure(cause)  # raises TaskDropped past the budget
            self.worker.restart()
            try:
                if self.snapshot is not None:
                    await self.worker.restore(self.snapshot.task, self.snapshot.state)
                    turn, obs = self.snapshot.turn, self.snapshot.observation
                    self.stats["restores"] += 1
                else:
                    obs = await self.worker.reset(self.task)
                    self._first_obs, turn = obs, 0
                    self.stats["redos"] += 1
                break
            except (WorkerCrashed, WorkerTimeout) as e:
                cause = e
        self.stats["rewound_turns"] += self.turn - turn
        self.turn = turn
        self._env_since, self._gen_since = [], []
        self._last_obs = obs
        self._last_return = time.perf_counter()
        raise EnvRewound(turn, obs, self.attempts, cause)


class EnvPool:
    """Environment processes reused across tasks: `pool(task)` hands out a `CheckpointingEnv` whose
    child is already running (its child builds a fresh environment at every `reset`), and the
    task's `close()` gives it back. No process starts or stops per task, and none on the event
    loop's thread after the first tasks. A worker that died is closed instead of returned."""

    def __init__(self, make_env: Callable[[Task], Environment] = tasks.make_env,
                 config: CheckpointConfig = CheckpointConfig(), *, start_method: str = "forkserver"):
        self.make_env, self.config, self.start_method = make_env, config, start_method
        self._free: list[CheckpointingEnv] = []
        self.created = 0

    def __call__(self, task: Task) -> "PooledEnv":
        if self._free:
            env = self._free.pop()
        else:
            env = CheckpointingEnv(self.make_env, self.config, start_method=self.start_method)
            self.created += 1
        return PooledEnv(env, self)

    def prestart(self, n: int) -> None:
        """Starts processes until `n` are free (a run calls it once, before its first tasks)."""
        while len(self._free) < n:
            self._free.append(CheckpointingEnv(self.make_env, self.config, start_method=self.start_method))
            self.created += 1

    def give_back(self, env: CheckpointingEnv) -> None:
        if env.worker.alive():
            self._free.append(env)
        else:
            env.close()

    def close(self) -> None:
        for env in self._free:
            env.close()
        self._free.clear()


class PooledEnv:
    """One task's use of a pooled `CheckpointingEnv` (the Environment protocol, plus `close`)."""

    def __init__(self, env: CheckpointingEnv, pool: EnvPool):
        self.env, self.pool, self._returned = env, pool, False

    @property
    def worker(self) -> EnvWorker:
        return self.env.worker

    async def reset(self, task: Task) -> str | Observation:
        return await self.env.reset(task)

    async def step(self, action: str) -> StepResult:
        return await self.env.step(action)

    def close(self) -> None:
        if not self._returned:
            self._returned = True
            self.pool.give_back(self.env)
