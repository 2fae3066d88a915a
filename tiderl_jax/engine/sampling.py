"""Per-request sampling on device: greedy, temperature, top-k, top-p, per-request seeds, two log-probs.

For every sampled token the engine returns its log-prob under the **sampling distribution** (after
temperature, top-k and top-p, renormalised; 0 for greedy, whose distribution is a point mass) and
under the **untempered model** (plain log-softmax of the logits). Decoupled PPO needs the first as
the behaviour policy; KL and scoring need the second.

Each row's random key is `fold_in(key(seed), index)` where index counts the tokens that sequence has
sampled so far, so a request's samples do not depend on what it was batched with, on preemption,
or on how many decode steps ran per call.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


class RequestError(ValueError):
    """One request is malformed; the engine refuses it and keeps serving the others."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    max_new_tokens: int = 64  # per turn
    stop_ids: tuple[int, ...] = ()

    def validate(self, max_stop_ids: int = 8) -> None:
        problems = []
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if len(self.stop_ids) > max_stop_ids:
            problems.append(f"{len(self.stop_ids)} stop ids; at most {max_stop_ids} are supported")
        if not 0 <= self.seed < 2**31:
            problems.append(f"seed={self.seed} must be in [0, 2**31)")
        if problems:
            raise RequestError("bad sampling parameters: " + "; ".join(problems))


def row_keys(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """seeds [b], index [b] -> one typed key per row."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, *, filtered: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [b, V] float32 -> (token [b], logp under sampling dist [b], logp under model [b]).

    `filtered` enables the top-k / top-p path (a sort over the vocabulary); without it, top_k and
    top_p are ignored, so the caller sets it whenever any row asks for them. A Python bool decides
    at trace time; a traced bool selects the path at run time (`lax.cond`), with no recompile.
    """
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]

    def top_k_top_p(scaled):
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(logits.shape[-1])[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & ((mass_before < top_p[:, None]) | (rank == 0))
        sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
        return jnp.take_along_axis(sorted_logits, jnp.argsort(order, axis=-1), axis=-1)

    if isinstance(filtered, bool):
        scaled = top_k_top_p(scaled) if filtered else scaled
    else:  # decided at run time: one compiled program serves both
        scaled = jax.lax.cond(filtered, top_k_top_p, lambda x: x, scaled)
    # Inverse-CDF draw: one uniform per row instead of one Gumbel per vocabulary entry (the
    # categorical sampler's way), which made sampling a fifth of a CPU decode step.
    lse = jax.nn.logsumexp(scaled, axis=-1)
    cdf = jnp.cumsum(jnp.exp(scaled - lse[:, None]), axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys) * cdf[:, -1]
    drawn = jnp.minimum(jnp.sum(cdf < u[:, None], axis=-1), logits.shape[-1] - 1)
    best = jax.lax.cond(greedy.any(), lambda x: jnp.argmax(x, axis=-1).astype(drawn.dtype),
                        lambda x: drawn, logits)  # argmax costs as much as the draw: skip if unused
    token = jnp.where(greedy, best, drawn).astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(x, token[:, None], axis=-1)[:, 0]  # noqa: E731
    logp_sample = jnp.where(greedy, 0.0, pick(scaled) - lse)
    logp_model = pick(logits) - jax.nn.logsumexp(logits, axis=-1)
    return token, logp_sample, logp_model


def stop_matrix(stop_ids: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Per-row stop ids padded with -1 to [b, width]."""
    return [list(s) + [-1] * (width - len(s)) for s in stop_ids]
