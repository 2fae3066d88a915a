"""Router policies of a multi-replica rollout service: which replica runs each request, which wait.

The service (N engine replicas behind a router) calls `route(name, requests, replicas, state, config,
now_s=, ended=)` at every scheduling tick, or `POLICIES[name]` with the same arguments; every policy
returns a `Routing`: placements, the request ids **held back**, and the router's new state (the caller
keeps it, as with `ers.ERSHistory`). The router keeps no request: held requests are the caller's to
offer again at the next call. Every request offered ends up in exactly one of placements or held;
nothing is dropped, even with no replica alive. Each `POLICIES` entry (a `RouterPolicy`) also says what
its caller must measure for it: prefix-cache lookups (`reads_prefix_cache`), workload classes and the
sessions that ended (`class_quotas`).

Views: a `Request` names its session (one task's multi-turn conversation, a sample of a GRPO group),
its class (`rlvr`, `rlhf`, `agentic`), its turn (0: a new session) and the replica holding the session's
KV (`kv_replica`, where its last turn ran); a `Replica` reports running and waiting requests, KV used /
pinned / free tokens, the tokens of each session's prefix it has cached, its prefix-cache counters and
tokens/s. Only live replicas are passed: a replica missing from the list is dead.

**Continuation rule** (common to all): a continuation goes to the replica holding its session's KV unless
the policy decides otherwise (that replica is at its limit; WAR's heavy-load score, MISA-T's placement
cost or cache_aware's balance threshold prefer another). A session whose replica died (`kv_replica` not
in the list) is re-routed as a new one (`Placement.rerouted`), its KV recomputed where it lands.

**Pinned rule** (common to all, applied by `route` after the policy): a continuation whose session's KV is
pinned on its live replica (`Request.kv_pinned`: the paused sequence this turn resumes, CTB's pin across the
tool gap) is never held: a turn the policy holds is placed there anyway (reason "pinned"). Holding it frees
nothing and keeps its KV pinned, and a replica whose pool is full of pinned sessions waiting on held turns
stops: its running turns cannot get pages until those sessions end [ours; measured: `war`'s KV window on
`benchmarks/misa_t.py`'s long regime held every pinned continuation while each replica's one running turn
waited for pages, a livelock].

Policies (origin in brackets):
- `round_robin` [baseline]: new sessions cycle over the live replicas in id order (the cursor is the
  state), skipping those at `concurrency_limit`.
- `least_loaded` [baseline]: new sessions go to the replica with the fewest running + waiting requests
  (placements of the same call included; then the lower KV use, then the lower id).
- `cache_aware` [baseline; the router MISA-T is measured against: the vLLM / SGLang cache-aware routers,
  SGLang's defaults]: prefix affinity: a request goes where the most of its session's prefix is cached
  (the replica holding its KV on a tie), if that is at least `cache_threshold` of its prompt, unless
  that replica's load exceeds the least-loaded one's by more than `balance_abs_threshold` requests and by
  a factor above `balance_rel_threshold`; then, or without enough cached prefix, to the least-loaded
  replica. Each replica takes at most a FIXED `concurrency_limit` requests (running + waiting): the knob
  a benchmark sweeps (the paper's tuned router: 128 and 48); a request finds only replicas below it,
  and is held when none is. SGLang tests the imbalance over all workers and falls back to the
  smallest radix tree without enough match; here the imbalance is the target's against the least
  loaded, and the fallback the least loaded [ours].
- `war`: `policies.war.place` on `war.ReplicaState(in_flight = running + waiting, window =
  war.concurrency_window(kv_used + kv_free - kv_pinned, war_footprint_tokens, war_max_batch))`: the
  window counts the KV not pinned by paused sessions [ours]; requests war.place leaves queued are held.
- `misa_t`: `policies.misa_t.observe` (the sessions that ended, the replicas' prefix-cache counters) then
  `misa_t.admit` over C = the live replicas' KV (used + free); admitted requests are placed by the
  paper's cost `d_w + (L_r - H_rw) / mu_w` (queueing delay, prompt tokens not cached on w, w's tokens/s),
  `d_w = queued_tokens_w / mu_w` and each placement adding its uncached tokens to w's queue [ours]; a
  replica that has not measured tokens/s yet counts at the mean of those that have (1 if none has).

The only imports are the sibling policies `war` and `misa_t` (reused, not rewritten): nothing else of the
project, no JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Mapping, Sequence

from . import misa_t as _misa_t
from . import war as _war
from .misa_t import CLASSES, MISATConfig, MISATState, SessionEnd

__all__ = ["CLASSES", "POLICIES", "Placement", "Replica", "Request", "RouterConfig", "RouterPolicy", "RouterState",
           "Routing", "SessionEnd", "cache_aware", "classes", "least_loaded", "misa_t", "round_robin", "route", "war"]


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: int
    session: Hashable  # one task's conversation (a sample of a GRPO group)
    cls: str = "agentic"  # one of CLASSES
    turn: int = 0  # 0: the session's first request (a new session); > 0: a continuation
    prompt_tokens: int = 0  # tokens of context this request prefills or finds cached (L_r)
    kv_replica: int | None = None  # replica holding the session's KV (its last turn ran there)
    kv_pinned: bool = False  # that KV is a paused sequence pinned there which this turn resumes (CTB)
    waiting_s: float = 0.0  # since it became ready (its observation came back)
    group_remaining_turns: float = 0.0  # predicted remaining turns of its GRPO group (WAR)

    def __post_init__(self):
        for name in ("turn", "prompt_tokens", "waiting_s", "group_remaining_turns"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"routing request {self.request_id}: {name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class Replica:
    replica: int
    running: int = 0  # requests decoding / prefilling on it
    waiting: int = 0  # requests queued on it
    kv_used_tokens: int = 0  # pinned included
    kv_pinned_tokens: int = 0  # held by paused sessions (tool gaps)
    kv_free_tokens: int = 0
    tokens_per_s: float = 0.0  # recently processed tokens per second (0: not measured yet)
    cached_tokens: Mapping[Hashable, int] = dataclasses.field(default_factory=dict)  # session -> prefix cached
    hit_tokens: int = 0  # prompt tokens served from its prefix cache since the last call
    prefill_tokens: int = 0  # prompt tokens it prefilled or found cached since the last call
    queued_tokens: int = 0  # prompt tokens of its waiting requests (MISA-T's queueing delay)

    def __post_init__(self):
        for name in ("running", "waiting", "kv_used_tokens", "kv_pinned_tokens", "kv_free_tokens", "tokens_per_s",
                     "hit_tokens", "prefill_tokens", "queued_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"routing replica {self.replica}: {name}={getattr(self, name)} must be >= 0")
        if self.kv_pinned_tokens > self.kv_used_tokens:
            raise ValueError(f"routing replica {self.replica}: kv_pinned_tokens={self.kv_pinned_tokens} > "
                             f"kv_used_tokens={self.kv_used_tokens}")
        if self.hit_tokens > self.prefill_tokens:
            raise ValueError(f"routing replica {self.replica}: hit_tokens={self.hit_tokens} > "
                             f"prefill_tokens={self.prefill_tokens}")

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_used_tokens + self.kv_free_tokens


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    concurrency_limit: int | None = None  # requests per replica at most (running + waiting); None: no limit
    cache_threshold: float = 0.5  # SGLang router default: cached share of the prompt for prefix affinity
    balance_abs_threshold: int = 32  # SGLang router default
    balance_rel_threshold: float = 1.0001  # SGLang router default
    war: _war.WARConfig = _war.WARConfig()
    war_footprint_tokens: float = 2048.0  # (ours) expected KV tokens of a request, for WAR's window
    war_max_batch: int = 256  # (ours, vLLM's default max_num_seqs) WAR's window at most
    war_min_window: int = 1
    misa_t: MISATConfig = MISATConfig()

    def __post_init__(self):
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"RouterConfig.concurrency_limit={self.concurrency_limit} must be >= 1 (or None)")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"RouterConfig.cache_threshold={self.cache_threshold} must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("RouterConfig: need balance_abs_threshold >= 0 and balance_rel_threshold >= 1")


@dataclasses.dataclass(frozen=True)
class RouterState:
    cursor: int = 0  # round_robin: the position of the next replica in id order
    misa_t: MISATState = MISATState()


@dataclasses.dataclass(frozen=True)
class Placement:
    request_id: int
    replica: int
    reason: str  # "sticky", "round-robin", "least-loaded", "prefix", "balance", war's, "cost" (misa_t), "pinned"
    rerouted: bool = False  # its session's KV was on a replica that died


@dataclasses.dataclass(frozen=True)
class Routing:
    placements: tuple[Placement, ...]  # in decision order
    held: tuple[int, ...]  # request ids held back: offer them again at the next call
    state: RouterState


Policy = Callable[..., Routing]


def _alive_kv(req: Request, alive: Mapping[int, Replica]) -> tuple[int | None, bool]:
    """(the live replica holding the session's KV or None, whether that replica died)."""
    if req.kv_replica is None:
        return None, False
    if req.kv_replica in alive:
        return req.kv_replica, False
    return None, True


class _Loads:
    """Running + waiting per replica, counting the placements of this call."""

    def __init__(self, replicas: Sequence[Replica], limit: int | None):
        self.load = {w.replica: w.load for w in replicas}
        self.limit = limit

    def room(self, w: int) -> bool:
        return self.limit is None or self.load[w] < self.limit

    def free(self) -> list[int]:
        return [w for w in self.load if self.room(w)]


def _finish(placements, held, state) -> Routing:
    return Routing(tuple(placements), tuple(held), state)


def round_robin(requests: Sequence[Request], replicas: Sequence[Replica], state: RouterState = RouterState(),
                config: RouterConfig = RouterConfig(), *, now_s: float = 0.0,
                ended: Sequence[SessionEnd] = ()) -> Routing:
    alive = {w.replica: w for w in replicas}
    ids = sorted(alive)
    loads = _Loads(replicas, config.concurrency_limit)
    cursor = state.cursor
    placements, held = [], []
    for req in requests:
        kv, died = _alive_kv(req, alive)
        if kv is not None and loads.room(kv):
            rep, reason = kv, "sticky"
        else:
            rep = None
            for step in range(len(ids)):
                candidate = ids[(cursor + step) % len(ids)]
                if loads.room(candidate):
                    rep, cursor = candidate, (cursor + step + 1) % len(ids)
                    break
            reason = "round-robin"
        if rep is None:
            held.append(req.request_id)
            continue
        loads.load[rep] += 1
        placements.append(Placement(req.request_id, rep, reason, died))
    return _finish(placements, held, dataclasses.replace(state, cursor=cursor))


def least_loaded(requests: Sequence[Request], replicas: Sequence[Replica], state: RouterState = RouterState(),
                 config: RouterConfig = RouterConfig(), *, now_s: float = 0.0,
                 ended: Sequence[SessionEnd] = ()) -> Routing:
    alive = {w.replica: w for w in replicas}
    loads = _Loads(replicas, config.concurrency_limit)
    placements, held = [], []
    for req in requests:
        kv, died = _alive_kv(req, alive)
        if kv is not None and loads.room(kv):
            rep, reason = kv, "sticky"
        else:
            free = loads.free()
            if not free:
                held.append(req.request_id)
                continue
            rep = min(free, key=lambda w: (loads.load[w], alive[w].kv_used_tokens, w))
            reason = "least-loaded"
        loads.load[rep] += 1
        placements.append(Placement(req.request_id, rep, reason, died))
    return _finish(placements, held, state)


def cache_aware(requests: Sequence[Request], replicas: Sequence[Replica], state: RouterState = RouterState(),
                config: RouterConfig = RouterConfig(), *, now_s: float = 0.0,
                ended: Sequence[SessionEnd] = ()) -> Routing:
    alive = {w.replica: w for w in replicas}
    loads = _Loads(replicas, config.concurrency_limit)
    placements, held = [], []
    for req in requests:
        kv, died = _alive_kv(req, alive)
        free = loads.free()
        if not free:
            held.append(req.request_id)
            continue
        least = min(free, key=lambda w: (loads.load[w], w))

        def cached(w: int) -> int:
            return alive[w].cached_tokens.get(req.session, 0)

        best = max(free, key=lambda w: (cached(w), w == kv, -loads.load[w], -w))
        share = cached(best) / req.prompt_tokens if req.prompt_tokens > 0 else float(cached(best) > 0)
        if cached(best) > 0 and share >= config.cache_threshold:
            target, reason = best, ("sticky" if best == kv else "prefix")
        elif kv is not None and loads.room(kv):
            target, reason = kv, "sticky"  # the common rule: its KV is there even if the view shows no prefix
        else:
            target, reason = least, "least-loaded"
        if target != least and (loads.load[target] - loads.load[least] > config.balance_abs_threshold
                                and loads.load[target] > config.balance_rel_threshold * loads.load[least]):
            target, reason = least, "balance"
        loads.load[target] += 1
        placements.append(Placement(req.request_id, target, reason, died))
    return _finish(placements, held, state)


def war(requests: Sequence[Request], replicas: Sequence[Replica], state: RouterState = RouterState(),
        config: RouterConfig = RouterConfig(), *, now_s: float = 0.0, ended: Sequence[SessionEnd] = ()) -> Routing:
    alive = {w.replica: w for w in replicas}
    states = [_war.ReplicaState(w.replica, in_flight=w.load, window=_war.concurrency_window(
        w.kv_capacity_tokens - w.kv_pinned_tokens, config.war_footprint_tokens, config.war_max_batch,
        config.war_min_window)) for w in replicas]
    signals, died = [], {}
    for req in requests:
        kv, died[req.request_id] = _alive_kv(req, alive)
        cached = {w.replica: w.cached_tokens[req.session] for w in replicas if req.session in w.cached_tokens}
        signals.append(_war.RequestSignals(req.request_id, waiting_s=req.waiting_s,
                                           group_remaining_turns=req.group_remaining_turns,
                                           cached_tokens=cached, last_replica=kv))
    if not replicas:
        return _finish([], [r.request_id for r in requests], state)
    placed, queued = _war.place(signals, states, config.war)
    return _finish([Placement(p.request_id, p.replica, p.reason, died[p.request_id]) for p in placed],
                   queued, state)


def misa_t(requests: Sequence[Request], replicas: Sequence[Replica], state: RouterState = RouterState(),
           config: RouterConfig = RouterConfig(), *, now_s: float = 0.0,
           ended: Sequence[SessionEnd] = ()) -> Routing:
    mconf = config.misa_t
    ms = _misa_t.observe(state.misa_t, ended, now_s=now_s, hit_tokens=sum(w.hit_tokens for w in replicas),
                         prefill_tokens=sum(w.prefill_tokens for w in replicas), config=mconf)
    if not replicas:  # nowhere to run: hold everything, admit nothing (no epoch passes)
        return _finish([], [r.request_id for r in requests], dataclasses.replace(state, misa_t=ms))
    adm = _misa_t.admit(ms, requests, capacity_tokens=sum(w.kv_capacity_tokens for w in replicas), now_s=now_s,
                        config=mconf)
    alive = {w.replica: w for w in replicas}
    measured = [w.tokens_per_s for w in replicas if w.tokens_per_s > 0]
    default_mu = sum(measured) / len(measured) if measured else 1.0
    mu = {w.replica: w.tokens_per_s if w.tokens_per_s > 0 else default_mu for w in replicas}
    queued = {w.replica: float(w.queued_tokens) for w in replicas}
    load = {w.replica: w.load for w in replicas}
    by_id = {r.request_id: r for r in requests}
    placements = []
    for a in adm.admitted:
        req = by_id[a.request_id]
        kv, died = _alive_kv(req, alive)

        def uncached(w: int) -> float:
            return max(0, req.prompt_tokens - alive[w].cached_tokens.get(req.session, 0))

        rep = min(alive, key=lambda w: ((queued[w] + uncached(w)) / mu[w], w != kv, load[w], w))
        queued[rep] += uncached(rep)
        load[rep] += 1
        placements.append(Placement(req.request_id, rep, "sticky" if rep == kv else "cost", died))
    return _finish(placements, adm.held, dataclasses.replace(state, misa_t=adm.state))


@dataclasses.dataclass(frozen=True)
class RouterPolicy:
    """A policy and what its caller must give it beyond the load views (called as the policy itself)."""

    decide: Policy
    # reads `Replica.cached_tokens` for replicas not holding the session's KV: the caller looks every request's
    # context up in every replica's prefix cache
    reads_prefix_cache: bool = False
    # admits by workload class (`Request.cls`, MISA-T's quotas from the `ended` sessions): the caller's class
    # labels decide admission, and the sessions that ended must be reported
    class_quotas: bool = False

    def __call__(self, *args, **kwargs) -> Routing:
        return self.decide(*args, **kwargs)


POLICIES: dict[str, RouterPolicy] = {
    "round_robin": RouterPolicy(round_robin), "least_loaded": RouterPolicy(least_loaded),
    "cache_aware": RouterPolicy(cache_aware, reads_prefix_cache=True), "war": RouterPolicy(war),
    "misa_t": RouterPolicy(misa_t, reads_prefix_cache=True, class_quotas=True)}


def classes(config: RouterConfig = RouterConfig()) -> tuple[str, ...]:
    """The workload classes a request may name: `CLASSES` and those of MISA-T's target."""
    return tuple(CLASSES) + tuple(c for c in config.misa_t.target if c not in CLASSES)


def route(policy: str, requests: Sequence[Request], replicas: Sequence[Replica],
          state: RouterState = RouterState(), config: RouterConfig = RouterConfig(), *, now_s: float = 0.0,
          ended: Sequence[SessionEnd] = ()) -> Routing:
    """`POLICIES[policy]` after checking the views: unique request and replica ids, known classes.

    `ended`: sessions that ended since the last call (MISA-T releases their KV and learns k_b, T_b from
    them; the other policies ignore it). `now_s`: the caller's clock (MISA-T's residency times)."""
    if policy not in POLICIES:
        raise ValueError(f"routing: unknown policy {policy!r}; one of {sorted(POLICIES)}")
    ids = [w.replica for w in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError(f"routing: duplicate replica ids in {ids}")
    rids = [r.request_id for r in requests]
    if len(set(rids)) != len(rids):
        raise ValueError(f"routing: duplicate request ids in {rids}")
    known = classes(config)
    for r in requests:
        if r.cls not in known:
            raise ValueError(f"routing request {r.request_id}: class {r.cls!r} is not one of {known}")
    decision = POLICIES[policy](requests, replicas, state, config, now_s=now_s, ended=ended)
    return _place_pinned(decision, requests, {w.replica for w in replicas})


def _place_pinned(decision: Routing, requests: Sequence[Request], alive: set[int]) -> Routing:
    """The pinned rule (module docstring): held continuations whose KV is pinned on a live replica go there."""
    by_id = {r.request_id: r for r in requests}
    pinned = [i for i in decision.held if by_id[i].kv_pinned and by_id[i].turn > 0 and by_id[i].kv_replica in alive]
    if not pinned:
        return decision
    placements = decision.placements + tuple(Placement(i, by_id[i].kv_replica, "pinned") for i in pinned)
    return Routing(placements, tuple(i for i in decision.held if i not in set(pinned)), decision.state)
