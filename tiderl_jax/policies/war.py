"""WAR (workload-aware rollout): request placement across replicas, the concurrency window, and when
to switch speculative decoding on.

WAR (docs/mechanisms.md), for synchronous agentic RL; the paper reports 1.4x at low load to 1.6x at
high load rollout throughput. A request is one turn of an agentic task (a session) that is ready to
generate; a replica is one rollout engine.

- **Placement** (`place`, the paper's criteria; the load test and greedy matching ours):
  - light load (`is_heavy` false): least-loaded with sticky sessions: a request goes back to the
    replica that ran its session's last turn (its KV is there) if that replica has room, else to
    the replica with the lowest load `in_flight / window` (then fewest in flight, then lowest id).
  - heavy load: score every (request, replica-with-room) pair lexicographically, smaller first:
        (-(waiting_s - wait_threshold_s)+,   waiting past the threshold first (>>: protects sandbox
                                             timeouts), longest overdue first
         group_remaining_turns,              then fewer predicted remaining turns of its GRPO group
         -cached_tokens[replica],            then the replica holding more of its context
         in_flight / window)                 then the less loaded replica
    and place the best pair, repeatedly, until no request or no room is left. The first two
    components depend on the request only, so requests are taken in that order and the pair search
    runs only among requests that tie on them.
  - the load is heavy (ours) when `in_flight + pending > heavy_load * sum(window)`: more work than
    the replicas run at once, so requests queue and the order in which they get a slot matters.
- **Concurrency window** (`concurrency_window`, ours): how many requests a replica runs at once:
  the sessions its free KV holds at their expected footprint, at least `min_window`, at most
  `max_batch` (beyond which decode is compute bound and adds latency, not throughput).
- **Speculative decoding** (`use_speculation`, the paper's rule): on for a replica only while its
  effective batch B is small (<= `spec_max_batch`, about 16 in the paper) and a speculative step
  pays for itself per emitted token: `T_spec(B) / accepted_tokens(B) < T_decode(B)`, where
  `accepted_tokens` counts the tokens one speculative step emits per sequence (accepted drafts + 1,
  up to and including a stop token: drafts verified past the turn's end are not emitted).
  The drafter in the paper is model-free (suffix trees over earlier trajectories); the rule only
  needs its measured step time and acceptance.
- **The engine's per-step switch** (`switch_speculation`, ours around the paper's rule): the engine
  measures both kinds of step per batch class (moving averages, `smoothing` on the newest) and asks
  per decode step. A class with no plain measurement runs plain, then one with no speculative
  measurement speculates (each kind measured once); every `probe_every`-th decision *of that class*
  runs the kind the rule did not choose last, so both measurements stay current (a class's own
  count: decisions of other classes never land its probes); otherwise the rule with hysteresis:
  speculation turns on only when it saves `margin` of a plain step, and off only when it saves
  nothing (the measurements are noisy: a measured tie leaves it where it is).

Metric served: rollout throughput (tokens per second) and, through the waiting threshold, fewer
environment-side timeouts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

SPEC_MAX_BATCH = 16  # the paper: speculation pays at effective batches of about 16 or fewer


@dataclasses.dataclass(frozen=True)
class WARConfig:
    wait_threshold_s: float = 30.0  # (ours) waiting past this outranks everything (sandbox timeouts)
    heavy_load: float = 1.0  # (ours) heavy when in_flight + pending > heavy_load * total window

    def __post_init__(self):
        for name in ("wait_threshold_s", "heavy_load"):
            if getattr(self, name) < 0:
                raise ValueError(f"WARConfig.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    replica: int
    in_flight: int  # requests running on it now
    window: int  # concurrency window: the most it runs at once

    def __post_init__(self):
        if self.in_flight < 0:
            raise ValueError(f"WAR replica {self.replica}: in_flight={self.in_flight} must be >= 0")
        if self.window < 1:
            raise ValueError(f"WAR replica {self.replica}: window={self.window} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RequestSignals:
    request_id: int
    waiting_s: float  # since the request became ready (its observation came back)
    group_remaining_turns: float  # predicted remaining turns of its GRPO group
    cached_tokens: Mapping[int, int] = dataclasses.field(default_factory=dict)  # replica -> tokens cached
    last_replica: int | None = None  # replica that ran its session's previous turn

    def __post_init__(self):
        for name in ("waiting_s", "group_remaining_turns"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"WAR request {self.request_id}: {name}={getattr(self, name)} must be >= 0")
        for replica, tokens in self.cached_tokens.items():
            if tokens < 0:
                raise ValueError(f"WAR request {self.request_id}: cached_tokens[{replica}]={tokens} must be >= 0")


@dataclasses.dataclass(frozen=True)
class Placement:
    request_id: int
    replica: int
    reason: str  # "sticky", "least-loaded" (light load) or "scored" (heavy load)


def _check_replicas(replicas: Sequence[ReplicaState]) -> None:
    ids = [r.replica for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError(f"WAR replicas: duplicate replica ids in {ids}")


def is_heavy(num_pending: int, replicas: Sequence[ReplicaState], config: WARConfig = WARConfig()) -> bool:
    """More work than the replicas run at once: `in_flight + pending > heavy_load * total window`."""
    total_window = sum(r.window for r in replicas)
    return sum(r.in_flight for r in replicas) + num_pending > config.heavy_load * total_window


def _load(in_flight: int, window: int) -> float:
    return in_flight / window


def request_key(r: RequestSignals, config: WARConfig) -> tuple[float, float]:
    """The request-only part of the heavy-load score (smaller first)."""
    return (-max(0.0, r.waiting_s - config.wait_threshold_s), r.group_remaining_turns)


def place(requests: Sequence[RequestSignals], replicas: Sequence[ReplicaState],
          config: WARConfig = WARConfig()) -> tuple[list[Placement], list[int]]:
    """(placements in decision order, ids of the requests left queued)."""
    _check_replicas(replicas)
    in_flight = {r.replica: r.in_flight for r in replicas}
    window = {r.replica: r.window for r in replicas}

    def room(rep: int) -> bool:
        return in_flight[rep] < window[rep]

    def replica_key(req: RequestSignals, rep: int) -> tuple[float, float, int, int]:
        return (-req.cached_tokens.get(rep, 0), _load(in_flight[rep], window[rep]), in_flight[rep], rep)

    placements: list[Placement] = []
    queued: list[int] = []
    if not is_heavy(len(requests), replicas, config):
        for req in sorted(requests, key=lambda q: -q.waiting_s):  # longest waiting first
            if req.last_replica in window and room(req.last_replica):
                rep, reason = req.last_replica, "sticky"
            else:
                free = [rep for rep in window if room(rep)]
                if not free:
                    queued.append(req.request_id)
                    continue
                rep = min(free, key=lambda x: (_load(in_flight[x], window[x]), in_flight[x], x))
                reason = "least-loaded"
            in_flight[rep] += 1
            placements.append(Placement(req.request_id, rep, reason))
        return placements, queued

    order = sorted(range(len(requests)), key=lambda i: (request_key(requests[i], config), i))
    start = 0
    while start < len(order):  # one run of requests that tie on the request-only key
        end = start + 1
        key = request_key(requests[order[start]], config)
        while end < len(order) and request_key(requests[order[end]], config) == key:
            end += 1
        tied = [requests[i] for i in order[start:end]]
        while tied:
            free = [rep for rep in window if room(rep)]
            if not free:
                break
            req, rep = min(((q, rep) for q in tied for rep in free),
                           key=lambda pair: replica_key(pair[0], pair[1]))
            in_flight[rep] += 1
            placements.append(Placement(req.request_id, rep, "scored"))
            tied.remove(req)
        queued.extend(q.request_id for q in tied)
        start = end
    return placements, queued


def concurrency_window(kv_free_tokens: int, footprint_tokens: float, max_batch: int, min_window: int = 1) -> int:
    """Requests a replica runs at once: `clamp(floor(kv_free_tokens / footprint_tokens), min_window,
    max_batch)` (ours)."""
    if kv_free_tokens < 0:
        raise ValueError(f"concurrency_window: kv_free_tokens={kv_free_tokens} must be >= 0")
    if not footprint_tokens > 0:
        raise ValueError(f"concurrency_window: footprint_tokens={footprint_tokens} must be > 0")
    if not 1 <= min_window <= max_batch:
        raise ValueError(f"concurrency_window: need 1 <= min_window={min_window} <= max_batch={max_batch}")
    return max(min_window, min(max_batch, math.floor(kv_free_tokens / footprint_tokens)))


@dataclasses.dataclass(frozen=True)
class SpecDecision:
    use: bool
    spec_s_per_token: float  # T_spec(B) / accepted_tokens(B)
    decode_s_per_token: float  # T_decode(B)
    effective_batch: int
    spec_max_batch: int
    margin: float = 0.0  # the fraction of the plain step's time speculation must save

    @property
    def reason(self) -> str:
        """Why (made when read: the simulator decides at every replica event)."""
        if self.effective_batch == 0:
            return "no sequence to decode"
        if self.effective_batch > self.spec_max_batch:
            return f"batch {self.effective_batch} > {self.spec_max_batch}"
        relation = "<" if self.use else ">="
        bar = self.decode_s_per_token * (1 - self.margin)
        within = f" ({self.margin:.0%} under {self.decode_s_per_token:.4g}s)" if self.margin else ""
        return f"{self.spec_s_per_token:.4g}s {relation} {bar:.4g}s per token{within}"


def use_speculation(effective_batch: int, t_spec_s: float, accepted_tokens: float, t_decode_s: float,
                    spec_max_batch: int = SPEC_MAX_BATCH, margin: float = 0.0) -> SpecDecision:
    """Speculate iff `effective_batch <= spec_max_batch` and
    `t_spec_s / accepted_tokens < t_decode_s * (1 - margin)`.

    `margin` (0 in the paper's rule) is for a caller deciding on noisy measurements: speculation must
    save that fraction of a plain step before it is chosen, so a measured tie does not flip the switch.
    """
    if effective_batch < 0:
        raise ValueError(f"use_speculation: effective_batch={effective_batch} must be >= 0")
    for name, v in (("t_spec_s", t_spec_s), ("t_decode_s", t_decode_s), ("accepted_tokens", accepted_tokens)):
        if not v > 0:
            raise ValueError(f"use_speculation: {name}={v} must be > 0")
    if not 0 <= margin < 1:
        raise ValueError(f"use_speculation: margin={margin} must be in [0, 1)")
    use = speculation_pays(effective_batch, t_spec_s, accepted_tokens, t_decode_s, spec_max_batch, margin)
    return SpecDecision(use, t_spec_s / accepted_tokens, t_decode_s, effective_batch, spec_max_batch, margin)


def speculation_pays(effective_batch: int, t_spec_s: float, accepted_tokens: float, t_decode_s: float,
                     spec_max_batch: int = SPEC_MAX_BATCH, margin: float = 0.0) -> bool:
    """`use_speculation`'s rule without its checks and explanation, for a caller that decides at every
    decode event on inputs it made itself (the simulator's replicas)."""
    return (0 < effective_batch <= spec_max_batch
            and t_spec_s / accepted_tokens < t_decode_s * (1 - margin))


@dataclasses.dataclass(frozen=True)
class SpecSwitchConfig:
    max_batch: int = SPEC_MAX_BATCH  # speculation only at effective batches up to this
    margin: float = 0.1  # (ours) share of a plain step speculation must save to turn on (noisy measurements)
    probe_every: int = 64  # (ours) every probe_every-th decision of a batch class runs the kind not chosen
    smoothing: float = 0.2  # (ours) weight of the newest step in the measured moving averages

    def __post_init__(self):
        if self.max_batch < 1 or self.probe_every < 1:
            raise ValueError(f"SpecSwitchConfig: need max_batch >= 1 and probe_every >= 1, got {self}")
        if not 0 <= self.margin < 1 or not 0 < self.smoothing <= 1:
            raise ValueError(f"SpecSwitchConfig: need margin in [0, 1) and smoothing in (0, 1], got {self}")


@dataclasses.dataclass(frozen=True)
class SpecClassHistory:
    """One batch class's switch state (the caller keeps one per class, as with `ers.ERSHistory`)."""

    decisions: int = 0  # of this class
    last_use: bool = False  # what the rule chose last (measurements and probes aside)


def switch_speculation(effective_batch: int, t_decode_s: float | None, t_spec_s: float | None,
                       accepted_tokens: float | None, history: SpecClassHistory = SpecClassHistory(),
                       config: SpecSwitchConfig = SpecSwitchConfig()
                       ) -> tuple[bool, SpecClassHistory, SpecDecision | None]:
    """Whether this decode step speculates (module docstring), on the measurements of its batch class (None:
    not measured yet); returns the class's new history and the rule's decision when the rule decided (None for a
    first measurement or a probe)."""
    if not 1 <= effective_batch <= config.max_batch:
        return False, history, None
    decisions = history.decisions + 1
    if t_decode_s is None:
        return False, dataclasses.replace(history, decisions=decisions), None
    if t_spec_s is None or accepted_tokens is None:
        return True, dataclasses.replace(history, decisions=decisions), None
    if decisions % config.probe_every == 0:  # refresh the measurement of the kind not chosen lately
        return not history.last_use, dataclasses.replace(history, decisions=decisions), None
    decision = use_speculation(effective_batch, t_spec_s, accepted_tokens, t_decode_s, config.max_batch,
                               margin=0.0 if history.last_use else config.margin)
    return decision.use, SpecClassHistory(decisions, decision.use), decision
