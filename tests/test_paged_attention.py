"""Paged attention: the fast path equals the obviously-correct reference; page writes land where they should."""

import jax.numpy as jnp
import numpy as np
import pytest

from tiderl_jax.engine.paged_attention import (PAGED_ATTENTION, TRASH_PAGE, paged_attention_reference,
                                               paged_attention_xla, write_pages)
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


def test_pallas_hook_says_how_to_plug_a_kernel():
    with pytest.raises(NotImplementedError, match="register_paged_attention"):
        PAGED_ATTENTION["pallas"](*_case(0))
