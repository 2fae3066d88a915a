"""The typed failures of the fault-tolerance layer, each naming its Belayer failure kind.

An `InfrastructureFailure` (a worker or sandbox process died, or a call outlived its limit) is the
machine's fault: `policies/belayer.decide_retry` retries it within a budget. `TaskDropped` ends a
task with the recorded reason once the budget is spent (or for a data failure).
"""

from __future__ import annotations

from tiderl_jax.policies import belayer


class InfrastructureFailure(RuntimeError):
    """A worker process failed; `kind` is a Belayer infrastructure kind (crash or timeout)."""

    def __init__(self, kind: str, message: str):
        if belayer.classify(kind) is not belayer.FailureClass.INFRASTRUCTURE:
            raise ValueError(f"failure kind {kind!r} is not an infrastructure failure")
        super().__init__(message)
        self.kind = kind


class WorkerCrashed(InfrastructureFailure):
    """The worker's process ended (killed, crashed, or its pipe closed)."""


class WorkerTimeout(InfrastructureFailure):
    """A call to the worker outlived its limit; the worker was killed (its state is unknown)."""

    def __init__(self, message: str):
        super().__init__(belayer.TIMEOUT, message)


class TaskDropped(RuntimeError):
    """The task ends without a result; `reason` is what the controller records for it."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class SnapshotError(RuntimeError):
    """An environment's state cannot be snapshotted (the message names the attribute and the fix)."""
