"""Context-parallel attention equals single-device attention: ring (prompt) and sharded prefix (replay),
forward and gradients, alone and inside the decoder as LongStraw's prompt state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl.context_parallel import (ContextParallelKV, attend_sharded_prefix, reference_attention,
                                            ring_attention)
from tiderl_jax.rl.longstraw import PromptKV

B, T_PROMPT, HEADS, KV_HEADS, D, T_NEW = 1, 64, 4, 2, 16, 8
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, qk_norm=True)


def _mesh(n, names=("context",)):
    shape = (len(jax.devices()) // n, n) if len(names) == 2 else (n,)
    return Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _out_and_grads(fn, args, weight):
    """fn(*args) and the gradient of sum(fn(*args) * weight) w.r.t. every arg, in one jitted program."""
    def both(*a):
        out, pullback = jax.vjp(fn, *a)
        return out, pullback(weight)

    return jax.jit(both)(*args)


def _assert_close(got, want, atol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_equals_reference(n, causal):
    rng = np.random.default_rng(n)
    q, k, v = _normal(rng, B, T_PROMPT, HEADS, D), *(_normal(rng, B, T_PROMPT, KV_HEADS, D) for _ in "kv")
    weight = _normal(rng, B, T_PROMPT, HEADS, D)
    mesh = _mesh(n)
    seq = NamedSharding(mesh, P(None, "context"))
    out, grads = _out_and_grads(lambda *a: ring_attention(*a, mesh=mesh, causal=causal),
                                jax.device_put((q, k, v), seq), weight)
    assert out.sharding.spec == P(None, "context")
    want, want_grads = _out_and_grads(lambda *a: reference_attention(*a, causal=causal), (q, k, v), weight)
    _assert_close(out, want)
    _assert_close(grads, want_grads)


def test_ring_attention_keeps_other_mesh_axes_automatic():
    """A (data 2, context 4) mesh: the batch stays split over data, the ring runs over context only."""
    rng = np.random.default_rng(0)
    q, k, v = _normal(rng, 2, 32, HEADS, D), *(_normal(rng, 2, 32, KV_HEADS, D) for _ in "kv")
    mesh = _mesh(4, ("data", "context"))
    placed = jax.device_put((q, k, v), NamedSharding(mesh, P("data", "context")))
    weight = _normal(rng, *q.shape)
    out, grads = _out_and_grads(lambda *a: ring_attention(*a, mesh=mesh), placed, weight)
    want, want_grads = _out_and_grads(reference_attention, (q, k, v), weight)
    _assert_close(out, want)
    _assert_close(grads, want_grads)


@pytest.mark.parametrize("n,padded", [(2, True), (4, False), (8, True)], ids=["n2-padded", "n4", "n8-padded"])
def test_attend_sharded_prefix_equals_reference(n, padded):
    rng = np.random.default_rng(10 + n)
    q = _normal(rng, B, T_NEW, HEADS, D)
    k_new, v_new = (_normal(rng, B, T_NEW, KV_HEADS, D) for _ in "kv")
    k_pre, v_pre = (_normal(rng, B, KV_HEADS, T_PROMPT, D) for _ in "kv")
    # Padding: the last 13 prompt positions, so the last device's block is all padding when n = 8.
    valid = jnp.arange(T_PROMPT) < T_PROMPT - 13 if padded else None
    weight = _normal(rng, *q.shape)
    mesh = _mesh(n)
    prefix = jax.device_put((k_pre, v_pre), NamedSharding(mesh, P(None, None, "context")))
    replicated = jax.device_put((q, k_new, v_new), NamedSharding(mesh, P()))
    out, grads = _out_and_grads(
        lambda q, kn, vn, kp, vp: attend_sharded_prefix(q, kn, vn, kp, vp, mesh=mesh, prefix_valid=valid),
        (*replicated, *prefix), weight)
    want, want_grads = _out_and_grads(
        lambda q, kn, vn, kp, vp: reference_attention(q, kn, vn, k_prefix=kp, v_prefix=vp,
                                                      prefix_valid=valid),
        (q, k_new, v_new, k_pre, v_pre), weight)
    _assert_close(out, want)
    _assert_close(grads, want_grads)
    if padded:  # padding keys get no gradient
        assert not np.asarray(grads[3])[:, :, T_PROMPT - 13:].any()


# ------------------------------------------------------------------------------------- decoder


def _prompt_state(graphdef, params, prompt, cache):
    """LongStraw's prompt forward, with a given empty cache: (K/V cache, hidden states [P, embed])."""
    model = nnx.merge(graphdef, params)
    positions = jnp.arange(prompt.shape[-1], dtype=jnp.int32)[None]
    hidden, kv = model(prompt, positions, cache=cache, return_hidden=True)
    return kv, hidden[0]


def _exact_loss(graphdef, empty, prompt, response, weight):
    """LongStraw's exact loss of one response, a function of (params, the prompt's real length):
    the prompt forward (right padding after `length`), then the replay on its K/V, as longstraw.py does."""
    def loss(params, length):
        kv, hidden = _prompt_state(graphdef, params, prompt, empty)
        last = jax.lax.dynamic_index_in_dim(hidden, length - 1, keepdims=False)
        if isinstance(kv, ContextParallelKV):  # PromptKV's prompt is not padded here
            kv = kv.replace(valid=jnp.arange(kv.k[0].shape[2]) < length)
        model = nnx.merge(graphdef, params)
        positions = length + jnp.arange(response.shape[0], dtype=jnp.int32)[None]
        out, _ = model(response[None], positions, cache=kv, return_hidden=True)
        before = jnp.concatenate([last[None], out[0, :-1]])  # the state before each response token
        logp = jax.nn.log_softmax(model.logits(before[None])[0], axis=-1)
        return -(jnp.take_along_axis(logp, response[:, None], axis=-1)[:, 0] * weight).sum()

    return loss


@pytest.mark.parametrize("n,real_len", [(4, T_PROMPT), (8, T_PROMPT - 3)], ids=["n4", "n8-padded"])
def test_decoder_prompt_and_replay_with_context_parallel_kv_equal_promptkv(n, real_len):
    rng = np.random.default_rng(n)
    prompt = rng.integers(0, CFG.vocab_size, T_PROMPT)
    response = jnp.asarray(rng.integers(0, CFG.vocab_size, T_NEW), jnp.int32)
    weight = _normal(rng, T_NEW)
    graphdef, params = nnx.split(init_decoder(CFG, seed=7))
    length = jnp.int32(real_len)

    # One device, PromptKV, the unpadded prompt.
    single = PromptKV.empty(CFG.num_layers, KV_HEADS, D, jnp.float32)
    real = jnp.asarray(prompt[:real_len], jnp.int32)[None]
    want_kv, want_hidden = jax.jit(_prompt_state, static_argnums=0)(graphdef, params, real, single)
    want_loss, want_grads = jax.jit(jax.value_and_grad(
        _exact_loss(graphdef, single, real, response, weight)))(params, length)

    # n devices, ContextParallelKV, the prompt (right-padded to T_PROMPT) sharded along its sequence.
    mesh = _mesh(n)
    cp = ContextParallelKV.empty(CFG.num_layers, KV_HEADS, D, jnp.float32, mesh=mesh)
    tokens = jax.device_put(jnp.asarray(prompt, jnp.int32)[None], NamedSharding(mesh, P(None, "context")))
    on_mesh = jax.device_put(params, NamedSharding(mesh, P()))
    kv, hidden = jax.jit(_prompt_state, static_argnums=0)(graphdef, on_mesh, tokens, cp)
    assert kv.k[0].sharding.spec == P(None, None, "context") and kv.k[0].shape[2] == T_PROMPT
    _assert_close(tuple(x[:, :, :real_len] for x in kv.k + kv.v), want_kv.k + want_kv.v)
    _assert_close(hidden[real_len - 1], want_hidden[-1])
    loss, grads = jax.jit(jax.value_and_grad(
        _exact_loss(graphdef, cp, tokens, response, weight)))(on_mesh, length)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _assert_close(grads, want_grads, atol=1e-5)


def test_sharded_model_with_fsdp_as_the_context_axis():
    """A model placed by `shard_model` pins its activations by the rules: with ("seq", "fsdp") and
    ("cache_seq", "fsdp") the prompt stays split over fsdp (the context axis) through every layer."""
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rules = tuple((name, "fsdp") if name in ("seq", "cache_seq") else (name, axes)
                  for name, axes in DEFAULT_RULES)
    graphdef, params = nnx.split(shard_model(init_decoder(CFG, seed=7), mesh, rules))
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, T_PROMPT), jnp.int32)[None]
    cp = ContextParallelKV.empty(CFG.num_layers, KV_HEADS, D, jnp.float32, mesh=mesh, axis="fsdp")
    forward = jax.jit(_prompt_state, static_argnums=0)
    kv, hidden = forward(graphdef, params, jax.device_put(prompt, NamedSharding(mesh, P(None, "fsdp"))), cp)
    assert kv.k[1].sharding.spec == P(None, None, "fsdp")
    single_graphdef, single = nnx.split(init_decoder(CFG, seed=7))
    want_kv, want_hidden = forward(single_graphdef, single, prompt,
                                   PromptKV.empty(CFG.num_layers, KV_HEADS, D, jnp.float32))
    _assert_close(kv.k + kv.v, want_kv.k + want_kv.v)
    _assert_close(hidden, want_hidden)


# ------------------------------------------------------------------------------------- refusals


def test_bad_inputs_are_refused_with_the_problem_named():
    rng = np.random.default_rng(0)
    q, k = _normal(rng, 1, 12, HEADS, D), _normal(rng, 1, 12, KV_HEADS, D)
    with pytest.raises(ValueError, match="length 12 is not divisible by the size 8 of mesh axis 'context'"):
        ring_attention(q, k, k, mesh=_mesh(8))
    with pytest.raises(ValueError, match="'seq' is not an axis of the mesh"):
        ring_attention(q, k, k, mesh=_mesh(4), axis="seq")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        ContextParallelKV.empty(2, KV_HEADS, D, jnp.float32, mesh=_mesh(4, ("data", "model")))
    prefix = _normal(rng, 1, KV_HEADS, 12, D)
    with pytest.raises(ValueError, match="prefix length 12 is not divisible"):
        attend_sharded_prefix(q, k, k, prefix, prefix, mesh=_mesh(8))
    with pytest.raises(ValueError, match=r"prefix_valid shape \(11,\) must be \(12,\)"):
        attend_sharded_prefix(q, k, k, prefix, prefix, mesh=_mesh(4), prefix_valid=jnp.ones(11, bool))
    with pytest.raises(ValueError, match="heads 4 a multiple of kv_heads 3"):
        ring_attention(q, _normal(rng, 1, 12, 3, D), _normal(rng, 1, 12, 3, D), mesh=_mesh(4))
