"""A multi-turn trajectory: what the trainer consumes, serialisable to disk and back.

Per token: `tokens`, `loss_mask` (True only for tokens the model generated, never prompt or
observation tokens), `logprobs` (behaviour log-probs under the sampling distribution),
`model_logprobs` (untempered) and `versions` (policy version that generated it, -1 elsewhere).
Per turn: the [start, end) token span the model generated, the seconds spent generating and in
the environment, and its tool calls (how many, how many errored, whether the markup was malformed).
Per task: reward, the end reason and, for a failed task, what failed.

Images (a vision model's observations): `images` holds each image's `vision.ImageSpan` with its
absolute offset in `tokens` (the same spans the engine was given), so a training forward rebuilds
the model's exact inputs (`vision.dense_inputs`). On disk a span is its offset, its patches' shape
and their float32 bytes in base64 (exact). `ImageSpan` compares by identity: compare trajectories
with images through `to_dict()`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from tiderl_jax.model.vision import ImageSpan

END_REASONS = ("answered", "max_turns", "context_limit", "env_error", "env_timeout", "engine_error", "agent_error",
               "agent_timeout")


@dataclasses.dataclass
class Turn:
    start: int  # first generated token of the turn
    end: int  # one past its last generated token
    generate_s: float
    env_s: float
    malformed: bool = False  # its tool-call markup did not parse
    tool_calls: int = 0  # tool calls it made
    tool_errors: int = 0  # of those, how many errored (unknown tool, refused arguments, the tool raised)


@dataclasses.dataclass
class Trajectory:
    task_id: str
    kind: str
    group: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model_logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    images: list[ImageSpan] = dataclasses.field(default_factory=list)  # absolute offsets, in order
    reward: float = 0.0
    end_reason: str = ""
    failure: str | None = None  # for failed tasks: what failed, for the log and the metrics
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def extend(self, tokens, *, generated: bool, logprobs=None, model_logprobs=None, versions=None,
               images: Sequence[ImageSpan] = ()):
        """Appends tokens; `images` are the images among them (offsets into `tokens`)."""
        n = len(tokens)
        self.images.extend(im.shifted(len(self.tokens)) for im in images)
        self.tokens.extend(int(t) for t in tokens)
        self.loss_mask.extend([generated] * n)
        self.logprobs.extend(list(logprobs) if generated else [0.0] * n)
        self.model_logprobs.extend(list(model_logprobs) if generated else [0.0] * n)
        self.versions.extend(list(versions) if generated else [-1] * n)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def oldest_version(self) -> int:
        """The oldest policy version among the model's tokens (-1 when it has none)."""
        return min((v for v, m in zip(self.versions, self.loss_mask) if m and v >= 0), default=-1)

    def model_version_counts(self) -> dict[int, int]:
        """Model tokens per policy version that generated them."""
        counts: dict[int, int] = {}
        for v, m in zip(self.versions, self.loss_mask):
            if m:
                counts[v] = counts.get(v, 0) + 1
        return counts

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, images=[]))
        d["images"] = [{"offset": im.offset, "shape": list(im.patches.shape),
                        "float32": base64.b64encode(im.patches.astype("<f4").tobytes()).decode("ascii")}
                       for im in self.images]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        d = dict(d)
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        d["images"] = [ImageSpan(im["offset"], np.frombuffer(base64.b64decode(im["float32"]), "<f4")
                                 .reshape(im["shape"])) for im in d.get("images", [])]
        return cls(**d)


def save_trajectories(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """One JSON object per line; written to a temporary file and renamed, so a crash loses nothing."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict()) + "\n")
    os.replace(tmp, path)


def load_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]
