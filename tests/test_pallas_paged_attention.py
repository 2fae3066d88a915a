"""JAX's Pallas paged-attention kernels in the engine (`pallas_gpu`, `pallas_tpu`), run here in Pallas' interpret
mode: the kernel calls against `reference` (decode, verify, odd lengths, page boundaries, the trash page and
pages past each query holding garbage), the kv-head-major pool layout, `auto`'s choice, and whole engines (plain,
speculative, tensor-parallel on faked devices) giving the reference's greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from engine_reference import greedy
from tiderl_jax.engine import pallas_attention
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.engine.paged_attention import (HEADS, PAGED_ATTENTION, TRASH_PAGE, paged_attention_reference,
                                               paged_attention_xla, resolve_impl, write_pages)
from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.hf_io import load_hf_checkpoint
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model

IMPLS = ("pallas_gpu", "pallas_tpu")
# the TPU kernel's dots run at the TPU's default precision (bfloat16 passes), which interpret mode reproduces
ATOL = {"pallas_gpu": 2e-5, "pallas_tpu": 2e-2}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TIDERL_PALLAS_INTERPRET", "1")


def _case(seed, b=3, t=1, heads=4, kvh=2, d=16, pages=24, ps=8, width=5, starts=None, scale=0.5):
    """q, pools (kv-head-major), page tables (unused entries on the trash page), starts."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(scale * rng.standard_normal((b, t, heads, d)), jnp.float32)
    k_pool = jnp.asarray(scale * rng.standard_normal((kvh, pages, ps, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((kvh, pages, ps, d)), jnp.float32)
    if starts is None:
        starts = rng.integers(0, width * ps - t, b)
    table = np.full((b, width), TRASH_PAGE, np.int32)
    for r in range(b):
        used = -(-(int(starts[r]) + t) // ps)  # the pages the row's keys reach
        table[r, :min(used, width)] = rng.permutation(np.arange(1, pages))[:min(used, width)]
    return q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(starts, jnp.int32)


CASES = {
    "decode": dict(),
    "decode-odd-heads": dict(heads=6, kvh=3, ps=4, width=9),
    "decode-one-page": dict(b=2, width=1, starts=[0, 6]),
    "verify": dict(t=5, starts=[0, 7, 30]),
    "page-boundaries": dict(t=3, starts=[7, 15, 6], ps=8),
    "padding-past-the-table": dict(t=4, starts=[37, 38, 0], width=5),
    "mqa": dict(heads=4, kvh=1, t=2),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_calls_equal_the_reference(impl, case):
    q, k, v, table, starts = _case(hash(case) % 1000, **CASES[case])
    out = jax.jit(PAGED_ATTENTION[impl])(q, k, v, table, starts)
    ref = paged_attention_reference(q, k, v, table, starts, HEADS)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL[impl])


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_past_each_query_and_the_trash_page_never_count(impl):
    """Garbage where no query may look (later positions of its row's pages, other pages, the trash page) must not
    move the output: an off-by-one in a row's length would add a 1e4 value."""
    q, k, v, table, starts = _case(11, t=3, starts=[2, 12, 29], width=5)
    ps = k.shape[2]
    k_bad, v_bad = np.array(k), np.array(v)
    seen = np.zeros(k.shape[1:3], bool)  # [pages, ps]: positions some query may see
    for r in range(table.shape[0]):
        last = int(starts[r]) + q.shape[1] - 1
        for pos in range(last + 1):
            seen[int(table[r, pos // ps]), pos % ps] = True
    k_bad[:, ~seen], v_bad[:, ~seen] = 1e4, 1e4
    out = np.asarray(PAGED_ATTENTION[impl](q, jnp.asarray(k_bad), jnp.asarray(v_bad), table, starts))
    np.testing.assert_allclose(out, np.asarray(paged_attention_reference(q, k, v, table, starts, HEADS)),
                               atol=ATOL[impl])


def test_prefill_chunks_take_the_xla_path_over_the_heads_layout():
    q, k, v, table, starts = _case(3, t=pallas_attention.MAX_QUERY_TOKENS + 5, width=6, starts=[0, 3, 9])
    ref = paged_attention_reference(q, k, v, table, starts, HEADS)
    np.testing.assert_allclose(np.asarray(paged_attention_xla(q, k, v, table, starts, HEADS)), np.asarray(ref),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(PAGED_ATTENTION["pallas_gpu"](q, k, v, table, starts)), np.asarray(ref),
                               atol=1e-5)


def test_heads_layout_writes_where_the_pages_layout_does():
    rng = np.random.default_rng(4)
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.float32)  # [b, t, kv, d]
    table, starts, num_new = jnp.asarray([[3, 5], [1, 2]], jnp.int32), jnp.asarray([2, 0]), jnp.asarray([3, 2])
    pages = write_pages(jnp.zeros((6, 2, 4, 4)), new, table, starts, num_new)
    heads = write_pages(jnp.zeros((2, 6, 4, 4)), new, table, starts, num_new, HEADS)
    np.testing.assert_array_equal(np.asarray(heads), np.asarray(pages).swapaxes(0, 1))


def test_off_its_platform_a_kernel_names_the_platform(monkeypatch):
    monkeypatch.delenv("TIDERL_PALLAS_INTERPRET")
    with pytest.raises(NotImplementedError, match="runs JAX's GPU paged-attention kernel, and this engine runs on cpu"):
        PAGED_ATTENTION["pallas_gpu"](*_case(0))


def test_auto_takes_the_platforms_kernel_where_its_tiles_fit(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", dtype="bfloat16", head_dim=64, page_size=16) == "pallas_gpu"
    assert resolve_impl("auto", dtype="float32", head_dim=8, page_size=16) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", dtype="bfloat16", head_dim=128, page_size=16) == "pallas_tpu"
    assert resolve_impl("auto", dtype="bfloat16", head_dim=64, page_size=16) == "xla"


# ------------------------------------------------------------------------------------------ whole engines

MODEL = load_hf_checkpoint(FIXTURES / "qwen3")  # head_dim 32, 4 heads over 2 kv heads
SMALL = dict(page_size=8, num_pages=96, max_seq_len=128, max_running=4, prefill_chunk=16, prefill_budget=32,
             decode_steps=4)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, n))) for n in lengths]


@pytest.mark.parametrize("impl", IMPLS)
def test_engine_greedy_tokens_equal_the_reference(impl):
    prompts = _prompts([1, 9, 21, 40])
    engine = Engine(MODEL, EngineConfig(**SMALL, attention_impl=impl))
    assert engine.runner.impl == impl and engine.runner.k_pages[0].shape == (2, 96, 8, 32)
    for p, o in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))):
        assert o.new_tokens == greedy(MODEL, p, 10)


def test_speculative_verification_through_the_kernel_emits_plain_decodings_tokens():
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, 256, 5))) * 4 for _ in range(3)]  # drafts get accepted
    engine = Engine(MODEL, EngineConfig(**SMALL, attention_impl="pallas_gpu", speculation="on", spec_tokens=3))
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert engine.stats()["spec_steps"] > 0
    for p, o in zip(prompts, out):
        assert o.new_tokens == greedy(MODEL, p, 16)


def test_a_tensor_parallel_engine_runs_the_kernel_per_kv_head_shard(monkeypatch):
    per_shard = []
    shard_map = jax.shard_map
    monkeypatch.setattr(pallas_attention.jax, "shard_map", lambda f, **kw: per_shard.append(kw) or shard_map(f, **kw))
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 2}, devices=jax.devices()[:2])
    sharded = shard_model(nnx.clone(MODEL), mesh, DEFAULT_RULES)
    engine = Engine(sharded, EngineConfig(**SMALL, attention_impl="pallas_gpu"))
    pool = engine.runner.k_pages[0]
    assert pool.sharding.spec[0] == "tensor" and pool.addressable_shards[0].data.shape == (1, 96, 8, 32)
    prompts = _prompts([3, 17, 30], seed=5)
    for p, o in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))):
        assert o.new_tokens == greedy(MODEL, p, 8)
    assert per_shard and per_shard[0]["in_specs"][1][0] == "tensor"  # each device its own kv head's pages
