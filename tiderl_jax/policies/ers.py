"""Elastic Resource Scaling (ERS): move one device group between rollout and training at a step boundary.

TideRL, docs/mechanisms.md (ERS). A static split cannot follow a bottleneck that flips between generation
(the trainer starves) and consumption (the ready backlog grows). `decide` is evaluated once per
step boundary (after the actor update, before the weight sync) and returns at most one `Move`, so
at most one group moves per step. Roles: `rollout`, `ref` (the reference model's own devices, for
RA2P's decoupled mode; may be empty) and `train` (the actor, and the ref when it is colocated).

Rule (the paper's, with the thresholds and hysteresis ours, all in `ERSConfig`):
- **generation deficit**: ready volume below the ideal batch *and* the trainer idle for more than
  `idle_fraction` of the step -> one group ref/train -> rollout, RA2P switches to colocated: a ref
  group first (colocated, the ref pass runs on the train devices, so the ref devices are the ones
  that would idle), a train group once no ref group is left.
- **consumption deficit**: head-of-line latency above `hol_fraction` of the step time, or RAS above
  RA2P's break-even RAS -> one group rollout -> train, RA2P switches to decoupled.
  A generation deficit takes precedence (ours): a trainer that idled is not the bottleneck, even if
  an item waited in the buffer (e.g. for its batch to fill).
- **idle ref group** (ours): RA2P ran the ref pass colocated (`ref_idle`) at `patience` consecutive
  boundaries while ref groups are held, with neither deficit -> one group ref -> train (the colocated
  ref pass runs there), with economics ref -> train or ref -> rollout, whichever pays more. Devices RA2P
  does not use must not sit out the run (issue 18: goodput.py's tiderl kept an idle ref group beside a
  trainer on half async's devices, and lost to async).
- hysteresis (ours): a deficit moves a group only after `patience` consecutive boundaries; after a
  move both streaks restart, so each further move needs fresh evidence from the new split; the
  reverse move is refused for `cooldown` boundaries after a move (no ping-pong).
- phases: `cold_start` and `eval` maximise rollout: a group moves train -> rollout at every
  boundary while the train role is above its minimum, without patience and regardless of cooldown
  (a phase change is an explicit event, not noisy signals).
- a move never takes a role below its minimum (`min_rollout_groups`, `min_train_groups`, >= 1).

- a move must pay for itself (ours, after BiDiRL's borrowing rule, docs/mechanisms.md): when the
  caller passes `MoveEconomics`, a deficit moves a group only if the predicted step-time gain over
  the steps left exceeds the predicted move cost (reshard + recompile, measured; per move where the
  caller can tell them apart, `move_costs`), see `move_gain`,
  and the gain per step is at least `min_gain_fraction` of the step (a smaller one is within the
  noise of one step's measurements: on a drifting workload such predictions flipped sign step after
  step and ERS moved groups back and forth, paying each move). Each move's predicted gain is averaged
  over the boundaries since the last move (`gain_weight` on the newest), so that one step's batch
  variance does not decide alone; a move starts the average afresh (the split it measured is gone).
  The gain assumes a role's speed grows by `scaling` of linear per added group (1.0 until a move
  has been measured, then `measured_scaling`): a backend that knows it (the simulator's
  cost model) gives it instead. (On this CPU's faked devices it is not 0: they share two cores, yet
  benchmarks/goodput.py's update took 7-8 s on 4 of them and 11-13 s on 2.) The rollout's own
  scaling (`rollout_scaling`) comes from the engine's costs at its load when the backend can tell:
  memory-bound decoding at small batches barely speeds up with more replicas.
- with economics the deficit says *that* a move is wanted, the economics say *which* (ours): every
  move of one group that leaves its role at or above its minimum (ref -> rollout, train -> rollout,
  ref -> train, rollout -> train) is scored by `move_gain` over the steps left net of its cost, and the
  best one moves if it pays and
  does not reverse the last move within the cooldown (then nothing moves). A trainer that idles because rollout
  latency and the staleness bound hold admission (`train_coupling`) is sped up by a train group, not
  by rollout devices that would only idle too. Without economics the paper's directions hold.

State stays with the caller: it passes the `ERSHistory` returned by the previous boundary and gets
the updated one back, so `decide` is a pure function.

Metric served: total waiting time, rollout plus trainer (RWT + TWT, docs/glossary.md).
"""

from __future__ import annotations

import dataclasses

ROLLOUT = "rollout"
REF = "ref"  # the reference model's own groups (RA2P decoupled)
TRAIN = "train"  # the actor's groups (and the ref's, colocated)
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
    # with economics, a move's predicted saving per step must also reach this share of the step time (ours):
    # predictions within the noise of one step's measurements (a drifting batch, environment latency) flip sign
    # from step to step, and each flip would pay a move for nothing
    min_gain_fraction: float = 0.02
    # with economics, the weight of this boundary's predicted gains in their moving average since the last move
    # (ours; 1: the last step alone). One step's busy times carry its batch's own variance, so a prediction from
    # one step chases it: on the simulator's drifting workload ERS moved back and forth around the best split
    gain_weight: float = 0.5

    def __post_init__(self):
        for name in ("patience", "min_rollout_groups", "min_train_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"ERSConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("cooldown", "idle_fraction", "hol_fraction", "min_gain_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"ERSConfig.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 < self.gain_weight <= 1.0:
            raise ValueError(f"ERSConfig.gain_weight={self.gain_weight} must be in (0, 1]")


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
    train_groups: int  # device groups the train role (actor, colocated ref) holds now
    phase: str = "train"  # one of PHASES
    ref_groups: int = 0  # device groups the ref role holds now (decoupled ref)
    ref_idle: bool = False  # the ref groups ran nothing this step (RA2P chose colocated: the ref pass ran on train)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"ERS signal phase={self.phase!r} is not one of {PHASES}")
        for name in ("ready_volume", "ideal_batch", "trainer_idle_s", "hol_latency_s", "step_time_s",
                     "ras", "break_even_ras", "rollout_groups", "train_groups", "ref_groups"):
            if getattr(self, name) < 0:
                raise ValueError(f"ERS signal {name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MoveEconomics:
    """What one move would cost and what it would buy (all measured by the caller)."""
    train_busy_s: float  # seconds the train role computed during the last step
    rollout_busy_s: float  # seconds the rollout role computed (engine steps) during the last step
    move_cost_s: float  # predicted seconds of one move: reshard + recompiling on the new meshes
    horizon_steps: int  # steps left in which a move's gain accrues
    scaling: float = 1.0  # speed one more group adds to a role, as a fraction of linear scaling
    ref_busy_s: float = 0.0  # seconds the ref role computed on its own groups during the last step
    # the rollout's own scaling (fraction of linear) at its current load, when the backend can tell it
    # from its engine's costs; None: `scaling`
    rollout_scaling: float | None = None
    # seconds the rollout's production of a batch moves per second of train time: while the staleness
    # bound holds admission, each update frees the next samples (ours: 1 / (eta + 1) times the share
    # of the step the producer was held by it); 0: production is independent of the trainer
    train_coupling: float = 0.0
    # batches of fresh samples the rollout delivered to the ready buffer during the last step (samples over the
    # ideal batch): above 1 the backlog grew, so a batch took less than the rollout's busy time to produce
    produced_batches: float = 1.0
    # predicted seconds of particular moves, {(from_role, to_role): seconds}, where they differ (a move rebuilds
    # only the parts whose devices change: the trainer's programs, the engine's whole bucket grid); other moves
    # cost `move_cost_s`
    move_costs: dict | None = None

    def __post_init__(self):
        for name in ("train_busy_s", "rollout_busy_s", "move_cost_s", "horizon_steps", "ref_busy_s",
                     "produced_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"ERS economics {name}={getattr(self, name)} must be >= 0")
        for move, seconds in (self.move_costs or {}).items():
            if not seconds >= 0:
                raise ValueError(f"ERS economics move_costs[{move}]={seconds} must be >= 0")
        if not 0.0 <= self.scaling <= 1.0:
            raise ValueError(f"ERS economics scaling={self.scaling} must be in [0, 1]")
        if self.rollout_scaling is not None and not 0.0 <= self.rollout_scaling <= 1.0:
            raise ValueError(f"ERS economics rollout_scaling={self.rollout_scaling} must be in [0, 1]")
        if not 0.0 <= self.train_coupling <= 1.0:
            raise ValueError(f"ERS economics train_coupling={self.train_coupling} must be in [0, 1]")

    def cost(self, from_role: str, to_role: str) -> float:
        """Predicted seconds of moving one group from `from_role` to `to_role`."""
        return (self.move_costs or {}).get((from_role, to_role), self.move_cost_s)


@dataclasses.dataclass(frozen=True)
class ERSHistory:
    generation_streak: int = 0  # consecutive boundaries with a generation deficit
    consumption_streak: int = 0  # consecutive boundaries with a consumption deficit
    idle_ref_streak: int = 0  # consecutive boundaries at which RA2P left the ref groups idle
    last_move_to: str | None = None  # role the last move went to (None: no move yet)
    boundaries_since_move: int = 0
    refused: str = ""  # why this boundary's wanted move did not happen ("" if none was wanted)
    refused_kind: str = ""  # and the kind of reason, one of REFUSALS ("" if none)
    # with economics: each move's predicted gain per step, averaged since the last move (`gain_weight`)
    gains: tuple[tuple[tuple[str, str], float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Move:
    from_role: str
    to_role: str
    ra2p_mode: str  # the RA2P mode to run from the next step on
    reason: str  # "generation deficit", "consumption deficit", "idle ref group", "cold_start" or "eval"
    gain_s: float | None = None  # predicted step-time gain over the horizon (with economics)
    cost_s: float | None = None  # predicted cost of the move (with economics)


# the kinds of reason a wanted move is refused (ERSHistory.refused_kind)
REFUSALS = ("at minimum", "cooldown", "within noise", "does not pay")
# every move of one group ERS weighs with economics, (from_role, to_role)
MOVES = ((REF, ROLLOUT), (TRAIN, ROLLOUT), (REF, TRAIN), (ROLLOUT, TRAIN))


def _speed(groups: int, scaling: float) -> float:
    """A role's speed on `groups` groups relative to one group."""
    return 1.0 + scaling * (groups - 1)


def move_gain(s: ERSSignals, e: MoveEconomics, to_role: str, from_role: str | None = None) -> float:
    """Predicted seconds saved per step by moving one group from `from_role` to `to_role` (negative: a
    loss); `from_role` defaults to the other of rollout and train.

    The step is bounded by the trainer's compute `t` and by the rollout's production time `R` of a batch
    (`t + idle` when the trainer idled for data, else the rollout's compute `r` over the p batches it
    delivered in the step, `produced_batches`); only the compute parts scale with devices, and the
    production follows the trainer by `train_coupling` k:

        t' = t * speed(n) / speed(n +- 1),  r' = r * speed_r(m) / speed_r(m -+ 1),
        R' = R + (r' - r) / p + k * (t' - t),     gain = max(t, R) - max(t', R')

    with n, m the train and rollout groups now, speed(j) = 1 + scaling * (j - 1) and speed_r the same
    with `rollout_scaling`. When the last ref group leaves, the ref pass (`ref_busy_s` on its f
    groups) runs colocated on the train groups from then on: t grows by ref_busy_s * speed(f) /
    speed(n) first (a ref group joining train then speeds all of it up). With ref groups left, the
    ref pass stays off the trainer's devices (its slower pipeline is not modelled).
    """
    n, m, f = s.train_groups, s.rollout_groups, s.ref_groups
    if from_role is None:
        from_role = TRAIN if to_role == ROLLOUT else ROLLOUT
    held = {ROLLOUT: m, TRAIN: n, REF: f}
    if to_role not in (ROLLOUT, TRAIN) or from_role not in held or from_role == to_role or held[from_role] < 1:
        return -float("inf")
    if from_role in (ROLLOUT, TRAIN) and held[from_role] < 2:
        return -float("inf")
    c = e.scaling
    c_r = c if e.rollout_scaling is None else e.rollout_scaling
    t, r = e.train_busy_s, e.rollout_busy_s
    t_new, r_new = t, r
    if from_role == REF and f == 1:
        t_new = t + e.ref_busy_s * _speed(f, c) / _speed(n, c)
    if to_role == TRAIN:
        t_new = t_new * _speed(n, c) / _speed(n + 1, c)
        if from_role == ROLLOUT:
            r_new = r * _speed(m, c_r) / _speed(m - 1, c_r)
    else:
        r_new = r * _speed(m, c_r) / _speed(m + 1, c_r)
        if from_role == TRAIN:
            t_new = t * _speed(n, c) / _speed(n - 1, c)
    p = e.produced_batches if e.produced_batches > 0 else 1.0  # (nothing delivered: no rate to divide by)
    production = t + s.trainer_idle_s if s.trainer_idle_s > 0 else r / p
    production_new = production + (r_new - r) / p + e.train_coupling * (t_new - t)
    return max(t, production) - max(t_new, production_new)


def train_coupling(held_s: float, step_s: float, eta: int) -> float:
    """`MoveEconomics.train_coupling` (ours): the share of the step the staleness bound held admission
    (`held_s` of `step_s`), over eta + 1 (each update frees the next batch's admissions)."""
    if held_s < 0 or step_s < 0 or eta < 0:
        raise ValueError(f"train_coupling needs held_s, step_s, eta >= 0; got {held_s}, {step_s}, {eta}")
    return min(1.0, held_s / step_s) / (eta + 1) if step_s > 0 else 0.0


def measured_scaling(groups_before: int, groups_after: int, time_ratio: float, prior: float = 1.0) -> float:
    """The `scaling` that explains a role's compute time changing by `time_ratio` (after / before,
    same work) when it went from `groups_before` to `groups_after` groups; clipped to [0, 1].

    speed(b) / speed(a) = ratio  =>  scaling = (ratio - 1) / ((b - 1) - ratio * (a - 1)).

    A ratio at or beyond linear (a / b) gives 1, one at or beyond no change gives 0 (the formula's pole
    lies beyond linear, where it would turn negative).
    """
    if groups_before < 1 or groups_after < 1 or not time_ratio > 0:
        raise ValueError(f"measured_scaling needs groups >= 1 and a positive time ratio; got "
                         f"{groups_before} -> {groups_after}, ratio {time_ratio}")
    if groups_before == groups_after:
        return prior
    linear = groups_before / groups_after
    more = groups_after > groups_before  # faster with more groups: ratio from 1 down to linear
    if (time_ratio <= linear) if more else (time_ratio >= linear):
        return 1.0
    if (time_ratio >= 1.0) if more else (time_ratio <= 1.0):
        return 0.0
    denominator = (groups_before - 1) - time_ratio * (groups_after - 1)
    return min(1.0, max(0.0, (time_ratio - 1.0) / denominator))


def generation_deficit(s: ERSSignals, config: ERSConfig) -> bool:
    return s.ready_volume < s.ideal_batch and s.trainer_idle_s > config.idle_fraction * s.step_time_s


def consumption_deficit(s: ERSSignals, config: ERSConfig) -> bool:
    return s.hol_latency_s > config.hol_fraction * s.step_time_s or s.ras > s.break_even_ras


def decide(s: ERSSignals, history: ERSHistory = ERSHistory(), config: ERSConfig = ERSConfig(),
           economics: MoveEconomics | None = None) -> tuple[Move | None, ERSHistory]:
    """At most one group move for this step boundary, and the history to pass to the next one.
    With `economics`, a deficit's move must also pay for itself (phases move regardless)."""
    groups = {ROLLOUT: s.rollout_groups, TRAIN: s.train_groups}
    minimum = {ROLLOUT: config.min_rollout_groups, TRAIN: config.min_train_groups}
    for role in (ROLLOUT, TRAIN):
        if groups[role] < minimum[role]:
            raise ValueError(f"ERS signal {role}_groups={groups[role]} is below its minimum "
                             f"{minimum[role]} (ERSConfig.min_{role}_groups)")
    generation = generation_deficit(s, config)
    consumption = not generation and consumption_deficit(s, config)
    averaged = {}
    if economics is not None:
        before, w = dict(history.gains), config.gain_weight
        for mv in MOVES:
            g = move_gain(s, economics, mv[1], mv[0])
            averaged[mv] = g if mv not in before or g == -float("inf") else w * g + (1 - w) * before[mv]
    history = ERSHistory(
        generation_streak=history.generation_streak + 1 if generation else 0,
        consumption_streak=history.consumption_streak + 1 if consumption else 0,
        idle_ref_streak=history.idle_ref_streak + 1 if s.ref_idle and s.ref_groups > 0 else 0,
        last_move_to=history.last_move_to,
        boundaries_since_move=history.boundaries_since_move + 1, gains=tuple(averaged.items()))

    if s.phase != "train":
        to_role, reason = ROLLOUT, s.phase
    elif history.generation_streak >= config.patience:
        to_role, reason = ROLLOUT, "generation deficit"
    elif history.consumption_streak >= config.patience:
        to_role, reason = TRAIN, "consumption deficit"
    elif history.idle_ref_streak >= config.patience:
        to_role, reason = TRAIN, "idle ref group"  # the colocated ref pass runs on the train devices
    else:
        return None, history
    groups[REF], minimum[REF] = s.ref_groups, 0

    def reversal(frm: str, to: str) -> bool:
        """Back toward the side the last move took a group from, within the cooldown (ref -> train
        and rollout -> train are one direction, toward training)."""
        return (history.last_move_to is not None and to != history.last_move_to
                and history.boundaries_since_move <= config.cooldown and s.phase == "train")

    from_role = TRAIN if to_role == ROLLOUT else ROLLOUT
    if (to_role == ROLLOUT or reason == "idle ref group") and s.ref_groups > 0:
        from_role = REF  # colocated from now on: the ref devices are the ones that would idle
    gain = cost = None
    if economics is not None and s.phase == "train":
        moves = ((REF, ROLLOUT), (REF, TRAIN)) if reason == "idle ref group" else MOVES
        candidates = [(frm, to) for frm, to in moves if groups[frm] > minimum[frm]]
        if not candidates:
            return None, dataclasses.replace(history, refused=f"{reason}: every role at its minimum",
                                                  refused_kind="at minimum")
        gains = {mv: averaged[mv] for mv in candidates}
        # the best by what it saves over the steps left net of its own cost (first listed on ties)
        (from_role, to_role), best = max(gains.items(), key=lambda kv: (
            kv[1] * economics.horizon_steps - economics.cost(*kv[0]) if kv[1] > -float("inf") else -float("inf")))
        if reversal(from_role, to_role):  # the best move is held: no second-best move instead
            return None, dataclasses.replace(
                history, refused_kind="cooldown",
                refused=f"{reason}: the best move ({from_role} -> {to_role}) reverses the last one within the cooldown")
        gain, cost = best * economics.horizon_steps, economics.cost(from_role, to_role)
        if best <= 0:  # a predicted loss is no question of noise
            return None, dataclasses.replace(
                history, refused_kind="does not pay",
                refused=f"{reason}: the best move ({from_role} -> {to_role}) would cost {-best:.2f}s per step, "
                                 "so it does not pay")
        if best < config.min_gain_fraction * s.step_time_s:
            return None, dataclasses.replace(
                history, refused_kind="within noise",
                refused=f"{reason}: the best move ({from_role} -> {to_role}) saves {best:.2f}s per step, "
                                 f"within the noise ({config.min_gain_fraction:.0%} of the {s.step_time_s:.2f}s step)")
        if not gain > cost:
            return None, dataclasses.replace(
                history, refused_kind="does not pay",
                refused=f"{reason}: the best move ({from_role} -> {to_role}) predicts {gain:.2f}s over "
                                 f"{economics.horizon_steps} steps, which does not pay the move's {cost:.2f}s")
    else:
        if groups[from_role] <= minimum[from_role]:
            return None, dataclasses.replace(history, refused=f"{reason}: {from_role} at its minimum",
                                       refused_kind="at minimum")
        if reversal(from_role, to_role):
            return None, dataclasses.replace(history, refused=f"{reason}: reverse move within the cooldown",
                                       refused_kind="cooldown")
    mode = RA2P_MODE_AFTER_MOVE_TO[to_role]
    if from_role == REF and s.ref_groups == 1:  # the last ref group: the ref pass runs on the train devices
        mode = RA2P_MODE_AFTER_MOVE_TO[ROLLOUT]
    move = Move(from_role, to_role, mode, reason, gain, cost)
    return move, ERSHistory(last_move_to=to_role)
