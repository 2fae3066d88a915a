"""Resource-Aware Ref-Actor Pipelining (RA2P): how a train step runs its ref and actor passes.

TideRL, MECHANISMS.md §1b. The trainer needs reference log-probs for every micro-batch before the
actor's forward/backward on it. Two modes (the paper's):

- **decoupled** streaming: ref and actor on different devices; the ref scores micro-batch i+1 while
  the actor trains on micro-batch i; no weight swaps.
- **colocated** aggregation: ref and actor share the devices; aggregate every ready micro-batch, run
  the ref pass over all of them, then the actor: one swap per burst.

Signals: M micro-batches per step; RAS (ready-at-start: micro-batches already in the ready buffer
when the step starts); TPRM (mean inter-arrival time of the micro-batches after the start); measured
per-micro-batch times `t_ref`, `t_act` (on the train group, ref and actor sharing it), the swap
time `T_swap`, the decoupled split's speed shares `D_ref`, `D_act` and its pipeline fill/drain time.

Rule (ours: the paper gives the modes, not the choice), with `late = M - min(RAS, M)` and
`wait(n, tprm) = n * tprm`:

    C_col = bursts * T_swap + M * (t_ref + t_act) + wait(late, TPRM)
    C_dec = max(M * t_ref / D_ref, M * t_act / D_act) + fill_drain + late * max(0, TPRM - t_act)

pick the smaller; a tie goes to colocated (`TIE_MODE`: it holds one copy of the weights on one
device set, which leaves ERS free to lend the rest to rollout). `bursts` is a signal when the
runtime measured it (the last step's count), else `estimate_bursts` (ours) replays the aggregation
loop on the arrival model: ready micro-batches arrive at time 0, the k-th late one at k * TPRM; a
burst takes every micro-batch that has arrived when it starts (waiting for the next one when none
has), costs `T_swap + n * (t_ref + t_act)`, and whatever arrives meanwhile waits for the next burst.

Note on the formulas: one more late micro-batch costs colocated `TPRM` (plus maybe a burst) but
decoupled only `max(0, TPRM - t_act)`, so lowering RAS or lengthening TPRM never moves the choice
towards colocated. What makes colocated win here is a slow decoupled split (small `D_ref`, `D_act`)
or a long fill/drain, not the RAS/TPRM regime the paper's prose associates with it.

Metric served: per-step training time (MECHANISMS.md §9); the runtime logs the choice and both costs
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
    t_ref_s: float  # ref pass of one micro-batch on the (shared) train group
    t_act_s: float  # actor forward/backward of one micro-batch on the train group
    t_swap_s: float  # one ref <-> actor weight swap
    ref_share: float  # D_ref: the ref's speed in the decoupled split, relative to the whole group
    act_share: float  # D_act: the actor's, likewise (e.g. 2 of 8 devices, linear scaling: 0.25)
    fill_drain_s: float  # decoupled pipeline fill plus drain
    bursts: int | None = None  # measured colocated bursts per step; None: `estimate_bursts`

    def __post_init__(self):
        for name in ("num_microbatches", "ready_at_start", "tprm_s", "t_ref_s", "t_act_s", "t_swap_s",
                     "fill_drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RA2P signal {name}={getattr(self, name)} must be >= 0")
        for name in ("ref_share", "act_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RA2P signal {name}={getattr(self, name)} must be > 0: the decoupled "
                                 f"split needs devices for both the ref and the actor")
        if self.bursts is not None and self.bursts < 0:
            raise ValueError(f"RA2P signal bursts={self.bursts} must be >= 0 (or None to estimate)")


@dataclasses.dataclass(frozen=True)
class Decision:
    mode: str  # COLOCATED or DECOUPLED
    cost_colocated: float  # seconds
    cost_decoupled: float  # seconds


def wait(n: int, tprm: float) -> float:
    """Seconds until n more micro-batches have arrived."""
    return n * tprm


def late_microbatches(s: RA2PSignals) -> int:
    """M - RAS: micro-batches that arrive after the step starts."""
    return s.num_microbatches - min(s.ready_at_start, s.num_microbatches)


def estimate_bursts(s: RA2PSignals) -> int:
    """Colocated bursts in one step, replaying the aggregation loop on the arrival model (ours)."""
    ras = min(s.ready_at_start, s.num_microbatches)

    def arrival(i: int) -> float:  # when micro-batch i (0-based) is ready
        return 0.0 if i < ras else wait(i - ras + 1, s.tprm_s)

    done, clock, bursts = 0, 0.0, 0
    while done < s.num_microbatches:
        clock = max(clock, arrival(done))
        take = done + 1
        while take < s.num_microbatches and arrival(take) <= clock:
            take += 1
        clock += s.t_swap_s + (take - done) * (s.t_ref_s + s.t_act_s)
        done, bursts = take, bursts + 1
    return bursts


def colocated_cost(s: RA2PSignals) -> float:
    bursts = estimate_bursts(s) if s.bursts is None else s.bursts
    m = s.num_microbatches
    return bursts * s.t_swap_s + m * (s.t_ref_s + s.t_act_s) + wait(late_microbatches(s), s.tprm_s)


def decoupled_cost(s: RA2PSignals) -> float:
    m = s.num_microbatches
    return (max(m * s.t_ref_s / s.ref_share, m * s.t_act_s / s.act_share) + s.fill_drain_s
            + late_microbatches(s) * max(0.0, s.tprm_s - s.t_act_s))


def choose_mode(s: RA2PSignals) -> Decision:
    """The cheaper mode by the cost model; a tie goes to `TIE_MODE`."""
    col, dec = colocated_cost(s), decoupled_cost(s)
    if col == dec:
        mode = TIE_MODE
    else:
        mode = COLOCATED if col < dec else DECOUPLED
    return Decision(mode=mode, cost_colocated=col, cost_decoupled=dec)
