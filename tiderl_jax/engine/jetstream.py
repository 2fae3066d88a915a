"""The JetStream engine contract (prefill / insert / generate), implemented over our paged KV pool.

JetStream (AI-Hypercomputer/JetStream, `engine_api.py`) drives an engine with three verbs over
opaque state; its PyPI release no longer runs on current JAX, so we implement the contract:

```
prefill(params, existing_prefix, tokens, true_length) -> (prefix, first_token)
        dense KV of one sequence; `existing_prefix` continues an earlier prefill (multi-turn)
insert(prefix, decode_state, slot) -> decode_state
        allocates pages for the slot and copies the prefix's KV into them
generate(params, decode_state) -> (decode_state, ResultTokens)
        one decode step for every occupied slot (feeds each slot's last token, samples the next)
```

`Engine` (engine.py), which the rest of the system uses, schedules the same device programs and
page pool directly instead of going through `prefill` + `insert`: chunked prefill writes straight
into pages, which a dense prefix followed by a copy cannot do without the extra pass. These verbs
exist for JetStream-style orchestrators and are tested to give the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiderl_jax.engine.kv_pages import PagePool
from tiderl_jax.engine.runner import ModelRunner, bucket, half_pow2_buckets, pow2_buckets
from tiderl_jax.engine.sampling import RequestError, row_keys, sample
from tiderl_jax.model.decoder import Decoder, KVCache


@flax.struct.dataclass
class Prefix:
    """One sequence's KV after prefill: k, v per layer [kv_heads, max_len, head_dim]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: int = flax.struct.field(pytree_node=False)
    first_token: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass
class DecodeState:
    """Opaque to callers: the slots' page tables, lengths and last tokens (pools live in the runner)."""

    pages: list[list[int]]
    lengths: np.ndarray  # [slots] tokens whose KV is cached
    tokens: np.ndarray  # [slots] the token to feed next
    occupied: np.ndarray  # [slots] bool
    steps: np.ndarray  # [slots] tokens sampled so far (the RNG index)


@dataclasses.dataclass(frozen=True)
class ResultTokens:
    tokens: np.ndarray  # [slots] the token sampled for each slot this step
    valid: np.ndarray  # [slots] bool: the slot was occupied
    lengths: np.ndarray  # [slots] context length after this step


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _dense_prefill(graphdef, params, prefix_k, prefix_v, prefix_len, tokens, true_length, *, max_len):
    model = nnx.merge(graphdef, params)
    cache = KVCache.init(model.cfg, 1, max_len)
    if prefix_k is not None:
        cache = cache.replace(
            k=tuple(jax.lax.dynamic_update_slice(c, p[None].astype(c.dtype), (0, 0, 0, 0))
                    for c, p in zip(cache.k, prefix_k)),
            v=tuple(jax.lax.dynamic_update_slice(c, p[None].astype(c.dtype), (0, 0, 0, 0))
                    for c, p in zip(cache.v, prefix_v)),
            lengths=jnp.full((1,), prefix_len, jnp.int32))
    t = tokens.shape[0]
    positions = (prefix_len + jnp.arange(t, dtype=jnp.int32))[None]
    logits, cache = model(tokens[None], positions, cache=cache, num_new=true_length[None])
    return tuple(k[0] for k in cache.k), tuple(v[0] for v in cache.v), logits[0, true_length - 1]


class JetStreamEngine:
    def __init__(self, model: Decoder, *, max_slots: int = 8, max_seq_len: int = 1024,
                 page_size: int = 16, num_pages: int = 1024, temperature: float = 0.0, seed: int = 0):
        self.cfg = model.cfg
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size)
        self.pool = PagePool(num_pages, page_size)
        self.page_size, self.max_seq_len, self.max_slots = page_size, max_seq_len, max_slots
        self.temperature, self.seed = temperature, seed
        self._len_buckets = pow2_buckets(16, max_seq_len)
        self._page_buckets = half_pow2_buckets(min(4, max_seq_len // page_size), max_seq_len // page_size)

    def load_params(self):
        return self.runner.params

    def init_decode_state(self) -> DecodeState:
        n = self.max_slots
        return DecodeState([[] for _ in range(n)], np.zeros(n, np.int32), np.zeros(n, np.int32),
                           np.zeros(n, bool), np.zeros(n, np.int32))

    def _sample_one(self, logits, index):
        keys = row_keys(jnp.asarray([self.seed], jnp.int32), jnp.asarray([index], jnp.int32))
        t = jnp.asarray([self.temperature], jnp.float32)
        tok, _, _ = sample(logits[None], t, jnp.zeros(1, jnp.int32), jnp.ones(1), keys, filtered=False)
        return int(tok[0])

    def prefill(self, params, existing_prefix: Prefix | None, tokens, true_length: int):
        """Prefills `tokens[:true_length]` after `existing_prefix`; returns (prefix, first_token)."""
        tokens = np.asarray(tokens, np.int32)
        start = 0 if existing_prefix is None else existing_prefix.length
        if not 0 < true_length <= len(tokens):
            raise RequestError(f"true_length={true_length} must be in [1, {len(tokens)}]")
        if start + true_length >= self.max_seq_len:
            raise RequestError(f"context {start + true_length} reaches max_seq_len {self.max_seq_len}")
        width = bucket(len(tokens), self._len_buckets)
        max_len = bucket(start + width, self._len_buckets + (self._len_buckets[-1] * 2,))
        padded = np.zeros(width, np.int32)
        padded[:len(tokens)] = tokens
        pk = pv = None
        if existing_prefix is not None:
            pk = tuple(x[:, :start] for x in existing_prefix.k)
            pv = tuple(x[:, :start] for x in existing_prefix.v)
        graphdef = self.runner.graphdef
        k, v, logits = _dense_prefill(graphdef, params, pk, pv, start, jnp.asarray(padded),
                                      jnp.asarray(true_length, jnp.int32), max_len=max_len)
        first = self._sample_one(logits, 0)
        return Prefix(k, v, start + true_length, first), first

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        for page in decode_state.pages[slot]:
            self.pool.release(page)
        n_pages = -(-(prefix.length + 1) // self.page_size)
        pages = [self.pool.allocate() for _ in range(n_pages)]
        row = np.zeros(bucket(n_pages, self._page_buckets), np.int32)
        row[:n_pages] = pages
        k = tuple(x[:, :prefix.length] for x in prefix.k)
        v = tuple(x[:, :prefix.length] for x in prefix.v)
        self.runner.write_sequence(k, v, row, prefix.length)
        decode_state.pages[slot] = pages
        decode_state.lengths[slot] = prefix.length
        decode_state.tokens[slot] = prefix.first_token
        decode_state.occupied[slot] = True
        decode_state.steps[slot] = 1
        return decode_state

    def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
        for page in decode_state.pages[slot]:
            self.pool.release(page)
        decode_state.pages[slot] = []
        decode_state.occupied[slot] = False
        return decode_state

    def generate(self, params, decode_state: DecodeState):
        ds = decode_state
        for s in np.flatnonzero(ds.occupied):
            if ds.lengths[s] + 1 >= self.max_seq_len:
                raise RequestError(f"slot {s} reached max_seq_len {self.max_seq_len}")
            while len(ds.pages[s]) * self.page_size < ds.lengths[s] + 1:
                ds.pages[s].append(self.pool.allocate())
        n = self.max_slots
        width = bucket(max(1, max(len(p) for p in ds.pages)), self._page_buckets)
        table = np.zeros((n, width), np.int32)
        for s, pages in enumerate(ds.pages):
            table[s, :len(pages)] = pages
        z = np.zeros(n, np.int32)
        temp = np.full(n, self.temperature, np.float32)
        tok, _, _, ok = self.runner.decode(
            ds.tokens.copy(), table, ds.lengths.copy(), ds.occupied.copy(), np.full(n, 1, np.int32),
            np.full((n, 1), -1, np.int32), temp, z, np.ones(n, np.float32),
            np.full(n, self.seed, np.int32), ds.steps.copy(), 1, max_steps=1, filtered=False,
            params=params)
        valid = ok[0].copy()
        ds.lengths = ds.lengths + valid
        ds.steps = ds.steps + valid
        ds.tokens = np.where(valid, tok[0], ds.tokens).astype(np.int32)
        return ds, ResultTokens(tok[0], valid, ds.lengths.copy())
