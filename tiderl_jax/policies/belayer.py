"""Belayer: the fault-tolerance decisions: worker health, environment checkpoints, failure classes, retries.

docs/mechanisms.md (Belayer). Pure functions of observed signals; the processes, pipes and snapshots that act
on them live in `tiderl_jax/faults/` (`engine_worker.py`, `env_worker.py`).

- **health** (`HealthState`, `observe`): a worker is checked every ~0.2 s (is its process alive, did
  it answer the last ping). It is declared failed after `threshold` *consecutive* failed checks; a
  passing check resets the count. Failure is final (ours): a worker declared failed is replaced
  (its standby is promoted), never revived, so a late answer cannot make two workers serve the same
  requests.
- **environment checkpoint** (`should_checkpoint`): at a safe turn boundary (the environment has
  answered, the model has not yet produced its next turn) take a snapshot iff
  `p_fail * redo_cost_s >= visible_overhead_s`, where `redo_cost_s` is the time to redo the turns
  since the last checkpoint (their environment seconds plus the model's generation seconds, as
  measured; `redo_cost`) and `visible_overhead_s = max(0, checkpoint_s - overlap_s)`: the snapshot
  runs while the model generates its next turn, so only the part that outlasts that generation is
  waited for (`visible_overhead`). A fully overlapped snapshot costs nothing visible and is always
  taken (0 >= 0), even at `p_fail = 0`. `p_fail` is the probability that the environment fails
  before the next boundary; `p_fail_within` turns a failure rate into it.
- **failure classes** (`classify`): infrastructure failures (`worker_crash`, `sandbox_crash`,
  `timeout`) are the machine's fault and are retried; data failures (`malformed_task`,
  `unparsable_answer`) would fail again on a retry, so the sample is dropped with a recorded
  reason. An unknown kind is an error, not silently one class or the other.
- **retry** (`decide_retry`): an infrastructure failure is retried while `attempts < max_retries`
  (attempts = retries already made for this task); then, and for every data failure, the task is
  dropped with a reason naming the kind and the attempts. Every admitted task thus ends exactly
  once: completed, or dropped with a reason.

Metric served: goodput under faults (work lost to a failure is redone from the latest checkpoint,
not from scratch) and `tasks_lost` (must stay 0; `benchmarks/recovery.py`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

# ----------------------------------------------------------------------------------- health


@dataclasses.dataclass(frozen=True)
class HealthState:
    consecutive_failures: int = 0  # failed checks in a row, up to now
    checks: int = 0  # checks observed in all
    failed: bool = False  # declared failed (final)


def observe(state: HealthState, ok: bool, threshold: int) -> HealthState:
    """The health state after one check: failed once `threshold` consecutive checks failed."""
    if threshold < 1:
        raise ValueError(f"health threshold={threshold} must be >= 1 (consecutive failed checks)")
    if state.failed:
        return dataclasses.replace(state, checks=state.checks + 1)
    failures = 0 if ok else state.consecutive_failures + 1
    return HealthState(failures, state.checks + 1, failures >= threshold)


# ----------------------------------------------------------------------------------- environment checkpoints


def redo_cost(env_s: Sequence[float], gen_s: Sequence[float]) -> float:
    """Seconds to redo the turns since the last checkpoint: their environment plus generation time."""
    for name, values in (("env_s", env_s), ("gen_s", gen_s)):
        bad = [v for v in values if not v >= 0]
        if bad:
            raise ValueError(f"redo_cost: {name} holds {bad[:3]}; turn times must be finite and >= 0")
    return float(sum(env_s) + sum(gen_s))


def visible_overhead(checkpoint_s: float, overlap_s: float) -> float:
    """The part of a snapshot the rollout waits for: what outlasts the generation it overlaps."""
    for name, value in (("checkpoint_s", checkpoint_s), ("overlap_s", overlap_s)):
        if not value >= 0:
            raise ValueError(f"visible_overhead: {name}={value} must be finite and >= 0")
    return max(0.0, checkpoint_s - overlap_s)


def should_checkpoint(p_fail: float, redo_cost_s: float, checkpoint_s: float, overlap_s: float) -> bool:
    """Belayer's rule at a safe turn boundary: `p_fail * redo_cost_s >= visible_overhead_s`."""
    if not 0.0 <= p_fail <= 1.0:
        raise ValueError(f"should_checkpoint: p_fail={p_fail} must be a probability in [0, 1]")
    if not redo_cost_s >= 0:
        raise ValueError(f"should_checkpoint: redo_cost_s={redo_cost_s} must be finite and >= 0")
    return p_fail * redo_cost_s >= visible_overhead(checkpoint_s, overlap_s)


def p_fail_within(failure_rate_per_s: float, horizon_s: float) -> float:
    """Probability of at least one failure within `horizon_s` at a constant (Poisson) failure rate."""
    if not failure_rate_per_s >= 0 or not horizon_s >= 0:
        raise ValueError(f"p_fail_within: failure_rate_per_s={failure_rate_per_s} and "
                         f"horizon_s={horizon_s} must be >= 0")
    return 1.0 - math.exp(-failure_rate_per_s * horizon_s)


# ----------------------------------------------------------------------------------- failure classes


class FailureClass(enum.Enum):
    INFRASTRUCTURE = "infrastructure"  # the machine failed: retry the task
    DATA = "data"  # the task or the answer is bad: a retry fails again, drop with a reason


WORKER_CRASH = "worker_crash"  # an engine worker process died or stopped answering
SANDBOX_CRASH = "sandbox_crash"  # an environment subprocess died
TIMEOUT = "timeout"  # an environment step or a worker call took longer than its limit
MALFORMED_TASK = "malformed_task"  # the task cannot be run (bad fields, an environment refuses it)
UNPARSABLE_ANSWER = "unparsable_answer"  # the final answer cannot be scored

FAILURE_CLASSES = {
    WORKER_CRASH: FailureClass.INFRASTRUCTURE,
    SANDBOX_CRASH: FailureClass.INFRASTRUCTURE,
    TIMEOUT: FailureClass.INFRASTRUCTURE,
    MALFORMED_TASK: FailureClass.DATA,
    UNPARSABLE_ANSWER: FailureClass.DATA,
}


def classify(kind: str) -> FailureClass:
    """The class of a failure kind (one of `FAILURE_CLASSES`)."""
    try:
        return FAILURE_CLASSES[kind]
    except KeyError:
        raise ValueError(f"failure kind {kind!r} is not one of {sorted(FAILURE_CLASSES)}") from None


# ----------------------------------------------------------------------------------- retries

RETRY = "retry"
DROP = "drop"


@dataclasses.dataclass(frozen=True)
class RetryDecision:
    action: str  # RETRY or DROP
    failure_class: FailureClass
    reason: str  # why: recorded with a dropped task


def decide_retry(kind: str, attempts: int, max_retries: int, detail: str = "") -> RetryDecision:
    """Retry an infrastructure failure while `attempts < max_retries`; else drop with a reason.

    `attempts`: retries already made for this task (0 at its first failure).
    """
    if attempts < 0 or max_retries < 0:
        raise ValueError(f"decide_retry: attempts={attempts} and max_retries={max_retries} must be >= 0")
    cls = classify(kind)
    what = f"{kind}: {detail}" if detail else kind
    if cls is FailureClass.DATA:
        return RetryDecision(DROP, cls, f"data failure ({what}); a retry would fail again")
    if attempts < max_retries:
        return RetryDecision(RETRY, cls, f"infrastructure failure ({what}); retry {attempts + 1} "
                                         f"of {max_retries}")
    return RetryDecision(DROP, cls, f"infrastructure failure ({what}); retry budget of {max_retries} "
                                    f"exhausted after {attempts} retries")
