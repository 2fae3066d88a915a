"""`SimRouter`: the simulator's replicas behind the project's router policies (`SimConfig.router`).

With a router policy set (any of `policies.routing.POLICIES`), every placement decision of the simulated
rollout goes through `routing.route`, as the real rollout service's (`serving/service.py`) do: a new task (a
session: one sample of a GRPO group) and each continuation after a tool gap (a resumed turn). The event core
(replicas.py) offers them (`offer`) and asks for a routing call at that instant (`ReplicaCore._route_soon`: one
heap entry per instant, so what happens at one instant is decided together); `call` builds the views, calls the
policy and applies its placements (`ReplicaCore._assign`). Held requests stay offered and go to the router
again at the next call, which the next event that can change the answer brings: a turn ends (its replica's
load falls), a task ends, the replica set changes (`changed`). Nothing is dropped: every policy places when
a replica has room, and every held request is offered again until placed.

The views follow the service's conventions:

- `Request`: session `(group, sample)`, the task's class, its turn, `prompt_tokens` = the context the turn starts
  from, `kv_replica` = the live replica that ran its last turn (its KV, pinned or cached, is there; None for a new
  task or one whose replica was removed), `kv_pinned` when that KV is pinned there (CTB), `waiting_s` since its
  observation came back (or it was first offered), `group_remaining_turns` = CTB's expected remaining turns of the
  task after the turns it has done (`ctb.expected_remaining_turns` over the finished-task window; ours: the
  group's estimate is its sample's).
- `Replica`: running = turns decoding or prefilling; waiting = turns queued (CTB: also awaiting task admission)
  or placed this instant; KV used (pinned included) / pinned / free tokens, where prefix cache is free (it is
  evictable); per pending session the tokens of its context cached there (its pinned KV but the new
  observation, its own prefix-cache entry of the current version, else its group's prompt held there: the KV
  model's hit rules, kv.py); the prompt tokens admitted there and those found cached since the last call; tokens
  prefilled and decoded per busy second there, in virtual time, over its life (0 before its first event);
  `queued_tokens` = the engine's "context of the waiting ones not computed yet": a waiting turn's whole context
  (the engine matches prefix-cache blocks only when it admits it), a pinned resume's new observation (CTB).

Tasks that end are reported at the next call as `SessionEnd(session, class, context tokens)` (MISA-T learns its
class estimates and releases its protected KV); `finished` logs each task's (class, first offered, ended) for
the study (routing_study.py). Plain Python (not compiled): it reads the core's state through its public
attributes.
"""

from __future__ import annotations

import collections

from tiderl_jax.policies import ctb, routing


class SimRouter:
    """The router of one `SimBackend` (see the module docstring)."""

    def __init__(self, core, policy: str, config: routing.RouterConfig):
        if policy not in routing.POLICIES:
            raise ValueError(f"SimRouter: unknown policy {policy!r}; one of {sorted(routing.POLICIES)}")
        self.core, self.policy, self.config = core, policy, config
        self.state = routing.RouterState()
        self.offered: dict = {}  # task (_Seq) -> [request id, time it became ready], oldest first
        self.ended: list[routing.SessionEnd] = []
        self.finished: list[tuple[str, float, float]] = []  # (class, first offered, ended) per finished task
        self.armed = False  # a routing call is on the core's heap at this instant
        self._ids = 0
        self._remaining: dict = {}  # (turns done, finished window) -> expected remaining turns
        self.counters = collections.Counter(calls=0, offered=0, placed=0, held=0, moved=0, ended=0)

    # ------------------------------------------------------------------ what the event core calls

    def offer(self, seq) -> None:
        """`seq` waits for a placement (a new task, or a continuation whose observation is back)."""
        now = self.core.loop._now
        if seq.born < 0:
            seq.born = now
        self.offered[seq] = [self._ids, now]
        self._ids += 1
        self.counters["offered"] += 1
        self.request()

    def ended_task(self, seq) -> None:
        now = self.core.loop._now
        self.ended.append(routing.SessionEnd((seq.gid, seq.sample), seq.cls, seq.ctx))
        self.finished.append((seq.cls, seq.born, now))
        self.counters["ended"] += 1
        self.changed()

    def changed(self) -> None:
        """Something that can change the router's answer happened: held requests are offered again now."""
        if self.offered:
            self.request()

    def request(self) -> None:
        if not self.armed:
            self.armed = True
            self.core._route_soon()

    # ------------------------------------------------------------------ the routing call

    def call(self) -> None:
        """One routing call: the offered tasks and the live replicas' views to `routing.route`; placements
        applied in its order, held tasks kept for the next call."""
        self.armed = False
        if not self.offered:
            return
        core = self.core
        now = core.loop._now
        live = [r for r in core.replicas.values() if r.alive]
        by_rid = {r.rid: r for r in live}
        seqs = list(self.offered)
        by_request = {}
        requests = []
        for s in seqs:
            request_id, ready = self.offered[s]
            by_request[request_id] = s
            kv = s.replica.rid if s.replica is not None and s.replica.alive and (s.turn or s.written) else None
            requests.append(routing.Request(request_id, (s.gid, s.sample), s.cls, s.turn, prompt_tokens=s.ctx,
                                            kv_replica=kv, kv_pinned=bool(kv is not None and s.pinned),
                                            waiting_s=max(0.0, now - ready),
                                            group_remaining_turns=self._remaining_turns(s.turn)))
        views = [self._view(r, seqs) for r in live]
        ended, self.ended = self.ended, []
        decision = routing.route(self.policy, requests, views, self.state, self.config, now_s=now, ended=ended)
        self.state = decision.state
        self.counters["calls"] += 1
        self.counters["held"] += len(decision.held)
        for p in decision.placements:
            s = by_request[p.request_id]
            del self.offered[s]
            r = by_rid[p.replica]
            self.counters["placed"] += 1
            if s.replica is not None and s.replica is not r and s.replica.alive:
                self.counters["moved"] += 1  # a continuation placed off its KV: recomputed where it lands
            core._assign(s, r)

    def _remaining_turns(self, turn: int) -> float:
        core = self.core
        key = (turn, core._window)
        value = self._remaining.get(key)
        if value is None:
            if len(self._remaining) > 4096:
                self._remaining.clear()
            value = self._remaining[key] = max(0.0, ctb.expected_remaining_turns(turn, core._window,
                                                                                  core.workload.max_turns))
        return value

    def _view(self, r, seqs) -> routing.Replica:
        ps = self.core.ps
        waiting = len(r.queue) + len(r.pending) + len(r.arrivals)
        queued = (sum(self._to_compute(r, s) for s in r.queue) + sum(self._to_compute(r, s) for s in r.pending)
                  + sum(self._to_compute(r, entry[2]) for entry in r.arrivals))
        pinned = sum(s.kv_pages for s in r.pinned) * ps
        cached = {}
        for s in seqs:
            c = self._cached(r, s, ps)
            if c > 0:
                cached[(s.gid, s.sample)] = c
        hits, prompts = r.r_cached - r.r_seen_cached, r.r_prompt - r.r_seen_prompt
        r.r_seen_cached, r.r_seen_prompt = r.r_cached, r.r_prompt
        return routing.Replica(r.rid, running=len(r.running) + len(r.prefilling), waiting=waiting,
                               kv_used_tokens=r.used * ps, kv_pinned_tokens=pinned,
                               kv_free_tokens=max(0, r.capacity - r.used) * ps,
                               tokens_per_s=r.r_tokens / r.r_busy if r.r_busy > 0 else 0.0, cached_tokens=cached,
                               hit_tokens=hits, prefill_tokens=prompts, queued_tokens=queued)

    @staticmethod
    def _to_compute(r, s) -> int:
        return s.new_tokens if s.pinned and s.replica is r else s.ctx

    @staticmethod
    def _cached(r, s, ps: int) -> int:
        """Tokens of `s`'s context an admission on `r` would find cached now (kv.py's rules)."""
        if s.pinned and s.replica is r:
            return s.ctx - s.new_tokens
        entry = r.cache.get(s)
        cached = entry[1] if entry is not None and entry[2] == r.version else 0
        if not cached:
            p = r.prompts.get(s.gid)
            if p is not None and p[0] == r.version and p[1] > 0:
                cached = (s.prompt - 1) // ps * ps
        return min(cached, s.ctx)
