"""`top_logprobs`: the k most likely next tokens at each position of a context, from one full forward.

The engine samples one token per step and keeps two log-probs of it (`engine/sampling.py`), not a top-k, so the
server asks the serving engine's current weights for the whole distribution once per request that wants it:
a jitted full-sequence forward of the context (padded to a power-of-two bucket: one program per bucket),
log-softmax, `lax.top_k`. Log-probs are the untempered model's, as `logprob` is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiderl_jax.engine.buckets import bucket, pow2_buckets

MAX_K = 20  # OpenAI's top_logprobs limit: one program serves every k <= 20


def _top(graphdef, params, tokens, positions, *, k):
    model = nnx.merge(graphdef, params)
    logits, _ = model(tokens, positions)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jax.lax.top_k(lp, k)


class TopLogprobs:
    def __init__(self):
        self._fn = jax.jit(_top, static_argnames=("graphdef", "k"))

    @functools.cached_property
    def _buckets(self):
        return pow2_buckets(64, 1 << 20)

    def __call__(self, engine, tokens, start: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n, k], log-probs [n, k]) of the next token after each of `tokens[start:]` (given all before)."""
        n = len(tokens)
        width = bucket(n, self._buckets)
        ids = np.zeros((1, width), np.int32)
        ids[0, :n] = tokens
        pos = np.arange(width, dtype=np.int32)[None]
        runner = engine.runner
        vals, idx = self._fn(runner.graphdef, runner.params, ids, pos, k=MAX_K)
        return np.asarray(idx[0, start:n, :k]), np.asarray(vals[0, start:n, :k])
