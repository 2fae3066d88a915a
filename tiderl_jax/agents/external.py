"""External agents as a rollout source: an agent that speaks the OpenAI API makes the samples, unchanged.

Configured by `rollout.agent` (`module:function` or `path/file.py:function`: an async function
`agent(task, base_url, api_key)`) or `rollout.agent_command` (a command line, run in a subprocess with
`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OPENAI_MODEL` set and the task as JSON on its stdin), under
`rollout.agent_timeout_s`. `JaxBackend` then serves the rollout service over HTTP on loopback (a free port,
in-process: the controller's weight syncs and KV handling stay as they are) and makes each sample so:

```
sample ─► session id + a key bound to it ─► agent(task, base_url, key)  ... its calls: one session, token-in /
          token-out, KV pinned between calls (rollout.mode ctb) ...  ─► returns (or crashes, or times out)
       ─► the session's record: exactly the tokens served (prompt / tool / user tokens masked; the model's tokens
          with their behaviour log-probs and policy versions) ─► reward ─► Trajectory ─► the controller
```

The task the agent gets (a dict): `task_id`, `kind`, `prompt`, `system_prompt`, `max_turns`, `max_new_tokens`,
`model` (the name to send); never the answer. The reward: what the agent returns (a number, or a dict with
`reward`), else the configured one on the agent's last reply: a built-in task's scorer, or the task's
environment (a dataset's reward function) stepping on that reply. An agent that raises, exits non-zero,
returns something else, makes no request or outlives its timeout fails its sample (`end_reason`
`agent_error` / `agent_timeout`, the reason in `failure`); its key is revoked and its session's KV released
whatever happens. A trajectory is the session's last consistent conversation (an agent that rewrites its
history starts the context over: `info["rewrites"]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import os
import shlex
from typing import Any, Callable

from tiderl_jax.agents.env import Task
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.import_path import ImportPathError, load_object
from tiderl_jax.model.config import ConfigError

log = logging.getLogger(__name__)

MODEL_NAME = "policy"


class AgentFailed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclasses.dataclass
class ExternalAgents:
    function: str = ""
    command: str = ""
    timeout_s: float = 600.0
    max_context: int | None = None  # a session's context limit (rollout.max_context)

    def __post_init__(self):
        if bool(self.function) == bool(self.command):
            raise ConfigError("give exactly one of rollout.agent (module:function) and rollout.agent_command")
        if not self.timeout_s > 0:
            raise ConfigError(f"rollout.agent_timeout_s={self.timeout_s} must be > 0")
        self._fn = None
        if self.function:
            try:
                self._fn = load_object(self.function, "rollout.agent")
            except ImportPathError as e:
                raise ConfigError(str(e)) from None
            if not inspect.iscoroutinefunction(self._fn):
                raise ConfigError(f"rollout.agent {self.function!r} must be an async function "
                                  "agent(task, base_url, api_key)")
        else:
            try:
                self._argv = shlex.split(self.command)
            except ValueError as e:
                raise ConfigError(f"rollout.agent_command: {e}") from None
            if not self._argv:
                raise ConfigError("rollout.agent_command is empty")
        self._ids = itertools.count()
        self.server = self.frontend = None
        self.counts = dict(episodes=0, failed=0)

    async def start(self, service, tokenizer, make_env: Callable[[Task], Any], kv_mode: str) -> None:
        """Serves `service` over HTTP on loopback (a free port) for the agents."""
        from tiderl_jax.serving.openai_api.app import HTTPServer
        from tiderl_jax.serving.openai_api.frontend import Frontend

        self.make_env = make_env
        self.frontend = Frontend(service, tokenizer, model_name=MODEL_NAME, kv_mode=kv_mode,
                                 max_context=self.max_context)
        self.server = HTTPServer(self.frontend, "127.0.0.1", 0)
        await self.server.start()
        log.info("external agents: serving the policy at %s", self.server.base_url)

    async def stop(self) -> None:
        for sid in list(self.frontend.sessions if self.frontend else ()):  # the episodes cut off: requests answered
            self.frontend.end_session(sid)
        if self.server is not None:
            await self.server.stop()
            self.server = None

    # ------------------------------------------------------------------ one sample

    async def run(self, task: Task, group: int, sample: int) -> Trajectory:
        """One episode of the agent on `task`: its session's tokens as a trajectory (module docstring)."""
        f = self.frontend
        sid = f"agent-{group}-{sample}-{next(self._ids)}"
        key = f.issue_key(sid)
        self.counts["episodes"] += 1
        returned, failure = None, None
        try:
            returned = await asyncio.wait_for(self._episode(self._task_json(task), key), self.timeout_s)
        except asyncio.TimeoutError:
            failure = AgentFailed("agent_timeout", f"the agent did not finish within {self.timeout_s}s")
        except AgentFailed as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - the agent's own error fails its sample, not the run
            failure = AgentFailed("agent_error", f"the agent raised {type(e).__name__}: {e}")
        finally:
            f.revoke_key(key)
            record = f.end_session(sid)  # its KV released, the router told
        traj = record.traj if record is not None else Trajectory(task.task_id, task.kind, group)
        traj.task_id, traj.kind, traj.group = task.task_id, task.kind, group
        traj.info.update(sample=sample, session=sid, requests=record.requests if record else 0,
                         rewrites=record.rewrites if record else 0)
        if failure is None and not traj.num_generated:
            failure = AgentFailed("agent_error", "the agent made no request to the policy")
        if failure is None:
            try:
                traj.reward = await self._reward(task, traj, returned)
                traj.end_reason = "answered"
            except AgentFailed as e:
                failure = e
        if failure is not None:
            self.counts["failed"] += 1
            traj.end_reason, traj.failure, traj.reward = failure.reason, str(failure), 0.0
            log.warning("task %s sample %d: %s", task.task_id, sample, failure)
        return traj

    def _task_json(self, task: Task) -> dict:
        from tiderl_jax.agents.rollout import system_prompt

        return {"task_id": task.task_id, "kind": task.kind, "prompt": task.prompt, "system_prompt": system_prompt(task),
                "max_turns": task.data.get("max_turns"), "max_new_tokens": task.data.get("max_new_tokens"),
                "model": MODEL_NAME}

    async def _episode(self, task: dict, key: str):
        base_url = self.server.base_url
        if self._fn is not None:
            return await self._fn(task, base_url, key)
        env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=key, OPENAI_MODEL=MODEL_NAME)
        try:
            proc = await asyncio.create_subprocess_exec(*self._argv, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, env=env)
        except OSError as e:
            raise AgentFailed("agent_error", f"rollout.agent_command could not start: {e}") from None
        try:
            out, err = await proc.communicate(json.dumps(task).encode())
        finally:
            if proc.returncode is None:  # timed out or cancelled: no orphan agent
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
            raise AgentFailed("agent_error", f"the agent command exited {proc.returncode}: {tail[0]}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            last = json.loads(lines[-1])
        except json.JSONDecodeError:
            return None
        is_reward = isinstance(last, (int, float)) or (isinstance(last, dict) and "reward" in last)
        return last if is_reward else None  # its last line is not a reward: the configured reward applies

    async def _reward(self, task: Task, traj: Trajectory, returned) -> float:
        if isinstance(returned, dict) and "reward" in returned:
            returned = returned["reward"]
        if isinstance(returned, (int, float)) and not isinstance(returned, bool):
            return float(returned)
        if returned is not None:
            raise AgentFailed("agent_error", f"the agent returned {type(returned).__name__} {returned!r:.80}; "
                              "expected a reward (a number, or a dict with 'reward') or None")
        last = traj.turns[-1]
        reply = self.frontend.visible(traj.tokens[last.start:last.end])
        env = self.make_env(task)
        try:
            score = getattr(env, "score", None)
            if score is not None:  # a built-in task's scorer: the reply is the answer
                parsed = self.frontend.parse_reply(reply)
                result = score(task, parsed.content)
                return float(await result if inspect.isawaitable(result) else result)
            await env.reset(task)
            step = await env.step(reply)  # a dataset's reward function, through its environment
            return float(step.reward) if step.done else 0.0
        except Exception as e:  # noqa: BLE001
            raise AgentFailed("reward_error", f"scoring the agent's reply raised {type(e).__name__}: {e}") from None
        finally:
            if hasattr(env, "close"):
                env.close()
