"""The decoder: one Flax NNX transformer for the Llama 3.x / Qwen2 / Qwen3 family.

Read top to bottom: RoPE, RMSNorm, attention (grouped-query, optional q/k/v bias and q/k norm),
SwiGLU MLP, the block, the model. Two forward modes share every layer:

- **full sequence** (training, scoring): `model(tokens, positions, segment_ids=...)`; attention is
  causal within each segment, so packed sequences never see each other;
- **cached** (rollout): `model(tokens, positions, cache=cache, num_new=...)` writes the new keys and
  values at each row's current length and attends over everything cached so far. One call with T > 1
  tokens is a prefill (possibly a chunk of one), T == 1 is a decode step. Rows may be ragged:
  `num_new[b] <= T` tokens of row b are real; the rest are padding whose cache entries are
  overwritten by the next call.

A vision model (`cfg.image_patch_dim > 0`) also takes `patches` [b, t, patch_dim] and `patch_index`
[b, t] in either mode: where `patch_index >= 0` the position is patch `patch_index` of an image and
its input is the patch embedding (`PatchEmbed`) instead of the token embedding (`vision.py`).

Every parameter carries logical axis names in its `axes` metadata (`embed`, `vocab`, `mlp`,
`q_heads`, `kv_heads`, `head_dim`, `norm`, `patch`, `image_patches`); `sharding.py` maps them to
mesh axes. Parameter layouts are ours ([in, out], heads split out); `hf_io.py` converts to and from
the HF layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.sharding import spec_for


# Rematerialisation of the decoder layers in the full-sequence mode (training; `trainer.remat`): which of a layer's
# intermediate values the backward pass keeps, the rest recomputed from the layer's input. JAX's checkpoint
# policies under the names MaxText and kin use: "full" keeps nothing (the least memory: each layer's forward runs
# twice), "dots_saveable" keeps every matmul's output, "dots_with_no_batch_dims_saveable" the ones without a
# batch dimension (the projections, not attention's scores), "save_out_proj" only the attention and MLP blocks'
# outputs (`checkpoint_name`d below). "none" keeps everything (no rematerialisation).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("attention_out", "mlp_out"),
}


def _dtype(name: str):
    return jnp.dtype(name)


def einsum_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation and output, whatever the operand dtype.

    Accelerators multiply bf16 operands into a float32 result natively; XLA's CPU backend has no
    such kernel (bf16 x bf16 -> f32 fails at run time), so on CPU the operands are upcast first.
    """
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(subscripts, a, b)
    if jax.default_backend() == "cpu":
        return jnp.einsum(subscripts, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def project(x: jax.Array, w: jax.Array, out_in: bool = False, f32: bool = False) -> jax.Array:
    """x [..., in] times a weight w [in, out] (`out_in`: w [out, in], a tied embedding as the LM head) -> [..., out];
    `f32`: float32 accumulation and output (`einsum_f32`'s rule), else x's dtype.

    The forward pass is the one matmul. The backward pass (`_project_bwd`) differs from JAX's own rule only in how
    the weight's gradient is laid out: it contracts the batch and sequence axes of x and of the output's gradient,
    and XLA's CPU dots take their operands with the contracted axes minor, so one of the two is transposed. JAX's
    rule always transposes the output's gradient, fused into the elementwise backward that produces it, which on
    this CPU runs at a fraction of memory speed: for the MLP's gate and up projections (2.7x wider than x) and the
    LM head (85x wider) most of the update's copy time. Here the narrower of the two is transposed."""
    return _project(x, w, out_in, f32)


def _dot(a: jax.Array, b: jax.Array, contract: tuple, f32: bool) -> jax.Array:
    dims = (contract, ((), ()))
    if not f32 or (a.dtype == jnp.float32 and b.dtype == jnp.float32):
        return jax.lax.dot_general(a, b, dims)
    if jax.default_backend() == "cpu":  # as einsum_f32: no bf16 x bf16 -> f32 kernel on XLA's CPU backend
        return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _project(x, w, out_in, f32):
    return _dot(x, w, ((x.ndim - 1,), (1 if out_in else 0,)), f32)


def _project_fwd(x, w, out_in, f32):
    return _project(x, w, out_in, f32), (x, w)


def _project_bwd(out_in, f32, res, g):
    x, w = res
    wide = jnp.promote_types(jnp.promote_types(x.dtype, w.dtype), g.dtype)  # the backward's dots, upcast as needed
    xw, ww, gw = x.astype(wide), w.astype(wide), g.astype(wide)
    dx = _dot(gw, ww, ((g.ndim - 1,), (0 if out_in else 1,)), False)
    batch = tuple(range(x.ndim - 1))
    if x.shape[-1] <= g.shape[-1]:  # transpose x: [in, out] comes out
        dw = _dot(xw, gw, (batch, batch), False)
        dw = dw.T if out_in else dw
    else:  # transpose g (JAX's own choice): [out, in]
        dw = _dot(gw, xw, (batch, batch), False)
        dw = dw if out_in else dw.T
    return dx.astype(x.dtype), dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def _project_heads(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [b, t, e] times w [e, heads, d] -> [b, t, heads, d], as one `project`."""
    return project(x, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])


# ------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with Llama 3 scaling when configured.

    Llama 3 scaling (Meta's `apply_scaling`): wavelengths longer than `original_ctx / low_freq_factor`
    are divided by `factor`, shorter than `original_ctx / high_freq_factor` are kept, and the band in
    between is interpolated linearly in `original_ctx / wavelength`.
    """
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    old_ctx = float(s.original_max_position_embeddings)
    low_wavelen = old_ctx / s.low_freq_factor
    high_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [batch, seq, heads, head_dim] by positions [batch, seq] (half-split layout, as HF)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, head_dim/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------------------ layers


def _param(rngs: nnx.Rngs, shape, axes, std, dtype) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, normalised in float32 (as HF Llama/Qwen)."""

    def __init__(self, dim: int, eps: float, param_dtype, axis_name: str = "norm"):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        # The mean square as a matmul with a 1/n column, not jnp.mean: XLA:CPU's reduction kernel cost
        # ~5% of a SmolLM2 decode step at batch 32 (two norms per layer), its matmul a fraction of that.
        ones = jnp.full((x.shape[-1], 1), 1.0 / x.shape[-1], jnp.float32)
        ms = jnp.matmul(x32 * x32, ones, precision=jax.lax.Precision.HIGHEST)
        y = x32 * jax.lax.rsqrt(ms + self.eps)
        return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention, the plain reference.

    q [b, t, heads, d]; k, v [b, kv_heads, s, d]; mask [b, t, s] (True = may attend).
    Returns [b, t, heads, d]. Scores and softmax in float32.
    """
    b, t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = einsum_f32("btkgd,bksd->bkgts", qg, k)
    scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = einsum_f32("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _segment_mask(segment_ids: jax.Array | None, b: int | None = None, t: int | None = None) -> jax.Array:
    """The full forward's [b, t, t] mask: causal, and within a segment when ids are given."""
    if segment_ids is not None:
        b, t = segment_ids.shape
    idx = jnp.arange(t)
    mask = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (b, t, t))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


# The full (uncached) forward's query chunk: chunk i of a causal [t, t] attention needs only the keys up to its own
# end, so the scores computed shrink from t^2 to about t^2 (n + 1) / 2n for n chunks (measured on the main job's
# packed rows of 1,024: the train step's attention, most of its time on a CPU, nearly halved).
CAUSAL_CHUNK = 128


def attend_causal(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, chunk: int = CAUSAL_CHUNK) -> jax.Array:
    """`attend` for a causal `mask` (the full forward's: no query attends to a later key), query chunk by query
    chunk, each over the keys up to its end. Equal to `attend` (the keys it leaves out are masked there)."""
    t = q.shape[1]
    if t <= chunk:
        return attend(q, k, v, mask)
    parts = [attend(q[:, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], mask[:, s:s + chunk, :s + chunk])
             for s in range(0, t, chunk)]
    return jnp.concatenate(parts, axis=1)


def causal_pairs_computed(t: int, chunk: int = CAUSAL_CHUNK) -> int:
    """(query, key) pairs `attend_causal` computes for a row of `t` tokens: each query chunk against the keys up to
    its end (all of them, masked or not)."""
    if t <= chunk:
        return t * t
    return sum(min(chunk, t - s) * min(s + chunk, t) for s in range(0, t, chunk))


# The train step's attention (the full-sequence mode; `trainer.attention_impl`, set on the model as
# `train_attention`): "xla", `attend_causal` over the [t, t] causal-and-same-segment mask; "pallas_gpu", JAX's
# Pallas flash attention for GPUs (`jax.experimental.pallas.ops.gpu.attention.mha`); "pallas_tpu", JAX's splash
# attention for TPUs (`...ops.tpu.splash_attention`, a causal mask with segment ids); both causal with segment
# ids and their own backward, never materialising a mask or the scores, per shard of a mesh under shard_map (a
# kernel has no partitioning rule). Off its platform a kernel runs in Pallas' interpret mode (how the tests
# check it).
TRAIN_ATTENTION = ("xla", "pallas_gpu", "pallas_tpu")
KERNEL_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def _flash_gpu(q, k, v, ids):
    """JAX's GPU flash attention: q, k, v [b, t, heads, d]; rows a multiple of 16 tokens."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    block = next(n for n in (128, 64, 32, 16) if q.shape[1] % n == 0)
    small = min(block, 32)
    sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=small, block_kv_dkv=small,
                                        block_q_dq=small, block_kv_dq=small)
    return pallas_attention.mha(q, k, v, ids, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=sizes,
                                interpret=jax.default_backend() != "gpu")


def _splash_tpu(q, k, v, ids):
    """JAX's TPU splash attention: q, k, v [b, t, heads, d]; rows a multiple of 128 tokens (a TPU lane)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
    b, t, h, d = q.shape
    block = next(n for n in (512, 256, 128) if t % n == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mha(splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * h),
                                    head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                    interpret=jax.default_backend() != "tpu")
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
        heads_first(q * (d ** -0.5)).astype(q.dtype), heads_first(k), heads_first(v), ids)
    return heads_first(out)


TRAIN_KERNELS = {"pallas_gpu": (_flash_gpu, 16), "pallas_tpu": (_splash_tpu, 128)}  # kernel, rows a multiple of


@flax.struct.dataclass
class KernelSegments:
    """The full-sequence mode's segment ids [b, t] for a fused kernel, and which (`TRAIN_ATTENTION`)."""
    ids: jax.Array
    kernel: str = flax.struct.field(pytree_node=False, default="pallas_gpu")


def attend_segments_pallas(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                           constrain=None, kernel: str = "pallas_gpu") -> jax.Array | None:
    """Causal attention within segments through a Pallas kernel: q [b, t, heads, d]; k, v [b, kv_heads, t, d];
    segment_ids [b, t] (equal ids attend, causally). None where the kernel does not apply (rows not a multiple of
    its block, or the sequence split over a mesh axis): the caller takes the xla path."""
    fn, multiple = TRAIN_KERNELS[kernel]
    b, t, h, d = q.shape
    if t % multiple:
        return None
    group = h // k.shape[1]  # grouped-query heads: each key / value head repeated for its query heads
    k = jnp.repeat(k.transpose(0, 2, 1, 3), group, axis=2)
    v = jnp.repeat(v.transpose(0, 2, 1, 3), group, axis=2)
    if constrain is None:
        return fn(q, k, v, segment_ids)
    spec = spec_for(q.shape, ("batch", "seq", "q_heads", "head_dim"), constrain.rules, constrain.mesh)
    if spec[1] is not None:  # context parallelism: each shard would miss the other shards' keys
        return None
    return jax.shard_map(fn, mesh=constrain.mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(spec[0], None)),
                         out_specs=spec, check_vma=False)(q, k, v, segment_ids)


class Cache(Protocol):
    """What the cached forward mode needs from a KV cache (dense here, paged in the engine).

    `attend_layer` stores the new keys/values of layer i and attends the queries over everything
    cached for their rows; `advance` returns the cache after all layers, given their new state.
    """

    def attend_layer(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array,
                     constrain) -> tuple[jax.Array, Any]: ...

    def advance(self, layer_states: list, num_new: jax.Array | None) -> "Cache": ...


@flax.struct.dataclass
class KVCache:
    """Dense KV cache for cached decoding.

    k, v: one array per layer, each [batch, kv_heads, max_len, head_dim] (the layout that decodes
    fastest here, see docs/architecture.md, Conventions); lengths: [batch] int32, tokens already written per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or _dtype(cfg.dtype)
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def attend_layer(self, i, q, k, v, constrain):
        """q [b, t, h, d], k/v [b, t, kv, d] -> (out [b, t, h, d], (cache k_i, cache v_i))."""
        k = _write_rows(self.k[i], k.transpose(0, 2, 1, 3), self.lengths)
        v = _write_rows(self.v[i], v.transpose(0, 2, 1, 3), self.lengths)
        if constrain is not None:
            k = constrain(k, ("batch", "kv_heads", "cache_seq", "head_dim"))
            v = constrain(v, ("batch", "kv_heads", "cache_seq", "head_dim"))
        q_abs = self.lengths[:, None] + jnp.arange(q.shape[1])[None, :]  # cache index of each query
        mask = jnp.arange(self.max_len)[None, None, :] <= q_abs[:, :, None]
        return attend(q, k.astype(q.dtype), v.astype(q.dtype), mask), (k, v)

    def advance(self, layer_states, num_new):
        return KVCache(k=tuple(s[0] for s in layer_states), v=tuple(s[1] for s in layer_states),
                       lengths=self.lengths + num_new)


def _write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes new [b, kv, t, d] into cache [b, kv, s, d] at per-row offsets starts [b]."""

    def one(c, n, s):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0, s, 0))

    return jax.vmap(one)(cache, new, starts)


class Adapter(nnx.LoRA):
    """LoRA on one projection: x @ A @ B * scale (A [in, rank] random, B [rank, out] zero: a new adapter changes
    nothing), its parameters `nnx.LoRAParam`s (the trainer trains only those when the model has adapters)."""

    def __init__(self, in_features: int, rank: int, out_features: int, scale: float, rngs: nnx.Rngs):
        super().__init__(in_features, rank, out_features, rngs=rngs)
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        return (super().__call__(x.astype(jnp.float32)) * self.scale).astype(x.dtype)


def _adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y (the projection `name` of x, [..., out] or [..., heads, d]) plus its adapter's term, if it has one."""
    adapter = getattr(module, name + "_lora", None)
    if adapter is None:
        return y
    return y + adapter(x).reshape(y.shape)


def split_adapters(state):
    """(LoRA adapters, everything else) of a model's state, or of a tree like it (its shardings): what a LoRA
    trainer trains and keeps frozen, and what a weight sync moves (the adapters alone)."""
    return nnx.split_state(state, nnx.LoRAParam, ...)


def add_adapters(model: "Decoder", rank: int, alpha: float, targets: Sequence[str], seed: int = 0) -> "Decoder":
    """Gives `model` (in place) LoRA adapters of `rank` on the `targets` projections of every layer, scaled by
    alpha / rank, and records them in its config; the base weights are untouched. Adapters start at zero (B = 0),
    so the adapted model computes what the base does. On a mesh, place the model again (`shard_model`)."""
    cfg = dataclasses.replace(model.cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=tuple(targets))
    rngs = nnx.Rngs(params=seed)  # a stream of its own: the base weights of a seed stay those of the same seed
    e, h, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"q_proj": (e, h * d), "k_proj": (e, kv * d), "v_proj": (e, kv * d), "o_proj": (h * d, e),
              "gate_proj": (e, m), "up_proj": (e, m), "down_proj": (m, e)}
    for layer in model.layers:
        for name in cfg.lora_targets:
            owner = layer.attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            setattr(owner, name + "_lora", Adapter(*shapes[name][:1], rank, shapes[name][1], alpha / rank, rngs))
        layer.attn.cfg = cfg
    model.cfg = cfg
    return model


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd, std = _dtype(cfg.param_dtype), cfg.init_std
        self.q_proj = _param(rngs, (e, h, d), ("embed", "q_heads", "head_dim"), std, pd)
        self.k_proj = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), std, pd)
        self.v_proj = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), std, pd)
        self.o_proj = _param(rngs, (h, d, e), ("q_heads", "head_dim", "embed"), std, pd)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, d), pd), axes=("q_heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((kv, d), pd), axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((kv, d), pd), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pd, "head_dim")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pd, "head_dim")
        self.cfg = cfg

    def __call__(self, x, positions, inv_freq, mask=None, cache=None, layer_index=0, constrain=None, segments=None):
        """x [b, t, embed] -> ([b, t, embed], this layer's new cache state or None).

        Full mode: `mask` [b, t, t]. Cached mode: the cache stores k/v and builds its own mask.
        """
        cfg, dt = self.cfg, x.dtype
        q = _adapted(self, "q_proj", x, _project_heads(x, self.q_proj[...].astype(dt)))
        k = _adapted(self, "k_proj", x, _project_heads(x, self.k_proj[...].astype(dt)))
        v = _adapted(self, "v_proj", x, _project_heads(x, self.v_proj[...].astype(dt)))
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if constrain is not None:
            q = constrain(q, ("batch", "seq", "q_heads", "head_dim"))
        if cache is None:
            out = None
            if segments is not None:
                out = attend_segments_pallas(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segments.ids,
                                             constrain, segments.kernel)
            if out is None:
                if mask is None:
                    mask = _segment_mask(segments.ids)
                out = attend_causal(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
            layer_state = None
        else:
            out, layer_state = cache.attend_layer(layer_index, q, k, v, constrain)
        # As one [b, t, h*d] x [h*d, e] matmul: written as the einsum over (h, d), XLA:CPU chose to
        # transpose the [h, d, e] weight at every call (a copy of the whole matrix per layer per step).
        b, t, h, d = out.shape
        o_proj = self.o_proj[...].astype(dt).reshape(h * d, -1)
        flat = out.reshape(b, t, h * d)
        return _adapted(self, "o_proj", flat, project(flat, o_proj)), layer_state


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, m, pd, std = cfg.hidden_size, cfg.intermediate_size, _dtype(cfg.param_dtype), cfg.init_std
        self.gate_proj = _param(rngs, (e, m), ("embed", "mlp"), std, pd)
        self.up_proj = _param(rngs, (e, m), ("embed", "mlp"), std, pd)
        self.down_proj = _param(rngs, (m, e), ("mlp", "embed"), std, pd)

    def __call__(self, x):
        dt = x.dtype
        gate = _adapted(self, "gate_proj", x, project(x, self.gate_proj[...].astype(dt)))
        up = _adapted(self, "up_proj", x, project(x, self.up_proj[...].astype(dt)))
        act = jax.nn.silu(gate) * up
        return _adapted(self, "down_proj", act, project(act, self.down_proj[...].astype(dt)))


class PatchEmbed(nnx.Module):
    """Image patches -> token-stream embeddings: a linear map of the patch's pixels plus a learned
    embedding of its index within its image (raster order), as a ViT's patch embedding.

    There is no separate image encoder: the decoder's own layers read the patch embeddings.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, pd, std = cfg.hidden_size, _dtype(cfg.param_dtype), cfg.init_std
        self.proj = _param(rngs, (cfg.image_patch_dim, e), ("patch", "embed"), std, pd)
        self.bias = nnx.Param(jnp.zeros((e,), pd), axes=("embed",))
        self.position = _param(rngs, (cfg.max_image_patches, e), ("image_patches", "embed"), std, pd)

    def __call__(self, patches: jax.Array, patch_index: jax.Array) -> jax.Array:
        """patches [b, t, patch_dim] (compute dtype), patch_index [b, t] -> [b, t, embed].

        Indices outside [0, max_image_patches) are clipped (the decoder masks the -1 of non-patches).
        """
        dt = patches.dtype
        position = self.position[...]
        index = jnp.clip(patch_index, 0, position.shape[0] - 1)
        return (patches @ self.proj[...].astype(dt) + self.bias[...].astype(dt)
                + jnp.take(position, index, axis=0).astype(dt))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, mask=None, cache=None, layer_index=0, constrain=None, segments=None):
        h, new_kv = self.attn(self.input_norm(x), positions, inv_freq, mask, cache, layer_index,
                              constrain, segments)
        x = x + checkpoint_name(h, "attention_out")
        x = x + checkpoint_name(self.mlp(self.post_attn_norm(x)), "mlp_out")
        if constrain is not None:
            x = constrain(x, ("batch", "seq", None))
        return x, new_kv


class Decoder(nnx.Module):
    """The causal LM: embed -> blocks -> final norm -> logits (float32)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                            cfg.init_std, pd)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        # Set when the model is placed on a mesh (sharding.py): a static (mesh, rules) callable
        # that pins activations to their logical layout; None on a single device.
        self.activation_sharding = None
        # `REMAT_POLICIES`' name for the full-sequence mode, set by the trainer (`trainer.remat`); static
        self.remat = "none"
        # the full-sequence mode's layers as one `jax.lax.scan` over their stacked weights (`trainer.scan_layers`):
        # one compiled layer instead of num_layers; static
        self.scan_layers = False
        # TRAIN_ATTENTION's name for the full-sequence mode, set by the trainer (`trainer.attention_impl`); static
        self.train_attention = "xla"
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, pd)
        if cfg.is_vision:  # created last: the text parameters equal a text-only model's of the same seed
            self.patch_embed = PatchEmbed(cfg, rngs)
        if cfg.lora_rank:  # from a stream of their own: the base weights equal an unadapted model's
            add_adapters(self, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)

    def _scanned_layers(self, x, positions, inv_freq, mask, constrain, segments, policy):
        """The full-sequence mode's layers as one scan over their weights stacked on a leading axis (every layer
        has the same structure), each step rematerialised by `policy` when remat is on."""
        split = [nnx.split(layer) for layer in self.layers]
        graphdef = split[0][0]
        stacked = jax.tree.map(lambda *w: jnp.stack(w), *(state for _, state in split))

        def body(h, weights):
            return nnx.merge(graphdef, weights)(h, positions, inv_freq, mask, None, 0, constrain, segments)[0], None
        if self.remat != "none":
            body = jax.checkpoint(body, policy=policy)
        return jax.lax.scan(body, x, stacked)[0]

    def __call__(
        self,
        tokens: jax.Array,  # [b, t] int32
        positions: jax.Array,  # [b, t] int32 RoPE positions
        *,
        segment_ids: jax.Array | None = None,  # [b, t]; full mode only; equal ids attend
        cache: Cache | None = None,  # KVCache here; the engine's PagedKV
        num_new: jax.Array | None = None,  # [b] real tokens per row (cached mode); default t
        patches: jax.Array | None = None,  # [b, t, patch_dim] float; vision models only
        patch_index: jax.Array | None = None,  # [b, t] int: index in its image, -1: not a patch
        return_hidden: bool = False,
    ) -> tuple[jax.Array, Cache | None]:
        """Returns (logits [b, t, vocab] float32 (or final hidden [b, t, embed]), updated cache).

        Without `patches` every position takes its token embedding (a text-only call, and a decode
        step: generated tokens are text even when one is the image placeholder id).
        """
        cfg = self.cfg
        dt = _dtype(cfg.dtype)
        b, t = tokens.shape
        constrain = self.activation_sharding
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if (patches is None) != (patch_index is None):
            raise ValueError("patches and patch_index go together")
        if patches is not None:
            if not cfg.is_vision:
                raise ValueError("patches given to a text-only model (image_patch_dim=0)")
            image = self.patch_embed(patches.astype(dt), patch_index)
            x = jnp.where((patch_index >= 0)[..., None], image, x)
        if constrain is not None:
            x = constrain(x, ("batch", "seq", None))
        inv_freq = jnp.asarray(rope_inv_freq(cfg))  # a compile-time constant, not state
        mask = segments = None
        if cache is None and self.train_attention in TRAIN_KERNELS:  # the kernel takes the ids, not a mask
            ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
            segments = KernelSegments(ids, self.train_attention)
        elif cache is None:
            mask = _segment_mask(segment_ids, b, t)
        elif segment_ids is not None:
            raise ValueError("segment_ids apply to the full-sequence mode, not the cached mode")
        layer_states = []
        policy = REMAT_POLICIES[self.remat] if cache is None else None
        if cache is None and self.scan_layers:
            x = self._scanned_layers(x, positions, inv_freq, mask, constrain, segments, policy)
        for i, layer in enumerate(self.layers if cache is not None or not self.scan_layers else ()):
            if self.remat != "none" and cache is None:  # the layer as a pure function of its weights and input
                graphdef, weights = nnx.split(layer)
                x, state = jax.checkpoint(
                    lambda w, h, g=graphdef, i=i: nnx.merge(g, w)(h, positions, inv_freq, mask, None, i, constrain,
                                                                  segments),
                    policy=policy)(weights, x)
            else:
                x, state = layer(x, positions, inv_freq, mask, cache, i, constrain, segments)
            layer_states.append(state)
        x = self.final_norm(x)
        new_cache = None
        if cache is not None:
            added = jnp.full((b,), t, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
            new_cache = cache.advance(layer_states, added)
        if return_hidden:
            return x, new_cache
        logits = self.logits(x)
        if constrain is not None:
            logits = constrain(logits, ("batch", "seq", "vocab"))
        return logits, new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden [b, t, embed] -> logits [b, t, vocab] in float32."""
        dt = hidden.dtype
        if self.cfg.tie_word_embeddings:
            return project(hidden, self.embed[...].astype(dt), out_in=True, f32=True)
        return project(hidden, self.lm_head[...].astype(dt), f32=True)


def merge_adapters(model: "Decoder") -> "Decoder":
    """A model without adapters computing what `model` does: each adapted weight W + scale * A @ B (an export's
    form, `hf_io.save_hf_checkpoint`). `model` itself when it has none."""
    if not model.cfg.lora_rank:
        return model
    plain = nnx.eval_shape(lambda: Decoder(dataclasses.replace(model.cfg, lora_rank=0), rngs=nnx.Rngs(0)))
    nnx.update(plain, split_adapters(nnx.state(model))[1])
    for layer, source in zip(plain.layers, model.layers):
        for owner, adapted in ((layer.attn, source.attn), (layer.mlp, source.mlp)):
            for name in model.cfg.lora_targets:
                adapter = getattr(adapted, name + "_lora", None)
                if adapter is not None:
                    w = getattr(owner, name)
                    delta = adapter.scale * (adapter.lora_a[...] @ adapter.lora_b[...])
                    w[...] = (w[...].astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    plain.activation_sharding = model.activation_sharding
    return plain


def init_decoder(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised decoder on the default device (see `sharding.init_sharded` for meshes)."""
    return Decoder(cfg, rngs=nnx.Rngs(seed))
