"""Resource-Aware Ref-Actor Pipelining (RA2P): how a train step runs its ref and actor passes.

TideRL, docs/mechanisms.md (RA2P). The trainer needs reference log-probs for every micro-batch before the
actor's forward/backward on it. Two modes (the paper's):

- **decoupled** streaming: ref and actor on different devices; the ref scores micro-batch i+1 while
  the actor trains on micro-batch i; no weight swaps.
- **colocated** aggregation: ref and actor share the devices; aggregate every ready micro-batch, run
  the ref pass over all of them, then the actor: one swap per burst.

Signals: M micro-batches per step; RAS (ready-at-start: micro-batches already in the ready buffer
when the step starts); TPRM (mean inter-arrival time of the micro-batches after the start); measured
per-micro-batch times `t_ref`, `t_act` on the colocated devices, the swap time `T_swap`, and the
speeds of the decoupled placement relative to the colocated one, `D_ref` (the ref on its own
devices) and `D_act` (the actor on its devices), plus a fixed decoupled overhead (`fill_drain_s`:
e.g. shipping ref log-probs between device sets).

Rule (ours: the paper gives the modes, not the choice): replay one step of each mode on the arrival
model (the RAS ready micro-batches at time 0, the k-th late one at `k * TPRM`) and pick the one whose
last actor pass ends first; a tie goes to colocated (`TIE_MODE`: one device set holds both weight
sets, which leaves ERS free to lend the rest to rollout).

- colocated (aggregation): a burst starts when a micro-batch is waiting and the devices are free,
  takes every micro-batch that has arrived, and costs `T_swap + n * (t_ref + t_act)`; what arrives
  meanwhile waits for the next burst.
- decoupled (streaming): a two-stage pipeline; micro-batch i leaves the ref stage at
  `ref_i = max(arrival_i, ref_{i-1}) + t_ref / D_ref` and the actor at
  `act_i = max(ref_i, act_{i-1}) + t_act / D_act`; cost `act_M + fill_drain_s`.

This gives the paper's regimes without tuning: with everything ready (high RAS) one colocated burst
pays a single swap and runs both passes on all the devices, while the pipeline runs each pass on
its share of them; with micro-batches trickling in (low RAS, TPRM below a burst's time) colocated
pays a swap per burst and serialises ref and actor, while the pipeline overlaps them with the
arrivals. (A first version summed closed-form terms, `C_dec = max(M t_ref / D_ref, M t_act / D_act)
+ fill_drain + late * max(0, TPRM - t_act)`; it charged colocated a full TPRM per late micro-batch
but decoupled only the part not hidden by one actor pass, so fewer ready micro-batches could never
move the choice towards decoupled's streaming: the replay replaced it.)

Metric served: per-step training time (docs/glossary.md); the runtime logs the choice and both costs
every step.
"""

from __future__ import annotations

import dataclasses

COLOCATED = "colocated"
DECOUPLED = "decoupled"
TIE_MODE = COLOCATED


@dataclasses.dataclass(frozen=True)
class RA2PSignals:
    num_microbatches: int  # M: micro-batches the step consumes
    ready_at_start: int  # RAS: of those, ready when the step starts (clipped to M)
    tprm_s: float  # TPRM: mean inter-arrival time of the micro-batches after the start
    t_ref_s: float  # ref pass of one micro-batch on the colocated devices
    t_act_s: float  # actor forward/backward of one micro-batch on the colocated devices
    t_swap_s: float  # one ref <-> actor weight swap (0 when both weight sets stay resident)
    ref_share: float  # D_ref: the decoupled ref's speed relative to the colocated devices
    act_share: float  # D_act: the decoupled actor's, likewise (1: it keeps the same devices)
    fill_drain_s: float = 0.0  # fixed extra cost of the decoupled mode

    def __post_init__(self):
        for name in ("num_microbatches", "ready_at_start", "tprm_s", "t_ref_s", "t_act_s", "t_swap_s",
                     "fill_drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RA2P signal {name}={getattr(self, name)} must be >= 0")
        for name in ("ref_share", "act_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RA2P signal {name}={getattr(self, name)} must be > 0: the decoupled "
                                 f"split needs devices for both the ref and the actor")


@dataclasses.dataclass(frozen=True)
class Decision:
    mode: str  # COLOCATED or DECOUPLED
    cost_colocated: float  # seconds
    cost_decoupled: float  # seconds


def arrivals(s: RA2PSignals) -> list[float]:
    """When each of the M micro-batches is ready, seconds after the step starts."""
    ras = min(s.ready_at_start, s.num_microbatches)
    return [0.0 if i < ras else (i - ras + 1) * s.tprm_s for i in range(s.num_microbatches)]


def colocated_replay(s: RA2PSignals) -> tuple[float, int]:
    """(seconds until the last actor pass ends, bursts) of the aggregation loop."""
    arrive = arrivals(s)
    done, clock, bursts = 0, 0.0, 0
    while done < len(arrive):
        clock = max(clock, arrive[done])
        take = done + 1
        while take < len(arrive) and arrive[take] <= clock:
            take += 1
        clock += s.t_swap_s + (take - done) * (s.t_ref_s + s.t_act_s)
        done, bursts = take, bursts + 1
    return clock, bursts


def colocated_cost(s: RA2PSignals) -> float:
    return colocated_replay(s)[0]


def decoupled_cost(s: RA2PSignals) -> float:
    ref_done = act_done = 0.0
    for t in arrivals(s):
        ref_done = max(t, ref_done) + s.t_ref_s / s.ref_share
        act_done = max(ref_done, act_done) + s.t_act_s / s.act_share
    return act_done + s.fill_drain_s


def choose_mode(s: RA2PSignals) -> Decision:
    """The mode whose replayed step ends first; a tie goes to `TIE_MODE`."""
    col, dec = colocated_cost(s), decoupled_cost(s)
    if col == dec:
        mode = TIE_MODE
    else:
        mode = COLOCATED if col < dec else DECOUPLED
    return Decision(mode=mode, cost_colocated=col, cost_decoupled=dec)


# ------------------------------------------------------------------ RA2P's devices: the training side's partition

@dataclasses.dataclass(frozen=True)
class Partition:
    """A move of one device group between the actor's (`train`) and the reference's own (`ref`) groups."""
    from_role: str  # "ref" (join the actor: colocated on more devices) or "train" (carve out a ref group)
    to_role: str
    gain_s: float  # predicted seconds saved per step (negative: a loss)
    cost_now_s: float  # the replayed step on the current partition, best mode
    cost_after_s: float  # and on the partition after the move


def _speed(groups: int, scaling: float) -> float:
    return 1.0 + scaling * (groups - 1)


def partition_cost(s: RA2PSignals, train_groups: int, ref_groups: int, to_train: int, to_ref: int,
                   scaling: float) -> float:
    """The replayed step's cost, best mode, with `to_train` actor groups and `to_ref` ref groups, from `s` measured
    on `train_groups` / `ref_groups` (t_ref_s, t_act_s on the train groups; ref_share: the ref groups' speed
    relative to them). A role's speed on j groups is 1 + scaling * (j - 1) of one group's (as ERS's)."""
    on = _speed(train_groups, scaling)
    act = dataclasses.replace(s, t_ref_s=s.t_ref_s * on / _speed(to_train, scaling),
                              t_act_s=s.t_act_s * on / _speed(to_train, scaling))
    cost = colocated_cost(act)
    if to_ref > 0:
        ref_share = (s.ref_share * _speed(to_ref, scaling) / _speed(ref_groups, scaling) if ref_groups > 0
                     else _speed(to_ref, scaling) / on)
        cost = min(cost, decoupled_cost(dataclasses.replace(
            s, ref_share=ref_share, act_share=_speed(to_train, scaling) / on)))
    return cost


def repartition(s: RA2PSignals, train_groups: int, ref_groups: int, max_ref_groups: int,
                scaling: float) -> Partition | None:
    """RA2P's own devices (ours: the paper gives the two modes, "ref and actor share the devices" or not; which
    devices the training side gives the reference is ours): the reference may hold up to `max_ref_groups` groups
    of its own (the config's), else it runs on the actor's. Colocated runs both passes on every training-side
    group only once the ref groups have joined the actor; decoupled needs them apart. Of the two neighbouring
    partitions (one ref group more, or one less), the one whose replayed step is cheapest, with its gain over
    the current partition's best mode; None when neither exists. Whether a move pays its cost, and
    hysteresis, are the caller's (the controller applies ERS's)."""
    if train_groups < 1 or ref_groups < 0 or max_ref_groups < 0 or not 0.0 <= scaling <= 1.0:
        raise ValueError(f"RA2P repartition needs train_groups >= 1, ref_groups and max_ref_groups >= 0, scaling in "
                         f"[0, 1]; got {train_groups}, {ref_groups}, {max_ref_groups}, {scaling}")
    now = partition_cost(s, train_groups, ref_groups, train_groups, ref_groups, scaling)
    options = []
    if ref_groups > 0:
        options.append(("ref", "train", train_groups + 1, ref_groups - 1))
    if ref_groups < max_ref_groups and train_groups > 1:
        options.append(("train", "ref", train_groups - 1, ref_groups + 1))
    best = None
    for frm, to, n, f in options:
        after = partition_cost(s, train_groups, ref_groups, n, f, scaling)
        if best is None or after < best.cost_after_s:
            best = Partition(frm, to, now - after, now, after)
    return best


@dataclasses.dataclass(frozen=True)
class RepartitionHistory:
    wanted: tuple[str, str] | None = None  # the (from, to) move that paid at the last boundaries
    streak: int = 0  # consecutive boundaries it paid
    refused: str = ""  # why this boundary's wanted move did not happen ("" if none was wanted)


@dataclasses.dataclass(frozen=True)
class RepartitionMove:
    from_role: str
    to_role: str
    mode: str  # the RA2P mode from the next step on
    reason: str
    gain_s: float  # predicted seconds saved over the steps left
    cost_s: float  # predicted seconds of the move


def decide_repartition(p: Partition | None, history: RepartitionHistory = RepartitionHistory(), *,
                       ref_groups: int, mode_now: str, step_time_s: float, horizon_steps: int, cost_s: float,
                       min_gain_fraction: float, patience: int, cooldown: int,
                       last_move_to: str | None = None, boundaries_since_move: int | None = None,
                       ) -> tuple[RepartitionMove | None, RepartitionHistory]:
    """Whether `repartition`'s move happens at this boundary, and the history for the next one (ERS's rules,
    applied to RA2P's devices): the per-step gain above the noise floor (`min_gain_fraction` of the step) and,
    over the `horizon_steps` left, above the move's `cost_s`; the same move paying at `patience` consecutive
    boundaries; no move back toward where a recent move (ERS's or RA2P's, `boundaries_since_move` <= `cooldown`
    boundaries ago) took a group from. After the move the reference runs colocated when its last group joined the
    actor, decoupled when a group was carved out for it, else as it did (`mode_now`)."""
    pays = p is not None and p.gain_s > min_gain_fraction * step_time_s and p.gain_s * horizon_steps > cost_s
    wanted = (p.from_role, p.to_role) if pays else None
    streak = history.streak + 1 if wanted is not None and wanted == history.wanted else int(wanted is not None)
    history = RepartitionHistory(wanted, streak)
    if wanted is None or streak < patience:
        return None, history
    if (last_move_to is not None and last_move_to != p.to_role and boundaries_since_move is not None
            and boundaries_since_move <= cooldown):
        return None, dataclasses.replace(history, refused=f"{p.from_role} -> {p.to_role} reverses a move made "
                                                          f"{boundaries_since_move} boundaries ago (cooldown {cooldown})")
    if p.to_role == "train" and ref_groups == 1:
        mode = COLOCATED
    elif p.to_role == "ref":
        mode = DECOUPLED
    else:
        mode = mode_now
    move = RepartitionMove(p.from_role, p.to_role, mode,
                           f"RA2P: {p.cost_now_s:.2f}s -> {p.cost_after_s:.2f}s per step",
                           p.gain_s * horizon_steps, cost_s)
    return move, RepartitionHistory()
