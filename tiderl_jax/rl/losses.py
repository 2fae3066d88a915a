"""Policy, KL, entropy and value losses of the GRPO/PPO family, as small pure functions of jnp arrays.

Where this sits: the train step computes the current policy's per-token log-probs `logp` (and,
optionally, entropies and value-head outputs) for a micro-batch, then calls `total_loss` with the
batch that scoring filled in (advantages, proximal / behaviour / reference log-probs). Everything here
is elementwise or a reduction, so it runs unchanged under `jax.jit` on sharded inputs.

Layout: token tensors are `[batch, T]`, one sequence per row, with `mask [batch, T]` (bool or 0/1
float) that is 1 on the model-generated tokens being trained and 0 on prompt, observation and
padding tokens. Masked-out positions may hold anything (garbage log-probs, inf): every function
replaces them by 0 *before* any exp, so neither the loss nor its gradient can pick up a NaN from them,
and an all-masked row or batch gives a loss of exactly 0.

**Aggregation** (how per-token losses become one scalar; `aggregate`):
- `"token"`: sum over all trained tokens / number of trained tokens in the batch. Every token weighs
  the same, so long responses are not down-weighted (DAPO, Yu et al. 2025).
- `"sequence"`: mean over each sequence's trained tokens, then mean over the sequences that have any
  (the original GRPO, Shao et al. 2024). A token of a short response weighs more than one of a long
  response.
- `"constant"`: sum over all trained tokens / (number of sequences * `norm_len`), `norm_len` a
  constant (default: the padded length T; better the generation budget, so the scale does not move
  with the padding bucket). This is Dr.GRPO's length-unbiased normaliser (Liu et al. 2025); pair it
  with `advantage_estimator="dr_grpo"`. With `norm_len=1` it is verl's "seq-mean-token-sum".
"Number of sequences" counts rows with at least one trained token (padding rows do not count). Under
gradient accumulation, pass the whole step's `num_tokens` / `num_sequences` so that the sum of the
micro-batch losses equals the loss of the whole batch.

**PPO-clip** with an asymmetric range and dual clip (`policy_loss`), per trained token t, with ratio
`r = exp(logp - proximal_logp)` and advantage A:
    l = max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high))
`clip_high > clip_low` ("clip-higher", DAPO) lets low-probability tokens grow more before the clip
stops them. Dual clip (Ye et al. 2020) bounds the loss of a negative-advantage token whose ratio has
run away: for A < 0, l = min(l, -A*dual_clip), with dual_clip > 1 (typically 3).

**Decoupled PPO** for stale samples (Hilton et al. 2022; AReaL, Fu et al. 2025). Tokens were sampled
by the behaviour policy pi_behav (the engine's log-probs, recorded per token, possibly several
versions old). The proximal policy pi_prox (log-probs recomputed by the trainer with the parameters
the step starts from) is the trust-region centre. Per token
    l = w * max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high)),   r = pi / pi_prox,
    w = min(pi_prox / pi_behav, tis_cap)                          (a constant: no gradient)
The clipped ratio is taken against pi_prox; the importance weight w corrects for sampling from
pi_behav and is truncated at `tis_cap` (truncated importance sampling; AReaL drops tokens above its
cap instead, we keep them at weight `tis_cap`). When pi_behav == pi_prox, w = 1 exactly and this is
standard PPO. Behaviour log-probs must come from the same distribution the trainer's `logp`
describes (same temperature; see `engine/sampling.py`).

**KL to the reference model** (`kl_estimate`): Schulman's estimators of KL(pi || pi_ref) from
tokens sampled from pi, with d = logp - ref_logp: k1 = d (unbiased, can be negative), k2 = d^2/2
(biased, low variance), k3 = exp(-d) + d - 1 (unbiased and >= 0; GRPO's choice). It is either a
loss term (`kl_coef * aggregate(k)`) or, with `kl_as_reward`, a per-token reward penalty
(`advantages.kl_reward_penalty`); then it is only reported here.

**Entropy bonus**: `-entropy_coef * aggregate(entropy)`; **value loss** (PPO with a value head,
`advantage_estimator="gae"`): clipped squared error to the GAE returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from tiderl_jax.model.config import ConfigError

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gae")
AGGREGATIONS = ("token", "sequence", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which advantage estimator and loss terms a run uses, and their coefficients.

    Frozen and hashable, so it can be a static argument of a jitted function.
    """

    advantage_estimator: str = "grpo"  # one of ADVANTAGE_ESTIMATORS
    normalize_std: bool = True  # "grpo" only: divide by the group's reward std
    std_eps: float = 1e-6  # added to the std before dividing
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (DAPO's clip-higher)
    dual_clip: float | None = None  # e.g. 3.0: bound on -A*r for A < 0; None: off
    aggregation: str = "token"  # one of AGGREGATIONS
    norm_len: int | None = None  # "constant" aggregation's length; None: the padded length T
    kl_coef: float = 0.0  # weight of the KL to the reference model (0: off)
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    kl_as_reward: bool = False  # KL as a per-token reward penalty instead of a loss term
    entropy_coef: float = 0.0  # weight of the entropy bonus (0: off)
    value_coef: float = 0.5  # weight of the value loss ("gae" only)
    value_clip: float | None = 0.2  # value update clip around the old values; None: unclipped
    gamma: float = 1.0  # "gae": discount per trained token
    lam: float = 1.0  # "gae": GAE lambda
    tis_cap: float | None = 2.0  # decoupled PPO: cap (>= 1) of pi_prox / pi_behav; None: off

    def __post_init__(self):
        problems = []
        for name, choices in (("advantage_estimator", ADVANTAGE_ESTIMATORS),
                              ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) not in choices:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {choices}")
        if not 0.0 <= self.clip_low < 1.0:
            problems.append(f"clip_low={self.clip_low} must be in [0, 1)")
        if not self.clip_high >= 0.0:
            problems.append(f"clip_high={self.clip_high} must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            problems.append(f"dual_clip={self.dual_clip} must be > 1 (or None to disable it)")
        if self.norm_len is not None and not self.norm_len > 0:
            problems.append(f"norm_len={self.norm_len} must be positive (or None for T)")
        for name in ("kl_coef", "entropy_coef", "value_coef"):
            if not getattr(self, name) >= 0.0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if not self.std_eps > 0.0:
            problems.append(f"std_eps={self.std_eps} must be > 0")
        if self.value_clip is not None and not self.value_clip > 0.0:
            problems.append(f"value_clip={self.value_clip} must be > 0 (or None to disable it)")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            problems.append(f"tis_cap={self.tis_cap} must be >= 1, so that on-policy tokens keep "
                            "weight 1 (or None for no truncation)")
        if problems:
            raise ConfigError("invalid loss config: " + "; ".join(problems))

    @property
    def uses_reference(self) -> bool:
        """Whether a loss term or the reward reads the reference model's log-probs (the KL, in the loss or as a
        reward penalty): without one the reference is never scored."""
        return self.kl_coef > 0


def from_config_dict(values: Mapping[str, Any], *, source: str = "config.loss") -> LossConfig:
    """Builds a `LossConfig` from an ml_collections ConfigDict or a dict; unknown keys are an error."""
    values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
    known = {f.name for f in dataclasses.fields(LossConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known keys are {sorted(known)}")
    return LossConfig(**values)


def aggregate(per_token: jax.Array, mask: jax.Array, aggregation: str = "token", *,
              norm_len: int | None = None, num_tokens: jax.Array | int | None = None,
              num_sequences: jax.Array | int | None = None) -> jax.Array:
    """Reduces per-token values `[batch, T]` over the trained tokens to a scalar (module docstring).

    `num_tokens` / `num_sequences` replace this batch's counts (for gradient accumulation: the
    whole step's counts). Zero trained tokens give 0, not NaN.
    """
    trained = mask > 0
    x = jnp.where(trained, per_token, 0.0)
    if aggregation == "token":
        count = trained.sum() if num_tokens is None else num_tokens
        return x.sum() / jnp.maximum(count, 1)
    row_tokens = trained.sum(axis=-1)  # [batch]
    if num_sequences is None:
        num_sequences = (row_tokens > 0).sum()
    num_sequences = jnp.maximum(num_sequences, 1)
    if aggregation == "sequence":
        return (x.sum(axis=-1) / jnp.maximum(row_tokens, 1)).sum() / num_sequences
    if aggregation == "constant":
        length = mask.shape[-1] if norm_len is None else norm_len
        return x.sum() / (num_sequences * length)
    raise ConfigError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}")


def _token_mean(per_token: jax.Array, trained: jax.Array) -> jax.Array:
    """Plain mean over trained tokens, for metrics (independent of the loss aggregation)."""
    return jnp.where(trained, per_token, 0.0).sum() / jnp.maximum(trained.sum(), 1)


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3", *,
                mask: jax.Array | None = None) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020).

    With d = logp - ref_logp: k1 = d; k2 = d^2 / 2; k3 = exp(-d) + d - 1 (>= 0). `[batch, T]` in and
    out; where `mask` is 0 the result is 0 (and the inputs there are never exponentiated).
    """
    d = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if mask is not None:
        d = jnp.where(mask > 0, d, 0.0)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return jnp.exp(-d) + d - 1.0
    raise ConfigError(f"kl_estimator={kind!r} is not one of {KL_ESTIMATORS}")


def policy_loss(logp: jax.Array, proximal_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                *, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None,
                behaviour_logp: jax.Array | None = None, tis_cap: float | None = 2.0,
                aggregation: str = "token", norm_len: int | None = None,
                num_tokens: jax.Array | int | None = None,
                num_sequences: jax.Array | int | None = None) -> tuple[jax.Array, dict]:
    """PPO-clip (asymmetric range, optional dual clip), decoupled when `behaviour_logp` is given.

    All arrays `[batch, T]`: `logp` the current policy (differentiated), `proximal_logp` the old /
    proximal policy, `advantages` per token, `behaviour_logp` the sampling policy. The rule is in the
    module docstring; with `behaviour_logp=None` (or equal to `proximal_logp`) it is standard PPO.

    Returns `(loss, metrics)`; metrics are plain means over trained tokens: `clip_fraction` (tokens
    whose clip is active, i.e. the clipped term wins and the gradient is 0), `dual_clip_fraction`,
    `approx_kl` (k3 estimate of KL(pi_prox || pi)), `ratio`, `importance_weight` and
    `truncated_fraction` (tokens whose weight hit `tis_cap`), `tokens`.
    """
    trained = mask > 0
    logp = logp.astype(jnp.float32)
    proximal_logp = proximal_logp.astype(jnp.float32)
    advantages = jnp.where(trained, advantages.astype(jnp.float32), 0.0)

    log_ratio = jnp.where(trained, logp - proximal_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = jnp.zeros_like(trained)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = jnp.where(dual_active, bound, per_token)

    weight = jnp.ones_like(ratio)
    truncated = jnp.zeros_like(trained)
    if behaviour_logp is not None:
        behaviour_log_w = proximal_logp - behaviour_logp.astype(jnp.float32)
        weight = jnp.exp(jnp.where(trained, behaviour_log_w, 0.0))
        if tis_cap is not None:
            truncated = weight > tis_cap
            weight = jnp.minimum(weight, tis_cap)
        weight = jax.lax.stop_gradient(weight)
        per_token = weight * per_token

    loss = aggregate(per_token, mask, aggregation, norm_len=norm_len, num_tokens=num_tokens,
                     num_sequences=num_sequences)
    metrics = {
        "clip_fraction": _token_mean(clip_active, trained),
        "dual_clip_fraction": _token_mean(dual_active, trained),
        "approx_kl": _token_mean(kl_estimate(proximal_logp, logp, "k3", mask=mask), trained),
        "ratio": _token_mean(ratio, trained),
        "importance_weight": _token_mean(weight, trained),
        "truncated_fraction": _token_mean(truncated, trained),
        "tokens": trained.sum().astype(jnp.float32),
    }
    return loss, metrics


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of each position's next-token distribution: `[batch, T, vocab]` -> `[batch, T]`.

    H = -sum_v p_v log p_v with p = softmax(logits); logits must be finite.
    """
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def entropy_bonus(entropy: jax.Array, mask: jax.Array, aggregation: str = "token", *,
                  norm_len: int | None = None, num_tokens: jax.Array | int | None = None,
                  num_sequences: jax.Array | int | None = None) -> jax.Array:
    """Aggregated entropy of the trained tokens (`[batch, T]` -> scalar); the loss adds `-coef *` it."""
    return aggregate(entropy.astype(jnp.float32), mask, aggregation, norm_len=norm_len,
                     num_tokens=num_tokens, num_sequences=num_sequences)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *,
               value_clip: float | None = 0.2, aggregation: str = "token",
               norm_len: int | None = None, num_tokens: jax.Array | int | None = None,
               num_sequences: jax.Array | int | None = None) -> jax.Array:
    """PPO's clipped value loss, all `[batch, T]`: per token
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2),
    with V the value head now, V_old at sampling time and R the GAE return. `value_clip=None`:
    0.5 * (V - R)^2.
    """
    trained = mask > 0
    values = jnp.where(trained, values.astype(jnp.float32), 0.0)
    old_values = jnp.where(trained, old_values.astype(jnp.float32), 0.0)
    returns = jnp.where(trained, returns.astype(jnp.float32), 0.0)
    per_token = jnp.square(values - returns)
    if value_clip is not None:
        clipped = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
        per_token = jnp.maximum(per_token, jnp.square(clipped - returns))
    return aggregate(0.5 * per_token, mask, aggregation, norm_len=norm_len, num_tokens=num_tokens,
                     num_sequences=num_sequences)


def _require(batch: Mapping[str, jax.Array], key: str, reason: str) -> jax.Array:
    if key not in batch:
        raise ConfigError(f"total_loss: batch has no {key!r}, which {reason} needs; "
                          f"batch keys: {sorted(batch)}")
    return batch[key]


def total_loss(config: LossConfig, batch: Mapping[str, jax.Array], logp: jax.Array, *,
               entropy: jax.Array | None = None, values: jax.Array | None = None,
               num_tokens: jax.Array | int | None = None,
               num_sequences: jax.Array | int | None = None) -> tuple[jax.Array, dict]:
    """The scalar training loss of one (micro-)batch and a metrics dict with every term.

    loss = policy + kl_coef * kl - entropy_coef * entropy + value_coef * value_loss

    `batch` (all `[batch, T]`): `mask`, `advantages`, `proximal_logp`; optional `behaviour_logp`
    (decoupled PPO), `ref_logp` (needed when the KL is a loss term; reported whenever present),
    `returns` and `old_values` (needed by `"gae"`). Model outputs: `logp [batch, T]` (differentiated),
    `entropy [batch, T]` (needed when `entropy_coef > 0`; reported whenever given), `values [batch, T]`
    (needed by `"gae"`). Every metric key is always present (0 when the term is off), so the metrics
    pytree has one structure whatever the config.
    """
    mask = batch["mask"]
    counts = dict(aggregation=config.aggregation, norm_len=config.norm_len,
                  num_tokens=num_tokens, num_sequences=num_sequences)
    policy, metrics = policy_loss(
        logp, _require(batch, "proximal_logp", "the policy loss"),
        _require(batch, "advantages", "the policy loss"), mask,
        clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
        behaviour_logp=batch.get("behaviour_logp"), tis_cap=config.tis_cap, **counts)
    loss = policy
    zero = jnp.zeros((), jnp.float32)

    kl = zero
    kl_in_loss = config.kl_coef > 0 and not config.kl_as_reward
    if kl_in_loss or "ref_logp" in batch:
        ref_logp = _require(batch, "ref_logp", f"the KL loss term (kl_coef={config.kl_coef})")
        kl = aggregate(kl_estimate(logp, ref_logp, config.kl_estimator, mask=mask), mask, **counts)
        if kl_in_loss:
            loss = loss + config.kl_coef * kl

    if config.entropy_coef > 0 and entropy is None:
        raise ConfigError(f"total_loss: entropy_coef={config.entropy_coef} needs the per-token "
                          "`entropy` of the policy (see token_entropy)")
    mean_entropy = zero if entropy is None else entropy_bonus(entropy, mask, **counts)
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * mean_entropy

    v_loss = zero
    if config.advantage_estimator == "gae":
        if values is None:
            raise ConfigError("total_loss: advantage_estimator='gae' needs the value head's `values`")
        v_loss = value_loss(values, _require(batch, "old_values", "the value loss"),
                            _require(batch, "returns", "the value loss"), mask,
                            value_clip=config.value_clip, **counts)
        loss = loss + config.value_coef * v_loss

    metrics.update(loss=loss, policy_loss=policy, kl=kl, entropy=mean_entropy, value_loss=v_loss)
    return loss, metrics
