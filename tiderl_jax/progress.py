"""Progress of a long phase: global step / total, rate and ETA, as a bar on a terminal, else as lines.

    bar = Progress("warm start", total=800, unit="step")
    for i in range(800):
        ...
        bar.update(i + 1, nll=0.41)
    bar.close()

On a terminal the line is redrawn in place (at most 10 times a second); otherwise (a log file, CI) a
line is printed every `every` updates and at the end. The rate counts only this process's updates
(a resumed phase starts its clock at the step it resumed from). JAX-free.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_seconds(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    def __init__(self, phase: str, total: int, *, unit: str = "step", start: int = 0, every: int = 25,
                 stream: TextIO | None = None, tty: bool | None = None):
        self.phase, self.total, self.unit = phase, max(int(total), 1), unit
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = max(1, every)
        self.start = self.done = start
        self.t0 = time.perf_counter()
        self._drawn = 0.0
        self._open = False

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return (self.done - self.start) / dt if dt > 0 else 0.0

    def line(self, **fields) -> str:
        rate = self.rate()
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        extra = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        pct = 100 * self.done / self.total
        head = f"{self.phase} {self.unit} {self.done}/{self.total} ({pct:.0f}%)"
        if self.tty:
            width = 20
            fill = int(width * self.done / self.total)
            head = f"{self.phase} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}"
        return (f"{head}{': ' + extra if extra else ''} | {rate:.2f} {self.unit}/s | "
                f"elapsed {format_seconds(time.perf_counter() - self.t0)}, ETA {format_seconds(eta)}")

    def update(self, done: int, **fields) -> None:
        self.done = done
        if self.tty:
            now = time.perf_counter()
            if now - self._drawn >= 0.1 or done >= self.total:
                self.stream.write("\r\033[K" + self.line(**fields))
                self.stream.flush()
                self._drawn, self._open = now, True
        elif (done - self.start) % self.every == 0 or done >= self.total:
            self.print(self.line(**fields))

    def print(self, text: str) -> None:
        """A line of its own (a probe's result, a warning) that does not break the bar."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


class CompileWatch:
    """Says when the process is compiling: JAX reports each program it compiles (`jax.monitoring`), and
    while compiles keep coming a line every `every_s` seconds tells how many so far and how long they
    took (first calls of a shape compile; later calls reuse the program). `count` / `seconds` total
    them for the summary. `start()` begins watching; `stop()` ends the reporting thread."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self, every_s: float = 20.0, stream: TextIO | None = None):
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self.count = 0
        self.seconds = 0.0
        self._reported = 0
        self._stop = None

    def _listen(self, event: str, duration: float, **_) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration

    def start(self) -> "CompileWatch":
        import threading

        from jax import monitoring
        monitoring.register_event_duration_secs_listener(self._listen)
        self._stop = threading.Event()
        threading.Thread(target=self._report, daemon=True, name="compile-watch").start()
        return self

    def _report(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.count > self._reported:
                self.stream.write(f"compiling device programs: {self.count} so far ({self.seconds:.0f}s); "
                                  f"each new shape compiles once, later calls reuse it\n")
                self.stream.flush()
                self._reported = self.count

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
