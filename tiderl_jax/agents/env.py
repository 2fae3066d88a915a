"""The environment protocol and the tool-calling environment the built-in tasks share.

An environment is driven by the rollout loop, one task at a time:

    observation = await env.reset(task)            # the user's request (text or an Observation)
    result = await env.step(model_turn_text)        # -> StepResult(observation, reward, done, info)

An observation is a str, or an `Observation` (text plus images) when the environment shows the
model pictures (the `visual` task). Its images are raw pixels `[height, width, channels]` (uint8, or
float in [0, 1]): the environment does not know the model, so the rollout loop patchifies them with
the model's patch size (`vision.patchify`) before they enter the token stream.

The model acts through the chat template's tool markup (`<tool_call>{"name", "arguments"}</tool_call>`,
see `tiderl_jax/model/chat.py`). `ToolEnvironment.step` parses the turn: valid calls run their tools
(after the environment's latency, which is real waiting time so that scheduling effects are real);
malformed calls become an error observation the model can read and the turn is counted as
malformed; a turn without a tool call is the final answer, which the task scores. Tool exceptions
become error observations too; a step's `info` counts its `tool_calls` and `tool_errors` (unknown
tool, refused arguments, the tool raised), which the rollout loop records per turn. Nothing the model
writes ends the run with an exception. Tools and the score function may be coroutine functions (the
`python` task runs its sandbox in a thread). A tool may return an `Observation`; the turn's observation
then carries the images of all its calls (rendered ahead of the text, see `chat.Message`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import random
from typing import Any, Awaitable, Callable, Mapping, Protocol

import numpy as np

from tiderl_jax.model import chat


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: str
    kind: str  # "calculator", "lookup", ...
    prompt: str  # the user's request
    answer: str  # the verifiable answer
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # task-specific (a KB, ...)
    is_eval: bool = False


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: images are arrays
class Observation:
    """What the model sees, with pictures: text and raw images [height, width, channels]."""

    text: str
    images: tuple[np.ndarray, ...] = ()


def as_observation(observation: str | Observation | None) -> Observation:
    """Any observation as an `Observation` (a str is text without images; None is empty)."""
    if isinstance(observation, Observation):
        return observation
    return Observation(observation or "")


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str | Observation | None  # what the model sees next (tool output, an error); None: done
    reward: float
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, task: Task) -> str | Observation: ...

    async def step(self, action: str) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Environment latency per tool call: log-normal with this median (s) and sigma, capped."""

    median_s: float = 0.0
    sigma: float = 0.0
    max_s: float = 10.0

    def sample(self, rng: random.Random) -> float:
        if self.median_s <= 0:
            return 0.0
        return min(self.max_s, self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))

    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma ** 2 / 2) if self.median_s > 0 else 0.0


Tool = Callable[[Mapping[str, Any]], str | Observation | Awaitable[str | Observation]]
Score = Callable[[Task, str], float | Awaitable[float]]


class RewardFailed(Exception):
    """A reward call failed; `reason` is `reward_error` or `reward_timeout` (the sample's end reason). Raised by
    a task's reward (`data/rewards.py`'s `RewardFn`) from an environment's `step`; the rollout loop ends the sample
    with that reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries intact (environment subprocesses)
        return type(self), (self.reason, str(self))


class EnvRewound(Exception):
    """Raised by an environment's `step` when it failed and came back at an earlier turn (restored
    from a checkpoint, or reset: turn 0). `turn` counts the environment steps the restored state has
    answered; the rollout cuts its trajectory back to just after that step's observation and
    generates from there (`faults/env_recovery.py`'s `CheckpointingEnv` raises it)."""

    def __init__(self, turn: int, observation=None, attempt: int = 1, cause: Exception | None = None):
        super().__init__(f"environment rewound to turn {turn} (recovery {attempt}): {cause!r}")
        self.turn, self.observation, self.attempt, self.cause = turn, observation, attempt, cause


class ToolError(Exception):
    """A tool refused its arguments; the message is shown to the model."""


class ToolEnvironment:
    """Runs the task's tools on the model's tool calls and scores its final answer."""

    def __init__(self, tools: Mapping[str, Tool], score: Score, *,
                 latency: LatencyModel = LatencyModel(), seed: int = 0, require_tool_call: bool = True):
        self.tools = dict(tools)
        self.score = score
        self.latency = latency
        self.rng = random.Random(seed)
        self.task: Task | None = None
        self.require_tool_call = require_tool_call  # the tasks need their tool: an answer before
        self.malformed_turns = 0                    # any tool call is sent back, not scored
        self.tool_calls = 0
        # How a turn's tool calls are read: the built-in markup, or the checkpoint's format (the rollout
        # loop sets its ChatTemplate's parser when the model has a template of its own).
        self.parse_tool_calls: Callable[[str], chat.ParsedTurn] = chat.parse_tool_calls

    async def reset(self, task: Task) -> str | Observation:
        self.task = task
        return task.prompt

    async def step(self, action: str) -> StepResult:
        assert self.task is not None, "reset() first"
        parsed = self.parse_tool_calls(action)
        if parsed.errors:
            self.malformed_turns += 1
            return StepResult("error: " + "; ".join(parsed.errors), 0.0, False,
                              {"malformed": True, "errors": parsed.errors})
        if not parsed.tool_calls and self.require_tool_call and self.tool_calls == 0:
            tools = ", ".join(sorted(self.tools))
            return StepResult(f"error: no tool call found; call one of [{tools}] with "
                              f"{chat.CALL_OPEN}{{\"name\": ..., \"arguments\": {{...}}}}{chat.CALL_CLOSE} "
                              f"before answering", 0.0, False, {"no_tool_call": True})
        if not parsed.tool_calls:
            reward = self.score(self.task, parsed.content)
            if inspect.isawaitable(reward):
                reward = await reward
            return StepResult(None, float(reward), True, {"answer": parsed.content})
        outputs, images, errors = [], [], 0
        for call in parsed.tool_calls:
            self.tool_calls += 1
            await asyncio.sleep(self.latency.sample(self.rng))
            tool = self.tools.get(call.name)
            if tool is None:
                outputs.append(f"error: unknown tool {call.name!r}; tools: {sorted(self.tools)}")
                errors += 1
                continue
            try:
                output = tool(call.arguments)
                if inspect.isawaitable(output):
                    output = await output
                if isinstance(output, Observation):
                    images += output.images
                    output = output.text
                outputs.append(str(output))
            except ToolError as e:
                outputs.append(f"error: {e}")
                errors += 1
            except Exception as e:  # a tool bug must not end the run; the model sees the failure
                outputs.append(f"error: tool {call.name} failed: {type(e).__name__}: {e}")
                errors += 1
        text = "\n".join(outputs)
        return StepResult(Observation(text, tuple(images)) if images else text, 0.0, False,
                          {"tool_calls": len(parsed.tool_calls), "tool_errors": errors})
