"""Ctrl-C that waits for a state change to finish, and SIGTERM taken as Ctrl-C (JAX-free).

A train step donates its parameters and optimizer state to the compiled program and stores the new ones
when it returns. Python raises KeyboardInterrupt at the first bytecode after the signal arrives: if that is
between the program's return and the stores (a first call compiles for seconds, and the interrupt is raised
as soon as it returns), the trainer is left holding donated, deleted arrays, and the save that Ctrl-C
promises fails. `deferred()` holds a SIGINT that arrives inside it until the block has ended; a second one
inside it interrupts at once (the user insists; what was being applied is lost).

SIGTERM is what Slurm, Kubernetes and preemptible cloud VMs send before they kill a job. `install()` makes it
take Ctrl-C's path wherever that path is: it calls whatever handles SIGINT at that moment (Python's default,
which raises KeyboardInterrupt; `deferred()`'s hold; asyncio's, which cancels the main task), so a SIGTERM
saves, is held, drains exactly as a Ctrl-C would there. `name()` says which of the two it was."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading

_terminated = False  # a SIGTERM arrived (Python runs signal handlers in the main thread, between bytecodes)


def install() -> None:
    """SIGTERM takes SIGINT's path from now on (module docstring). Call at the top of a launch script's main."""
    signal.signal(signal.SIGTERM, _as_sigint)


def _as_sigint(signum, frame):
    global _terminated
    _terminated = True
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    # SIGINT ignored or left to the C default: Ctrl-C has no Python path here, so SIGTERM ends the process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def name() -> str:
    """The signal that interrupted this process: SIGTERM when one arrived (`install`), else SIGINT (Ctrl-C)."""
    return "SIGTERM" if _terminated else "SIGINT"


def command() -> str:
    """This process's command line, as the user can paste it to resume."""
    return shlex.join([sys.executable, *sys.argv])


@contextlib.contextmanager
def deferred():
    """Holds SIGINT (and with `install`, SIGTERM, which calls SIGINT's handler) until the block ends, then
    raises KeyboardInterrupt as the default handler it stood in for would have. Only the main thread receives
    signals: elsewhere (and under a handler that is not Python's default, such as asyncio's, which cancels
    tasks instead of raising) the block runs unchanged."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending = []

    def hold(signum, frame):
        if pending:  # the second Ctrl-C: at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt
