"""MISA-T: adaptive session admission for mixed RLVR / RLHF / agentic rollout serving (docs/mechanisms.md).

When the three workload classes share one rollout service, their sessions hold KV for very different
times (agentic ones across tool gaps); prefix-aware routing alone does not control how they compete for
KV, and the mix the trainer consumes drifts from the one it asked for. The paper reports +53.3% / +43.6%
rollout throughput over a sweep-tuned cache-aware router, prefix hit rate 74.5% -> 96.2% and mixture
deviation 4.14 -> 2.71 points. A **session** is one task's conversation (a sample of a GRPO group); its
first request is a new session, the later ones are its continuations. One call of `admit` is one
**epoch**. The state (`MISATState`) stays with the caller, which passes it in and gets the new one back
(as with `ers.ERSHistory`), so both functions are pure.

Rules (origin in brackets):
- **continuations** are always admitted [paper]. A request with `turn > 0` whose session the state does
  not know (the caller restarted it) is a continuation too, and its session is counted as admitted from
  then on [ours: holding it would strand the KV it already has].
- **new sessions** are admitted only with room under the global session cap *and* their class quota, and
  with KV room (below); otherwise they are held in the **demand ledger** [paper]. The ledger remembers
  when each held session was first held; the caller offers held requests again at every call and each
  epoch re-checks them [paper: re-checked each epoch; that the router keeps no request, ours]. A ledger
  entry whose session is not offered again is dropped (the caller withdrew it) [ours].
- **time-aware demand and class quotas** [paper]: per class b, `R_b = N_b * k_b * T_b`, KV share
  `M_b = C * R_b / sum_b R_b`, quota `K_b = max(1, floor(M_b / k_b))`, where `k_b` is the session KV
  footprint (tokens), `T_b` the residency time (seconds from admission to end, tool gaps included) and
  C the service's KV capacity in tokens. The paper computes them per instance w (C_w, N_wb); here they are
  computed once over the service (C = sum of the replicas' KV) [ours: the router places after admitting].
  `N_b` counts the class's admitted sessions plus its held ones [ours: the ledger is the demand the
  quota must see, or a class with nothing admitted would get no share]. `k_b` and `T_b` are moving
  averages over the class's completed sessions (`smoothing` on the newest) [ours], starting from priors:
  `k_b` the paper's trace medians (input + output tokens per request) [paper's trace], `T_b` assumed
  [ours]. A caller at another scale passes its own priors.
- **residency-time-aware KV accounting** [paper's idea, the accounting ours]: an admitted session is
  charged `k_b` tokens of protected KV from admission until the caller reports its end, tool gaps
  included (its KV stays pinned while its tool runs); a new session needs `protected + k_b <= C` (or
  nothing admitted at all, so an oversized session still runs).
- **global session cap** [paper: shrinks when the prefix hit rate falls below its healthy reference; the
  base is a moving average of completed-session length; the formulas are ours]: `cap =
  max(1, floor(scale * C / L))`, `L` the moving average of completed sessions' KV tokens (prior: the
  target-weighted mean of the `k_b` priors). The healthy reference is `ref = min(reference_hit_rate, h*)`, h*
  the best smoothed hit rate observed so far (what this workload reaches when the KV is not thrashing: a
  workload of mostly new single-turn prompts never reaches a fixed 0.9, and must not be throttled for it). The
  pressure `G = max(0, ref - h)`, h the smoothed observed prefix hit rate (hit tokens / prefilled prompt tokens,
  `hit_smoothing`), shrinks `scale` multiplicatively at every observation under pressure, `scale *= 1 - shrink *
  G / ref`, down to `min_cap_scale`; a healthy observation (G = 0) adds `recover`, up to 1 [ours:
  multiplicative decrease, additive increase; the reference tracking the best observed rate].
- **mixture** [paper: the deviation `0.5 * sum_b |target_b - consumed_b|`; the steering ours]: among new
  sessions that may be admitted, the class most under its target share goes first, where a class's
  share counts its completed plus admitted sessions (what the trainer will consume); oldest first
  within a class. The default target is the paper's agentic / RLVR / RLHF = 48.6 / 33.1 / 18.2.
- **borrowing** [ours: the paper's quotas with idle reservations lent]: after the quota pass, the unused quota
  slots of classes with no session waiting (`K_b - admitted_b`) are lent to the waiting sessions of the other
  classes (the mixture order again, the global cap and KV room still apply), so a class without demand does not
  keep KV idle while others wait (light load). A class whose sessions arrive later finds its quota taken until
  borrowed sessions end; the starvation bound below still holds.
- **starvation bound** [ours]: a session held for `max_hold_epochs` epochs is *overdue*. Overdue sessions
  go before every other new session, oldest first, bypassing the class quota and the mixture preference
  (the global cap and KV room still apply), and while the oldest overdue session cannot be admitted no
  other new session is. So a session first held at epoch e is admitted by epoch
  `e + max_hold_epochs + n` at the latest, n the overdue sessions older than it, as long as each epoch
  leaves room for at least one session (sessions end): no stream of other classes can starve it.

The caller must report every session's end (finished, failed or dropped) through `observe`: an
unreported session keeps its protected KV and its place under the cap.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Mapping, Protocol, Sequence

AGENTIC, RLVR, RLHF = "agentic", "rlvr", "rlhf"
CLASSES = (AGENTIC, RLVR, RLHF)

# the trainer's target mixture in the paper (points; normalised by MISATConfig)
PAPER_TARGET = {AGENTIC: 48.6, RLVR: 33.1, RLHF: 18.2}
# the paper's trace, median input + output tokens per request: a session's KV footprint prior
PAPER_KV_TOKENS = {AGENTIC: 37_757 + 148, RLVR: 156 + 47_583, RLHF: 60 + 7_344}
# (ours, assumed) residency priors in seconds: agentic sessions run many turns across tool gaps, RLVR
# decodes long outputs, RLHF medium ones
PRIOR_RESIDENCY_S = {AGENTIC: 600.0, RLVR: 300.0, RLHF: 60.0}


class SessionRequest(Protocol):
    """What admission reads of a request (`policies.routing.Request` has it)."""
    request_id: int
    session: Hashable
    cls: str
    turn: int  # 0: the session's first request (a new session); > 0: a continuation


@dataclasses.dataclass(frozen=True)
class MISATConfig:
    target: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(PAPER_TARGET))  # paper
    prior_kv_tokens: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(PAPER_KV_TOKENS))
    prior_residency_s: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(PRIOR_RESIDENCY_S))
    reference_hit_rate: float = 0.9  # (ours) the healthy prefix hit rate; the paper's runs: 74.5% -> 96.2%
    hit_smoothing: float = 0.5  # (ours) weight of the newest observation in the smoothed hit rate
    shrink: float = 0.5  # (ours) cap scale *= 1 - shrink * G / reference_hit_rate under pressure G
    recover: float = 0.05  # (ours) cap scale += recover per healthy observation, up to 1
    min_cap_scale: float = 0.25  # (ours) the cap never shrinks below this share of its base
    smoothing: float = 0.2  # (ours) weight of a newly completed session in k_b, T_b and L
    max_hold_epochs: int = 8  # (ours) a session held this many epochs is overdue (starvation bound)

    def __post_init__(self):
        if not self.target or any(not v >= 0 for v in self.target.values()) or not sum(self.target.values()) > 0:
            raise ValueError(f"MISATConfig.target={dict(self.target)} needs non-negative shares with a positive sum")
        for name in ("prior_kv_tokens", "prior_residency_s"):
            values = getattr(self, name)
            missing = [b for b in self.target if b not in values]
            if missing:
                raise ValueError(f"MISATConfig.{name} lacks classes {missing}")
            if any(not values[b] > 0 for b in self.target):
                raise ValueError(f"MISATConfig.{name}={dict(values)} must be > 0")
        for name in ("reference_hit_rate", "hit_smoothing", "smoothing", "min_cap_scale"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"MISATConfig.{name}={getattr(self, name)} must be in (0, 1]")
        for name in ("shrink", "recover"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"MISATConfig.{name}={getattr(self, name)} must be in [0, 1]")
        if self.max_hold_epochs < 0:
            raise ValueError(f"MISATConfig.max_hold_epochs={self.max_hold_epochs} must be >= 0")

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.target)

    def target_share(self, cls: str) -> float:
        return self.target[cls] / sum(self.target.values())


@dataclasses.dataclass(frozen=True)
class Active:
    """An admitted session, until its end is observed."""
    session: Hashable
    cls: str
    admitted_s: float  # the caller's clock at admission (residency starts)
    kv_tokens: float  # protected KV charged to it: its class's k_b at admission


@dataclasses.dataclass(frozen=True)
class Held:
    """A new session in the demand ledger."""
    session: Hashable
    cls: str
    since_epoch: int  # the epoch it was first held


@dataclasses.dataclass(frozen=True)
class ClassStats:
    kv_tokens: float | None = None  # moving average of completed sessions' KV tokens (None: prior)
    residency_s: float | None = None  # moving average of their residency, tool gaps included (None: prior)
    completed: int = 0  # sessions of the class that ended (consumed)


@dataclasses.dataclass(frozen=True)
class MISATState:
    epoch: int = 0  # admission epochs so far (calls of `admit`)
    active: tuple[Active, ...] = ()
    ledger: tuple[Held, ...] = ()
    stats: tuple[tuple[str, ClassStats], ...] = ()  # (class, stats), classes seen so far
    session_tokens: float | None = None  # L: moving average of completed sessions' KV tokens (None: prior)
    hit_rate: float | None = None  # smoothed observed prefix hit rate (None: nothing observed yet)
    best_hit_rate: float | None = None  # the highest smoothed hit rate observed (the healthy reference's bound)
    cap_scale: float = 1.0  # the global cap's share of its base, shrunk by hit-rate pressure

    def class_stats(self, cls: str) -> ClassStats:
        return dict(self.stats).get(cls, ClassStats())


@dataclasses.dataclass(frozen=True)
class SessionEnd:
    """A session that ended (finished, failed or dropped) since the last observation."""
    session: Hashable
    cls: str
    kv_tokens: int  # KV tokens it held at its end (its context length)
    residency_s: float | None = None  # None: measured from its admission to `now_s`


@dataclasses.dataclass(frozen=True)
class Admitted:
    request_id: int
    reason: str  # "continuation", "admitted" (under cap and quota), "borrowed" (an idle class's quota) or "overdue"


@dataclasses.dataclass(frozen=True)
class Admission:
    admitted: tuple[Admitted, ...]  # in decision order
    held: tuple[int, ...]  # request ids held in the ledger (offer them again next epoch)
    state: MISATState
    cap: int  # the global session cap this epoch
    quotas: Mapping[str, int]  # K_b this epoch


def mixture_deviation(target: Mapping[str, float], counts: Mapping[str, float]) -> float:
    """Total-variation deviation `0.5 * sum_b |target_b - consumed_b|` of the consumed shares from the target
    shares, in [0, 1] (x100: points). Both are normalised; nothing consumed yet: 0."""
    total_t, total_c = sum(target.values()), sum(counts.values())
    if total_c <= 0:
        return 0.0
    classes = set(target) | set(counts)
    return 0.5 * sum(abs(target.get(b, 0.0) / total_t - counts.get(b, 0.0) / total_c) for b in classes)


def class_estimates(state: MISATState, config: MISATConfig = MISATConfig()) -> tuple[dict, dict]:
    """({class: k_b}, {class: T_b}): moving averages of completed sessions, else the priors."""
    k, t = {}, {}
    for b in config.classes:
        s = state.class_stats(b)
        k[b] = s.kv_tokens if s.kv_tokens is not None else float(config.prior_kv_tokens[b])
        t[b] = s.residency_s if s.residency_s is not None else float(config.prior_residency_s[b])
    return k, t


def demand(state: MISATState, config: MISATConfig = MISATConfig()) -> dict[str, float]:
    """Time-aware demand `R_b = N_b * k_b * T_b`, N_b = admitted + held sessions of class b."""
    k, t = class_estimates(state, config)
    n = {b: 0 for b in config.classes}
    for s in (*state.active, *state.ledger):
        n[s.cls] += 1
    return {b: n[b] * k[b] * t[b] for b in config.classes}


def class_quotas(capacity_tokens: float, state: MISATState, config: MISATConfig = MISATConfig()) -> dict[str, int]:
    """Session quota per class: `K_b = max(1, floor(M_b / k_b))`, `M_b = C * R_b / sum_b R_b` (the paper's)."""
    r = demand(state, config)
    k, _ = class_estimates(state, config)
    total = sum(r.values())
    return {b: max(1, math.floor((capacity_tokens * r[b] / total if total > 0 else 0.0) / k[b]))
            for b in config.classes}


def session_tokens(state: MISATState, config: MISATConfig = MISATConfig()) -> float:
    """L: the moving average of completed sessions' KV tokens; before any ended, the target-weighted prior."""
    if state.session_tokens is not None:
        return state.session_tokens
    return sum(config.target_share(b) * config.prior_kv_tokens[b] for b in config.classes)


def global_cap(capacity_tokens: float, state: MISATState, config: MISATConfig = MISATConfig()) -> int:
    """`max(1, floor(cap_scale * C / L))` sessions admitted at once (ours, see the module docstring)."""
    return max(1, math.floor(state.cap_scale * capacity_tokens / session_tokens(state, config)))


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


def observe(state: MISATState, ended: Sequence[SessionEnd] = (), *, now_s: float, hit_tokens: int = 0,
            prefill_tokens: int = 0, config: MISATConfig = MISATConfig()) -> MISATState:
    """The state after sessions ended and an epoch's prefix-cache counters (prompt tokens served from the
    cache, `hit_tokens`, of `prefill_tokens` prompt tokens) were observed."""
    if not 0 <= hit_tokens <= prefill_tokens:
        raise ValueError(f"MISA-T observe: need 0 <= hit_tokens={hit_tokens} <= prefill_tokens={prefill_tokens}")
    stats = dict(state.stats)
    active = {a.session: a for a in state.active}
    length = state.session_tokens
    for end in ended:
        if end.cls not in config.target:
            raise ValueError(f"MISA-T: session {end.session!r} has class {end.cls!r}, not one of {config.classes}")
        if end.kv_tokens < 0:
            raise ValueError(f"MISA-T: session {end.session!r} ended with kv_tokens={end.kv_tokens} < 0")
        admitted = active.pop(end.session, None)
        residency = end.residency_s
        if residency is None and admitted is not None:
            residency = max(0.0, now_s - admitted.admitted_s)
        s = stats.get(end.cls, ClassStats())
        stats[end.cls] = ClassStats(
            kv_tokens=_ema(s.kv_tokens, float(end.kv_tokens), config.smoothing) if end.kv_tokens > 0 else s.kv_tokens,
            residency_s=_ema(s.residency_s, residency, config.smoothing) if residency else s.residency_s,
            completed=s.completed + 1)
        if end.kv_tokens > 0:
            length = _ema(length, float(end.kv_tokens), config.smoothing)
    hit_rate, best, scale = state.hit_rate, state.best_hit_rate, state.cap_scale
    if prefill_tokens > 0:
        hit_rate = _ema(hit_rate, hit_tokens / prefill_tokens, config.hit_smoothing)
        best = hit_rate if best is None else max(best, hit_rate)
        reference = min(config.reference_hit_rate, best)
        pressure = max(0.0, reference - hit_rate)
        if pressure > 0:
            scale = max(config.min_cap_scale, scale * (1.0 - config.shrink * pressure / reference))
        else:
            scale = min(1.0, scale + config.recover)
    return dataclasses.replace(state, active=tuple(a for a in state.active if a.session in active),
                               stats=tuple(sorted(stats.items())), session_tokens=length, hit_rate=hit_rate, best_hit_rate=best,
                               cap_scale=scale)


def admit(state: MISATState, requests: Sequence[SessionRequest], *, capacity_tokens: float, now_s: float,
          config: MISATConfig = MISATConfig()) -> Admission:
    """One epoch: which of `requests` run now, which are held (see the module docstring for the rules).

    `requests` are this epoch's new requests plus every request held before (offered again), in the
    caller's order (oldest first); `capacity_tokens` is C, the service's KV capacity.
    """
    if capacity_tokens < 0:
        raise ValueError(f"MISA-T admit: capacity_tokens={capacity_tokens} must be >= 0")
    for r in requests:
        if r.cls not in config.target:
            raise ValueError(f"MISA-T: request {r.request_id} has class {r.cls!r}, not one of {config.classes}")
    epoch = state.epoch
    k, _ = class_estimates(state, config)
    active = list(state.active)
    active_ids = {a.session for a in active}
    admitted: list[Admitted] = []

    candidates, seen = [], set()  # new sessions, first request of each
    for r in requests:
        if r.turn > 0 or r.session in active_ids:
            if r.session not in active_ids:  # a continuation the admission never saw: count it from now
                active.append(Active(r.session, r.cls, now_s, k[r.cls]))
                active_ids.add(r.session)
            admitted.append(Admitted(r.request_id, "continuation"))
        elif r.session in seen:
            raise ValueError(f"MISA-T: two new-session requests for session {r.session!r}")
        else:
            seen.add(r.session)
            candidates.append(r)

    since = {h.session: h.since_epoch for h in state.ledger}
    ledger = {r.session: Held(r.session, r.cls, since.get(r.session, epoch)) for r in candidates}
    state = dataclasses.replace(state, active=tuple(active), ledger=tuple(ledger.values()))
    quotas = class_quotas(capacity_tokens, state, config)
    cap = global_cap(capacity_tokens, state, config)

    per_class = {b: 0 for b in config.classes}
    for a in active:
        per_class[a.cls] += 1
    protected = sum(a.kv_tokens for a in active)
    completed = {b: state.class_stats(b).completed for b in config.classes}

    def room(cls: str) -> bool:
        return len(active) < cap and (not active or protected + k[cls] <= capacity_tokens)

    def take(r, reason: str) -> None:
        nonlocal protected
        active.append(Active(r.session, r.cls, now_s, k[r.cls]))
        per_class[r.cls] += 1
        protected += k[r.cls]
        admitted.append(Admitted(r.request_id, reason))
        del ledger[r.session]

    order = sorted(range(len(candidates)), key=lambda i: (ledger[candidates[i].session].since_epoch, i))
    waiting = [candidates[i] for i in order]  # oldest first
    blocked = False
    for r in [q for q in waiting if epoch - ledger[q.session].since_epoch >= config.max_hold_epochs]:
        if not room(r.cls):
            blocked = True  # the oldest overdue session waits for room; nobody overtakes it
            break
        take(r, "overdue")
        waiting.remove(r)
    def most_under_target(classes: list[str]) -> str:
        total = sum(completed.values()) + sum(per_class.values())

        def deficit(b: str) -> float:
            share = (completed[b] + per_class[b]) / total if total > 0 else 0.0
            return config.target_share(b) - share
        return max(classes, key=lambda b: (deficit(b), -config.classes.index(b)))

    def fill(reason: str, quota, budget: float) -> None:
        """Admits waiting sessions in mixture order (the class most under its target first, oldest first within
        it) while under the cap, each class under `quota(class)`, at most `budget` of them; a class whose
        sessions do not fit the KV left is skipped (a smaller class's may)."""
        skipped: set[str] = set()
        taken = 0
        while not blocked and waiting and taken < budget and len(active) < cap:
            eligible = [b for b in config.classes
                        if b not in skipped and per_class[b] < quota(b) and any(q.cls == b for q in waiting)]
            if not eligible:
                break
            cls = most_under_target(eligible)
            if not room(cls):
                skipped.add(cls)
                continue
            r = next(q for q in waiting if q.cls == cls)
            take(r, reason)
            waiting.remove(r)
            taken += 1

    fill("admitted", lambda b: quotas[b], math.inf)
    # borrowing: the quota slots of classes with no session waiting are lent to the others (mixture order), so
    # KV reserved for a class without demand is not left idle
    lendable = sum(max(0, quotas[b] - per_class[b]) for b in config.classes if not any(q.cls == b for q in waiting))
    fill("borrowed", lambda b: math.inf, lendable)

    held_sessions = set(ledger)
    return Admission(
        admitted=tuple(admitted),
        held=tuple(r.request_id for r in candidates if r.session in held_sessions),
        state=dataclasses.replace(state, epoch=epoch + 1, active=tuple(active), ledger=tuple(ledger.values())),
        cap=cap, quotas=quotas)
