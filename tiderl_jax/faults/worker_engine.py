"""The rollout's view of engine workers: `WorkerEngine` makes an `EngineClient` (engine_worker.py: an
engine in a worker process, warm standby, health checks, token checkpoints, failover) look like the
part of `Engine` that the request-level rollout loop drives, so `RolloutRunner` runs multi-turn tasks
on engine workers unchanged.

- `submit(Request)` sends the generation to the client; `step()` waits (briefly) until at least one
  generation in flight has finished and returns their handles; `get(handle)` gives the finished
  turn as a `SequenceOutput` (the prompt, then the generated tokens with their log-probs and
  versions; a generation that moved to the standby keeps the versions and log-probs of the tokens
  made before the failure).
- A generation the worker refused comes back from `get` as the `RequestError` it raised (the rollout
  fails that task); a failed client (its monitor stopped) raises `WorkerCrashed` there.
- Limits (the workers'): request-level only (no KV kept across tool calls: `keep_kv`, `pause`,
  `resume` are refused), text only, no device moves, no prefix-cache statistics here (each worker
  keeps its own); `abort` lets the generation finish in the worker and drops its result. A generation's
  tokens are seen only when it has finished, so `end_turn` (a caller's stop string) never ends one early:
  the caller cuts the text. No `runner` here: the HTTP server refuses `top_logprobs` by name
  (serving/openai_api/frontend.py: it needs a full forward on the serving weights).
"""

from __future__ import annotations

import dataclasses
import time

from tiderl_jax.engine.engine import EngineConfig, SequenceOutput, Status
from tiderl_jax.engine.sampling import RequestError
from tiderl_jax.faults.engine_worker import EngineClient


@dataclasses.dataclass
class _Gen:
    prompt: list[int]
    submitted: float
    result: object = None  # GenerationResult, or the exception `wait` raised
    finished: float | None = None


class _Pages:  # what the rollout reads of the page pool (its CTB budget, unused at request level)
    def __init__(self, num_pages: int):
        self.num_pages = num_pages


class WorkerEngine:
    def __init__(self, client: EngineClient, model_cfg, config: EngineConfig, *, poll_s: float = 0.02):
        self.client, self.model_cfg, self.config = client, model_cfg, config
        self.pool = _Pages(config.num_pages)
        self.poll_s = poll_s
        self._gens: dict[int, _Gen] = {}
        self.version = client.params.version
        self.compile_s = 0.0  # the workers compile before they serve (not on the run's clock)
        self._steps = self._prompt_tokens = self._decode_tokens = 0  # counters of finished generations

    # ------------------------------------------------------------------ requests

    def submit(self, req) -> int:
        if req.keep_kv or req.images:
            raise RequestError("engine workers serve request-level text requests (no keep_kv, no images)")
        rid = self.client.submit(req.prompt, req.sampling)
        self._gens[rid] = _Gen(list(req.prompt), time.perf_counter())
        return rid

    def has_work(self) -> bool:
        return any(g.finished is None for g in self._gens.values())

    def step(self) -> list[int]:
        """Handles of the generations that finished; waits up to `poll_s` for one if none has."""
        self._steps += 1
        deadline = time.perf_counter() + self.poll_s
        while True:
            ended = [rid for rid, g in self._gens.items() if g.finished is None and self.client.done(rid)]
            if ended or time.perf_counter() >= deadline:
                break
            time.sleep(0.002)
        for rid in ended:
            g = self._gens[rid]
            try:
                g.result = self.client.wait(rid)
            except Exception as e:  # noqa: BLE001 - delivered to the task by `get`
                g.result = e
            else:
                self._prompt_tokens += len(g.prompt)
                self._decode_tokens += len(g.result.tokens)
            g.finished = time.perf_counter()
        return ended

    def get(self, handle: int) -> SequenceOutput:
        g = self._gens[handle]
        if isinstance(g.result, BaseException):
            raise g.result
        n = len(g.prompt)
        if g.result is None:  # still generating
            return SequenceOutput(handle, Status.RUNNING, None, list(g.prompt), [False] * n, [0.0] * n,
                                  [0.0] * n, [-1] * n, n, None, None)
        r = g.result
        return SequenceOutput(
            handle, Status.FINISHED, r.finish_reason, g.prompt + list(r.tokens),
            [False] * n + [True] * len(r.tokens), [0.0] * n + list(r.logp_sample),
            [0.0] * n + list(r.logp_model), [-1] * n + list(r.versions), n, None, g.finished - g.submitted)

    def forget(self, handle: int) -> None:
        self._gens.pop(handle, None)

    def abort(self, handle: int) -> None:
        self._gens.pop(handle, None)

    def release(self, handle: int) -> None:
        pass

    def end_turn(self, handle: int) -> bool:
        """Never ends a generation early (its tokens arrive when it has finished): False, as `Engine.end_turn`
        for a turn that is not running."""
        return False

    def pin(self, handle: int) -> None:
        raise RequestError("engine workers keep no KV across turns (request-level rollout only)")

    unpin = pause = resume = pin

    # ------------------------------------------------------------------ weights, stats

    def update_params(self, params, version: int) -> None:
        self.client.update_params(params, version)
        self.version = version

    def move_to(self, model) -> None:
        raise RequestError("engine workers do not move between device meshes")

    def stats(self) -> dict:
        """The engine's counters that the rollout service reads (prefix-cache numbers are 0: each worker keeps its
        own cache and does not report it); prompt and generated tokens counted as their generations finish."""
        return {"prefix_hit_rate": 0.0, "prompt_tokens": self._prompt_tokens, "prompt_tokens_cached": 0,
                "prefill_tokens_computed": self._prompt_tokens, "decode_tokens": self._decode_tokens,
                "pages_used": 0, "steps": self._steps, "failovers": len(self.client.failovers),
                "version": self.version, "in_flight": sum(g.finished is None for g in self._gens.values())}

    def load(self) -> dict:
        """The router's reading: every generation in flight counts as running (the worker batches them itself)."""
        return dict(running=sum(g.finished is None for g in self._gens.values()), waiting=0, queued_tokens=0,
                    pinned_kv_tokens=0)

    def free_kv_tokens(self) -> int:
        return self.config.num_pages * self.config.page_size

    def num_kv_tokens(self, handle: int) -> int:
        return 0  # no KV kept across turns

    def cached_prefix_tokens(self, tokens) -> int:
        return 0
