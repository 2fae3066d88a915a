"""Per-request sampling on device: greedy, temperature, top-k, top-p, per-request seeds, two log-probs.

For every sampled token the engine returns its log-prob under the **sampling distribution** (after
temperature, top-k and top-p, renormalised; 0 for greedy, whose distribution is a point mass) and
under the **untempered model** (plain log-softmax of the logits). Decoupled PPO needs the first as
the behaviour policy; KL and scoring need the second.

Each row's random key is `fold_in(key(seed), index)` where index counts the tokens that sequence has
sampled so far, so a request's samples do not depend on what it was batched with, on preemption,
or on how many decode steps ran per call.

Speculative decoding (`verify_drafts`) uses the key of each position's sample index the same way, for
an acceptance uniform and a draw: its tokens are not plain decoding's tokens, but every token has the
same distribution (and greedy output is the same tokens).
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


def _sampling_logits(logits, temperature, top_k, top_p, filtered):
    """logits [b, V] -> the sampling distribution's logits (tempered, top-k / top-p filtered; -inf where cut)
    and `greedy` [b]. `filtered`: see `sample`."""
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]

    def top_k_top_p(scaled):
        # The cut in sorted order gives a threshold logit; every token at or above it is kept (ties at the
        # threshold too, as transformers' filters do). One sort of the values, no argsort or un-permuting gather:
        # a third of the time on a 49k vocabulary, and less to compile.
        sorted_logits = -jnp.sort(-scaled, axis=-1)
        rank = jnp.arange(logits.shape[-1])[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & ((mass_before < top_p[:, None]) | (rank == 0))
        threshold = jnp.take_along_axis(sorted_logits, (keep.sum(axis=-1) - 1)[:, None], axis=-1)
        return jnp.where(scaled >= threshold, scaled, -jnp.inf)

    if isinstance(filtered, bool):
        scaled = top_k_top_p(scaled) if filtered else scaled
    else:  # decided at run time: one compiled program serves both
        scaled = jax.lax.cond(filtered, top_k_top_p, lambda x: x, scaled)
    return scaled, greedy


def _draw(scaled, lse, u):
    """Inverse-CDF draw of one token per row from softmax(scaled) [b, V], u [b] uniform in [0, 1): one
    uniform per row instead of one Gumbel per vocabulary entry (the categorical sampler's way), which
    made sampling a fifth of a CPU decode step.

    The draw is the first token whose cdf passes u times the mass. A token without mass (cut by top-k /
    top-p, the rejected draft in a residual) is never drawn: its cdf is taken as 0, so it passes nothing,
    not even at u == 0; and u times the mass is kept below the largest cdf, so that rounding cannot put it
    past every token."""
    p = jnp.exp(scaled - lse[:, None])
    cdf = jnp.where(p > 0, jnp.cumsum(p, axis=-1), 0.0)
    top = jnp.max(cdf, axis=-1, keepdims=True)
    return jnp.argmax(cdf > jnp.minimum(u[:, None] * top, jnp.nextafter(top, 0.0)), axis=-1)


def _uniform(keys, stream: int | None = None):
    """One uniform in [0, 1) per typed key [b] (of the key folded with `stream`, when given)."""
    if stream is not None:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)
    return jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, *, filtered: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [b, V] float32 -> (token [b], logp under sampling dist [b], logp under model [b]).

    `filtered` enables the top-k / top-p path (a sort over the vocabulary); without it, top_k and
    top_p are ignored, so the caller sets it whenever any row asks for them. A Python bool decides
    at trace time; a traced bool selects the path at run time (`lax.cond`), with no recompile.
    """
    scaled, greedy = _sampling_logits(logits, temperature, top_k, top_p, filtered)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    drawn = _draw(scaled, lse, _uniform(keys))
    best = jax.lax.cond(greedy.any(), lambda x: jnp.argmax(x, axis=-1).astype(drawn.dtype),
                        lambda x: drawn, logits)  # argmax costs as much as the draw: skip if unused
    token = jnp.where(greedy, best, drawn).astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(x, token[:, None], axis=-1)[:, 0]  # noqa: E731
    logp_sample = jnp.where(greedy, 0.0, pick(scaled) - lse)
    logp_model = pick(logits) - jax.nn.logsumexp(logits, axis=-1)
    return token, logp_sample, logp_model


def verify_uniforms(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """keys [b, K+1] (one per position: `row_keys` at the sample index of that position) -> the
    acceptance uniforms [b, K+1] and the final draw's uniforms [b, K+1] `verify_drafts` uses."""
    b, k1 = keys.shape
    flat = keys.reshape(b * k1)
    return _uniform(flat, 1).reshape(b, k1), _uniform(flat, 2).reshape(b, k1)


def verify_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array, keys: jax.Array, *, filtered
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Speculative sampling of drafted tokens against the model (exact: each emitted token has the
    sampling distribution `sample` draws from).

    logits [b, K+1, V]: the model's logits at the fed positions (the last accepted token, then the K
    drafts); drafts [b, K]; num_drafts [b] (row r's drafts beyond num_drafts[r] are padding); keys
    [b, K+1] as `verify_uniforms`. The drafter proposes one token (a point mass q), so draft j is
    accepted with probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j) (greedy: iff it is the argmax);
    at the first rejection the token is drawn from the residual max(0, p - q) normalised, which is p
    without d_j (greedy: the argmax); when every draft is accepted, a bonus token is drawn from p_K.
    Returns tokens [b, K+1] (the first num_emitted valid), their log-probs under the sampling
    distribution (0 for greedy) and under the model, and num_emitted [b] = accepted drafts + 1.
    """
    b, k1, v = logits.shape
    k = k1 - 1
    rep = lambda x: jnp.repeat(x, k1, axis=0)  # noqa: E731  per row -> per (row, position)
    flat = logits.reshape(b * k1, v)
    scaled, greedy = _sampling_logits(flat, rep(temperature), rep(top_k), rep(top_p), filtered)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    logp_s = (scaled - lse[:, None]).reshape(b, k1, v)
    logp_m = (flat - jax.nn.logsumexp(flat, axis=-1)[:, None]).reshape(b, k1, v)
    greedy = greedy.reshape(b, k1)[:, 0]
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b, K+1]
    u_acc, u_draw = verify_uniforms(keys)
    d = drafts.astype(jnp.int32)
    lp_d = jnp.take_along_axis(logp_s[:, :k], d[..., None], axis=-1)[..., 0]  # [b, K]
    accept = jnp.where(greedy[:, None], argmax[:, :k] == d, u_acc[:, :k] < jnp.exp(lp_d))
    accept &= jnp.arange(k)[None, :] < num_drafts[:, None]
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [b]
    at = lambda x: jnp.take_along_axis(x, n_acc[:, None], axis=1)[:, 0]  # noqa: E731  position n_acc
    final = jnp.take_along_axis(scaled.reshape(b, k1, v), n_acc[:, None, None], axis=1)[:, 0]  # [b, V]
    d_at = at(jnp.concatenate([d, jnp.full((b, 1), -1, jnp.int32)], axis=1))
    rejected = n_acc < num_drafts
    residual = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == d_at[:, None]), -jnp.inf, final)
    residual = jnp.where(jnp.isfinite(residual).any(axis=-1, keepdims=True), residual, final)
    drawn = _draw(residual, jax.nn.logsumexp(residual, axis=-1), at(u_draw)).astype(jnp.int32)
    last = jnp.where(greedy, at(argmax), drawn)
    pos = jnp.arange(k1)[None, :]
    tokens = jnp.where(pos < n_acc[:, None], jnp.concatenate([d, jnp.zeros((b, 1), jnp.int32)], axis=1),
                       last[:, None])
    pick = lambda lp: jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]  # noqa: E731
    lps = jnp.where(greedy[:, None], 0.0, pick(logp_s))
    return tokens, lps, pick(logp_m), n_acc + 1


def stop_matrix(stop_ids: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Per-row stop ids padded with -1 to [b, width]."""
    return [list(s) + [-1] * (width - len(s)) for s in stop_ids]
