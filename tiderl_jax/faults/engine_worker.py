"""Rollout engines in worker processes: health checks, a warm standby, token checkpoints, failover.

docs/mechanisms.md (Belayer, engine failure). `EngineClient` serves generation requests with an
`Engine` (`engine/engine.py`) that runs in a worker process, and keeps serving when that process
dies or hangs:

- **workers**: each is a `spawn`ed process (never a fork of a process running JAX) that sets
  `JAX_PLATFORMS=cpu` and one host device before JAX starts, builds the decoder from a
  `ModelConfig` plus host numpy parameters, builds the `Engine`, compiles every program
  (`Engine.warmup`) and then says it is ready. Requests, weights and pings go over a pipe; the
  worker streams back each request's new tokens with their log-probs and versions after every
  engine step.
- **parameter service**: `ParamService` holds the live host-memory copy of the rollout weights (the
  latest numpy parameters and their version). A worker loads the latest at start; every
  `update_params` publishes there and is forwarded to the primary *and* the standby, so the standby
  is always on the current weights (it joins every weight sync, not just the next one).
- **standby**: a second worker started with the first, warmed up (programs compiled) and idle, so
  promoting it costs no process start, weight load or compile. After a promotion a new standby is
  started in the background.
- **health**: a monitor thread pings every worker every `health_interval_s` (~0.2 s); a check
  passes when the worker answered the previous ping. `belayer.observe` declares a worker failed
  after `health_threshold` consecutive failed checks (a hung worker). A worker whose process ended
  (its pipe closed) is failed at once: an exit is conclusive, there is nothing to wait for.
- **token checkpoints**: the client records, for each generation in flight, its prompt, sampling
  parameters and every token received so far with its two log-probs and its version. On failover
  the promoted worker continues each unfinished generation from `prompt + tokens so far` with the
  remaining budget (`continuation`), starting its sampling index at the number of tokens already
  sampled (`Request.sample_offset`), so a seeded sample draws the same random keys as without the
  failure; tokens from before the failure keep their recorded versions and log-probs. Tokens a dead
  worker generated but never sent are generated again.
- **exactly once**: messages from a worker that is no longer the primary are ignored, and a
  generation's result is delivered once, when its final message arrives.

Limits (ours): requests are request-level (each turn a new request with its full context, as the
rollout's request-level mode); `keep_kv` pauses and resumes across turns, images and groups are not
served through workers. Pings are answered between engine steps, so `health_interval_s *
health_threshold` must exceed the longest step; checks pause while a worker warms up or loads new
weights (a weight update compiles its copy program), and a process exit is still seen at once.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import re
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tiderl_jax.faults.env_worker import main_module_hidden
from tiderl_jax.faults.errors import WorkerCrashed
from tiderl_jax.policies import belayer

# ----------------------------------------------------------------------------------- parameters


def host_params(params: Any) -> dict:
    """Parameters (a Decoder, its nnx.State, or a pure dict) as a nested dict of host numpy arrays."""
    from flax import nnx

    if isinstance(params, nnx.Module):
        params = nnx.split(params)[1]
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not isinstance(params, Mapping):
        raise TypeError(f"parameters must be a Decoder, an nnx.State or a dict, not {type(params).__name__}")
    return _map_leaves(params, lambda x: np.array(x, copy=True))


def _map_leaves(tree, fn):
    if isinstance(tree, Mapping):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    return fn(tree)


class ParamService:
    """The live host-memory copy of the rollout weights: the latest numpy parameters and version."""

    def __init__(self, params: Any = None, version: int = 0):
        self._lock = threading.Lock()
        self._params: dict | None = None
        self.version = -1
        if params is not None:
            self.publish(params, version)

    def publish(self, params: Any, version: int) -> dict:
        """Stores a host copy of `params` as `version` (versions only move forward); returns it."""
        host = host_params(params)
        with self._lock:
            if version < self.version:
                raise ValueError(f"ParamService: version {version} is older than the published {self.version}")
            self._params, self.version = host, version
        return host

    def latest(self) -> tuple[int, dict]:
        with self._lock:
            if self._params is None:
                raise RuntimeError("ParamService holds no parameters yet: publish(params, version) first")
            return self.version, self._params


# ----------------------------------------------------------------------------------- token checkpoints


@dataclasses.dataclass
class TokenCheckpoint:
    """What the client knows of one generation: its request and every token received so far."""

    rid: int
    prompt: list[int]
    sampling: Any  # engine.sampling.SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    logp_sample: list[float] = dataclasses.field(default_factory=list)
    logp_model: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    failovers: int = 0  # times this generation moved to another worker

    def copy(self) -> TokenCheckpoint:
        return dataclasses.replace(self, prompt=list(self.prompt), tokens=list(self.tokens),
                                   logp_sample=list(self.logp_sample), logp_model=list(self.logp_model),
                                   versions=list(self.versions))


def continuation(ckpt: TokenCheckpoint) -> tuple[list[int], Any, int]:
    """The request that finishes a checkpointed generation elsewhere: (prompt + tokens so far,
    sampling with the remaining budget, sample offset = tokens already sampled)."""
    if ckpt.finish_reason is not None:
        raise ValueError(f"generation {ckpt.rid} has finished ({ckpt.finish_reason}); nothing to continue")
    remaining = ckpt.sampling.max_new_tokens - len(ckpt.tokens)
    if remaining < 1:
        raise ValueError(f"generation {ckpt.rid} has {len(ckpt.tokens)} of its {ckpt.sampling.max_new_tokens} "
                         f"tokens but no finish reason: its checkpoint is inconsistent")
    return (list(ckpt.prompt) + list(ckpt.tokens),
            dataclasses.replace(ckpt.sampling, max_new_tokens=remaining), len(ckpt.tokens))


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    rid: int
    tokens: list[int]  # the generated tokens only
    logp_sample: list[float]
    logp_model: list[float]
    versions: list[int]
    finish_reason: str
    failovers: int


# ----------------------------------------------------------------------------------- the worker process


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    model: Any  # model.config.ModelConfig
    engine: Any  # engine.engine.EngineConfig
    warmup: bool = True  # compile every program before saying ready
    step_delay_s: float = 0.0  # fault injection: sleep after each engine step (slows generation)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # set in the child before JAX starts


def _child_environment(overrides: Mapping[str, str]) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # one CPU device (JAX's own setting, as the tests set it, too)
    os.environ.update(overrides)


def _worker_main(conn, spec_bytes: bytes, env: Mapping[str, str]) -> None:
    """The worker process: load, warm up, then serve requests / params / pings until closed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides when a worker stops
    _child_environment(env)
    import jax

    jax.config.update("jax_platforms", "cpu")
    from flax import nnx

    from tiderl_jax.engine.engine import Engine, Request, Status
    from tiderl_jax.engine.sampling import RequestError
    from tiderl_jax.model.decoder import Decoder

    spec: WorkerSpec = pickle.loads(spec_bytes)
    t0 = time.perf_counter()
    _, version, pure = conn.recv()
    graphdef, template = nnx.split(nnx.eval_shape(lambda: Decoder(spec.model, rngs=nnx.Rngs(0))))

    def state_of(pure_params):
        state = jax.tree.map(lambda x: x, template)  # a fresh container to fill
        nnx.replace_by_pure_dict(state, _map_leaves(pure_params, jax.numpy.asarray))
        return state

    engine = Engine(nnx.merge(graphdef, state_of(pure)), spec.engine, version=version)
    # Place the weights the way every later update places them before compiling: the programs are
    # keyed on their parameters' placement, and a first update would otherwise recompile them all.
    engine.update_params(state_of(pure), version)
    load_s = time.perf_counter() - t0
    warmup_s = engine.warmup() if spec.warmup else 0.0
    conn.send(("ready", {"pid": os.getpid(), "load_s": load_s, "warmup_s": warmup_s,
                         "programs": engine.runner.compile_count(), "version": version}))
    handles: dict[int, int] = {}  # request id -> engine handle
    sent: dict[int, int] = {}  # request id -> context tokens already reported
    ended = (Status.FINISHED, Status.ABORTED)
    while True:
        timeout = 0.0 if engine.has_work() else 0.02
        while conn.poll(timeout):
            timeout = 0.0
            msg = conn.recv()
            op = msg[0]
            if op == "submit":
                _, rid, prompt, sampling, offset = msg
                try:
                    handles[rid] = engine.submit(Request(prompt, sampling, sample_offset=offset))
                    sent[rid] = len(prompt)
                except RequestError as e:
                    conn.send(("rejected", rid, str(e)))
            elif op == "abort":
                if msg[1] in handles:
                    engine.abort(handles[msg[1]])
            elif op == "params":
                engine.update_params(state_of(msg[2]), msg[1])
                conn.send(("params_ok", msg[1]))
            elif op == "ping":
                conn.send(("pong", msg[1]))
            elif op == "hang":  # fault injection: stop answering (a hung worker)
                time.sleep(msg[1])
            elif op == "close":
                return
        if engine.has_work():
            engine.step()
            if spec.step_delay_s:
                time.sleep(spec.step_delay_s)
        for rid, h in list(handles.items()):
            out = engine.get(h)
            n = sent[rid]
            done = out.status in ended
            if len(out.tokens) > n or done:
                conn.send(("tokens", rid, out.tokens[n:], out.logp_sample[n:], out.logp_model[n:],
                           out.versions[n:], out.finish_reason if done else None))
                sent[rid] = len(out.tokens)
            if done:
                engine.forget(h)
                del handles[rid], sent[rid]


class _Worker:
    """The client's handle on one worker process: a sender thread, a reader thread, health state."""

    def __init__(self, ctx, name: str, spec: WorkerSpec, version: int, params: dict, on_message, on_exit):
        self.name = name
        self.started_at = time.perf_counter()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, pickle.dumps(spec), dict(spec.env)),
                                daemon=True, name=f"tiderl-engine-{name}")
        with main_module_hidden(_worker_main):  # the child does not re-run the parent's script
            self.proc.start()
        child.close()
        self.conn = parent
        self.ready = threading.Event()
        self.info: dict = {}
        self.exited = threading.Event()
        self.health = belayer.HealthState()
        self.fail_reason = ""
        self.params_pending = 0  # weight updates sent and not yet acknowledged
        self.pings_sent = 0
        self.last_pong = 0
        self._outbox: queue.Queue = queue.Queue()
        self._on_message, self._on_exit = on_message, on_exit
        self.send(("params", version, params))
        threading.Thread(target=self._send_loop, daemon=True, name=f"{name}-send").start()
        threading.Thread(target=self._read_loop, daemon=True, name=f"{name}-read").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError, EOFError):
                return  # the reader sees the exit

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "ready":
                self.info = msg[1]
                self.info["ready_s"] = time.perf_counter() - self.started_at
                self.ready.set()
            elif msg[0] == "pong":
                self.last_pong = max(self.last_pong, msg[1])
            elif msg[0] == "params_ok":
                self.params_pending -= 1
            else:
                self._on_message(self, msg)
        self.exited.set()
        self._outbox.put(None)
        self._on_exit(self)

    def alive(self) -> bool:
        return not self.exited.is_set() and self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(10)
        self._outbox.put(None)

    def close(self) -> None:
        if self.proc.is_alive():
            self.send(("close",))
            self.proc.join(5)
        self.kill()


# ----------------------------------------------------------------------------------- the client


@dataclasses.dataclass
class FailoverEvent:
    worker: str  # the failed worker
    reason: str
    detected_at: float  # perf_counter when the failure was declared
    serving_at: float = 0.0  # perf_counter when the new primary had the in-flight work resubmitted
    first_token_at: float | None = None  # first tokens received from the new primary
    promoted_standby: bool = True  # False: no warm standby, a new worker was started cold
    resumed: int = 0  # generations continued from their token checkpoints

    @property
    def recovery_s(self) -> float:
        return self.serving_at - self.detected_at


class EngineClient:
    """Generation through an engine worker with a warm standby and failover (module docstring)."""

    def __init__(self, spec: WorkerSpec, params: ParamService, *, standby: bool = True,
                 health_interval_s: float = 0.2, health_threshold: int = 3,
                 ready_timeout_s: float = 600.0, start_method: str = "spawn"):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method={start_method!r} must be 'spawn' or 'forkserver' (a fork of a "
                             f"process running JAX is unsafe)")
        if not health_interval_s > 0 or health_threshold < 1:
            raise ValueError(f"health_interval_s={health_interval_s} must be > 0 and "
                             f"health_threshold={health_threshold} >= 1")
        self.spec, self.params = spec, params
        self.health_interval_s, self.health_threshold = health_interval_s, health_threshold
        self.ready_timeout_s = ready_timeout_s
        self.use_standby = standby
        self._ctx = multiprocessing.get_context(start_method)
        self._lock = threading.RLock()
        self._records: dict[int, TokenCheckpoint] = {}
        self._done: dict[int, threading.Event] = {}
        self._next_rid = 0
        self._names = 0
        self.failovers: list[FailoverEvent] = []
        self._closed = False
        self.monitor_error: BaseException | None = None  # what stopped the health monitor, if anything
        with self._lock:
            self.primary: _Worker | None = self._start_worker()
            self.standby: _Worker | None = self._start_worker() if standby else None
        try:
            self._wait_ready(self.primary)
        except BaseException:
            self.close()
            raise
        self._wake = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, daemon=True, name="engine-health")
        self._monitor.start()

    # ------------------------------------------------------------------ public API

    def submit(self, prompt: Sequence[int], sampling) -> int:
        """Queues a generation; returns its id. A worker that refuses it reports through `wait`."""
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
            self._records[rid] = TokenCheckpoint(rid, [int(t) for t in prompt], sampling)
            self._done[rid] = threading.Event()
            if self.primary is not None:  # else: sent when the failover completes
                self.primary.send(("submit", rid, self._records[rid].prompt, sampling, 0))
        return rid

    def done(self, rid: int) -> bool:
        """Whether generation `rid` has finished (or failed): `wait` then returns at once."""
        return self._done[rid].is_set()

    def wait(self, rid: int, timeout_s: float | None = None) -> GenerationResult:
        """Blocks until generation `rid` finished; returns it (once) and forgets it."""
        done = self._done.get(rid)
        if done is None:
            raise KeyError(f"unknown or already returned generation id {rid}")
        if not done.wait(timeout_s):
            raise TimeoutError(f"generation {rid} did not finish within {timeout_s}s")
        with self._lock:
            rec = self._records.pop(rid)
            del self._done[rid]
        if rec.error is not None:
            if self.monitor_error is not None:
                raise WorkerCrashed(belayer.WORKER_CRASH, rec.error)
            from tiderl_jax.engine.sampling import RequestError
            raise RequestError(rec.error)
        return GenerationResult(rid, rec.tokens, rec.logp_sample, rec.logp_model, rec.versions,
                                rec.finish_reason, rec.failovers)

    def generate(self, prompts: Sequence[Sequence[int]], sampling, timeout_s: float | None = None
                 ) -> list[GenerationResult]:
        rids = [self.submit(p, sampling) for p in prompts]
        return [self.wait(r, timeout_s) for r in rids]

    def checkpoint(self, rid: int) -> TokenCheckpoint:
        """A copy of generation `rid`'s token checkpoint now."""
        with self._lock:
            return self._records[rid].copy()

    def update_params(self, params: Any, version: int) -> None:
        """Publishes new weights to the parameter service and to the primary and the standby."""
        with self._lock:
            host = self.params.publish(params, version)
            for w in (self.primary, self.standby):
                if w is not None:
                    w.params_pending += 1
                    w.send(("params", version, host))

    def wait_standby(self, timeout_s: float | None = None) -> bool:
        """Blocks until a standby is ready (True), or `timeout_s` passed (False)."""
        if not self.use_standby:
            raise RuntimeError("this EngineClient runs without a standby (standby=False)")
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            w = self.standby
            if w is not None and w.ready.wait(0.05):
                return True
            if deadline is not None and time.perf_counter() > deadline:
                return False

    def inject_hang(self, seconds: float) -> None:
        """Fault injection: the primary stops answering (sleeps in its loop) for `seconds`."""
        self.primary.send(("hang", seconds))

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        for w in (self.primary, self.standby):
            if w is not None:
                w.close()

    # ------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        """A new worker on the latest weights. Call with the result assigned to `standby` or
        `primary` under the lock, so no `update_params` falls between the two."""
        with self._lock:
            version, host = self.params.latest()
            self._names += 1
            return _Worker(self._ctx, f"w{self._names}", self.spec, version, host,
                           self._on_message, self._on_exit)

    def _wait_ready(self, w: _Worker) -> None:
        deadline = time.perf_counter() + self.ready_timeout_s
        while not w.ready.wait(0.1):
            if w.exited.is_set():
                raise WorkerCrashed(belayer.WORKER_CRASH, f"engine worker {w.name} (pid {w.pid}) exited "
                                                          f"with code {w.proc.exitcode} while starting")
            if time.perf_counter() > deadline:
                w.kill()
                raise TimeoutError(f"engine worker {w.name} not ready within {self.ready_timeout_s}s")

    def _on_message(self, w: _Worker, msg) -> None:
        with self._lock:
            if w is not self.primary:
                return  # a replaced worker's late words
            op = msg[0]
            if op == "tokens":
                _, rid, toks, lps, lpm, versions, finish = msg
                rec = self._records.get(rid)
                if rec is None or rec.finish_reason is not None:
                    return
                rec.tokens += toks
                rec.logp_sample += lps
                rec.logp_model += lpm
                rec.versions += versions
                if toks and self.failovers and self.failovers[-1].first_token_at is None:
                    self.failovers[-1].first_token_at = time.perf_counter()
                if finish is not None:
                    rec.finish_reason = finish
                    self._done[rid].set()
            elif op == "rejected":
                rec = self._records.get(msg[1])
                if rec is not None:
                    rec.error, rec.finish_reason = msg[2], "rejected"
                    self._done[msg[1]].set()

    def _on_exit(self, w: _Worker) -> None:
        self._wake.set()  # the monitor acts on it now, not at its next tick

    # ------------------------------------------------------------------ health and failover

    def _monitor_loop(self) -> None:
        try:
            while not self._closed:
                self._wake.wait(self.health_interval_s)
                self._wake.clear()
                if self._closed:
                    return
                for w in (self.primary, self.standby):
                    if w is None or self._check(w):
                        continue
                    if w is self.primary:
                        self._failover(w)
                    else:
                        self._replace_standby(w)
        except BaseException as e:  # no failover can happen any more: say so where callers look
            self.monitor_error = e
            logging.getLogger(__name__).exception("engine health monitor stopped")
            with self._lock:
                for rid, rec in self._records.items():
                    if rec.finish_reason is None:
                        rec.error, rec.finish_reason = f"engine failover failed: {e!r}", "error"
                        self._done[rid].set()

    def _check(self, w: _Worker) -> bool:
        """One health check of `w`; False when it is declared failed."""
        if w.exited.is_set() or not w.proc.is_alive():
            w.proc.join(1)  # the pipe may close a moment before the exit code is known
            w.health = dataclasses.replace(w.health, failed=True)
            w.fail_reason = f"process exited with code {w.proc.exitcode}"
            return False
        if not w.ready.is_set() or w.params_pending > 0:
            return True  # loading weights or compiling: it answers no pings meanwhile
        ok = w.last_pong >= w.pings_sent
        w.health = belayer.observe(w.health, ok, self.health_threshold)
        if w.health.failed:
            w.fail_reason = f"{w.health.consecutive_failures} consecutive health checks unanswered"
            return False
        if ok:
            w.pings_sent += 1
            w.send(("ping", w.pings_sent))
        return True

    def _failover(self, old: _Worker) -> None:
        if self._closed:
            return
        event = FailoverEvent(old.name, old.fail_reason, time.perf_counter())
        with self._lock:
            self.primary = None  # submissions wait in their checkpoints meanwhile
        old.kill()
        for attempt in range(3):  # the standby stays registered (it gets weight updates) until promoted
            if self.standby is None or self.standby.exited.is_set():
                event.promoted_standby = False
                if self.standby is not None:
                    self.standby.kill()
                with self._lock:  # cold: process start, weight load, compile
                    self.standby = self._start_worker()
            try:
                self._wait_ready(self.standby)
                break
            except (WorkerCrashed, TimeoutError):
                if attempt == 2:
                    raise
                self.standby = None
        with self._lock:
            new, self.primary, self.standby = self.standby, self.standby, None
            for rec in self._records.values():
                if rec.finish_reason is not None:
                    continue
                prompt, sampling, offset = continuation(rec)
                if offset:
                    rec.failovers += 1
                    event.resumed += 1
                new.send(("submit", rec.rid, prompt, sampling, offset))
            event.serving_at = time.perf_counter()
            self.failovers.append(event)
        if self.use_standby and not self._closed:
            with self._lock:
                self.standby = self._start_worker()

    def _replace_standby(self, old: _Worker) -> None:
        old.kill()
        with self._lock:
            self.standby = self._start_worker() if not self._closed else None
