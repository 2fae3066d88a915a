"""The multi-turn rollout loop, with Continuous Task Batching (CTB) or the request-level baseline.

Many tasks run at once (asyncio). Each task alternates an engine turn (the model writes until its
end-of-turn token or the per-turn budget) and an environment step (real waiting time). Every turn goes
through the rollout service (`serving.service.RolloutService`: one engine, or N replicas behind a router):
each task is a session, the router places each of its turns (back on the replica holding its KV unless the
policy decides otherwise), and one driver coroutine per replica applies the commands (submit, resume,
release, ...) between engine steps; each step runs in a worker thread so environments keep running meanwhile.

```
task:   admit ─► turn ─► env_wait ─► ready ─► turn ─► ... ─► done
CTB:    footprint   KV kept + pinned   resume: prefill only the observation tokens
request-level:      KV released        resubmit: prefill the whole context (prefix cache may hit)
```

CTB (`mode="ctb"`, docs/mechanisms.md, rules in `tiderl_jax/policies/ctb.py`): tasks are admitted
while their footprint estimates fit the KV budget; a waiting task's KV stays resident and pinned;
before each engine step, if free KV falls below what the generating tasks need, waiting tasks are
evicted (lowest priority, or longest expected wait when `readiness_aware`) and recompute on resume.
The baseline (`mode="request"`) releases KV at every tool call, as a stock engine does.

Images: an observation may carry raw images (`env.Observation`). The runner patchifies them with
the model's patch size (square patches: image_patch_dim = patch_size**2 * channels), renders them
into the chat (`chat.encode` -> `ImageSpan`s) and keeps the spans in the trajectory at absolute
offsets. CTB passes the new observation's spans to `Engine.resume`; the baseline resubmits the
whole context with all its spans. A model that cannot take an image (text-only, or another patch
shape) fails that task with `engine_error`, the reason stated.

Chat format: the built-in ChatML (`chat.encode`), or the checkpoint's own template when the tokenizer
ships one (`Tokenizer.chat_template` -> `chat_template.ChatTemplate`): the prompt is its encoding, each
observation its token delta after the model's turn (`observation_ids`: the conversation rendered without
and with the tool message), the model's tokens stay exactly as sampled, the environment parses the turn
in the family's tool-call format, and turns end at the checkpoint's stop tokens (`Tokenizer.stop_ids`).

Truncation policy: a task whose context plus the next observation plus one more turn's budget
would exceed `max_context` ends with `end_reason="context_limit"` and reward 0, keeping what it
generated (the observation that does not fit is not appended), so no trajectory is longer than
`max_context` and the trainer never has to cut one.
A first prompt that leaves no room for one turn (its tokens plus `max_new_tokens` over `max_context`)
is not a truncation but a configuration that cannot work for that task: it fails with
`prompt_too_long`, the sizes stated, and a warning names the task.
Failures: an environment exception or timeout ends the task (`env_error` / `env_timeout`, reward 0,
the reason recorded; a dataset task's reward function that raises or times out: `reward_error` /
`reward_timeout`, `data/rewards.py`); a refused engine request ends it with `engine_error`. Other tasks go on.
An exception from the engine's step itself (a bad kernel choice, device out of memory, a compile
error) ends that engine: with other replicas alive the service re-routes its turns (their KV recomputed);
with none left, every pending turn and command fails with `EngineFailed` (naming the original error), and
so does any later command; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import zlib
from typing import Callable, Sequence

import numpy as np

from tiderl_jax.agents.env import (EnvRewound, Environment, LatencyModel, Observation, RewardFailed, Task,
                                   as_observation)
from tiderl_jax.agents.tasks import SYSTEM_PROMPT
from tiderl_jax.trajectory import Trajectory, Turn
from tiderl_jax.engine.engine import Engine, Request, SequenceOutput
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.model import chat, vision
from tiderl_jax.model.chat_template import ChatTemplate, continuation_ids
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.model.vision import ImageSpan
from tiderl_jax.policies import ctb
from tiderl_jax.serving.service import EngineFailed, EngineReplica, RolloutService  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    mode: str = "ctb"  # "ctb" | "request"
    max_turns: int = 8
    max_new_tokens: int = 64  # per turn
    max_context: int = 2048
    env_concurrency: int = 64  # environment steps in flight at once
    env_timeout_s: float = 30.0
    temperature: float = 1.0
    seed: int = 0
    kv_budget_tokens: int | None = None  # CTB admission budget; default: the engine's pool
    initial_growth: int = 128  # CTB footprint growth guess before a task's first turn
    # CTB footprint horizon: "task" reserves the expected remaining growth of the whole task (from
    # finished tasks' turn counts; max_turns before any finishes), "turn" only the next turn's.
    footprint_horizon: str = "task"
    readiness_aware: bool = False
    weights: ctb.CTBWeights = ctb.CTBWeights()
    # External agents make the train samples instead of this loop (agents/external.py, docs/serving.md):
    # an async function `module:function` (task, base_url, api_key), or a command run with OPENAI_BASE_URL /
    # OPENAI_API_KEY set; both "": this loop. An episode past agent_timeout_s fails its sample.
    agent: str = ""
    agent_command: str = ""
    agent_timeout_s: float = 600.0

    def __post_init__(self):
        if self.mode not in ("ctb", "request"):
            raise ValueError(f"rollout mode {self.mode!r} is not 'ctb' or 'request'")
        if self.footprint_horizon not in ("task", "turn"):
            raise ValueError(f"footprint_horizon {self.footprint_horizon!r} is not 'task' or 'turn'")


def turn_limits(task: Task, config: RolloutConfig) -> tuple[int, int]:
    """(max_turns, max_new_tokens per turn) of a task: its own (`Task.data["max_turns"]`,
    `["max_new_tokens"]`, e.g. its workload class's: `data.mixture`), else the config's."""
    turns, tokens = task.data.get("max_turns", config.max_turns), task.data.get("max_new_tokens", config.max_new_tokens)
    if not (isinstance(turns, int) and turns >= 1 and isinstance(tokens, int) and tokens >= 1):
        raise ValueError(f"task {task.task_id}: max_turns={turns!r} and max_new_tokens={tokens!r} must be ints >= 1")
    return turns, tokens


def workload_class(task: Task, config: RolloutConfig) -> str:
    """A task's workload class for the router (`policies.routing.CLASSES`): its own
    (`Task.data["workload_class"]`), else `agentic` when it may take several turns, `rlvr` when one."""
    return task.data.get("workload_class") or ("agentic" if turn_limits(task, config)[0] > 1 else "rlvr")


def system_prompt(task: Task) -> str:
    """A task's system message: its own (`Task.data["system_prompt"]`, e.g. a dataset's `data.system_prompt`),
    else the project's tool-use prompt."""
    return task.data.get("system_prompt") or SYSTEM_PROMPT


def first_prompt(tokenizer: Tokenizer, template: ChatTemplate | None, text: str, system: str = SYSTEM_PROMPT,
                 images=()) -> tuple[list[chat.Message], chat.EncodedChat]:
    """A task's first messages (system, user) and the tokens it starts from: their encoding with the generation
    prompt, in the checkpoint's own template when it ships one (`template`), else the built-in ChatML.
    ValueError for text the template cannot take."""
    messages = [chat.Message("system", system), chat.Message("user", text, images=images)]
    if template is not None:
        return messages, template.encode(messages, add_generation_prompt=True)
    return messages, chat.encode(tokenizer, messages, add_generation_prompt=True)


@dataclasses.dataclass
class _TaskState:
    task: Task
    group: int
    latency: LatencyModel
    sample: int = 0  # which of the group's samples of this task (its own sampling seed)
    temperature: float = 1.0  # its sampling temperature and seed (`submit`: the config's by default)
    seed: int = 0
    session: int = 0  # its session in the rollout service
    active: bool = False  # generating (or about to)
    context_len: int = 0
    turns_done: int = 0
    tokens_added: int = 0
    wait_started: float = 0.0
    done: bool = False
    pending_obs: list = dataclasses.field(default_factory=list)  # observation tokens to resume with
    pending_images: list = dataclasses.field(default_factory=list)  # their images (offsets into them)
    restart: bool = False  # the next turn starts a fresh engine sequence (after a rewind)


class RolloutRunner:
    """Runs tasks to their end through a rollout service: `engine` is one `Engine` (a one-replica service
    with the default router) or a `RolloutService` of N replicas."""

    def __init__(self, engine: Engine | RolloutService, tokenizer: Tokenizer, config: RolloutConfig = RolloutConfig()):
        self.service = engine if isinstance(engine, RolloutService) else RolloutService([engine])
        self._sessions = 0
        self.tok = tokenizer
        self.template = ChatTemplate.for_tokenizer(tokenizer)  # None: the built-in ChatML
        self.config = config
        self.metrics = dict(tasks=0, completed=0, failed=0, rewinds=0, malformed_turns=0, turns=0,
                            generated_tokens=0, ctb_evictions=0, env_seconds=0.0)
        self._states: dict[str, _TaskState] = {}
        self._group_sizes: dict[int, int] = {}
        self._group_done: dict[int, int] = {}
        self._finished_turns: list[int] = []  # turn counts of tasks that ended (footprint horizon)
        self._samples: dict[tuple[str, int], int] = {}  # (task id, group) -> samples submitted
        self.step_span = None  # optional: a context manager factory wrapping each engine step

    @property
    def engine(self) -> Engine:
        """The first replica's engine (the only one of a one-engine runner)."""
        return self.service.replicas[0].engine

    # ------------------------------------------------------------------ CTB signals

    def _signals(self, s: _TaskState, engine: Engine | None = None, handle: int | None = None) -> ctb.TaskKVSignals:
        waited = time.perf_counter() - s.wait_started
        return ctb.TaskKVSignals(
            task_id=handle if handle is not None else -1, is_eval=s.task.is_eval,
            group_completion=self._group_done.get(s.group, 0) / self._group_sizes[s.group],
            is_active=s.active, context_len=engine.num_kv_tokens(handle) if handle is not None else 0,
            expected_wait_s=0.0 if s.active else max(0.0, s.latency.mean_s() - waited))

    def _relieve_pressure(self, rep: EngineReplica):
        """CTB: evict waiting tasks' KV on this replica when its free KV cannot hold the next turns of the tasks
        generating there."""
        if self.config.mode != "ctb":
            return
        eng = rep.engine
        live = [(s, rep.sessions[s.session]) for s in self._states.values()
                if not s.done and s.session in rep.sessions]
        ps = eng.config.page_size
        need = sum(eng.pending_kv_tokens(h) + ps for s, h in live if s.active)
        shortfall = need - eng.free_kv_tokens()
        if shortfall <= 0:
            return
        waiting = [self._signals(s, eng, h) for s, h in live if not s.active]
        for handle in ctb.choose_evictions(waiting, shortfall, weights=self.config.weights,
                                           readiness_aware=self.config.readiness_aware):
            eng.evict(handle)
            self.metrics["ctb_evictions"] += 1

    # ------------------------------------------------------------------ one task

    async def _run_task(self, s: _TaskState, env: Environment,
                        admission: "_Admission", env_slots: asyncio.Semaphore) -> Trajectory:
        cfg = self.config
        traj = Trajectory(s.task.task_id, s.task.kind, s.group, info={"sample": s.sample})
        try:
            first = as_observation(await env.reset(s.task))
        except Exception as e:
            return self._fail(traj, s, "env_error", f"reset failed: {type(e).__name__}: {e}")
        try:  # an image the model cannot take, or text that holds image placeholders
            messages, encoded = first_prompt(self.tok, self.template, first.text, system_prompt(s.task),
                                   images=self._patches(first))
            if self.template is not None and hasattr(env, "parse_tool_calls"):  # tools in the family's format
                env.parse_tool_calls = self.template.parse_tool_calls
        except (RequestError, ValueError) as e:
            return self._fail(traj, s, "engine_error", str(e))
        context = encoded.ids
        traj.extend(context, generated=False, images=encoded.images)
        try:
            max_turns, max_new = turn_limits(s.task, cfg)
        except ValueError as e:
            return self._fail(traj, s, "bad_task", str(e))
        if len(context) + max_new > cfg.max_context:  # not one turn fits: the config cannot work
            room = cfg.max_context - max_new
            log.warning("task %s: its prompt (%d tokens) leaves no room for a turn (rollout.max_context=%d, "
                        "max_new_tokens=%d)", s.task.task_id, len(context), cfg.max_context, max_new)
            return self._fail(traj, s, "prompt_too_long",
                              f"the prompt is {len(context)} tokens; rollout.max_context={cfg.max_context} leaves "
                              f"room for at most {room} with max_new_tokens={max_new}")
        stop = self.tok.stop_ids
        marks = [len(traj.tokens)]  # trajectory length after the prompt, then after each observation
        await admission.acquire(s, self._footprint(s, len(context)))
        try:
            turn = -1
            while True:
                turn += 1
                if turn >= max_turns:
                    traj.end_reason = "max_turns"
                    break
                seed = zlib.crc32(f"{s.seed}/{s.task.task_id}/{s.sample}".encode()) % 2**31
                sampling = SamplingParams(temperature=s.temperature, max_new_tokens=max_new,
                                          seed=seed, stop_ids=stop)
                s.active = True
                t0 = time.perf_counter()
                try:
                    out = await self._engine_turn(s, traj, turn, sampling)
                except RequestError as e:
                    return self._fail(traj, s, "engine_error", str(e))
                gen_s = time.perf_counter() - t0
                n = len(out.new_tokens)
                start = len(traj.tokens)
                traj.extend(out.new_tokens, generated=True, logprobs=out.logp_sample[-n:],
                            model_logprobs=out.logp_model[-n:], versions=out.versions[-n:])
                self.metrics["generated_tokens"] += n
                s.active = False
                s.wait_started = time.perf_counter()
                text = self.tok.decode(out.new_tokens)
                t1 = time.perf_counter()
                try:
                    async with env_slots:
                        result = await asyncio.wait_for(env.step(text), cfg.env_timeout_s)
                except EnvRewound as r:  # the environment crashed and came back at turn r.turn
                    try:
                        self._rewind(s, traj, marks, r.turn)
                    except ValueError as e:
                        return self._fail(traj, s, "env_error", str(e))
                    del messages[2 + 2 * r.turn:]  # system, user, then (assistant, tool) per turn
                    turn = r.turn - 1
                    continue
                except asyncio.TimeoutError:
                    traj.turns.append(Turn(start, start + n, gen_s, time.perf_counter() - t1))
                    return self._fail(traj, s, "env_timeout", f"environment step exceeded {cfg.env_timeout_s}s")
                except RewardFailed as e:  # the task's reward function raised or timed out
                    traj.turns.append(Turn(start, start + n, gen_s, time.perf_counter() - t1))
                    return self._fail(traj, s, e.reason, str(e))
                except Exception as e:
                    traj.turns.append(Turn(start, start + n, gen_s, time.perf_counter() - t1))
                    return self._fail(traj, s, "env_error", f"{type(e).__name__}: {e}")
                env_s = time.perf_counter() - t1
                self.metrics["env_seconds"] += env_s
                malformed = bool(result.info.get("malformed"))
                self.metrics["malformed_turns"] += malformed
                self.metrics["turns"] += 1
                calls, errors = int(result.info.get("tool_calls", 0)), int(result.info.get("tool_errors", 0))
                traj.turns.append(Turn(start, start + n, gen_s, env_s, malformed, calls, errors))
                if result.done:
                    traj.reward = float(result.reward)
                    traj.end_reason = "answered"
                    break
                try:
                    obs, obs_images = self._encode_observation(messages, text, out.finish_reason == "stop",
                                                               as_observation(result.observation))
                except (RequestError, ValueError) as e:
                    return self._fail(traj, s, "engine_error", str(e))
                if len(traj.tokens) + len(obs) + max_new > cfg.max_context:
                    traj.end_reason = "context_limit"  # the observation and a next turn do not fit
                    break
                traj.extend(obs, generated=False, images=obs_images)
                marks.append(len(traj.tokens))
                s.turns_done += 1
                s.tokens_added = len(traj.tokens) - len(context)
                admission.update(s, self._footprint(s, len(traj.tokens)))
                s.pending_obs, s.pending_images = obs, obs_images
            self.metrics["completed"] += 1
            return traj
        finally:
            self._finish(s, len(traj.tokens))
            admission.release(s)

    def _rewind(self, s: _TaskState, traj: Trajectory, marks: list[int], turn: int):
        """Cuts the trajectory back to just after environment step `turn`'s observation (0: the
        prompt) and drops the engine's sequence: the next turn is a fresh request over what is left
        (its KV recomputed, or found in the prefix cache)."""
        if not 0 <= turn < len(marks):
            raise ValueError(f"environment rewound to turn {turn}, but the task has only reached "
                               f"turn {len(marks) - 1}")
        keep = marks[turn]
        for name in ("tokens", "loss_mask", "logprobs", "model_logprobs", "versions"):
            del getattr(traj, name)[keep:]
        traj.images[:] = [im for im in traj.images if im.offset < keep]
        del traj.turns[turn:]
        del marks[turn + 1:]
        s.turns_done, s.tokens_added = turn, keep - marks[0]
        s.restart = True
        self.metrics["rewinds"] += 1
        self.service.release(s.session)

    def _patches(self, obs: Observation) -> tuple[np.ndarray, ...]:
        """The observation's raw images as the model's patches; RequestError when it takes none."""
        cfg = self.engine.model_cfg
        patches = []
        for image in obs.images:
            if not cfg.is_vision:
                raise RequestError("the observation holds an image but the model is text-only "
                                   "(image_patch_dim=0): it takes no images")
            channels = np.shape(image)[-1] if np.ndim(image) == 3 else 0
            size = math.isqrt(cfg.image_patch_dim // channels) if channels else 0
            if not channels or size * size * channels != cfg.image_patch_dim:
                raise RequestError(f"an observation image of shape {np.shape(image)} does not fit the "
                                   f"model's image_patch_dim {cfg.image_patch_dim} (patch_size**2 * channels)")
            try:
                patches.append(vision.patchify(image, size))
            except ValueError as e:
                raise RequestError(f"observation image: {e}") from None
        return tuple(patches)

    def _encode_observation(self, messages: list[chat.Message], turn_text: str, stopped: bool,
                            obs: Observation) -> tuple[list[int], list[ImageSpan]]:
        """The tokens that end the model's turn (its end-of-turn token when it did not stop on one) and
        add the observation as a tool message, with the generation prompt; and the observation's image
        spans (offsets into those tokens). `messages` gains the model's turn and the tool message."""
        tool = chat.Message("tool", obs.text, images=self._patches(obs))
        said = chat.Message("assistant", turn_text)
        if self.template is not None:
            parsed = self.template.parse_tool_calls(turn_text)
            if not parsed.errors:
                said = chat.Message("assistant", parsed.content, parsed.tool_calls)
        messages += [said]
        ids, images = continuation_ids(self.tok, self.template, messages, [tool], stopped=stopped)
        messages += [tool]
        return ids, images

    def _footprint(self, s: _TaskState, context_len: int) -> int:
        cfg = self.config
        margin = 1.0 if cfg.footprint_horizon == "turn" else max(
            1.0, ctb.expected_remaining_turns(s.turns_done, self._finished_turns, turn_limits(s.task, cfg)[0]))
        return ctb.estimate_footprint(context_len, s.turns_done, s.tokens_added,
                                      initial_growth=cfg.initial_growth, margin_turns=margin)

    async def _engine_turn(self, s: _TaskState, traj: Trajectory, turn: int, sampling: SamplingParams
                           ) -> SequenceOutput:
        """One turn through the service. CTB: the first turn (or the first after a rewind or a move) submits the
        whole context and keeps its KV; a later one resumes on the replica holding it, prefilling only the
        observation. Request-level: every turn submits the whole context (the prefix cache may hit)."""
        context, images = list(traj.tokens), list(traj.images)  # absolute offsets
        # speculative drafts from what this task's samples have generated so far (its GRPO group). A train task's
        # id is new in every group and epoch (a dataset's ends in /e<epoch>), so nothing carries over from earlier
        # epochs; only held-out tasks, evaluated again during RL, may find their earlier evaluations' tokens
        draft_key = ("task", s.task.task_id)
        ctb_mode = self.config.mode == "ctb"
        if ctb_mode:
            def submit(eng: Engine) -> int:
                return eng.submit(Request(context, sampling, keep_kv=True, images=images,
                                          priority=ctb.task_priority(self._signals(s), self.config.weights),
                                          sample_offset=sum(traj.loss_mask), draft_key=draft_key))
        else:
            def submit(eng: Engine) -> int:
                return eng.submit(Request(context, sampling, images=images, draft_key=draft_key))
        obs, obs_images = s.pending_obs, s.pending_images

        def resume_here(eng: Engine, handle: int) -> int:
            eng.unpin(handle)
            eng.resume(handle, obs, sampling=sampling, images=obs_images)
            return handle
        resume = resume_here if ctb_mode and turn > 0 and not s.restart else None
        s.restart = False  # (after a rewind: the seeded stream goes on where it was)
        cfg = self.config
        left = self._group_sizes[s.group] - self._group_done.get(s.group, 0)
        remaining = ctb.expected_remaining_turns(s.turns_done, self._finished_turns, turn_limits(s.task, cfg)[0])
        _, out = await self.service.turn(s.session, tokens=context, submit=submit, resume=resume,
                                         cls=workload_class(s.task, cfg), turn=turn,
                                         group_remaining_turns=max(0.0, remaining) * left)
        return out

    def _fail(self, traj: Trajectory, s: _TaskState, reason: str, detail: str) -> Trajectory:
        traj.end_reason, traj.failure, traj.reward = reason, detail, 0.0
        self.metrics["failed"] += 1
        return traj

    def _finish(self, s: _TaskState, kv_tokens: int):
        s.done = True
        self._finished_turns.append(s.turns_done + 1)
        self._group_done[s.group] = self._group_done.get(s.group, 0) + 1
        self.service.end_session(s.session, workload_class(s.task, self.config), kv_tokens)

    # ------------------------------------------------------------------ many tasks

    async def run(self, tasks: Sequence[tuple[Task, int]], make_env: Callable[[Task], Environment],
                  latency_of: Callable[[Task], LatencyModel] = lambda t: LatencyModel()) -> list[Trajectory]:
        """Runs every (task, group) to its end; returns trajectories in the order given. The same
        task given several times (a GRPO group) gives differently seeded samples."""
        await self.start(make_env, latency_of)
        try:
            return list(await asyncio.gather(*(self.submit(t, g) for t, g in tasks)))
        finally:
            await self.stop()

    # ------------------------------------------------------------------ streaming

    async def start(self, make_env: Callable[[Task], Environment],
                    latency_of: Callable[[Task], LatencyModel] = lambda t: LatencyModel()) -> None:
        """Starts the engine driver; tasks then come in one by one with `submit` (a controller that
        admits tasks as capacity frees up), until `stop`."""
        self._make_env, self._latency_of = make_env, latency_of
        pin = (lambda rep, h: rep.engine.pin(h)) if self.config.mode == "ctb" else (lambda rep, h: None)
        await self.service.start(self._relieve_pressure, pin, self.step_span)
        budget = self.config.kv_budget_tokens or sum((e.pool.num_pages - 1) * e.config.page_size
                                                     for e in self.service.engines)
        self._admission = _Admission(budget if self.config.mode == "ctb" else None)
        self._env_slots = asyncio.Semaphore(self.config.env_concurrency)

    async def submit(self, task: Task, group: int, *, expected_group_size: int | None = None,
                     sample: int | None = None, temperature: float | None = None,
                     seed: int | None = None) -> Trajectory:
        """Runs one task to its end (await it, or wrap it in a task). `expected_group_size` tells CTB's
        group-completion signal how many samples the group will have when they arrive one by one;
        `sample` fixes the sample index (its seed; default: the next one of this task and group);
        `temperature` and `seed` replace the config's for this task (a held-out evaluation during RL)."""
        self.metrics["tasks"] += 1
        self._group_sizes[group] = max(self._group_sizes.get(group, 0) + 1, expected_group_size or 0)
        if sample is None:
            sample = self._samples.get((task.task_id, group), 0)
        self._samples[(task.task_id, group)] = max(sample + 1, self._samples.get((task.task_id, group), 0))
        cfg = self.config
        self._sessions += 1
        st = _TaskState(task, group, self._latency_of(task), sample=sample,
                        temperature=cfg.temperature if temperature is None else temperature,
                        seed=cfg.seed if seed is None else seed, session=self._sessions)
        self._states[id(st)] = st
        env = self._make_env(task)
        try:
            return await self._run_task(st, env, self._admission, self._env_slots)
        finally:
            del self._states[id(st)]
            if hasattr(env, "close"):  # e.g. an environment subprocess
                env.close()

    def command(self, fn: Callable[[], object]) -> asyncio.Future:
        """Runs `fn` between engine steps of the first replica (e.g. a weight update); the future gets its
        result. `service.command_all` runs one on every replica."""
        return self.service.command(fn)

    async def stop(self) -> None:
        await self.service.stop()


class _Admission:
    """CTB task-level admission: first come, first served while footprints fit the budget."""

    def __init__(self, budget_tokens: int | None):
        self.budget = budget_tokens
        self.footprints: dict[int, int] = {}  # id(state) -> tokens, admitted tasks
        self.queue: list[tuple[object, int, asyncio.Future]] = []

    async def acquire(self, s, footprint: int):
        if self.budget is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((s, footprint, fut))
        self._admit()
        await fut

    def update(self, s, footprint: int):
        if self.budget is not None and id(s) in self.footprints:
            self.footprints[id(s)] = footprint
            self._admit()  # an estimate that shrank may let a queued task in

    def release(self, s):
        if self.budget is None:
            return
        self.footprints.pop(id(s), None)
        self._admit()

    def _admit(self):
        ids = ctb.admit_tasks([(i, f) for i, (_, f, _) in enumerate(self.queue)],
                              budget_tokens=self.budget, used_tokens=sum(self.footprints.values()))
        admitted = set(ids)
        rest = []
        for i, (s, f, fut) in enumerate(self.queue):
            if i in admitted:
                self.footprints[id(s)] = f
                fut.set_result(None)
            else:
                rest.append((s, f, fut))
        self.queue = rest
