"""LongStraw's exact mode equals the standard full-sequence gradient; its approximate mode is close to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl.longstraw import longstraw_grad, standard_grad, tree_cosine

CONFIGS = {
    "qwen3": ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
    "llama": ModelConfig(arch="llama", vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         tie_word_embeddings=False),
}
MODELS = {name: init_decoder(cfg, seed=7) for name, cfg in CONFIGS.items()}


def ppo_kl_loss(logp, mask, extra):
    """A PPO-clip token-mean loss with a k3 KL penalty: per-response inputs of every kind."""
    ratio = jnp.exp(logp - extra["old_logp"])
    adv = extra["advantage"]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
    kl = jnp.exp(extra["ref_logp"] - logp) - (extra["ref_logp"] - logp) - 1
    per_token = -surrogate + 0.1 * kl
    return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1)


def _group(lengths, prompt_len=24, width=8, seed=0):
    """One prompt [P], right-padded responses [G, width] of the given lengths, their mask and inputs."""
    rng = np.random.default_rng(seed)
    g = len(lengths)
    prompt = rng.integers(0, 384, prompt_len)
    responses = rng.integers(0, 384, (g, width))
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    extra = {"advantage": jnp.asarray(rng.normal(size=g), jnp.float32),
             "old_logp": jnp.asarray(-6 + 0.1 * rng.normal(size=(g, width)), jnp.float32),
             "ref_logp": jnp.asarray(-6 + 0.1 * rng.normal(size=(g, width)), jnp.float32)}
    return prompt, responses, mask, extra


def _rel_diff(a, b):
    """Global norm of a - b over global norm of b."""
    sq = lambda t: sum(float(jnp.vdot(x, x)) for x in jax.tree.leaves(t))  # noqa: E731
    return np.sqrt(sq(jax.tree.map(jnp.subtract, a, b)) / sq(b))


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("lengths", [[5], [8, 3, 1]], ids=["G1", "G3-ragged"])
def test_exact_mode_equals_standard_gradient(arch, lengths):
    group = _group(lengths)
    want_loss, want = standard_grad(MODELS[arch], *group[:3], ppo_kl_loss, group[3])
    loss, grads = longstraw_grad(MODELS[arch], *group[:3], ppo_kl_loss, group[3], mode="exact")
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert _rel_diff(grads, want) < 1e-5


def test_approximate_mode_is_close_but_not_equal():
    group = _group([8, 6, 2, 7], prompt_len=32)
    want_loss, want = standard_grad(MODELS["qwen3"], *group[:3], ppo_kl_loss, group[3])
    loss, grads = longstraw_grad(MODELS["qwen3"], *group[:3], ppo_kl_loss, group[3], mode="approximate")
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)  # the same forward
    assert float(tree_cosine(grads, want)) > 0.5
    assert _rel_diff(grads, want) > 1e-2  # the prompt's share of the gradient is missing


def test_first_token_gradient_reaches_the_prompt_only_in_exact_mode():
    """A loss on each response's first token only: its log-prob comes from the prompt's last state."""
    model = MODELS["llama"]
    prompt, responses, _, extra = _group([1, 1])
    mask = np.zeros(responses.shape, bool)
    mask[:, 0] = True
    _, want = standard_grad(model, prompt, responses, mask, ppo_kl_loss, extra)
    _, exact = longstraw_grad(model, prompt, responses, mask, ppo_kl_loss, extra, mode="exact")
    _, approx = longstraw_grad(model, prompt, responses, mask, ppo_kl_loss, extra, mode="approximate")
    assert _rel_diff(exact, want) < 1e-5
    layer = lambda g: g["layers"][0]["attn"]["q_proj"][...]  # noqa: E731
    assert np.abs(np.asarray(layer(want))).max() > 0
    assert np.abs(np.asarray(layer(approx))).max() == 0  # prompt state constant: only the head learns
    assert _rel_diff(approx["lm_head"][...], want["lm_head"][...]) < 1e-5


def test_exact_mode_on_the_8_device_mesh_equals_single_device_standard():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    sharded = shard_model(init_decoder(CONFIGS["qwen3"], seed=7), mesh, DEFAULT_RULES)
    assert len(sharded.layers[0].mlp.up_proj[...].sharding.device_set) == 8
    group = _group([8, 4, 6])
    want_loss, want = standard_grad(MODELS["qwen3"], *group[:3], ppo_kl_loss, group[3])
    loss, grads = longstraw_grad(sharded, *group[:3], ppo_kl_loss, group[3], mode="exact")
    assert len(grads["layers"][0]["mlp"]["up_proj"][...].sharding.device_set) == 8
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert _rel_diff(grads, want) < 1e-5


def test_bad_groups_are_refused_with_the_input_named():
    model = MODELS["qwen3"]
    prompt, responses, mask, extra = _group([3, 2])
    with pytest.raises(ValueError, match="mode="):
        longstraw_grad(model, prompt, responses, mask, ppo_kl_loss, extra, mode="fast")
    with pytest.raises(ValueError, match="empty group"):
        longstraw_grad(model, prompt, responses[:0], mask[:0], ppo_kl_loss, extra)
    with pytest.raises(ValueError, match="response_mask shape"):
        standard_grad(model, prompt, responses, mask[:, :3], ppo_kl_loss, extra)
    with pytest.raises(ValueError, match="prompt"):
        longstraw_grad(model, prompt[:0], responses, mask, ppo_kl_loss, extra)
