"""The engine's device programs: chunked prefill and multi-step decode over the paged KV pool.

Three jitted programs, each compiled once per padded shape bucket so a steady-state run never
recompiles (`compile_count` lets tests check it):

- `prefill(tokens [N], rows [B], chunk [T], pages [P])`: the rows' new tokens packed back to back (ragged: N
  is a bucket of their sum, so the projections and the MLP compute no row or chunk padding; the attention runs
  in the [B, T] view, `PagedKV`), writes up to T new tokens per row into its pages, computes logits only at
  each row's last real token, and samples a token there (used only when the chunk completes the row's
  context); a vision model's prefill also takes the chunk's image inputs (patches [1, N, patch_dim],
  patch_index [1, N], packed the same way), a text-only model's program has no such inputs;
- `decode(rows [S], pages [P])`: up to K decode steps in one call (a `while` loop on device with a
  dynamic trip count), each feeding every live row its last token, writing its KV and sampling the
  next; rows stop on their stop ids or remaining budget. Multi-step decode removes the host round
  trip between steps when no scheduling event is pending;
- `verify(rows [S], 1 + K tokens, pages [P])`: speculative decoding (WAR): each row feeds its last
  token and up to K drafted tokens, writes their KV, and `sampling.verify_drafts` accepts a prefix of
  the drafts and draws one more token, exactly as plain sampling would distribute them.

Pools are donated to every call and replaced by the results, so pages are updated in place.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from tiderl_jax.engine.buckets import bucket, half_pow2_buckets, pow2_buckets  # noqa: F401 (re-exported)
from tiderl_jax.engine.paged_attention import HEADS, POOL_AXES, PagedKV, pool_layout, resolve_impl, write_pages
from tiderl_jax.engine.sampling import row_keys, sample, verify_drafts
from tiderl_jax.model.decoder import Decoder, split_adapters
from tiderl_jax.model.sharding import place_copy, spec_for


def _prefill_program(graphdef, params, k_pages, v_pages, tokens, positions, unpack, pack, last, page_table, starts,
                     num_new, temperature, top_k, top_p, seeds, sample_index, filtered, patches=None,
                     patch_index=None, *, impl):
    model = nnx.merge(graphdef, params)
    cache = PagedKV(k_pages, v_pages, page_table, starts, num_new, impl=impl, unpack=unpack, pack=pack)
    hidden, cache = model(tokens, positions, cache=cache, num_new=num_new, patches=patches,
                          patch_index=patch_index, return_hidden=True)
    logits = model.logits(hidden[0, last][:, None])[:, 0]  # at each row's last packed token
    token, lp_sample, lp_model = sample(logits, temperature, top_k, top_p,
                                        row_keys(seeds, sample_index), filtered=filtered)
    return cache.k_pages, cache.v_pages, token, lp_sample, lp_model


def _decode_program(graphdef, params, k_pages, v_pages, tokens, page_table, starts, live,
                    remaining, stop_ids, temperature, top_k, top_p, seeds, sample_index, filtered,
                    num_steps, *, max_steps, impl):
    model = nnx.merge(graphdef, params)
    s = tokens.shape[0]
    out_tok = jnp.zeros((max_steps, s), jnp.int32)
    out_lps = jnp.zeros((max_steps, s), jnp.float32)
    out_lpm = jnp.zeros((max_steps, s), jnp.float32)
    out_ok = jnp.zeros((max_steps, s), bool)

    def body(i, carry):
        cache, tok, live, rem, idx, out_tok, out_lps, out_lpm, out_ok = carry
        n = live.astype(jnp.int32)
        cache = cache.replace(num_new=n)
        hidden, cache = model(tok[:, None], cache.starts[:, None], cache=cache, num_new=n,
                              return_hidden=True)
        logits = model.logits(hidden)[:, 0]
        nxt, lps, lpm = sample(logits, temperature, top_k, top_p, row_keys(seeds, idx),
                               filtered=filtered)
        out_tok = out_tok.at[i].set(nxt)
        out_lps = out_lps.at[i].set(lps)
        out_lpm = out_lpm.at[i].set(lpm)
        out_ok = out_ok.at[i].set(live)
        rem = rem - n
        stopped = (nxt[:, None] == stop_ids).any(axis=-1) | (rem <= 0)
        return (cache, jnp.where(live, nxt, tok), live & ~stopped, rem, idx + n,
                out_tok, out_lps, out_lpm, out_ok)

    cache = PagedKV(k_pages, v_pages, page_table, starts, live.astype(jnp.int32), impl=impl)
    carry = (cache, tokens, live, remaining, sample_index, out_tok, out_lps, out_lpm, out_ok)
    carry = jax.lax.fori_loop(0, num_steps, body, carry)
    cache = carry[0]
    return cache.k_pages, cache.v_pages, carry[5], carry[6], carry[7], carry[8]


def _verify_program(graphdef, params, k_pages, v_pages, tokens, page_table, starts, num_drafts, live,
                    temperature, top_k, top_p, seeds, sample_index, filtered, *, impl):
    model = nnx.merge(graphdef, params)
    s, k1 = tokens.shape
    positions = starts[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    num_new = jnp.where(live, num_drafts + 1, 0)
    cache = PagedKV(k_pages, v_pages, page_table, starts, num_new, impl=impl)
    hidden, cache = model(tokens, positions, cache=cache, num_new=num_new, return_hidden=True)
    logits = model.logits(hidden)  # [S, 1 + K, V]
    index = sample_index[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    keys = row_keys(jnp.repeat(seeds, k1), index.reshape(-1)).reshape(s, k1)
    tok, lps, lpm, emitted = verify_drafts(logits, tokens[:, 1:], num_drafts, temperature, top_k, top_p,
                                           keys, filtered=filtered)
    return cache.k_pages, cache.v_pages, tok, lps, lpm, jnp.where(live, emitted, 0)


def _write_sequence(k_pages, v_pages, k, v, page_row, length, *, layout):
    """Copies one sequence's dense KV (per layer [kv, L, d]) into its pages (page_row [P])."""
    table, start, n = page_row[None], jnp.zeros((1,), jnp.int32), length[None]
    new_k = tuple(write_pages(kp, x.transpose(1, 0, 2)[None], table, start, n, layout) for kp, x in zip(k_pages, k))
    new_v = tuple(write_pages(vp, x.transpose(1, 0, 2)[None], table, start, n, layout) for vp, x in zip(v_pages, v))
    return new_k, new_v


class ModelRunner:
    """Owns the parameters and the page pools on the engine's devices; runs the two programs."""

    def __init__(self, model: Decoder, *, num_pages: int, page_size: int, attention_impl: str = "auto",
                 max_stop_ids: int = 8):
        cfg = model.cfg
        self.max_stop_ids = max_stop_ids
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        act = model.activation_sharding
        self.impl = resolve_impl(attention_impl, dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=page_size)
        self.layout = pool_layout(self.impl)
        self.graphdef, self.params = nnx.split(model)
        shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        if self.layout == HEADS:
            shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        if act is not None:
            spec = spec_for(shape, POOL_AXES[self.layout], act.rules, act.mesh)
            self.pool_sharding = NamedSharding(act.mesh, spec)
            self.param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        else:
            self.pool_sharding = SingleDeviceSharding(jax.local_devices()[0])
            self.param_shardings = None
        self._zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(cfg.dtype)), out_shardings=self.pool_sharding)
        self.k_pages, self.v_pages = self._new_pools()
        self._write = jax.jit(functools.partial(_write_sequence, layout=self.layout),
                              donate_argnames=("k_pages", "v_pages"))
        self._prefill = jax.jit(_prefill_program, static_argnames=("graphdef", "impl"),
                                donate_argnames=("k_pages", "v_pages"))
        self._decode = jax.jit(_decode_program, static_argnames=("graphdef", "max_steps", "impl"),
                               donate_argnames=("k_pages", "v_pages"))
        self._verify = jax.jit(_verify_program, static_argnames=("graphdef", "impl"),
                               donate_argnames=("k_pages", "v_pages"))
        self._programs: set = set()  # shape keys this runner has run (compiled here or before)
        self.compile_s = 0.0  # wall time of calls that compiled a new program
        self.compiled = False  # whether the last call compiled one

    def _new_pools(self):
        return (tuple(self._zeros() for _ in range(self.cfg.num_layers)),
                tuple(self._zeros() for _ in range(self.cfg.num_layers)))

    def _dummy_call(self, key, k_pages, v_pages):
        """Runs the program of shape key `key` on zero inputs and the given pools; returns the new pools."""
        kind = key[0]
        if kind == "decode":
            (rows,), (_, pages), steps = key[1:]
            z = np.zeros(rows, np.int32)
            out = self._decode(self.graphdef, self.params, k_pages, v_pages, z, np.zeros((rows, pages), np.int32), z,
                               np.zeros(rows, bool), z, np.full((rows, self.max_stop_ids), -1, np.int32),
                               np.zeros(rows, np.float32), z, np.ones(rows, np.float32), z, z, np.bool_(False),
                               np.int32(1), max_steps=steps, impl=self.impl)
        elif kind == "verify":
            (rows, width), (_, pages) = key[1:]
            z = np.zeros(rows, np.int32)
            out = self._verify(self.graphdef, self.params, k_pages, v_pages, np.zeros((rows, width), np.int32),
                               np.zeros((rows, pages), np.int32), z, z, np.zeros(rows, bool),
                               np.zeros(rows, np.float32), z, np.ones(rows, np.float32), z, z, np.bool_(False),
                               impl=self.impl)
        elif kind == "prefill":
            (rows, width), (_, pages), n = key[1:]
            z = np.zeros(rows, np.int32)
            packed = (np.zeros((1, n), np.int32), np.zeros((1, n), np.int32), np.full((rows, width), n, np.int32),
                      np.zeros(n, np.int32), z)
            images = (None, None)  # as `prefill` passes them: a call spelled otherwise is another cache entry
            if self.cfg.is_vision:
                images = (np.zeros((1, n, self.cfg.image_patch_dim), np.float32), np.full((1, n), -1, np.int32))
            out = self._prefill(self.graphdef, self.params, k_pages, v_pages, *packed,
                                np.zeros((rows, pages), np.int32), z, z, np.zeros(rows, np.float32), z,
                                np.ones(rows, np.float32), z, z, np.bool_(False), *images, impl=self.impl)
        else:
            raise ValueError(f"no program of kind {kind!r} to warm up")
        jax.block_until_ready(out)
        return out[0], out[1]

    def warm(self, keys, threads: int = 1) -> float:
        """Compiles (and runs once, on zeros) the programs of the shape keys `keys`, `threads` at a time: XLA
        compiles with the GIL released, so two compile at once on two cores. Each thread runs on page pools of
        its own (freed after), never the engine's. Returns the seconds, all counted as compile time."""
        keys = [k for k in keys if k not in self._programs]
        t0 = time.perf_counter()
        if keys:
            local = threading.local()

            def one(key):
                if not hasattr(local, "pools"):
                    local.pools = self._new_pools()
                local.pools = self._dummy_call(key, *local.pools)
                return key
            n = max(1, min(threads, len(keys)))
            if n == 1:
                self._programs.update(one(k) for k in keys)
            else:
                with concurrent.futures.ThreadPoolExecutor(n) as ex:
                    self._programs.update(ex.map(one, keys))
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        return seconds

    def set_params(self, params) -> None:
        """New weights (an nnx.State like the model's, or its LoRA adapters alone: `adapters`), copied onto the
        engine's shardings: the engine never shares buffers with a trainer, which donates its parameters at every
        step."""
        target = self.param_shardings if self.param_shardings is not None else jax.tree.map(
            lambda x: x.sharding, self.params)
        if self.cfg.lora_rank:
            mine, base = split_adapters(self.params)
            if jax.tree.structure(params) == jax.tree.structure(mine):
                self.params = nnx.merge_state(base, place_copy(params, split_adapters(target)[0]))
                return
        self.params = place_copy(params, target)

    def compile_count(self) -> int:
        """Distinct device programs this runner has run (one compilation each, at most)."""
        return len(self._programs)

    def _call(self, key, fn, *args, **kwargs):
        """Runs `fn`, timing it as compile time if the jit cache grew (a new program); `compiled` tells whether
        the last call did (its wall time is then no measure of the program's speed)."""
        before = fn._cache_size()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.compiled = fn._cache_size() != before
        if self.compiled:
            self.compile_s += time.perf_counter() - t0
        self._programs.add(key)
        return out

    def write_sequence(self, k, v, page_row, length) -> None:
        """Stores a dense per-sequence KV (tuples of [kv, L, d]) into the pages of `page_row` [P]."""
        key = ("write", k[0].shape, page_row.shape)
        self.k_pages, self.v_pages = self._call(key, self._write, self.k_pages, self.v_pages, k, v,
                                                page_row, np.int32(length))

    def prefill(self, tokens, positions, unpack, pack, last, page_table, starts, num_new, temperature, top_k, top_p,
                seeds, sample_index, *, filtered: bool, patches=None, patch_index=None):
        """All arguments are host arrays: the packed tokens and their positions [1, N]; unpack [B, T] (row b's t-th
        new token's packed index, N for padding), pack [N] (each packed token's index in the flattened [B * T]
        view), last [B] (each row's last packed token); page_table [B, P]; the rest [B] (`PagedKV`).

        A vision model always gets `patches` [1, N, patch_dim] and `patch_index` [1, N] (-1 off images; see
        `vision.dense_inputs`), so it has one program per shape bucket, as a text model.
        """
        key = ("prefill", unpack.shape, page_table.shape, tokens.shape[1])
        self.k_pages, self.v_pages, tok, lps, lpm = self._call(
            key, self._prefill, self.graphdef, self.params, self.k_pages, self.v_pages, tokens, positions, unpack,
            pack, last, page_table, starts, num_new, temperature, top_k, top_p, seeds, sample_index,
            np.bool_(filtered), patches, patch_index, impl=self.impl)
        return np.asarray(tok), np.asarray(lps), np.asarray(lpm)

    def decode(self, tokens, page_table, starts, live, remaining, stop_ids, temperature, top_k,
               top_p, seeds, sample_index, num_steps: int, *, max_steps: int, filtered: bool,
               params=None):
        """Host arrays [S] (page_table [S, P], stop_ids [S, W]); returns host [max_steps, S] arrays.

        `params` overrides the runner's own (the JetStream verbs pass parameters explicitly).
        """
        key = ("decode", tokens.shape, page_table.shape, max_steps)
        self.k_pages, self.v_pages, tok, lps, lpm, ok = self._call(
            key, self._decode, self.graphdef, self.params if params is None else params,
            self.k_pages, self.v_pages, tokens,
            page_table, starts, live, remaining, stop_ids, temperature, top_k, top_p, seeds,
            sample_index, np.bool_(filtered), np.int32(num_steps), max_steps=max_steps,
            impl=self.impl)
        return np.asarray(tok), np.asarray(lps), np.asarray(lpm), np.asarray(ok)

    def verify(self, tokens, page_table, starts, num_drafts, live, temperature, top_k, top_p, seeds,
               sample_index, *, filtered: bool):
        """Host arrays: tokens [S, 1 + K] (each row's last token, then its drafts), page_table [S, P], the
        rest [S]; returns host (tokens, logp_sample, logp_model) [S, 1 + K] and emitted [S] (0 off `live`)."""
        key = ("verify", tokens.shape, page_table.shape)
        self.k_pages, self.v_pages, tok, lps, lpm, emitted = self._call(
            key, self._verify, self.graphdef, self.params, self.k_pages, self.v_pages, tokens, page_table,
            starts, num_drafts, live, temperature, top_k, top_p, seeds, sample_index, np.bool_(filtered),
            impl=self.impl)
        return np.asarray(tok), np.asarray(lps), np.asarray(lpm), np.asarray(emitted)
