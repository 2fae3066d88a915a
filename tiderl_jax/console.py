"""What a launch script's log records look like, on the terminal and in the log file (docs/running.md, "Output").

    console.setup(cfg.logdir)  # first thing in main, after absl parsed the flags

On the terminal (stderr) a record is its message alone, whatever its level: the progress, step and decision
lines read as plain text (a line starting `error: ` stays the scripts' own last word on a failure). Records of
third-party code below WARNING (JAX's backend probe, `Unable to initialize backend 'tpu'` on a CPU-only machine;
orbax's per-save lines) and third-party Python warnings (written for their developers) stay off the terminal;
their warnings and errors logged as such still show. With a log directory every record goes, with absl's prefix
(level, date, time, thread, file:line), to `<logdir>/log.txt` (appended: a resumed run continues it). absl's
`--verbosity=1` (`-v 1`) shows every record on the terminal too, prefixed, and the debug ones; `--verbosity=-1`
only warnings and errors. JAX-free.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

from absl import logging as absl_logging
from absl.logging import converter

LOG_FILE = "log.txt"
# the project's code: a record logged from a file under these (absl's records name their caller's file)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = ("tiderl_jax", "launch")
_HANDLERS: list[logging.Handler] = []  # this module's handlers on the root logger: a second setup replaces them
_SHOWWARNING = warnings.showwarning


class _Prefixed(logging.Formatter):
    """absl's prefix, then the message: `I1204 18:53:40.141405 140629797907328 metrics.py:172] RL step ...`."""

    def format(self, record: logging.LogRecord) -> str:
        return absl_logging.get_absl_log_prefix(record) + super().format(record)


class _LogFile(logging.FileHandler):
    """Opened at its first record, its directory made then: a run refused before it logs anything leaves no file."""

    def _open(self):
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def _in_project(path: str) -> bool:
    rel = os.path.relpath(os.path.abspath(path), _ROOT)
    return rel.split(os.sep, 1)[0] in _OURS


def _ours(record: logging.LogRecord) -> bool:
    if record.name == "absl":  # absl.logging's calls: the launch scripts', and orbax's
        return _in_project(record.pathname)
    return record.name.split(".", 1)[0] in ("tiderl_jax", "__main__")


def _for_terminal(record: logging.LogRecord) -> bool:
    if record.name == "py.warnings":  # a library's Python warning
        return False
    return record.levelno >= logging.WARNING or _ours(record)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Python warnings as log records: the project's own on the terminal, a library's in the log file."""
    if file is not None:  # written where the caller asked, as Python does
        _SHOWWARNING(message, category, filename, lineno, file, line)
    elif _in_project(filename):
        logging.getLogger("tiderl_jax.warnings").warning("%s", message)
    else:
        logging.getLogger("py.warnings").warning(
            "%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())


def setup(logdir: str | None = None, *, log_name: str = LOG_FILE, verbosity: int | None = None,
          stream: TextIO | None = None) -> str | None:
    """The terminal's handler (plain, or prefixed at verbosity >= 1) and, with `logdir`, the log file's, on the
    root logger in place of absl's; the root level from `verbosity` (absl's flag when None). Call it again to
    change them (the old ones are removed). Returns the log file's path (None without a log directory)."""
    if verbosity is None:
        verbosity = absl_logging.get_verbosity()
    root = logging.getLogger()
    for h in _HANDLERS + [absl_logging.get_absl_handler()]:
        root.removeHandler(h)
        if h in _HANDLERS:
            h.close()
    _HANDLERS.clear()
    # absl's mapping of its verbosity (1: DEBUG; higher: finer still, for vlog)
    root.setLevel(converter.absl_to_standard(verbosity) if verbosity <= 1 else logging.DEBUG - (verbosity - 1))
    terminal = logging.StreamHandler(stream or sys.stderr)
    if verbosity >= 1:
        terminal.setFormatter(_Prefixed())
    else:
        terminal.setFormatter(logging.Formatter())  # the message (and a record's traceback)
        terminal.addFilter(_for_terminal)
    _HANDLERS.append(terminal)
    path = None
    if logdir:
        path = os.path.join(logdir, log_name)
        log_file = _LogFile(path, mode="a", encoding="utf-8", delay=True)
        log_file.setFormatter(_Prefixed())
        _HANDLERS.append(log_file)
    for h in _HANDLERS:
        root.addHandler(h)
    warnings.showwarning = _show_warning
    return path
