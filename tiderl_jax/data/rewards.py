"""Reward functions and environments named by import path, run under a timeout.

A reward function is named `"module:function"` (importable: `my_pkg.rewards:compute_score`) or
`"path/to/file.py:function"` (loaded from that file, as veRL's `custom_reward_function.path` is), or
by a built-in's short name (`"math"`, `"code"`, `"auto"`: `builtin.py`; `"reasoning_gym"`,
`"reasoning_gym_last_number"`: `packaged.py`).
Its signature is veRL's:

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict

so existing veRL reward files work unchanged. A dict's `score` key is the reward; its other keys are
kept as the sample's info. `async def` functions are awaited.

Every call runs under `timeout_s`. A sync function runs in its own daemon thread, not in a subprocess:
veRL reward files are ordinary module-level Python that may close over state, read globals or
hold unpicklable objects, and a subprocess per call would have to re-import the module (tens of ms)
or pickle the function; a thread keeps the event loop free while the function runs, at no cost. The
price: Python cannot kill a thread, so a call that hangs past its timeout is abandoned (the daemon
thread does not keep the process alive at exit) and counted in `RewardFn.abandoned` while it runs on
(a slow call that finishes later leaves the count); with `max_abandoned` of them running at once the
function is considered broken and later calls fail at once instead of piling up threads. The code
reward runs the model's code in `agents/sandbox.py`'s subprocesses, which are killed at their own
time limit, so the unbounded work is never in the thread.

A call that raises, times out, or returns something that is not a number (or a dict without a
numeric `score`) raises `RewardFailed` with the reason (`reward_error` / `reward_timeout`) and a
message naming the function; the rollout loop ends that sample with that reason (the controller
counts it as a dropped sample, `dropped:reward_error`), never the run.

An environment is named `"module:Class"` (or `"file.py:Class"`): a class implementing the
`Environment` protocol (`agents/env.py`: `async reset(task)`, `async step(action)`), checked when
loaded. A bad path is one `ImportPathError` naming the path and what is wrong.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
from typing import Any, Callable, Mapping

from tiderl_jax.agents.env import RewardFailed
from tiderl_jax.import_path import ImportPathError, load_object

BUILTIN_REWARDS = {"math": "tiderl_jax.data.builtin:math_reward",
                   "code": "tiderl_jax.data.builtin:code_reward",
                   "reasoning_gym": "tiderl_jax.data.packaged:reasoning_gym_reward",
                   "reasoning_gym_last_number": "tiderl_jax.data.packaged:reasoning_gym_last_number_reward",
                   "auto": "tiderl_jax.data.builtin:auto_reward"}
DEFAULT_TIMEOUT_S = 10.0
MAX_ABANDONED = 16  # abandoned calls still running at which the function is considered broken


# ----------------------------------------------------------------------------------- reward functions


@dataclasses.dataclass(frozen=True)
class RewardResult:
    score: float
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class RewardFn:
    """A veRL-signature reward function under a timeout; `await fn(data_source, solution, truth, extra)`."""

    def __init__(self, fn: Callable, *, name: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_abandoned: int = MAX_ABANDONED):
        if not callable(fn):
            raise ImportPathError(f"reward function {name or fn!r} is not callable ({type(fn).__name__})")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.fn, self.name = fn, name or getattr(fn, "__qualname__", repr(fn))
        self.timeout_s, self.max_abandoned = timeout_s, max_abandoned
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self.abandoned = 0  # calls past their timeout still running in a thread that could not be stopped
        self._lock = threading.Lock()  # `abandoned` changes on the event loop and in the calls' threads
        self.calls = 0

    def __repr__(self):
        return f"RewardFn({self.name}, timeout_s={self.timeout_s})"

    async def __call__(self, data_source: Any, solution_str: str, ground_truth: Any,
                       extra_info: Any = None) -> RewardResult:
        self.calls += 1
        if self.abandoned >= self.max_abandoned:
            raise RewardFailed("reward_timeout", f"reward function {self.name}: {self.abandoned} calls still "
                                                 f"running past {self.timeout_s}s; not called until they end")
        args = (data_source, solution_str, ground_truth, extra_info)
        try:
            if self.is_async:
                value = await asyncio.wait_for(self.fn(*args), self.timeout_s)
            else:
                value = await self._in_thread(args)
        except asyncio.TimeoutError:
            raise RewardFailed("reward_timeout", f"reward function {self.name} took longer than "
                                                 f"{self.timeout_s}s") from None
        except RewardFailed:
            raise
        except Exception as e:
            raise RewardFailed("reward_error", f"reward function {self.name} raised "
                                               f"{type(e).__name__}: {e}") from e
        return self._result(value)

    async def _in_thread(self, args) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(ok: bool, value):
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        state = {"finished": False, "abandoned": False}  # under self._lock: whichever comes second counts

        def work():
            try:
                value, ok = self.fn(*args), True
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                value, ok = e, False
            with self._lock:
                state["finished"] = True
                if state["abandoned"]:  # it outlived its timeout but has ended now
                    self.abandoned -= 1
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop closed meanwhile (an abandoned call)
                pass

        threading.Thread(target=work, name=f"reward:{self.name}", daemon=True).start()
        try:
            return await asyncio.wait_for(future, self.timeout_s)  # cancelled on timeout; settle skips it
        except asyncio.TimeoutError:
            with self._lock:
                state["abandoned"] = True
                if not state["finished"]:
                    self.abandoned += 1
            raise

    def _result(self, value: Any) -> RewardResult:
        info: dict[str, Any] = {}
        if isinstance(value, Mapping):
            if "score" not in value:
                raise RewardFailed("reward_error", f"reward function {self.name} returned a dict without a "
                                                   f"'score' key (keys {sorted(value)})")
            info = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        if isinstance(value, bool):
            value = float(value)
        try:
            score = float(value)
        except (TypeError, ValueError):
            raise RewardFailed("reward_error", f"reward function {self.name} returned {value!r} "
                                               f"({type(value).__name__}), not a number") from None
        if not math.isfinite(score):
            raise RewardFailed("reward_error", f"reward function {self.name} returned {score}")
        return RewardResult(score, info)


def load_reward_fn(spec: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RewardFn:
    """A reward function by import path or built-in name (`BUILTIN_REWARDS`), under `timeout_s`."""
    path = BUILTIN_REWARDS.get(spec, spec)
    fn = load_object(path, "reward function")
    if isinstance(fn, type) or not callable(fn):
        raise ImportPathError(f"reward function {spec!r} is a {type(fn).__name__}, not a callable function")
    return RewardFn(fn, name=spec, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------- environments

_ENV_METHODS = ("reset", "step")


def check_environment_class(cls: Any, spec: str = "") -> type:
    """`cls` if it is a class implementing the `Environment` protocol; ImportPathError naming what is not."""
    what = f"environment {spec or cls!r}"
    if not isinstance(cls, type):
        raise ImportPathError(f"{what} is a {type(cls).__name__}, not a class")
    for method in _ENV_METHODS:
        fn = getattr(cls, method, None)
        if fn is None or not callable(fn):
            raise ImportPathError(f"{what} ({cls.__qualname__}) has no {method}() method; an environment "
                                  f"implements async reset(task) and async step(action) (agents/env.py)")
        if not inspect.iscoroutinefunction(fn):
            raise ImportPathError(f"{what} ({cls.__qualname__}).{method} is not an async def method")
    return cls


def load_environment_class(spec: str) -> type:
    return check_environment_class(load_object(spec, "environment"), spec)
