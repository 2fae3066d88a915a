"""The engine's request and sequence records: `Request` (what a caller submits), `Status`, `_Seq` (the engine's
per-sequence state) and `SequenceOutput` (what `Engine.get` returns). `engine.py` re-exports them."""

from __future__ import annotations

import dataclasses
import enum
from typing import Hashable, Sequence

from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.vision import ImageSpan


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    sampling: SamplingParams = SamplingParams()
    priority: float = 0.0  # higher is kept longer under memory pressure
    keep_kv: bool = False  # at the end of a turn, pause with KV kept (for resume) instead of finishing
    images: Sequence[ImageSpan] = ()  # images among the prompt tokens (offsets into `prompt`)
    # Sampling index of the first token to generate: a continuation of a generation that sampled
    # n tokens elsewhere (a token checkpoint, `faults/engine_worker.py`) passes n, so its tokens
    # draw the same random keys as the uninterrupted generation would have.
    sample_offset: int = 0
    # What the speculative drafter drafts this sequence from (engine/speculation.py): sequences under one key
    # (a task: its GRPO group and its earlier epochs) share one suffix index. None: its own, shared with the
    # other samples of its `submit_group`.
    draft_key: Hashable | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass
class _Seq:
    id: int
    tokens: list[int]
    model_mask: list[bool]  # True where the engine generated the token
    logp_sample: list[float]  # per token (0.0 where not generated)
    logp_model: list[float]
    versions: list[int]  # policy version that generated each token (-1 where not generated)
    sampling: SamplingParams
    priority: float
    keep_kv: bool
    arrival: int
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in `pages`
    pages: list[int] = dataclasses.field(default_factory=list)
    block_keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of registered full blocks
    images: list[ImageSpan] = dataclasses.field(default_factory=list)  # absolute offsets, in order
    turn_start: int = 0  # index of the first token of the current turn's context addition
    turn_generated: int = 0
    num_sampled: int = 0  # all tokens ever sampled (the RNG index)
    pinned: bool = False
    parent: int | None = None  # group leader whose prompt pages this sample forks
    looked_up: bool = False  # prefix cache consulted since the last (re)admission
    finish_reason: str | None = None
    draft_key: Hashable | None = None  # its suffix index in the drafter
    indexed: int = 0  # tokens of it the drafter has indexed
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclasses.dataclass(frozen=True)
class SequenceOutput:
    handle: int
    status: Status
    finish_reason: str | None
    tokens: list[int]  # the whole context: prompt, generated and resumed tokens
    model_mask: list[bool]
    logp_sample: list[float]
    logp_model: list[float]
    versions: list[int]
    turn_start: int  # where the current (or last) turn's context began
    ttft_s: float | None
    latency_s: float | None
    images: tuple[ImageSpan, ...] = ()  # the context's images (offsets into `tokens`)

    @property
    def new_tokens(self) -> list[int]:
        """The tokens generated in the current (or last) turn."""
        return [t for t, m in zip(self.tokens[self.turn_start:], self.model_mask[self.turn_start:]) if m]
