"""The rollout service: N engine replicas behind a router.

Every rollout goes through it: `agents.rollout.RolloutRunner` asks it for each turn of each task, and the
service decides where the turn runs (`policies.routing`, the policy chosen by `ServiceConfig.policy`), runs
it there and returns the engine's output. One replica is the plain case (the runner over one `Engine`); N
replicas are N `Engine`s, each on its own device group, stepping concurrently (each engine step runs in a
worker thread; JAX releases the GIL while a device program runs).

```
runner ─ turn(session, submit, resume) ─► pending ─► route(policy, pending, replicas' views) ─► placement
                                             ▲                         │ held: offered again at the next tick
                                             └─────────────────────────┘
placement on the replica that holds the session's KV: resume (only the new tokens are prefilled)
placement elsewhere: the old replica releases the session (its full blocks stay in its prefix cache), the new
one submits the whole context (its KV recomputed, or found in that replica's prefix cache)
```

A **session** is one task's multi-turn conversation (a sample of a GRPO group): the runner names it in every
turn, so a continuation goes back to the replica holding its KV unless the policy decides otherwise. The
service keeps, per session, the replica and engine handle of its KV; `release(session)` drops that KV and
`end_session` also tells the router the session ended (MISA-T learns its classes' demand from it).

Each replica is driven by a `Driver`: it owns the engine, applies commands (submit, resume, release, a weight
swap) between engine steps and hands each turn's output to whoever waits for it. Per-replica stats
(`stats()`): running, waiting, KV used / pinned / free, prefix-cache hits, tokens/s; the router reads the same
numbers as `policies.routing.Replica` views. An engine is read only between its steps: a step runs in a worker
thread and moves sequences, pages and counters as it goes, so while one runs the router and `stats()` read what
the replica recorded right before it (`EngineReplica.observe`). A policy that reads the prefix cache
(`RouterPolicy.reads_prefix_cache`) gets each turn's lookups made between steps: a turn is offered to it once
every live replica has looked its context up (a replica stepping does so right before its next step; a turn
placed there waits for that step anyway).

Faults: an engine step that raises kills its replica (`EngineFailed`, naming the error). The turns that were
in flight or queued there go back to the router and run on a live replica from their whole context (the KV
recomputed), counted in `counters["rerouted"]`; only when no replica is left does a turn fail, with the last
replica's `EngineFailed`. A request the engine refuses (`RequestError`) fails that turn only. A step listener
that raises (`step_listeners`: they run between steps, not in the engine) is logged and the replica goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Callable, Hashable, Sequence

from tiderl_jax.engine.engine import Engine, SequenceOutput
from tiderl_jax.engine.sampling import RequestError
from tiderl_jax.policies import routing

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """An engine's step raised: that engine is unusable, so every turn and command on it fails with this (the
    service re-routes a failed turn while another replica is alive). `fatal`: the run cannot go on (the
    controller stops rather than fail every later sample)."""

    fatal = True


class Driver:
    """Owns one engine: applies queued commands between steps, reports ended turns to their waiters.

    `before_step()` runs before each engine step (CTB relieves KV pressure there), `on_turn_end(handle)` when a
    turn ends, before the next step (CTB pins the KV there), `after_step(seconds)` after each step, `observe()`
    right before each step starts: the last moment the engine may be read until `stepping` is false again."""

    def __init__(self, engine: Engine, before_step: Callable[[], None] = lambda: None,
                 on_turn_end: Callable[[int], None] = lambda h: None, step_span=None,
                 after_step: Callable[[float], None] = lambda s: None, observe: Callable[[], None] = lambda: None):
        self.engine = engine
        self.step_span = step_span or contextlib.nullcontext  # wraps each engine step (metrics)
        self.before_step = before_step
        self.on_turn_end = on_turn_end
        self.after_step = after_step
        self.observe = observe
        self.stepping = False  # an engine step runs in a worker thread: nothing else may read the engine
        self._commands: list = []
        self._waiters: dict[int, asyncio.Future] = {}
        self._wake = asyncio.Event()
        self.stop = False
        self.error: BaseException | None = None  # what the engine's step raised; the driver has ended

    def command(self, fn: Callable[[], object], wait_turn: bool = False) -> asyncio.Future:
        """Queues fn (run between steps). With wait_turn, the future gets the SequenceOutput of the turn fn
        starts (fn must return its handle); otherwise fn's result. After an engine failure the future has
        already failed with `EngineFailed`."""
        fut = asyncio.get_running_loop().create_future()
        if self.error is not None:
            fut.set_exception(self.failed())
            return fut
        self._commands.append((fn, wait_turn, fut))
        self._wake.set()
        return fut

    @property
    def busy(self) -> bool:
        return bool(self._commands)

    def failed(self) -> EngineFailed:
        e = EngineFailed(f"rollout engine step failed: {type(self.error).__name__}: {self.error}")
        e.__cause__ = self.error
        return e

    def abandon(self, handle: int, error: Exception) -> None:
        """The turn of `handle` will never end (aborted): whoever waits for it gets `error` instead."""
        fut = self._waiters.pop(handle, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def _fail_all(self, error: BaseException):
        """The engine's step raised: every waiting turn and queued command fails with it."""
        self.error = error
        log.error("rollout engine step failed (%s: %s); failing every pending turn", type(error).__name__, error)
        pending = [fut for _, _, fut in self._commands] + list(self._waiters.values())
        self._commands, self._waiters = [], {}
        for fut in pending:
            if not fut.done():
                fut.set_exception(self.failed())

    def _apply(self):
        commands, self._commands = self._commands, []
        for fn, wait_turn, fut in commands:
            try:
                result = fn()
            except Exception as e:  # a refused request fails its task, not the run
                fut.set_exception(e)
                continue
            if wait_turn:
                self._waiters[result] = fut
            else:
                fut.set_result(result)

    async def run(self):
        while not self.stop:
            self._apply()
            try:
                stepped = await self._step()
            except Exception as e:  # noqa: BLE001 - the engine is broken: fail its waiters, never hang them
                self._fail_all(e)
                return
            if not stepped:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.01)
                except asyncio.TimeoutError:
                    pass

    async def _step(self) -> bool:
        """One engine step, if it has work (False if not); the turns it ended go to their waiters."""
        if not self.engine.has_work():
            return False
        self.before_step()
        self.observe()
        t0 = time.perf_counter()
        self.stepping = True
        try:
            with self.step_span():
                ended = await asyncio.to_thread(self.engine.step)
        finally:
            self.stepping = False
        self.after_step(time.perf_counter() - t0)
        for h in ended:
            fut = self._waiters.pop(h, None)
            if fut is not None:
                self.on_turn_end(h)
            if fut is not None and not fut.done():
                try:
                    fut.set_result(self.engine.get(h))
                except Exception as e:  # noqa: BLE001 - e.g. an engine worker refused it: that task fails
                    fut.set_exception(e)
        return True


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    policy: str = "least_loaded"  # policies.routing.POLICIES
    router: routing.RouterConfig = routing.RouterConfig()
    tick_s: float = 0.01  # held requests are offered again at least this often (and whenever a turn ends)
    tokens_per_s_window: int = 32  # engine steps the replicas' tokens/s is measured over

    def __post_init__(self):
        if self.policy not in routing.POLICIES:
            raise ValueError(f"serving policy {self.policy!r} is not one of {sorted(routing.POLICIES)}")
        if not self.tick_s > 0 or self.tokens_per_s_window < 1:
            raise ValueError("ServiceConfig: need tick_s > 0 and tokens_per_s_window >= 1")


class EngineReplica:
    """One engine of the service, its driver and what the router reads of it: the engine read now between its
    steps, else what `observe` recorded right before the step that runs (module docstring)."""

    def __init__(self, replica_id: int, engine: Engine, window: int):
        self.id = replica_id
        self.engine = engine
        self.driver: Driver | None = None
        self.task: asyncio.Task | None = None
        self.alive = True
        self.sessions: dict[Hashable, int] = {}  # session -> engine handle of its KV here
        self.in_turn: dict[Hashable, _Pending] = {}  # sessions whose turn runs here now
        self._steps = collections.deque(maxlen=window)  # (seconds, tokens) of its recent engine steps
        self._kv: dict[int, int] = {}  # engine handle -> KV tokens, at `observe`
        self.observe()
        self._last_tokens = self._processed()
        self._seen = (0, 0)  # prompt / cached prompt tokens at the router's last look

    @property
    def stepping(self) -> bool:
        return self.driver is not None and self.driver.stepping

    def _read(self) -> tuple[dict, dict, int]:
        e = self.engine
        return e.stats(), e.load(), e.free_kv_tokens()

    def observe(self) -> None:
        """Records what is read of the engine while its next step runs: its counters, load, free KV, and the KV of
        the sessions it holds or runs (between steps only: the driver calls it right before each step)."""
        self._observed = self._read()
        handles = set(self.sessions.values()) | {p.handle for p in self.in_turn.values() if p.handle is not None}
        self._kv = {}
        for h in handles:
            with contextlib.suppress(RequestError):
                self._kv[h] = self.engine.num_kv_tokens(h)

    def _numbers(self) -> tuple[dict, dict, int]:
        return self._observed if self.stepping else self._read()

    def kv_tokens(self, handle: int) -> int | None:
        """Tokens of KV engine sequence `handle` holds (None: not there)."""
        if self.stepping:
            return self._kv.get(handle)
        with contextlib.suppress(RequestError):
            return self.engine.num_kv_tokens(handle)
        return None

    def look_up(self, pending: Sequence["_Pending"]) -> None:
        """Each pending turn's context in this engine's prefix cache (`_Pending.prefix`; between steps only)."""
        for p in pending:
            p.prefix[self.id] = self.engine.cached_prefix_tokens(p.tokens)

    def _processed(self) -> int:
        c = self._numbers()[0]
        return c["prefill_tokens_computed"] + c["decode_tokens"]

    def record_step(self, seconds: float) -> None:
        now = self._processed()
        self._steps.append((seconds, now - self._last_tokens))
        self._last_tokens = now

    @property
    def tokens_per_s(self) -> float:
        """Tokens prefilled and decoded per second of its recent engine steps (0 before the first)."""
        seconds = sum(s for s, _ in self._steps)
        return sum(n for _, n in self._steps) / seconds if seconds > 0 else 0.0

    def stats(self) -> dict:
        ps = self.engine.config.page_size
        c, load, free = self._numbers()
        return dict(replica=self.id, alive=self.alive, running=load["running"], waiting=load["waiting"],
                    sessions=len(self.sessions), kv_used_tokens=c["pages_used"] * ps,
                    kv_pinned_tokens=load["pinned_kv_tokens"], kv_free_tokens=free,
                    prefix_hit_tokens=c["prompt_tokens_cached"], prompt_tokens=c["prompt_tokens"],
                    prefix_hit_rate=c["prefix_hit_rate"], tokens_per_s=self.tokens_per_s,
                    queued_tokens=load["queued_tokens"], steps=c["steps"], version=c["version"])

    def view(self, pending: Sequence["_Pending"], reads_prefix_cache: bool) -> routing.Replica:
        """The router's view; `cached_tokens` for the sessions of `pending`: the KV of those held here, else (for
        the policies that read them) their prefix-cache lookups here."""
        st = self.stats()
        # turns dispatched here whose command has not run yet count as waiting, their contexts as queued
        unstarted = [q for q in self.in_turn.values() if q.handle is None]
        waiting = max(st["waiting"], len(self.in_turn) - st["running"])
        queued = st["queued_tokens"] + sum(len(q.tokens) for q in unstarted)
        cached = {}
        for p in pending:
            h = self.sessions.get(p.session)
            kv = self.kv_tokens(h) if h is not None else None
            if kv is not None:
                cached[p.session] = kv
            if reads_prefix_cache and not cached.get(p.session):
                cached[p.session] = p.prefix.get(self.id, 0)
        hits, prompts = st["prefix_hit_tokens"] - self._seen[1], st["prompt_tokens"] - self._seen[0]
        self._seen = (st["prompt_tokens"], st["prefix_hit_tokens"])
        return routing.Replica(self.id, running=st["running"], waiting=waiting,
                               kv_used_tokens=max(st["kv_used_tokens"], st["kv_pinned_tokens"]),
                               kv_pinned_tokens=st["kv_pinned_tokens"], kv_free_tokens=st["kv_free_tokens"],
                               tokens_per_s=st["tokens_per_s"], cached_tokens=cached, hit_tokens=min(hits, prompts),
                               prefill_tokens=prompts, queued_tokens=queued)


@dataclasses.dataclass
class _Pending:
    request_id: int
    session: Hashable
    cls: str
    turn: int
    tokens: Sequence[int]  # the context this turn starts from (for the prefix lookups)
    submit: Callable[[Engine], int]
    resume: Callable[[Engine, int], int] | None
    future: asyncio.Future
    ready_s: float
    group_remaining_turns: float = 0.0
    rerouted: bool = False
    released: bool = False  # the session was released while this turn was queued or ran
    handle: int | None = None  # its engine sequence once started
    prefix: dict[int, int] = dataclasses.field(default_factory=dict)  # replica id -> context tokens cached there


class RolloutService:
    """N engine replicas behind a router (module docstring)."""

    def __init__(self, engines: Sequence[Engine], config: ServiceConfig = ServiceConfig(),
                 clock: Callable[[], float] = time.perf_counter):
        if not engines:
            raise ValueError("a rollout service needs at least one engine")
        self.config = config
        self.policy = routing.POLICIES[config.policy]
        self.clock = clock
        self._ids = itertools.count()
        self.replicas: list[EngineReplica] = [EngineReplica(next(self._ids), e, config.tokens_per_s_window)
                                              for e in engines]
        self._pending: dict[int, _Pending] = {}
        self._where: dict[Hashable, int] = {}  # session -> replica id holding its KV
        self._ended: list[routing.SessionEnd] = []
        self._state = routing.RouterState()
        self._requests = itertools.count()
        self._last_route = -float("inf")
        self._hooks = (lambda rep: None, lambda rep, h: None, None)
        # called with the replica after each of its engine steps, between steps (e.g. the HTTP server streams
        # its running sequences' new tokens from here)
        self.step_listeners: list[Callable[[EngineReplica], None]] = []
        self._started = False
        self.counters = collections.Counter(turns=0, resumed=0, submitted=0, moved=0, rerouted=0, held=0,
                                            replica_failures=0)

    # ------------------------------------------------------------------ replicas

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.replicas]

    def live(self) -> list[EngineReplica]:
        return [r for r in self.replicas if r.alive]

    def replica(self, replica_id: int) -> EngineReplica:
        for r in self.replicas:
            if r.id == replica_id:
                return r
        raise KeyError(f"no replica {replica_id} in the rollout service (replicas: {[r.id for r in self.replicas]})")

    def where(self, session: Hashable) -> tuple[EngineReplica, int] | None:
        """The replica and engine handle holding `session`'s KV, or None."""
        rid = self._where.get(session)
        if rid is None:
            return None
        rep = self.replica(rid)
        return rep, rep.sessions[session]

    def add_replica(self, engine: Engine) -> int:
        """A new replica (e.g. devices ERS or BiDiRL gave to rollout); routed to from the next tick on."""
        rep = EngineReplica(next(self._ids), engine, self.config.tokens_per_s_window)
        self.replicas.append(rep)
        if self._started:
            self._start_driver(rep)
        self._route(force=True)
        return rep.id

    async def remove_replica(self, replica_id: int) -> int:
        """Takes a replica out (its devices go elsewhere): no new turn is placed on it, the turns running there
        finish, then its sessions' KV is released (their next turns run elsewhere from their whole context).
        Returns the number of sessions moved off it."""
        rep = self.replica(replica_id)
        if len(self.live()) == 1 and rep.alive:
            raise ValueError(f"replica {replica_id} is the rollout service's last live replica")
        rep.alive = False
        while rep.in_turn and rep.driver is not None and rep.driver.error is None:
            await asyncio.sleep(0.005)
        moved = list(rep.sessions)
        for session in moved:
            self.release(session)
        if rep.driver is not None:
            while rep.driver.busy:
                await asyncio.sleep(0.005)
            rep.driver.stop = True
            await rep.task
        self.replicas.remove(rep)
        self._route(force=True)
        return len(moved)

    # ------------------------------------------------------------------ running

    async def start(self, before_step: Callable[[EngineReplica], None] = lambda rep: None,
                    on_turn_end: Callable[[EngineReplica, int], None] = lambda rep, h: None, step_span=None) -> None:
        """Starts every replica's driver: `before_step(replica)` before each of its engine steps,
        `on_turn_end(replica, handle)` when a turn ends there, `step_span`: wraps each engine step."""
        self._hooks = (before_step, on_turn_end, step_span)
        self._started = True
        for rep in self.replicas:
            self._start_driver(rep)

    def _start_driver(self, rep: EngineReplica) -> None:
        before_step, on_turn_end, step_span = self._hooks

        def after_step(seconds: float, rep=rep):
            rep.record_step(seconds)
            for listener in self.step_listeners:  # the engine is idle until its next step: state reads are safe
                try:
                    listener(rep)
                except Exception:  # noqa: BLE001 - a listener's error is not the engine's: the replica goes on
                    log.exception("a step listener of rollout replica %d raised; the replica goes on", rep.id)
            self._route()

        def observe(rep=rep):
            rep.observe()
            if self.policy.reads_prefix_cache:
                rep.look_up(list(self._pending.values()))
        rep.driver = Driver(rep.engine, lambda: before_step(rep), lambda h: on_turn_end(rep, h), step_span, after_step,
                            observe)
        rep.task = asyncio.create_task(rep.driver.run())
        rep.task.add_done_callback(lambda t, rep=rep: self._driver_ended(rep))
        self._tick_task = getattr(self, "_tick_task", None) or asyncio.create_task(self._ticks())

    async def _ticks(self):
        """Offers held requests again every tick (MISA-T's epochs pass even when no engine steps)."""
        while self._started:
            await asyncio.sleep(self.config.tick_s)
            if self._pending:
                self._route()

    async def stop(self) -> None:
        """Lets queued commands (the final releases) land, then stops every driver."""
        for rep in self.replicas:
            while rep.driver is not None and rep.driver.busy and rep.driver.error is None:
                await asyncio.sleep(0.005)
        for rep in self.replicas:
            if rep.driver is not None:
                rep.driver.stop = True
        await asyncio.gather(*(rep.task for rep in self.replicas if rep.task is not None))
        self._started = False
        if getattr(self, "_tick_task", None) is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
            self._tick_task = None

    def command(self, fn: Callable[[], object], replica: int | None = None) -> asyncio.Future:
        """Runs `fn` between engine steps of one replica (default: the first live one); the future gets its
        result."""
        rep = self.replica(replica) if replica is not None else (self.live() or self.replicas)[0]
        return rep.driver.command(fn)

    async def command_all(self, fn: Callable[[EngineReplica], object]) -> list:
        """Runs `fn(replica)` between engine steps of every live replica (e.g. a weight swap); their results."""
        return list(await asyncio.gather(*(rep.driver.command(lambda rep=rep: fn(rep)) for rep in self.live())))

    # ------------------------------------------------------------------ turns

    async def turn(self, session: Hashable, *, tokens: Sequence[int], submit: Callable[[Engine], int],
                   resume: Callable[[Engine, int], int] | None = None, cls: str = "agentic", turn: int = 0,
                   group_remaining_turns: float = 0.0) -> tuple[EngineReplica, SequenceOutput]:
        """Runs one turn of `session` where the router places it; returns the replica and the engine's output.

        `tokens`: the context the turn starts from; `submit(engine) -> handle` starts it on an engine from that
        whole context; `resume(engine, handle) -> handle` continues it on the engine that holds the session's
        KV (None: always submit). RequestError when the engine refuses it; EngineFailed when no replica is left.
        """
        p = _Pending(next(self._requests), session, cls, turn, tokens, submit, resume,
                     asyncio.get_running_loop().create_future(), self.clock(), group_remaining_turns)
        self._pending[p.request_id] = p
        self._route(force=True)
        return await p.future

    def release(self, session: Hashable) -> None:
        """Drops `session`'s KV (its full blocks stay in that replica's prefix cache); its next turn is submitted
        from its whole context. A turn of it not placed yet is dropped, one running is aborted: either way its
        caller gets a RequestError (not a cancellation: the caller itself was not cancelled)."""
        for rid in [rid for rid, p in self._pending.items() if p.session == session]:
            fut = self._pending.pop(rid).future
            if not fut.done():
                fut.set_exception(RequestError(f"session {session!r} was released before its turn started"))
        for rep in self.replicas:
            p = rep.in_turn.get(session)
            if p is not None:
                p.released = True
                if p.handle is not None:
                    self._end_handle(rep, p.handle)
        rid = self._where.pop(session, None)
        if rid is not None:
            rep = self.replica(rid)
            self._end_handle(rep, rep.sessions.pop(session))

    def _end_handle(self, rep: EngineReplica, handle: int) -> None:
        """Ends an engine sequence between steps: released when paused, aborted while it runs, then forgotten."""
        if rep.driver is None or rep.driver.error is not None:
            return
        engine, driver = rep.engine, rep.driver

        def end():
            try:
                out = engine.get(handle)
            except RequestError:  # already gone
                return
            if out.status.value == "paused":
                engine.release(handle)
            elif out.status.value in ("waiting", "prefilling", "running"):
                engine.abort(handle)  # its turn ends now: the service's waiter is told, not left hanging
                driver.abandon(handle, RequestError(f"engine sequence {handle}: its session was released while "
                                                    "its turn ran"))
            engine.forget(handle)
        # nobody awaits it: after an engine failure its EngineFailed is read here, not logged as unread
        rep.driver.command(end).add_done_callback(lambda f: f.cancelled() or f.exception())

    def end_session(self, session: Hashable, cls: str, kv_tokens: int) -> None:
        """The session ended (finished or failed): its KV is released and the router told (MISA-T)."""
        self.release(session)
        if self.policy.class_quotas:  # the other policies learn nothing from it
            self._ended.append(routing.SessionEnd(session, cls, kv_tokens))
        self._route(force=True)

    # ------------------------------------------------------------------ routing

    def _route(self, force: bool = False) -> None:
        """Offers the pending turns to the router; dispatches its placements, keeps what it holds."""
        now = self.clock()
        if not self._pending and not self._ended:
            return
        if not force and now - self._last_route < self.config.tick_s:
            return
        self._last_route = now
        live = [r for r in self.replicas if r.alive and r.driver is not None]
        if not live and self._started and self._pending:
            self._fail_pending()
            return
        pending = list(self._pending.values())
        reads_cache = self.policy.reads_prefix_cache
        if reads_cache:
            for rep in live:
                if not rep.stepping:
                    rep.look_up(pending)
            # offered once every live replica has looked it up (one stepping does right before its next step)
            pending = [p for p in pending if all(rep.id in p.prefix for rep in live)]
            if not pending and not self._ended:
                return
        views = [r.view(pending, reads_cache) for r in live]
        requests = [routing.Request(p.request_id, p.session, p.cls, p.turn,
                                    prompt_tokens=len(p.tokens), kv_replica=self._where.get(p.session),
                                    kv_pinned=p.resume is not None and p.session in self._where,
                                    waiting_s=max(0.0, now - p.ready_s),
                                    group_remaining_turns=max(0.0, p.group_remaining_turns))
                    for p in pending]
        ended, self._ended = self._ended, []
        decision = routing.route(self.config.policy, requests, views, self._state, self.config.router,
                                 now_s=now, ended=ended)
        self._state = decision.state
        self.counters["held"] += len(decision.held)
        for placement in decision.placements:
            self._dispatch(self._pending.pop(placement.request_id), self.replica(placement.replica))

    def _dispatch(self, p: _Pending, rep: EngineReplica) -> None:
        held = self.where(p.session)
        self.counters["turns"] += 1
        if held is not None and held[0] is rep and p.resume is not None:
            handle = held[1]
            start = lambda: p.resume(rep.engine, handle)  # noqa: E731
            self.counters["resumed"] += 1
        else:
            if held is not None:
                self.counters["moved"] += held[0] is not rep
                self.release(p.session)
            start = lambda: p.submit(rep.engine)  # noqa: E731
            self.counters["submitted"] += 1

        def fn():
            if p.released:
                raise RequestError(f"session {p.session!r} was released before its turn started")
            p.handle = start()
            return p.handle
        rep.in_turn[p.session] = p
        rep.driver.command(fn, wait_turn=True).add_done_callback(lambda f: self._turn_done(p, rep, f))

    def _turn_done(self, p: _Pending, rep: EngineReplica, fut: asyncio.Future) -> None:
        rep.in_turn.pop(p.session, None)
        error = None if fut.cancelled() else fut.exception()
        if isinstance(error, EngineFailed) and not p.released:
            self._replica_failed(rep)
            self._where.pop(p.session, None)
            rep.sessions.pop(p.session, None)
            if self.live():  # the turn runs again elsewhere, from its whole context
                p.rerouted, p.handle = True, None
                self.counters["rerouted"] += 1
                self._pending[p.request_id] = p
                self._route(force=True)
                return
        if fut.cancelled() or error is not None:
            if not p.future.done():
                p.future.set_exception(error or EngineFailed("the turn was cancelled"))
            return
        out = fut.result()
        if p.released or p.future.done():  # the session ended (or its caller gave up) while the turn ran
            self._end_handle(rep, out.handle)
            return
        rep.sessions[p.session] = out.handle
        self._where[p.session] = rep.id
        p.future.set_result((rep, out))
        self._route(force=True)

    def _replica_failed(self, rep: EngineReplica) -> None:
        if not rep.alive:
            return
        rep.alive = False
        self.counters["replica_failures"] += 1
        for session in list(rep.sessions):  # their KV died with it
            self._where.pop(session, None)
        rep.sessions.clear()
        log.error("rollout replica %d failed (%s); its sessions go to the %d live replica(s)", rep.id,
                  rep.driver.error if rep.driver else "?", len(self.live()))
        if not self.live():
            self._fail_pending()

    def _driver_ended(self, rep: EngineReplica) -> None:
        if rep.driver is not None and rep.driver.error is not None:
            self._replica_failed(rep)

    def _fail_pending(self) -> None:
        """No replica is left: every pending turn fails with the last failure."""
        failed = next((r.driver for r in reversed(self.replicas) if r.driver is not None and r.driver.error), None)
        error = failed.failed() if failed is not None else EngineFailed("no live rollout replica")
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    # ------------------------------------------------------------------ stats

    def stats(self) -> list[dict]:
        """Per replica: running, waiting, sessions, KV used / pinned / free tokens, prefix-cache hits, tokens/s."""
        return [rep.stats() for rep in self.replicas]

    def kv_hit_rate(self) -> float:
        """Prompt tokens found cached over prompt tokens, over every replica."""
        stats = self.stats()
        return sum(s["prefix_hit_tokens"] for s in stats) / max(1, sum(s["prompt_tokens"] for s in stats))
