"""Advantage estimators of the GRPO/PPO family, as small pure functions of jnp arrays.

Where this sits: after a batch of trajectories is scored (rewards, and old / reference log-probs),
`compute_advantages` turns rewards into per-token advantages `[batch, T]` for `losses.total_loss`.
Advantages are data, computed once per batch outside the differentiated function.

Group layout (GRPO, Dr.GRPO, RLOO): sequence rewards are `[num_groups, G]`, G responses to one
prompt per row, and the token tensors' rows are group-major: row `g * G + i` is response i of group
g. A group may be ragged: `valid [num_groups, G]` marks the members that count (a failed task, or a
slot padded to a fixed G, is invalid). Group statistics use valid members only, invalid members get
advantage 0 and their rewards are never read (they may be NaN), and a group with no valid member
(an empty group) gives zeros. Fixed shapes and masked reductions keep all of it jit-friendly.

Estimators, for the valid members of a group with rewards r_1..r_n and mean m:
- `grpo` (Shao et al. 2024): A_i = (r_i - m) / (std + eps), std the unbiased (n - 1) standard
  deviation; with `normalize_std=False`, A_i = r_i - m. All-equal rewards give exactly 0 (0 / eps),
  and so does a group of one.
- `dr_grpo` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - m. Dividing by the
  std up-weights easy and hard prompts; Dr.GRPO's other half is the loss-side normaliser: use
  `aggregation="constant"` (sum over tokens / (sequences * a constant length)) instead of a
  per-sequence length mean, which biases towards long wrong answers.
- `rloo` (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j, the leave-one-out baseline
  (= n / (n - 1) * (r_i - m)); 0 for a group of one.
- `gae` (Schulman et al. 2016), PPO with a value head: per-token rewards and values `[batch, T]`,
  delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, computed backwards
  with `lax.scan` over the **trained** tokens only: prompt, observation and padding tokens are
  transparent (V_next and A_next are those of the next trained token; after a row's last trained
  token both are 0). Returns R_t = A_t + V_t are the value head's targets.

A sequence advantage is the same for every trained token of that sequence (`broadcast_to_tokens`).
KL as a reward penalty (`kl_reward_penalty`, `LossConfig.kl_as_reward`): the per-token penalty
kl_coef * k(old, ref) is subtracted from the per-token rewards for `gae`, and its sum over the
sequence from the sequence reward for the group estimators.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tiderl_jax.model.config import ConfigError
from tiderl_jax.rl.batch import PackedBatch
from tiderl_jax.rl.losses import ADVANTAGE_ESTIMATORS, LossConfig, kl_estimate


def _group_mean(rewards: jax.Array, valid: jax.Array | None):
    """(valid [N, G] bool, rewards with invalid members zeroed, count [N, 1], mean [N, 1])."""
    valid = jnp.ones(rewards.shape, bool) if valid is None else valid.astype(bool)
    rewards = jnp.where(valid, rewards.astype(jnp.float32), 0.0)
    count = valid.sum(axis=-1, keepdims=True)
    mean = rewards.sum(axis=-1, keepdims=True) / jnp.maximum(count, 1)
    return valid, rewards, count, mean


def grpo(rewards: jax.Array, *, valid: jax.Array | None = None, normalize_std: bool = True,
         eps: float = 1e-6) -> jax.Array:
    """GRPO group-relative advantages: `[num_groups, G]` rewards -> `[num_groups, G]` advantages."""
    valid, rewards, count, mean = _group_mean(rewards, valid)
    centred = jnp.where(valid, rewards - mean, 0.0)
    if not normalize_std:
        return centred
    variance = jnp.sum(centred * centred, axis=-1, keepdims=True) / jnp.maximum(count - 1, 1)
    return centred / (jnp.sqrt(variance) + eps)


def dr_grpo(rewards: jax.Array, *, valid: jax.Array | None = None) -> jax.Array:
    """Dr.GRPO advantages r_i - group mean (no std); pair with `aggregation="constant"`."""
    return grpo(rewards, valid=valid, normalize_std=False)


def rloo(rewards: jax.Array, *, valid: jax.Array | None = None) -> jax.Array:
    """RLOO advantages r_i - mean of the group's other valid members; 0 when a group has one."""
    valid, rewards, count, _ = _group_mean(rewards, valid)
    others = jnp.maximum(count - 1, 1)
    baseline = (rewards.sum(axis=-1, keepdims=True) - rewards) / others
    return jnp.where(valid & (count > 1), rewards - baseline, 0.0)


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over each row's trained tokens (module docstring).

    `rewards`, `values`, `mask`: `[batch, T]`; rewards and values are read at trained tokens only,
    so put a sequence reward on its last trained token (`token_level_rewards`). Returns
    `(advantages, returns)`, both `[batch, T]` and 0 where `mask` is 0.
    """
    trained = mask > 0
    rewards = rewards.astype(jnp.float32)
    values = values.astype(jnp.float32)

    def step(carry, xs):
        next_value, next_advantage = carry
        r, v, t = xs
        advantage = r + gamma * next_value - v + gamma * lam * next_advantage
        carry = (jnp.where(t, v, next_value), jnp.where(t, advantage, next_advantage))
        return carry, jnp.where(t, advantage, 0.0)

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, trained.T),
                                 reverse=True)
    advantages = advantages.T
    return advantages, jnp.where(trained, advantages + values, 0.0)


def broadcast_to_tokens(sequence_values: jax.Array, mask: jax.Array) -> jax.Array:
    """One value per sequence (`[batch]`, or `[num_groups, G]` group-major) onto its trained tokens
    `[batch, T]`; 0 elsewhere."""
    return jnp.where(mask > 0, sequence_values.reshape(-1, 1), 0.0)


def token_level_rewards(sequence_rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Places each sequence's reward (`[batch]`) on its last trained token: `[batch, T]`, 0 elsewhere.

    A row without trained tokens gets no reward (nothing of it is trained).
    """
    trained = mask > 0
    length = trained.shape[-1]
    last = length - 1 - jnp.argmax(trained[:, ::-1], axis=-1)  # [batch]
    at_last = (jnp.arange(length)[None, :] == last[:, None]) & trained
    return jnp.where(at_last, sequence_rewards.reshape(-1, 1).astype(jnp.float32), 0.0)


def kl_reward_penalty(old_logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, *,
                      kl_coef: float, kind: str = "k3") -> jax.Array:
    """Per-token KL-to-reference reward penalty kl_coef * k(old, ref), `[batch, T]`, 0 off the mask.

    `old_logp` is the policy that sampled the tokens (behaviour or proximal log-probs): the penalty
    is part of the data, not differentiated. Subtract it from the rewards (`compute_advantages` does).
    """
    return kl_coef * kl_estimate(old_logp, ref_logp, kind, mask=mask)


# Group estimators by config name: (rewards [num_groups, G], valid, config) -> [num_groups, G].
GROUP_ESTIMATORS = {
    "grpo": lambda r, valid, c: grpo(r, valid=valid, normalize_std=c.normalize_std, eps=c.std_eps),
    "dr_grpo": lambda r, valid, c: dr_grpo(r, valid=valid),
    "rloo": lambda r, valid, c: rloo(r, valid=valid),
}


def compute_advantages(config: LossConfig, rewards: jax.Array, mask: jax.Array, *,
                       valid: jax.Array | None = None, values: jax.Array | None = None,
                       old_logp: jax.Array | None = None,
                       ref_logp: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Per-token advantages `[batch, T]` by `config.advantage_estimator`, and GAE returns (else None).

    `rewards`: sequence rewards `[num_groups, G]` (group-major rows of `mask [num_groups * G, T]`);
    `valid [num_groups, G]`: group members that count (group estimators only). `"gae"` also needs the
    value head's `values [batch, T]` at sampling time. With `config.kl_as_reward`, `old_logp` and
    `ref_logp [batch, T]` give the KL penalty subtracted from the rewards.
    """
    name = config.advantage_estimator
    if name != "gae" and name not in GROUP_ESTIMATORS:
        raise ConfigError(f"advantage_estimator={name!r} is not one of {ADVANTAGE_ESTIMATORS}")
    penalty = None
    if config.kl_as_reward and config.kl_coef > 0:
        if old_logp is None or ref_logp is None:
            raise ConfigError("compute_advantages: kl_as_reward needs old_logp and ref_logp")
        penalty = kl_reward_penalty(old_logp, ref_logp, mask, kl_coef=config.kl_coef,
                                    kind=config.kl_estimator)

    if name == "gae":
        if values is None:
            raise ConfigError("compute_advantages: advantage_estimator='gae' needs `values`")
        token_rewards = token_level_rewards(rewards.reshape(-1), mask)
        if penalty is not None:
            token_rewards = token_rewards - penalty
        return gae(token_rewards, values, mask, gamma=config.gamma, lam=config.lam)

    if penalty is not None:
        rewards = rewards - penalty.sum(axis=-1).reshape(rewards.shape)
    advantages = GROUP_ESTIMATORS[name](rewards, valid, config)
    return broadcast_to_tokens(advantages, mask), None


def group_advantages(cfg: LossConfig, rewards: Sequence[float], groups: Sequence[int]) -> np.ndarray:
    """One advantage per sequence from its reward and GRPO group (groups may be ragged)."""
    names = sorted(set(groups))
    index = {g: i for i, g in enumerate(names)}
    size = max((list(groups).count(g) for g in names), default=1)
    table = np.zeros((len(names), size), np.float32)
    valid = np.zeros((len(names), size), bool)
    slot = [0] * len(names)
    where = []
    for r, g in zip(rewards, groups):
        i = index[g]
        table[i, slot[i]], valid[i, slot[i]] = r, True
        where.append((i, slot[i]))
        slot[i] += 1
    adv = np.asarray(GROUP_ESTIMATORS[cfg.advantage_estimator](jnp.asarray(table), jnp.asarray(valid), cfg))
    return np.asarray([adv[i, j] for i, j in where], np.float32)


def gae_advantages(cfg: LossConfig, packed: PackedBatch, rewards: np.ndarray):
    """Per-token GAE advantages and returns of a packed batch (the critic's `old_values` in it): each
    sequence is laid out alone in a row (`advantages.gae` is one sequence per row), its reward on its
    last trained token, and the results are put back at the sequence's place in the packed arrays."""
    n, length = len(packed.placements), packed.arrays["mask"].shape[-1]
    rows = 1 << max(0, (n - 1).bit_length())  # a power of two: few compiled shapes
    mask, values = np.zeros((rows, length), np.float32), np.zeros((rows, length), np.float32)
    for j, (_, _, _, size) in enumerate(packed.placements):
        mask[j, :size] = packed.per_token("mask", j)
        values[j, :size] = packed.per_token("old_values", j)
    token_rewards = token_level_rewards(jnp.asarray(np.pad(rewards, (0, rows - n))), jnp.asarray(mask))
    adv, ret = _gae(token_rewards, jnp.asarray(values), jnp.asarray(mask), gamma=cfg.gamma, lam=cfg.lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    out_adv, out_ret = np.zeros_like(packed.arrays["mask"]), np.zeros_like(packed.arrays["mask"])
    for j, (m, r, start, size) in enumerate(packed.placements):
        out_adv[m, r, start:start + size] = adv[j, :size]
        out_ret[m, r, start:start + size] = ret[j, :size]
    return out_adv, out_ret


_gae = jax.jit(gae, static_argnames=("gamma", "lam"))
