"""GRPO groups that share their prompt, trained prompt-once (LongStraw inside the trainer).

`TrainerConfig.shared_prompt` ("off" | "exact" | "approximate"). With it on, `Trainer.rl_step` splits
the step's trajectories (`split`):

- a **shared group** is a GRPO group (`Trajectory.group`) of at least two text-only samples whose
  common token prefix, cut at the first model-generated token of any member, is at least
  `shared_prompt_min_tokens` long. That prefix is the group's prompt; everything after it (the first
  answer, later turns' observations, later answers) is each sample's response, so multi-turn
  trajectories share their first prompt and their later turns are part of the response;
- every other trajectory is packed into rows as before.

A shared group is scored (proximal and reference log-probs) by running its prompt once and replaying
each response on the prompt's K/V without a graph (`longstraw.group_logprobs`), and trained by the
prompt-once gradient (`longstraw.group_gradient`): `exact` pulls the responses' K/V cotangents back
through the prompt once (equal to the packed gradient up to float rounding), `approximate` holds the
prompt state constant (the paper's mode: no gradient through the prompt's own tokens). Each
response's per-token loss is `losses.total_loss` with the whole step's token and sequence counts, so
the sum over packed micro-batches and shared responses is exactly the packed path's loss, whatever
the aggregation (for "constant" with `norm_len` unset, the packed rows' length `row_len` is the
normaliser in both).

Shapes: a group's prompt is right-padded to a length bucket (`prompt_bucket`: a multiple of a
quarter of the next power of two, at least 16, so at most ~25% padding, and divisible by any context
parallelism up to 16; the padding is never attended to) and its responses to the next power of two of
the longest. Groups with the same (prompt bucket, G, response bucket) are stacked and scanned over in
one program, so a step compiles one program per shape class, not per group.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.buckets import next_pow2
from tiderl_jax.rl import losses
from tiderl_jax.rl.longstraw import group_gradient, group_logprobs

MODES = ("off", "exact", "approximate")
# Per-token arrays of a stacked shape class, each [groups, G, R] ("responses" int32, the rest float32);
# the trainer adds "proximal_logp" and, with a reference model, "ref_logp" when it scores them.
PER_TOKEN = ("responses", "mask", "behaviour_logp", "advantages")


def prompt_bucket(n: int) -> int:
    """The padded prompt length: n rounded up to a multiple of max(16, next_pow2(n) / 4)."""
    step = max(16, next_pow2(n) // 4)
    return -(-n // step) * step


def response_bucket(n: int) -> int:
    return max(8, next_pow2(n))


def shared_prefix(trajectories: Sequence[Trajectory]) -> int:
    """Length of the members' common token prefix, cut at the first model-generated token of any member."""
    first = min(t.loss_mask.index(True) if any(t.loss_mask) else len(t.tokens) for t in trajectories)
    n = min(first, min(len(t.tokens) for t in trajectories))
    head = np.asarray(trajectories[0].tokens[:n])
    for t in trajectories[1:]:
        differ = np.nonzero(np.asarray(t.tokens[:n]) != head)[0]
        if differ.size:
            n = int(differ[0])
            head = head[:n]
    return n


@dataclasses.dataclass
class SharedGroup:
    members: list[int]  # indices into the trajectory list, in the order of the group's rows
    prompt_len: int
    shape: tuple[int, int, int]  # (prompt bucket, G, response bucket): its shape class


@dataclasses.dataclass
class SharedBatch:
    """The step's shared groups, stacked by shape class. `classes[c]` maps "prompt" [n, P], "length" [n]
    and the `PER_TOKEN` arrays [n, G, R] (scoring fills proximal / ref log-probs and advantages)."""

    groups: list[SharedGroup]
    classes: list[dict[str, np.ndarray]]
    where: dict[int, tuple[int, int, int]]  # trajectory index -> (class, group in class, row)

    @property
    def num_sequences(self) -> int:
        return len(self.where)

    @property
    def num_tokens(self) -> float:
        return float(sum(c["mask"].sum() for c in self.classes))

    def per_token(self, name: str, index: int, length: int) -> np.ndarray:
        """Trajectory `index`'s response part of array `name` (its first `length` tokens after the prompt)."""
        c, i, g = self.where[index]
        return self.classes[c][name][i, g, :length]

    def fill(self, name: str, index: int, values: np.ndarray) -> None:
        c, i, g = self.where[index]
        self.classes[c][name][i, g, :len(values)] = values


def split(trajectories: Sequence[Trajectory], candidates: Sequence[int], *, min_tokens: int,
          max_response: int) -> tuple[SharedBatch, list[int]]:
    """(the shared groups among `candidates`, the candidate indices left to the packed path).

    A group is shared when it has >= 2 members, none with images, each with a model-generated token,
    a shared prefix of >= max(1, min_tokens) tokens, and every response at most `max_response` tokens
    (the trainer's row length: what it trains a sequence of at most)."""
    by_group: dict[int, list[int]] = {}
    for i in candidates:
        by_group.setdefault(trajectories[i].group, []).append(i)
    groups, rest = [], []
    for members in by_group.values():
        ts = [trajectories[i] for i in members]
        ok = len(ts) >= 2 and not any(t.images for t in ts) and all(any(t.loss_mask) for t in ts)
        p = shared_prefix(ts) if ok else 0
        if not ok or p < max(1, min_tokens) or max(len(t.tokens) for t in ts) - p > max_response:
            rest.extend(members)
            continue
        shape = (prompt_bucket(p), len(ts), response_bucket(max(len(t.tokens) for t in ts) - p))
        groups.append(SharedGroup(members, p, shape))
    shapes = sorted({g.shape for g in groups})
    classes, where = [], {}
    for c, shape in enumerate(shapes):
        members = [g for g in groups if g.shape == shape]
        pb, gsize, rb = shape
        arrays = {"prompt": np.zeros((len(members), pb), np.int32), "length": np.zeros(len(members), np.int32)}
        for name in PER_TOKEN:
            arrays[name] = np.zeros((len(members), gsize, rb), np.int32 if name == "responses" else np.float32)
        for i, g in enumerate(members):
            arrays["prompt"][i, :g.prompt_len] = trajectories[g.members[0]].tokens[:g.prompt_len]
            arrays["length"][i] = g.prompt_len
            for row, j in enumerate(g.members):
                t, p = trajectories[j], g.prompt_len
                n = len(t.tokens) - p
                mask = np.asarray(t.loss_mask[p:], np.float32)
                arrays["responses"][i, row, :n] = t.tokens[p:]
                arrays["mask"][i, row, :n] = mask
                arrays["behaviour_logp"][i, row, :n] = np.where(mask > 0, t.logprobs[p:], 0.0)
                where[j] = (c, i, row)
        classes.append(arrays)
    return SharedBatch(groups, classes, where), rest


@dataclasses.dataclass(frozen=True)
class ResponseLoss:
    """`losses.total_loss` of one response, normalised by the whole step's counts: the internal
    `longstraw` loss protocol (logp, entropy, mask, extra) -> (loss, metrics). Hashable (a static
    argument of the compiled step)."""

    config: losses.LossConfig
    decoupled: bool

    def __call__(self, logp, entropy, mask, extra):
        # no proximal log-probs: they are this forward's own (rl/trainer.py: the step's weights)
        proximal = extra["proximal_logp"] if "proximal_logp" in extra else jax.lax.stop_gradient(logp)
        batch = {"mask": mask[None], "advantages": extra["advantages"][None], "proximal_logp": proximal[None]}
        if self.decoupled:
            batch["behaviour_logp"] = extra["behaviour_logp"][None]
        if "ref_logp" in extra:
            batch["ref_logp"] = extra["ref_logp"][None]
        return losses.total_loss(self.config, batch, logp[None], entropy=entropy[None],
                                 num_tokens=extra["num_tokens"], num_sequences=extra["num_sequences"])


def score_classes(graphdef, temperature: float, params, classes):
    """Per-token log-probs [n, G, R] of each shape class's responses under `params`, no graph."""
    return [jax.lax.map(lambda grp: group_logprobs(graphdef, params, grp["prompt"], grp["length"],
                                                   grp["responses"], temperature),
                        {k: c[k] for k in ("prompt", "length", "responses")}) for c in classes]


def class_gradients(graphdef, loss_fn: ResponseLoss, mode: str, temperature: float, params, classes,
                    num_tokens, num_sequences):
    """Summed float32 gradients of every shared group's responses, and their metrics (each [responses]).
    `classes`: the stacked arrays with "proximal_logp", "advantages" (and "ref_logp" when scored)."""
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    metrics = []
    for c in classes:
        def body(acc, grp):
            extra = {k: grp[k] for k in ("advantages", "proximal_logp", "behaviour_logp", "ref_logp") if k in grp}
            g_size = grp["responses"].shape[0]
            extra.update(num_tokens=jnp.broadcast_to(num_tokens, (g_size,)),
                         num_sequences=jnp.broadcast_to(num_sequences, (g_size,)))
            _, grads, aux = group_gradient(graphdef, params, grp["prompt"], grp["length"], grp["responses"],
                                           grp["mask"], extra, loss_fn=loss_fn, mode=mode, temperature=temperature)
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), aux
        acc, aux = jax.lax.scan(body, acc, c)
        metrics.append(jax.tree.map(lambda x: x.reshape(-1), aux))
    return acc, metrics
