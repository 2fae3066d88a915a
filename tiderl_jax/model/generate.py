"""Reference generation over the dense KV cache: prefill a padded batch, then decode in one jitted scan.

This is the simple, obviously-correct generator: the rollout engine (paged cache, continuous
batching) is tested against it, and the main job uses it until the engine exists. Prompts are
right-padded to a bucket length; each row's real length drives where its cache writes go, so ragged
batches give the same tokens as one-at-a-time generation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiderl_jax.model.decoder import Decoder, KVCache


def _bucket(n: int, multiple: int = 16) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def sample_logits(logits: jax.Array, rng: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """logits [b, vocab] -> (token [b], its log-prob under the sampling distribution [b]).

    temperature == 0 is greedy (log-prob under the untempered model).
    """
    if temperature == 0.0:
        logp = jax.nn.log_softmax(logits, axis=-1)
        token = jnp.argmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        token = jax.random.categorical(rng, logp, axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "temperature"))
def _prefill(graphdef, state, tokens, lengths, rng, *, max_len, temperature):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    cache = KVCache.init(model.cfg, b, max_len)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, cache = model(tokens, positions, cache=cache, num_new=lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    token, logp = sample_logits(last, rng, temperature)
    return cache, token, logp


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature"))
def _decode(graphdef, state, cache, first, rng, stop_ids, pad_id, *, steps, temperature):
    model = nnx.merge(graphdef, state)

    def step(carry, key):
        cache, token, done = carry
        logits, cache = model(token[:, None], cache.lengths[:, None], cache=cache)
        nxt, logp = sample_logits(logits[:, 0], key, temperature)
        nxt = jnp.where(done, pad_id, nxt)
        done = done | jnp.isin(nxt, stop_ids)
        return (cache, nxt, done), (nxt, logp)

    done0 = jnp.isin(first, stop_ids)
    (_, _, _), (tokens, logps) = jax.lax.scan(step, (cache, first, done0), jax.random.split(rng, steps))
    return tokens.T, logps.T  # [b, steps]


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: list[list[int]]  # per prompt, the new tokens up to and including the first stop token
    logprobs: list[list[float]]  # per new token, log-prob under the sampling distribution


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 1.0, seed: int = 0, stop_ids: Sequence[int] = (),
             pad_id: int = 0) -> Generation:
    """Samples up to `max_new_tokens` for each prompt (greedy when temperature == 0)."""
    if not prompts:
        return Generation([], [])
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    limit = model.cfg.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} "
                             f"it exceeds the model's context of {limit} tokens")
        bad = [t for t in p if not 0 <= t < model.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token ids {bad[:4]} outside [0, {model.cfg.vocab_size})")
    t = _bucket(max(len(p) for p in prompts))
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    graphdef, state = nnx.split(model)
    k_prefill, k_decode = jax.random.split(jax.random.key(seed))
    max_len = _bucket(t + max_new_tokens)
    cache, first, first_logp = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths),
                                        k_prefill, max_len=max_len, temperature=float(temperature))
    out = np.asarray(first)[:, None]
    logps = np.asarray(first_logp)[:, None]
    if max_new_tokens > 1:
        rest, rest_logp = _decode(graphdef, state, cache, first, k_decode,
                                  jnp.asarray(list(stop_ids) or [-1], jnp.int32), pad_id,
                                  steps=max_new_tokens - 1, temperature=float(temperature))
        out = np.concatenate([out, np.asarray(rest)], axis=1)
        logps = np.concatenate([logps, np.asarray(rest_logp)], axis=1)
    stops = set(stop_ids)
    result_tokens, result_logps = [], []
    for row, lrow in zip(out.tolist(), logps.tolist()):
        n = next((j + 1 for j, tok in enumerate(row) if tok in stops), len(row))
        result_tokens.append(row[:n])
        result_logps.append(lrow[:n])
    return Generation(result_tokens, result_logps)
