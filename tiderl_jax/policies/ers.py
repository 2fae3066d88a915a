"""Elastic Resource Scaling (ERS): move one device group between rollout and training at a step boundary.

TideRL, MECHANISMS.md §1c. A static split cannot follow a bottleneck that flips between generation
(the trainer starves) and consumption (the ready backlog grows). `decide` is evaluated once per
step boundary (after the actor update, before the weight sync) and returns at most one `Move`, so
at most one group moves per step. Roles: `rollout`, and `train` (which holds the ref as well).

Rule (the paper's, with the thresholds and hysteresis ours, all in `ERSConfig`):
- **generation deficit**: ready volume below the ideal batch *and* the trainer idle for more than
  `idle_fraction` of the step -> one group train -> rollout, RA2P switches to colocated.
- **consumption deficit**: head-of-line latency above `hol_fraction` of the step time, or RAS above
  RA2P's break-even RAS -> one group rollout -> train, RA2P switches to decoupled.
  A generation deficit takes precedence (ours): a trainer that idled is not the bottleneck, even if
  an item waited in the buffer (e.g. for its batch to fill).
- hysteresis (ours): a deficit moves a group only after `patience` consecutive boundaries; after a
  move both streaks restart, so each further move needs fresh evidence from the new split; the
  reverse move is refused for `cooldown` boundaries after a move (no ping-pong).
- phases: `cold_start` and `eval` maximise rollout: a group moves train -> rollout at every
  boundary while the train role is above its minimum, without patience and regardless of cooldown
  (a phase change is an explicit event, not noisy signals).
- a move never takes a role below its minimum (`min_rollout_groups`, `min_train_groups`, >= 1).

State stays with the caller: it passes the `ERSHistory` returned by the previous boundary and gets
the updated one back, so `decide` is a pure function.

Metric served: total waiting time, rollout plus trainer (RWT + TWT, MECHANISMS.md §9).
"""

from __future__ import annotations

import dataclasses

ROLLOUT = "rollout"
TRAIN = "train"  # the train group, holding the actor and the ref
PHASES = ("cold_start", "train", "eval")
RA2P_MODE_AFTER_MOVE_TO = {ROLLOUT: "colocated", TRAIN: "decoupled"}  # ra2p.COLOCATED / DECOUPLED


@dataclasses.dataclass(frozen=True)
class ERSConfig:
    patience: int = 2  # consecutive boundaries a deficit must persist before a move
    cooldown: int = 3  # boundaries after a move during which the reverse move is refused
    idle_fraction: float = 0.05  # trainer idle above this share of the step time: it starved
    hol_fraction: float = 0.5  # head-of-line latency above this share of the step time: backlog
    min_rollout_groups: int = 1
    min_train_groups: int = 1

    def __post_init__(self):
        for name in ("patience", "min_rollout_groups", "min_train_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"ERSConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("cooldown", "idle_fraction", "hol_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"ERSConfig.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ERSSignals:
    ready_volume: int  # samples in the ready buffer at the boundary
    ideal_batch: int  # samples one train step consumes
    trainer_idle_s: float  # seconds the trainer waited for data during the last step
    hol_latency_s: float  # age of the oldest ready item
    step_time_s: float  # wall time of the last step
    ras: float  # ready-at-start micro-batches of the last step
    break_even_ras: float  # RAS above which RA2P's decoupled mode pays (math.inf: never)
    rollout_groups: int  # device groups the rollout role holds now
    train_groups: int  # device groups the train role (actor + ref) holds now
    phase: str = "train"  # one of PHASES

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"ERS signal phase={self.phase!r} is not one of {PHASES}")
        for name in ("ready_volume", "ideal_batch", "trainer_idle_s", "hol_latency_s", "step_time_s",
                     "ras", "break_even_ras", "rollout_groups", "train_groups"):
            if getattr(self, name) < 0:
                raise ValueError(f"ERS signal {name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ERSHistory:
    generation_streak: int = 0  # consecutive boundaries with a generation deficit
    consumption_streak: int = 0  # consecutive boundaries with a consumption deficit
    last_move_to: str | None = None  # role the last move went to (None: no move yet)
    boundaries_since_move: int = 0


@dataclasses.dataclass(frozen=True)
class Move:
    from_role: str
    to_role: str
    ra2p_mode: str  # the RA2P mode to run from the next step on
    reason: str  # "generation deficit", "consumption deficit", "cold_start" or "eval"


def generation_deficit(s: ERSSignals, config: ERSConfig) -> bool:
    return s.ready_volume < s.ideal_batch and s.trainer_idle_s > config.idle_fraction * s.step_time_s


def consumption_deficit(s: ERSSignals, config: ERSConfig) -> bool:
    return s.hol_latency_s > config.hol_fraction * s.step_time_s or s.ras > s.break_even_ras


def decide(s: ERSSignals, history: ERSHistory = ERSHistory(),
           config: ERSConfig = ERSConfig()) -> tuple[Move | None, ERSHistory]:
    """At most one group move for this step boundary, and the history to pass to the next one."""
    groups = {ROLLOUT: s.rollout_groups, TRAIN: s.train_groups}
    minimum = {ROLLOUT: config.min_rollout_groups, TRAIN: config.min_train_groups}
    for role in (ROLLOUT, TRAIN):
        if groups[role] < minimum[role]:
            raise ValueError(f"ERS signal {role}_groups={groups[role]} is below its minimum "
                             f"{minimum[role]} (ERSConfig.min_{role}_groups)")
    generation = generation_deficit(s, config)
    consumption = not generation and consumption_deficit(s, config)
    history = ERSHistory(
        generation_streak=history.generation_streak + 1 if generation else 0,
        consumption_streak=history.consumption_streak + 1 if consumption else 0,
        last_move_to=history.last_move_to,
        boundaries_since_move=history.boundaries_since_move + 1)

    if s.phase != "train":
        to_role, reason = ROLLOUT, s.phase
    elif history.generation_streak >= config.patience:
        to_role, reason = ROLLOUT, "generation deficit"
    elif history.consumption_streak >= config.patience:
        to_role, reason = TRAIN, "consumption deficit"
    else:
        return None, history
    from_role = TRAIN if to_role == ROLLOUT else ROLLOUT
    reversal = history.last_move_to == from_role and history.boundaries_since_move <= config.cooldown
    if groups[from_role] <= minimum[from_role] or (reversal and s.phase == "train"):
        return None, history
    move = Move(from_role, to_role, RA2P_MODE_AFTER_MOVE_TO[to_role], reason)
    return move, ERSHistory(last_move_to=to_role)
