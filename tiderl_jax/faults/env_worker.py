"""Environments in subprocesses and their snapshots (Belayer, environment failure: docs/mechanisms.md);
recovery from a crash by restore and rewind is `env_recovery.py`'s, over these workers.

- `EnvWorker`: one agentic `Environment` (`agents/env.py`) run in a child process behind the same
  async `reset` / `step` interface, plus `snapshot()` / `restore(snapshot)` of its state. The child
  is started from a clean interpreter (`forkserver` by default, or `spawn`; never a fork of a
  process that has initialised JAX) and builds the environment with `make_env(task)` (a picklable
  callable; default `tasks.make_env`). Every call waits on the reply *and* the child's process
  sentinel: a child that dies raises `WorkerCrashed` (kind `sandbox_crash`), a call that outlives
  `timeout_s` kills the child and raises `WorkerTimeout` (kind `timeout`). An exception raised by
  the environment itself is re-raised as `EnvError` with the child's traceback (not an
  infrastructure failure: the same call would fail again).
Snapshot format (`snapshot_env` / `restore_env`): an environment with `snapshot_state()` and
`restore_state(state)` methods gives its own picklable state. Otherwise its state is its instance
attributes, each pickled, except code (functions, bound methods, and mappings of them: the tools
and score function), which `make_env(task)` rebuilds; restore builds a fresh environment with
`make_env(task)` and sets the attributes back. This covers every built-in task's environment
(`ToolEnvironment` and its subclasses: task, RNG state, counters). An attribute that cannot be
pickled (a lock, an open socket, a live process) raises `SnapshotError` naming it: such an
environment needs the two methods, or runs with checkpoints off (`mode="never"`: redo from turn 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

from tiderl_jax.agents import tasks
from tiderl_jax.agents.env import Environment, Observation, StepResult, Task
from tiderl_jax.faults.errors import (
    SnapshotError,
    WorkerCrashed,
    WorkerTimeout,
)
from tiderl_jax.policies import belayer

START_METHODS = ("forkserver", "spawn")


# Messages between parent and child: length-prefixed pickles on a socket pair. A sender writes a
# frame (header and payload) with one send; a reader takes whatever has arrived with one recv and
# splits off the complete frames (multiprocessing.Connection reads a header and a payload with two
# syscalls, and pickles with the default protocol).
_HEADER = struct.Struct("!Q")  # payload bytes
_READ_SIZE = 1 << 16  # bytes per recv (below malloc's mmap threshold: no mmap per read)


def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class _FrameReader:
    """Splits a byte stream into frames: `feed(data)` returns the payloads (memoryviews of
    immutable bytes) of the frames `data` completes, in order, and keeps a partial one. A frame
    split across reads is buffered until complete (copied once then, not at every read)."""

    def __init__(self):
        self._buf = bytearray()
        self._need = 0  # bytes (header included) the buffered frame needs; 0 while its header is incomplete

    def feed(self, data: bytes) -> list[memoryview]:
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return []
            data, self._buf, self._need = bytes(self._buf), bytearray(), 0
        view, pos, size, out = memoryview(data), 0, len(data), []
        while size - pos >= _HEADER.size:
            end = pos + _HEADER.size + _HEADER.unpack_from(data, pos)[0]
            if end > size:
                self._need = end - pos
                break
            out.append(view[pos + _HEADER.size:end])
            pos = end
        if pos < size:
            self._buf += view[pos:]
        return out


class EnvError(RuntimeError):
    """The environment raised inside its subprocess (the message carries the child's traceback)."""


@dataclasses.dataclass(frozen=True)
class EnvSnapshot:
    """An environment's state after `turn` completed steps (held by the parent, outlives the child)."""

    task: Task
    turn: int
    state: bytes
    observation: str | Observation | None  # what the model saw last at that turn


# ----------------------------------------------------------------------------------- snapshots


def _is_code(value: Any) -> bool:
    if callable(value):
        return True
    return isinstance(value, Mapping) and bool(value) and all(callable(v) for v in value.values())


def snapshot_env(env: Environment) -> bytes:
    """The environment's state as bytes (see the module docstring for what counts as state)."""
    if hasattr(env, "snapshot_state") and hasattr(env, "restore_state"):
        return pickle.dumps(("custom", env.snapshot_state()))
    try:
        attrs = vars(env)
    except TypeError:
        raise SnapshotError(f"environment {type(env).__name__} has no instance attributes (__slots__?) "
                            f"to snapshot; give it snapshot_state()/restore_state() methods") from None
    state = {}
    for name, value in attrs.items():
        if _is_code(value):
            continue  # tools, score: rebuilt by make_env(task)
        try:
            state[name] = pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError, ...
            raise SnapshotError(
                f"environment {type(env).__name__}: attribute {name!r} ({type(value).__name__}) cannot "
                f"be pickled ({type(e).__name__}: {e}); give the environment snapshot_state()/"
                f"restore_state() methods, or run it with checkpoints off (mode='never')") from None
    return pickle.dumps(("attrs", state))


def restore_env(env: Environment, state: bytes) -> None:
    """Sets a freshly built environment (`make_env(task)`) back to a snapshot's state."""
    kind, payload = pickle.loads(state)
    if kind == "custom":
        env.restore_state(payload)
        return
    for name, value in payload.items():
        setattr(env, name, pickle.loads(value))


# ----------------------------------------------------------------------------------- the child


def _serve(sock: socket.socket, make_env: Callable[[Task], Environment]) -> None:
    """The child's loop: one request at a time, replies ("ok", seq, result) or ("error", seq, text).
    A "step+snapshot" replies first, then (unless the episode ended) snapshots the environment and
    pushes ("snapshot", seq, (state, seconds, monotonic end)) or ("snapshot_error", seq, message) unasked: the
    snapshot runs while the parent's model generates, and costs the parent no request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop (Ctrl-C there)
    sock.setblocking(True)
    loop = asyncio.new_event_loop()
    env: Environment | None = None
    reader, requests = _FrameReader(), []

    def reply(message) -> bool:
        """Sends `message` (an error instead if it cannot be pickled); False once the parent is gone."""
        try:
            data = _frame(message)
        except Exception as e:  # noqa: BLE001 - an unpicklable result is the environment's error
            data = _frame(("error", message[1], (type(e).__name__, False, str(e), traceback.format_exc())))
        try:
            sock.sendall(data)
        except OSError:
            return False
        return True

    while True:
        try:
            while not requests:
                data = sock.recv(_READ_SIZE)
                if not data:
                    return  # the parent closed its end
                requests = reader.feed(data)[::-1]
            seq, op, arg = pickle.loads(requests.pop())
        except OSError:
            return
        try:
            if op == "reset":
                env = make_env(arg)
                result = loop.run_until_complete(env.reset(arg))
            elif op == "restore":
                task, state = arg
                env = make_env(task)
                restore_env(env, state)
                result = None
            elif env is None:
                raise RuntimeError(f"{op} before reset")
            elif op in ("step", "step+snapshot"):
                result = loop.run_until_complete(env.step(arg))
                if op == "step+snapshot":
                    if not reply(("ok", seq, result)):
                        return
                    if not result.done:
                        t0 = time.perf_counter()
                        try:
                            state = snapshot_env(env)
                        except SnapshotError as e:
                            pushed = ("snapshot_error", seq, str(e))
                        else:
                            pushed = ("snapshot", seq, (state, time.perf_counter() - t0, time.monotonic()))
                        if not reply(pushed):
                            return
                    continue
            elif op == "ping":
                result = None
            elif op == "snapshot":
                result = snapshot_env(env)
            else:
                raise RuntimeError(f"unknown request {op!r}")
            message = ("ok", seq, result)
        except Exception as e:  # noqa: BLE001 - the environment's own error goes back to the caller
            message = ("error", seq, (type(e).__name__, isinstance(e, SnapshotError), str(e), traceback.format_exc()))
        if not reply(message):
            return


# ----------------------------------------------------------------------------------- EnvWorker


@contextlib.contextmanager
def main_module_hidden(make_env):
    """Starts children without re-running the parent's main script in them.

    A spawn or forkserver child first re-imports the parent's `__main__` from its path (CPython
    3.11's forkserver does not preload it either), which costs that script's imports (JAX: ~0.3 s,
    a training entry point more) at every environment start and restart. The child needs only
    `_serve` and `make_env`, so while a child starts, `__main__` is a bare module without a path:
    the child's preparation data names no main to run. Skipped when `make_env` itself lives in
    `__main__` (the child must run the script to find it).
    """
    fn = getattr(make_env, "func", make_env)  # a functools.partial's function
    if getattr(fn, "__module__", None) == "__main__":
        yield
        return
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main



class EnvWorker:
    """One environment in a subprocess: async reset / step / snapshot / restore, crash and timeout
    detection. Calls are serialised (one at a time); `restart()` replaces the child."""

    def __init__(self, make_env: Callable[[Task], Environment] = tasks.make_env, *,
                 timeout_s: float = 30.0, start_method: str = "forkserver"):
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not one of {START_METHODS} "
                             f"(fork is unsafe once JAX has started threads)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        try:
            pickle.dumps(make_env)
        except Exception as e:  # noqa: BLE001 - any pickling error means the same
            raise ValueError(f"make_env {make_env!r} must be picklable (a module-level function or a "
                             f"functools.partial of one) to reach the subprocess: {e}") from None
        self.make_env = make_env
        self.timeout_s = timeout_s
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":  # children fork with the task code imported (no effect
            self._ctx.set_forkserver_preload(["tiderl_jax.agents.tasks"])  # once the server runs)
        self._lock = asyncio.Lock()
        self._seq = 0
        # called with (seq of the step, ok, (state, seconds, end) or the error message) for each pushed snapshot
        self.on_snapshot: Callable[[int, bool, Any], None] | None = None
        self.sent_at = 0.0  # time.monotonic() when the latest request was sent
        self.starts = 0
        self._proc = self._sock = None
        self.start()

    # ------------------------------------------------------------------ process

    def start(self) -> None:
        parent, child = socket.socketpair()
        proc = self._ctx.Process(target=_serve, args=(child, self.make_env), daemon=True,
                                 name="tiderl-env-worker")
        with main_module_hidden(self.make_env):
            proc.start()
        child.close()
        parent.setblocking(False)
        self._proc, self._sock = proc, parent
        self._fd, self._sentinel = parent.fileno(), proc.sentinel
        self._frames = _FrameReader()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the socket and the sentinel
        self._waiting: tuple[int, asyncio.Future] | None = None  # (seq, reply future) of the call in flight
        self._pushed: list[tuple[int, bool, Any]] = []  # snapshots that arrived while no call waited
        self._outbox: memoryview | None = None  # the rest of a request larger than the socket buffer
        self._ended = False  # the child closed its end or exited: no more replies
        self._paused = False  # socket unwatched until the next call: a snapshot push is on its way
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        """Ends the child now (SIGKILL) and waits for it."""
        if self._proc is None:
            return
        self._unwatch()
        if self._proc.is_alive():
            try:
                os.kill(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.join(5)
        self._sock.close()
        self._ended = True

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        self._proc = None

    # ------------------------------------------------------------------ the event loop's watch

    # The event loop watches the socket and the child's process sentinel for as long as the child
    # lives (not per call: a reader added and removed per call cost four epoll_ctl syscalls and
    # the selector's bookkeeping on every round trip). Each arriving frame goes to the call waiting
    # for it by seq; a pushed snapshot goes to `on_snapshot` during a call, or is handed over when
    # the next call starts. After a step whose snapshot is still to come, the socket alone is
    # unwatched until the next call (which reads what arrived first): a push arriving between
    # calls would wake the loop once more per step, and a wake-up of the loop's thread takes the
    # GIL from the engine and trainer threads (measured: about 5-10% per update in the controller).

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        self._unwatch()  # a worker moves with its caller to another loop (e.g. asyncio.run after asyncio.run)
        self._loop, self._paused = loop, False
        if not self._ended:
            loop.add_reader(self._fd, self._on_readable)
            loop.add_reader(self._sentinel, self._on_exit)

    def _unwatch(self) -> None:
        loop, self._loop, self._outbox = self._loop, None, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)
            loop.remove_reader(self._sentinel)

    def _on_readable(self) -> bool:
        """One recv: dispatches the frames it completes (at EOF: `_end`); False when nothing was
        waiting or the child ended."""
        try:
            data = self._sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._end()
            return False
        self._dispatch(self._frames.feed(data))
        return True

    def _drain(self) -> None:
        """Reads and dispatches everything that has arrived (at EOF: `_end`)."""
        while not self._ended and self._on_readable():
            pass

    def _on_exit(self) -> None:
        """The child exited: what it sent before is read first."""
        self._drain()
        self._end()

    def _end(self) -> None:
        """No more replies: the waiting call (and every later one) finds the child crashed."""
        self._ended, self._paused = True, False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)
            loop.remove_reader(self._sentinel)
        self._outbox = None
        self._resolve(None, "crashed", None)

    def _dispatch(self, frames: list[memoryview]) -> None:
        for frame in frames:
            try:
                status, seq, payload = pickle.loads(frame)
            except Exception as e:  # noqa: BLE001 - an unreadable reply fails the call waiting for it
                self._resolve(None, "raise", e)
                continue
            if status in ("snapshot", "snapshot_error"):  # pushed after an earlier step+snapshot
                if self._waiting is not None:
                    if self.on_snapshot is not None:
                        try:
                            self.on_snapshot(seq, status == "snapshot", payload)
                        except Exception as e:  # noqa: BLE001 - raised to the waiting call, as it was
                            self._resolve(None, "raise", e)
                else:
                    self._pushed.append((seq, status == "snapshot", payload))
            else:
                self._resolve(seq, status, payload)

    def _resolve(self, seq: int | None, status: str, payload: Any) -> None:
        """Hands (status, payload) to the call waiting for `seq` (any call when None); a reply to
        an abandoned call finds none and is dropped."""
        waiting = self._waiting
        if waiting is None or (seq is not None and seq != waiting[0]):
            return
        self._waiting = None
        if not waiting[1].done():
            waiting[1].set_result((status, payload))

    def _send(self, data: bytes) -> None:
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):  # the rest when the child has read some (a large restore)
            self._outbox = memoryview(data)[sent:]
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        try:
            sent = self._sock.send(self._outbox) if self._outbox is not None else 0
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end()
            return
        if self._outbox is not None:
            self._outbox = self._outbox[sent:]
            if len(self._outbox):
                return
        self._outbox = None
        self._loop.remove_writer(self._fd)

    def _on_timeout(self, seq: int) -> None:
        self._resolve(seq, "timeout", None)

    # ------------------------------------------------------------------ calls

    async def _call(self, op: str, arg: Any = None, timeout_s: float | None = None) -> Any:
        """Sends one request and waits for its reply on the event loop itself: the loop watches the
        socket and the child's process sentinel, so a reply costs no thread hand-off (on a loaded
        machine a waiting thread's wake-up and GIL hand-back added milliseconds to every call)."""
        async with self._lock:
            proc = self._proc
            if proc is None:
                raise RuntimeError("EnvWorker is closed")
            loop = asyncio.get_running_loop()
            self._watch(loop)
            self._seq += 1
            seq = self._seq
            data = _frame((seq, op, arg))
            self.sent_at = time.monotonic()  # (CLOCK_MONOTONIC: the child's clock too)
            if self._paused:  # what the child pushed since the last call, then watch again
                self._paused = False
                self._drain()
                if not self._ended:
                    loop.add_reader(self._fd, self._on_readable)
            pushed, self._pushed = self._pushed, []
            for item in pushed:  # arrived after the previous call returned
                if self.on_snapshot is not None:
                    self.on_snapshot(*item)
            if self._ended:
                raise self._crashed(op)
            try:
                self._send(data)
            except OSError:
                raise self._crashed(op) from None
            reply = loop.create_future()
            self._waiting = (seq, reply)
            timeout_s = timeout_s or self.timeout_s
            timer = loop.call_later(timeout_s, self._on_timeout, seq)
            try:
                status, payload = await reply
            except asyncio.CancelledError:
                self._waiting = None
                self.kill()  # the child's state is unknown now; its next call reports a crash
                raise
            finally:
                timer.cancel()
            if status == "ok":
                if (op == "step+snapshot" and not payload.done and not self._ended and self._loop is loop
                        and not any(item[0] == seq for item in self._pushed)):
                    loop.remove_reader(self._fd)  # its snapshot is read when the next call starts
                    self._paused = True
                return payload
            if status == "timeout":
                self.kill()
                raise WorkerTimeout(f"environment {op} took longer than {timeout_s}s; its subprocess "
                                    f"(pid {proc.pid}) was killed")
            if status == "crashed":
                raise self._crashed(op)
            if status == "raise":
                raise payload
            name, is_snapshot_error, message, tb = payload
            if is_snapshot_error:
                raise SnapshotError(message)
            raise EnvError(f"environment {op} raised {name}: {message}\n--- in the subprocess ---\n{tb}")

    def _crashed(self, op: str) -> WorkerCrashed:
        proc = self._proc
        proc.join(1)
        return WorkerCrashed(belayer.SANDBOX_CRASH, f"environment subprocess (pid {proc.pid}) ended "
                                                    f"with exit code {proc.exitcode} during {op}")

    async def reset(self, task: Task) -> str | Observation:
        return await self._call("reset", task)

    async def step(self, action: str, snapshot: bool = False) -> StepResult:
        """One step; with `snapshot`, the child snapshots after replying and pushes the state to
        `on_snapshot`, which runs during a later call (the next one drains it)."""
        return await self._call("step+snapshot" if snapshot else "step", action)

    @property
    def last_seq(self) -> int:
        """The sequence number of the latest request."""
        return self._seq

    async def ping(self) -> None:
        """A no-op round trip: everything the child pushed before it has been handed over."""
        await self._call("ping")

    async def snapshot_bytes(self) -> bytes:
        return await self._call("snapshot")

    async def restore(self, task: Task, state: bytes) -> None:
        await self._call("restore", (task, state))
