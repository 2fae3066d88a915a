"""Roofline cost models: seconds for every piece of work the simulator schedules.

Each function is pure: (model shape, accelerator, work, efficiencies) -> seconds. A device program is
bounded either by compute or by memory traffic (the roofline):

    time = max(flops / (peak * mfu * devices), bytes / (hbm_bandwidth * mbu * devices))

where `devices` chips hold one replica (tensor/data parallel) and split both evenly. Collective
communication inside a replica is not modelled (ours: at the replica sizes a 7B/14B model uses, it
hides behind compute or memory; calibration against real runs is how this is checked, issue 8 §7).

FLOPs (forward, per token): `2 * matmul_params` for the weight matmuls (the input embedding is a
gather, not a matmul: `ModelShape.matmul_params` leaves it out unless tied to the LM head), plus
attention: a query attending to `k` keys costs `4 * num_heads * head_dim * k` per layer (QK^T and
AV, two FLOPs per multiply-add). Backward is twice the forward (the usual 6 * params per trained
token). Bytes: the weights once per device program, plus the KV read and written.

Efficiencies (`Efficiency`: MFU for compute, MBU for memory bandwidth) are **assumptions** until
calibrated from measurements; their defaults are round numbers, not fitted to any result.

Model shapes: Qwen2.5-7B and Qwen2.5-14B from their published config.json files; `shape_from_config`
reads the same fields from a `tiderl_jax.model.config.ModelConfig` (or any object with those
attributes) without importing JAX.
"""

from __future__ import annotations

import dataclasses
import math

from tiderl_jax.rl import batch as rl_batch  # (JAX-free: the trainer's packing rule)
from tiderl_jax.sim.hardware import Accelerator

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int  # SwiGLU MLP: gate, up and down projections
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm scales over head_dim on q and k (Qwen3)
    dtype_bytes: int = 2  # bytes per parameter and per KV element (bf16)

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "dtype_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelShape {self.name!r}: {name}={getattr(self, name)} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape {self.name!r}: num_heads={self.num_heads} must be a multiple "
                             f"of num_kv_heads={self.num_kv_heads}")

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)  # RMSNorm scales
        return attention + 3 * h * self.intermediate_size + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """All parameters: embeddings, layers, final norm, and an untied LM head."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the input embedding gather (a tied
        embedding is the LM head's matmul, so it counts once)."""
        return self.params - (0 if self.tie_word_embeddings else self.embedding_params)

    @property
    def param_bytes(self) -> float:
        return float(self.params * self.dtype_bytes)


# Qwen/Qwen2.5-7B config.json: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV heads,
# head_dim 3584 / 28 = 128, vocab 152064, untied embeddings, q/k/v biases; 7.62B parameters.
QWEN2_5_7B = ModelShape("qwen2.5-7b", num_layers=28, hidden_size=3584, intermediate_size=18944,
                        num_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152064,
                        tie_word_embeddings=False, attention_bias=True)
# Qwen/Qwen2.5-14B config.json: hidden 5120, intermediate 13824, 48 layers, 40 heads, 8 KV heads,
# head_dim 128, vocab 152064, untied embeddings, q/k/v biases; 14.77B parameters.
QWEN2_5_14B = ModelShape("qwen2.5-14b", num_layers=48, hidden_size=5120, intermediate_size=13824,
                         num_heads=40, num_kv_heads=8, head_dim=128, vocab_size=152064,
                         tie_word_embeddings=False, attention_bias=True)
# Qwen/Qwen2.5-32B config.json: hidden 5120, intermediate 27648, 64 layers, 40 heads, 8 KV heads, head_dim 128,
# vocab 152064, untied embeddings, q/k/v biases; 32.8B parameters. The 30B-class replica of the MISA-T study
# (sim/routing_study.py), a dense stand-in for the paper's Qwen3.6-35B-A3B (mixture-of-experts not modelled)
QWEN2_5_32B = ModelShape("qwen2.5-32b", num_layers=64, hidden_size=5120, intermediate_size=27648,
                         num_heads=40, num_kv_heads=8, head_dim=128, vocab_size=152064,
                         tie_word_embeddings=False, attention_bias=True)
SHAPES = {s.name: s for s in (QWEN2_5_7B, QWEN2_5_14B, QWEN2_5_32B)}


def model_shape(name: str | ModelShape) -> ModelShape:
    """The shape called `name` (a `ModelShape` is returned as it is)."""
    if isinstance(name, ModelShape):
        return name
    key = name.strip().lower()
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: choose one of {sorted(SHAPES)} or build a "
                         f"ModelShape (shape_from_config reads a ModelConfig)")
    return SHAPES[key]


def shape_from_config(config, name: str = "config", dtype: str | None = None) -> ModelShape:
    """A `ModelShape` from anything with `ModelConfig`'s fields (num_layers, hidden_size,
    intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size, tie_word_embeddings,
    attention_bias, qk_norm, param_dtype): plain numbers, no JAX. `dtype` overrides `param_dtype`."""
    fields = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size")
    missing = [f for f in fields if not hasattr(config, f)]
    if missing:
        raise ValueError(f"shape_from_config: {name} lacks {missing}")
    dtype = dtype or getattr(config, "param_dtype", "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"shape_from_config: dtype={dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return ModelShape(name, **{f: int(getattr(config, f)) for f in fields},
                      tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                      attention_bias=bool(getattr(config, "attention_bias", False)),
                      qk_norm=bool(getattr(config, "qk_norm", False)),
                      dtype_bytes=DTYPE_BYTES[dtype])


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached (assumptions until calibrated; defaults are round numbers)."""
    prefill_mfu: float = 0.5
    decode_mfu: float = 0.5
    mbu: float = 0.8  # HBM bandwidth utilisation of prefill and decode programs
    train_mfu: float = 0.4
    score_mfu: float = 0.5

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not 0 < getattr(self, f.name) <= 1:
                raise ValueError(f"Efficiency.{f.name}={getattr(self, f.name)} must be in (0, 1]")


def _check(**values):
    for name, v in values.items():
        if v < 0 or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"{name}={v} must be >= 0")


def _devices(devices: int) -> int:
    if devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")
    return devices


def kv_bytes_per_token(shape: ModelShape) -> int:
    """K and V of every layer: `2 * layers * kv_heads * head_dim * dtype_bytes`."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes


def causal_pairs(new_tokens: float, context: float) -> float:
    """(query, key) pairs when `new_tokens` tokens attend causally after `context` cached ones:
    token i (0-based) sees context + i + 1 keys, so `n * c + n * (n + 1) / 2`."""
    _check(new_tokens=new_tokens, context=context)
    return new_tokens * context + new_tokens * (new_tokens + 1) / 2


def attention_flops(shape: ModelShape, pairs: float) -> float:
    """Forward attention FLOPs for `pairs` (query, key) pairs: `4 * layers * heads * head_dim * pairs`."""
    return 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * pairs


def roofline(flops: float, bytes_moved: float, hw: Accelerator, mfu: float, mbu: float, devices: int) -> float:
    d = _devices(devices)
    return max(flops / (hw.peak_bf16_flops * mfu * d), bytes_moved / (hw.hbm_bandwidth * mbu * d))


def prefill_time(shape: ModelShape, hw: Accelerator, tokens: int, context: int = 0, *, devices: int = 1,
                 eff: Efficiency = Efficiency()) -> float:
    """One prefill chunk of `tokens` new tokens after `context` cached ones (a CTB resume prefills only
    the observation, with the task's context cached).

    flops = 2 * matmul_params * tokens + attention_flops(causal_pairs(tokens, context))
    bytes = param_bytes + kv_bytes_per_token * (context + tokens)     (KV read, new KV written)
    time  = max(flops / (peak * prefill_mfu * devices), bytes / (hbm_bw * mbu * devices))
    """
    _check(tokens=tokens, context=context)
    if tokens == 0:
        return 0.0
    flops = 2.0 * shape.matmul_params * tokens + attention_flops(shape, causal_pairs(tokens, context))
    bytes_moved = shape.param_bytes + kv_bytes_per_token(shape) * (context + tokens)
    return roofline(flops, bytes_moved, hw, eff.prefill_mfu, eff.mbu, devices)


def decode_step_time(shape: ModelShape, hw: Accelerator, batch: int, context_tokens: int, *, devices: int = 1,
                     eff: Efficiency = Efficiency()) -> float:
    """One decode step for `batch` sequences holding `context_tokens` tokens of KV in total.

    flops = 2 * matmul_params * batch + attention_flops(context_tokens)   (one query per sequence)
    bytes = param_bytes + kv_bytes_per_token * (context_tokens + batch)   (weights and all KV read)
    time  = max(flops / (peak * decode_mfu * devices), bytes / (hbm_bw * mbu * devices))
    """
    _check(batch=batch, context_tokens=context_tokens)
    if batch == 0:
        return 0.0
    flops = 2.0 * shape.matmul_params * batch + attention_flops(shape, context_tokens)
    bytes_moved = shape.param_bytes + kv_bytes_per_token(shape) * (context_tokens + batch)
    return roofline(flops, bytes_moved, hw, eff.decode_mfu, eff.mbu, devices)


def kv_capacity_pages(shape: ModelShape, hw: Accelerator, page_size: int, *, devices: int = 1,
                      memory_fraction: float = 0.9, reserve_bytes: float = 0.0) -> int:
    """KV pages one replica holds: `floor((hbm_bytes * devices * memory_fraction - param_bytes
    - reserve_bytes) / (page_size * kv_bytes_per_token))`. `memory_fraction` (ours, after vLLM's
    gpu_memory_utilization default) leaves room for the runtime; `reserve_bytes` for activations."""
    d = _devices(devices)
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
    _check(reserve_bytes=reserve_bytes)
    free = hw.hbm_bytes * d * memory_fraction - shape.param_bytes - reserve_bytes
    if free <= 0:
        raise ValueError(f"{shape.name} ({shape.param_bytes / 1e9:.1f} GB of weights) does not fit "
                         f"{d} x {hw.name} at memory_fraction={memory_fraction}: use more devices")
    return int(free // (page_size * kv_bytes_per_token(shape)))


def _sequence_pairs(tokens: float, seq_len: float | None) -> float:
    """Causal pairs of `tokens` tokens cut into sequences of `seq_len`: `tokens * (seq_len + 1) / 2`."""
    if seq_len is None:
        return 0.0
    _check(seq_len=seq_len)
    return tokens * (seq_len + 1) / 2


def train_step_time(shape: ModelShape, hw: Accelerator, tokens: int, *, devices: int, seq_len: float | None = None,
                    eff: Efficiency = Efficiency()) -> float:
    """Forward + backward over `tokens` tokens on `devices` chips (sequences of mean length `seq_len`;
    None leaves attention out):

    flops = 6 * matmul_params * tokens + 3 * attention_flops(tokens * (seq_len + 1) / 2)
    time  = flops / (peak * train_mfu * devices)
    """
    _check(tokens=tokens)
    flops = 6.0 * shape.matmul_params * tokens + 3 * attention_flops(shape, _sequence_pairs(tokens, seq_len))
    return flops / (hw.peak_bf16_flops * eff.train_mfu * _devices(devices))


def score_time(shape: ModelShape, hw: Accelerator, tokens: int, *, devices: int, seq_len: float | None = None,
               eff: Efficiency = Efficiency()) -> float:
    """Forward only (reference or old-policy log-probs): a third of `train_step_time`'s FLOPs at
    `score_mfu`: `(2 * matmul_params * tokens + attention_flops(pairs)) / (peak * score_mfu * devices)`."""
    _check(tokens=tokens)
    flops = 2.0 * shape.matmul_params * tokens + attention_flops(shape, _sequence_pairs(tokens, seq_len))
    return flops / (hw.peak_bf16_flops * eff.score_mfu * _devices(devices))


def transfer_time(bytes_moved: float, bandwidth: float, *, streams: int = 1, latency_s: float = 0.0) -> float:
    """`latency_s + bytes / (bandwidth * streams)`: `streams` chips each move their shard in parallel."""
    _check(bytes_moved=bytes_moved, latency_s=latency_s)
    if not bandwidth > 0:
        raise ValueError(f"bandwidth={bandwidth} must be > 0")
    if streams < 1:
        raise ValueError(f"streams={streams} must be >= 1")
    return latency_s + bytes_moved / (bandwidth * streams)


def weight_sync_time(shape: ModelShape, hw: Accelerator, *, receiver_devices: int, span_devices: int,
                     latency_s: float = 0.0) -> float:
    """Publishing new weights to one rollout replica: each of its `receiver_devices` chips receives its
    shard of the parameters at the per-chip link bandwidth of a transfer spanning `span_devices` chips
    (NVLink/ICI inside one domain, the inter-node network beyond):

    time = latency_s + param_bytes / (link_bandwidth(span_devices) * receiver_devices)

    Replicas receive in parallel (each over its own links), so this is also the sync time of the
    whole rollout pool. `latency_s` is the fixed part (measured: drain, publish, barrier).
    """
    return transfer_time(shape.param_bytes, hw.link_bandwidth(span_devices), streams=_devices(receiver_devices),
                         latency_s=latency_s)


def switch_time(state_bytes: float, hw: Accelerator, *, devices: int, span_devices: int, fixed_s: float) -> float:
    """A device move between roles (ERS move, BiDiRL hot switch): `fixed_s` (measured: runtime
    switch, recompile or warm program swap; BiDiRL reports a few seconds) plus the role's state
    (`state_bytes`: bf16 weights for rollout; weights + optimizer state for training) arriving on
    `devices` chips in parallel: `fixed_s + state_bytes / (link_bandwidth(span_devices) * devices)`."""
    return transfer_time(state_bytes, hw.link_bandwidth(span_devices), streams=_devices(devices), latency_s=fixed_s)


def packed_micro_batches(lengths, row_len: int, micro_rows: int) -> int:
    """Micro-batches the trainer computes for sequences of these lengths (`rl.batch.pack`: first-fit
    decreasing into rows of `row_len` tokens, `micro_rows` rows per micro-batch, their count rounded up
    to a power of two; sequences longer than a row are dropped)."""
    rows = rl_batch.first_fit_rows([n for n in lengths if n <= row_len], row_len)
    return rl_batch.num_micro_batches(len(rows), micro_rows)


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
    """Per-operation seconds measured on a real machine, used by `SimBackend` instead of the roofline
    (`SimConfig.measured`; `benchmarks/sim_validation.py` measures them on this CPU). A host whose
    fake devices share its cores does not get faster with more devices, so nothing here scales with
    device counts: each time is the one measured on the layout being simulated. Work is linear in
    its size (a fixed part plus a part per token or per sequence):

        decode step   = decode_step_s + decode_per_seq_s * B            (B running sequences)
                        + decode_per_kv_token_s * their context tokens   (attention reads their KV)
        prefill       = prefill_fixed_s + prefill_per_token_s * new tokens   (per event that prefills)
                        + prefill_per_pair_s * attention pairs            (sum of new * cached + new * (new + 1) / 2)
        proximal pass = score_fixed_s + score_per_token_s * tokens       (train devices; the colocated
                        + score_per_micro_s * micro-batches               reference pass costs the same)
        ref pass      = ref_fixed_s + ref_per_token_s * tokens           (ref devices, RA2P decoupled)
                        + ref_per_micro_s * micro-batches
        update        = update_fixed_s + update_per_token_s * tokens + update_per_micro_s * micro-batches
        weight sync   = sync_s;  device move = switch_s
        engine call   + call_overhead_s                                  (per replica event: the rollout
                        loop's host time per engine call beyond the call measured alone)
                      + program_s per shape bucket the engine runs for the first time
        train / ref   + score_program_s, update_program_s (ref_program_s on the ref devices) the first
                        time this trainer (scorer) meets a micro-batch count

    Shared cores: rollout and training that overlap slow each other down. A replica event that starts
    while a train or ref job runs takes `rollout_overlap_x` times longer; a train or ref job that
    starts while any replica is busy takes `train_overlap_x` times longer (first order: the state at
    the start of the work decides, not the share of its duration that overlaps).
    """
    decode_step_s: float
    decode_per_seq_s: float
    prefill_fixed_s: float
    prefill_per_token_s: float
    score_fixed_s: float
    score_per_token_s: float
    update_fixed_s: float
    update_per_token_s: float
    ref_fixed_s: float = 0.0
    ref_per_token_s: float = 0.0
    sync_s: float = 0.0
    switch_s: float = 0.0
    rollout_overlap_x: float = 1.0
    train_overlap_x: float = 1.0
    call_overhead_s: float = 0.0
    decode_per_kv_token_s: float = 0.0
    prefill_per_pair_s: float = 0.0
    # per packed micro-batch (`packed_micro_batches`; SimConfig.train_row_len): the trainer computes whole
    # padded micro-batches, so its time follows their count, not the tokens in them
    score_per_micro_s: float = 0.0
    update_per_micro_s: float = 0.0
    ref_per_micro_s: float = 0.0
    program_s: float = 0.0  # an engine's first call of a shape bucket (SimConfig.max_seq_len): load or compile
    # the trainer's and the reference scorer's first call of a program shape (micro-batch count): each jits
    # its own programs (`Trainer._program`, keyed on the packed batch's shapes), so a new count of packed
    # micro-batches, or a new trainer (each run), loads (or compiles) them again: the proximal / colocated ref
    # score program, the update program, the scorer's program on the ref devices (SimConfig.train_row_len)
    score_program_s: float = 0.0
    update_program_s: float = 0.0
    ref_program_s: float = 0.0
    source: str = ""  # what was measured, where

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name != "source":
                _check(**{f"MeasuredCosts.{f.name}": getattr(self, f.name)})
        if self.rollout_overlap_x < 1 or self.train_overlap_x < 1:
            raise ValueError(f"MeasuredCosts: overlap factors ({self.rollout_overlap_x}, {self.train_overlap_x}) "
                             f"must be >= 1 (sharing cores never speeds work up)")
