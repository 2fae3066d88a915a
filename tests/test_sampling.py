"""The on-device sampler draws from the distribution it reports (checked on many draws)."""

import jax
import jax.numpy as jnp
import numpy as np

from tiderl_jax.engine.sampling import row_keys, sample


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, n=20000):
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    tok, lps, lpm = jax.jit(lambda r, s: sample(
        r, jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p),
        row_keys(s, jnp.zeros(n, jnp.int32)), filtered=True))(rows, jnp.arange(n))
    return np.asarray(tok), np.asarray(lps), np.asarray(lpm)


LOGITS = np.log(np.asarray([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]))


def test_empirical_frequencies_match_the_tempered_distribution():
    for temperature in (1.0, 0.5):
        tok, lps, lpm = _draw(LOGITS, temperature)
        p = jax.nn.softmax(jnp.asarray(LOGITS) / temperature)
        freq = np.bincount(tok, minlength=len(LOGITS)) / len(tok)
        np.testing.assert_allclose(freq, np.asarray(p), atol=0.012)
        np.testing.assert_allclose(np.exp(lps), np.asarray(p)[tok], rtol=1e-5)
        np.testing.assert_allclose(lpm, LOGITS[tok] - np.log(np.exp(LOGITS).sum()), rtol=1e-5)


def test_top_k_and_top_p_renormalise_over_the_kept_tokens():
    tok, lps, _ = _draw(LOGITS, top_k=2)
    assert set(tok) == {0, 1}
    np.testing.assert_allclose(np.bincount(tok) / len(tok), [0.4 / 0.65, 0.25 / 0.65], atol=0.012)
    tok, lps, _ = _draw(LOGITS, top_p=0.7)  # 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15: three kept
    assert set(tok) == {0, 1, 2}
    np.testing.assert_allclose(np.exp(lps), (np.exp(LOGITS) / 0.8)[tok], rtol=1e-5)


def test_greedy_rows_take_the_argmax_with_zero_sampling_logprob():
    tok, lps, lpm = _draw(LOGITS, temperature=0.0, n=16)
    assert (tok == 0).all() and (lps == 0).all()


def test_a_token_without_mass_is_never_drawn_even_at_u_zero(monkeypatch):
    from tiderl_jax.engine import sampling
    monkeypatch.setattr(sampling, "_uniform", lambda keys, stream=None: jnp.zeros(keys.shape[0]))
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.25, 0.3]]))  # top-k 2 keeps tokens 1 and 3: token 0 has no mass
    keys = row_keys(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    tok, lps, _ = sample(logits, jnp.ones(1), jnp.full(1, 2, jnp.int32), jnp.ones(1), keys, filtered=True)
    assert int(tok[0]) == 1 and np.isfinite(float(lps[0]))  # the first token with mass
    # a uniform rounded up to the whole mass: the last token with mass, not the cut one after it
    scaled = jnp.asarray([[0.0, 1.0, -jnp.inf]])
    assert int(sampling._draw(scaled, jax.nn.logsumexp(scaled, axis=-1), jnp.ones(1))[0]) == 1


def test_the_residual_never_draws_the_rejected_draft_even_at_u_zero(monkeypatch):
    from tiderl_jax.engine import sampling
    # draft 0 (mass 0.5) rejected (acceptance uniform 0.999), then the residual's draw at u == 0
    monkeypatch.setattr(sampling, "verify_uniforms", lambda keys: (jnp.full(keys.shape, 0.999), jnp.zeros(keys.shape)))
    logits = jnp.log(jnp.asarray([[[0.5, 0.2, 0.3], [0.2, 0.3, 0.5]]]))
    keys = row_keys(jnp.zeros(2, jnp.int32), jnp.arange(2)).reshape(1, 2)
    tok, lps, _, n = sampling.verify_drafts(logits, jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1),
                                            jnp.zeros(1, jnp.int32), jnp.ones(1), keys, filtered=False)
    assert int(n[0]) == 1 and int(tok[0, 0]) == 1 and np.isfinite(float(lps[0, 0]))
