"""`SimBackend`: the controller's `Backend` on cost-modelled devices and a virtual clock.

The real controller (`runtime/controller.py`: staleness capacity, ready buffer, RA2P, ERS) drives
this backend exactly as it drives `JaxBackend`; only the devices are simulated. Every piece of work
takes the seconds `sim/costs.py` gives it on the virtual-time loop (`sim/clock.py`), so a
1024-accelerator run costs only the Python of its events.

`SimBackend` is built from one module per concern, each of whose docstring says what it models:

- `config.py`: `SimConfig` (all parameters, each a documented default) and `SimTrajectory`;
- `kv.py`: the KV / prefix-cache model (`KVModel`: pages, CTB footprints and admission, eviction,
  prefix-cache hits, prefill and program-load costs) and the task / replica state (`_Seq`, `_Replica`);
- `replicas.py`: the replica event core (`ReplicaCore(KVModel)`: the rollout side of the interface,
  placement (`router.py`: `SimRouter`, the router policies' views of the replicas with `SimConfig.router`),
  the event heap, spans of decode events, turn ends, weight updates, busy accounting, and the
  replica set that moves and borrows change). These two are compiled by Cython with the types in kv.pxd
  and replicas.pxd, when built (`tiderl_jax.sim`); run as they are, they are the reference;
- `trainer_costs.py`: train, proximal and reference scoring, host cores shared with the rollout
  (`TrainerCosts`);
- `switches.py`: ERS's device moves and BiDiRL's hot switches (`Switches`);
- this module: `SimBackend(ReplicaCore, TrainerCosts, Switches)`, the controller-facing backend (the
  device pool, task shapes, the load signals ERS reads, stats), and `run` / `make_controller`.

What this module models (all parameters in `SimConfig`):

- **Device pool**: a `runtime.devices.DevicePool` over integer device ids (None in sync mode: every
  device generates and trains, the staleness bound 0 makes them take turns). Moves use
  `DevicePool.moved`, as the real backend does.
- **Environment**: the workload's per-call latency between turns. Task shapes follow
  `workloads.sample_task`'s rule, a GRPO group's samples drawn together (`sample_tasks`) from an rng
  seeded by (`seed`, group), so runs are reproducible.

`run` makes Python's cyclic garbage collector rare while it runs (`rare_collections`).

Ours, not the papers': the admission-by-known-turn-length, least-loaded placement (the default router), the group-prompt
sharing rule, the sliding window of finished tasks for CTB's remaining-turns estimate (the last
`finished_window` tasks, refreshed every `finished_window` finishes, to keep the cost per turn
constant), and every default in `SimConfig` that does not cite a source.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
from typing import Any

import numpy as np

from tiderl_jax.engine.buckets import half_pow2_buckets, pow2_buckets
from tiderl_jax.runtime.pool import DevicePool, lanes_of, split_devices
from tiderl_jax.sim import clock as clock_lib
from tiderl_jax.sim import costs, hardware, workloads
from tiderl_jax.sim.config import SimConfig, SimTrajectory  # noqa: F401 (SimTrajectory: re-exported)
from tiderl_jax.sim.kv import _Replica, _Seq  # noqa: F401 (re-exported: tests build them)
from tiderl_jax.sim.replicas import ReplicaCore
from tiderl_jax.sim.router import SimRouter
from tiderl_jax.sim.switches import Switches
from tiderl_jax.sim.trainer_costs import TrainerCosts


_NO_LIMIT = 1 << 62
SHAPE_BLOCK = 64  # groups whose task shapes are drawn together (`SimBackend._shape`)


class SimBackend(ReplicaCore, TrainerCosts, Switches):
    """Cost-modelled devices behind the controller's `Backend` interface (see the module docstring)."""

    def __init__(self, config: SimConfig, *, mode: str, pool: DevicePool | None, num_devices: int,
                 loop: clock_lib.VirtualTimeLoop | None = None, kv_mode: str | None = None):
        self.cfg = config
        self.mode = mode
        self.pool = pool
        self.num_devices = num_devices
        self.loop = loop or clock_lib.new_event_loop()
        self.workload = workloads.workload(config.workload)
        self.shape = costs.model_shape(self.workload.model)
        self.hw = hardware.accelerator(config.accelerator or self.workload.accelerator)
        self.eff = config.efficiency
        # "ctb" | "request": the controller's (`ControllerConfig.kv_mode`: tiderl with CTB off is request-level)
        self.kv_mode = kv_mode or ("ctb" if mode == "tiderl" else "request")
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
        # SimConfig.router: the router that places every task and continuation (router.py); None: sticky
        self._routing = config.router != "sticky"
        self.router = SimRouter(self, config.router, config.router_config) if self._routing else None
        self._switch_out_s = 0.0

    @classmethod
    def for_controller(cls, config: SimConfig, controller_config, num_devices: int) -> "SimBackend":
        """The backend for a `ControllerConfig`: its mode and device groups over `num_devices` ids."""
        c = controller_config
        pool = split_devices(range(num_devices), mode=c.mode, group_size=c.device_group_size,
                             rollout=c.rollout_groups, ref=c.ref_groups, train=c.train_groups, tensor=c.tensor)
        return cls(config, mode=c.mode, pool=pool, num_devices=num_devices, kv_mode=c.kv_mode)

    def attach(self, metrics) -> None:
        """Exact busy accounting per replica into the controller's `RunMetrics` (replicas.py's docstring)."""
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

    def _shape(self, group: int, sample: int, group_size: int) -> workloads.TaskSample:
        """Sample `sample` of `group`. The workload's shapes are drawn (`sample_tasks`) for `SHAPE_BLOCK`
        groups at once, from an rng seeded by (seed, block): a group's shapes depend on the seed and its
        id only, so a run is reproducible whatever order samples start in (and one draw serves many
        groups: ~3x cheaper). `shape_sampler`'s, and a mixed workload's, are drawn per group, from an rng seeded by
        (seed, group)."""
        entry = self._groups.get(group)
        if entry is None or sample >= len(entry[0]):
            n = max(group_size, sample + 1)
            if self.shape_sampler is not None or n > group_size or self.workload.parts:  # (mixed: a class per group)
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

    def compile_s(self) -> float:
        """Seconds of calls that loaded a program so far, as `JaxBackend.compile_s` counts its engine's and
        trainer's (measured costs' `program_s`: the load, an engine call's own run being milliseconds here; the
        trainer's and scorer's `*_program_s`: the load and the run of that first call); 0 without them."""
        return self._compiled_s

    def train_scaling(self) -> float:
        """The speed one more device group adds to the trainer, as a fraction of linear (ERS's economics), as the
        cost model has it: 1 for the roofline (`costs.train_step_time` divides by the devices), 0 with measured
        costs (fake devices on one host's cores, `MeasuredCosts`: nothing scales with the device count). A real
        backend measures it on its first move; one step's per-token time is a noisy probe when the batches'
        lengths drift."""
        return 0.0 if self.measured is not None else 1.0

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

    def arrays(self) -> dict[str, Any] | None:
        return None

    def restore_arrays(self, arrays, *, step: int, version: int) -> None:
        self.version = version

    def load_policy(self, params, version: int) -> None:
        del params, version

    def stats(self) -> dict:
        self.counters.update(events=self._events, decode_tokens=self._decode_tokens, prompt_tokens=self._prompt_tokens,
                             prompt_tokens_cached=self._prompt_tokens_cached, prefill_tokens=self._prefill_tokens)
        out = dict(self.counters, replicas=len(self.replicas), kv_pages_per_replica=self.capacity,
                   kv_hit_rate=self.kv_hit_rate())
        if self.router is not None:
            out["router"] = dict(self.router.counters, policy=self.router.policy)
        return out

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


def _integers(x: np.ndarray) -> np.ndarray:
    """`x` rounded to integers (already so if the distribution rounds them)."""
    return x if x.dtype.kind == "i" else np.rint(x).astype(np.int64)


def sample_tasks(w: workloads.Workload, rng: np.random.Generator, n: int) -> list[workloads.TaskSample]:
    """`n` task shapes by `workloads.sample_task`'s rule (same distributions, clipping and `max_context`
    truncation), each distribution drawn once for all `n` tasks, as many turns as each task takes (a
    different random stream than `n` calls of `sample_task`, ~10x cheaper). A mixed workload draws all `n` from
    one of its parts (`Workload.part`): they are one prompt's GRPO group, of one class."""
    w = w.part(rng)
    cls = w.task_class
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
            out.append(workloads.TaskSample(prompt, tuple(g), tuple(o), tuple(lat[first:first + T - 1]), False, cls))
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
        out.append(workloads.TaskSample(prompt, tuple(g), tuple(o), tuple(la), truncated, cls))
        first += T
    return out


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
        shape_sampler=None, programs: set | None = None, on_step=None) -> tuple[dict, Any, SimBackend]:
    """Runs the controller on the simulator to its last step: (summary, controller, backend).
    `shape_sampler`: `SimBackend.shape_sampler` (None: the workload's distributions); `programs`:
    `SimBackend.programs` (shared by the runs of one simulated process); `on_step`: `Controller.run`'s."""
    controller, backend = make_controller(sim, controller_config, num_devices=num_devices, logdir=logdir)
    backend.shape_sampler = shape_sampler
    backend.programs = programs
    loop = backend.loop
    try:
        asyncio.set_event_loop(loop)
        with rare_collections():
            summary = loop.run_until_complete(controller.run(on_step=on_step))
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
