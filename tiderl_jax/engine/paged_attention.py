"""Attention over a paged KV pool, and the `PagedKV` cache the decoder's cached mode writes into.

The pool of one layer is [num_pages, kv_heads, page_size, head_dim]. A row (one sequence in this
call) owns a page table [max_pages] of page ids: token position p of the row lives at
page_table[p // page_size], offset p % page_size. Page 0 is the trash page: padding tokens write there
and unused page-table entries point there; it is never read unmasked.

Implementations (selected by name, so a kernel can be plugged in without touching the model):
- `reference`: per row, concatenate the row's pages into a contiguous K/V and run the plain
  attention. Obviously correct; slow; used by tests.
- `xla`: one gather of all rows' pages, one masked attention. Portable; every backend.
- `cpu`: a C++ kernel that reads each row's pages in place (`cpu_attention.py`, `paged_attention.cc`, an
  XLA FFI custom call built at first use) for every call: decode, verify and prefill chunks (in query tiles,
  pages past a query's position never read, padding queries skipped); per kv-head shard on a sharded engine.
- `pallas_gpu`, `pallas_tpu`: JAX's own Pallas paged-attention kernels (`pallas_attention.py`) for decode and
  verify calls, over pools laid out kv-head-major; prefill chunks go to `xla` over that layout. On a sharded
  engine they run per shard of the kv-head axis.
- any other: `register_paged_attention(name, fn, layout)` (same signature as `paged_attention_xla`).

The kernels (`KERNEL_IMPLS`) also take `constrain` (the engine's mesh, to run per kv-head shard) and `num_new` [b]
(each row's real queries in this call: the later ones are padding, whose outputs no caller reads, so a kernel
may skip them).

The pool's layout is its implementation's (`LAYOUT`): "pages" [num_pages, kv_heads, page_size, head_dim]
(reference, xla, cpu) or "heads" [kv_heads, num_pages, page_size, head_dim] (the Pallas kernels).

`EngineConfig.attention_impl="auto"` (the default) takes `pallas_gpu` / `pallas_tpu` on a GPU / TPU where the
kernel's tiles fit the model's head_dim and the page size, `cpu` for a CPU engine (one device or sharded) with a
float32 model when the kernel builds, else `xla` (`resolve_impl`).
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from tiderl_jax.engine import cpu_attention, pallas_attention
from tiderl_jax.model.decoder import attend, einsum_f32

TRASH_PAGE = 0
PAGES, HEADS = "pages", "heads"  # the pool layouts
HEADS_AXES = ("kv_heads", None, None, "head_dim")
POOL_AXES = {PAGES: (None, "kv_heads", None, "head_dim"), HEADS: HEADS_AXES}


def _mask(starts: jax.Array, t: int, span: int) -> jax.Array:
    """[b, t, span]: query t of row b (at position starts[b] + t) sees keys at positions <= its own."""
    q_abs = starts[:, None] + jnp.arange(t)[None, :]
    return jnp.arange(span)[None, None, :] <= q_abs[:, :, None]


def paged_attention_reference(q, k_pool, v_pool, page_table, starts, layout=PAGES):
    """q [b, t, h, d]; pools [pages, kv, ps, d] (or kv-head-major); page_table [b, P]; starts [b] -> [b, t, h, d]."""
    if layout == HEADS:
        k_pool, v_pool = k_pool.swapaxes(0, 1), v_pool.swapaxes(0, 1)
    rows = []
    for r in range(q.shape[0]):
        k = jnp.concatenate([k_pool[page_table[r, j]] for j in range(page_table.shape[1])], axis=1)
        v = jnp.concatenate([v_pool[page_table[r, j]] for j in range(page_table.shape[1])], axis=1)
        mask = _mask(starts[r:r + 1], q.shape[1], k.shape[1])
        rows.append(attend(q[r:r + 1], k[None].astype(q.dtype), v[None].astype(q.dtype), mask))
    return jnp.concatenate(rows, axis=0)


def attend_gathered(q, k, v, starts, layout=PAGES):
    """Attention over already-gathered pages: q [b, t, h, d]; k, v [b, P, kv, ps, d] (layout "pages") or
    [kv, b, P, ps, d] ("heads"); starts [b].

    The contractions run over the page layout directly (no transpose into a contiguous
    [b, kv, P*ps, d] copy), which halves the attention time on CPU.
    """
    b, t, h, d = q.shape
    kv_index = "bpksd" if layout == PAGES else "kbpsd"
    kvh = k.shape[kv_index.index("k")]
    p, ps = k.shape[kv_index.index("p")], k.shape[kv_index.index("s")]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = einsum_f32(f"btkgd,{kv_index}->bkgtps", qg, k.astype(q.dtype)).reshape(b, kvh, h // kvh, t, p * ps)
    scores = scores * (d ** -0.5)
    mask = _mask(starts, t, p * ps)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, kvh, h // kvh, t, p, ps)
    out = einsum_f32(f"bkgtps,{kv_index}->btkgd", probs, v.astype(q.dtype))
    return out.reshape(b, t, h, d).astype(q.dtype)


def paged_attention_xla(q, k_pool, v_pool, page_table, starts, layout=PAGES):
    """Same contract as the reference: one gather of the rows' pages, then `attend_gathered`."""
    if layout == HEADS:
        return attend_gathered(q, k_pool[:, page_table], v_pool[:, page_table], starts, HEADS)
    return attend_gathered(q, k_pool[page_table], v_pool[page_table], starts)


def _cpu(q, k_pool, v_pool, page_table, starts, constrain=None, num_new=None):
    """The C++ kernel where it `handles` the call (float32: decode, verification, prefill), per kv-head shard on
    a sharded engine; else `xla`."""
    if cpu_attention.handles(q, k_pool, v_pool):
        rows = () if num_new is None else (num_new,)  # none given: the kernel's default, every query real
        return pallas_attention.per_kv_shard(cpu_attention.paged_attention_cpu, q, k_pool, v_pool, page_table,
                                             starts, constrain, POOL_AXES[PAGES], *rows)
    return paged_attention_xla(q, k_pool, v_pool, page_table, starts)


def _pallas(impl: str) -> Callable:
    """JAX's kernel for decode and verify calls (at most MAX_QUERY_TOKENS per row), per kv-head shard on a sharded
    engine; else `xla` (a prefill chunk)."""
    def fn(q, k_pool, v_pool, page_table, starts, constrain=None, num_new=None):
        del num_new  # JAX's kernels compute every query
        if q.shape[1] <= pallas_attention.MAX_QUERY_TOKENS:
            kernel = functools.partial(pallas_attention.paged_attention_pallas, impl)
            return pallas_attention.per_kv_shard(kernel, q, k_pool, v_pool, page_table, starts, constrain, HEADS_AXES)
        return paged_attention_xla(q, k_pool, v_pool, page_table, starts, HEADS)
    return fn


PAGED_ATTENTION: dict[str, Callable] = {
    "reference": paged_attention_reference,
    "xla": paged_attention_xla,
    "cpu": _cpu,
    "pallas_gpu": _pallas("pallas_gpu"),
    "pallas_tpu": _pallas("pallas_tpu"),
}
LAYOUT: dict[str, str] = {"pallas_gpu": HEADS, "pallas_tpu": HEADS}  # the others: PAGES
KERNEL_IMPLS = ("cpu", "pallas_gpu", "pallas_tpu")  # run per kv-head shard (`constrain`: the engine's mesh)
AUTO = "auto"


def resolve_impl(name: str, *, dtype, head_dim: int = 0, page_size: int = 0) -> str:
    """The implementation an engine runs: `name` itself, or for "auto" JAX's Pallas kernel of a GPU / TPU where
    its tiles fit (`pallas_attention.applies`), the CPU kernel where it applies (float32, the kernel built; per
    kv-head shard on a sharded engine), and `xla` elsewhere."""
    if name != AUTO:
        return name
    platform = jax.default_backend()
    for impl, kernel_platform in pallas_attention.PLATFORM.items():
        if platform == kernel_platform:
            return impl if pallas_attention.applies(impl, head_dim=head_dim, page_size=page_size) else "xla"
    if platform != "cpu" or jnp.dtype(dtype) != jnp.float32:
        return "xla"
    return "cpu" if cpu_attention.available() else "xla"


def register_paged_attention(name: str, fn: Callable, layout: str = PAGES) -> None:
    PAGED_ATTENTION[name] = fn
    if layout != PAGES:
        LAYOUT[name] = layout


def pool_layout(impl: str) -> str:
    return LAYOUT.get(impl, PAGES)


def write_pages(pool: jax.Array, new: jax.Array, page_table: jax.Array, starts: jax.Array,
                num_new: jax.Array, layout: str = PAGES) -> jax.Array:
    """Scatters new [b, t, kv, d] into pool [pages, kv, ps, d] (or [kv, pages, ps, d], layout "heads");
    tokens t >= num_new[b] go to trash."""
    b, t = new.shape[:2]
    ps = pool.shape[2]
    pos = starts[:, None] + jnp.arange(t)[None, :]  # [b, t]
    valid = jnp.arange(t)[None, :] < num_new[:, None]
    slot = jnp.clip(pos // ps, 0, page_table.shape[1] - 1)
    page = jnp.where(valid, jnp.take_along_axis(page_table, slot, axis=1), TRASH_PAGE)
    offset = jnp.where(valid, pos % ps, 0)
    rows = new.reshape(b * t, *new.shape[2:]).astype(pool.dtype)  # [b * t, kv, d]
    if layout == HEADS:
        return pool.at[:, page.reshape(-1), offset.reshape(-1), :].set(rows.swapaxes(0, 1))
    return pool.at[page.reshape(-1), :, offset.reshape(-1), :].set(rows)


@flax.struct.dataclass
class PagedKV:
    """The paged cache of one forward call (implements the decoder's `Cache` protocol).

    k_pages, v_pages: per layer [num_pages, kv_heads, page_size, head_dim] (kv-head-major for an implementation
    whose `LAYOUT` is "heads"); page_table [b, P];
    starts [b]: tokens of each row already cached (its first new token's position);
    num_new [b]: real tokens of this call per row (0 for a padding row).

    A ragged (token-packed) call feeds the model its rows' new tokens back to back, as one row [1, n] (the
    projections and the MLP compute no padding), and gives `unpack` [b, t]: the packed index of row b's query t
    (n or more for padding), and `pack` [n]: each packed token's index in the flattened [b * t] view. Only the
    attention runs in that [b, t] view (the kernels skip its padding queries).
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    page_table: jax.Array
    starts: jax.Array
    num_new: jax.Array
    impl: str = flax.struct.field(pytree_node=False, default="xla")
    unpack: jax.Array | None = None
    pack: jax.Array | None = None

    def attend_layer(self, i, q, k, v, constrain):
        if self.unpack is not None:  # [1, n, ...] packed -> the [b, t, ...] rows view (padding zeros)
            q, k, v = (jnp.take(x[0], self.unpack, axis=0, mode="fill", fill_value=0) for x in (q, k, v))
        layout = pool_layout(self.impl)
        k_pool = write_pages(self.k_pages[i], k, self.page_table, self.starts, self.num_new, layout)
        v_pool = write_pages(self.v_pages[i], v, self.page_table, self.starts, self.num_new, layout)
        per_shard = {"constrain": constrain, "num_new": self.num_new} if self.impl in KERNEL_IMPLS else {}
        out = PAGED_ATTENTION[self.impl](q, k_pool, v_pool, self.page_table, self.starts, **per_shard)
        if self.unpack is not None:
            out = jnp.take(out.reshape(-1, *out.shape[2:]), self.pack, axis=0)[None]
        return out, (k_pool, v_pool)

    def advance(self, layer_states, num_new):
        return self.replace(k_pages=tuple(s[0] for s in layer_states),
                            v_pages=tuple(s[1] for s in layer_states),
                            starts=self.starts + self.num_new)

