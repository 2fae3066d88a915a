"""Runs small model-written Python programs in a fresh, limited subprocess (the `python` task's sandbox).

`run_python(code)` writes the program to `main.py` in a fresh temporary directory and starts
`python -I -S -B -X utf8` there (isolated mode: no PYTHON* variables, no site or user packages, no
bytecode writes) with that directory as its working directory, HOME and TMPDIR and an otherwise
empty environment. A short prelude runs in the child before the program:

- hard resource limits: address space (`memory_limit_mb`), CPU seconds, size of written files, no
  core files. The child sets them on itself rather than in `preexec_fn`, which is unsafe in a
  process with threads (`run_python_async` runs from a worker thread of a process running JAX).
- an audit hook (PEP 578) that ends the program on a violation:
  - `network`: any `socket.*` event (creating, connecting, resolving), except creating a Unix socket
    (asyncio's event loop makes a socket pair; connecting or binding one is still refused);
  - `filesystem`: opening a file for writing, or removing / renaming / linking / chmod-ing / making a
    directory, outside the temporary directory (symlinks resolved). Reading is allowed;
  - `process`: starting processes (`subprocess`, `os.system`, `os.exec*`, `os.fork`,
    `os.posix_spawn`, multiprocessing), signalling other processes, and opening another process's
    entries under /proc (its memory, descriptors, environment);
  - `native`: loading native code through ctypes; `limits`: changing the resource limits.
  The program cannot catch a violation: the hook writes a marker line to stderr and exits with
  status 97, which the parent reports as `SandboxResult.violation`.
- a MemoryError that reaches the top level is reported as the violation `memory_limit`.

The parent enforces the wall-clock limit (`timeout`) and the stdout limit (`output_limit`; stderr
keeps its last `max_output_chars` bytes instead, where a traceback ends). It kills the program's
whole process group (`start_new_session=True`) after every run, so nothing the program started
outlives it, and removes the temporary directory.

`run_python_pair(code, peer)` runs two programs so, side by side, each in its own directory and process
group, joined only by a Unix socket pair (its descriptor in `SANDBOX_PEER_FD`); the run ends when `code`
ends. The code reward runs its test judge and the graded program this way, so that the graded program can
answer calls but cannot write the judge's output.

What it does not guard: an audit hook is not a security boundary. Code that reaches native code by
other means, tampers with the hook through introspection, or writes through descriptor-relative
calls the audit events do not describe (`os.open(name, flags, dir_fd=fd)`) gets past the Python-level
rules. The hard limits are the rlimits and the process-group kill. The sandbox is meant for programs
that go wrong by accident or naively (infinite loops, memory bombs, stray writes, network calls),
not for hostile native code: run the trainer in a container for that. Linux only (it reads
/proc/self/fd).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

_MARKER = "__tiderl_sandbox_violation__"
_VIOLATION_STATUS = 97
_MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: the largest file the program may write

# Runs in the child as `python -c _PRELUDE marker status memory_bytes cpu_s file_bytes`, in the
# sandbox directory, then runs main.py.
_PRELUDE = r'''
import _posixsubprocess, os, resource, socket, sys, traceback

marker, (status, memory_bytes, cpu_s, file_bytes) = sys.argv[1], map(int, sys.argv[2:6])
root = os.path.realpath(os.getcwd())


def limit(kind, soft, hard):
    current = resource.getrlimit(kind)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


limit(resource.RLIMIT_AS, memory_bytes, memory_bytes)
limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
limit(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
limit(resource.RLIMIT_CORE, 0, 0)


def refuse(kind, detail):
    try:
        sys.stdout.flush()
    finally:
        os.write(2, f"\n{marker} {kind} {detail}\n".encode(errors="replace"))
        os._exit(status)


def inside(path, dir_fd=None):
    """Whether `path` (a name, relative to `dir_fd` if one is given, or a descriptor) lies in root."""
    try:
        if isinstance(path, int):
            path = os.readlink(f"/proc/self/fd/{path}")
        elif isinstance(dir_fd, int) and dir_fd >= 0:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))
        path = os.path.realpath(os.fsdecode(path))
    except (OSError, TypeError, ValueError):
        return False
    return path == root or path.startswith(root + os.sep)


def another_process(path):
    """Whether `path` names an entry of another process under /proc (its memory, descriptors, environment)."""
    try:
        path = os.path.abspath(os.fsdecode(path))
        parts = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)).split(os.sep)
    except (OSError, TypeError, ValueError):
        return True
    return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != str(os.getpid())


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# event -> (index of a path argument, index of its dir_fd argument or None) for each path it changes
FS_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
}
PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork",
                  "os.forkpty", "pty.spawn"}


def hook(event, args):
    if event.startswith("socket.") and not (event == "socket.__new__" and args[1] == socket.AF_UNIX):
        refuse("network", event)  # a local socket pair (asyncio's wake-up pipe) is fine; using it to connect is not
    elif event == "open":
        path, _, flags = args
        if not isinstance(path, int) and flags & WRITE_FLAGS and not inside(path):  # an int is an open descriptor
            refuse("filesystem", f"open {path!r}")
        if not isinstance(path, int) and another_process(path):
            refuse("process", f"open {path!r}")
    elif event in FS_EVENTS:
        for p, d in FS_EVENTS[event]:
            if not inside(args[p], None if d is None else args[d]):
                refuse("filesystem", f"{event} {args[p]!r}")
    elif event in PROCESS_EVENTS or (event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid())):
        refuse("process", event)
    elif event.startswith("ctypes."):
        refuse("native", event)
    elif event in ("resource.setrlimit", "resource.prlimit"):
        refuse("limits", event)


# multiprocessing's spawn and forkserver start processes through fork_exec, which raises no event.
_posixsubprocess.fork_exec = lambda *args: refuse("process", "_posixsubprocess.fork_exec")
with open("main.py", encoding="utf-8") as f:
    source = f.read()
sys.addaudithook(hook)
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
except MemoryError:
    refuse("memory_limit", "MemoryError")
except SystemExit:
    raise
except BaseException as e:  # the program's traceback, without the prelude's frame
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
'''

_VIOLATION_LINE = re.compile(rf"\n?^{_MARKER} (\w+) (.*)$\n?", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str  # at most max_output_chars bytes of it
    stderr: str  # its last max_output_chars bytes; a violation adds "sandbox violation: <kind> (<what>)"
    exit_code: int  # the program's exit status; negative: killed by that signal
    violation: str | None  # timeout, memory_limit, output_limit, network, filesystem, process, native, limits
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.violation is None


def run_python(code: str, *, stdin: str = "", time_limit_s: float = 2.0, memory_limit_mb: int = 256,
               max_output_chars: int = 2000) -> SandboxResult:
    """Runs `code` in a fresh sandboxed interpreter (see the module docstring); blocks until it ends.

    `max_output_chars` counts bytes of UTF-8 output (characters, for ASCII). Nothing the program
    does raises out of here: its failures and violations are in the result.
    """
    return _run((code,), stdin, time_limit_s, memory_limit_mb, max_output_chars)[0]


def run_python_pair(code: str, peer: str, *, time_limit_s: float = 2.0, memory_limit_mb: int = 256,
                    max_output_chars: int = 2000) -> tuple[SandboxResult, SandboxResult]:
    """Runs `code` and `peer` side by side, each in a sandbox of its own (temporary directory, process group,
    `run_python`'s limits), joined by a Unix socket pair: each finds its end's descriptor number in the
    environment variable SANDBOX_PEER_FD. Returns their results, `code`'s first.

    The run ends when `code` exits (or at the time limit, or when either's stdout passes the limit); `peer`
    is killed then. Neither can write to the other's directory, output or process, so `code` can judge an
    untrusted `peer` through the socket alone (the code reward does). Both can read files, the other's
    directory included.
    """
    first, second = _run((code, peer), "", time_limit_s, memory_limit_mb, max_output_chars)
    return first, second


def _run(codes: tuple[str, ...], stdin: str, time_limit_s: float, memory_limit_mb: int,
         max_output_chars: int) -> list[SandboxResult]:
    """Starts each program in its own directory (two: joined by a socket pair), collects them, cleans up."""
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _PRELUDE, _MARKER, str(_VIOLATION_STATUS),
            str(memory_limit_mb << 20), str(math.ceil(time_limit_s)), str(_MAX_FILE_BYTES)]
    with contextlib.ExitStack() as stack:
        ends = socket.socketpair() if len(codes) == 2 else (None,)
        for end in ends:
            if end is not None:
                stack.enter_context(end)
        start = time.monotonic()
        procs = []
        for code, end in zip(codes, ends):
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tiderl_sandbox_",
                                                                  ignore_cleanup_errors=True))
            with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            with open(os.path.join(tmp, "stdin.txt"), "w", encoding="utf-8") as f:
                f.write(stdin)
            env = {"HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            if end is not None:
                env["SANDBOX_PEER_FD"] = str(end.fileno())
            with open(os.path.join(tmp, "stdin.txt"), "rb") as stdin_file:
                proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        pass_fds=() if end is None else (end.fileno(),))
            stack.enter_context(proc)  # closes the pipes and reaps the program on the way out
            stack.callback(os.killpg, proc.pid, signal.SIGKILL)  # first: not reaped yet, its group is ours
            procs.append(proc)
        for end in ends:  # the programs hold theirs: one that ends is seen by the other at once
            if end is not None:
                end.close()
        collected = _collect(procs, start + time_limit_s, max_output_chars)
    wall_s = time.monotonic() - start
    return [_result(proc, out, err, violation, wall_s) for proc, (out, err, violation) in zip(procs, collected)]


def _result(proc: subprocess.Popen, out: bytearray, err: bytearray, violation: str | None,
            wall_s: float) -> SandboxResult:
    stderr = err.decode(errors="replace")
    if violation is None and proc.returncode == _VIOLATION_STATUS:
        found = list(_VIOLATION_LINE.finditer(stderr))
        if found:
            violation, detail = found[-1].groups()
            stderr = stderr[:found[-1].start()] + f"\nsandbox violation: {violation} ({detail})"
    if violation is None and proc.returncode == -signal.SIGXCPU:
        violation = "timeout"
    return SandboxResult(out.decode(errors="replace"), stderr.strip("\n"), proc.returncode, violation, wall_s)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the program has exited, without reaping it (its process group stays ours to kill)."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(procs: list[subprocess.Popen], deadline: float,
             limit: int) -> list[tuple[bytearray, bytearray, str | None]]:
    """Reads the programs' output until the first one exits; stops early at the deadline (`timeout` for the
    first and for each other still running) or when a program's stdout passes `limit` (`output_limit` for
    it). Returns (stdout head, stderr tail, violation or None) per program. Waits for the exit without
    reaping, so that the caller can still kill the process groups safely."""
    got = [(bytearray(), bytearray(), [None]) for _ in procs]

    def read(key) -> bool:  # False: that stdout passed the limit
        out, err, violation = got[key.data[0]]
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
            selector.unregister(key.fileobj)
        buffer = out if key.data[1] else err
        buffer.extend(chunk)
        if len(out) > limit:
            del out[limit:]
            violation[0] = "output_limit"
            return False
        del err[:-limit]
        return True

    def results():
        return [(out, err, violation[0]) for out, err, violation in got]

    def timed_out():
        for i, (proc, (_, _, violation)) in enumerate(zip(procs, got)):
            if i == 0 or not _exited(proc):
                violation[0] = "timeout"
        return results()

    with selectors.DefaultSelector() as selector:
        for i, proc in enumerate(procs):
            selector.register(proc.stdout, selectors.EVENT_READ, (i, True))
            selector.register(proc.stderr, selectors.EVENT_READ, (i, False))
        while any(key.data[0] == 0 for key in selector.get_map().values()):  # the first's output is open
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return timed_out()
            for key, _ in selector.select(remaining):
                if not read(key):
                    return results()
        for key, _ in selector.select(0):  # what the others wrote before the first ended (a traceback)
            if not read(key):
                return results()
    while not _exited(procs[0]):
        if time.monotonic() >= deadline:  # it closed its output but runs on
            return timed_out()
        time.sleep(0.005)
    return results()


async def run_python_async(code: str, **limits: Any) -> SandboxResult:
    """`run_python` (same arguments) in a worker thread, so that the event loop runs on meanwhile.

    Cancelling the await does not stop the program early; its time limit still does.
    """
    return await asyncio.to_thread(run_python, code, **limits)
