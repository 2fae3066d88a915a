"""Multi-host runs on JAX's multi-controller runtime (`jax.distributed`): one process per host, the same program
on every one (docs/multihost.md).

- **Start** (`define_flags`, `initialize`): every `launch/` entry point takes `--coordinator_address`,
  `--num_processes`, `--process_id` and `--local_device_ids`, or leaves them unset where the environment says
  it runs in a cluster (Slurm, Open MPI, a Cloud TPU VM or GKE TPU slice: `detected_cluster`) and
  `jax.distributed.initialize()` reads it; it is called before any JAX work. On the CPU the collectives are gloo's (`launch/local_cluster.py` starts N processes on one machine).
- **Control messages** (`Cluster`): small objects (decisions, signals, trajectories, checkpoint meta) go
  through the coordinator's key-value store, not through device collectives: no program is compiled per
  message shape, every wait has its own bounded timeout, and a timeout names the processes that did not
  answer (gloo's collectives wait 30 s and then fail without a name). `broadcast` sends process 0's object to
  all (the decisions: every process applies process 0's); `allgather` gives every process the list of all
  processes' objects (the signals, the batch). Each call is numbered, so every process must make the same
  calls in the same order, which the controller's lockstep at step boundaries guarantees. The waits run on one
  exchange thread, in the order of the calls: `allgather_async` / `broadcast_async` (the controller's) leave the
  event loop running meanwhile (rollouts, environments, engine steps, the HTTP server), `allgather` /
  `broadcast` block their caller. Only key-value store calls move there, no JAX collective.
- **Faults** (`Cluster.start_watchdog`): each process writes a heartbeat every second; a process whose heartbeat
  stops for `heartbeat_timeout_s` (it died, or it hangs: a stopped process stops beating too), or that has not
  beaten for that long since the watcher's watchdog started, makes every other one exit with status 1 and an
  error naming it, and so does the coordinator going away. JAX's own detection
  (its heartbeat timeout, which aborts with a stack trace) is set later than ours as the backstop. A process
  alive but stuck in its loop is caught by the next exchange's timeout (`exchange_timeout_s`), named too.
- **Interruptions** (`Cluster.interrupted`): a process stopped by Ctrl-C or SIGTERM says so in its heartbeat;
  the others' watchdogs stop them at once with status 130, naming the process and the signal. As with Ctrl-C
  on every process, nothing new is saved (a save is collective): the last checkpoint resumes.

A single process (`num_processes` 1, nothing initialized) gets the same `Cluster` with `count == 1`, whose
exchanges return at once: the controller's code is the same either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import pickle
import queue
import sys
import threading
import time
import zlib
from typing import Any, Callable, Sequence

# a key-value store value stays well under gRPC's 4 MiB message limit: larger objects go in chunks
_CHUNK = 1 << 21
# JAX's own heartbeat detection (it aborts the process with a stack trace) waits this many times ours
_JAX_HEARTBEAT_FACTOR = 3
# a heartbeat value: this process stopped on the signal named after it (`Cluster.interrupted`)
_INTERRUPTED = "interrupted:"
# how long `Cluster.fail` waits for its message to be posted (an exchange stuck ahead of it must not hold it)
_FAIL_POST_S = 5.0


class ClusterError(RuntimeError):
    """A process of the run died, hangs, or answered with an error; the message names it."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    coordinator_address: str = ""  # host:port of process 0's coordinator; "": detect (TPU, Slurm, MPI) or single
    num_processes: int = 0  # 0: detect
    process_id: int = -1  # -1: detect
    local_device_ids: tuple[int, ...] = ()  # the accelerators this process drives (GPUs); (): all it sees
    heartbeat_timeout_s: float = 20.0
    exchange_timeout_s: float = 600.0  # longest wait for the others at a step boundary (a compile, an evaluation)

    @property
    def explicit(self) -> bool:
        return bool(self.coordinator_address) or self.num_processes > 1


def define_flags(flags_module=None) -> None:
    """The multi-host flags of every launch script (absl)."""
    from absl import flags
    f = flags_module or flags
    f.DEFINE_string("coordinator_address", "", "host:port of process 0 (jax.distributed); unset: detected on TPU, "
                    "Slurm and Open MPI, else a single process")
    f.DEFINE_integer("num_processes", 0, "processes of the run (one per host); 0: detected, else 1")
    f.DEFINE_integer("process_id", -1, "this process's index, 0 .. num_processes - 1; -1: detected")
    f.DEFINE_list("local_device_ids", [], "accelerator ids this process drives (GPUs; comma list); unset: all it sees")
    f.DEFINE_float("heartbeat_timeout_s", 20.0, "a process silent this long ends the run, named (multi-host)")
    f.DEFINE_float("exchange_timeout_s", 600.0, "longest wait for the other processes at a step boundary")


def spec_from_flags() -> ClusterSpec:
    from absl import flags
    F = flags.FLAGS
    try:
        ids = tuple(int(x) for x in F.local_device_ids)
    except ValueError:
        raise ValueError(f"--local_device_ids={','.join(F.local_device_ids)}: a comma list of integers") from None
    return ClusterSpec(F.coordinator_address, F.num_processes, F.process_id, ids, F.heartbeat_timeout_s,
                       F.exchange_timeout_s)


def detected_cluster() -> str | None:
    """The cluster environment `jax.distributed.initialize()` reads by itself, when this process runs in one:
    Slurm or Open MPI with more than one task, or a Cloud TPU VM / GKE TPU slice (JAX's own detection, which
    reads the TPU metadata); None otherwise (a single process needs no coordinator)."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    try:
        from jax._src.clusters import cloud_tpu_cluster  # JAX's detection (no public accessor)
        for kind in (cloud_tpu_cluster.GkeTpuCluster, cloud_tpu_cluster.GceTpuCluster):
            if kind.is_env_present():
                return "tpu"
    except Exception:  # noqa: BLE001 - an older or newer JAX without these: flags then
        pass
    return None


def check_spec(spec: ClusterSpec) -> None:
    """Bad flags as one line (ValueError), before anything starts."""
    if spec.num_processes < 0:
        raise ValueError(f"--num_processes={spec.num_processes}: must be >= 1")
    if spec.explicit:
        if not spec.coordinator_address:
            raise ValueError(f"--num_processes={spec.num_processes} needs --coordinator_address=HOST:PORT (process "
                             f"0's address, the same on every process)")
        host, _, port = spec.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator_address={spec.coordinator_address!r}: expected HOST:PORT")
        if spec.num_processes < 1:
            raise ValueError("--coordinator_address needs --num_processes (the same on every process)")
        if not 0 <= spec.process_id < spec.num_processes:
            raise ValueError(f"--process_id={spec.process_id}: must be in 0..{spec.num_processes - 1} "
                             f"(--num_processes={spec.num_processes})")
    if spec.heartbeat_timeout_s <= 0 or spec.exchange_timeout_s <= 0:
        raise ValueError("--heartbeat_timeout_s and --exchange_timeout_s must be > 0")


_CLUSTER: "Cluster | None" = None


def initialize(spec: ClusterSpec = ClusterSpec()) -> "Cluster":
    """Starts `jax.distributed` when the flags (or a detected cluster) ask for more than one process, before any
    other JAX work; returns the run's `Cluster` (a single one when they do not). Call once, at the top of main."""
    global _CLUSTER
    check_spec(spec)
    import jax
    detected = None if spec.explicit else detected_cluster()
    if not spec.explicit and detected is None:
        _CLUSTER = Cluster(spec, 0, 1)
        return _CLUSTER
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU's collectives across processes
    heartbeat = max(int(spec.heartbeat_timeout_s * _JAX_HEARTBEAT_FACTOR), 10)
    if detected is not None:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
    else:
        jax.distributed.initialize(spec.coordinator_address, num_processes=spec.num_processes,
                                   process_id=spec.process_id, local_device_ids=list(spec.local_device_ids) or None,
                                   heartbeat_timeout_seconds=heartbeat,
                                   initialization_timeout=int(max(60, spec.exchange_timeout_s)))
    _CLUSTER = Cluster(spec, jax.process_index(), jax.process_count())
    return _CLUSTER


def initialize_from_flags() -> "Cluster":
    """`initialize` from the launch flags; bad flags exit 2 with one line. (A process that never joins is
    JAX's to report: the others abort after its initialization timeout.)"""
    try:
        spec = spec_from_flags()
        return initialize(spec)
    except (ValueError, RuntimeError) as e:  # JaxRuntimeError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: multi-host start: {first}", file=sys.stderr, flush=True)
        sys.exit(2)


def detected_process_id() -> int:
    """This process's index in a detected cluster (Slurm, Open MPI, TPU VMs), 0 when there is none."""
    env = os.environ
    for key in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def single_process_main(main: Callable, script: str) -> Callable:
    """The `main` of a launch script whose work is one process's (generate, serve, export, sft, simulate,
    sample): it takes the multi-host flags like every script, and on a multi-host launch process 0 does the work
    on its own devices while the others say so and exit 0 (no coordinator is needed for that). Bad flags exit 2
    with one line."""
    def wrapped(argv):
        try:
            spec = spec_from_flags()
            check_spec(spec)
        except ValueError as e:
            print(f"error: multi-host flags: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        index = spec.process_id if spec.explicit else (detected_process_id() if detected_cluster() else 0)
        if index > 0:
            print(f"process {index}: {script} runs on process 0 only; nothing to do here", flush=True)
            return None
        return main(argv)
    return wrapped


def cluster() -> "Cluster":
    """The run's cluster (a single process until `initialize` says otherwise)."""
    return _CLUSTER if _CLUSTER is not None else Cluster(ClusterSpec(), 0, 1)


class Cluster:
    """This process's place in the run and the control messages between the processes (module docstring)."""

    def __init__(self, spec: ClusterSpec, index: int, count: int):
        self.spec = spec
        self.index = index
        self.count = count
        self._seq = 0
        self.exchange_s = 0.0  # wall seconds spent in exchanges (waiting for the others included)
        self._mine: list[str] = []  # keys this process wrote, deleted two exchanges later (all have read them)
        self._order = threading.Lock()  # an exchange's number and its place on the exchange thread, together
        self._exchanges: _ExchangeThread | None = None  # started at the first exchange
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.on_failure: Callable[[str], None] | None = None
        self.on_interrupted: Callable[[str], None] = _exit_interrupted

    @property
    def primary(self) -> bool:
        return self.index == 0

    @property
    def multi(self) -> bool:
        return self.count > 1

    def __repr__(self) -> str:
        return f"Cluster(process {self.index} of {self.count})"

    # ------------------------------------------------------------------ the key-value store

    @property
    def _client(self):
        from jax._src import distributed  # the coordinator's client: no public accessor
        return distributed.global_state.client

    @staticmethod
    def _dumps(obj: Any) -> bytes:
        return zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 1)

    def _put(self, key: str, data: bytes) -> None:
        chunks = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        client = self._client
        for i, chunk in enumerate(chunks):
            client.key_value_set_bytes(f"{key}/{i}", chunk)
        client.key_value_set(f"{key}/n", str(len(chunks)))  # last: a reader sees every chunk after it
        self._mine.append(key)

    def _get(self, key: str, owner: int, deadline: float, what: str) -> Any:
        client = self._client
        try:
            n = int(client.blocking_key_value_get(f"{key}/n", self._ms_left(deadline)))
            data = b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", self._ms_left(deadline))
                            for i in range(n))
        except Exception as e:  # noqa: BLE001 - a timeout, or the coordinator gone: named below
            raise self._failure(owner, what, e) from None
        return pickle.loads(zlib.decompress(data))

    @staticmethod
    def _ms_left(deadline: float) -> int:
        return max(1, int((deadline - time.monotonic()) * 1000))

    def _failure(self, owner: int, what: str, e: Exception) -> ClusterError:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or "deadline" in text.lower():
            return ClusterError(f"process {owner} of {self.count} did not reach '{what}' within "
                                f"{self.spec.exchange_timeout_s:.0f} s (it hangs, died, or took another path)")
        return ClusterError(f"process {owner} of {self.count}: '{what}' failed ({text}); the coordinator "
                            f"(process 0) may be gone")

    def _forget_old(self) -> None:
        """Deletes this process's values of two exchanges ago: every process has read them by now (each has
        posted to the last exchange, which it does only after reading the one before)."""
        while len(self._mine) > 2 * max(1, self.count):
            key = self._mine.pop(0)
            try:
                self._client.key_value_delete(key)  # the key and every key under it
            except Exception:  # noqa: BLE001 - a leftover value costs memory, not correctness
                pass

    # ------------------------------------------------------------------ exchanges

    def allgather(self, what: str, obj: Any) -> list[Any]:
        """Every process's `obj`, in process order, on every process (one exchange; all processes call it)."""
        if not self.multi:
            return [obj]
        return self._queued(self._allgather_job, what, obj).result()

    async def allgather_async(self, what: str, obj: Any) -> list[Any]:
        """`allgather` from the event loop, which goes on while this process waits for the others."""
        if not self.multi:
            return [obj]
        return await self._queued(self._allgather_job, what, obj, loop=asyncio.get_running_loop())

    def broadcast(self, what: str, obj: Any = None) -> Any:
        """Process 0's `obj` on every process (the others' argument is ignored)."""
        if not self.multi:
            return obj
        return self._queued(self._broadcast_job, what, obj).result()

    async def broadcast_async(self, what: str, obj: Any = None) -> Any:
        """`broadcast` from the event loop, which goes on while this process waits for process 0."""
        if not self.multi:
            return obj
        return await self._queued(self._broadcast_job, what, obj, loop=asyncio.get_running_loop())

    def _queued(self, make: Callable[..., Callable[[], Any]], *args, loop: asyncio.AbstractEventLoop | None = None):
        """The exchange `make(*args)` (numbered and its message serialized here, in call order: the object as it
        is now) queued on the exchange thread; its concurrent future, or with `loop` an asyncio one (through
        `run_in_executor`: the simulator's virtual clock stands still while it waits)."""
        with self._order:
            job = make(*args)
            if self._exchanges is None:
                self._exchanges = _ExchangeThread()
            if loop is None:
                return self._exchanges.submit(self._timed, job)
            return loop.run_in_executor(self._exchanges, self._timed, job)

    def _timed(self, job: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return job()
        finally:
            self.exchange_s += time.perf_counter() - t0  # only the exchange thread writes it

    def _allgather_job(self, what: str, obj: Any) -> Callable[[], list[Any]]:
        data = self._dumps((what, obj))  # first: an object that does not pickle raises here, taking no number
        self._seq += 1
        base = f"tiderl/x{self._seq}"

        def job() -> list[Any]:
            self._put(f"{base}/{self.index}", data)
            deadline = time.monotonic() + self.spec.exchange_timeout_s
            out = [obj if q == self.index else self._matching(self._get(f"{base}/{q}", q, deadline, what), q, what)
                   for q in range(self.count)]
            self._forget_old()
            errors = [(q, o["__error__"]) for q, o in enumerate(out) if isinstance(o, dict) and "__error__" in o]
            if errors:
                q, error = errors[0]
                raise ClusterError(f"process {q} of {self.count} failed at '{what}': {error}")
            return out
        return job

    def _broadcast_job(self, what: str, obj: Any) -> Callable[[], Any]:
        data = self._dumps((what, obj)) if self.primary else b""  # first, as in `_allgather_job`
        self._seq += 1
        key = f"tiderl/b{self._seq}"
        if self.primary:
            def post() -> Any:
                self._put(key, data)
                self._forget_old()
                return obj
            return post

        def receive() -> Any:
            out = self._matching(self._get(key, 0, time.monotonic() + self.spec.exchange_timeout_s, what), 0, what)
            if isinstance(out, dict) and "__error__" in out:
                raise ClusterError(f"process 0 of {self.count} failed at '{what}': {out['__error__']}")
            return out
        return receive

    def _matching(self, posted, owner: int, what: str):
        """The object of a posted (what, object): the processes must be at the same exchange, else the run's
        processes took different paths (a bug: named, never silently mixed)."""
        theirs, obj = posted
        if theirs != what and not (isinstance(obj, dict) and "__error__" in obj):
            raise ClusterError(f"process {owner} of {self.count} is at '{theirs}' where this process "
                               f"({self.index}) is at '{what}': the processes took different paths")
        return obj

    def fail(self, what: str, error: str) -> None:
        """Tells the others this process failed at `what`: posted as its part of the next exchange, whose
        `allgather` raises on the others, naming it. It does not wait for them (they may be failing too)."""
        if not self.multi:
            return

        def make():
            data = self._dumps((what, {"__error__": error}))
            self._seq += 1
            key = f"tiderl/x{self._seq}/{self.index}"
            return lambda: self._put(key, data)
        try:  # bounded: an exchange cancelled mid-wait (Ctrl-C) may still hold the exchange thread
            self._queued(make).result(timeout=_FAIL_POST_S)
        except Exception:  # noqa: BLE001 - best effort: the heartbeat names this process once it exits
            pass

    def barrier(self, what: str) -> None:
        self.allgather(what, None)

    # ------------------------------------------------------------------ heartbeats

    def start_watchdog(self, on_failure: Callable[[str], None] | None = None) -> None:
        """Beats every second and watches the others' beats (module docstring). `on_failure(message)` runs once
        when a process goes silent (default: the error on stderr and exit status 1, at once)."""
        if not self.multi or self._watchdog is not None:
            return
        self.on_failure = on_failure or _exit_named
        self._watchdog = threading.Thread(target=self._watch, name="tiderl-heartbeat", daemon=True)
        self._watchdog.start()

    def await_peer_verdict(self, wait_s: float | None = None) -> None:
        """After an error in a multi-process run (a collective that failed because a peer died: gloo's "Connection
        reset by peer" comes before the peer's heartbeat is overdue): gives the watchdog up to the heartbeat
        timeout to name a stopped peer, which ends this process with that message (`on_failure`); returns when
        none is named, for the caller to report its own error."""
        if not self.multi or self._watchdog is None:
            return
        deadline = time.monotonic() + (self.spec.heartbeat_timeout_s + 2.0 if wait_s is None else wait_s)
        while time.monotonic() < deadline and self._watchdog.is_alive() and not self._stop.is_set():
            time.sleep(0.2)

    def _watch(self) -> None:
        client, me = self._client, self.index
        start = time.monotonic()
        seen = {q: (None, start) for q in range(self.count) if q != me}  # q -> (its last beat, seen since)
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                client.key_value_set(f"tiderl/hb/{me}", str(beat), allow_overwrite=True)
                silent = self._silent(client, seen)
            except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone
                if self._stop.is_set():
                    return
                if me != 0:
                    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    return self._report(f"process 0 of {self.count} (the coordinator) is gone ({text})", "")
                silent = None
            if silent is not None:
                return self._report(*silent)
            self._stop.wait(1.0)

    def _silent(self, client, seen: dict) -> tuple[str, str] | None:
        """Reads every other process's beat (updating `seen`); (the message, the signal or "") naming the first
        one interrupted (`interrupted`: the signal) or silent for longer than the timeout, else None. A process
        that has not beaten yet is silent since this watchdog started: one that died before its first beat is
        named too."""
        timeout = self.spec.heartbeat_timeout_s
        for q, (last, since) in seen.items():
            try:
                value = client.key_value_try_get(f"tiderl/hb/{q}")
            except Exception as e:  # noqa: BLE001
                if "NOT_FOUND" not in str(e):
                    raise
                value = None  # no beat yet
            now = time.monotonic()
            if value == "done":  # it finished normally
                continue
            if value is not None and value.startswith(_INTERRUPTED):
                signal_name = value[len(_INTERRUPTED):]
                return f"process {q} of {self.count} was interrupted by {signal_name}", signal_name
            if value != last:
                seen[q] = (value, now)
            elif now - since > timeout:
                if last is None:
                    return (f"process {q} of {self.count} stopped: no heartbeat in the {now - since:.0f} s since "
                            f"the watchdog started (it died before its first, or hangs)"), ""
                return (f"process {q} of {self.count} stopped: no heartbeat for {now - since:.0f} s (it died or "
                        f"hangs)"), ""
        return None

    def _report(self, message: str, signal_name: str) -> None:
        if self._stop.is_set():
            return
        if signal_name:  # stop too, and say so in this beat: the coordinator waits for that before it exits
            with contextlib.suppress(Exception):
                self._client.key_value_set(f"tiderl/hb/{self.index}", _INTERRUPTED + signal_name, allow_overwrite=True)
            self.on_interrupted(f"{message}; process {self.index} stops too")
        elif self.on_failure is not None:
            self.on_failure(message)

    def interrupted(self, signal_name: str, wait_s: float = 5.0) -> None:
        """This process stops on `signal_name` (Ctrl-C's path: SIGINT, or SIGTERM): its heartbeat says so, and
        every other process's watchdog stops it too, naming this one and the signal. The coordinator (process 0)
        waits up to `wait_s` until every other process has seen it (their beats say interrupted, or done): its
        key-value store ends with it, and a process that found it gone first would report a failure instead."""
        if not self.multi:
            return
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2.0)  # its last beat must not overwrite the one below
        try:
            client = self._client
            client.key_value_set(f"tiderl/hb/{self.index}", _INTERRUPTED + signal_name, allow_overwrite=True)
            deadline = time.monotonic() + wait_s
            while self.primary and time.monotonic() < deadline:
                beats = [self._beat_of(client, q) for q in range(1, self.count)]
                if all(b == "done" or (b or "").startswith(_INTERRUPTED) for b in beats):
                    return
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - best effort: the others' heartbeat watch names this process anyway
            pass

    @staticmethod
    def _beat_of(client, q: int) -> str | None:
        try:
            return client.key_value_try_get(f"tiderl/hb/{q}")
        except Exception:  # noqa: BLE001 - NOT_FOUND: no beat yet
            return None

    def finished(self) -> None:
        """This process ends normally: the others' watchdogs stop watching it."""
        if not self.multi:
            return
        self._stop.set()
        try:
            self._client.key_value_set(f"tiderl/hb/{self.index}", "done", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass


class _ExchangeThread(concurrent.futures.Executor):
    """One daemon thread running the exchanges in the order they were queued (the key-value store's calls must
    come in the same order on every process). A daemon, unlike a ThreadPoolExecutor's worker: an exchange left
    waiting when the run stops (Ctrl-C mid-wait) does not hold the interpreter's exit for `exchange_timeout_s`."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="tiderl-exchanges", daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            wanted = future.set_running_or_notify_cancel()  # a cancelled exchange still runs: its number is taken
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                if wanted:
                    future.set_exception(e)
            else:
                if wanted:
                    future.set_result(result)


def _exit_interrupted(message: str) -> None:
    print(f"interrupted: {message}; across processes nothing new is saved: the last checkpoint resumes with the "
          f"same command on every process", file=sys.stderr, flush=True)
    os._exit(130)  # Ctrl-C's status


def _exit_named(message: str) -> None:
    print(f"error: multi-host run stopped: {message}; rerun the same command on every process to resume from "
          f"the last checkpoint", file=sys.stderr, flush=True)
    os._exit(1)


def shard_indices(n: int, index: int, count: int) -> list[int]:
    """This process's share of n items (round robin: item i on process i % count)."""
    return list(range(index, n, count))


def merge_shards(shards: Sequence[Sequence[Any]]) -> list[Any]:
    """The items of `shard_indices` shards back in their global order."""
    count = len(shards)
    n = sum(len(s) for s in shards)
    return [shards[i % count][i // count] for i in range(n)]
