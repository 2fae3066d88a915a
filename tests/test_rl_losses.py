"""Advantages and losses (tiderl_jax/rl): each function against a small example worked by hand."""

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from tiderl_jax.model.config import ConfigError
from tiderl_jax.rl import advantages as adv
from tiderl_jax.rl import losses
from tiderl_jax.rl.losses import LossConfig

LOG = math.log


def close(actual, expected, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, np.float32), rtol=1e-5,
                               atol=atol)


# ---------------------------------------------------------------------------------- advantages


def test_grpo_normalises_by_unbiased_group_std():
    # mean 0.5; deviations +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3; std = 0.57735;
    # A = +-0.5 / 0.57735 = +-0.866025.
    a = adv.grpo(jnp.array([[1.0, 0.0, 0.0, 1.0]]))
    close(a, [[0.866025, -0.866025, -0.866025, 0.866025]])
    # Without std normalisation: r - mean.
    close(adv.grpo(jnp.array([[1.0, 0.0, 0.0, 1.0]]), normalize_std=False), [[0.5, -0.5, -0.5, 0.5]])


def test_grpo_all_equal_rewards_give_zero_not_nan():
    # std = 0: (r - m) / (0 + eps) = 0 / eps = 0 exactly; a group of one likewise.
    a = adv.grpo(jnp.array([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]]))
    assert np.array_equal(np.asarray(a), np.zeros((2, 3)))
    assert np.array_equal(np.asarray(adv.grpo(jnp.array([[7.0]]))), [[0.0]])


def test_group_estimators_ragged_and_empty_groups():
    rewards = jnp.array([[1.0, 0.0, jnp.nan, 0.0],    # member 2 failed: its NaN is never read
                         [jnp.nan, jnp.nan, 5.0, 5.0],
                         [jnp.nan] * 4])               # an empty group
    valid = jnp.array([[1, 1, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]], bool)
    # group 0 over {1, 0, 0}: mean 1/3; deviations 2/3, -1/3, -1/3; unbiased var = (4/9 + 1/9 +
    # 1/9) / 2 = 1/3; std 0.57735 -> A = 1.154701, -0.577350, -0.577350. Group 1 all equal -> 0.
    g = adv.grpo(rewards, valid=valid)
    close(g, [[1.154701, -0.577350, 0.0, -0.577350], [0.0] * 4, [0.0] * 4])
    close(adv.dr_grpo(rewards, valid=valid), [[2 / 3, -1 / 3, 0.0, -1 / 3], [0.0] * 4, [0.0] * 4])
    # RLOO group 0: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 (twice).
    close(adv.rloo(rewards, valid=valid), [[1.0, -0.5, 0.0, -0.5], [0.0] * 4, [0.0] * 4])
    for f in (adv.grpo, adv.dr_grpo, adv.rloo):
        assert np.all(np.isfinite(np.asarray(f(rewards, valid=valid))))
    # No groups at all: an empty result, no error.
    assert adv.grpo(jnp.zeros((0, 4))).shape == (0, 4)


def test_dr_grpo_is_mean_centred():
    # mean of [1, 2, 6] is 3 -> [-2, -1, 3] (no std division).
    close(adv.dr_grpo(jnp.array([[1.0, 2.0, 6.0]])), [[-2.0, -1.0, 3.0]])


def test_rloo_leave_one_out_baseline():
    # 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5. A group of one has no baseline: 0.
    close(adv.rloo(jnp.array([[1.0, 2.0, 3.0]])), [[-1.5, 0.0, 1.5]])
    close(adv.rloo(jnp.array([[4.0]])), [[0.0]])


def test_gae_three_steps_by_hand():
    rewards = jnp.array([[0.0, 0.0, 1.0]])
    values = jnp.array([[0.5, 0.6, 0.7]])
    mask = jnp.ones((1, 3))
    # gamma = lam = 1: A_t = (sum of later rewards) - V_t = 1 - V_t -> [0.5, 0.4, 0.3];
    # returns A + V = [1, 1, 1].
    a, r = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(a, [[0.5, 0.4, 0.3]])
    close(r, [[1.0, 1.0, 1.0]])
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72):
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;      A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;   A1 = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;   A0 = 0.04 + 0.72*0.246 = 0.21712
    a, r = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(a, [[0.21712, 0.246, 0.3]])
    close(r, [[0.71712, 0.846, 1.0]])


def test_gae_skips_observation_and_padding_tokens():
    # The same three trained tokens with an observation token (value 99, reward 5: never read)
    # between the first two and two padding tokens after: identical advantages on the trained
    # tokens, zeros elsewhere; a second row with nothing trained is all zeros.
    rewards = jnp.array([[0.0, 5.0, 0.0, 1.0, 0.0, 0.0], [1.0] * 6])
    values = jnp.array([[0.5, 99.0, 0.6, 0.7, jnp.inf, 0.0], [1.0] * 6])
    mask = jnp.array([[1, 0, 1, 1, 0, 0], [0] * 6])
    a, r = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(a, [[0.21712, 0.0, 0.246, 0.3, 0.0, 0.0], [0.0] * 6])
    close(r, [[0.71712, 0.0, 0.846, 1.0, 0.0, 0.0], [0.0] * 6])


def test_token_level_rewards_and_broadcast():
    mask = jnp.array([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0] * 6])
    close(adv.token_level_rewards(jnp.array([2.0, 3.0, 4.0]), mask),
          [[0, 0, 0, 0, 2, 0], [0, 3, 0, 0, 0, 0], [0] * 6])
    close(adv.broadcast_to_tokens(jnp.array([[1.0, -1.0, 0.5]]), mask),
          [[0, 1, 1, 0, 1, 0], [-1, -1, 0, 0, 0, 0], [0] * 6])


def test_kl_reward_penalty_and_compute_advantages_dispatch():
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    rewards = jnp.array([[1.0, 0.0], [2.0, 4.0]])  # two groups of G=2, rows group-major
    # GRPO, G=2: deviations +-d, unbiased std = sqrt(2 d^2) = sqrt(2)|d| -> A = +-1/sqrt(2).
    a, returns = adv.compute_advantages(LossConfig(), rewards, mask)
    s = 1 / math.sqrt(2)
    close(a, [[s, s, 0], [-s, 0, 0], [-s, -s, -s], [s, 0, 0]], atol=1e-5)
    assert returns is None
    a, _ = adv.compute_advantages(LossConfig(advantage_estimator="rloo"), rewards, mask)
    close(a, [[1, 1, 0], [-1, 0, 0], [-2, -2, -2], [2, 0, 0]])

    # KL as reward: k1 penalty 0.1 * (old - ref) = 0.1 * 1 per trained token, summed per sequence:
    # row rewards 1 - 0.2, 0 - 0.1 (mean 0.35), 2 - 0.3, 4 - 0.1 (mean 2.8); Dr.GRPO:
    # [0.8 - 0.35, -0.1 - 0.35] = [0.45, -0.45], [1.7 - 2.8, 3.9 - 2.8] = [-1.1, 1.1].
    old, ref = jnp.zeros((4, 3)), -jnp.ones((4, 3))
    penalty = adv.kl_reward_penalty(old, ref, mask, kl_coef=0.1, kind="k1")
    close(penalty, 0.1 * np.asarray(mask))
    config = LossConfig(advantage_estimator="dr_grpo", kl_coef=0.1, kl_estimator="k1",
                        kl_as_reward=True)
    a, _ = adv.compute_advantages(config, rewards, mask, old_logp=old, ref_logp=ref)
    close(a, [[0.45, 0.45, 0], [-0.45, 0, 0], [-1.1, -1.1, -1.1], [1.1, 0, 0]])
    with pytest.raises(ConfigError, match="old_logp and ref_logp"):
        adv.compute_advantages(config, rewards, mask)

    # GAE: the sequence reward lands on the last trained token; minus the per-token penalty.
    config = LossConfig(advantage_estimator="gae", kl_coef=0.1, kl_estimator="k1",
                        kl_as_reward=True)
    a, returns = adv.compute_advantages(config, rewards, mask, values=jnp.zeros((4, 3)),
                                        old_logp=old, ref_logp=ref)
    # Row 0 (gamma = lam = 1, V = 0): token rewards [-0.1, 1 - 0.1] -> A = [0.8, 0.9].
    close(a[0], [0.8, 0.9, 0.0])
    close(returns[0], [0.8, 0.9, 0.0])
    with pytest.raises(ConfigError, match="needs `values`"):
        adv.compute_advantages(LossConfig(advantage_estimator="gae"), rewards, mask)


def test_estimator_names_agree_and_unknown_names_are_refused():
    assert set(adv.GROUP_ESTIMATORS) | {"gae"} == set(losses.ADVANTAGE_ESTIMATORS)
    # A config that skipped LossConfig's validation still gets a clear refusal from the dispatcher.
    duck = types.SimpleNamespace(advantage_estimator="ppo", kl_as_reward=False, kl_coef=0.0)
    with pytest.raises(ValueError, match=r"advantage_estimator='ppo' is not one of \('grpo'"):
        adv.compute_advantages(duck, jnp.zeros((1, 2)), jnp.ones((2, 3)))


# ---------------------------------------------------------------------------------- config


def test_loss_config_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"advantage_estimator='ppo' is not one of \('grpo'"):
        LossConfig(advantage_estimator="ppo")
    with pytest.raises(ConfigError, match="aggregation='mean'"):
        LossConfig(aggregation="mean")
    with pytest.raises(ConfigError, match="kl_estimator='k4'"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ConfigError, match="dual_clip=0.5 must be > 1"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ConfigError, match="clip_low=1.0"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ConfigError, match="gamma=1.5"):
        LossConfig(gamma=1.5)
    with pytest.raises(ConfigError, match="tis_cap=0.5 must be >= 1"):
        LossConfig(tis_cap=0.5)
    assert isinstance(ConfigError("x"), ValueError)


def test_from_config_dict():
    c = losses.from_config_dict(ConfigDict({"advantage_estimator": "rloo", "dual_clip": 3.0}))
    assert c == LossConfig(advantage_estimator="rloo", dual_clip=3.0)
    assert losses.from_config_dict({}) == LossConfig()
    with pytest.raises(ConfigError, match=r"config.loss: unknown key\(s\) \['clip_ratio'\]"):
        losses.from_config_dict({"clip_ratio": 0.2})


# ---------------------------------------------------------------------------------- losses


def test_aggregation_choices_on_unequal_lengths():
    x = jnp.array([[1.0, 1.0, 1.0, 1.0], [3.0, 9.0, 9.0, 9.0], [7.0] * 4])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])  # 4 tokens, 1 token, padding row
    # token: (4*1 + 3) / 5 = 1.4; sequence: (1 + 3) / 2 = 2 (the padding row does not count);
    # constant, norm_len 4: (4 + 3) / (2 * 4) = 0.875; norm_len None -> T = 4, the same.
    close(losses.aggregate(x, mask, "token"), 1.4)
    close(losses.aggregate(x, mask, "sequence"), 2.0)
    close(losses.aggregate(x, mask, "constant", norm_len=4), 0.875)
    close(losses.aggregate(x, mask, "constant"), 0.875)
    # Gradient accumulation: whole-step counts replace this micro-batch's: 7 / 10; 4 / 4; 7 / 16.
    close(losses.aggregate(x, mask, "token", num_tokens=10), 0.7)
    close(losses.aggregate(x, mask, "sequence", num_sequences=4), 1.0)
    close(losses.aggregate(x, mask, "constant", num_sequences=4), 0.4375)
    for mode in losses.AGGREGATIONS:
        assert float(losses.aggregate(x, jnp.zeros_like(mask), mode)) == 0.0
    with pytest.raises(ConfigError, match="aggregation='avg'"):
        losses.aggregate(x, mask, "avg")


def test_kl_estimators_by_hand():
    logp = jnp.array([-1.0, -2.0, -1.5])
    ref = jnp.array([-2.0, -1.0, -1.5])
    # d = logp - ref = [1, -1, 0].
    close(losses.kl_estimate(logp, ref, "k1"), [1.0, -1.0, 0.0])
    close(losses.kl_estimate(logp, ref, "k2"), [0.5, 0.5, 0.0])
    # k3 = exp(-d) + d - 1: exp(-1) + 0 = 0.367879; exp(1) - 2 = 0.718282; 0.
    close(losses.kl_estimate(logp, ref, "k3"), [0.367879, 0.718282, 0.0])
    grid = jnp.linspace(-8.0, 8.0, 101)
    assert float(losses.kl_estimate(grid, jnp.zeros_like(grid), "k3").min()) >= 0.0
    # Masked positions are 0 even when their inputs would overflow exp.
    k = losses.kl_estimate(jnp.array([-1.0, -500.0]), jnp.array([-2.0, 0.0]), "k3",
                           mask=jnp.array([1, 0]))
    close(k, [0.367879, 0.0])
    with pytest.raises(ConfigError, match="kl_estimator='k5'"):
        losses.kl_estimate(logp, ref, "k5")


def _ppo(ratios, advantages, **kw):
    r = jnp.array([ratios], jnp.float32)
    return losses.policy_loss(jnp.log(r), jnp.zeros_like(r), jnp.array([advantages], jnp.float32),
                              jnp.ones_like(r), **kw)


def test_ppo_clip_asymmetric_range():
    # clip range [0.8, 1.28]; per token l = max(-A r, -A clip(r)):
    #   A=+1 r=1.5  -> max(-1.5, -1.28) = -1.28  (clipped)
    #   A=+1 r=0.5  -> max(-0.5, -0.8)  = -0.5
    #   A=-1 r=0.5  -> max(0.5, 0.8)    =  0.8   (clipped)
    #   A=-1 r=1.5  -> max(1.5, 1.28)   =  1.5
    #   A=+1 r=1.25 -> -1.25 (inside 1.28; a symmetric 0.2 would give -1.2)
    #   A=-1 r=0.75 -> max(0.75, 0.8)   =  0.8   (clipped)
    # token mean = (-1.28 - 0.5 + 0.8 + 1.5 - 1.25 + 0.8) / 6 = 0.07 / 6; clip fraction 3/6.
    loss, m = _ppo([1.5, 0.5, 0.5, 1.5, 1.25, 0.75], [1, 1, -1, -1, 1, -1])
    close(loss, 0.07 / 6)
    close(m["clip_fraction"], 0.5)
    close(m["tokens"], 6.0)
    close(m["ratio"], (1.5 + 0.5 + 0.5 + 1.5 + 1.25 + 0.75) / 6)
    # approx_kl = mean of r - 1 - log r, e.g. for r = 1.5: 0.5 - 0.405465 = 0.094535.
    r = np.array([1.5, 0.5, 0.5, 1.5, 1.25, 0.75])
    close(m["approx_kl"], np.mean(r - 1 - np.log(r)))
    close(m["importance_weight"], 1.0)


def test_dual_clip_bounds_negative_advantage_loss():
    # A=-1, r=5: PPO gives max(5, 1.28) = 5; dual clip 3 bounds it to -A*3 = 3.
    # A=+1, r=5: dual clip does not touch positive advantages: max(-5, -1.28) = -1.28.
    # A=-2, r=2: max(4, 2.56) = 4 < 6 = -A*3: untouched.
    loss, m = _ppo([5.0, 5.0, 2.0], [-1.0, 1.0, -2.0], dual_clip=3.0)
    close(loss, (3.0 - 1.28 + 4.0) / 3)
    close(m["dual_clip_fraction"], 1 / 3)
    loss, _ = _ppo([5.0, 5.0, 2.0], [-1.0, 1.0, -2.0])
    close(loss, (5.0 - 1.28 + 4.0) / 3)


def test_policy_loss_gradient_by_hand():
    # Two tokens, A = 1, r = [1.1, 1.5], token mean. d l_t / d logp_t = -A r_t inside the clip
    # range, 0 once clipped: grad = [-1.1 / 2, 0].
    ratio = jnp.array([[1.1, 1.5]])
    grad = jax.grad(lambda lp: losses.policy_loss(lp, jnp.zeros_like(lp), jnp.ones_like(lp),
                                                  jnp.ones_like(lp))[0])(jnp.log(ratio))
    close(grad, [[-0.55, 0.0]])
    # Negative advantage A = -2 at r = 1 (inside): d/dlogp (2 r) = 2 r = 2; with sequence
    # aggregation over rows of 1 and 2 tokens: weights 1/(2*1) and 1/(2*2).
    lp = jnp.zeros((2, 2))
    mask = jnp.array([[1, 0], [1, 1]])
    grad = jax.grad(lambda lp: losses.policy_loss(lp, jnp.zeros_like(lp), -2.0 * jnp.ones_like(lp),
                                                  mask, aggregation="sequence")[0])(lp)
    close(grad, [[1.0, 0.0], [0.5, 0.5]])


def test_decoupled_ppo_reduces_to_ppo_when_behaviour_is_proximal():
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    logp = -jax.random.uniform(k1, (3, 5), maxval=3.0)
    prox = logp + 0.4 * jax.random.normal(k2, (3, 5))
    a = jax.random.normal(k3, (3, 5))
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]])
    for kw in (dict(), dict(dual_clip=3.0, aggregation="sequence")):
        standard = losses.policy_loss(logp, prox, a, mask, **kw)
        decoupled = losses.policy_loss(logp, prox, a, mask, behaviour_logp=prox, **kw)
        assert float(standard[0]) == float(decoupled[0])
        f = lambda b: lambda lp: losses.policy_loss(lp, prox, a, mask, behaviour_logp=b, **kw)[0]
        assert np.array_equal(np.asarray(jax.grad(f(None))(logp)),
                              np.asarray(jax.grad(f(prox))(logp)))


def test_decoupled_ppo_truncates_importance_weight():
    # r = pi / pi_prox = 1 on both tokens, A = 1 -> PPO term -1 each.
    # Token 0: pi_prox / pi_behav = 3 -> truncated at tis_cap 2 -> -2.
    # Token 1: pi_prox / pi_behav = 0.5 -> -0.5. Token mean: -1.25; gradient -w_t / 2.
    prox = jnp.log(jnp.array([[0.3, 0.2]]))
    behav = jnp.log(jnp.array([[0.1, 0.4]]))
    ones = jnp.ones((1, 2))

    def loss_fn(lp, cap=2.0):
        return losses.policy_loss(lp, prox, ones, ones, behaviour_logp=behav, tis_cap=cap)

    loss, m = loss_fn(prox)
    close(loss, -1.25)
    close(m["importance_weight"], 1.25)
    close(m["truncated_fraction"], 0.5)
    close(jax.grad(lambda lp: loss_fn(lp)[0])(prox), [[-1.0, -0.25]])
    # Without a cap the weight is 3: (-3 - 0.5) / 2.
    close(loss_fn(prox, cap=None)[0], -1.75)


def test_all_masked_rows_give_no_nan():
    # Garbage in masked positions (inf, huge log-ratios) must not leak into the loss or its
    # gradient; an all-masked batch gives 0 for every aggregation.
    logp = jnp.array([[-1.0, 80.0], [-500.0, jnp.inf]])
    prox = jnp.array([[-1.2, -80.0], [0.0, 0.0]])
    a = jnp.array([[1.0, jnp.inf], [1.0, 1.0]])
    mask = jnp.array([[1, 0], [0, 0]])
    for mode in losses.AGGREGATIONS:
        for extra in (dict(), dict(behaviour_logp=jnp.full((2, 2), -300.0), dual_clip=3.0)):
            f = lambda lp: losses.policy_loss(lp, prox, a, mask, aggregation=mode, **extra)
            (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
            assert np.isfinite(float(loss)), (mode, extra)
            assert np.all(np.isfinite(np.asarray(grad)))
            assert all(np.isfinite(float(v)) for v in metrics.values())
            assert float(f(logp)[1]["tokens"]) == 1.0
            empty, metrics = losses.policy_loss(logp, prox, a, jnp.zeros_like(mask),
                                                aggregation=mode, **extra)
            assert float(empty) == 0.0
            assert all(float(v) == 0.0 for v in metrics.values())


def test_entropy_from_logits_and_bonus():
    # p = [1/2, 1/4, 1/4]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.039721; uniform over 4: ln 4.
    logits = jnp.array([[[LOG(0.5), LOG(0.25), LOG(0.25), -1e9], [0.0, 0.0, 0.0, 0.0]]])
    h = losses.token_entropy(logits)
    close(h, [[1.5 * LOG(2), LOG(4)]], atol=1e-5)
    close(losses.entropy_bonus(h, jnp.array([[1, 0]])), 1.5 * LOG(2), atol=1e-5)


def test_value_loss_clipped_by_hand():
    # Token 0: V_old 0, V 1, R 1: unclipped error 0; clipped V = 0 + 0.2 -> (0.2 - 1)^2 = 0.64;
    #   0.5 * max(0, 0.64) = 0.32.
    # Token 1: V_old 0, V 0.1, R 1: inside the clip, 0.5 * 0.81 = 0.405. Mean: 0.3625.
    v, old, ret = jnp.array([[1.0, 0.1]]), jnp.zeros((1, 2)), jnp.ones((1, 2))
    mask = jnp.ones((1, 2))
    close(losses.value_loss(v, old, ret, mask, value_clip=0.2), 0.3625)
    # Unclipped: 0.5 * (0 + 0.81) / 2 = 0.2025.
    close(losses.value_loss(v, old, ret, mask, value_clip=None), 0.2025)


def _batch():
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    return {
        "mask": mask,
        "advantages": jnp.array([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]),
        "proximal_logp": jnp.zeros((2, 3)),
        "ref_logp": -jnp.ones((2, 3)),
    }


def test_total_loss_composes_every_term():
    batch = _batch() | {"returns": jnp.ones((2, 3)), "old_values": jnp.zeros((2, 3))}
    logp = jnp.zeros((2, 3))  # r = 1 on every token
    entropy = jnp.array([[2.0, 1.0, 9.0], [3.0, 9.0, 9.0]])
    values = jnp.array([[1.0, 0.1, 5.0], [0.1, 5.0, 5.0]])
    config = LossConfig(advantage_estimator="gae", kl_coef=0.5, kl_estimator="k1",
                        entropy_coef=0.1, value_coef=2.0)
    loss, m = losses.total_loss(config, batch, logp, entropy=entropy, values=values)
    # policy: -A r over 3 tokens = (-1 - 1 + 1) / 3 = -1/3
    # kl (k1, d = 0 - (-1) = 1): 1;  entropy: (2 + 1 + 3) / 3 = 2
    # value: per token 0.32, 0.405, 0.405 (as in test_value_loss_clipped_by_hand) -> 1.13 / 3
    # loss = -1/3 + 0.5 * 1 - 0.1 * 2 + 2 * 1.13 / 3
    close(m["policy_loss"], -1 / 3)
    close(m["kl"], 1.0)
    close(m["entropy"], 2.0)
    close(m["value_loss"], 1.13 / 3)
    close(loss, -1 / 3 + 0.5 - 0.2 + 2 * 1.13 / 3)
    close(m["loss"], loss)
    close(m["clip_fraction"], 0.0)

    # KL as a reward penalty: reported, not in the loss; GRPO: no value term.
    config = LossConfig(kl_coef=0.5, kl_estimator="k1", kl_as_reward=True)
    loss, m = losses.total_loss(config, _batch(), logp)
    close(loss, -1 / 3)
    close(m["kl"], 1.0)
    close(m["value_loss"], 0.0)
    # Metrics have one structure whatever the config.
    assert set(m) == {"loss", "policy_loss", "kl", "entropy", "value_loss", "clip_fraction",
                      "dual_clip_fraction", "approx_kl", "ratio", "importance_weight",
                      "truncated_fraction", "tokens"}


def test_total_loss_refuses_missing_inputs():
    batch = _batch()
    no_ref = {k: v for k, v in batch.items() if k != "ref_logp"}
    logp = jnp.zeros((2, 3))
    with pytest.raises(ConfigError, match="'ref_logp'.*KL loss term"):
        losses.total_loss(LossConfig(kl_coef=0.1), no_ref, logp)
    with pytest.raises(ConfigError, match="entropy_coef=0.01"):
        losses.total_loss(LossConfig(entropy_coef=0.01), batch, logp)
    with pytest.raises(ConfigError, match="'gae' needs the value head"):
        losses.total_loss(LossConfig(advantage_estimator="gae"), batch, logp)
    with pytest.raises(ConfigError, match="'old_values'"):
        losses.total_loss(LossConfig(advantage_estimator="gae"), batch, logp, values=logp)
    # No KL requested and no ref log-probs: fine, KL reported as 0.
    _, m = losses.total_loss(LossConfig(), no_ref, logp)
    assert float(m["kl"]) == 0.0


def test_everything_under_jit():
    config = LossConfig(advantage_estimator="gae", kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0,
                        aggregation="sequence", gamma=0.9, lam=0.8)
    mask = jnp.array([[1, 0, 1, 1], [1, 1, 0, 0]])
    rewards = jnp.array([[1.0, 0.0]])
    values = jnp.array([[0.5, 9.0, 0.6, 0.7], [0.2, 0.1, 0.0, 0.0]])

    @jax.jit
    def step(logp, entropy, new_values):
        a, returns = adv.compute_advantages(config, rewards, mask, values=values)
        batch = {"mask": mask, "advantages": a, "returns": returns, "old_values": values,
                 "proximal_logp": jnp.full((2, 4), -1.0), "behaviour_logp": jnp.full((2, 4), -1.1),
                 "ref_logp": jnp.full((2, 4), -0.9)}
        f = lambda lp: losses.total_loss(config, batch, lp, entropy=entropy, values=new_values)
        return jax.value_and_grad(f, has_aux=True)(logp)

    args = (jnp.full((2, 4), -1.05), jnp.ones((2, 4)), values + 0.05)
    (loss, metrics), grad = step(*args)
    with jax.disable_jit():
        (eager_loss, eager_metrics), eager_grad = step(*args)
    close(loss, eager_loss)
    close(grad, eager_grad)
    for k in metrics:
        close(metrics[k], eager_metrics[k])
    assert np.isfinite(float(loss)) and np.any(np.asarray(grad) != 0)

    for name in ("grpo", "dr_grpo", "rloo"):
        c = dataclasses.replace(config, advantage_estimator=name)
        jitted = jax.jit(lambda r: adv.compute_advantages(c, r, mask)[0])(rewards)
        close(jitted, adv.compute_advantages(c, rewards, mask)[0])
