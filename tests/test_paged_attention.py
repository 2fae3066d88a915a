"""Paged attention: the fast path equals the obviously-correct reference; page writes land where they should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl_jax.engine.paged_attention import (PAGED_ATTENTION, TRASH_PAGE, paged_attention_reference,
                                               paged_attention_xla, resolve_impl, write_pages)
from tiderl_jax.model.decoder import attend


def _case(seed, b=3, t=4, heads=4, kvh=2, d=8, pages=12, ps=4, width=5):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    k_pool = jnp.asarray(rng.standard_normal((pages, kvh, ps, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((pages, kvh, ps, d)), jnp.float32)
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in range(b)]), jnp.int32)
    starts = jnp.asarray(rng.integers(0, width * ps - t, b), jnp.int32)
    return q, k_pool, v_pool, table, starts


@pytest.mark.parametrize("seed", range(4))
def test_xla_path_equals_reference(seed):
    args = _case(seed)
    np.testing.assert_allclose(np.asarray(paged_attention_xla(*args)),
                               np.asarray(paged_attention_reference(*args)), atol=1e-5)


def test_reference_equals_dense_attention_over_the_gathered_sequence():
    q, k_pool, v_pool, table, starts = _case(7, b=1)
    k = jnp.concatenate([k_pool[p] for p in np.asarray(table[0])], axis=1)[None]  # [1, kv, span, d]
    v = jnp.concatenate([v_pool[p] for p in np.asarray(table[0])], axis=1)[None]
    span = k.shape[2]
    q_abs = starts[0] + jnp.arange(q.shape[1])
    mask = (jnp.arange(span)[None, :] <= q_abs[:, None])[None]
    np.testing.assert_allclose(np.asarray(paged_attention_reference(q, k_pool, v_pool, table, starts)),
                               np.asarray(attend(q, k, v, mask)), atol=1e-6)


def test_write_pages_places_tokens_and_sends_padding_to_trash():
    pool = jnp.zeros((6, 1, 4, 2))
    table = jnp.asarray([[3, 5], [1, 2]], jnp.int32)
    new = jnp.arange(2 * 3 * 1 * 2, dtype=jnp.float32).reshape(2, 3, 1, 2) + 1
    out = np.asarray(write_pages(pool, new, table, jnp.asarray([2, 0]), jnp.asarray([3, 2])))
    # row 0: positions 2, 3 -> page 3 offsets 2, 3; position 4 -> page 5 offset 0
    np.testing.assert_array_equal(out[3, 0, 2], new[0, 0, 0])
    np.testing.assert_array_equal(out[3, 0, 3], new[0, 1, 0])
    np.testing.assert_array_equal(out[5, 0, 0], new[0, 2, 0])
    # row 1: 2 real tokens at page 1 offsets 0, 1; its third (padding) token went to the trash page
    np.testing.assert_array_equal(out[1, 0, :2], new[1, :2, 0])
    assert np.all(out[2] == 0) and np.any(out[TRASH_PAGE] != 0)


# ------------------------------------------------------------------------------ the CPU kernel (`cpu`)


def _kernel():
    from tiderl_jax.engine import cpu_attention
    assert cpu_attention.available(), f"the CPU kernel did not build: {cpu_attention.unavailable_reason()}"
    return cpu_attention


@pytest.mark.parametrize("seed,shape", [(0, {}), (1, dict(t=1, heads=9, kvh=3, d=64, ps=16, pages=40, width=6)),
                                        (2, dict(b=5, t=16, heads=6, kvh=1, d=16)),
                                        (3, dict(t=1, heads=2, kvh=2, d=7, ps=3, width=9, pages=30)),
                                        # prefill chunks: several query tiles of 16, the last one partial, odd
                                        # lengths and page sizes, spans crossing page boundaries mid-tile
                                        (4, dict(b=2, t=37, heads=9, kvh=3, d=64, ps=16, pages=20, width=8)),
                                        (5, dict(b=3, t=23, heads=4, kvh=2, d=20, ps=5, pages=40, width=11)),
                                        (6, dict(b=1, t=64, heads=2, kvh=1, d=32, ps=16, pages=8, width=5))])
def test_cpu_kernel_equals_reference(seed, shape):
    kernel = _kernel()
    args = _case(seed, **shape)
    np.testing.assert_allclose(np.asarray(jax.jit(kernel.paged_attention_cpu)(*args)),
                               np.asarray(paged_attention_reference(*args)), atol=2e-5, rtol=1e-5)


def test_cpu_kernel_prefill_over_a_shared_prefix_and_with_padding_queries():
    """Two rows whose tables share their first pages (a prefix-cache hit) and a third starting at 0: the kernel
    equals the reference on every real query; queries at or past a row's num_new are padding, written as zeros
    (a row of num_new 0 is all padding)."""
    kernel = _kernel()
    q, k_pool, v_pool, table, starts = _case(8, b=4, t=21, heads=6, kvh=3, d=16, ps=4, pages=30, width=12)
    table = table.at[1, :3].set(table[0, :3])  # rows 0 and 1: the same three first pages
    starts = jnp.asarray([12, 12, 0, 5], jnp.int32)
    num_new = jnp.asarray([21, 9, 14, 0], jnp.int32)
    out = np.asarray(jax.jit(kernel.paged_attention_cpu)(q, k_pool, v_pool, table, starts, num_new))
    ref = np.asarray(paged_attention_reference(q, k_pool, v_pool, table, starts))
    for row, n in enumerate(np.asarray(num_new)):
        np.testing.assert_allclose(out[row, :n], ref[row, :n], atol=2e-5, rtol=1e-5)
        assert not out[row, n:].any()
    # the engine's entry: the same through `PAGED_ATTENTION["cpu"]` with the call's num_new
    via = np.asarray(PAGED_ATTENTION["cpu"](q, k_pool, v_pool, table, starts, num_new=num_new))
    np.testing.assert_array_equal(via, out)


@pytest.mark.parametrize("t", [2, 20])
def test_cpu_kernel_reads_only_the_rows_own_pages_up_to_each_query(t):
    """Pages past a row's keys, and other rows' pages, may hold anything (NaN here): the kernel never reads them,
    for decode-sized calls and for a prefill chunk whose query tile spans several pages."""
    kernel = _kernel()
    q, k_pool, v_pool, table, starts = _case(5, b=2, t=t, width=8, pages=20, ps=4)
    starts = jnp.asarray([0, 5], jnp.int32)  # row 0's last query sees keys 0..t-1, row 1's keys 0..t+4
    used = {int(table[0, p]) for p in range((t - 1) // 4 + 1)} | {int(table[1, p]) for p in range((t + 4) // 4 + 1)}
    poison = jnp.asarray([p not in used for p in range(k_pool.shape[0])])[:, None, None, None]
    k_bad, v_bad = jnp.where(poison, jnp.nan, k_pool), jnp.where(poison, jnp.nan, v_pool)
    out = np.asarray(kernel.paged_attention_cpu(q, k_bad, v_bad, table, starts))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(paged_attention_reference(q, k_pool, v_pool, table, starts)),
                               atol=2e-5)


def test_auto_takes_the_kernel_for_float32_on_the_cpu_and_xla_elsewhere():
    _kernel()
    assert resolve_impl("auto", dtype="float32") == "cpu"
    assert resolve_impl("auto", dtype="bfloat16") == "xla"
    assert resolve_impl("reference", dtype="float32") == "reference"
    # every float32 call goes to the kernel, a prefill chunk too; others to the xla implementation
    args = _case(6, t=24, width=8)
    assert "tiderl_paged_attention" in jax.jit(PAGED_ATTENTION["cpu"]).lower(*args).as_text()
    half = tuple(x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in args)
    assert "tiderl_paged_attention" not in jax.jit(PAGED_ATTENTION["cpu"]).lower(*half).as_text()
    with pytest.raises(ValueError, match="float32 calls, not bfloat16"):  # the kernel itself refuses it
        _kernel().paged_attention_cpu(*half)


def test_a_failed_kernel_build_names_the_command_and_the_compilers_error(tmp_path, monkeypatch):
    from tiderl_jax.engine import cpu_attention
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", bad)
    monkeypatch.setenv("TIDERL_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"bad\.cc .*failed: .*error"):
        cpu_attention._build()
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-built is left for a later load
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler .*no-such-compiler"):
        cpu_attention._build()


def test_the_kernel_cache_key_follows_jaxlib_and_its_ffi_headers(tmp_path, monkeypatch):
    import shutil

    import jax
    import jaxlib

    from tiderl_jax.engine import cpu_attention
    compiler = tmp_path / "fake-c++"  # writes an empty library: no compile
    compiler.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("TIDERL_KERNEL_CACHE", str(tmp_path / "cache"))
    first = cpu_attention._build()
    assert first.exists() and cpu_attention._build() == first  # the same jaxlib: the cached library
    monkeypatch.setattr(jaxlib, "__version__", jaxlib.__version__ + ".post1")
    upgraded = cpu_attention._build()
    assert upgraded != first and upgraded.exists()
    headers = tmp_path / "include"  # the same version, other FFI headers
    shutil.copytree(jax.ffi.include_dir(), headers)
    next(headers.rglob("ffi.h")).write_text("// another version\n", encoding="utf-8")
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(headers))
    assert cpu_attention._build() not in (first, upgraded)


def test_a_tensor_parallel_engine_runs_the_cpu_kernel_per_kv_head_shard(monkeypatch):
    """`auto` takes the kernel on a sharded CPU engine too: under shard_map, each device its own kv heads' pages."""
    from flax import nnx

    from conftest import FIXTURES
    from engine_reference import greedy
    from tiderl_jax.engine import pallas_attention
    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.model.hf_io import load_hf_checkpoint
    from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
    _kernel()
    per_shard = []
    shard_map = jax.shard_map
    monkeypatch.setattr(pallas_attention.jax, "shard_map", lambda f, **kw: per_shard.append(kw) or shard_map(f, **kw))
    model = load_hf_checkpoint(FIXTURES / "qwen3")  # 2 kv heads
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 2}, devices=jax.devices()[:2])
    engine = Engine(shard_model(nnx.clone(model), mesh, DEFAULT_RULES),
                    EngineConfig(page_size=8, num_pages=64, max_seq_len=96, max_running=4, prefill_chunk=16))
    assert engine.runner.impl == "cpu" and engine.runner.k_pages[0].sharding.spec[1] == "tensor"
    prompts = [[3, 1, 4, 1, 5], list(range(40, 70))]
    for p, o in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))):
        assert o.new_tokens == greedy(model, p, 8)
    assert per_shard and per_shard[0]["in_specs"][1][1] == "tensor"
