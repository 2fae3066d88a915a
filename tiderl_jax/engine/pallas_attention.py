"""The `pallas_gpu` and `pallas_tpu` paged-attention implementations: the kernels JAX ships.

- GPU: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton: each program reads one kv head's pages of
  one row in place, splits the row's pages over `k_splits` programs and merges them with their
  log-sum-exps).
- TPU: `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic: pages copied from HBM block by block,
  double-buffered, online softmax).

Both take one query token per row and a pool laid out kv-head-major, [kv_heads, num_pages, page_size,
head_dim] (a head's pages one block), which is why the engine keeps its pools in that layout
(`paged_attention.LAYOUT`) when it runs them. A call of t tokens per row (decode t=1; speculative
verification t = drafts + 1) becomes b * t kernel rows: query i of row r is a row of its own over r's page
table whose length is r's position of i plus one, which is exactly the causal mask. Longer chunks
(prefill) take the `xla` path over the same layout (`paged_attention.py`): on b * t rows the kernel would
read the row's pages once per query.

JAX's TPU ragged kernel (`ragged_paged_attention`, mixed prefill and decode in one call) needs K and V
interleaved in one array per layer ([pages, page_size, 2 * kv_heads, head_dim]); the engine's separate K
and V pools and separate prefill / decode programs do not have that shape, so it is not used.

A kernel has no partitioning rule, so on a sharded engine each runs under `jax.shard_map` over the pool's
kv-head axis (`per_kv_shard`, which the C++ `cpu` kernel uses too): every device attends its own heads over its
own shard of the pool.

Off their platform the kernels run in Pallas' interpret mode only when `TIDERL_PALLAS_INTERPRET=1` (the tests
set it): an engine asked for `pallas_gpu` on a CPU otherwise fails naming the platform, instead of running
an interpreter for hours. On a TPU the kernel's dots run at the TPU's default matmul precision (bfloat16
passes) even for a float32 pool; interpret mode reproduces that, so its tests compare at that precision.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from tiderl_jax.model.sharding import spec_for

PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
MAX_QUERY_TOKENS = 8  # tokens per row a call may have to go to the kernel (decode, verification)


def interpret_requested() -> bool:
    return os.environ.get("TIDERL_PALLAS_INTERPRET") == "1"


def applies(impl: str, *, head_dim: int, page_size: int) -> bool:
    """Whether `auto` may take `impl` for this model: the tile shapes the kernels' compilers need (Triton's
    dots at least 16 wide; a TPU lane is 128 wide)."""
    if impl == "pallas_gpu":
        return head_dim % 16 == 0 and page_size % 16 == 0
    return head_dim % 128 == 0 and page_size % 16 == 0


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _check_platform(impl: str) -> bool:
    """Whether the kernel runs interpreted; raises where it can run neither compiled nor interpreted."""
    platform = jax.default_backend()
    if platform == PLATFORM[impl]:
        return False
    if interpret_requested():
        return True
    raise NotImplementedError(
        f"attention_impl {impl!r} runs JAX's {PLATFORM[impl].upper()} paged-attention kernel, and this engine "
        f"runs on {platform}: use attention_impl='auto' (or set TIDERL_PALLAS_INTERPRET=1 to run the kernel in "
        "Pallas' interpret mode, as the tests do)")


def _gpu(q, k_pool, v_pool, tables, lengths, *, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu
    pages = tables.shape[1]
    splits = _divisor_at_most(pages, 16)
    return gpu.paged_attention(q, k_pool, v_pool, tables, lengths, k_splits=splits,
                               pages_per_compute_block=_divisor_at_most(pages // splits, 8), interpret=interpret)


def _tpu(q, k_pool, v_pool, tables, lengths, *, interpret):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu

    block = _divisor_at_most(tables.shape[1], 8)
    if not interpret:
        return tpu(q, k_pool, v_pool, lengths, tables, pages_per_compute_block=block)
    with pltpu.force_tpu_interpret_mode():
        return tpu(q, k_pool, v_pool, lengths, tables, pages_per_compute_block=block)


KERNELS = {"pallas_gpu": _gpu, "pallas_tpu": _tpu}


def paged_attention_pallas(impl: str, q, k_pool, v_pool, page_table, starts):
    """q [b, t, h, d] (t <= MAX_QUERY_TOKENS); pools [kv, pages, ps, d]; page_table [b, P]; starts [b]
    -> [b, t, h, d], each query over its row's keys up to its own position. One device's (or shard's) call."""
    interpret = _check_platform(impl)
    b, t, h, d = q.shape
    span = page_table.shape[1] * k_pool.shape[2]
    # padding queries (a row's tokens past its real ones) may sit past the table's span: clamped, never read
    lengths = jnp.minimum(starts[:, None] + jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], span).reshape(-1)
    rows_q = (q * (d ** -0.5)).astype(q.dtype).reshape(b * t, h, d)
    out = KERNELS[impl](rows_q, k_pool, v_pool, jnp.repeat(page_table, t, axis=0), lengths, interpret=interpret)
    return out.reshape(b, t, h, d)


def per_kv_shard(kernel, q, k_pool, v_pool, page_table, starts, constrain, pool_axes, *rows):
    """`kernel` (q [b, t, h, d], pools, page_table, starts, *rows -> [b, t, h, d]: a custom call or a Pallas kernel,
    which has no partitioning rule) on each device's kv heads under `jax.shard_map`: every device attends its own
    heads over its own shard of the pool (`pool_axes`: the pool's logical axes, its kv-head axis named
    "kv_heads"); `rows`: more per-row arrays, replicated as the page table is. Without a mesh, one call."""
    if constrain is None or constrain.mesh.size == 1:
        return kernel(q, k_pool, v_pool, page_table, starts, *rows)
    pool_spec = spec_for(k_pool.shape, pool_axes, constrain.rules, constrain.mesh)
    heads_dim = pool_axes.index("kv_heads")
    if any(axis is not None for i, axis in enumerate(pool_spec) if i != heads_dim):
        pool_spec = PartitionSpec()  # a pool split other than by heads: every device attends all of it
    heads = pool_spec[heads_dim] if len(pool_spec) else None
    q_spec = PartitionSpec(None, None, heads, None)  # h = kv * group: a kv-head split keeps each head with its group
    return jax.shard_map(kernel, mesh=constrain.mesh,
                         in_specs=(q_spec, pool_spec, pool_spec, *[PartitionSpec()] * (2 + len(rows))),
                         out_specs=q_spec, check_vma=False)(q, k_pool, v_pool, page_table, starts, *rows)
