"""Environments for dataset tasks, and the one call that turns a `data` config section into a task source.

- Single-turn (no `env` given): `AnswerEnvironment` shows the task's prompt and scores the model's first
  reply with the reward function (`rewards.RewardFn`: veRL's signature, under a timeout): the reply
  text is `solution_str`, the row's ground truth, `data_source` and `extra_info` the other arguments.
  A reward failure raises `RewardFailed`, which the rollout loop records as that sample's end reason.
- Multi-turn (`env="module:Class"`): the user's class (checked at load: `rewards.check_environment_class`),
  one instance per task, built with no arguments, or with `reward_fn=` the loaded reward function
  when its constructor takes a `reward_fn` parameter. The rollout loop calls `reset(task)` and `step`.

`DataEnvFactory` is picklable (it holds the import paths, not the objects) so it also works in the
controller's environment subprocesses (`env_workers`), each loading the paths once.

`build_data(cfg, seed)`: the train `TaskSource`, the held-out tasks and the environment factory
from a config section with `train_files`, `heldout_files`, `prompt_key`, `answer_key`, `reward_fn`,
`env`, `reward_timeout_s`, `shuffle`, `system_prompt` (docs/data.md); without held-out files, rows of the
train files held out (`hold_out`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from tiderl_jax.agents.env import StepResult, Task
from tiderl_jax.data import datasets, rewards

log = logging.getLogger(__name__)


class AnswerEnvironment:
    """A single-turn task: the first reply is the answer, scored by the reward function."""

    def __init__(self, reward_fn: rewards.RewardFn):
        self.reward_fn = reward_fn
        self.task: Task | None = None

    async def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    async def step(self, action: str) -> StepResult:
        assert self.task is not None, "reset() first"
        d = self.task.data
        result = await self.reward_fn(d.get("data_source", ""), action, d.get("ground_truth"), d.get("extra_info"))
        return StepResult(None, result.score, True, {"answer": action, "reward_info": dict(result.info)})


@dataclasses.dataclass(frozen=True)
class DataEnvFactory:
    """`make_env(task)` for dataset tasks: the user's environment class, else `AnswerEnvironment`."""

    reward_fn: str = "math"
    env: str = ""
    reward_timeout_s: float = rewards.DEFAULT_TIMEOUT_S

    def __post_init__(self):
        self.load()  # a bad path fails here, when the run is configured, not at the first task

    def load(self) -> tuple[rewards.RewardFn, type | None]:
        cache = self.__dict__.get("_loaded")
        if cache is None:
            fn = rewards.load_reward_fn(self.reward_fn, timeout_s=self.reward_timeout_s)
            cls = rewards.load_environment_class(self.env) if self.env else None
            cache = (fn, cls)
            object.__setattr__(self, "_loaded", cache)
        return cache

    def __getstate__(self):  # the paths travel; each process loads them again
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def __call__(self, task: Task):
        fn, cls = self.load()
        if cls is None:
            return AnswerEnvironment(fn)
        params = inspect.signature(cls).parameters
        return cls(reward_fn=fn) if "reward_fn" in params else cls()


@dataclasses.dataclass(frozen=True)
class DataTasks:
    train: datasets.TaskSource | None
    heldout: tuple[Task, ...]
    make_env: DataEnvFactory
    errors: tuple[datasets.RowError, ...]  # malformed rows of both splits, skipped
    heldout_from_train: int = 0  # rows of the train files held out (no held-out files were given)


def _get(cfg: Any, key: str, default: Any) -> Any:
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def _with_system(dataset: datasets.Dataset, system: str) -> datasets.Dataset:
    if not system:
        return dataset
    tasks = tuple(dataclasses.replace(t, data={**t.data, "system_prompt": system}) for t in dataset.tasks)
    return dataclasses.replace(dataset, tasks=tasks)


def hold_out(dataset: datasets.Dataset, n: int, *, seed: int = 0) -> tuple[datasets.Dataset, tuple[Task, ...]]:
    """`n` rows of a train split held out for evaluation (a seeded choice, at most half the rows), the rest to
    train on: what a run without held-out files evaluates on, never trained."""
    import random

    n = min(n, len(dataset) // 2)
    if n <= 0:
        return dataset, ()
    chosen = set(random.Random(f"heldout/{seed}").sample(range(len(dataset)), n))
    held = tuple(dataclasses.replace(t, is_eval=True) for i, t in enumerate(dataset.tasks) if i in chosen)
    kept = tuple(t for i, t in enumerate(dataset.tasks) if i not in chosen)
    return dataclasses.replace(dataset, tasks=kept), held


def build_data(cfg: Any, *, seed: int = 0, holdout: int = 0) -> DataTasks:
    """The dataset tasks a `data` config section names (a ConfigDict, a dict or an object); each
    malformed row logged as a warning (file, row, field) and counted in `errors`. Without held-out files,
    `holdout` rows of the train files are held out (`hold_out`) and not trained on. `system_prompt`, when
    set, is each task's system message (`Task.data["system_prompt"]`, read by the rollout loop)."""
    make_env = DataEnvFactory(_get(cfg, "reward_fn", "") or "math", _get(cfg, "env", "") or "",
                              float(_get(cfg, "reward_timeout_s", rewards.DEFAULT_TIMEOUT_S)))
    keys = dict(prompt_key=_get(cfg, "prompt_key", "") or "", answer_key=_get(cfg, "answer_key", "") or "",
                require_answer=not make_env.env)
    system = _get(cfg, "system_prompt", "") or ""
    train = heldout = None
    if datasets.split_paths(_get(cfg, "train_files", "") or ""):
        train = _with_system(datasets.load_dataset(_get(cfg, "train_files", ""), split="train", **keys), system)
    if datasets.split_paths(_get(cfg, "heldout_files", "") or ""):
        heldout = _with_system(datasets.load_dataset(_get(cfg, "heldout_files", ""), split="heldout", **keys), system)
    errors = tuple(e for d in (train, heldout) if d for e in d.errors)
    for e in errors:
        log.warning("skipped a malformed row: %s", e)
    held = heldout.tasks if heldout else ()
    if train is not None and heldout is None and holdout > 0:
        train, held = hold_out(train, holdout, seed=seed)
    source = train and datasets.TaskSource(train, seed=seed, shuffle=bool(_get(cfg, "shuffle", True)))
    return DataTasks(source, held, make_env, errors, heldout_from_train=len(held) if heldout is None else 0)
