"""From trajectories to the trainer's packed batch (host side, numpy).

Trajectories are packed into rows of `row_len` tokens, first-fit decreasing, each one a segment
with its own `segment_ids` value (1, 2, ... within a row; 0 is padding) and positions restarting at
0, so attention never crosses trajectories. Rows are grouped into micro-batches: every array is
`[num_micro, micro_rows, row_len]`, the leading axis is what gradient accumulation scans over.
`num_micro` is rounded up to a power of two or 1.5 times one (1, 2, 3, 4, 6, 8, 12, ...: padding micro-batches
cost as much as full ones, so these waste at most a third where powers of two wasted up to half) and `row_len`
is fixed by the config, so a run compiles a handful of programs, not one per batch.

Per token: `tokens`, `positions`, `segment_ids`, `mask` (1.0 on the model-generated tokens that are
trained; logp[t] is the log-probability of token t given the tokens before it, so the mask is the
trajectory's own loss mask), `behaviour_logp` (from the engine). Scoring adds `proximal_logp` and
`ref_logp`; `advantages` are filled from sequence advantages by `fill_per_sequence`.

Images: when some packed trajectory holds images (a vision model's rollouts), two more arrays carry
them, `patches [num_micro, micro_rows, row_len, patch_dim]` (float32, zeros off images) and
`patch_index [num_micro, micro_rows, row_len]` (each patch's index in its image, -1 elsewhere), as
`vision.dense_inputs` builds them; `pack` needs the model's `patch_dim` for that. Batches without
images have neither array. A trajectory whose images do not match `patch_dim` (or any image with
`patch_dim=0`, a text-only model) is left out and reported like an overlong one.

A trajectory longer than `row_len` cannot be trained on without cutting its context: it is left
out and reported in `dropped` (index, reason), never silently truncated and never an exception
that ends the run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.buckets import next_pow2
from tiderl_jax.model import vision


@dataclasses.dataclass
class PackedBatch:
    arrays: dict[str, np.ndarray]  # name -> [num_micro, micro_rows, row_len]
    placements: list[tuple[int, int, int, int]]  # per kept sequence: (micro, row, start, length)
    kept: list[int]  # indices (into the input) of the packed sequences, in placement order
    dropped: list[tuple[int, str]]  # (index, reason) of sequences left out

    @property
    def num_sequences(self) -> int:
        return len(self.kept)

    @property
    def num_tokens(self) -> int:
        return int(self.arrays["mask"].sum())

    def per_token(self, name: str, index: int) -> np.ndarray:
        """The slice of array `name` that belongs to the kept sequence number `index`."""
        m, r, s, n = self.placements[index]
        return self.arrays[name][m, r, s:s + n]

    def fill_per_sequence(self, name: str, values: Sequence[float]) -> None:
        """Sets array `name` to each kept sequence's value on its trained tokens (0 elsewhere)."""
        out = np.zeros_like(self.arrays["mask"])
        for (m, r, s, n), v in zip(self.placements, values):
            out[m, r, s:s + n] = v * self.arrays["mask"][m, r, s:s + n]
        self.arrays[name] = out


def first_fit_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Positions into `lengths` per row: first-fit decreasing into rows of `row_len` tokens (longest
    first, equal lengths in their order). Every length must fit a row."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for r, u in enumerate(used):
            if u + n <= row_len:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    return rows


def num_micro_batches(num_rows: int, micro_rows: int, min_micro: int = 1) -> int:
    """Micro-batches of `micro_rows` rows that hold `num_rows` rows, rounded up to a power of two or 1.5 times
    one (1, 2, 3, 4, 6, 8, 12, ...; one compiled train program per count)."""
    n = max(min_micro, -(-num_rows // micro_rows))
    p = next_pow2(n)
    return p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


def pack(sequences: Sequence[Trajectory], *, row_len: int, micro_rows: int,
         min_micro: int = 1, patch_dim: int = 0) -> PackedBatch:
    """Packs trajectories (first-fit decreasing) into `[num_micro, micro_rows, row_len]` arrays.

    `patch_dim`: the model's `image_patch_dim` (0: text-only), for trajectories with images."""
    dropped, order = [], []
    for i, t in enumerate(sequences):
        dims = {im.patches.shape[1] for im in t.images}
        if len(t.tokens) > row_len:
            dropped.append((i, f"{len(t.tokens)} tokens exceed the trainer's row length {row_len}"))
        elif not any(t.loss_mask):
            dropped.append((i, "no model-generated tokens to train on"))
        elif dims - {patch_dim}:
            dropped.append((i, f"images with patches of {sorted(dims)} values do not fit the model's "
                               f"patch_dim {patch_dim}"))
        else:
            order.append(i)
    rows = [[order[j] for j in row]  # sequence indices per row
            for row in first_fit_rows([len(sequences[i].tokens) for i in order], row_len)]
    num_micro = num_micro_batches(len(rows), micro_rows, min_micro)
    shape = (num_micro, micro_rows, row_len)
    arrays = {"tokens": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
              "segment_ids": np.zeros(shape, np.int32), "mask": np.zeros(shape, np.float32),
              "behaviour_logp": np.zeros(shape, np.float32)}
    if any(sequences[i].images for i in order):
        arrays["patches"] = np.zeros(shape + (patch_dim,), np.float32)
        arrays["patch_index"] = np.full(shape, -1, np.int32)
    placements, kept = [], []
    for r, members in enumerate(rows):
        m, row = divmod(r, micro_rows)
        start = 0
        for seg, i in enumerate(members, start=1):
            t = sequences[i]
            n = len(t.tokens)
            sl = (m, row, slice(start, start + n))
            arrays["tokens"][sl] = t.tokens
            arrays["positions"][sl] = np.arange(n)
            arrays["segment_ids"][sl] = seg
            arrays["mask"][sl] = np.asarray(t.loss_mask, np.float32)
            arrays["behaviour_logp"][sl] = np.where(t.loss_mask, t.logprobs, 0.0)
            if t.images:
                arrays["patches"][sl], arrays["patch_index"][sl] = vision.dense_inputs(
                    t.images, 0, n, patch_dim)
            placements.append((m, row, start, n))
            kept.append(i)
            start += n
    return PackedBatch(arrays, placements, kept, dropped)
