"""The decoder's two forward modes agree with each other, and packing, ragged batches and sampling work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ARCHS, FIXTURES
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import KVCache, init_decoder
from tiderl_jax.model.generate import generate
from tiderl_jax.model.hf_io import load_hf_checkpoint

TINY = ModelConfig(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=256)


def _models():
    return {"tiny": init_decoder(TINY, seed=1),
            **{a: load_hf_checkpoint(FIXTURES / a) for a in ARCHS}}


MODELS = _models()


@nnx.jit
def _call(model, tokens, positions, **kw):
    """The model's forward as one program (eager, every op of every new shape compiles on its own)."""
    return model(tokens, positions, **kw)


def _full(model, tokens, start=0):
    tokens = jnp.asarray(tokens)
    pos = jnp.broadcast_to(jnp.arange(start, start + tokens.shape[1]), tokens.shape)
    return np.asarray(_call(model, tokens, pos)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decode_equals_full_forward_token_by_token(name):
    model = MODELS[name]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.cfg.vocab_size, (2, 20)).astype(np.int32)
    want = _full(model, tokens)
    cache = KVCache.init(model.cfg, 2, 32)
    prefix = 7
    pos = jnp.broadcast_to(jnp.arange(prefix), (2, prefix))
    got, cache = _call(model, jnp.asarray(tokens[:, :prefix]), pos, cache=cache)
    np.testing.assert_allclose(np.asarray(got), want[:, :prefix], atol=1e-5, rtol=0)
    for t in range(prefix, 20):
        step, cache = _call(model, jnp.asarray(tokens[:, t:t + 1]), jnp.full((2, 1), t), cache=cache)
        np.testing.assert_allclose(np.asarray(step)[:, 0], want[:, t], atol=1e-5, rtol=0,
                                   err_msg=f"{name}: decode step {t}")
    assert np.asarray(cache.lengths).tolist() == [20, 20]


@pytest.mark.parametrize("name", ["tiny", "qwen2"])
def test_ragged_prefill_then_decode(name):
    """Rows of different true lengths in one padded prefill behave as if run alone."""
    model = MODELS[name]
    rng = np.random.default_rng(1)
    lens = [5, 11]
    seqs = [rng.integers(0, model.cfg.vocab_size, (n + 3,)).astype(np.int32) for n in lens]
    padded = np.zeros((2, 16), np.int32)
    for i, n in enumerate(lens):
        padded[i, :n] = seqs[i][:n]
    cache = KVCache.init(model.cfg, 2, 32)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    logits, cache = _call(model, jnp.asarray(padded), pos, cache=cache, num_new=jnp.asarray(lens))
    assert np.asarray(cache.lengths).tolist() == lens
    for i, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits)[i, :n], _full(model, seqs[i][None, :n])[0],
                                   atol=1e-5, rtol=0)
    for k in range(3):  # decode the remaining 3 tokens of each row together
        tok = np.asarray([[seqs[i][n + k]] for i, n in enumerate(lens)], np.int32)
        step, cache = _call(model, jnp.asarray(tok), cache.lengths[:, None], cache=cache)
        for i, n in enumerate(lens):
            want = _full(model, seqs[i][None, : n + k + 1])[0, -1]
            np.testing.assert_allclose(np.asarray(step)[i, 0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_packed_sequences_do_not_attend_across_segments(name):
    model = MODELS[name]
    rng = np.random.default_rng(2)
    a = rng.integers(0, model.cfg.vocab_size, (9,)).astype(np.int32)
    b = rng.integers(0, model.cfg.vocab_size, (6,)).astype(np.int32)
    pad = 3
    packed = np.concatenate([a, b, np.zeros(pad, np.int32)])[None]
    segs = np.asarray([[1] * 9 + [2] * 6 + [0] * pad])
    pos = np.asarray([list(range(9)) + list(range(6)) + list(range(pad))])
    got = np.asarray(_call(model, jnp.asarray(packed), jnp.asarray(pos), segment_ids=jnp.asarray(segs))[0])
    np.testing.assert_allclose(got[0, :9], _full(model, a[None])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[0, 9:15], _full(model, b[None])[0], atol=1e-5, rtol=0)
    # Without segment ids the second sequence would see the first: the test can fail.
    unpacked = np.asarray(_call(model, jnp.asarray(packed), jnp.asarray(pos))[0])
    assert np.abs(unpacked[0, 9:15] - got[0, 9:15]).max() > 1e-3


def test_bf16_compute_tracks_fp32():
    tokens = np.random.default_rng(3).integers(0, 128, (2, 12)).astype(np.int32)
    f32 = _full(MODELS["tiny"], tokens)
    cfg16 = ModelConfig(**{**vars(TINY), "dtype": "bfloat16", "param_dtype": "bfloat16"})
    m16 = init_decoder(cfg16, seed=1)
    assert m16.embed[...].dtype == jnp.bfloat16
    b16 = _full(m16, tokens)
    assert b16.dtype == np.float32 and np.isfinite(b16).all()
    assert np.abs(b16 - f32).max() < 0.05 * np.abs(f32).max()


def _greedy_by_full_forward(model, prompt, n, width=32):
    """Greedy decoding by re-running the full forward each step (padding after the end is causal-safe)."""
    forward = nnx.jit(lambda m, t, p: m(t, p)[0])
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        logits = forward(model, jnp.asarray(padded), jnp.arange(width)[None])
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_generate_matches_full_forward_argmax():
    model = MODELS["qwen3"]
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 18]
    out = generate(model, prompts, max_new_tokens=6, temperature=0.0)
    for p, toks in zip(prompts, out.tokens):
        assert toks == _greedy_by_full_forward(model, p, 6)
    assert all(len(lp) == 6 and all(v <= 0 for v in lp) for lp in out.logprobs)


def test_generate_stops_and_is_seeded():
    model = MODELS["tiny"]
    a = generate(model, [[1, 2, 3]] * 4, max_new_tokens=12, temperature=1.0, seed=7)
    b = generate(model, [[1, 2, 3]] * 4, max_new_tokens=12, temperature=1.0, seed=7)
    assert a.tokens == b.tokens
    stop = a.tokens[0][2]
    c = generate(model, [[1, 2, 3]] * 4, max_new_tokens=12, temperature=1.0, seed=7, stop_ids=[stop])
    assert c.tokens[0] == a.tokens[0][: a.tokens[0].index(stop) + 1]
    assert all(len(t) == len(lp) for t, lp in zip(c.tokens, c.logprobs))


def test_generate_rejects_bad_prompts():
    model = MODELS["tiny"]
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        generate(model, [[1] * 250], max_new_tokens=10)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 999]], max_new_tokens=2)


def test_chunked_causal_attention_equals_the_reference_forward_and_gradients():
    import jax

    from tiderl_jax.model.decoder import attend, attend_causal
    rng = np.random.default_rng(4)
    b, t, h, kvh, d = 2, 37, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, kvh, t, d)), jnp.float32) for _ in range(2))
    segs = np.zeros((b, t), np.int32)  # packed rows: three sequences, then padding (segment 0)
    segs[0, :11], segs[0, 11:30], segs[1, :25], segs[1, 25:33] = 1, 2, 1, 2
    idx = np.arange(t)
    mask = jnp.asarray((idx[None, :, None] >= idx[None, None, :]) & (segs[:, :, None] == segs[:, None, :]))
    ref = attend(q, k, v, mask)
    for chunk in (5, 16, 37, 64):  # chunks that do not divide t, one that is t, one past it
        np.testing.assert_allclose(attend_causal(q, k, v, mask, chunk), ref, atol=1e-6, rtol=0)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, mask) * jnp.asarray(segs > 0)[:, :, None, None] * jnp.cos(q))
    got = jax.grad(lambda *x: loss(lambda *y: attend_causal(*y, chunk=8), *x), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *x: loss(attend, *x), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("out_in", [False, True])
@pytest.mark.parametrize("widths", [(8, 24), (24, 8)])
def test_project_is_the_matmul_and_its_gradient_jaxs(widths, out_in, dtype):
    """`project` (the projections' and LM head's matmul with its own backward) against the plain matmul under JAX's
    autodiff: values and both gradients, whichever of x and the output is the narrower (the one it transposes), a
    weight stored [in, out] or [out, in] (tied), float32 and bfloat16 operands with float32 accumulation."""
    from tiderl_jax.model.decoder import einsum_f32, project
    e, f = widths
    dt = jnp.dtype(dtype)
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (2, 5, e)).astype(dt)
    w = jax.random.normal(kw, (f, e) if out_in else (e, f)).astype(dt)
    probe = jax.random.normal(kg, (2, 5, f))  # a cotangent that weighs every output differently

    def reference(x, w):
        return (einsum_f32("bte,fe->btf" if out_in else "bte,ef->btf", x, w) * probe).sum()

    def fast(x, w):
        return (project(x, w, out_in=out_in, f32=True) * probe).sum()

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(jax.jit(fast)(x, w), reference(x, w), **tol)
    for a, b in zip(jax.jit(jax.grad(fast, (0, 1)))(x, w), jax.grad(reference, (0, 1))(x, w)):
        assert a.dtype == b.dtype == dt
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
    plain = project(x, w, out_in=out_in)  # without f32: x's dtype, as `x @ w`
    assert plain.dtype == dt and plain.shape == (2, 5, f)
