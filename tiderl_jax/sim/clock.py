"""Virtual time for asyncio: the simulator's discrete-event clock.

The controller, rollout runner and environments are asyncio code; the simulator runs that same code
on an event loop whose `time()` is virtual. When no callback is ready the loop does not sleep: it
jumps its clock to the next scheduled timer. `await asyncio.sleep(3600)` returns at once in wall time
while `loop.time()` advances by 3600, and everything built on the loop's timers (`asyncio.sleep`,
`wait_for`, `asyncio.timeout`, `call_later`) follows virtual time. A simulated worker "takes" its
cost-modelled seconds by sleeping them; runs are deterministic because wall time never enters.

How: `BaseEventLoop._run_once` computes how long to wait for I/O (`timeout`: 0 when callbacks are
ready, the delay to the next timer, or None when nothing is scheduled) and calls
`selector.select(timeout)`. `VirtualTimeLoop` wraps the selector: it polls real I/O without
waiting, and if nothing arrived it advances the virtual clock by `timeout` instead of blocking.

- Executor jobs (`run_in_executor`, `asyncio.to_thread`) take zero virtual time: while one is
  pending the loop waits for it in real time and the clock stands still, so a thread's result is
  never overtaken by a timer it raced.
- Real I/O (sockets, pipes) is polled, never waited for: it is seen if it is ready when the loop
  polls, and it cannot hold the clock back. The simulator's workers must be cost-modelled, not real.
- Deadlock: nothing ready, no timer, no executor job pending: in virtual time nothing can ever
  happen again (a real loop would block forever, e.g. on I/O that never comes). The loop raises
  `VirtualTimeDeadlock` naming the tasks still waiting instead of hanging.

(Researched: the `looptime` package does the same selector trick but is built as a pytest plugin
with real-time stepping for executors and I/O, and `timeless-loop` / `asyncio-time-travel` are
small unmaintained packages; this module is the ~100 lines we need, with no dependency.)

Use: `clock.run(main())` runs a coroutine on a fresh virtual loop and returns its result;
`clock.now()` is the running loop's time (virtual in a simulation, monotonic on a real loop), so code
that reads time through it (or `loop.time()`) runs unchanged in both worlds.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeDeadlock(RuntimeError):
    """The virtual-time loop has nothing to run, no timer and no executor job: it would wait forever."""


class _VirtualSelector:
    """The loop's selector with `select` replaced: poll real I/O, then jump the clock instead of waiting."""

    def __init__(self, loop: VirtualTimeLoop, real: selectors.BaseSelector):
        self._loop, self._real = loop, real

    def __getattr__(self, name):  # register, unregister, modify, get_key, get_map, close
        return getattr(self._real, name)

    def select(self, timeout: float | None = None):
        loop = self._loop
        if loop.pending_executor_jobs:  # a thread owes us a result: wait for it in real time
            return self._real.select(timeout if timeout == 0 else None)
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise VirtualTimeDeadlock(loop.deadlock_report())
        loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose `time()` is virtual, starting at `start` seconds."""

    def __init__(self, start: float = 0.0):
        real = selectors.DefaultSelector()
        super().__init__(_VirtualSelector(self, real))
        self._now = float(start)
        self.pending_executor_jobs = 0

    def time(self) -> float:
        return self._now

    def quiet_until(self) -> float:
        """The virtual time up to which nothing on the loop can happen: now while callbacks are ready or
        an executor job is pending, else the next timer's time (inf without one). A discrete-event
        driver running inside a callback (`sim/replicas.py`) may `advance` the clock up to it and
        process its own events in plain Python, as if the loop had jumped there itself."""
        if self._ready or self._stopping or self.pending_executor_jobs:
            return self._now
        scheduled = self._scheduled
        while scheduled and scheduled[0]._cancelled:  # what _run_once does with a cancelled head
            self._timer_cancelled_count -= 1
            heapq.heappop(scheduled)._scheduled = False
        if not scheduled:
            return math.inf
        return scheduled[0]._when

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"VirtualTimeLoop.advance: seconds={seconds} must be >= 0 (time runs forward)")
        self._now += seconds

    def run_in_executor(self, executor, func, *args):
        future = super().run_in_executor(executor, func, *args)
        self._track(future)
        return future

    async def shutdown_default_executor(self, *args, **kwargs):
        self.pending_executor_jobs += 1  # its worker thread reports back through the loop
        try:
            await super().shutdown_default_executor(*args, **kwargs)
        finally:
            self.pending_executor_jobs -= 1

    def _track(self, future: asyncio.Future) -> None:
        self.pending_executor_jobs += 1

        def done(_):
            self.pending_executor_jobs -= 1
        future.add_done_callback(done)

    def deadlock_report(self) -> str:
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        names = ", ".join(f"{t.get_name()} ({t.get_coro().__qualname__})" for t in tasks[:8])
        more = f" and {len(tasks) - 8} more" if len(tasks) > 8 else ""
        return (f"virtual-time deadlock at t={self._now:.6f}s: no callback is ready, no timer is scheduled "
                f"and no executor job is pending, so nothing can ever wake the {len(tasks)} waiting task(s): "
                f"{names or 'none'}{more}. A simulated worker must wait on the clock (asyncio.sleep) or on "
                f"other tasks, never on real I/O.")


def new_event_loop(start: float = 0.0) -> VirtualTimeLoop:
    return VirtualTimeLoop(start)


def run(coro: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool | None = None) -> T:
    """Run `coro` to completion on a fresh virtual-time loop (like `asyncio.run`) and return its result."""
    with asyncio.Runner(debug=debug, loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(coro)


def now() -> float:
    """The running event loop's time: virtual on a `VirtualTimeLoop`, `time.monotonic()` on a real one."""
    return asyncio.get_running_loop().time()
