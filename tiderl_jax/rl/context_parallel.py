"""Context-parallel attention: a prompt too long for one device, sharded along its sequence.

LongStraw (`longstraw.py`) runs a long prompt once, keeps every layer's keys and values, and replays
each response of its group against them. When the prompt's activations or its K/V do not fit one
device, the prompt is sharded over a mesh axis (`context` by default) in contiguous blocks: of n
devices on that axis, device i holds tokens [i * P / n, (i + 1) * P / n), their activations and
their K/V. Two attention patterns then cross the blocks:

- **the prompt forward** (`ring_attention`): every query block attends causally to every key block
  at or before it. The K/V blocks travel around the ring (`lax.ppermute` to the next device, n
  steps): at each step a device attends its own queries to the block it holds and folds the result
  into a running (output, log-sum-exp) with the stable online-softmax merge. Ring order, not an
  all-gather of the K/V: a device holds its own block plus the one in flight (and one transient
  score block [heads, P / n, P / n]), so per-device memory stays O(P / n), and that is what bounds
  the longest prompt a device can take. (All-gathering the
  K/V, or letting GSPMD gather it for a plain `attend`, costs O(P) per device per layer, and the
  score map O(P^2 / n).) The backward is a second ring pass (`jax.custom_vjp`): the forward keeps
  only q, k, v, the output and the log-sum-exp of its own block, and the backward rotates the K/V
  blocks together with their gradient accumulators, which arrive back at their owner after n steps.
  Plain autodiff through the forward loop would keep every step's rotated K/V block and score block
  (O(P) and O(P^2 / n) per device per layer); the hand-written backward is the same flash-attention
  gradient, equal to autodiff of the reference to float rounding (the tests check it). Being a
  `custom_vjp`, it has no forward-mode derivative (`jax.jvp`, `jax.jacfwd`).
  With contiguous blocks, causal, about half of the ring's block products are fully masked (device
  i needs i + 1 of its n blocks, but every device steps through all n in lockstep): a striped or
  zig-zag token order would make every step useful work.
- **a response replay** (`attend_sharded_prefix`): the T new tokens are few and replicated; their
  queries attend to the whole prompt (sharded, all before them; `prefix_valid` masks right padding)
  and causally to their own K/V. Each device attends the queries to its prompt block; the partials
  are merged across devices by their log-sum-exp (pmax of the lse, psum of the weighted outputs and
  weights) and then with the local causal part. Plain autodiff: the residuals are one block's.

Numerics follow `decoder.attend`: scores in float32 scaled by head_dim ** -0.5, softmax in float32,
probabilities cast to v's dtype for the weighted sum (float32 accumulation), output in q's dtype.
`reference_attention` is the single-device reference of both (concatenate, one masked `attend`).

## `ContextParallelKV` in LongStraw

`ContextParallelKV` implements the decoder's `Cache` protocol as `PromptKV` does (per-layer k, v
[b, kv_heads, S, head_dim], here sequence-sharded over `axis`). Empty, it runs the prompt forward
with `ring_attention` and `advance` returns the prompt's K/V (sharded); holding a prefix, it replays
new tokens with `attend_sharded_prefix` and `advance` returns the prefix unchanged (the new tokens'
K/V are replicated and are not appended; LongStraw discards the replay's cache). `valid` [S] bool
marks the real keys of a right-padded prompt, as `PromptKV.valid` does. The swap in `longstraw.py`
is in `_prompt_state` alone (names as there; `mesh` and `axis` reach it as static arguments):

    empty = ContextParallelKV.empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                    jnp.dtype(cfg.dtype), mesh=mesh, axis=axis)
    tokens = jax.lax.with_sharding_constraint(prompt[None], NamedSharding(mesh, P(None, axis)))
    hidden, kv = model(tokens, positions, cache=empty, return_hidden=True)

(in place of the `PromptKV.empty(...)` line and the `model(prompt[None], ...)` call; imports:
`NamedSharding`, `PartitionSpec as P`, `ContextParallelKV`). The replay needs no change: it reads
the prompt's (padded) length from `kv.k[0].shape[2]` (the global shape inside jit), sets
`kv.replace(valid=jnp.arange(size) < length)` when the prompt is padded, and calls the decoder with
`cache=state.kv`; picking the last real hidden state with `lax.dynamic_index_in_dim` from the
sequence-sharded hidden states compiles without gathering them. In exact mode the prompt state's
cotangent is a ContextParallelKV too (its k, v sequence-sharded), and the prompt's vjp runs the
ring backward. The prompt's (padded) length must be a multiple of the axis size (a ValueError says
so): pad to a bucket that is. The parameters must live on the mesh's devices (replicated, or placed
by `shard_model` on the same mesh).

Where the decoder gets in the way (decoder.py and sharding.py are not changed here):

- A model placed with `shard_model` / `init_sharded` carries an `ActivationSharding` that pins the
  hidden states to ("batch", "seq", None) and q to ("batch", "seq", "q_heads", "head_dim") in every
  layer, and `PromptKV`'s K/V to ("batch", "kv_heads", "cache_seq", "head_dim"). Its rules must map
  "seq" (and "cache_seq") to the context axis: under a rule ("seq", None) the pin replicates the
  sequence and GSPMD all-gathers each layer's P-token activations (O(P) per device) before the ring
  re-slices them (correct, but the memory bound is lost; checked on the compiled program). The rules
  name only `sharding.MESH_AXES`, so the context axis must be one of them: `context` where that tuple
  has it, or an existing axis, e.g. `axis="fsdp"` with ("seq", "fsdp") and ("cache_seq", "fsdp") (a
  batch-1 prompt's batch dimension does not take fsdp, 1 not being divisible, so the sequence does;
  `test_sharded_model_with_fsdp_as_the_context_axis`). With a model that carries no
  `ActivationSharding` (the unsharded decoder, parameters replicated on the mesh) nothing pins the
  sequence and the prompt tokens' sharding propagates. A sharded model's embedding lookup (its table
  split over fsdp along embed, tensor along vocab) still makes one [P, embed / fsdp] partial per
  device before the first layer (GSPMD's choice for the gather; the layers are split after it).
- RoPE and the positions need nothing: positions [1, P] shard like the tokens and RoPE is
  elementwise along the sequence.

The shard_maps are manual over `axis` only (`axis_names={axis}`): other mesh axes (batch over data,
heads over tensor) stay under GSPMD inside them.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tiderl_jax.model.decoder import attend, einsum_f32

# Layouts of the key / value operands of `_block`: the decoder's projections give [b, s, kv, d]
# (the ring's blocks), the cache holds [b, kv, s, d] (the replay's prefix).
_SEQ_MAJOR = "bskd"
_HEAD_MAJOR = "bksd"


# ------------------------------------------------------------------------------ checks and helpers


def _axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"context axis {axis!r} is not an axis of the mesh (its axes: "
                         f"{tuple(mesh.axis_names)}); build the mesh with a {axis!r} axis or pass "
                         f"axis= one of them")
    return mesh.shape[axis]


def _check_heads(q: jax.Array, k: jax.Array, v: jax.Array, kv_dim: int, what: str) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{what}: q, k, v must be 4-D, got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k shape {k.shape} != v shape {v.shape}")
    heads, kv_heads = q.shape[2], k.shape[kv_dim]
    if heads % kv_heads or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"{what}: q {q.shape} does not fit k/v {k.shape} (batch and head_dim must "
                         f"match, heads {heads} a multiple of kv_heads {kv_heads})")


def _check_divisible(length: int, n: int, axis: str, what: str) -> None:
    if length % n:
        raise ValueError(f"{what} length {length} is not divisible by the size {n} of mesh axis "
                         f"{axis!r}: pad it to a multiple of {n} (right padding; mask it as "
                         f"prefix_valid / ContextParallelKV.valid in the replay)")


def _shard_map(f, mesh: Mesh, axis: str, in_specs, out_specs):
    """shard_map manual over `axis` only: the mesh's other axes stay automatic (GSPMD) inside."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset({axis}))


def _group(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [b, t, heads, d] -> [b, t, kv_heads, heads // kv_heads, d] (query heads by their KV head)."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


def _finite_or_zero(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _scores(qg: jax.Array, k: jax.Array, mask: jax.Array, layout: str) -> jax.Array:
    """Scaled float32 scores [b, q, kv, g, s], -inf where `mask` [q, s] or [b, q, s] is False."""
    s = einsum_f32(f"bqkgd,{layout}->bqkgs", qg, k) * (qg.shape[-1] ** -0.5)
    mask = mask if mask.ndim == 3 else mask[None]
    return jnp.where(mask[:, :, None, None, :], s, -jnp.inf)


def _block(qg, k, v, mask, layout):
    """Attention of grouped queries qg [b, q, kv, g, d] over one key block (k, v in `layout`).

    Returns (out [b, q, kv, g, d] float32, normalised over this block; lse [b, q, kv, g] float32).
    A row with no visible key gives out 0 and lse -inf, without NaN in values or gradients.
    """
    s = _scores(qg, k, mask, layout)
    m = _finite_or_zero(lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = einsum_f32(f"bqkgs,{layout}->bqkgd", (p / total).astype(v.dtype), v)
    return out, jnp.where(seen, m + jnp.log(total), -jnp.inf)[..., 0]


def _combine(m, terms):
    """Online-softmax merge of [(out, lse), ...] given their (stop-gradient) max lse m."""
    m = _finite_or_zero(lax.stop_gradient(m))
    weights = [jnp.exp(lse - m) for _, lse in terms]
    total = sum(weights)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, terms)) / safe[..., None]
    return out, jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def _merge(a, b):
    """Merges two partial attentions (out, lse) over disjoint key sets into one."""
    return _combine(jnp.maximum(a[1], b[1]), [a, b])


def _ring_mask(my, src, block: int, causal: bool) -> jax.Array:
    """[block, block] visibility of key block `src` to query block `my` (contiguous blocks)."""
    if not causal:
        return jnp.ones((block, block), bool)
    pos = jnp.arange(block)
    return (src * block + pos)[None, :] <= (my * block + pos)[:, None]


def _rotate(x, axis: str, n: int):
    """Each device's x to the next device on the ring (device i -> i + 1 mod n)."""
    return lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


# ---------------------------------------------------------------------------------- ring attention


def _ring_forward_local(q, k, v, *, axis: str, n: int, causal: bool):
    """One device's ring forward: local q [b, t, h, d], k/v [b, t, kv, d] -> (out, lse) float32."""
    b, t, _, d = q.shape
    qg = _group(q, k.shape[2])
    my = lax.axis_index(axis)

    def step(i, kb, vb, acc):
        part = _block(qg, kb, vb, _ring_mask(my, (my - i) % n, t, causal), _SEQ_MAJOR)
        return part if acc is None else _merge(acc, part)

    acc = step(0, k, v, None)

    def body(i, carry):
        kb, vb, acc = carry
        kb, vb = _rotate(kb, axis, n), _rotate(vb, axis, n)
        return kb, vb, step(i, kb, vb, acc)

    _, _, (out, lse) = lax.fori_loop(1, n, body, (k, v, acc))
    return out, lse


def _ring_backward_local(q, k, v, out, lse, dout, *, axis: str, n: int, causal: bool):
    """One device's ring backward (flash-attention gradient): dq stays, dk/dv travel with k/v."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = _group(q, kvh)
    dog = _group(dout, kvh).astype(jnp.float32)
    lse_safe = _finite_or_zero(lse)[..., None]
    delta = jnp.sum(dog * _group(out, kvh).astype(jnp.float32), axis=-1)[..., None]  # [b, t, kv, g, 1]
    my = lax.axis_index(axis)
    scale = d ** -0.5

    def step(i, kb, vb, dq, dkb, dvb):
        s = _scores(qg, kb, _ring_mask(my, (my - i) % n, t, causal), _SEQ_MAJOR)
        p = jnp.exp(s - lse_safe)  # this block's share of the final softmax; 0 where masked
        dvb = dvb + einsum_f32("bqkgs,bqkgd->bskd", p, dog)
        ds = p * (einsum_f32("bqkgd,bskd->bqkgs", dog, vb) - delta)
        dq = dq + einsum_f32("bqkgs,bskd->bqkgd", ds, kb) * scale
        dkb = dkb + einsum_f32("bqkgs,bqkgd->bskd", ds, qg) * scale
        return dq, dkb, dvb

    def body(i, carry):
        kb, vb, dq, dkb, dvb = carry
        dq, dkb, dvb = step(i, kb, vb, dq, dkb, dvb)
        kb, vb, dkb, dvb = (_rotate(x, axis, n) for x in (kb, vb, dkb, dvb))
        return kb, vb, dq, dkb, dvb

    zeros = jnp.zeros_like(k, jnp.float32)  # zeros_like: varying over the axis, as the loop's carry
    kb, vb, dq, dkb, dvb = lax.fori_loop(0, n - 1, body,
                                         (k, v, jnp.zeros_like(qg, jnp.float32), zeros, zeros))
    dq, dkb, dvb = step(n - 1, kb, vb, dq, dkb, dvb)
    # Block j's gradient is on device j - 1 after n - 1 rotations: one more brings it home.
    dk, dv = _rotate(dkb, axis, n), _rotate(dvb, axis, n)
    return dq.reshape(b, t, h, d).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, mesh, axis, causal):
    return _ring_fwd(q, k, v, mesh, axis, causal)[0]


def _ring_fwd(q, k, v, mesh, axis, causal):
    n = mesh.shape[axis]
    seq = P(None, axis)  # [b, t, ...] sharded along t
    local = functools.partial(_ring_forward_local, axis=axis, n=n, causal=causal)
    out, lse = _shard_map(local, mesh, axis, (seq, seq, seq), (seq, seq))(q, k, v)
    out = out.reshape(q.shape).astype(q.dtype)
    return out, (q, k, v, out, lse)


def _ring_bwd(mesh, axis, causal, residuals, dout):
    n = mesh.shape[axis]
    seq = P(None, axis)
    local = functools.partial(_ring_backward_local, axis=axis, n=n, causal=causal)
    return _shard_map(local, mesh, axis, (seq,) * 6, (seq,) * 3)(*residuals, dout)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh, axis: str = "context",
                   causal: bool = True) -> jax.Array:
    """Attention of a sequence sharded over mesh axis `axis` in contiguous blocks, by ring passing.

    q [b, t, heads, d]; k, v [b, t, kv_heads, d] (grouped-query: heads a multiple of kv_heads);
    position j of the sequence attends to positions <= j (`causal`) or to all. t must be divisible by
    the axis size. Returns [b, t, heads, d] in q's dtype, sharded like q. Differentiable (reverse
    mode; the backward is a second ring pass, see the module docstring).
    """
    _check_heads(q, k, v, 2, "ring_attention")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"ring_attention: k/v length {k.shape[1]} != q length {q.shape[1]} "
                         f"(self-attention of one sequence)")
    n = _axis_size(mesh, axis)
    _check_divisible(q.shape[1], n, axis, "ring_attention: sequence")
    return _ring(q, k, v, mesh, axis, causal)


# ------------------------------------------------------------------------- replay over a prefix


def attend_sharded_prefix(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_prefix: jax.Array,
                          v_prefix: jax.Array, *, mesh: Mesh, axis: str = "context",
                          prefix_valid: jax.Array | None = None) -> jax.Array:
    """New tokens' attention over a prefix sharded along its sequence plus, causally, themselves.

    q [b, T, heads, d], k_new / v_new [b, T, kv_heads, d] (the decoder's layout; replicated over
    `axis`); k_prefix / v_prefix [b, kv_heads, S, d] (the cache's layout), sharded over `axis` along
    S (S divisible by its size); prefix_valid [S] bool or None: False marks a padding key no query
    sees. Every prefix position precedes every new token. Returns [b, T, heads, d] in q's dtype.
    Differentiable w.r.t. q, the new and the prefix K/V by plain autodiff.
    """
    what = "attend_sharded_prefix"
    _check_heads(q, k_new, v_new, 2, what)
    _check_heads(q, k_prefix, v_prefix, 1, what)
    if k_new.shape[1] != q.shape[1] or k_prefix.shape[1] != k_new.shape[2]:
        raise ValueError(f"{what}: q {q.shape}, k_new {k_new.shape}, k_prefix {k_prefix.shape} "
                         f"disagree on the new tokens' count or kv_heads")
    n = _axis_size(mesh, axis)
    length = k_prefix.shape[2]
    _check_divisible(length, n, axis, f"{what}: prefix")
    if prefix_valid is None:
        prefix_valid = jnp.ones((length,), bool)
    elif prefix_valid.shape != (length,):
        raise ValueError(f"{what}: prefix_valid shape {prefix_valid.shape} must be ({length},)")
    qg = _group(q, k_new.shape[2])

    def local(qg, kp, vp, valid):
        return _across(*_block(qg, kp, vp, valid[None, :], _HEAD_MAJOR), axis)

    prefix = P(None, None, axis)
    part = _shard_map(local, mesh, axis, (P(), prefix, prefix, P(axis)), (P(), P()))(
        qg, k_prefix, v_prefix, prefix_valid.astype(bool))
    t = q.shape[1]
    own = _block(qg, k_new, v_new, jnp.tril(jnp.ones((t, t), bool)), _SEQ_MAJOR)
    out, _ = _merge(part, own)
    return out.reshape(q.shape).astype(q.dtype)


def _across(out, lse, axis: str):
    """Merges each device's partial (out, lse) over its key block into the whole (replicated)."""
    m = _finite_or_zero(lax.pmax(lax.stop_gradient(lse), axis))  # pmax has no derivative rule
    w = jnp.exp(lse - m)
    total = lax.psum(w, axis)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    merged = lax.psum(w[..., None] * out, axis) / safe[..., None]
    return merged, jnp.where(seen, m + jnp.log(safe), -jnp.inf)


# ------------------------------------------------------------------------------------ reference


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        k_prefix: jax.Array | None = None, v_prefix: jax.Array | None = None,
                        prefix_valid: jax.Array | None = None) -> jax.Array:
    """Single-device reference of both: concatenate the keys, one masked `decoder.attend`.

    q [b, t, heads, d] attends to the prefix k_prefix / v_prefix [b, kv_heads, S, d] (if given: all
    of it, less where prefix_valid [S] is False) and to k / v [b, t, kv_heads, d], causally or not.
    `ring_attention(q, k, v, causal=c)` equals `reference_attention(q, k, v, causal=c)`;
    `attend_sharded_prefix(q, k, v, kp, vp, prefix_valid=m)` equals
    `reference_attention(q, k, v, k_prefix=kp, v_prefix=vp, prefix_valid=m)`.
    """
    b, t = q.shape[:2]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    mask = jnp.tril(jnp.ones((t, t), bool)) if causal else jnp.ones((t, t), bool)
    if k_prefix is not None:
        length = k_prefix.shape[2]
        valid = jnp.ones((length,), bool) if prefix_valid is None else prefix_valid.astype(bool)
        mask = jnp.concatenate([jnp.broadcast_to(valid, (t, length)), mask], axis=1)
        k = jnp.concatenate([k_prefix.astype(k.dtype), k], axis=2)
        v = jnp.concatenate([v_prefix.astype(v.dtype), v], axis=2)
    return attend(q, k, v, jnp.broadcast_to(mask, (b, *mask.shape)))


# ---------------------------------------------------------------------------- the decoder's cache


@flax.struct.dataclass
class ContextParallelKV:
    """A KV prefix sharded along its sequence over `mesh`'s `axis` (the decoder's `Cache` protocol).

    k, v: one array per layer, each [batch, kv_heads, S, head_dim], sequence-sharded over `axis`.
    Empty (S == 0): a call runs the new tokens (sharded over `axis` along the sequence, their count
    divisible by its size) with `ring_attention`, and `advance` returns their K/V as the prefix.
    Holding a prefix: a call attends the new tokens (replicated) to it and causally to themselves
    with `attend_sharded_prefix`, and `advance` returns the prefix unchanged (a replay does not grow
    it). `valid` [S] bool (None: all), as `PromptKV.valid`: False marks right padding of the prompt,
    never attended to by a replay (the prompt forward needs no mask: causality hides right padding).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mesh: Mesh = flax.struct.field(pytree_node=False)
    axis: str = flax.struct.field(pytree_node=False, default="context")
    valid: jax.Array | None = None

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int, dtype, *, mesh: Mesh,
              axis: str = "context") -> "ContextParallelKV":
        _axis_size(mesh, axis)
        zero = jnp.zeros((1, kv_heads, 0, head_dim), dtype)
        return cls(k=(zero,) * num_layers, v=(zero,) * num_layers, mesh=mesh, axis=axis)

    @property
    def sharding(self) -> NamedSharding:
        """The layout of the prefix K/V: [b, kv_heads, S, head_dim] sharded along S."""
        return NamedSharding(self.mesh, P(None, None, self.axis))

    def attend_layer(self, i, q, k, v, constrain):
        """q [b, t, h, d], k/v [b, t, kv, d] -> (out [b, t, h, d], layer state).

        `constrain` (the model's activation sharding) is not applied to the K/V here: its rule for
        `cache_seq` would undo the sequence sharding (module docstring).
        """
        k, v = k.astype(self.k[i].dtype), v.astype(self.v[i].dtype)  # rounded as stored, as PromptKV
        if self.k[i].shape[2] == 0:
            out = ring_attention(q, k.astype(q.dtype), v.astype(q.dtype), mesh=self.mesh, axis=self.axis)
            state = tuple(lax.with_sharding_constraint(x.transpose(0, 2, 1, 3), self.sharding)
                          for x in (k, v))
            return out, state
        out = attend_sharded_prefix(q, k.astype(q.dtype), v.astype(q.dtype), self.k[i].astype(q.dtype),
                                    self.v[i].astype(q.dtype), mesh=self.mesh, axis=self.axis,
                                    prefix_valid=self.valid)
        return out, None

    def advance(self, layer_states, num_new):
        if self.k[0].shape[2] > 0:
            return self
        k = tuple(s[0] for s in layer_states)
        valid = self.valid
        if valid is not None:
            valid = jnp.concatenate([valid, jnp.ones((k[0].shape[2] - valid.shape[0],), bool)])
        return self.replace(k=k, v=tuple(s[1] for s in layer_states), valid=valid)
