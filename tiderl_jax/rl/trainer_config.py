"""The trainer's options (`TrainerConfig`, checked when built), its learning-rate schedule and its optimizer
(`rl/trainer.py` runs the step they configure)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from tiderl_jax.model.config import LORA_TARGETS, ConfigError
from tiderl_jax.model.decoder import KERNEL_PLATFORM, REMAT_POLICIES, TRAIN_ATTENTION
from tiderl_jax.rl import losses, shared_prompt

LR_SCHEDULES = ("constant", "cosine", "linear")
RECOMPUTE = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    loss: losses.LossConfig = losses.LossConfig()
    learning_rate: float = 1e-4
    # the schedule (`lr_schedule`): "constant" (RL's usual choice: veRL's actor default), or "cosine" /
    # "linear" decay to `end_lr_ratio` of the peak by the run's last update; after `warmup_steps` updates
    # of linear warm-up that does not start at 0 (update k < warmup_steps runs at (k + 1) / (warmup_steps + 1))
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000  # the run's updates: where a decay ends
    end_lr_ratio: float = 0.1  # the last update's learning rate / peak, with a decay
    weight_decay: float = 0.0  # AdamW, on matrices only (not norms, biases)
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0  # global norm
    row_len: int = 1024  # the longest trajectory trained on: the longest packed row
    micro_rows: int = 8  # rows of `row_len` per micro-batch (gradient accumulation over micro-batches)
    # rows sized to the batch (`trainer.row_layout`): of the buckets (16, 32, 48, 64, 96, ... up to row_len) that
    # hold the batch's longest trajectory, the one whose first-fit packing computes the least (padding and
    # attention pairs), micro-batches of the same tokens (micro_rows x row_len); False: always rows of row_len
    row_buckets: bool = True
    temperature: float = 1.0  # the rollout temperature (log-probs of the sampling distribution)
    decoupled: bool = True  # decoupled PPO: weight tokens by pi_prox / pi_behav (truncated)
    # the proximal log-probs (the trainer's log-probs of the batch under the weights the step starts from):
    # "auto" takes them from the update's own forward (module docstring) unless the reward reads them first (a
    # KL reward) or a critic scores the batch; then a separate pass runs unless the batch is on-policy (every
    # trained token sampled by the engine on exactly these weights: `Trainer.policy_version`), where the
    # engine's log-probs stand in for it (as Tunix, TRL and slime do); "always" runs the pass; "never" trusts the
    # behaviour log-probs whatever their age (PPO against pi_behav)
    recompute_proximal: str = "auto"
    # LongStraw in the step (rl/shared_prompt.py): GRPO groups sharing a prompt of at least
    # `shared_prompt_min_tokens` tokens run it once; "exact" equals the packed gradient, "approximate"
    # holds the prompt state constant (the paper's mode); "off" packs every sample as a full sequence.
    shared_prompt: str = "off"
    shared_prompt_min_tokens: int = 256
    # rematerialisation of the decoder layers in the train step (`model/decoder.py`'s REMAT_POLICIES: "none",
    # "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "save_out_proj"): less activation memory for
    # a recomputed forward; the gradients are the same (`Trainer.memory_plan` measures the memory)
    remat: str = "none"
    # the train step's decoder layers as one `jax.lax.scan` over their stacked weights: one layer compiled instead
    # of num_layers (the compile time of a deep model), for a copy of the weights stacked in each step
    scan_layers: bool = False
    # the train step's attention (`model/decoder.py`'s TRAIN_ATTENTION): "auto" takes JAX's Pallas flash attention
    # on a GPU ("pallas_gpu"), its splash attention on a TPU ("pallas_tpu"), the chunked XLA attention elsewhere
    # ("xla")
    attention_impl: str = "auto"
    # LoRA: low-rank adapters of `lora_rank` (0: full fine-tuning) on the `lora_targets` projections of every
    # layer, scaled by lora_alpha / lora_rank (`model/decoder.py`'s `add_adapters`); only they are trained (Adam's
    # state is theirs alone), the rollout engine samples from the adapted model, and an export merges them
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        problems = []
        for name in ("learning_rate", "grad_clip", "temperature"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        for name in ("row_len", "micro_rows", "total_steps", "shared_prompt_min_tokens"):
            if not getattr(self, name) >= 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"lr_schedule={self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if not 0 <= self.end_lr_ratio <= 1:
            problems.append(f"end_lr_ratio={self.end_lr_ratio} must be in [0, 1]")
        if not 0 <= self.warmup_steps < self.total_steps:
            problems.append(f"warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps})")
        if self.attention_impl not in ("auto",) + TRAIN_ATTENTION:
            problems.append(f"attention_impl={self.attention_impl!r} is not one of {('auto',) + TRAIN_ATTENTION}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"remat={self.remat!r} is not one of {tuple(REMAT_POLICIES)}")
        if self.recompute_proximal not in RECOMPUTE:
            problems.append(f"recompute_proximal={self.recompute_proximal!r} is not one of {RECOMPUTE}")
        if self.shared_prompt not in shared_prompt.MODES:
            problems.append(f"shared_prompt={self.shared_prompt!r} is not one of {shared_prompt.MODES}")
        elif self.shared_prompt != "off" and self.loss.advantage_estimator == "gae":
            problems.append(f"shared_prompt={self.shared_prompt!r} trains GRPO groups; PPO's value head "
                            "(advantage_estimator='gae') is trained on packed rows only: set shared_prompt='off'")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))  # a config's list too
        if self.lora_rank < 0:
            problems.append(f"lora_rank={self.lora_rank} must be >= 0 (0: full fine-tuning)")
        if set(self.lora_targets) - set(LORA_TARGETS) or (self.lora_rank and not self.lora_targets):
            problems.append(f"lora_targets={self.lora_targets} must be a non-empty subset of {LORA_TARGETS}")
        if self.lora_rank and self.shared_prompt != "off":
            problems.append("shared_prompt trains the whole model's shared-prompt gradients; with LoRA "
                            "(lora_rank > 0) set shared_prompt='off'")
        if self.loss.aggregation == "sequence":
            problems.append("aggregation='sequence' is a per-row mean, which packed rows (several "
                            "sequences per row) do not have; use 'token' or 'constant'")
        if problems:
            raise ConfigError("invalid trainer config: " + "; ".join(problems))


def lr_schedule(cfg: TrainerConfig) -> optax.Schedule:
    """The learning rate by applied update k = 0, 1, ...: during the warm-up (k < W = `warmup_steps`) the peak
    times (k + 1) / (W + 1), so the first update moves the policy; then the peak ("constant"), or a decay from
    the peak at k = W to `end_lr_ratio` of it at the run's last update k = `total_steps` - 1 ("cosine",
    "linear")."""
    peak, warm = cfg.learning_rate, cfg.warmup_steps
    end, span = peak * cfg.end_lr_ratio, max(cfg.total_steps - 1 - warm, 1)

    def schedule(count):
        k = jnp.asarray(count, jnp.float32)
        frac = jnp.clip((k - warm) / span, 0.0, 1.0)
        if cfg.lr_schedule == "cosine":
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        elif cfg.lr_schedule == "linear":
            after = peak + (end - peak) * frac
        else:
            after = jnp.full_like(k, peak)
        return jnp.where(k < warm, peak * (k + 1.0) / (warm + 1.0), after)
    return schedule


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `lr_schedule`."""
    schedule = lr_schedule(cfg)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                                   mask=decay_mask))


def train_attention(cfg: TrainerConfig) -> str:
    """The train step's attention on this platform: `attention_impl`, "auto" resolved."""
    if cfg.attention_impl != "auto":
        return cfg.attention_impl
    platform = jax.default_backend()
    return next((impl for impl, p in KERNEL_PLATFORM.items() if p == platform), "xla")
