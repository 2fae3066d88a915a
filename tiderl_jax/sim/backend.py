"""`SimBackend`: the controller's `Backend` on cost-modelled devices and a virtual clock.

The real controller (`runtime/controller.py`: staleness capacity, ready buffer, RA2P, ERS) drives
this backend exactly as it drives `JaxBackend`; only the devices are simulated. Every piece of work
takes the seconds `sim/costs.py` gives it on the virtual-time loop (`sim/clock.py`), so a
1024-accelerator run costs only the Python of its events.

**The event core.** Train, reference scoring, weight sync and moves are `asyncio.sleep`s of their
cost. The rollout side runs on one heap of timed entries inside the backend (this module compiled by
Cython with the types in backend.pxd, when built; run as it is, it is the reference): one
loop timer fires the earliest, and the driver (`_drive`) keeps popping entries and advancing the
virtual clock itself as long as nothing else on the loop could happen first
(`VirtualTimeLoop.quiet_until`: no ready callback, no earlier timer). A replica has one entry, at its
next *boundary* where its batch can change (`_wake`): between two, its decode events (chunks) are
timed in one loop (`_walk`, a *span*), event after event with the same sums as one heap entry per
event (tests/test_sim_backend.py checks a run against that). A span ends with the event in which a
turn ends, or the first that ends after something arrives (an environment return, kept on the
replica's own `arrivals` heap, or a new task); a new version, CTB's refreshed estimate, or an
admission that evicted without succeeding end it at the next boundary (`_cut`), because the old
core tried admission at every event. The only asyncio object per GRPO group is the future
`generate_group` awaits (every sample's whole multi-turn trajectory runs in the heap); when the
group's last sample ends its future wakes the controller and the driver yields back to the loop at
that virtual instant. Same-instant order: heap
entries in the order they were pushed; an idle replica that gets work starts once the driver reaches
that instant (all enqueues of the instant made before then join its first event). `run` makes
Python's cyclic garbage collector rare while it runs (`rare_collections`).

What is modelled (all parameters in `SimConfig`, each a documented default):

- **Device pool**: a `runtime.devices.DevicePool` over integer device ids (None in sync mode: every
  device generates and trains, the staleness bound 0 makes them take turns). Moves use
  `DevicePool.moved`, as the real backend does.
- **Rollout**: `tp`-device replicas on the rollout devices, each a continuous-batching server (its
  events on the heap). Per event: prefill of the sequences admitted (new, resumed) since the last event, then
  K decode steps of every running sequence, K = min(`decode_chunk`, most tokens any of them still
  has to write this turn) (the engine's multi-step decode: a sequence that ends early rides along
  to the end of the chunk but its turn ends at its own step):

      prefill = roofline(2 * matmul_params * sum(n_i) + attention_flops(sum causal_pairs(n_i, c_i)),
                         param_bytes + kv_bytes_per_token * sum(c_i + n_i))      (n new, c cached)
      decode  = K * decode_step_time(B, sum(context_i) + B * (K - 1) / 2)        (B running)
      event   = prefill + decode                         (then every sequence advances K tokens)

  the batched prefill is `costs.prefill_time` summed over sequences with the weights read once.
  KV capacity in pages (`costs.kv_capacity_pages`, or `kv_pages`); a turn is admitted only when the
  pages of its context plus the tokens it will write fit (ours: the simulator knows the turn's
  length, so nothing is preempted mid-turn), evicting cached KV (LRU) first; at most `max_batch`
  sequences run at once.
- **KV modes** (as the real rollout): `ctb` (mode tiderl): a task is admitted while its footprint
  estimate fits the replica's budget (`policies.ctb.estimate_footprint` with the margin of
  `expected_remaining_turns`, `admit_tasks`: first come, first served); its KV stays pinned across
  tool calls, so a resume prefills only the observation; when a turn does not fit, waiting tasks'
  KV is evicted (`ctb.choose_evictions`) into the prefix cache. `request` (sync / async): after each
  turn the sequence's KV becomes evictable prefix cache (LRU, full pages); the next turn prefills
  the whole context minus what is still cached. The engine keys prefix blocks by policy version and
  chains each block's key to its parent's, and a lookup walks from the first block: an entry hits only
  under the version its chain began in, the version of the sequence's last prefill from its first block
  (`_Seq.kv_version`; a turn that runs across a weight update keeps its KV but its next lookup misses);
  pinned KV survives weight updates (`EngineConfig.on_update="continue"`). A GRPO group's prompt hits
  when another sample of the group already holds it on the same replica (under the current version:
  a sample prefilled again writes it anew), as does the shared system prefix. KV hit rate = cached
  prompt tokens / prompt tokens over every prefill admission (the engine's counter).
- **Placement**: a task stays on its replica (sticky); a new task goes to the replica with the fewest
  live tasks (ties: lowest id). A replica removed by a move loses its KV; its tasks continue on
  others (their next prefill recomputes the whole context).
- **Environment**: the workload's per-call latency between turns. Task shapes follow
  `workloads.sample_task`'s rule, a GRPO group's samples drawn together (`sample_tasks`) from an rng
  seeded by (`seed`, group), so runs are reproducible.
- **Train** (`train_step_time`), **proximal and reference scoring** (`score_time`) over all context
  tokens of the batch, mean sequence length for attention; ref scored on the train devices unless
  the trajectories carry scores from the ref devices (RA2P decoupled). Ref jobs run one at a time.
- **Weight sync** (`weight_sync_time` + `sync_fixed_s`): replicas swap in the new version after it;
  decode events already in flight finish on the old weights (token versions recorded per event).
- **Moves** (`switch_time`: `switch_fixed_s` plus the role's state: bf16 weights for rollout, plus
  `optimizer_bytes_per_param` for train, arriving on the moved group's devices).
- **BiDiRL borrowing** (`lend` / `take_back`, the controller's `bidirl` option): a hot switch of idle
  devices for part of a step (`switch_costs`, ours after BiDiRL's divisible layouts, where both roles'
  programs are resident on every pool):
  - the rollout borrows train devices while the trainer waits for data: switch-in offloads the
    trainer's optimizer state from them (`switch_time` of those bytes), then `tp`-device replicas
    serve on them and take over queued work that has no KV yet from the most loaded replicas
    (`_rebalance`); giving them back drops what they run (their tasks continue elsewhere without
    KV) and reloads the optimizer state;
  - the trainer borrows rollout replicas that have no task while admission is blocked: switch-in
    loads weights and optimizer state onto them, the train step runs on the extra devices and pays
    a gradient all-reduce across them (`merge_s`: 2 x bf16 gradients over the link), switch-out
    brings the weights back; the replicas return empty.
  Busy device-seconds go to the lane that owns the devices (borrowed replicas' events to the train
  lane, a borrowed train step to the rollout lane).
- **WAR speculative decoding** (`war_speculation`, modes `+war` of launch/simulate.py; roofline
  costs): per event, a verify step of `spec_draft_tokens` + 1 tokens per sequence (its roofline over
  the same context) emitting `spec_accepted_tokens` replaces the decode step when
  `war.use_speculation` says it pays (batch <= 16 and less time per emitted token). The drafter's own
  time is taken as nil (WAR's is model-free: suffix trees on the host).

**Measured costs** (`SimConfig.measured`, `costs.MeasuredCosts`; benchmarks/sim_validation.py): per-op
times measured on a host replace the roofline (no scaling with device counts: fake devices that share
a host's cores do not add speed), `tp=0` runs one replica on all rollout devices (one engine, as the
real backend), and train / ref jobs share the cores with the rollout by processor sharing
(`_host_work`: each side advances at 1 / its measured overlap factor while the other works; in-flight
replica events are re-timed when the first job starts and the last one ends). With them, the real engine's
own rules replace the roofline replica's where they differ (`engine_steps`, each an `Engine` behaviour):
an event is one engine call, which decodes 1 step when it prefills or leaves a turn waiting and a whole
`decode_chunk` otherwise (ended rows ride along), and hands its ended turns to the rollout loop when it
returns; it prefills at most `prefill_chunk` tokens of a sequence and `prefill_budget` in all (a longer prefill goes
on in the next calls, the sequence decoding from the call of its last chunk), in one call per chunk-length bucket
(`prefill_chunk`); a first turn's prompt hits
the prefix cache only for blocks computed by an earlier call (a GRPO group's samples admitted together
all compute it; `shared_prefix_tokens`: the system prompt every task shares); every call pays the rollout
loop's measured host time (`MeasuredCosts.call_overhead_s`), and a call whose shape bucket the process
has not run yet loads its program (`MeasuredCosts.program_s`, `max_seq_len`; `programs`: what the
simulated process has run, shared by the backends of one process). The trainer and the ref scorer load
their programs (`score_program_s`, `update_program_s`, `ref_program_s`) at their first batch of each
packed micro-batch count, per backend (each real run builds its own) and again after a move of their
devices; `compile_s` counts those calls as the real backend does, and with them simulated it is ERS's
move-cost estimate before any move (as for the real controller, whose backend gives none).

Busy time (MECHANISMS.md §9 waiting): with `attach(metrics)`, each replica event adds
`seconds * tp` busy device-seconds to the rollout lane (replicas idle while others work count as
waiting), wall busy seconds add `seconds * tp / rollout devices` (the mean replica's busy time, what
ERS scales with device count), and the timeline gets one span while any replica is busy. In sync
mode (shared lanes) the rollout lane is busy while any replica is (the metric's span definition),
and the device-seconds of replicas idle inside that span (a batch's tail) go to
`RunMetrics.idle_in_spans`, rollout waiting: each device is counted once either way.

Ours, not the papers': the admission-by-known-turn-length, least-loaded placement, the group-prompt
sharing rule, the sliding window of finished tasks for CTB's remaining-turns estimate (the last
`finished_window` tasks, refreshed every `finished_window` finishes, to keep the cost per turn
constant), and every default below that does not cite a source.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import gc
import heapq
from typing import Any, Sequence

import numpy as np

from tiderl_jax.agents.trajectory import Trajectory
from tiderl_jax.engine.buckets import half_pow2_buckets, pow2_buckets
from tiderl_jax.policies import ctb, war
from tiderl_jax.runtime.pool import DevicePool, lanes_of, split_devices
from tiderl_jax.sim import clock as clock_lib
from tiderl_jax.sim import costs, hardware, workloads


_INF = float("inf")
_NO_LIMIT = 1 << 62
SHAPE_BLOCK = 64  # groups whose task shapes are drawn together (`SimBackend._shape`)


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
    seed: int = 0  # task shapes: rng seeded by (seed, group)
    # WAR speculative decoding (policies.war.use_speculation per event; roofline costs only): a
    # model-free drafter proposes `spec_draft_tokens`, one verify step scores them all, and emits
    # `spec_accepted_tokens` per sequence on average (accepted drafts + 1). Both ours: WAR's record
    # gives the rule and the batch bound (war.SPEC_MAX_BATCH), not the acceptance.
    war_speculation: bool = False
    spec_draft_tokens: int = 4
    spec_accepted_tokens: float = 2.0
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

    def __post_init__(self):
        workloads.workload(self.workload)
        if self.accelerator:
            hardware.accelerator(self.accelerator)
        if self.tp < 0 or (self.tp == 0 and self.measured is None):
            raise ValueError(f"SimConfig.tp={self.tp} must be >= 1 (0: one replica on all rollout devices, "
                             f"with measured costs)")
        for name in ("page_size", "max_batch", "decode_chunk", "finished_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("kv_pages", "initial_growth", "shared_prefix_tokens", "prefill_chunk", "prefill_budget",
                     "max_seq_len",
                     "train_row_len", "train_micro_rows", "sync_fixed_s", "switch_fixed_s",
                     "optimizer_bytes_per_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 0")
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


class _Waiter:
    """What `generate_group` awaits: its future resolves when `left` reaches 0 (`_finish`)."""
    __slots__ = ("future", "left")

    def __init__(self, future: asyncio.Future, left: int):
        self.future, self.left = future, left


class _Seq:
    """One task (a GRPO sample) on the rollout side."""
    __slots__ = ("gid", "sample", "shape", "gen", "obs", "latency", "prompt", "turn", "left", "ctx", "written",
                 "versions", "replica", "future", "pinned", "kv_pages", "kv_version", "footprint", "tokens_added",
                 "wait_started", "new_tokens", "admitted", "start", "end", "ctx0", "run", "pf_left", "pf_done")

    def __init__(self, gid: int, sample: int, shape: workloads.TaskSample, future: _Waiter | None):
        self.gid, self.sample, self.shape, self.future = gid, sample, shape, future
        # the shape's fields the event core reads at every turn
        self.gen, self.obs, self.latency, self.prompt = (shape.gen_tokens, shape.obs_tokens, shape.env_latency_s,
                                                         shape.prompt_tokens)
        self.turn = 0
        self.left = shape.gen_tokens[0]  # tokens still to write this turn
        self.ctx = shape.prompt_tokens  # tokens of context (prompt + written + observations)
        self.written = 0
        self.versions: dict[int, int] = {}
        self.replica: _Replica | None = None
        self.pinned = False  # CTB: KV held while the environment runs
        self.kv_pages = 0  # pages it holds (running reservation or pinned)
        self.kv_version = 0  # the version its KV's prefix-cache chain is keyed by (its last prefill from block 0)
        self.footprint = 0  # CTB admission estimate (tokens), 0 before admission
        self.tokens_added = 0
        self.wait_started = 0.0
        self.new_tokens = 0  # prefill work of its next event
        self.admitted = False  # CTB task admission done
        # while running (lazy: `left`, `ctx`, `written`, `versions` are brought up to date when the
        # turn ends or the replica goes away): the replica's decode-step count when it started this
        # turn, that count when the turn ends, its context then, and its admission number (-1: not running)
        self.start = self.end = self.ctx0 = 0
        self.run = -1
        # while prefilling over several events (SimConfig.prefill_budget): tokens still to prefill, and its
        # context's tokens computed (cached or prefilled) so far
        self.pf_left = self.pf_done = 0


class _Replica:
    """A continuous-batching server on `tp` devices (state; `SimBackend._wake` runs it on the
    backend's event heap).

    Running sequences are kept lazily, so an event costs O(log B) plus the turns it ends, not O(B):
    every running sequence advances by the event's K tokens, so the replica counts decode `steps` and
    a sequence's turn ends at step `start + left`; `ends` (min-heap) yields the turns an event ends,
    `maxend` the step the longest turn ends at, for K (turns end in step order, so it only grows while any
    sequence runs: the one that ends last is the last to leave), and the context sum
    is `ctx_base + len(running) * steps`. `vlog` lists (step, version) where the weights changed, so
    a turn's tokens per version are counted when it ends.

    Events run in spans (`SimBackend._walk`): a span is the run of decode chunks (events) between two
    boundaries where the replica's batch can change; only its last boundary is on the event heap
    (`wake_at`). Environment returns wait in `arrivals` (a per-replica heap) and join the queue at the
    first chunk boundary after they arrive, as if queued at once."""

    __slots__ = ("rid", "devices", "capacity", "version", "pending", "queue", "running", "steps", "ends",
                 "maxend", "ctx_base", "vlog", "used", "cache", "cache_pages", "pinned", "footprints", "live",
                 "prompts", "alive", "borrowed", "busy", "retry", "arrivals", "wake_at", "span_start", "span_prefill",
                 "span_steps", "span_batch", "span_ctx_base", "span_maxend", "span_first_end", "w_step", "w_start",
                 "w_prefill", "w_first", "w_step_s", "w_prev", "w_chunks", "w_dur", "one_step", "events", "prefix_at",
                 "programs", "prefilling")

    def __init__(self, rid: int, devices: tuple, capacity: int):
        self.rid, self.devices, self.capacity = rid, devices, capacity  # capacity in pages
        self.version = 0
        self.pending: collections.deque[_Seq] = collections.deque()  # CTB: new tasks awaiting task admission
        self.queue: collections.deque[_Seq] = collections.deque()  # the engine's queue: turns to start, FIFO
        self.running: dict[_Seq, None] = {}  # insertion order = admission order
        # admitted turns whose prefill goes on in the next events (SimConfig.prefill_budget), in admission order
        self.prefilling: collections.deque[_Seq] = collections.deque()
        self.steps = 0  # decode steps done
        self.ends: list = []  # (step its turn ends at, admission number, seq)
        self.maxend = 0  # the latest step a running sequence's turn ends at
        self.ctx_base = 0  # sum over running of (context at admission - step at admission)
        self.vlog: list[tuple[int, int]] = [(0, 0)]  # (decode step, version from that step on)
        self.used = 0  # pages held by running (reserved to the turn's end) and pinned sequences
        self.cache: collections.OrderedDict = collections.OrderedDict()  # seq -> (pages, tokens, version)
        self.cache_pages = 0
        self.pinned: dict[_Seq, None] = {}  # CTB: waiting tasks holding KV (insertion order)
        self.footprints = 0  # CTB: admitted tasks' footprint estimates (tokens)
        self.live = 0  # tasks placed here and not finished
        self.prompts: dict[int, list] = {}  # gid -> [version written, samples here holding it, event]
        self.events = 0  # events that admitted (SimConfig.engine_steps: what a block computed by then is)
        self.prefix_at = (-1, 0)  # (version, event) of the first prompt prefilled under that version
        self.programs: set = set()  # shape buckets this replica's engine has run (SimConfig.max_seq_len)
        self.alive = True
        self.borrowed = False  # BiDiRL: serving on borrowed train devices
        self.busy = False  # a span of events in flight
        self.retry = False  # an admission that failed changed the KV: the next event boundary tries again
        self.arrivals: list = []  # (time, order, seq): environment returns and placements not yet queued
        self.wake_at = _INF  # when its next heap entry runs (`_wake`); entries at other times are stale
        # the span in flight: its start, prefill seconds, first step, batch, ctx_base, longest end, first turn end
        self.span_start = self.span_prefill = 0.0
        self.span_steps = self.span_batch = self.span_ctx_base = self.span_maxend = self.span_first_end = 0
        # its last event (the one `wake_at` ends): the decode step count then; that event's start, prefill
        # seconds, first step and decode step seconds; its start time, events and busy seconds so far
        self.w_step = 0
        self.w_start = self.w_prefill = self.w_step_s = 0.0
        self.w_first = 0
        self.w_prev = 0.0
        self.w_chunks = 0
        self.w_dur = 0.0
        self.one_step = False  # SimConfig.engine_steps: the span's event prefilled or left a turn waiting


class SimBackend:
    """Cost-modelled devices behind the controller's `Backend` interface (see the module docstring)."""

    def __init__(self, config: SimConfig, *, mode: str, pool: DevicePool | None, num_devices: int,
                 loop: clock_lib.VirtualTimeLoop | None = None):
        self.cfg = config
        self.mode = mode
        self.pool = pool
        self.num_devices = num_devices
        self.loop = loop or clock_lib.new_event_loop()
        self.workload = workloads.workload(config.workload)
        self.shape = costs.model_shape(self.workload.model)
        self.hw = hardware.accelerator(config.accelerator or self.workload.accelerator)
        self.eff = config.efficiency
        self.kv_mode = "ctb" if mode == "tiderl" else "request"
        self.ps = config.page_size
        if config.tp and pool is not None and pool.group_size % config.tp:
            raise ValueError(f"SimConfig.tp={config.tp} must divide the device group size {pool.group_size}")
        if config.tp and pool is None and num_devices % config.tp:
            raise ValueError(f"SimConfig.tp={config.tp} must divide the {num_devices} devices")
        if not config.kv_pages and not config.tp:
            raise ValueError("SimConfig.tp=0 needs kv_pages (the replica size changes with moves)")
        self.capacity = config.kv_pages or costs.kv_capacity_pages(
            self.shape, self.hw, self.ps, devices=config.tp, memory_fraction=config.memory_fraction)
        self.measured = config.measured
        self._host_jobs = 0  # train / ref jobs in flight (measured costs: cores shared with the rollout)
        self._flip: asyncio.Future | None = None  # resolved when the rollout goes busy or idle (_host_work)
        # task shapes of a group: (group, rng, n) -> n TaskSamples; None: `sample_tasks` of the workload
        # (benchmarks/sim_validation.py replays the tasks' demonstrations)
        self.shape_sampler = None
        # SimConfig.max_seq_len: the shape buckets already run in this process, as (replica devices, bucket);
        # None: each replica's own (`_Replica.programs`). JAX keeps compiled programs per process, so an
        # engine built later on the same devices (the next mode of goodput.py) finds them in memory
        self.programs: set | None = None
        self._replica_devices = config.tp  # tp=0: all rollout devices (set by _rebuild)
        self._kv_bytes = costs.kv_bytes_per_token(self.shape)
        # costs.decode_step_time's terms, computed once (it is called at every replica event)
        self._param_bytes, self._matmul_params = self.shape.param_bytes, self.shape.matmul_params
        self._attn_per_pair = costs.attention_flops(self.shape, 1.0)
        self._flops_rate = self.hw.peak_bf16_flops * config.efficiency.decode_mfu * config.tp
        self._prefill_rate = self.hw.peak_bf16_flops * config.efficiency.prefill_mfu * config.tp
        self._bytes_rate = self.hw.hbm_bandwidth * config.efficiency.mbu * config.tp
        self._groups: dict[int, list] = {}  # gid -> [task shapes of its samples, samples not yet started]
        self._blocks: dict[tuple, list] = {}  # (block, group size) -> [its groups' shapes, groups that took theirs]
        self._rollout_devices = 0
        self._sync_s = config.measured.sync_s if config.measured is not None else costs.weight_sync_time(
            self.shape, self.hw, receiver_devices=config.tp,
            span_devices=config.tp if pool is None else num_devices, latency_s=config.sync_fixed_s)
        self.replicas: dict[tuple, _Replica] = {}
        self._rid = 0
        self._load_heap: list[tuple[int, int, _Replica]] = []  # lazy heap (live, rid, replica)
        self.counters = dict(prompt_tokens=0, prompt_tokens_cached=0, prefill_tokens=0, decode_tokens=0,
                             events=0, ctb_evictions=0, cache_evictions=0, moved_tasks=0)
        # counted apart (at every event), merged into `counters` by stats()
        self._events = self._decode_tokens = self._prompt_tokens = self._prompt_tokens_cached = self._prefill_tokens = 0
        # the replicas' load since the last `rollout_scaling`: decode steps, busy and prefill seconds of their
        # spans, and task-seconds running / queued behind a full replica (what admission left waiting)
        self._load_mark = (0, 0, 0.0, 0.0, 0.0, 0.0)  # (steps, tokens, busy, prefill, running, queued) at the last call
        self._load_steps = 0
        self._load_busy = self._load_prefill = self._load_running = self._load_queued = 0.0
        self._chunk = config.decode_chunk
        self._max_batch, self._finished_window = config.max_batch, config.finished_window
        self._shared_prefix = config.shared_prefix_tokens
        self._decode_flops = 2.0 * self._matmul_params
        self._finished: collections.deque[int] = collections.deque(maxlen=config.finished_window)
        self._window: tuple[int, ...] = ()  # `_finished` at the last refresh: what the estimate reads
        self._finishes = 0
        self._remaining_turns: dict[int, float] = {}  # turns done -> CTB's footprint margin (`_footprint`)
        self._ctb = self.kv_mode == "ctb"
        self._busy_lane = False  # replica events add busy time to the rollout lane (`attach`, lanes not shared)
        self._span_lane = False  # shared lanes (sync): replica busy time is summed per rollout span instead
        self._span_busy = 0.0  # device-seconds of replica events in the open rollout span
        self._spec = config.war_speculation and config.measured is None
        self._engine_steps = config.engine_steps
        self._call_overhead = config.measured.call_overhead_s if config.measured is not None else 0.0
        # `Engine._chunk_buckets` (SimConfig.prefill_chunk with engine_steps), () otherwise
        chunk = config.prefill_chunk if config.engine_steps else 0
        self._chunk_buckets = pow2_buckets(min(16, chunk), chunk) if chunk else ()
        self._prefill_budget = (config.prefill_budget or _NO_LIMIT) if chunk else _NO_LIMIT
        self._prefill_row_cap = min(16, config.max_batch) if chunk else _NO_LIMIT  # EngineConfig.max_prefill_rows
        # `Engine`'s shape buckets (SimConfig.max_seq_len with engine_steps and MeasuredCosts.program_s)
        m = config.measured
        self._program_s = m.program_s if (m is not None and config.engine_steps and config.max_seq_len) else 0.0
        if self._program_s:
            if not chunk:
                raise ValueError("SimConfig.max_seq_len (engine programs) needs prefill_chunk")
            max_pages = config.max_seq_len // config.page_size
            self._decode_pages = half_pow2_buckets(min(4, max_pages), max_pages)
            self._prefill_pages = pow2_buckets(min(4, max_pages), max_pages)
            self._decode_rows = pow2_buckets(min(8, config.max_batch), config.max_batch)
            self._prefill_rows = pow2_buckets(1, min(16, config.max_batch))  # EngineConfig.max_prefill_rows
        # the trainer's and the ref scorer's programs run so far, as (program, micro-batches)
        # (MeasuredCosts.score_program_s / update_program_s / ref_program_s): per backend, as each real run
        # builds its own Trainer and Scorer, whose jitted programs are their own; a move of their devices drops them
        self._train_programs: set = set()
        self._compiled_s = 0.0  # seconds of program loads simulated so far (`compile_s`, as the real backend's)
        self._mean_latency = self.workload.env_latency_s.mean()
        self._ref_lock: asyncio.Lock | None = None  # created on the loop in start()
        self.metrics = None
        self._shared = pool is None
        self._busy_replicas = 0
        self._busy_since = 0.0
        self._step_span = None
        self._span_ctx = None
        self._started = False
        self.version = 0
        # the discrete-event core: one heap of (virtual time, order, replica (`_wake`) or returning task
        # (`_env_return`)) for every
        # replica event and environment return, driven by one loop timer (`_drive`)
        self._heap: list = []
        self._order = 0
        self._admissions = 0
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at = 0.0
        self._driving = False
        # BiDiRL: train-device slices serving as rollout replicas; rollout replicas lent to the trainer
        self._borrowed: list[tuple] = []
        self._lent: set[tuple] = set()
        self._train_extra = 0  # devices the trainer borrowed
        self._parked: list[_Seq] = []  # tasks that arrived while no replica served
        self._switch_out_s = 0.0

    @classmethod
    def for_controller(cls, config: SimConfig, controller_config, num_devices: int) -> "SimBackend":
        """The backend for a `ControllerConfig`: its mode and device groups over `num_devices` ids."""
        c = controller_config
        pool = split_devices(range(num_devices), mode=c.mode, group_size=c.device_group_size,
                             rollout=c.rollout_groups, ref=c.ref_groups, train=c.train_groups, tensor=c.tensor)
        return cls(config, mode=c.mode, pool=pool, num_devices=num_devices)

    def attach(self, metrics) -> None:
        """Exact busy accounting per replica into the controller's `RunMetrics` (module docstring)."""
        self.metrics = metrics
        self._busy_lane = metrics is not None and not self._shared
        self._span_lane = metrics is not None and self._shared

    # ---------------------------------------------------------------- the interface

    def clock(self) -> float:
        return self.loop.time()

    def lanes(self) -> dict[str, int]:
        return lanes_of(self.pool, self.num_devices)

    @property
    def has_ref_devices(self) -> bool:
        return self.pool is not None and bool(self.pool.devices_of("ref"))

    def _devices(self, role: str) -> list:
        return list(range(self.num_devices)) if self.pool is None else self.pool.devices_of(role)

    async def start(self, make_env, latency_for, step_span) -> None:
        del make_env, latency_for  # environment latency comes from the workload
        self._step_span = step_span
        self._ref_lock = asyncio.Lock()
        self._started = True
        self._rebuild()

    async def stop(self) -> None:
        now = self.loop._now
        for r in self.replicas.values():  # the events of spans in flight that ended by now count
            if r.busy:
                end = self._walk(r, now)
                self._events += r.w_chunks - 1
                if self._busy_lane:
                    self._add_busy(r, r.w_dur - (end - r.w_prev))
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        self._heap.clear()
        self._started = False

    async def generate(self, task, group, sample, expected_group_size) -> Trajectory:
        return (await self.generate_group(task, group, [sample], expected_group_size))[0]

    async def generate_group(self, task, group, samples, expected_group_size) -> list[Trajectory]:
        """Samples `samples` of one GRPO group, placed in order; returns when the last one ends (one
        asyncio future per group: the controller acts on a group only once it is complete)."""
        waiter = _Waiter(self.loop.create_future(), len(samples))
        seqs = [_Seq(group, i, self._shape(group, i, expected_group_size), waiter) for i in samples]
        for seq in seqs:
            self._place(seq)
        await waiter.future
        return [SimTrajectory(task.task_id, task.kind, group, info={"sample": seq.sample}, end_reason="answered",
                              model_tokens=sum(seq.shape.gen_tokens), context_tokens=seq.shape.context_tokens,
                              version_tokens=seq.versions) for seq in seqs]

    def _shape(self, group: int, sample: int, group_size: int) -> workloads.TaskSample:
        """Sample `sample` of `group`. The workload's shapes are drawn (`sample_tasks`) for `SHAPE_BLOCK`
        groups at once, from an rng seeded by (seed, block): a group's shapes depend on the seed and its
        id only, so a run is reproducible whatever order samples start in (and one draw serves many
        groups: ~3x cheaper). `shape_sampler`'s are drawn per group, from an rng seeded by (seed, group)."""
        entry = self._groups.get(group)
        if entry is None or sample >= len(entry[0]):
            n = max(group_size, sample + 1)
            if self.shape_sampler is not None or n > group_size:
                rng = np.random.default_rng([self.cfg.seed, group])
                shapes = (sample_tasks(self.workload, rng, n) if self.shape_sampler is None
                          else self.shape_sampler(group, rng, n))
            else:
                shapes = self._block_shapes(group, group_size)
            entry = self._groups[group] = [shapes, 0]
        entry[1] += 1
        shape = entry[0][sample]
        if entry[1] >= len(entry[0]):
            del self._groups[group]
        return shape

    def _block_shapes(self, group: int, group_size: int) -> list:
        """`group`'s `group_size` shapes from its block's draw (drawn at the block's first group; the draw
        is dropped once every group of the block has taken its shapes)."""
        block, i = divmod(group, SHAPE_BLOCK)
        key = (block, group_size)
        entry = self._blocks.get(key)
        if entry is None:
            rng = np.random.default_rng([self.cfg.seed, block, SHAPE_BLOCK])
            entry = self._blocks[key] = [sample_tasks(self.workload, rng, SHAPE_BLOCK * group_size), 0]
        entry[1] += 1
        if entry[1] == SHAPE_BLOCK:
            del self._blocks[key]
        return entry[0][i * group_size:(i + 1) * group_size]

    def kv_hit_rate(self) -> float:
        return self._prompt_tokens_cached / max(1, self._prompt_tokens)

    async def score_ref(self, trajectories: Sequence[Trajectory]) -> tuple[list, bool]:
        tokens, seq_len = _tokens(trajectories)
        async with self._ref_lock:
            m = self.measured
            if m is None:
                # a job queued across an ERS move that took the last ref group runs on the train devices
                devices = len(self._devices("ref")) or len(self._devices("train"))
                seconds = costs.score_time(self.shape, self.hw, tokens, devices=devices,
                                           seq_len=seq_len, eff=self.eff)
            else:
                micro = self._micro(trajectories)
                load = self._train_program("ref", micro, m.ref_program_s)
                seconds = m.ref_fixed_s + m.ref_per_token_s * tokens + m.ref_per_micro_s * micro + load
                self._compiled_s += seconds if load else 0.0  # (the scorer's first call, load and run)
            await self._host_work(seconds)
        return [0.0] * len(trajectories), False

    async def _host_work(self, seconds: float) -> None:
        """A train or ref job of `seconds` (alone). Measured costs with shared cores: processor
        sharing with the rollout, both ways: while any replica is busy the job advances at
        1 / `train_overlap_x` of its speed, and while a job runs the busy replicas' events advance at
        1 / `rollout_overlap_x` of theirs (their remaining time is stretched when the first job
        starts and shrunk back when the last one ends)."""
        m = self.measured
        if m is None or (m.train_overlap_x == 1 and m.rollout_overlap_x == 1):
            await asyncio.sleep(seconds)
            return
        if self._host_jobs == 0:
            self._rescale_rollout(m.rollout_overlap_x)
        self._host_jobs += 1
        try:
            loop, left = self.loop, seconds
            while left > 1e-12:
                x = m.train_overlap_x if self._busy_replicas else 1.0
                if self._flip is None or self._flip.done():
                    self._flip = loop.create_future()
                flip, t0 = self._flip, loop.time()
                timer = loop.call_at(t0 + left * x, lambda f=flip: f.done() or f.set_result(None))
                try:
                    await flip
                finally:
                    timer.cancel()
                left -= (loop.time() - t0) / x
        finally:
            self._host_jobs -= 1
            if self._host_jobs == 0 and self._started:  # (a job cancelled at the end: the loop may be closed)
                self._rescale_rollout(1.0 / m.rollout_overlap_x)

    def _rescale_rollout(self, f: float) -> None:
        """Stretches (f > 1) or shrinks the rest of every busy replica's event by `f`."""
        now = self.loop._now
        for r in self.replicas.values():  # measured costs: a span is one event (`_walk`)
            if not r.busy or r.wake_at <= now:
                continue
            prefill, step = r.w_prefill, r.w_step_s
            K = r.w_step - r.w_first
            start = now + (r.w_start - now) * f  # then start + prefill + k * step = now + (old - now) * f
            r.w_start, r.w_prefill, r.w_step_s = start, prefill * f, step * f
            end = start + (prefill + K * step) * f
            r.w_dur = end - r.span_start
            r.wake_at = _INF
            self._schedule(r, end)

    def _rollout_flipped(self) -> None:
        """The rollout went idle or busy: host jobs re-time themselves (`_host_work`)."""
        flip = self._flip
        if flip is not None and not flip.done():
            flip.set_result(None)

    async def train(self, trajectories: Sequence[Trajectory]) -> dict:
        tokens, seq_len = _tokens(trajectories)
        n = len(self._devices("train")) + self._train_extra
        m = self.measured
        if m is None:
            proximal = costs.score_time(self.shape, self.hw, tokens, devices=n, seq_len=seq_len, eff=self.eff)
            update = costs.train_step_time(self.shape, self.hw, tokens, devices=n, seq_len=seq_len, eff=self.eff)
        else:
            micro = self._micro(trajectories)
            proximal = m.score_fixed_s + m.score_per_token_s * tokens + m.score_per_micro_s * micro
            update = m.update_fixed_s + m.update_per_token_s * tokens + m.update_per_micro_s * micro
        has_ref = bool(trajectories) and all(t.info.get("ref_logp") is not None for t in trajectories)
        ref = 0.0 if has_ref else proximal
        if m is not None:  # a program shape this trainer has not run yet: its first call loads it (the colocated
            # ref pass then finds the score program loaded)
            loads = self._train_program("score", micro, m.score_program_s), self._train_program(
                "update", micro, m.update_program_s)
            proximal, update = proximal + loads[0], update + loads[1]
            # `Trainer.compile_s` counts the whole first call of a program (its load and its run)
            self._compiled_s += (proximal if loads[0] else 0.0) + (update if loads[1] else 0.0)
        if self._train_extra:  # borrowed replicas merge their gradients
            update += self.switch_costs("rollout", "train")["merge_s"]
        t0 = self.loop.time()
        await self._host_work(proximal + ref + update)
        if self._train_extra and self.metrics is not None:  # the borrowed rollout devices were busy
            self.metrics.busy_device_s["rollout"] += (self.loop.time() - t0) * self._train_extra
        return dict(tokens=float(sum(t.model_tokens for t in trajectories)), reward=0.0, loss=0.0,
                    time_proximal_s=proximal, time_ref_s=ref, time_update_s=update, compile_s=0.0)

    def _train_program(self, program: str, micro: int, seconds: float) -> float:
        """`seconds` the first time this trainer / scorer runs `program` on `micro` micro-batches, else 0
        (`Trainer._program`: a jitted program per packed shape, loaded or compiled at its first call)."""
        if not seconds or (program, micro) in self._train_programs:
            return 0.0
        self._train_programs.add((program, micro))
        return seconds

    def _micro(self, trajectories: Sequence[Trajectory]) -> int:
        """The trainer's micro-batches for these trajectories (SimConfig.train_row_len; 0 without it)."""
        if not self.cfg.train_row_len or not self.cfg.train_micro_rows:
            return 0
        return costs.packed_micro_batches([getattr(t, "context_tokens", 0) or len(t.tokens) for t in trajectories],
                                          self.cfg.train_row_len, self.cfg.train_micro_rows)

    async def publish(self, version: int) -> bool:
        await asyncio.sleep(self._sync_s)
        self.version = version
        now = self.loop._now
        for r in self.replicas.values():
            r.version = version
            if r.busy:  # the events after the one in flight run the new weights
                self._cut(r, now)
        return True

    async def move(self, from_role: str, to_role: str) -> None:
        group = self.pool.group_size
        self.pool = self.pool.moved(from_role, to_role)
        state = self.shape.param_bytes + (self.shape.params * self.cfg.optimizer_bytes_per_param
                                          if to_role == "train" else 0.0)
        seconds = costs.switch_time(state, self.hw, devices=group, span_devices=len(self._devices(to_role)),
                                    fixed_s=self.cfg.switch_fixed_s)
        if self.measured is not None:
            seconds = self.measured.switch_s
        # the trainer moved to a new mesh recompiles (`Trainer.move_to`); a ref group's move makes a new Scorer
        dropped = ({"score", "update"} if "train" in (from_role, to_role) else set()) | (
            {"ref"} if "ref" in (from_role, to_role) else set())
        self._train_programs = {k for k in self._train_programs if k[0] not in dropped}
        if from_role == "rollout":
            self._rebuild()  # its replicas stop now
        await asyncio.sleep(seconds)
        if to_role == "rollout":
            self._rebuild()  # new replicas serve once the weights are there

    # ---------------------------------------------------------------- BiDiRL borrowing

    def borrow_unit(self, role: str) -> int:
        """Devices per unit of `role` a borrow moves: a rollout replica, a trainer device group."""
        if role == "rollout":
            return self.cfg.tp or len(self._devices("rollout"))
        return self.cfg.tp or 1

    def switch_costs(self, lender: str, borrower: str) -> dict[str, float]:
        """Seconds of a BiDiRL hot switch of one borrower unit (module docstring)."""
        opt = self.shape.params * self.cfg.optimizer_bytes_per_param
        unit = self.borrow_unit(borrower)
        span = self.num_devices
        if self.measured is not None:
            return dict(switch_in_s=self.measured.switch_s, switch_out_s=self.measured.switch_s, merge_s=0.0)
        def t(state):
            return costs.switch_time(state, self.hw, devices=unit, span_devices=span, fixed_s=self.cfg.switch_fixed_s)
        if borrower == "rollout":
            return dict(switch_in_s=t(opt), switch_out_s=t(opt), merge_s=0.0)
        merge = costs.transfer_time(2 * 2.0 * self.shape.params, self.hw.link_bandwidth(span),
                                    streams=max(1, unit))
        return dict(switch_in_s=t(self.shape.param_bytes + opt), switch_out_s=t(self.shape.param_bytes),
                    merge_s=merge)

    def idle_devices(self, role: str) -> int:
        """Rollout devices whose replica has no task (placed, running, waiting or queued)."""
        if role != "rollout" or self.pool is None:
            return 0
        return sum(len(k) for k, r in self.replicas.items() if r.live == 0 and not r.busy and not r.borrowed)

    async def lend(self, lender: str, borrower: str, devices: int) -> None:
        """Switches `devices` idle devices of `lender` to `borrower` until `take_back`."""
        if self._borrowed or self._lent:
            raise RuntimeError("SimBackend.lend: devices are already lent (take_back first)")
        costs_ = self.switch_costs(lender, borrower)
        unit = self.borrow_unit(borrower)
        if lender == "train" and borrower == "rollout":
            devs = self._devices("train")[:devices]
            await asyncio.sleep(costs_["switch_in_s"])
            self._borrowed = [tuple(devs[i:i + unit]) for i in range(0, len(devs) - unit + 1, unit)]
            self._rebuild()
            self._rebalance([self.replicas[k] for k in self._borrowed])
        elif lender == "rollout" and borrower == "train":
            idle = [k for k, r in self.replicas.items() if r.live == 0 and not r.busy and not r.borrowed]
            chosen, n = [], 0
            for k in idle:
                if n + len(k) > devices:
                    break
                chosen.append(k)
                n += len(k)
            self._lent = set(chosen)
            self._rebuild()  # they stop serving now
            await asyncio.sleep(costs_["switch_in_s"])
            self._train_extra = n
        else:
            raise ValueError(f"SimBackend.lend: cannot lend {lender} devices to {borrower}")
        self._switch_out_s = costs_["switch_out_s"]

    async def take_back(self) -> None:
        """Ends the borrow: each device back in its own role after the switch-out."""
        if self._borrowed:
            self._borrowed = []
            self._rebuild()  # what they ran continues elsewhere, without its KV
            await asyncio.sleep(self._switch_out_s)
        elif self._lent:
            self._train_extra = 0
            await asyncio.sleep(self._switch_out_s)
            self._lent = set()
            self._rebuild()

    def _rebalance(self, targets: list) -> None:
        """New replicas take queued tasks that hold no KV (tails first) from replicas above the mean load."""
        if not targets:
            return
        share = sum(r.live for r in self.replicas.values()) // len(self.replicas)
        movable = []
        now = self.loop._now
        for r in sorted(self.replicas.values(), key=lambda r: -r.live):
            if r.borrowed or r.live <= share:
                continue
            self._arrived(r, now)  # (queued at once, as far as this is concerned)
            excess = r.live - share
            for q in (r.pending, r.queue):
                for s in reversed(list(q)):
                    if excess <= 0:
                        break
                    if s.pinned or s.kv_pages or s.run >= 0:
                        continue
                    q.remove(s)
                    entry = r.cache.pop(s, None)
                    if entry is not None:
                        r.cache_pages -= entry[0]
                    if s.admitted:
                        r.footprints -= s.footprint
                    self._set_live(r, -1)
                    movable.append(s)
                    excess -= 1
        i = 0
        for s in movable:
            for _ in range(len(targets)):
                t = targets[i % len(targets)]
                i += 1
                if t.live < share:
                    break
            else:
                t = targets[i % len(targets)]
            s.replica = t
            self._set_live(t, +1)
            if s.admitted:
                t.footprints += s.footprint
            self.counters["moved_tasks"] += 1
            self._enqueue(t, s)

    def compile_s(self) -> float:
        """Seconds of calls that loaded a program so far, as `JaxBackend.compile_s` counts its engine's and
        trainer's (measured costs' `program_s`: the load, an engine call's own run being milliseconds here; the
        trainer's and scorer's `*_program_s`: the load and the run of that first call); 0 without them."""
        return self._compiled_s

    def rollout_scaling(self) -> float | None:
        """The speed one more rollout device group would add, as a fraction of linear (ERS's economics,
        `policies.ers.MoveEconomics.rollout_scaling`), from the replicas' costs at their load since the
        last call (ours). With g more devices the n replicas become n' = n + g / tp:

        - task-seconds queued behind a full replica (share q) would start sooner: linear, n / n';
        - prefill (share p of the busy time) is compute: linear;
        - decode runs the same sequences' tokens at a smaller batch per replica, B' = B n / n', each
          step costing `decode_step(B', context)` instead of `decode_step(B, context)`; memory-bound
          decoding at small B barely gets faster.

        ratio = q n/n' + (1 - q) (p n/n' + (1 - p) step(B') / step(B)); then the scaling that gives it
        (`ers.measured_scaling`). None before any load was seen."""
        from tiderl_jax.policies import ers  # (policies import nothing of the simulator)

        mark = (self._load_steps, self._decode_tokens, self._load_busy, self._load_prefill, self._load_running,
                self._load_queued)
        steps, tokens, busy, prefill, running, queued = (a - b for a, b in zip(mark, self._load_mark))
        self._load_mark = mark
        devices = len(self._devices("rollout")) if self.pool is not None else 0
        if self.pool is None or steps <= 0 or tokens <= 0 or busy <= 0 or not devices:
            return None
        tp = self.cfg.tp or devices
        n = devices / tp
        n_new = n + self.pool.group_size / tp
        linear = n / n_new
        batch = tokens / steps
        live = [r for r in self.replicas.values() if r.running]
        seqs = sum(len(r.running) for r in live)
        context = (sum(r.ctx_base + len(r.running) * r.steps for r in live) / seqs if seqs else
                   self.workload.prompt_tokens.mean() + self.workload.tokens_per_turn.mean())
        def step(b):
            if self.measured is not None:
                return self.measured.decode_step_s + self.measured.decode_per_seq_s * b
            return self._decode_step(b, b * context)
        p = min(1.0, prefill / busy)
        q = queued / (queued + running) if queued + running > 0 else 0.0
        ratio = q * linear + (1 - q) * (p * linear + (1 - p) * step(batch * linear) / step(batch))
        groups = devices / self.pool.group_size
        return ers.measured_scaling(round(groups), round(groups) + 1, ratio)

    def move_cost_estimate(self) -> float:
        """What one ERS move of a device group costs here (the controller's economics before any move
        is measured): the measured switch time, or the roofline switch of a train group's state."""
        m = self.measured
        if m is not None:
            if self._program_s or m.score_program_s or m.update_program_s or m.ref_program_s:
                # program loads simulated: what the real controller weighs, with no estimate from its backend
                # (`Controller._ers_economics`): the program seconds so far, which a move to new meshes repeats
                return self._compiled_s
            return m.switch_s
        group = self.pool.group_size if self.pool is not None else self.num_devices
        state = self.shape.param_bytes + self.shape.params * self.cfg.optimizer_bytes_per_param
        return costs.switch_time(state, self.hw, devices=group, span_devices=self.num_devices,
                                 fixed_s=self.cfg.switch_fixed_s)

    def arrays(self) -> dict[str, Any] | None:
        return None

    def restore_arrays(self, arrays, *, step: int, version: int) -> None:
        self.version = version

    def load_policy(self, params, version: int) -> None:
        del params, version

    def stats(self) -> dict:
        self.counters.update(events=self._events, decode_tokens=self._decode_tokens, prompt_tokens=self._prompt_tokens,
                             prompt_tokens_cached=self._prompt_tokens_cached, prefill_tokens=self._prefill_tokens)
        return dict(self.counters, replicas=len(self.replicas), kv_pages_per_replica=self.capacity,
                    kv_hit_rate=self.kv_hit_rate())

    def decode_load(self) -> dict:
        """How hard the replicas decoded over the run so far: `decode_batch`, the mean sequences per decode
        step; `decode_batch_limit`, the most a replica could run at the mean context (KV pages and
        `max_batch`); `decode_capacity_used`, the decode throughput at `decode_batch` over the throughput at
        that limit (roofline costs; 1 for a replica that decodes as fast as it can, a few percent for one whose
        memory-bound steps carry a handful of sequences: latency-bound); `prefill_share` of the replicas' busy
        time. The mean context is the context tasks start their turns with. {} before any decoding. (From the
        load signals ERS reads (`rollout_scaling`): events still in flight when the run stops are not in them.)"""
        if not self._load_steps or not self._admissions:
            return {}
        batch = self._decode_tokens / self._load_steps
        context = self._prompt_tokens / self._admissions
        limit = max(1.0, min(float(self._max_batch), self.capacity * self.ps / max(context, 1.0)))
        out = dict(decode_batch=batch, decode_batch_limit=limit,
                   prefill_share=self._load_prefill / self._load_busy if self._load_busy else 0.0)
        if self.measured is None:
            def rate(b: float) -> float:  # tokens per second of a replica decoding b sequences of `context` tokens
                # (`_decode_step`'s roofline; its batch is an integer when compiled, a mean batch is not)
                flops = 2.0 * self._matmul_params * b + self._attn_per_pair * b * context
                moved = self._param_bytes + self._kv_bytes * (b * context + b)
                return b / max(flops / self._flops_rate, moved / self._bytes_rate)
            out["decode_capacity_used"] = min(1.0, rate(batch) / rate(max(limit, batch)))
        return out

    # ---------------------------------------------------------------- replicas

    def _rebuild(self) -> None:
        """Replicas over the rollout devices now: kept where their devices stay, new ones empty,
        removed ones' tasks placed elsewhere without their KV."""
        devs = self._devices("rollout")
        self._rollout_devices = len(devs)
        tp = self.cfg.tp or len(devs)
        self._replica_devices = tp
        wanted = [tuple(devs[i:i + tp]) for i in range(0, len(devs) - tp + 1, tp)]
        wanted = [k for k in wanted if k not in self._lent] + list(self._borrowed)  # BiDiRL
        orphans: list[_Seq] = []
        for key in [k for k in self.replicas if k not in set(wanted)]:
            r = self.replicas.pop(key)
            r.alive = False  # its event on the heap is skipped
            if r.busy:  # the events of its span that ended count; the one in flight is cut short (lost)
                end = self._walk(r, self.loop._now)
                r.steps = r.w_first
                self._events += r.w_chunks - 1
                self._busy_end(r, r.w_dur - (end - r.w_prev))
            for s in list(r.running):
                self._retire(r, s)  # what earlier events wrote
                orphans.append(s)
            now = self.loop._now
            self._arrived(r, now)  # returned: in the queue
            for at, order, s in r.arrivals:  # still in their environment: placed when they return
                heapq.heappush(self._heap, (at, order, s))
                if not self._driving:
                    self._arm(at)
            r.arrivals = []
            orphans.extend(r.prefilling)  # (their prefill so far lost with the KV)
            orphans.extend(r.queue)
            orphans.extend(r.pending)
            for s in list(r.pinned) + list(r.cache):
                s.pinned = False
            for s in orphans + list(r.queue) + list(r.pinned):
                s.kv_pages = 0
        for key in wanted:
            if key not in self.replicas:
                r = _Replica(self._rid, key, self.capacity)
                r.version = self.version
                r.borrowed = key in self._borrowed
                self._rid += 1
                self.replicas[key] = r
                heapq.heappush(self._load_heap, (0, r.rid, r))
        for s in orphans:  # tasks in flight continue on other replicas (sticky tasks now waiting: on return)
            self.counters["moved_tasks"] += 1
            s.replica = None
            self._place(s)
        if self.replicas and self._parked:
            parked, self._parked = self._parked, []
            for s in parked:
                self._place(s)

    def _pick(self) -> _Replica:
        """The alive replica with the fewest live tasks (lowest id on ties), from a lazy heap."""
        r: _Replica
        while self._load_heap:
            live, rid, r = self._load_heap[0]
            if not r.alive or live != r.live:
                heapq.heappop(self._load_heap)
                continue
            return r
        raise RuntimeError("no rollout replica")

    def _set_live(self, r: _Replica, delta) -> None:
        r.live += delta
        if r.alive:
            load = self._load_heap
            if len(load) > 4 * len(self.replicas) + 64:  # stale entries sink and stay: rebuilt from the replicas
                load = self._load_heap = [(q.live, q.rid, q) for q in self.replicas.values()]
                heapq.heapify(load)
            else:
                heapq.heappush(load, (r.live, r.rid, r))

    def _place(self, seq: _Seq) -> None:
        if not self.replicas:  # every rollout replica is lent out (BiDiRL): it waits for their return
            seq.replica = None
            self._parked.append(seq)
            return
        r = self._pick()
        seq.replica = r
        self._set_live(r, +1)
        if seq.admitted:  # a task moved off a removed replica keeps its CTB admission
            r.footprints += seq.footprint
        self._enqueue(r, seq)

    def _enqueue(self, r: _Replica, seq: _Seq) -> None:
        """`seq` joins `r`'s queue now: at the end of the event in flight, or at this instant once the loop
        is quiet if `r` is idle (all enqueues of the instant made before then join its first event)."""
        now: float = self.loop._now
        self._order += 1
        heapq.heappush(r.arrivals, (now, self._order, seq))
        if r.busy:
            self._cut(r, now)
        else:
            self._schedule(r, now)

    def _env_return(self, seq: _Seq) -> None:
        r = seq.replica
        if r is None or not r.alive:  # its replica was moved away meanwhile
            if r is not None:
                r.live -= 1
            self.counters["moved_tasks"] += 1
            seq.pinned, seq.kv_pages = False, 0
            self._place(seq)
        else:
            self._enqueue(r, seq)

    # ---------------------------------------------------------------- admission

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def _footprint(self, seq: _Seq) -> int:
        turn = seq.turn
        margin = self._remaining_turns.get(turn)  # max(1, expected remaining turns), per turns done
        if margin is None:
            margin = self._remaining_turns[turn] = max(
                1.0, ctb.expected_remaining_turns(turn, self._window, self.workload.max_turns))
        return ctb.estimate_footprint(seq.ctx, turn, seq.tokens_added, initial_growth=self.cfg.initial_growth,
                                      margin_turns=margin)

    def _free(self, r: _Replica) -> int:
        return r.capacity - r.used - r.cache_pages

    def _evict_cache(self, r: _Replica, need, keep: _Seq | None) -> None:
        """LRU: drops cached KV until `need` pages are free (never `keep`'s own entry)."""
        s: _Seq
        for s in list(r.cache):
            if self._free(r) >= need:
                return
            if s is keep:
                continue
            pages = r.cache.pop(s)[0]
            r.cache_pages -= pages
            self.counters["cache_evictions"] += 1

    def _evict_pinned(self, r: _Replica, need: int, keep: _Seq | None = None) -> None:
        """CTB: waiting tasks' KV dropped (into the prefix cache) by `ctb.choose_evictions`; never
        `keep`'s (the task being admitted: its pinned pages are part of what it needs)."""
        shortfall = need - self._free(r)
        if shortfall <= 0 or not r.pinned:
            return
        now = self.loop.time()
        by_id = {}
        signals = []
        for i, s in enumerate(r.pinned):
            if s is keep:
                continue
            by_id[i] = s
            signals.append(ctb.TaskKVSignals(
                task_id=i, is_eval=False, group_completion=0.0, is_active=False, context_len=s.kv_pages * self.ps,
                expected_wait_s=max(0.0, self._mean_latency - (now - s.wait_started))))
        for i in ctb.choose_evictions(signals, shortfall * self.ps, readiness_aware=self.cfg.readiness_aware):
            s = by_id[i]
            del r.pinned[s]
            s.pinned = False
            r.used -= s.kv_pages
            full = (s.ctx // self.ps)
            r.cache[s] = (s.kv_pages, full * self.ps, s.kv_version)
            r.cache_pages += s.kv_pages
            s.kv_pages = 0
            self.counters["ctb_evictions"] += 1

    def _admit(self, r: _Replica) -> float:
        """Starts the turns of the queue's sequences that fit now (FIFO, no overtaking); returns the seconds
        of their prefill."""
        s: _Seq
        ctb_mode = self._ctb
        budget = r.capacity * self.ps
        while r.pending:  # CTB task-level admission on the footprint estimate (first come, first served)
            s = r.pending[0]
            f = self._footprint(s)
            if not ctb.admit_tasks([(0, f)], budget_tokens=budget, used_tokens=r.footprints):
                break
            r.pending.popleft()
            s.footprint, s.admitted = f, True
            r.footprints += f
            r.queue.append(s)
        ps = self.ps
        queue, running, max_batch = r.queue, r.running, self._max_batch
        prompt_tokens = cached_tokens = prefill_tokens = 0
        pairs = 0.0
        chunk_buckets = self._chunk_buckets
        calls: dict[int, list] = {}  # chunk-length bucket -> [rows, most pages]: one prefill call each
        # `Engine._plan_prefill` (engine_steps with prefill_chunk): per event at most `chunk` tokens of a sequence,
        # `budget` tokens in all, `row_cap` sequences; prefills admitted by earlier events go first
        chunk = chunk_buckets[-1] if chunk_buckets else 0
        budget = self._prefill_budget
        row_cap = self._prefill_row_cap
        rows = 0
        work = 0  # tokens this event prefills
        n: int
        prefilling = r.prefilling
        if prefilling:
            for s in prefilling:
                if budget <= 0 or rows >= row_cap:
                    break
                n = min(s.pf_left, chunk, budget)
                call = calls.setdefault(_bucket(n, chunk_buckets), [0, 0])
                call[0] += 1
                call[1] = max(call[1], -(-(s.pf_done + n) // ps))
                pairs += n * s.pf_done + n * (n + 1) / 2
                s.pf_done += n
                s.pf_left -= n
                budget -= n
                rows += 1
                work += n
            if any(q.pf_left == 0 for q in prefilling):
                done = [q for q in prefilling if q.pf_left == 0]
                r.prefilling = prefilling = collections.deque(q for q in prefilling if q.pf_left)
                for s in done:
                    self._start(r, s)
        while queue and len(running) + len(prefilling) < max_batch:
            s = queue[0]
            need = -(-(s.ctx + s.left) // ps) - s.kv_pages  # pages to the end of the turn
            entry = r.cache.get(s)
            own = entry[0] if entry is not None else 0  # its own cached pages become its KV
            if r.capacity - r.used - r.cache_pages + own < need:
                c = self.counters
                evictions = c["cache_evictions"] + c["ctb_evictions"]
                self._evict_cache(r, need - own, keep=s)
                if ctb_mode and self._free(r) + own < need:
                    self._evict_pinned(r, need - own, keep=s)
                    self._evict_cache(r, need - own, keep=s)
                if self._free(r) + own < need and (r.used > 0 or r.running):
                    # what it evicted may let the next try pass: the next event boundary tries again
                    r.retry = c["cache_evictions"] + c["ctb_evictions"] != evictions
                    break
            queue.popleft()
            # what is cached of the context: pinned KV, a prefix-cache entry of this version, the group prompt
            if s.pinned:
                cached = s.ctx - s.new_tokens  # all but the observation
                del r.pinned[s]
                s.pinned = False
            else:
                cached = 0
                entry = r.cache.pop(s, None)
                if entry is not None:
                    r.cache_pages -= entry[0]
                    if entry[2] == r.version:
                        cached = entry[1]
                first = s.turn == 0 and s.written == 0
                if first or not cached:  # its prompt: blocks of this version another sample computed
                    p = r.prompts.get(s.gid)
                    if self._engine_steps:  # blocks computed in an earlier event only (`SimConfig.engine_steps`)
                        event = r.events
                        if p is not None and p[0] == r.version and p[1] > 0 and p[2] < event:
                            cached = max(cached, (s.prompt - 1) // ps * ps)
                        elif r.prefix_at[0] == r.version and r.prefix_at[1] < event:
                            cached = max(cached, min(self._shared_prefix, s.prompt - 1)
                                         // ps * ps)
                        if r.prefix_at[0] != r.version:
                            r.prefix_at = (r.version, event)
                    elif p is not None and p[0] == r.version and p[1] > 0:
                        cached = max(cached, (s.prompt - 1) // ps * ps)
                    if p is None or p[0] != r.version:  # (a re-prefill writes the group's prompt under this version)
                        r.prompts[s.gid] = p = [r.version, 0 if first else 1, r.events]
                    if first:
                        p[1] += 1
                s.kv_version = r.version  # a hit was of this version; a miss prefills the chain anew under it
            ctx = s.ctx
            new = ctx - cached
            s.new_tokens = 0  # prefilled by this event
            prompt_tokens += ctx
            cached_tokens += cached
            prefill_tokens += new
            r.used += need
            s.kv_pages += need
            if chunk_buckets:  # its first chunk, if the event has room for it
                if budget > 0 and rows < row_cap:
                    n = min(new, chunk, budget)
                    call = calls.setdefault(_bucket(n, chunk_buckets), [0, 0])
                    call[0] += 1
                    call[1] = max(call[1], -(-(cached + n) // ps))
                    budget -= n
                    rows += 1
                else:
                    n = 0
                pairs += n * cached + n * (n + 1) / 2
                work += n
                if n < new:  # the rest in the next events
                    s.pf_left, s.pf_done = new - n, cached + n
                    prefilling.append(s)
                    continue
            else:
                pairs += new * cached + new * (new + 1) / 2
                work += new
            self._start(r, s)
        r.events += 1
        if not prompt_tokens and not calls:
            return 0.0
        self._prompt_tokens += prompt_tokens
        self._prompt_tokens_cached += cached_tokens
        self._prefill_tokens += prefill_tokens
        seconds = self._prefill_time(work, cached_tokens, pairs, len(calls) or 1)
        if self._program_s:  # programs this engine has not run yet (SimConfig.max_seq_len)
            for width, (rows, pages) in calls.items():
                key = ("prefill", _bucket(rows, self._prefill_rows), width, _bucket(pages, self._prefill_pages))
                seconds += self._program(r, key)
        return seconds

    def _start(self, r: _Replica, s: _Seq) -> None:
        """`s`'s turn runs from this event's decode on (its prefill done)."""
        steps = r.steps
        end = steps + s.left
        s.start, s.end, s.ctx0 = steps, end, s.ctx
        s.run = n = self._admissions
        self._admissions = n + 1
        r.ctx_base += s.ctx - steps
        heapq.heappush(r.ends, (end, n, s))
        if end > r.maxend or not r.running:
            r.maxend = end
        r.running[s] = None

    # ---------------------------------------------------------------- serving

    def _program(self, r: _Replica, key: tuple) -> float:
        """Seconds to get the device program of shape bucket `key` on `r` (SimConfig.max_seq_len):
        `program_s` the first time (in this process: `programs`, or on this replica), else 0."""
        seen, key = (r.programs, key) if self.programs is None else (self.programs, (r.devices, key))
        if key in seen:
            return 0.0
        seen.add(key)
        self._compiled_s += self._program_s
        return self._program_s

    def _decode_step(self, batch: int, context_tokens: float) -> float:
        """`costs.decode_step_time(shape, hw, batch, context_tokens, devices=tp, eff)`, its constants cached."""
        flops = 2.0 * self._matmul_params * batch + self._attn_per_pair * context_tokens
        bytes_moved = self._param_bytes + self._kv_bytes * (context_tokens + batch)
        return max(flops / self._flops_rate, bytes_moved / self._bytes_rate)

    def _prefill_time(self, n, c, pairs: float, calls=1) -> float:
        """One batched prefill of `n` new tokens over `c` cached ones, `pairs` causal attention pairs in all
        (sum over sequences of new * cached + new * (new + 1) / 2); measured costs: in `calls` calls."""
        if self.measured is not None:
            m = self.measured
            return m.prefill_fixed_s * calls + m.prefill_per_token_s * n + m.prefill_per_pair_s * pairs if n else 0.0
        if n == 0:
            return 0.0
        flops = 2.0 * self._matmul_params * n + self._attn_per_pair * pairs
        bytes_moved = self._param_bytes + self._kv_bytes * (c + n)
        return max(flops / self._prefill_rate, bytes_moved / self._bytes_rate)

    def _wake(self, r: _Replica) -> None:
        """`r` at a chunk boundary (`wake_at`): what arrived meanwhile joins the queue, the span's events
        end (their turns end, each at its own step), then what fits is admitted and the next span starts:
        the new sequences' prefill and K decode steps of all, event after event until one ends a turn or
        something arrives (`_walk`); idle without running sequences."""
        now: float = self.loop._now
        if now != r.wake_at or not r.alive:  # stale: re-timed (`_cut`, `_rescale_rollout`) or moved away
            return
        r.wake_at = _INF
        arrivals = r.arrivals
        if arrivals and arrivals[0][0] <= now:  # (before the turns below add their environment returns)
            self._arrived(r, now)
        busy = r.busy
        if busy:  # (it stays busy if it goes on: no zero-length idle gap)
            self._events += r.w_chunks
            if self._busy_lane:
                self._add_busy(r, r.w_dur)
            elif self._span_lane:
                self._span_busy += r.w_dur * self._replica_devices
            self._load_steps += r.w_step - r.steps
            self._load_busy += r.w_dur
            r.steps = last = r.w_step
            ends = r.ends
            if ends and ends[0][0] <= last:  # turns of the span's last event (none end before it)
                start, first, step = r.w_start + r.w_prefill, r.w_first, r.w_step_s
                pop = heapq.heappop
                at_end = self._engine_steps  # the engine's call returns them all at once
                s: _Seq
                while ends and ends[0][0] <= last:
                    end, _, s = pop(ends)
                    self._retire(r, s)
                    self._turn_end(r, s, now if at_end else start + (end - first) * step)
        admitted = False
        if r.queue or r.pending or r.prefilling:
            before = self._admissions
            prefill = self._admit(r)
            admitted = self._admissions != before
            if self._host_jobs:  # measured costs, cores shared with a train / ref job
                prefill *= self.measured.rollout_overlap_x
        else:
            prefill = 0.0
        # (read by `_walk` with SimConfig.engine_steps: `Engine.step` decodes 1 step when it prefills or a turn waits)
        r.one_step = admitted or bool(r.queue) or bool(r.prefilling)
        B = len(r.running)
        self._load_prefill += prefill
        if (B or prefill) and self._call_overhead:  # measured costs: the rollout loop's host time per engine call
            prefill += self._call_overhead * (self.measured.rollout_overlap_x if self._host_jobs else 1.0)
        if B and self._program_s:  # the decode program of this batch's shape bucket, if this engine lacks it
            K = 1 if r.one_step else self._chunk
            steps = r.steps
            pages = max(-(-(s.ctx0 + steps - s.start + K - 1) // self.ps) for s in r.running)
            key = ("decode", _bucket(B, self._decode_rows), _bucket(pages, self._decode_pages))
            prefill += self._program(r, key) * (self.measured.rollout_overlap_x if self._host_jobs else 1.0)
        if not B and not prefill:  # idle until something arrives
            r.retry = False
            if busy:
                self._busy_end(r, 0.0)
            if arrivals:
                self._schedule(r, arrivals[0][0])
            return
        steps = r.steps
        if r.vlog[-1][1] != r.version:
            r.vlog.append((steps, r.version))
        r.span_start, r.span_prefill, r.span_steps, r.span_batch = now, prefill, steps, B
        r.span_ctx_base, r.span_maxend, r.span_first_end = r.ctx_base, r.maxend, r.ends[0][0] if B else steps
        end: float
        if r.retry:
            r.retry = False
            end = self._walk(r, now)
        else:
            end = self._walk(r, arrivals[0][0] if arrivals else _INF)
        if not busy:
            r.busy = True
            self._busy_replicas += 1
            if self._busy_replicas == 1:
                self._busy_first()
        span = end - now
        self._load_running += B * span
        self._load_queued += (len(r.queue) + len(r.pending)) * span
        r.wake_at = end  # (`_drive` runs this: no loop timer to arm)
        self._order += 1
        heapq.heappush(self._heap, (end, self._order, r))

    def _arrived(self, r: _Replica, now: float) -> None:
        """What arrived at `r` by `now` joins its queue (CTB: a task not admitted yet, task admission's)."""
        s: _Seq
        arrivals, pending, queue, ctb_mode = r.arrivals, r.pending, r.queue, self._ctb
        pop = heapq.heappop
        while arrivals and arrivals[0][0] <= now:
            s = pop(arrivals)[2]
            (pending if ctb_mode and not s.admitted else queue).append(s)

    def _walk(self, r: _Replica, until: float) -> float:
        """Times the events of `r`'s span (`r.span_*`) up to the first that ends after `until` or ends a
        turn (with measured costs: the first, whose time `_rescale_rollout` may change); sets `r.w_*`
        and returns when that event ends. Event by event (K = min(decode_chunk, the longest turn's steps
        left), B running sequences whose `context` tokens grow by B per step):

            seconds = prefill (the span's first event) + K * decode_step_time(B, context + B * (K - 1) / 2)

        accumulated in the order, and so to the last bit, of timing each event on its own heap entry."""
        start, prefill, steps, B = r.span_start, r.span_prefill, r.span_steps, r.span_batch
        ctx_base, maxend, first_end = r.span_ctx_base, r.span_maxend, r.span_first_end
        chunk = self._chunk
        t = start
        dur = 0.0
        n = 0
        m = self.measured
        if m is None:
            attn, decode_flops, flops_rate = self._attn_per_pair, self._decode_flops * B, self._flops_rate
            param_bytes, kv_bytes, bytes_rate = self._param_bytes, self._kv_bytes, self._bytes_rate
            spec, spec_max = self._spec, war.SPEC_MAX_BATCH
            while True:
                K = maxend - steps
                if K > chunk:
                    K = chunk
                # self._decode_step(B, context + B * (K - 1) / 2), inlined (the hottest line of a simulation)
                context = ctx_base + B * steps + B * (K - 1) / 2
                step = (decode_flops + attn * context) / flops_rate
                b = (param_bytes + kv_bytes * (context + B)) / bytes_rate
                if b > step:
                    step = b
                if spec and B <= spec_max:  # WAR: seconds per emitted token with a verify step, if it pays
                    step = self._spec_step(B, context, step)
                d = prefill + K * step
                prev = t
                t += d
                dur += d
                n += 1
                first = steps
                steps += K
                if steps >= first_end or t > until:
                    break
                prefill = 0.0
        else:
            if self._engine_steps:  # `Engine.step`: 1 step in a call that prefills or leaves a turn waiting
                K = (1 if r.one_step else chunk) if B else 0  # (no decode while all it runs still prefill)
            else:
                K = maxend - steps
                if K > chunk:
                    K = chunk
            step = m.decode_step_s + m.decode_per_seq_s * B
            if m.decode_per_kv_token_s:  # attention over the running sequences' context (as the roofline's)
                step += m.decode_per_kv_token_s * (ctx_base + B * steps + B * (K - 1) / 2)
            if self._host_jobs:
                step *= m.rollout_overlap_x
            d = prefill + K * step
            prev = t
            t += d
            dur, n, first = d, 1, steps
            steps += K
        r.w_step, r.w_prev, r.w_chunks, r.w_dur = steps, prev, n, dur
        r.w_start, r.w_prefill, r.w_first, r.w_step_s = prev, prefill, first, step
        return t

    def _spec_step(self, B: int, context: float, t_decode: float) -> float:
        """WAR's switch (`war.speculation_pays`, `use_speculation`'s rule) for one event: a verify step scores
        `spec_draft_tokens` + 1 tokens of each of the B sequences over the same context (roofline) and emits
        `spec_accepted_tokens` of them; returns the seconds per emitted token, with or without it."""
        cfg = self.cfg
        n = B * (cfg.spec_draft_tokens + 1)
        flops = self._decode_flops * n + self._attn_per_pair * context * (cfg.spec_draft_tokens + 1)
        t_spec = max(flops / self._flops_rate, (self._param_bytes + self._kv_bytes * (context + n)) / self._bytes_rate)
        accepted = cfg.spec_accepted_tokens
        return t_spec / accepted if war.speculation_pays(B, t_spec, accepted, t_decode) else t_decode

    def _cut(self, r: _Replica, at: float) -> None:
        """The span in flight on `r` ends with its first event that ends after `at` (something arrived,
        or the weights or CTB's footprint estimate changed: the next event sees it)."""
        if at < r.w_prev:  # (else that is the span's last event already)
            self._schedule(r, self._walk(r, at))

    def _schedule(self, r: _Replica, at: float) -> None:
        """`r` wakes at `at` if that is earlier than its wake now (the later heap entry goes stale)."""
        if at < r.wake_at:
            r.wake_at = at
            self._order += 1
            heapq.heappush(self._heap, (at, self._order, r))
            if not self._driving:
                self._arm(at)

    def _retire(self, r: _Replica, s: _Seq) -> None:
        """Takes `s` off the running set, bringing its counts up to the replica's decode steps."""
        del r.running[s]
        s.run = -1
        r.ctx_base -= s.ctx0 - s.start
        k = min(s.end, r.steps) - s.start
        if k <= 0:
            return
        s.left -= k
        s.ctx += k
        s.written += k
        self._decode_tokens += k
        versions, a, hi = s.versions, s.start, s.start + k
        vlog = r.vlog
        at, v = vlog[-1]
        if at <= a:  # one version all turn
            versions[v] = versions.get(v, 0) + k
            return
        for i in range(len(vlog) - 1, -1, -1):
            at, v = vlog[i]
            if hi > at:
                lo = at if at > a else a
                versions[v] = versions.get(v, 0) + hi - lo
                hi = lo
            if at <= a:
                break

    # ---------------------------------------------------------------- the event heap

    def _arm(self, at: float) -> None:
        if self._armed is not None:
            if self._armed_at <= at:
                return
            self._armed.cancel()
        self._armed, self._armed_at = self.loop.call_at(at, self._drive), at

    def _drive(self) -> None:
        """Runs heap events in time order, advancing the virtual clock itself while nothing else on
        the loop could happen first (`VirtualTimeLoop.quiet_until`); stops when an asyncio callback
        becomes ready (a finished sample wakes the controller) or a loop timer comes first."""
        self._armed = None
        heap, loop = self._heap, self.loop
        pop = heapq.heappop
        ready = loop._ready  # asyncio's ready queue: non-empty once a finished sample wakes a task
        # the next loop timer: heap events never schedule loop timers, so it holds while driving
        limit: float = loop.quiet_until()
        now: float = loop._now
        self._driving = True
        try:
            while heap:
                at: float = heap[0][0]
                if at > now:
                    if at > limit or ready:
                        break
                    loop._now = now = at
                x = pop(heap)[2]
                if type(x) is _Replica:
                    self._wake(x)
                else:
                    self._env_return(x)
        finally:
            self._driving = False
        if heap:
            self._arm(heap[0][0])

    def _turn_end(self, r: _Replica, s: _Seq, at: float) -> None:
        turn = s.turn
        if turn + 1 >= len(s.gen) or turn >= len(s.obs):  # the task ends
            self._finish(r, s)
            return
        obs = s.obs[turn]
        latency = s.latency[turn]
        s.turn = turn + 1
        s.left = s.gen[turn + 1]
        if self._ctb:  # KV kept and pinned; the reservation shrinks to the context
            keep = -(-s.ctx // self.ps)
            r.used -= s.kv_pages - keep
            s.kv_pages = keep
            s.pinned = True
            r.pinned[s] = None
        else:  # the turn's KV becomes prefix cache (full pages), keyed by this version
            r.used -= s.kv_pages
            full = s.ctx // self.ps
            r.cache[s] = (full, full * self.ps, s.kv_version)
            r.cache_pages += full
            s.kv_pages = 0
        s.ctx += obs
        s.new_tokens = obs  # a pinned resume prefills only the observation
        s.tokens_added = s.ctx - s.prompt
        if s.admitted:
            f = self._footprint(s)
            r.footprints += f - s.footprint
            s.footprint = f
        s.wait_started = at
        at += latency
        now: float = self.loop._now
        self._order += 1
        heapq.heappush(r.arrivals, (at if at > now else now, self._order, s))  # `_wake` schedules its wake

    def _finish(self, r: _Replica, s: _Seq) -> None:
        r.used -= s.kv_pages
        s.kv_pages = 0
        r.footprints -= s.footprint
        s.footprint = 0
        p = r.prompts.get(s.gid)
        if p is not None:
            p[1] -= 1
            if p[1] <= 0:
                del r.prompts[s.gid]
        self._set_live(r, -1)
        self._finished.append(len(s.gen))
        self._finishes += 1
        if self._finishes % self._finished_window == 0 or self._finishes < self._finished_window:
            self._remaining_turns.clear()
            self._window = tuple(self._finished)
            now: float = self.loop._now
            for q in self.replicas.values():  # the footprints of tasks awaiting admission changed
                if q.pending and q.busy:
                    self._cut(q, now)
        w: _Waiter = s.future
        w.left -= 1
        if w.left == 0 and not w.future.done():
            w.future.set_result(None)

    # ---------------------------------------------------------------- busy accounting

    def _add_busy(self, r: _Replica, seconds: float) -> None:
        """`seconds` of events of `r` into the rollout lane's busy time (`_busy_lane`: with `attach`, lanes
        not shared)."""
        m = self.metrics
        if r.borrowed:  # train devices doing rollout work: the train lane's busy time
            m.busy_device_s["train"] += seconds * self._replica_devices
        else:
            n = self._rollout_devices or 1
            m.busy_device_s["rollout"] += seconds * self._replica_devices
            m.busy_s["rollout"] += seconds * self._replica_devices / n

    def _busy_first(self) -> None:
        """The first busy replica of the pool (`_wake` counts them): a rollout span opens."""
        if self._flip is not None:
            self._rollout_flipped()
        if self.metrics is not None:
            self._busy_since = self.metrics.now()
        elif self._step_span is not None:
            self._span_ctx = self._step_span()
            self._span_ctx.__enter__()

    def _busy_end(self, r: _Replica, seconds: float) -> None:
        if not r.busy:
            return
        r.busy = False
        self._busy_replicas -= 1
        if self._busy_lane:
            self._add_busy(r, seconds)
        elif self._span_lane:
            self._span_busy += seconds * self._replica_devices
        m = self.metrics
        if self._busy_replicas == 0:
            if self._flip is not None:
                self._rollout_flipped()
            if m is not None:
                start, end = self._busy_since, m.now()
                m.spans.append(("rollout", "generate", start, end))
                if self._shared:
                    m.busy_device_s["rollout"] += (end - start) * m.devices.get("rollout", 0)
                    m.busy_s["rollout"] += end - start
                    # replicas that had nothing to run while others generated (a batch's tail)
                    idle = (end - start) * m.devices.get("rollout", 0) - self._span_busy
                    m.idle_in_spans["rollout"] += max(0.0, idle)
                    self._span_busy = 0.0
            elif self._span_ctx is not None:
                ctx, self._span_ctx = self._span_ctx, None
                ctx.__exit__(None, None, None)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    """`engine.runner.bucket`: the smallest bucket that holds n (the largest if none does)."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def _integers(x: np.ndarray) -> np.ndarray:
    """`x` rounded to integers (already so if the distribution rounds them)."""
    return x if x.dtype.kind == "i" else np.rint(x).astype(np.int64)


def sample_tasks(w: workloads.Workload, rng: np.random.Generator, n: int) -> list[workloads.TaskSample]:
    """`n` task shapes by `workloads.sample_task`'s rule (same distributions, clipping and `max_context`
    truncation), each distribution drawn once for all `n` tasks, as many turns as each task takes (a
    different random stream than `n` calls of `sample_task`, ~10x cheaper)."""
    max_context = w.max_context
    prompts = np.minimum(np.maximum(_integers(w.prompt_tokens.sample(rng, n)), 1), max_context - 1).tolist()
    turns = np.minimum(np.maximum(_integers(w.turns.sample(rng, n)), 1), w.max_turns).tolist()
    total = sum(turns)  # task i's turns are [first_i, first_i + turns_i) of these draws
    gen = np.maximum(_integers(w.tokens_per_turn.sample(rng, total)), 1).tolist()
    obs = np.maximum(_integers(w.observation_tokens.sample(rng, total)), 0).tolist()
    lat = np.asarray(w.env_latency_s.sample(rng, total), float).tolist()
    out = []
    first = 0
    for i in range(n):
        prompt, T = prompts[i], turns[i]
        g, o = gen[first:first + T], obs[first:first + T - 1]
        if prompt + sum(g) + sum(o) < max_context:  # the context never reaches max_context: no truncation
            out.append(workloads.TaskSample(prompt, tuple(g), tuple(o), tuple(lat[first:first + T - 1]), False))
            first += T
            continue
        context, g, o, la, truncated = prompt, [], [], [], False
        for turn in range(first, first + T):
            tokens = gen[turn]
            if context + tokens >= max_context:
                g.append(max_context - context)
                truncated = True
                break
            g.append(tokens)
            context += tokens
            if turn == first + T - 1:
                break
            observation = obs[turn]
            if context + observation >= max_context:
                truncated = True
                break
            o.append(observation)
            la.append(lat[turn])
            context += observation
        out.append(workloads.TaskSample(prompt, tuple(g), tuple(o), tuple(la), truncated))
        first += T
    return out


def _tokens(trajectories: Sequence[Trajectory]) -> tuple[int, float]:
    """All context tokens of a batch (a forward pass reads them all) and the mean sequence length."""
    total = sum(getattr(t, "context_tokens", 0) or len(t.tokens) for t in trajectories)
    return total, total / max(1, len(trajectories))


def make_controller(sim: SimConfig, controller_config, *, num_devices: int, logdir: str):
    """(controller, backend) for a simulated run; run it with `backend.loop.run_until_complete(controller.run())`."""
    from tiderl_jax.runtime.controller import Controller

    backend = SimBackend.for_controller(sim, controller_config, num_devices)
    controller = Controller(config=controller_config, logdir=logdir, backend=backend, checkpoints=False)
    backend.attach(controller.metrics)
    return controller, backend


@contextlib.contextmanager
def rare_collections(threshold: int = 1_000_000):
    """Python's cyclic garbage collector made rare while a simulation runs (restored after). A run allocates
    millions of short-lived objects (futures, tasks, trajectories) while hundreds of thousands stay alive,
    and the default thresholds (a young collection every 700 allocations, full ones scanning every live
    object) took a third of a 1024-accelerator run. Objects alive before the run are frozen out of the
    collector's generations; cycles are still collected, every `threshold` allocations."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(threshold, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def run(sim: SimConfig, controller_config, *, num_devices: int, logdir: str,
        shape_sampler=None, programs: set | None = None) -> tuple[dict, Any, SimBackend]:
    """Runs the controller on the simulator to its last step: (summary, controller, backend).
    `shape_sampler`: `SimBackend.shape_sampler` (None: the workload's distributions); `programs`:
    `SimBackend.programs` (shared by the runs of one simulated process)."""
    controller, backend = make_controller(sim, controller_config, num_devices=num_devices, logdir=logdir)
    backend.shape_sampler = shape_sampler
    backend.programs = programs
    loop = backend.loop
    try:
        asyncio.set_event_loop(loop)
        with rare_collections():
            summary = loop.run_until_complete(controller.run())
    finally:
        try:  # what the controller left running (e.g. a decoupled ref pass) is cancelled, as asyncio.run does
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            asyncio.set_event_loop(None)
            controller.metrics.close()
            loop.close()
    summary.update(sim=backend.stats(), decode_load=backend.decode_load())
    return summary, controller, backend


