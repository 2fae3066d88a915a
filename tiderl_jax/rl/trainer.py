"""The trainer: scoring, the sharded RL / SFT train step, and the optimizer.

```
trajectories --pack--> PackedBatch [micro, rows, T] --score(ref_params)--> ref_logp (when a loss reads it)
             rewards by GRPO group --advantages--> per-token advantages
             step: scan over micro-batches (grad accumulation) -> global-norm clip -> AdamW -> params
```

- **The proximal log-probs** (the weights the step starts from: PPO's trust-region centre) come from the
  update's own forward, under a stop-gradient: the step is one optimizer update over all its micro-batches,
  so every micro-batch's forward runs on exactly those weights and a separate proximal pass would compute
  the same numbers again. The pass runs only where something reads them before the update (a KL folded into
  the reward, PPO's critic) or where `recompute_proximal="always"` asks for it (the reference the in-step
  path is tested against).
- **Scoring** (`Trainer.score`): one jitted program computes per-token log-probs of a packed batch
  for any parameter set of the model family (the current policy = proximal / old log-probs; the
  reference model = a second parameter set), micro-batch by micro-batch (`lax.map`), sharded like
  the train step.
- **Train step**: one jitted program with explicit input and output shardings on the train mesh
  (parameters and optimizer state on their logical-axis shardings, donated; batch rows over
  `data x fsdp`). Gradients of the micro-batches are summed in float32 (`lax.scan`); each micro-batch's
  loss is normalised by the whole step's token and sequence counts, so the sum is exactly the loss of
  the whole batch. Metrics: every loss term, KL, clip fraction, entropy, gradient norm, tokens, and the
  update's learning rate (`lr`).
- **Bad steps**: a non-finite loss or gradient norm skips the update (parameters and optimizer
  state stay as they were, inside the same program), `skipped=1` in the metrics, and the trainer
  counts it and says so in the log; the run goes on.
- **Log-probs** are of the sampling distribution, `log_softmax(logits / temperature)`, so the
  engine's behaviour log-probs and the trainer's are comparable (decoupled PPO needs that).
- **SFT** (`Trainer.sft_step`): the same program with the token-mean negative log-likelihood of the
  model tokens (the supervised warm start on demonstrations).
- **Images**: a packed batch of a vision model's trajectories also holds `patches` and `patch_index`
  (`batch.pack(patch_dim=)`); scoring and both steps then feed them to the model with the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tiderl_jax import interrupts
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.buckets import half_pow2_buckets, next_pow2
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import (TRAIN_KERNELS, Decoder, add_adapters, causal_pairs_computed, init_decoder,
                                      split_adapters)
from tiderl_jax.model.sharding import (DEFAULT_RULES, ActivationSharding, Rules, from_host, host_value, place_copy,
                                       put, shard_model, spec_for, state_shardings)
from tiderl_jax.rl import losses, shared_prompt
from tiderl_jax.rl.advantages import gae_advantages, group_advantages
from tiderl_jax.rl.batch import PackedBatch, first_fit_rows, num_micro_batches, pack
from tiderl_jax.rl.trainer_config import TrainerConfig, lr_schedule, make_optimizer, train_attention

log = logging.getLogger(__name__)

# Metrics that are already normalised by the whole step's counts: micro-batch values add up.
_ADDITIVE = ("loss", "policy_loss", "kl", "entropy", "value_loss", "nll", "tokens")
_INPUTS = ("tokens", "positions", "segment_ids", "patches", "patch_index")  # the image ones: if present


# Positions per slice of the loss head (`head_logprobs`): a slice's [rows, slice, vocabulary] float32 logits,
# log-softmax and entropy terms are the update's largest buffers at long rows (Qwen's vocabulary of 151,936: 2.5 GB
# per array for a row of 4,096 tokens, against 0.6 GB for a slice of 1,024)
LOGIT_SLICE = 1024


def head_logprobs(model: Decoder, hidden, targets, temperature: float, slice_len: int = LOGIT_SLICE):
    """(log-prob of each of `targets` [b, n], entropy of its next-token distribution [b, n]) under the logits of the
    final hidden states `hidden` [b, n, e], in slices of `slice_len` positions, each rematerialised: the backward
    recomputes a slice's logits from its hidden states instead of keeping [b, n, vocabulary] arrays. Per position
    the arithmetic is the unsliced one's (tested against it)."""
    constrain = model.activation_sharding  # the logits' layout, as the model's own forward pins it

    def head(h, tgt):
        logits = model.logits(h)
        if constrain is not None:
            logits = constrain(logits, ("batch", "seq", "vocab"))
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
        return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    b, n = targets.shape
    if n <= slice_len:
        return head(hidden, targets)
    k = -(-n // slice_len)
    pad = k * slice_len - n
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, k, slice_len, -1).swapaxes(0, 1)
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, k, slice_len).swapaxes(0, 1)
    logp, entropy = jax.lax.map(lambda xs: jax.checkpoint(head)(*xs), (h, t))
    unslice = lambda x: x.swapaxes(0, 1).reshape(b, k * slice_len)[:, :n]  # noqa: E731
    return unslice(logp), unslice(entropy)


def token_logprobs(model: Decoder, tokens, positions, segment_ids, temperature: float,
                   patches=None, patch_index=None):
    """Per-token log-prob of each token given the tokens before it in its segment, and the entropy
    of that next-token distribution: both `[b, t]`, 0 at each row's first position. A vision model
    also takes the rows' images (`patches [b, t, patch_dim]`, `patch_index [b, t]`)."""
    hidden, _ = model(tokens, positions, segment_ids=segment_ids, patches=patches, patch_index=patch_index,
                      return_hidden=True)
    logp, entropy = head_logprobs(model, hidden[:, :-1], tokens[:, 1:], temperature)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)


class ValueHead(nnx.Module):
    """PPO's critic: a linear map of the policy's final hidden state to a scalar value (zero init,
    so training starts from V = 0). It shares the policy's trunk; its gradient reaches the trunk."""

    def __init__(self, hidden_size: int, *, rngs: nnx.Rngs | None = None):
        del rngs  # zero initialisation needs no randomness
        self.w = nnx.Param(jnp.zeros((hidden_size,), jnp.float32), axes=("embed",))
        self.b = nnx.Param(jnp.zeros((), jnp.float32), axes=())

    def __call__(self, hidden: jax.Array) -> jax.Array:
        return hidden.astype(jnp.float32) @ self.w[...] + self.b[...]


def _forward(graphdefs, params, micro, temperature, frozen=None):
    """(logp, entropy, values or None), each `[b, t]` and shifted like `token_logprobs`: the value
    of token t is the critic's estimate at the state before it (position t - 1). `frozen`: the policy's weights
    that `params` leaves out (LoRA's base: `params` then holds the adapters)."""
    policy = lambda p: nnx.merge(graphdefs[0], p) if frozen is None else nnx.merge(graphdefs[0], frozen, p)  # noqa: E731
    if graphdefs[1] is None:
        model = policy(params)
        logp, entropy = token_logprobs(model, micro["tokens"], micro["positions"], micro["segment_ids"],
                                       temperature, micro.get("patches"), micro.get("patch_index"))
        return logp, entropy, None
    model, head = policy(params[0]), nnx.merge(graphdefs[1], params[1])
    tokens = micro["tokens"]
    hidden, _ = model(tokens, micro["positions"], segment_ids=micro["segment_ids"],
                      patches=micro.get("patches"), patch_index=micro.get("patch_index"), return_hidden=True)
    logp, entropy = head_logprobs(model, hidden[:, :-1], tokens[:, 1:], temperature)
    values = head(hidden[:, :-1])
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return tuple(jnp.concatenate([pad, x], axis=1) for x in (logp, entropy, values))


def _score_program(graphdefs, temperature, params, batch):
    def one(micro):
        logp, _, values = _forward(graphdefs, params, micro, temperature)
        live = micro["segment_ids"] > 0
        return jnp.where(live, logp, 0.0), jnp.where(live, values, 0.0) if values is not None else None
    return jax.lax.map(one, {k: batch[k] for k in _INPUTS if k in batch})


def _micro_loss(graphdefs, cfg: TrainerConfig, kind: str, params, micro, num_tokens, num_sequences, frozen=None):
    logp, entropy, values = _forward(graphdefs, params, micro, cfg.temperature, frozen)
    mask = micro["mask"]
    if kind == "sft":
        nll = -jnp.sum(jnp.where(mask > 0, logp, 0.0)) / jnp.maximum(num_tokens, 1)
        ent = jnp.sum(jnp.where(mask > 0, entropy, 0.0)) / jnp.maximum(num_tokens, 1)
        return nll, {"loss": nll, "nll": nll, "entropy": ent, "tokens": mask.sum()}
    batch = {k: micro[k] for k in ("mask", "advantages")}
    # absent: the proximal log-probs are this forward's own (the step's weights; module docstring)
    batch["proximal_logp"] = micro["proximal_logp"] if "proximal_logp" in micro else jax.lax.stop_gradient(logp)
    if cfg.decoupled:
        batch["behaviour_logp"] = micro["behaviour_logp"]
    for key in ("ref_logp", "returns", "old_values"):
        if key in micro:
            batch[key] = micro[key]
    return losses.total_loss(cfg.loss, batch, logp, entropy=entropy, values=values, num_tokens=num_tokens,
                             num_sequences=num_sequences)


def _fixed_norm(cfg: TrainerConfig) -> TrainerConfig:
    """`cfg` with "constant" aggregation's default length pinned to `row_len` (the config's row, whatever length
    a batch's rows are bucketed to, so the loss's scale does not move with the bucket)."""
    if cfg.loss.aggregation == "constant" and cfg.loss.norm_len is None:
        return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, norm_len=cfg.row_len))
    return cfg


def row_layout(cfg: TrainerConfig, lengths: Sequence[int], pair_cost: float = 0.0) -> tuple[int, int]:
    """(row length, rows per micro-batch) of a batch of trajectories of `lengths` tokens.

    With `row_buckets`, rows are sized to the batch: of the buckets that hold its longest trajectory (powers of two
    from 16 and 1.5x between, up to `row_len` and the power of two above the longest; a multiple of the train
    attention kernel's block), the one whose
    first-fit packing computes the least, micro-batches holding `micro_rows x row_len` tokens (fewer rows, in the
    micro-batch counts' steps, when the whole batch takes fewer). A row's cost is
    `row + pair_cost x (the (query, key) pairs its causal attention computes)`; `pair_cost` is the model's
    attention FLOPs per pair over its matmul FLOPs per token (`packing_pair_cost`), so a longer row that packs
    trajectories together is weighed against its attention. Equal costs take the shorter row."""
    if not cfg.row_buckets or not lengths:
        return cfg.row_len, cfg.micro_rows
    longest = max(lengths)
    if longest >= cfg.row_len:
        return cfg.row_len, cfg.micro_rows
    multiple = TRAIN_KERNELS.get(train_attention(cfg), (None, 16))[1]
    # not past the power of two that holds the longest: a longer row packs more trajectories together, but on
    # this CPU its attention cost more than the padding it saved (SmolLM2: 8 rows of 512 tokens 14.7 s, 4 of 768
    # holding the same trajectories 16.3 s)
    top = max(next_pow2(longest), -(-longest // multiple) * multiple)
    rows = [b for b in half_pow2_buckets(min(16, cfg.row_len), cfg.row_len)
            if longest <= b <= top and (b % multiple == 0 or b == cfg.row_len)] or [cfg.row_len]
    best = None
    for row in rows:
        count, micro_rows = len(first_fit_rows(lengths, row)), max(1, cfg.micro_rows * cfg.row_len // row)
        micro_rows = min(micro_rows, num_micro_batches(count, 1))  # a batch smaller than one micro-batch: its rows
        micro = num_micro_batches(count, micro_rows)
        cost = micro * micro_rows * (row + pair_cost * causal_pairs_computed(row))
        if best is None or cost < best[0]:
            best = (cost, row, micro_rows)
    return best[1], best[2]


def packing_pair_cost(model_cfg: ModelConfig) -> float:
    """`row_layout`'s weight of one attention (query, key) pair against one token's matmuls (FLOPs over FLOPs)."""
    return model_cfg.attention_flops_per_pair / (2 * model_cfg.matmul_params)


def _shared_loss(cfg: TrainerConfig) -> shared_prompt.ResponseLoss:
    """A shared response's loss: the packed path's, with "constant" aggregation's default length the
    packed rows' length (the T a packed micro-batch would normalise by)."""
    return shared_prompt.ResponseLoss(_fixed_norm(cfg).loss, cfg.decoupled)


def _train_program(graphdefs, tx, cfg: TrainerConfig, kind: str, params, opt_state, batch, shared=(), frozen=None):
    """`batch`: the packed micro-batches (absent when every sample is in a shared group) and the step's
    counts; `shared`: the shared groups' stacked shape classes (`rl/shared_prompt.py`); `params` the trained
    weights, `frozen` (LoRA's base) the policy's others: no gradient, no optimizer state."""
    batch = dict(batch)
    num_tokens, num_sequences = batch.pop("num_tokens"), batch.pop("num_sequences")
    grad_fn = jax.value_and_grad(functools.partial(_micro_loss, graphdefs, cfg, kind), has_aux=True)
    grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(acc, micro):
        (_, metrics), grads = grad_fn(params, micro, num_tokens, num_sequences, frozen)
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), metrics

    parts = []
    if "tokens" in batch:
        grads, per_micro = jax.lax.scan(body, grads, batch)
        parts.append(per_micro)
    if shared:
        shared_grads, per_response = shared_prompt.class_gradients(
            graphdefs[0], _shared_loss(cfg), cfg.shared_prompt, cfg.temperature, params, shared,
            num_tokens, num_sequences)
        grads = jax.tree.map(jnp.add, grads, shared_grads)
        parts.extend(per_response)
    per_micro = {k: jnp.concatenate([p[k] for p in parts]) for k in parts[0]}
    weights = per_micro["tokens"] / jnp.maximum(per_micro["tokens"].sum(), 1)
    metrics = {k: v.sum() if k in _ADDITIVE else (v * weights).sum() for k, v in per_micro.items()}
    grad_norm = optax.tree.norm(grads)
    if kind == "gradients":  # Trainer.gradients: the summed gradient, nothing updated
        return grads, dict(metrics, grad_norm=grad_norm, sequences=num_sequences.astype(jnp.float32))
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
    metrics.update(grad_norm=grad_norm, skipped=(~ok).astype(jnp.float32),
                   sequences=num_sequences.astype(jnp.float32))
    return keep(new_params, params), keep(new_opt_state, opt_state), metrics


def batch_shardings(batch: dict, mesh: Mesh, rules: Rules) -> dict:
    """A packed batch's shardings: [micro-batches, rows, tokens(, features)] rows over the batch axes, tokens over
    the sequence axis; scalars (the step's counts) replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    names = (None, "batch", "seq", None)  # patches have a trailing feature axis
    return {k: rep if np.ndim(v) == 0 else NamedSharding(mesh, spec_for(np.shape(v), names[:np.ndim(v)], rules, mesh))
            for k, v in batch.items()}


def step_memory(model_cfg: ModelConfig, config: TrainerConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                kind: str = "rl"):
    """XLA's memory analysis (per device) of one update's program on a micro-batch of `micro_rows` full rows of
    `row_len` tokens, the optimizer update included (`kind="gradients"`: up to the gradient, the program
    `Trainer.memory_plan` compiles), compiled for `mesh` from abstract weights: nothing is allocated, so a model
    larger than this machine is planned here (`benchmarks/memory_plan.py`; `check_fits` at start-up)."""
    if config.lora_rank:
        model_cfg = dataclasses.replace(model_cfg, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
                                        lora_targets=config.lora_targets)
    model = nnx.eval_shape(lambda: init_decoder(model_cfg, seed=0))
    model.remat, model.train_attention, model.scan_layers = config.remat, train_attention(config), config.scan_layers
    model.activation_sharding = ActivationSharding(mesh, rules)
    graphdef, state = nnx.split(model)
    params = jax.tree.unflatten(jax.tree.structure(state), [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings(state, mesh, rules)))])
    params, frozen = split_adapters(params) if config.lora_rank else (params, None)
    tx = make_optimizer(config)
    ps = jax.tree.map(lambda x: x.sharding, params)
    os_ = opt_state_shardings(tx, params, ps, mesh)
    opt_state = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                             jax.eval_shape(tx.init, params), os_)
    trajectories = _warmup_trajectories(1, config)
    packed = pack(trajectories, row_len=config.row_len, micro_rows=config.micro_rows)
    arrays = dict(packed.arrays, advantages=np.zeros_like(packed.arrays["mask"]), num_tokens=np.float32(1),
                  num_sequences=np.float32(len(trajectories)))
    shardings = batch_shardings(arrays, mesh, rules)
    batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=shardings[k])
             for k, v in arrays.items()}
    rep = NamedSharding(mesh, PartitionSpec())
    fn = functools.partial(_train_program, (graphdef, None), tx, _fixed_norm(config), kind)
    program = jax.jit(fn, in_shardings=(ps, os_, shardings, [], jax.tree.map(lambda x: x.sharding, frozen)),
                      out_shardings=(ps, rep) if kind == "gradients" else (ps, os_, rep),
                      donate_argnums=() if kind == "gradients" else (0, 1))
    return program.lower(params, opt_state, batch, [], frozen).compile().memory_analysis()


def opt_state_shardings(tx: optax.GradientTransformation, trainable, shardings, mesh: Mesh):
    """The optimizer state's shardings on `mesh`: each copy of the parameter tree in it (Adam's moments) laid out
    as the parameters are (`shardings`), the rest (counts) replicated. Left to XLA, a moment initialised from
    zeros comes out replicated: every device would hold both moments of the whole model."""
    rep = NamedSharding(mesh, PartitionSpec())
    return optax.tree_utils.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, trainable),
                                            shardings, transform_non_params=lambda _: rep)


def _same_layout_on(x: jax.Array, mesh: Mesh) -> NamedSharding:
    """x's partitioning carried over to `mesh`, dropping mesh axes that no longer divide its dims
    (optimizer moments follow their parameters; scalars stay replicated)."""
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
    dims = []
    for size, axes in zip(x.shape, tuple(spec) + (None,) * (x.ndim - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        ways = 1
        for a in names:
            ways *= mesh.shape[a]
        dims.append(axes if names and size % ways == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*dims))


class Trainer:
    """Owns the train-side parameters and optimizer state of one policy on one mesh."""

    def __init__(self, model: Decoder, config: TrainerConfig = TrainerConfig(), *,
                 mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES, ref_params=None):
        self.config = config
        self.mesh, self.rules = mesh, rules
        model.remat, model.scan_layers = config.remat, config.scan_layers  # the train step's layers (full mode)
        model.train_attention = train_attention(config)
        if config.lora_rank and not model.cfg.lora_rank:  # (the main job's model has them from `config.build`)
            add_adapters(model, config.lora_rank, config.lora_alpha, config.lora_targets)
            if mesh is not None:
                shard_model(model, mesh, rules)
        if model.cfg.lora_rank != config.lora_rank:
            raise ConfigError(f"the model's LoRA rank is {model.cfg.lora_rank} and trainer.lora_rank "
                              f"{config.lora_rank}: build the model with the trainer's adapters")
        self.lora = config.lora_rank > 0  # only the adapters train (`_trainable`); the base is `_frozen`
        self.graphdef, params = nnx.split(model)
        # Our own copy: the train step donates its parameters, which must not be the caller's.
        self.params = place_copy(params, jax.tree.map(lambda x: x.sharding, params))
        self.patch_dim = model.cfg.image_patch_dim  # packs trajectories with images (0: text-only)
        self.pair_cost = packing_pair_cost(model.cfg)  # row_layout's weight of attention
        # The reference model: a second parameter set of the same family; with a KL term and none
        # given, a frozen copy of the starting policy (the usual choice). Scored only when the loss reads it.
        if ref_params is None and config.loss.uses_reference:
            ref_params = place_copy(self.params, jax.tree.map(lambda x: x.sharding, self.params))
        self.ref_params = ref_params
        # PPO with GAE: a value head on the policy's trunk, trained with it (one optimizer state).
        self.value_graphdef, self.value_params = None, None
        if config.loss.advantage_estimator == "gae":
            self.value_graphdef, self.value_params = nnx.split(ValueHead(model.cfg.hidden_size))
            if mesh is not None:
                self.value_params = put(self.value_params,
                                                   state_shardings(self.value_params, mesh, rules))
        self.tx = make_optimizer(config)
        self.schedule = lr_schedule(config)
        trainable = self._trainable()
        self.opt_state = jax.jit(self.tx.init, out_shardings=None if mesh is None else opt_state_shardings(
            self.tx, trainable, self._shardings(trainable), mesh))(trainable)
        self.step_count = 0
        self.skipped_steps = 0
        # the policy version the parameters are (the engine tags each sampled token with its weights' version):
        # set by the owner (`JaxBackend`: at the start, a restore) and advanced by each applied RL step; None:
        # unknown, so no batch counts as on-policy (`recompute_proximal="auto"` then always recomputes)
        self.policy_version: int | None = None
        self._programs: dict[tuple, object] = {}
        self.compile_s = 0.0  # wall seconds of calls that compiled a program
        # Set to {} to compile each new program ahead of time and keep XLA's memory analysis of it
        # here, by program key (benchmarks/long_context.py); None: plain jit.
        self.program_memory: dict | None = None
        self._dry_run = False  # memory_plan: compile the step's programs, run none

    def learning_rate(self) -> float:
        """The next update's learning rate: the schedule at the optimizer's count of applied updates (a skipped
        update does not count; a restored optimizer state brings its count)."""
        count = optax.tree_utils.tree_get(self.opt_state, "count", filtering=lambda path, _: getattr(
            path[-1], "tuple_name", None) == "ScaleByScheduleState")
        return float(self.schedule(count))

    def _trainable(self):
        """What the optimizer updates: the policy (with LoRA its adapters), or (that, value head) with GAE."""
        policy = split_adapters(self.params)[0] if self.lora else self.params
        return policy if self.value_params is None else (policy, self.value_params)

    def _frozen(self):
        """The policy's weights the optimizer leaves alone: LoRA's base, else None."""
        return split_adapters(self.params)[1] if self.lora else None

    def _graphdefs(self):
        return (self.graphdef, self.value_graphdef)

    def move_to(self, mesh: Mesh) -> None:
        """Continues on another mesh (an ERS move at a step boundary): parameters, value head,
        reference parameters and optimizer state are resharded there; programs recompile."""
        model = nnx.merge(self.graphdef, put(self.params, state_shardings(self.params, mesh, self.rules)))
        model.activation_sharding = ActivationSharding(mesh, self.rules)  # activations pinned there too
        self.graphdef, self.params = nnx.split(model)
        if self.value_params is not None:
            self.value_params = put(self.value_params,
                                               state_shardings(self.value_params, mesh, self.rules))
        if self.ref_params is not None:
            self.ref_params = put(self.ref_params, state_shardings(self.ref_params, mesh, self.rules))
        self.opt_state = put(self.opt_state, jax.tree.map(lambda x: _same_layout_on(x, mesh), self.opt_state))
        self.mesh = mesh
        self._programs.clear()

    def model(self) -> Decoder:
        """The current policy as a module (for the engine's weight update, evaluation)."""
        return nnx.merge(self.graphdef, self.params)

    # ------------------------------------------------------------------ shardings

    def _shardings(self, tree):
        return jax.tree.map(lambda x: x.sharding, tree)

    def _batch_sharding(self, batch: dict):
        return None if self.mesh is None else batch_shardings(batch, self.mesh, self.rules)

    def _program(self, key, build):
        """The jitted program for `key` (a shape bucket); a new one's first call, which compiles it,
        is timed into `compile_s` (what a move to a new mesh costs again)."""
        fn = self._programs.get(key)
        if fn is not None:
            return fn
        fn = self._programs[key] = build()

        def first_call(*args):
            t0 = time.perf_counter()
            if self.program_memory is not None:
                compiled = self._programs[key] = fn.lower(*args).compile()
                self.program_memory[key] = compiled.memory_analysis()
                out = (jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(fn, *args))
                       if self._dry_run else jax.block_until_ready(compiled(*args)))
            else:
                out = jax.block_until_ready(fn(*args))
            self.compile_s += time.perf_counter() - t0
            return out
        return first_call

    def _put(self, batch: dict):
        shardings = self._batch_sharding(batch)
        if shardings is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {k: from_host(v, shardings[k]) for k, v in batch.items()}  # across processes: no check

    # ------------------------------------------------------------------ scoring

    def score(self, packed: PackedBatch, params=None) -> np.ndarray:
        """Per-token log-probs `[micro, rows, T]` of the packed batch under `params` (default: the
        current policy; pass `ref_params` for the reference model)."""
        return self._score(packed, self.params if params is None else params, with_values=False)[0]

    def score_values(self, packed: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
        """(log-probs, critic values), both `[micro, rows, T]`, under the current policy and value head."""
        return self._score(packed, self._trainable(), with_values=True)

    def _score(self, packed: PackedBatch, params, *, with_values: bool):
        batch = self._put({k: packed.arrays[k] for k in _INPUTS if k in packed.arrays})
        graphdefs = self._graphdefs() if with_values else (self.graphdef, None)

        def build():
            fn = functools.partial(_score_program, graphdefs, self.config.temperature)
            if self.mesh is None:
                return jax.jit(fn)
            out = self._batch_sharding({"x": packed.arrays["tokens"]})["x"]
            return jax.jit(fn, in_shardings=(self._shardings(params), self._batch_sharding(batch)),
                           out_shardings=(out, out if with_values else None))
        key = ("score", with_values, tuple(sorted((k, np.shape(v)) for k, v in batch.items())))
        logp, values = self._program(key, build)(params, batch)
        return host_value(logp), None if values is None else host_value(values)

    def _put_shared(self, classes: list[dict]) -> list[dict]:
        """The shared groups' stacked arrays on the train mesh, replicated (each group is scanned whole)."""
        if self.mesh is None:
            return [{k: jnp.asarray(v) for k, v in c.items()} for c in classes]
        rep = NamedSharding(self.mesh, PartitionSpec())
        return [{k: from_host(v, rep) for k, v in c.items()} for c in classes]

    def score_shared(self, shared: shared_prompt.SharedBatch, params=None) -> list[np.ndarray]:
        """Per-token log-probs [n, G, R] of each shape class of shared groups under `params` (default: the
        current policy), each prompt run once and every response replayed on its K/V, without a graph."""
        params = self.params if params is None else params
        classes = self._put_shared([{k: c[k] for k in ("prompt", "length", "responses")} for c in shared.classes])

        def build():
            fn = functools.partial(shared_prompt.score_classes, self.graphdef, self.config.temperature)
            if self.mesh is None:
                return jax.jit(fn)
            rep = NamedSharding(self.mesh, PartitionSpec())
            return jax.jit(fn, in_shardings=(self._shardings(params), jax.tree.map(lambda _: rep, classes)),
                           out_shardings=rep)
        key = ("score_shared", tuple(c["responses"].shape + c["prompt"].shape[1:] for c in shared.classes))
        return [host_value(x) for x in self._program(key, build)(params, classes)]

    # ------------------------------------------------------------------ steps

    def _run_step(self, kind: str, arrays: dict, num_sequences: int, *, apply: bool = True,
                  shared: shared_prompt.SharedBatch | None = None) -> dict:
        """One optimizer step on the packed arrays (and the shared groups' classes, if any); `apply=False`
        (a warm-up) runs the same program on copies of the parameters and optimizer state (its inputs are
        donated) and keeps nothing."""
        num_tokens = (float(arrays["mask"].sum()) if "mask" in arrays else 0.0) + (shared.num_tokens if shared else 0.0)
        arrays = dict(arrays, num_tokens=np.float32(num_tokens), num_sequences=np.float32(num_sequences))
        batch = self._put(arrays)
        classes = self._put_shared(shared.classes) if shared else []

        graphdefs, trainable, frozen = self._graphdefs(), self._trainable(), self._frozen()

        def build():
            fn = functools.partial(_train_program, graphdefs, self.tx, _fixed_norm(self.config), kind)
            donate = () if kind == "gradients" else (0, 1)
            if self.mesh is None:
                return jax.jit(fn, donate_argnums=donate)
            ps, os_ = self._shardings(trainable), self._shardings(self.opt_state)
            rep = NamedSharding(self.mesh, PartitionSpec())
            return jax.jit(fn, in_shardings=(ps, os_, self._batch_sharding(batch), jax.tree.map(lambda _: rep, classes),
                                             self._shardings(frozen)),
                           out_shardings=(ps, rep) if kind == "gradients" else (ps, os_, rep), donate_argnums=donate)
        key = (kind, tuple(sorted((k, np.shape(v)) for k, v in arrays.items())),
               tuple(tuple(sorted((k, v.shape) for k, v in c.items())) for c in classes))
        if not apply:
            copies = jax.tree.map(lambda x: x.copy(), (trainable, self.opt_state))
            jax.block_until_ready(self._program(key, build)(*copies, batch, classes, frozen))
            return {}
        if kind == "gradients":
            grads, metrics = self._program(key, build)(trainable, self.opt_state, batch, classes, frozen)
            return {"gradients": grads, **{k: float(v) for k, v in metrics.items()}}
        lr = self.learning_rate()  # read before the step: it donates the optimizer state
        with interrupts.deferred():  # Ctrl-C after the donation but before the stores would lose the state
            trainable, self.opt_state, metrics = self._program(key, build)(trainable, self.opt_state, batch, classes,
                                                                           frozen)
            if self.value_params is not None:
                policy, self.value_params = trainable
            else:
                policy = trainable
            self.params = nnx.merge_state(frozen, policy) if self.lora else policy
            self.step_count += 1
        metrics = dict({k: float(v) for k, v in metrics.items()}, lr=lr)
        if metrics["skipped"]:
            self.skipped_steps += 1
            log.warning("step %d: non-finite loss (%s) or gradient norm (%s); update skipped "
                        "(%d skipped so far)", self.step_count, metrics["loss"], metrics["grad_norm"],
                        self.skipped_steps)
        return metrics

    def sft_step(self, packed: PackedBatch) -> dict:
        """One supervised step: token-mean NLL of the model tokens of the packed demonstrations."""
        arrays = {k: packed.arrays[k] for k in _INPUTS + ("mask",) if k in packed.arrays}
        return self._run_step("sft", arrays, packed.num_sequences)

    def warmup(self, micro_counts: Sequence[int], row_lens: Sequence[int] | None = None) -> float:
        """Loads every program a step of each packed micro-batch count in `micro_counts` runs (proximal and
        reference scoring, the update) with rows of each of `row_lens` tokens (default: `row_len`; a batch's rows
        are sized to it: `row_layout`), compiling it or reading it from the persistent compile cache, without
        changing the policy, the optimizer state or the step count; returns the seconds it took. A run that
        warms up before its first step pays no program load inside its steps."""
        t0 = time.perf_counter()
        for row in row_lens or [self.config.row_len]:
            for m in micro_counts:
                self.rl_step(_warmup_trajectories(m, self.config, row), apply=False)
        return time.perf_counter() - t0

    def memory_plan(self, trajectories: Sequence[Trajectory]) -> dict:
        """Compiles every program that a step on `trajectories` runs up to its gradient (scoring, the
        gradient), runs none of them, and returns XLA's memory analysis of each (per device), by program
        key: whether a step fits before trying it. The optimizer update adds its state, constant in the batch."""
        saved = self.program_memory, self._programs, self.compile_s
        self.program_memory, self._programs, self._dry_run = {}, {}, True
        try:
            self.gradients(trajectories)
            return self.program_memory
        finally:
            self.program_memory, self._programs, self.compile_s = saved
            self._dry_run = False

    def gradients(self, trajectories: Sequence[Trajectory]) -> dict:
        """What `rl_step` would do up to its gradient, changing nothing: {"gradients": the summed float32
        gradient (before clipping), the step's metrics}. For diagnostics and benchmarks."""
        return self.rl_step(trajectories, _kind="gradients")

    def rl_step(self, trajectories: Sequence[Trajectory], *, apply: bool = True, _kind: str = "rl") -> dict:
        """Packs, scores (proximal and, with a reference model, reference log-probs), computes group
        advantages and takes one optimizer step. Trajectories that cannot be trained on are left out
        and counted (`dropped`). With `shared_prompt` on, GRPO groups that share a long enough prompt
        are scored and trained prompt-once (`rl/shared_prompt.py`), the rest packed as always.
        `apply=False`: the same programs, nothing kept (`warmup`)."""
        cfg = self.config
        shared, rest = None, list(range(len(trajectories)))
        if cfg.shared_prompt != "off":
            shared, rest = shared_prompt.split(trajectories, rest, min_tokens=cfg.shared_prompt_min_tokens,
                                               max_response=cfg.row_len)
            shared = shared if shared.groups else None
        sub = [trajectories[i] for i in rest]
        row_len, micro_rows = row_layout(cfg, [len(t.tokens) for t in sub], self.pair_cost)
        packed = pack(sub, row_len=row_len, micro_rows=micro_rows, patch_dim=self.patch_dim)
        for i, reason in packed.dropped:
            log.warning("trajectory %s left out of the step: %s", sub[i].task_id, reason)
        if not packed.kept and shared is None:
            return {"dropped": float(len(packed.dropped)), "skipped": 1.0}
        # The kept trajectories: the packed ones in placement order, then the shared groups' members.
        kept = [sub[i] for i in packed.kept]
        shared_index = list(shared.where) if shared else []
        kept += [trajectories[i] for i in shared_index]
        prompt_len = {i: g.prompt_len for g in (shared.groups if shared else []) for i in g.members}

        def per_token(name: str, j: int) -> np.ndarray:  # kept trajectory j's trained span of `name`
            if j < len(packed.kept):
                return packed.per_token(name, j)
            i = shared_index[j - len(packed.kept)]
            return shared.per_token(name, i, len(trajectories[i].tokens) - prompt_len[i])

        def score(params) -> dict:  # proximal or reference log-probs of both parts
            out = {"packed": self.score(packed, params) if packed.kept else None}
            out["shared"] = self.score_shared(shared, params) if shared else []
            return out

        def store(name: str, scores: dict) -> None:
            if scores["packed"] is not None:
                packed.arrays[name] = scores["packed"]
            for c, x in zip(shared.classes if shared else [], scores["shared"]):
                c[name] = np.where(c["mask"] > 0, x, 0.0).astype(np.float32)

        on_policy = self.policy_version is not None and all(
            v == self.policy_version for t in kept for v, m in zip(t.versions, t.loss_mask) if m)
        kl_reward = cfg.loss.kl_as_reward and cfg.loss.kl_coef > 0 and (
            self.ref_params is not None or all(t.info.get("ref_logp") is not None for t in kept))
        in_step = cfg.recompute_proximal == "auto" and self.value_params is None and not kl_reward
        recompute = not in_step and (cfg.recompute_proximal == "always" or not apply or self.value_params is not None
                                     or (cfg.recompute_proximal == "auto" and not on_policy))
        t0 = time.perf_counter()
        if self.value_params is not None:  # PPO with a critic: packed rows only (no shared_prompt with "gae")
            packed.arrays["proximal_logp"], packed.arrays["old_values"] = self.score_values(packed)
        elif recompute:
            store("proximal_logp", score(self.params))
        elif in_step:  # the update's forward computes them (module docstring)
            pass
        else:  # the engine's log-probs of these very weights stand in for the pass
            store("proximal_logp", {"packed": packed.arrays["behaviour_logp"].copy() if packed.kept else None,
                                    "shared": [c["behaviour_logp"] for c in (shared.classes if shared else [])]})
        t_proximal, t_ref = time.perf_counter() - t0, 0.0
        drift = _behaviour_drift(packed) if recompute and on_policy and packed.kept else {}
        has_ref = all(t.info.get("ref_logp") is not None for t in kept)
        if has_ref:  # scored ahead, on the ref's own devices (RA2P decoupled)
            packed.arrays["ref_logp"] = np.zeros_like(packed.arrays["mask"])
            for j, t in enumerate(kept[:len(packed.kept)]):
                m, r, start, n = packed.placements[j]
                packed.arrays["ref_logp"][m, r, start:start + n] = t.info["ref_logp"]
            for c in shared.classes if shared else []:
                c["ref_logp"] = np.zeros_like(c["mask"])
            for i in shared_index:
                shared.fill("ref_logp", i, np.asarray(trajectories[i].info["ref_logp"])[prompt_len[i]:])
        elif self.ref_params is not None and cfg.loss.uses_reference:
            t0 = time.perf_counter()
            store("ref_logp", score(self.ref_params))
            t_ref, has_ref = time.perf_counter() - t0, True
        rewards = np.asarray([t.reward for t in kept], np.float32)
        if cfg.loss.kl_as_reward and cfg.loss.kl_coef > 0 and has_ref:
            for j in range(len(kept)):
                k = losses.kl_estimate(per_token("proximal_logp", j), per_token("ref_logp", j),
                                       cfg.loss.kl_estimator, mask=per_token("mask", j))
                rewards[j] -= cfg.loss.kl_coef * float(jnp.sum(k))
        if self.value_params is None:
            adv = group_advantages(cfg.loss, rewards, [t.group for t in kept])
            packed.fill_per_sequence("advantages", adv[:len(packed.kept)])
            for j, i in enumerate(shared_index):
                a = adv[len(packed.kept) + j]
                c, g, row = shared.where[i]
                shared.classes[c]["advantages"][g, row] = a * shared.classes[c]["mask"][g, row]
        else:
            packed.arrays["advantages"], packed.arrays["returns"] = gae_advantages(cfg.loss, packed, rewards)
        arrays = dict(packed.arrays) if packed.kept else {}
        t0 = time.perf_counter()
        metrics = self._run_step(_kind, arrays, len(kept), apply=apply, shared=shared)
        if not apply:
            return {}
        if _kind != "rl":
            return metrics
        # wall seconds of each part (compiles included): what RA2P's cost model reads
        metrics.update(dropped=float(len(packed.dropped)), reward=float(rewards.mean()),
                       time_proximal_s=t_proximal, time_ref_s=t_ref, time_update_s=time.perf_counter() - t0,
                       shared_groups=float(len(shared.groups) if shared else 0),
                       proximal_recomputed=float(recompute), proximal_in_step=float(in_step),
                       on_policy=float(on_policy), **drift,
                       # what the step's passes compute: token slots (padding included), real tokens, and the causal
                       # attention pairs the sequences need (benchmarks/rl_step.py's FLOPs)
                       tokens_computed=float(packed.arrays["mask"].size if packed.kept else 0),
                       tokens_real=float(sum(len(t.tokens) for t in kept)),
                       attention_pairs=float(sum(len(t.tokens) * (len(t.tokens) + 1) // 2 for t in kept)),
                       attention_pairs_computed=float(packed.arrays["mask"].shape[0] * packed.arrays["mask"].shape[1]
                                                      * causal_pairs_computed(row_len) if packed.kept else 0),
                       row_len=float(row_len if packed.kept else 0))
        self.policy_version = None if self.policy_version is None else self.policy_version + 1
        return metrics


def _behaviour_drift(packed: PackedBatch) -> dict:
    """|trainer log-prob - engine log-prob| on the trained tokens of an on-policy batch (the same weights on
    both sides): mean and 99th percentile, what `recompute_proximal="auto"` ignores when it skips the pass."""
    mask = packed.arrays["mask"] > 0
    if not mask.any():
        return {}
    d = np.abs(packed.arrays["proximal_logp"][mask] - packed.arrays["behaviour_logp"][mask])
    return {"behaviour_logp_diff_mean": float(d.mean()), "behaviour_logp_diff_p99": float(np.percentile(d, 99))}


class Scorer:
    """Per-token log-probs of trajectories under one parameter set on its own mesh: the reference
    model when RA2P runs it decoupled from the actor (on the ref devices, as trajectories arrive)."""

    def __init__(self, model: Decoder, config: TrainerConfig, *, mesh: Mesh | None = None,
                 rules: Rules = DEFAULT_RULES):
        self.config = config
        self.mesh, self.rules = mesh, rules
        self.graphdef, self.params = nnx.split(model)
        self.patch_dim = model.cfg.image_patch_dim
        self.pair_cost = packing_pair_cost(model.cfg)
        self._programs: dict = {}
        self.compile_s = 0.0
        self.program_memory, self._dry_run = None, False  # as Trainer's

    _batch_sharding = Trainer._batch_sharding
    _shardings = Trainer._shardings
    _program = Trainer._program
    _put = Trainer._put
    _score = Trainer._score

    def warmup(self, micro_counts: Sequence[int], row_lens: Sequence[int] | None = None) -> float:
        """Loads the scoring program of each packed micro-batch count (as `Trainer.warmup`); returns seconds."""
        t0 = time.perf_counter()
        for row in row_lens or [self.config.row_len]:
            for m in micro_counts:
                self.score_trajectories(_warmup_trajectories(m, self.config, row))
        return time.perf_counter() - t0

    def score_trajectories(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray | None]:
        """Each trajectory's per-token log-probs (None for one the trainer would leave out)."""
        cfg = self.config
        row_len, micro_rows = row_layout(cfg, [len(t.tokens) for t in trajectories], self.pair_cost)
        packed = pack(trajectories, row_len=row_len, micro_rows=micro_rows, patch_dim=self.patch_dim)
        if not packed.kept:
            return [None] * len(trajectories)
        logp = self._score(packed, self.params, with_values=False)[0]
        out: list[np.ndarray | None] = [None] * len(trajectories)
        for j, i in enumerate(packed.kept):
            m, r, start, n = packed.placements[j]
            out[i] = logp[m, r, start:start + n].copy()
        return out


def _warmup_trajectories(micro: int, config: TrainerConfig, row_len: int | None = None) -> list[Trajectory]:
    """Stand-in trajectories that pack into exactly `micro` micro-batches of rows of `row_len` tokens (default: the
    config's; one full row each, two groups): what `Trainer.warmup` runs the step's programs on."""
    row_len = row_len or config.row_len
    micro_rows = max(1, config.micro_rows * config.row_len // row_len)  # a full micro-batch's (row_layout)
    rows = max(micro_rows, (micro - 1) * micro_rows + 1)  # the fewest rows that need `micro` full micro-batches
    out = []
    for i in range(rows):
        t = Trajectory(task_id=f"warmup-{i}", kind="warmup", group=i % 2, reward=float(i % 2))
        prompt, generated = row_len // 2, row_len - row_len // 2
        t.extend([2 + i] + [1] * (prompt - 1), generated=False)  # no shared prompt: the packed programs
        t.extend([1] * generated, generated=True, logprobs=[0.0] * generated, model_logprobs=[0.0] * generated,
                 versions=[0] * generated)
        out.append(t)
    return out
