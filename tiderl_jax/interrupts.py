"""Ctrl-C that waits for a state change to finish (JAX-free).

A train step donates its parameters and optimizer state to the compiled program and stores the new ones
when it returns. Python raises KeyboardInterrupt at the first bytecode after the signal arrives: if that is
between the program's return and the stores (a first call compiles for seconds, and the interrupt is raised
as soon as it returns), the trainer is left holding donated, deleted arrays, and the save that Ctrl-C
promises fails. `deferred()` holds a SIGINT that arrives inside it until the block has ended; a second one
inside it interrupts at once (the user insists; what was being applied is lost)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred():
    """Holds SIGINT until the block ends, then raises KeyboardInterrupt as the default handler it stood in
    for would have. Only the main thread receives signals: elsewhere (and under a handler that is not Python's
    default, such as asyncio's, which cancels tasks instead of raising) the block runs unchanged."""
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
