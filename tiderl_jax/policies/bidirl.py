"""BiDiRL: a hot-switch-friendly static partition, and borrowing idle devices across pools at run time.

BiDiRL (docs/mechanisms.md): hybrid time-space multiplexing for asynchronous, disaggregated RL. The
rollout and training pools run concurrently (one-step-off pipeline), so a step takes as long as the
slower of the two; either pool can idle while the other is the bottleneck.

- **Static planner** (`plan_partition`, the paper's idea; the candidate set and tie-break ours):
  given a time model, `rollout_time(d)` and `train_time(d)` = seconds one step of each stage takes
  on d devices (measured or from `sim/costs.py`), consider every split of the cluster into rollout
  and training pools in units of `group_size` devices whose pools can each host the *other* role
  as well (divisible layouts: each pool a multiple of both the rollout replica size and the
  trainer's model-parallel size, so a hot switch needs no resharding from storage). Pick the split
  minimising the step time `max(rollout_time, train_time)`; ties (within `tie_tolerance`, relative)
  go to the more balanced one (smaller |rollout_time - train_time|), then to the more even device
  split.
- **Bidirectional borrowing** (`decide_borrow`, the paper's rule; the gain model ours): when one pool
  (the bottleneck) still has `remaining_s` seconds of work and the other pool has idle devices,
  borrow them **only if** the predicted gain exceeds the switch-in + switch-out cost, plus the
  gradient merge when the trainer borrows (its borrowed data-parallel replicas must merge gradients;
  a borrowing rollout has nothing to merge):

      k        = scaling * borrowed / own           (speed added, relative to the own pool)
      window   = idle_for_s - switch_in_s - switch_out_s   (the lender needs its devices back)
      finish   = remaining_s / (1 + k)              if that fits in the window,
                 remaining_s - k * window           otherwise (the borrowed devices leave early)
      gain     = remaining_s - finish
      cost     = switch_in_s + switch_out_s + (merge_s if the trainer borrows)
      borrow   iff gain > cost

  Borrowed devices come in whole units of the borrower (`borrower_unit`: a rollout replica or a
  trainer model-parallel group); leftover idle devices stay with the lender.

Metric served: RL training throughput (samples or tokens per second; the paper: up to 1.94x over
veRL, AReaL and ROLL on 32 GPUs), through less idle time on both pools (waiting, docs/glossary.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

ROLLOUT = "rollout"
TRAIN = "train"
ROLES = (ROLLOUT, TRAIN)


@dataclasses.dataclass(frozen=True)
class Partition:
    rollout_devices: int
    train_devices: int
    rollout_time_s: float  # one step of rollout on the rollout pool
    train_time_s: float  # one step of training on the train pool

    @property
    def step_time_s(self) -> float:
        return max(self.rollout_time_s, self.train_time_s)

    @property
    def imbalance_s(self) -> float:
        return abs(self.rollout_time_s - self.train_time_s)


@dataclasses.dataclass(frozen=True)
class Plan:
    best: Partition
    candidates: tuple[Partition, ...]  # every layout considered, fewest rollout devices first


def _hosts_both(devices: int, rollout_unit: int, train_unit: int) -> bool:
    return devices % rollout_unit == 0 and devices % train_unit == 0


def candidate_splits(total_devices: int, group_size: int, rollout_unit: int = 1, train_unit: int = 1) -> list[int]:
    """Rollout-pool sizes of the divisible layouts: multiples of `group_size`, each pool non-empty and
    able to host both roles (a multiple of `rollout_unit` and of `train_unit`)."""
    for name, v in (("total_devices", total_devices), ("group_size", group_size), ("rollout_unit", rollout_unit),
                    ("train_unit", train_unit)):
        if v < 1:
            raise ValueError(f"BiDiRL planner: {name}={v} must be >= 1")
    if total_devices % group_size:
        raise ValueError(f"BiDiRL planner: total_devices={total_devices} is not a multiple of "
                         f"group_size={group_size}")
    return [r for r in range(group_size, total_devices, group_size)
            if _hosts_both(r, rollout_unit, train_unit) and _hosts_both(total_devices - r, rollout_unit, train_unit)]


def _timed(fn: Callable[[int], float], name: str, devices: int) -> float:
    t = float(fn(devices))
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"BiDiRL planner: {name}({devices})={t} must be a positive finite number of seconds")
    return t


def plan_partition(total_devices: int, group_size: int, rollout_time: Callable[[int], float],
                   train_time: Callable[[int], float], *, rollout_unit: int = 1, train_unit: int = 1,
                   tie_tolerance: float = 1e-9) -> Plan:
    """The divisible rollout/train split with the shortest step time `max(rollout, train)`."""
    if tie_tolerance < 0:
        raise ValueError(f"BiDiRL planner: tie_tolerance={tie_tolerance} must be >= 0")
    splits = candidate_splits(total_devices, group_size, rollout_unit, train_unit)
    if not splits:
        raise ValueError(f"BiDiRL planner: no divisible layout of total_devices={total_devices} in groups of "
                         f"{group_size} lets both pools host both roles (rollout_unit={rollout_unit}, "
                         f"train_unit={train_unit}): use a group_size that is a multiple of both units")
    candidates = tuple(Partition(r, total_devices - r, _timed(rollout_time, "rollout_time", r),
                                 _timed(train_time, "train_time", total_devices - r)) for r in splits)
    fastest = min(p.step_time_s for p in candidates)
    tied = [p for p in candidates if p.step_time_s <= fastest * (1 + tie_tolerance)]
    best = min(tied, key=lambda p: (p.imbalance_s, abs(p.rollout_devices - p.train_devices), p.rollout_devices))
    return Plan(best=best, candidates=candidates)


@dataclasses.dataclass(frozen=True)
class BorrowSignals:
    borrower: str  # the bottleneck role: ROLLOUT or TRAIN
    remaining_s: float  # predicted seconds of the borrower's remaining step work on its own pool
    own_devices: int  # devices the borrower's pool holds
    idle_devices: int  # devices of the other pool idle now
    idle_for_s: float  # how long the lender stays idle (math.inf: until told otherwise)
    switch_in_s: float  # hot switch of the borrowed devices to the borrower's role (measured)
    switch_out_s: float  # switching them back (measured)
    merge_s: float = 0.0  # gradient merge across the borrowed replicas (counted when TRAIN borrows)
    borrower_unit: int = 1  # devices per unit of the borrower's role (replica / model-parallel group)
    scaling: float = 1.0  # speed a borrowed device adds, as a fraction of an own device

    def __post_init__(self):
        if self.borrower not in ROLES:
            raise ValueError(f"BiDiRL borrow signal borrower={self.borrower!r} is not one of {ROLES}")
        for name in ("remaining_s", "idle_devices", "idle_for_s", "switch_in_s", "switch_out_s", "merge_s"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"BiDiRL borrow signal {name}={v} must be >= 0")
        for name in ("own_devices", "borrower_unit"):
            if getattr(self, name) < 1:
                raise ValueError(f"BiDiRL borrow signal {name}={getattr(self, name)} must be >= 1")
        if not 0 < self.scaling <= 1:
            raise ValueError(f"BiDiRL borrow signal scaling={self.scaling} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class BorrowDecision:
    borrow: bool
    borrower: str
    lender: str
    devices: int  # devices to borrow (0 when not borrowing)
    gain_s: float  # predicted seconds the borrower's remaining work gets shorter
    cost_s: float  # switch-in + switch-out (+ merge when the trainer borrows)
    reason: str


def borrow_gain(s: BorrowSignals, devices: int) -> float:
    """Seconds saved on the borrower's `remaining_s` by `devices` borrowed devices (module docstring)."""
    if devices <= 0 or s.remaining_s == 0:
        return 0.0
    k = s.scaling * devices / s.own_devices
    window = s.idle_for_s - s.switch_in_s - s.switch_out_s
    if window <= 0:
        return 0.0
    alone = s.remaining_s / (1 + k)
    finish = alone if alone <= window else s.remaining_s - k * window
    return s.remaining_s - finish


def decide_borrow(s: BorrowSignals) -> BorrowDecision:
    """Borrow the lender's idle devices (whole borrower units) only if the gain pays every switch cost."""
    lender = TRAIN if s.borrower == ROLLOUT else ROLLOUT
    devices = (s.idle_devices // s.borrower_unit) * s.borrower_unit
    cost = s.switch_in_s + s.switch_out_s + (s.merge_s if s.borrower == TRAIN else 0.0)
    gain = borrow_gain(s, devices)
    if devices == 0:
        reason = f"{s.idle_devices} idle {lender} device(s) make no whole {s.borrower} unit of {s.borrower_unit}"
    elif gain > cost:
        reason = f"gain {gain:.3f}s > cost {cost:.3f}s"
    else:
        reason = f"gain {gain:.3f}s does not pay cost {cost:.3f}s"
    use = devices > 0 and gain > cost
    return BorrowDecision(borrow=use, borrower=s.borrower, lender=lender, devices=devices if use else 0,
                          gain_s=gain, cost_s=cost, reason=reason)


MIN_SCALING = 0.01  # (ours) a borrow that measured no gain still leaves decide_borrow a valid scaling


def measured_scaling(rate_before: float, rate_during: float, own_devices: int, borrowed_devices: int) -> float:
    """The `scaling` a borrow showed (ours): the borrower's rate rose by `k = during / before - 1` with
    `borrowed / own` more devices, so each borrowed device added `k * own / borrowed` of an own one;
    clipped to [MIN_SCALING, 1]."""
    if not rate_before > 0 or not rate_during >= 0 or own_devices < 1 or borrowed_devices < 1:
        raise ValueError(f"BiDiRL measured_scaling needs positive rate_before={rate_before}, rate_during="
                         f"{rate_during} >= 0 and devices >= 1 (own {own_devices}, borrowed {borrowed_devices})")
    k = rate_during / rate_before - 1.0
    return min(1.0, max(MIN_SCALING, k * own_devices / borrowed_devices))
