"""The simulator's configuration, `SimConfig` (every parameter a documented default), and its trajectories,
`SimTrajectory` (counts without per-token lists). Both are re-exported by `sim/backend.py`; each part of the
backend describes what its parameters model (backend.py lists the parts)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.policies import routing
from tiderl_jax.sim import costs, hardware, workloads


# Acceptance of the engine's speculative decoding on agentic rollouts, as `benchmarks/speculative.py --record` measured
# it (the file names the run): the simulator's WAR mode uses it instead of an assumption.
MEASURED_SPECULATION = json.loads((pathlib.Path(__file__).parent / "measured_speculation.json").read_text())


@dataclasses.dataclass(frozen=True)
class SimConfig:
    workload: str | workloads.Workload = "tiderl-text-7b"  # a workloads.PRESETS name (or a Workload)
    accelerator: str = ""  # a hardware preset; "" = the workload's
    tp: int = 1  # devices per rollout replica (tensor parallel); 0: one replica on all rollout devices
    # per-operation times measured on a machine instead of the roofline (0 devices scaling; see
    # costs.MeasuredCosts); tp=0 needs them (the roofline needs a fixed replica size)
    measured: costs.MeasuredCosts | None = None
    efficiency: costs.Efficiency = costs.Efficiency()
    page_size: int = 16  # tokens per KV page (the engine's default page)
    memory_fraction: float = 0.9  # of HBM for weights + KV (vLLM's gpu_memory_utilization default)
    kv_pages: int = 0  # KV pages per replica; 0: costs.kv_capacity_pages
    max_batch: int = 256  # sequences a replica runs at once (vLLM's max_num_seqs default)
    decode_chunk: int = 32  # decode steps per event at most (multi-step decode)
    initial_growth: int = 256  # CTB footprint growth guess before a task's first turn (ours)
    readiness_aware: bool = False  # CTB eviction order (policies.ctb.choose_evictions)
    finished_window: int = 256  # finished tasks CTB's expected-remaining-turns estimate reads (ours)
    sync_fixed_s: float = 0.5  # weight sync fixed part: drain, publish, barrier (ours)
    switch_fixed_s: float = 3.0  # device move fixed part (BiDiRL reports a few seconds)
    optimizer_bytes_per_param: float = 8.0  # Adam m and v in fp32: train state beyond the bf16 weights
    # StreamRL-like baseline (launch/simulate.py's `streamrl`): the reference model and the actor share the
    # train devices without both staying resident, so the colocated ref pass of every micro-batch (a GRPO
    # group, the controller's unit) swaps the ref's bf16 weights in and the actor's back over the host link
    # (`host_bandwidth` per device, one direction; both directions at once): 2 x weights / devices / bandwidth
    ref_swap: bool = False
    host_bandwidth: float = 55e9  # PCIe 5 x16: 64 GB/s peak one way, ~55 in practice (ours)
    seed: int = 0  # task shapes: rng seeded by (seed, group)
    # WAR speculative decoding (policies.war.use_speculation per event; roofline costs only): a
    # model-free drafter proposes `spec_draft_tokens`, one verify step scores them all, and emits
    # `spec_accepted_tokens` per sequence on average (accepted drafts + 1). Both measured: the engine's
    # own drafter on agentic rollouts sampled at temperature 1, `rollout.temperature`'s default
    # (`benchmarks/speculative.py --temperature 1 --record` writes measured_speculation.json, with its command,
    # date and temperature);
    # WAR's record gives the rule and the batch bound (war.SPEC_MAX_BATCH), not the acceptance.
    war_speculation: bool = False
    spec_draft_tokens: int = MEASURED_SPECULATION["draft_tokens"]
    spec_accepted_tokens: float = MEASURED_SPECULATION["accepted_tokens"]
    # the real engine's step rule (`engine.Engine.step`; measured costs only): an event that prefills,
    # or leaves a turn waiting in the queue, decodes 1 step; any other decodes `decode_chunk` steps
    # whatever the running turns have left (ended rows ride along); the turns an event ends reach the
    # rollout loop when the event ends (the engine's call returns), not at their own step
    engine_steps: bool = False
    # with `engine_steps`, the engine's prefix cache for first turns: blocks are shared once computed, so a
    # GRPO group's prompt hits only for samples admitted in a later event than the group's first (the
    # samples admitted together all compute it), and a prompt's first `shared_prefix_tokens` (a system
    # prompt every task shares: its full pages) hit once any prompt was prefilled under this version
    shared_prefix_tokens: int = 0
    # with `engine_steps`: the engine's longest prefill chunk (EngineConfig.prefill_chunk; 0: one prefill call per
    # event): an event makes one prefill call per chunk-length bucket among the sequences it admits (powers of
    # two from 16 up to this, as `Engine._run_prefill`), each paying `MeasuredCosts.prefill_fixed_s`
    prefill_chunk: int = 0
    # with `engine_steps` and `prefill_chunk`: the engine's prefill tokens per call (EngineConfig.prefill_budget; 0:
    # no limit). As `Engine._plan_prefill`, an event prefills at most `prefill_chunk` tokens of each sequence and
    # this many in all, for at most 16 sequences (EngineConfig.max_prefill_rows); a sequence with more left goes on
    # prefilling in the next events, and decodes from the event that prefills its last chunk
    prefill_budget: int = 0
    # with `engine_steps` and `MeasuredCosts.program_s`: the engine's longest sequence (EngineConfig.max_seq_len),
    # for its shape buckets. Every engine jits its programs itself, one per shape bucket (decode: rows x pages
    # per row; prefill: rows x chunk length x pages), so a replica's first event that needs a bucket it has not
    # run pays `program_s` (a fresh backend is a fresh engine, as each mode of goodput.py builds its own)
    max_seq_len: int = 0
    # measured costs: the trainer's rows and rows per micro-batch (TrainerConfig.row_len, micro_rows), for the
    # micro-batch terms of MeasuredCosts (`costs.packed_micro_batches`); 0: none
    train_row_len: int = 0
    train_micro_rows: int = 0
    # placement of tasks on the rollout replicas: "sticky" (a task stays on its replica, a new one goes to the
    # fewest live tasks: replicas.py), or one of `policies.routing.POLICIES` by name, which then places every new
    # task and every continuation after a tool gap (sim/router.py) with `router_config`
    router: str = "sticky"
    router_config: routing.RouterConfig = routing.RouterConfig()

    def __post_init__(self):
        workloads.workload(self.workload)
        if self.accelerator:
            hardware.accelerator(self.accelerator)
        if self.tp < 0 or (self.tp == 0 and self.measured is None):
            raise ValueError(f"SimConfig.tp={self.tp} must be >= 1 (0: one replica on all rollout devices, "
                             f"with measured costs)")
        if not self.host_bandwidth > 0:
            raise ValueError(f"SimConfig.host_bandwidth={self.host_bandwidth} must be > 0")
        for name in ("page_size", "max_batch", "decode_chunk", "finished_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("kv_pages", "initial_growth", "shared_prefix_tokens", "prefill_chunk", "prefill_budget",
                     "max_seq_len",
                     "train_row_len", "train_micro_rows", "sync_fixed_s", "switch_fixed_s",
                     "optimizer_bytes_per_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 0")
        if self.router != "sticky" and self.router not in routing.POLICIES:
            raise ValueError(f"SimConfig.router={self.router!r}: 'sticky' or one of {sorted(routing.POLICIES)}")
        if self.engine_steps and self.measured is None:
            raise ValueError("SimConfig.engine_steps models the real engine's calls: it needs measured costs")
        if self.spec_draft_tokens < 1 or not 1.0 <= self.spec_accepted_tokens <= self.spec_draft_tokens + 1:
            raise ValueError(f"SimConfig: spec_draft_tokens={self.spec_draft_tokens} must be >= 1 and "
                             f"spec_accepted_tokens={self.spec_accepted_tokens} in [1, spec_draft_tokens + 1]")


@dataclasses.dataclass
class SimTrajectory(Trajectory):
    """A trajectory's counts without per-token lists: what the controller and metrics read."""
    model_tokens: int = 0
    context_tokens: int = 0
    version_tokens: dict = dataclasses.field(default_factory=dict)  # policy version -> model tokens

    @property
    def num_generated(self) -> int:
        return self.model_tokens

    def oldest_version(self) -> int:
        return min(self.version_tokens, default=-1)

    def model_version_counts(self) -> dict[int, int]:
        return dict(self.version_tokens)
