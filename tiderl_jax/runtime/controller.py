"""The controller: one loop for the `sync`, `async` and `tiderl` modes (docs/architecture.md; docs/mechanisms.md).

```
producer (asyncio):  capacity = staleness.capacity(...)  -> admit GRPO groups -> RolloutRunner
                     finished group -> fresh samples -> ready buffer   (RA2P decoupled: ref scores it
                                                                        now, on the ref devices)
trainer loop:        wait for a batch of groups (trainer waiting) -> RA2P choice (logged with both
                     costs) -> score + train (Trainer.rl_step, in a worker thread) -> version + 1
                     -> ERS move at the step boundary (tiderl) -> weight sync to the rollout mesh
```

The modes are settings of this one loop, not code paths:
- `sync` (veRL-like): one mesh of all devices for generation and training, staleness bound 0 (the
  capacity rule admits exactly one batch per version, so rollout and training take turns), the
  request-level rollout of a stock engine, reference scored with the actor (colocated).
- `async` (AReaL-like): disjoint rollout / ref / train device groups, staleness bound `eta` >= 1,
  decoupled PPO on behaviour log-probs, request-level rollout, no ERS.
- `tiderl`: as async, plus CTB (task-level KV admission, KV kept across tool calls), RA2P (the ref
  pass decoupled on its own devices as groups arrive, or colocated on the train devices once per
  step, by `policies.ra2p` on measured costs) and ERS (one device group moves between rollout and
  train at a step boundary, by `policies.ers`).
- `bidirl` (an option of async and tiderl; BiDiRL, `policies.bidirl`): within a step, the pool that
  waits lends its idle devices to the other, only if `bidirl.decide_borrow` predicts a gain above
  switch-in + switch-out (+ the gradient merge when the trainer borrows). While the trainer waits for
  data, the rollout may borrow the train devices (returned, switch-out paid, when the batch is
  ready); while the producer is blocked by the staleness bound, the trainer may borrow the rollout
  devices that have no task, for one train step. It needs a backend that hot-switches devices
  (`lend` / `take_back`): the simulator's, or `JaxBackend` with `rollout_replicas="group"` (a lent
  train group serves as a temporary rollout replica; the trainer's state moves onto a mesh over its
  own and the lent replicas' devices: `runtime/hot_switch.py`). Switch costs are the backend's
  measured ones (estimated from bytes before the first switch); the gain model's `scaling` is
  re-measured after each rollout borrow from the sample arrival rate during it versus before it.

Everything the decisions read is measured here: step times, per-micro-batch actor and ref times,
ready-at-start counts, arrival gaps, trainer idle time, head-of-line latency.

Checkpoints (orbax, `rl/checkpoint.py`) hold the parameters, optimizer state, reference and value
parameters, and a JSON meta with the step, policy version, data cursor, the ready buffer's
trajectories and the in-flight tasks; a resumed run re-queues the ready groups and re-runs the
in-flight tasks (with the same task, group and sample seeds), so no sampled work is lost.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from tiderl_jax import distributed
from tiderl_jax.agents import tasks as task_lib
from tiderl_jax.agents.env import LatencyModel, Task
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.model.config import ConfigError
from tiderl_jax.policies import dynamic_sampling, ers, ra2p, staleness
from tiderl_jax.runtime import health
from tiderl_jax.runtime.borrowing import Borrowing
from tiderl_jax.runtime.boundaries import Boundaries
from tiderl_jax.runtime.controller_config import MODES, ControllerConfig  # noqa: F401 (re-exported)
from tiderl_jax.runtime.group import Group
from tiderl_jax.runtime.metrics import RunMetrics
from tiderl_jax.runtime.multihost import Multihost, local_config, process_devices
from tiderl_jax.runtime.pool import Backend, DevicePool, split_devices

if TYPE_CHECKING:  # the JAX side is imported only when a JaxBackend is built (the simulator needs none)
    from tiderl_jax.agents.rollout import RolloutConfig
    from tiderl_jax.engine.engine import EngineConfig
    from tiderl_jax.model.decoder import Decoder
    from tiderl_jax.model.tokenizer import Tokenizer
    from tiderl_jax.rl.trainer_config import TrainerConfig

log = logging.getLogger(__name__)

# groups in a row whose every sample raised (or had a prompt that cannot fit: `prompt_too_long`) before
# the producer gives up
FAILED_GROUPS_LIMIT = 8
# weight syncs in a row that failed before the run stops (sooner when the staleness bound is lower:
# a rollout more than eta versions behind makes only samples that are dropped as stale)
SYNC_FAILURES_LIMIT = 3


class Controller(Boundaries, Borrowing, Multihost):
    """One RL loop for the three modes. Give it a model and tokenizer (it builds the `JaxBackend`:
    engine, trainer and reference scorer on device meshes), or any `backend` (e.g. the simulator's)."""

    def __init__(self, model: Decoder | None = None, tokenizer: Tokenizer | None = None, *,
                 config: ControllerConfig, engine_config: EngineConfig | None = None,
                 rollout_config: RolloutConfig | None = None, trainer_config: TrainerConfig | None = None,
                 latency: LatencyModel = LatencyModel(), logdir: str, rules=None,
                 make_env: Callable[[Task], object] | None = None, devices: Sequence | None = None,
                 backend: Backend | None = None, checkpoints: bool = True,
                 task_source: Callable[[int], Task] | None = None):
        # across processes (runtime/multihost.py): `run_cfg` is the run's config, `cfg` this process's share of it
        self.cluster = distributed.cluster()
        self.run_cfg = config
        self.cfg = config = local_config(config, self.cluster.count)
        self._task_source = task_source  # train task by index (a dataset's, data/datasets.py); None: built-in kinds
        self.latency = latency
        self._make_env = make_env or task_lib.TaskEnvFactory(latency)
        if config.env_workers:
            from tiderl_jax.faults.env_recovery import CheckpointConfig, EnvPool
            checkpoint = CheckpointConfig(mode=config.env_checkpoint, p_fail=config.env_p_fail,
                                          max_retries=config.env_max_retries,
                                          step_timeout_s=config.env_step_timeout_s)
            self._make_env = EnvPool(self._make_env, checkpoint)  # processes reused across tasks
        if backend is None:
            if config.bidirl and config.rollout_replicas != "group":
                raise ConfigError("controller.bidirl on the JAX backend lends whole rollout replicas: set "
                                  "controller.rollout_replicas='group' (one engine replica per device group)")
            if model is None or tokenizer is None or None in (engine_config, rollout_config, trainer_config):
                raise ConfigError("Controller needs a backend, or a model, a tokenizer and the engine, "
                                  "rollout and trainer configs to build one")
            import jax

            from tiderl_jax.model.sharding import DEFAULT_RULES
            from tiderl_jax.runtime.backend import JaxBackend
            devices = list(devices or (jax.local_devices() if self.cluster.multi else jax.devices()))
            pool = split_devices(devices, mode=config.mode, group_size=config.device_group_size,
                                 rollout=config.rollout_groups, ref=config.ref_groups,
                                 train=config.train_groups, tensor=config.tensor,
                                 hosts=process_devices() if self.cluster.multi else None)
            backend = JaxBackend(model, tokenizer, kv_mode=config.kv_mode, pool=pool, engine_config=engine_config,
                                 rollout_config=rollout_config, trainer_config=trainer_config,
                                 rules=rules or DEFAULT_RULES,
                                 devices=devices, tensor=config.tensor, replicas=config.rollout_replicas,
                                 router=config.router, router_config=config.router_config(),
                                 replica_devices=config.device_group_size,
                                 engine_workers=config.engine_workers and dict(
                                     warmup=config.engine_worker_warmup,
                                     health_threshold=config.engine_worker_health_checks))
        if config.bidirl and not hasattr(backend, "lend"):
            raise ConfigError(f"controller.bidirl needs a backend that hot-switches devices between roles "
                              f"(lend / take_back: sim.backend.SimBackend, runtime.backend.JaxBackend); "
                              f"{type(backend).__name__} cannot")
        why = backend.cannot_lend() if config.bidirl and hasattr(backend, "cannot_lend") else None
        if why:
            raise ConfigError(f"controller.bidirl: {why}")
        self.backend = backend
        self.clock = backend.clock
        self.metrics = RunMetrics(logdir, total_steps=config.steps, devices=backend.lanes(), clock=self.clock,
                                  shared=("rollout", "train") if backend.pool is None else (),
                                  write=self.cluster.primary)
        self.checkpointer = None
        if checkpoints:
            from tiderl_jax.rl.checkpoint import Checkpointer  # orbax + JAX: only runs that save need it
            self.checkpointer = Checkpointer(f"{logdir}/checkpoints", keep=2)
        self.logdir = logdir
        # run state
        self.version = 0
        self.step = 0
        self.cursor = 0  # next train task index
        self.running = 0  # samples in flight
        self.accepted = 0  # fresh samples accepted into the ready buffer
        self._produced = self._produced_mark = 0  # samples that reached the ready buffer (ERS: per step)
        self.syncs_failed = 0
        self._syncs_failed_in_row = 0  # past SYNC_FAILURES_LIMIT the run stops with the last sync's error
        self._sync_error = ""
        # every admitted sample ends once: completed (then trained, or still ready at the end) or
        # dropped with its reason (`dropped:<reason>`); `dropped:stale` ones were completed first
        self.ledger: collections.Counter = collections.Counter()
        self.consumed: list[list[int]] = []  # [group, sample] of every trained sample, in order
        self.taking: list[Group] = []  # the groups of the update being assembled or trained (a checkpoint keeps them)
        self.ready: collections.deque[Group] = collections.deque()
        self.in_flight: dict[int, Group] = {}
        self.resume_groups: list[Group] = []  # in-flight groups of a checkpoint, to complete
        self._sample_tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self.ra2p_mode = ra2p.COLOCATED
        self.ers_history = ers.ERSHistory()
        self.moves: list[dict] = []
        self.ers_refused = 0  # boundaries where a deficit wanted a move that did not happen
        self.ers_refusals = collections.Counter()  # and why, by kind (ers.REFUSALS)
        self._timings = dict(t_act=None, t_ref_col=None, t_ref_dec=None, tprm=None, train_busy=0.0)
        self._rollout_busy_mark = 0.0  # the rollout lane's busy seconds at the last step boundary
        self._ref_busy_mark = 0.0  # and the ref lane's
        self.ers_scaling = config.ers_scaling  # measured after the first move that changes the trainer
        self._scaling_probe: dict | None = None  # the trainer's speed before a move, to measure it
        self._move_cost: float | None = None  # measured seconds of the last move (incl. recompiles)
        self._measured_move_costs: dict[tuple[str, str], float] = {}  # (from, to) -> the last such move's seconds
        self._last_move: tuple[int, str | None] = (-1, None)  # (step, to role) of the last ERS or RA2P move
        self.ra2p_history = ra2p.RepartitionHistory()  # RA2P's wanted move of devices, boundaries in a row
        self._stop = False
        # groups in a row whose every sample raised (a broken rollout side) or had a prompt too long for
        # the context: past FAILED_GROUPS_LIMIT the producer stops with the last error instead of
        # admitting (and failing) more forever
        self._failed_groups = 0
        self._last_error = ""
        self._uninformative_in_row = 0  # complete groups in a row that dynamic sampling dropped (filter_groups)
        self._no_signal = ""  # past filter_groups_limit of them: why the run stops
        self._filtered = collections.Counter()  # complete and dropped groups since the last step (filter_groups)
        # a sample's error that no later sample can escape (one marked `fatal`: `rollout.EngineFailed`,
        # the engine's step raised): the producer stops admitting and the trainer raises it at once
        self._fatal = ""
        # BiDiRL
        self.borrows: list[dict] = []  # every borrow: step, borrower, devices, predicted gain / cost, seconds
        self.borrows_refused = 0
        self.bidirl_scaling = config.bidirl_scaling
        self._arrivals: collections.deque = collections.deque(maxlen=64)  # (time, samples) of ready groups
        self._producer_blocked = False  # the staleness bound stops admission until the next version
        self._held_by_staleness_s = 0.0  # seconds the staleness bound (not max_concurrent) held admission
        self._held_mark = 0.0  # its value at the last step boundary
        self._held_since: float | None = None  # when the hold in progress began
        self.ers_economics: ers.MoveEconomics | None = None  # what ERS weighed at the last boundary
        self.health = health.Monitor()  # per-update training health; warns when the run is not learning
        self._ledger_total = None  # every process's ledger summed, at the end of `run`

    @property
    def discarded(self) -> int:
        """Over-stale samples dropped (the ledger's count)."""
        return self.ledger["dropped:stale"]

    # the JAX backend's parts (launch scripts, tests and benchmarks reach them through the controller)
    @property
    def pool(self) -> DevicePool | None:
        return self.backend.pool

    @property
    def engine(self):
        return self.backend.engine

    @property
    def trainer(self):
        return self.backend.trainer

    # ------------------------------------------------------------------ the producer

    def _next_task(self) -> Task:
        """The next train task (its index is the group id: one GRPO group per task)."""
        kinds = self.cfg.task_kinds
        i = self._task_index(self.cursor)  # one process: the cursor itself
        self.cursor += 1
        if self._task_source is not None:
            return self._task_source(i)
        return task_lib.make_task(kinds[i % len(kinds)], i // len(kinds), "train", self.cfg.data_seed)

    async def _produce(self):
        G = self.cfg.group_size
        while not self._stop and not self._fatal and not self._no_signal:
            if self._failed_groups >= FAILED_GROUPS_LIMIT:
                raise RuntimeError(f"every sample of the last {self._failed_groups} groups failed (last: "
                                   f"{self._last_error}); the rollout side is broken, so no more tasks are admitted")
            cap = staleness.capacity(self.cfg.max_concurrent, self.running, self.cfg.staleness.eta,
                                     self.version, self.cfg.batch_samples, self.accepted)
            if cap < G:
                self._producer_blocked = True
                # held by the staleness bound's term of the capacity (not by max_concurrent): ERS's coupling
                if staleness.staleness_room(self.running, self.cfg.staleness.eta, self.version,
                                            self.cfg.batch_samples, self.accepted) < G:
                    self._held_since = self.clock()
                self._wake.clear()
                await self._wake.wait()
                self._producer_blocked = False
                if self._held_since is not None:
                    self._held_by_staleness_s += self.clock() - self._held_since
                    self._held_since = None
                continue
            if self.resume_groups:
                group = self.resume_groups.pop(0)
            else:
                group = Group(self._task_index(self.cursor), self._next_task())
            self.in_flight[group.gid] = group
            ended = {t.info.get("sample") for t in group.trajectories} | set(group.dropped)
            missing = [i for i in range(G) if i not in ended]
            group.launched, group.finished, group.errors = len(missing), 0, 0
            self.running += len(missing)
            self.ledger["admitted"] += len(missing)
            if hasattr(self.backend, "generate_group"):  # one job per group (the simulator's)
                jobs = [asyncio.create_task(self._one_group(group, missing))]
            else:
                jobs = [asyncio.create_task(self._one_sample(group, i)) for i in missing]
            for job in jobs:
                self._sample_tasks.add(job)
                job.add_done_callback(self._sample_tasks.discard)

    async def _one_sample(self, group: Group, sample: int):
        """Generates one sample of a group; the group goes to the ready buffer when its last one ends.
        A sample ends exactly once: completed, or dropped with its reason (a failed task, whose
        failure the rollout already retried where that is the right thing, or an error here)."""
        try:
            traj = await self.backend.generate(group.task, group.gid, sample, self.cfg.group_size)
        except Exception as e:  # noqa: BLE001 - one sample's error must not stop the run
            traj = e
        self._sample_done(group, sample, traj)

    async def _one_group(self, group: Group, samples: list[int]):
        """`_one_sample` for a backend that generates a group's samples in one call (`generate_group`)."""
        try:
            results = await self.backend.generate_group(group.task, group.gid, samples, self.cfg.group_size)
        except Exception as e:  # noqa: BLE001
            results = [e] * len(samples)
        for sample, traj in zip(samples, results):
            self._sample_done(group, sample, traj)

    def _sample_done(self, group: Group, sample: int, traj) -> None:
        """One sample ended (a trajectory, or the exception that ended it). An exception marked `fatal`
        (the rollout engine is broken) ends the run: the trainer is woken to raise it. A prompt too
        long for the context (`prompt_too_long`) counts as an error toward FAILED_GROUPS_LIMIT: one
        such task is dropped, a configuration where none fits stops the run with the reason."""
        if isinstance(traj, Exception):
            log.warning("sample %d of group %d failed: %s: %s", sample, group.gid, type(traj).__name__, traj)
            self._last_error = f"{type(traj).__name__}: {traj}"
            group.errors += 1
            if getattr(traj, "fatal", False) and not self._fatal:
                self._fatal = self._last_error
                self._wake.set()
            traj, reason = None, f"error:{type(traj).__name__}"
        else:
            reason = traj.end_reason if traj.failure else None
            if reason == "prompt_too_long":
                self._last_error = f"prompt_too_long: {traj.failure}"
                group.errors += 1
        group.finished += 1
        if reason is None:
            group.trajectories.append(traj)
            self.ledger["completed"] += 1
        else:
            group.dropped.append(sample)
            self.ledger[f"dropped:{reason}"] += 1
        if group.finished < group.launched:
            return
        group.trajectories.sort(key=lambda t: t.info["sample"])
        failed = group.launched > 0 and group.errors == group.launched
        self._failed_groups = self._failed_groups + 1 if failed else 0
        self.running -= group.launched
        del self.in_flight[group.gid]
        self._drop_stale(group)
        self._drop_uninformative(group)
        group.arrived = self.clock()
        if group.trajectories:
            self._arrivals.append((group.arrived, len(group.trajectories)))
            self.accepted += len(group.trajectories)
            self._produced += len(group.trajectories)
            if self.backend.has_ref_devices and self.ra2p_mode == ra2p.DECOUPLED:
                group.ref_job = asyncio.ensure_future(self._score_ref(group))
            self.ready.append(group)
        self._wake.set()

    def unfinished(self) -> int:
        """Admitted samples that have not ended yet (running, or cut off by a stop)."""
        return sum(g.launched - g.finished for g in self.in_flight.values())

    def _check_run(self) -> None:
        """Raises what must end the run (the trainer would otherwise wait for data forever, or train
        on while nothing reaches the rollout): the rollout engine failed; weight syncs failed
        SYNC_FAILURES_LIMIT times in a row, or more than eta times (the rollout, more than eta
        versions behind, would make only samples dropped as stale, and with no step no sync is
        tried again); or the producer died (e.g. FAILED_GROUPS_LIMIT). The error is named."""
        if self._fatal:
            raise RuntimeError(f"the rollout failed and cannot go on ({self._fatal}); the run stops")
        if self._no_signal:
            raise RuntimeError(self._no_signal)
        failed, eta = self._syncs_failed_in_row, self.cfg.staleness.eta
        if failed >= min(SYNC_FAILURES_LIMIT, eta + 1):
            raise RuntimeError(f"{failed} weight syncs in a row failed (the last, {self._sync_error}); the "
                               f"rollout is stuck on weights {failed} versions old (staleness bound eta={eta}), "
                               "so the run stops")
        producer = getattr(self, "_producer", None)
        if producer is not None and producer.done() and not producer.cancelled() and producer.exception():
            raise RuntimeError(f"the rollout producer failed ({producer.exception()}); no more data will "
                               "arrive") from producer.exception()

    def _drop_stale(self, group: Group) -> int:
        """Drops the group's samples whose oldest token is more than eta versions behind now;
        returns how many."""
        eta, version = self.cfg.staleness.eta, self.version
        oldest = [t.oldest_version() for t in group.trajectories]
        if staleness.is_fresh([v for v in oldest if v >= 0], version, eta):  # its oldest sample is fresh: all are
            return 0
        fresh = [t for t, v in zip(group.trajectories, oldest) if v < 0 or staleness.is_fresh(v, version, eta)]
        dropped = len(group.trajectories) - len(fresh)
        self.ledger["dropped:stale"] += dropped
        group.trajectories = fresh
        if dropped:
            self._wake.set()  # capacity freed: the producer replaces them
        return dropped

    def _drop_uninformative(self, group: Group) -> None:
        """Dynamic sampling (DAPO; `filter_groups`): a complete group whose rewards are all equal (or that has fewer
        than two samples left) has no advantage to train on: it is dropped (`dropped:zero_variance`) and the capacity
        it held is freed, so the producer samples another. Past `filter_groups_limit` such groups in a row the run
        stops with the reason (tasks all too hard or all too easy for this policy) instead of sampling forever."""
        if not self.cfg.filter_groups or not group.trajectories:
            return
        rewards = [t.reward for t in group.trajectories]
        self._filtered["complete"] += 1
        self._filtered["samples"] += len(rewards)
        self._filtered["reward_sum"] += sum(rewards)
        if dynamic_sampling.informative(rewards):
            self._uninformative_in_row = 0
            return
        self._filtered["dropped"] += 1
        self.ledger["dropped:zero_variance"] += len(group.trajectories)
        self._uninformative_in_row += 1
        if dynamic_sampling.exhausted(self._uninformative_in_row, self.cfg.filter_groups_limit) and not self._no_signal:
            self._no_signal = (f"dynamic sampling dropped the last {self._uninformative_in_row} groups: each had one reward "
                               f"for all its samples (the last: {group.trajectories[0].reward}), so there is nothing to "
                               "learn from; the tasks are too hard or too easy for this policy "
                               "(--config.controller.filter_groups=false trains on them anyway); the run stops")
            self._wake.set()
        group.trajectories = []

    async def _score_ref(self, group: Group):
        with self.metrics.span("ref", "score"):
            t0 = self.clock()
            scores, compiled = await self.backend.score_ref(group.trajectories)
            if not compiled:
                self._timings["t_ref_dec"] = self.clock() - t0
        for t, s in zip(group.trajectories, scores):
            if s is not None:
                t.info["ref_logp"] = s

    # ------------------------------------------------------------------ the trainer loop

    async def _take_batch(self):
        """Waits for `groups_per_step` ready groups; returns them with the measured signals. Raises
        (`_check_run`) before the step and while waiting when the run cannot go on. Across processes: this
        process's share, then every process's groups in one exchange (`Multihost._exchange_batch`)."""
        try:
            batch, waited, ras, hol = await self._take_local_batch()
        except BaseException as e:
            self._failed_here(f"step {self.step + 1} batch", e)
            raise
        if self.cluster.multi:
            batch, waited, ras, hol = await self._exchange_batch(batch, waited, ras, hol)
        return batch, waited, ras, hol

    async def _take_local_batch(self):
        self._check_run()
        t0 = self.clock()
        ras = min(len(self.ready), self.cfg.groups_per_step)
        hol = t0 - self.ready[0].arrived if self.ready else 0.0
        arrivals, batch = [], self.taking
        if len(self.ready) > 1:  # the groups closest to the staleness bound go first
            versions = [min((t.oldest_version() for t in g.trajectories), default=-1) for g in self.ready]
            self.ready = collections.deque(self.ready[i] for i in staleness.consumption_order(versions))
        with self.metrics.data_wait():
            lent = await self._rollout_borrow(batch) if self.cfg.bidirl else None
            try:
                while len(batch) < self.cfg.groups_per_step:
                    while not self.ready:
                        self._check_run()
                        self._wake.clear()
                        await self._wake.wait()
                        arrivals.append(self.clock())
                    group = self.ready.popleft()
                    # it may have aged in the buffer since it arrived; what is dropped now is replaced
                    self.accepted -= self._drop_stale(group)
                    if group.trajectories:
                        batch.append(group)
            finally:  # the trainer's devices come back even when the run stops while waiting
                if lent is not None:
                    await self._return_borrowed(lent)
        waited = self.clock() - t0
        gaps = np.diff([t0] + arrivals) if arrivals else []
        if len(gaps):
            self._timings["tprm"] = float(np.mean(gaps))
        self._wake.set()  # capacity may have freed up
        return batch, waited, ras, hol

    def _count_step(self, trajs) -> None:
        self.step += 1
        self.taking, self.consumed = [], self.consumed + [[t.group, t.info.get("sample")] for t in trajs]

    async def _train_step(self, batch: list[Group]):
        # in task order: an update is the same whatever order its groups arrived in, on one process or several
        trajs = [t for g in sorted(batch, key=lambda g: g.gid) for t in g.trajectories]
        if any(g.ref_job is not None for g in batch):  # the trainer waits (idle) for decoupled ref scores
            await asyncio.gather(*(g.ref_job for g in batch if g.ref_job is not None))
        lent = await self._train_borrow() if self.cfg.bidirl else None
        try:
            with self.metrics.span("train", "train"):
                t0 = self.clock()
                out = await self.backend.train(trajs)
                dt = self.clock() - t0
        finally:  # the lent rollout devices come back even when the step raised
            if lent is not None:
                await self._return_borrowed(lent)
        if lent is None:
            self._timings["train_own"] = dt - out.get("compile_s", 0.0)  # BiDiRL's prediction of a train step
        # steady-state times per micro-batch (one group each), compiles left out: RA2P's signals
        compile_s = out.pop("compile_s", 0.0)
        m = len(batch)
        self._timings["train_busy"] = max(0.0, dt - compile_s)
        # the actor's part (the ref pass, when it ran here, is off the train devices in the other RA2P mode)
        self._timings["actor_busy"] = max(0.0, dt - compile_s - out.get("time_ref_s", 0.0))
        if compile_s == 0.0 and "time_update_s" in out:
            self._timings["t_act"] = (out["time_proximal_s"] + out["time_update_s"]) / m
            if out["time_ref_s"] > 0:  # the ref ran here (colocated)
                self._timings["t_ref_col"] = out["time_ref_s"] / m
        return out, trajs

    async def _publish(self, version: int):
        """Sends the new weights to the rollout. A failed sync leaves the rollout on its previous
        weights and the run goes on; failures in a row past the limit (`_check_run`; a success
        resets the count) stop it at the next step with the last sync's error (the backend's
        `last_sync_error`)."""
        with self.metrics.span("train", "sync"):
            ok = await self.backend.publish(version)
        if ok:
            self._syncs_failed_in_row = 0
            return
        self.syncs_failed += 1
        self._syncs_failed_in_row += 1
        error = getattr(self.backend, "last_sync_error", None) or "the backend recorded no error"
        self._sync_error = f"to version {version}: {error}"
        log.warning("weight sync to version %d failed (%s); the rollout keeps its previous weights (%d in a row)",
                    version, error, self._syncs_failed_in_row)

    def load_policy(self, params) -> None:
        """Starts from these weights (the warm start): the actor, the reference model and the
        rollout engine all take them (version 0)."""
        self.backend.load_policy(params, self.version)

    # ------------------------------------------------------------------ checkpoints

    def save(self, wait: bool = False) -> None:
        if self.checkpointer is None:
            return
        self.checkpointer.save(self.step, self.backend.arrays(), self._global_meta(self.checkpoint_meta()))
        if wait:
            self.checkpointer.wait()

    def checkpoint_meta(self) -> dict:
        """What a checkpoint keeps beside the arrays: the step, version, data cursor, trained samples, the ready
        buffer and the groups in flight, and the ledger."""
        return dict(step=self.step, version=self.version, cursor=self.cursor, consumed=self.consumed,
                    # the update being assembled when the run stopped goes back to the front of the buffer, and
                    # groups a resume has not admitted again yet stay in flight: no finished sample is lost
                    ready=[dict(gid=g.gid, task=dataclasses.asdict(g.task),
                                trajectories=[t.to_dict() for t in g.trajectories]) for g in [*self.taking, *self.ready]],
                    in_flight=[dict(gid=g.gid, task=dataclasses.asdict(g.task), dropped=list(g.dropped),
                                    trajectories=[t.to_dict() for t in g.trajectories])
                               for g in [*self.in_flight.values(), *self.resume_groups]],
                    # samples still running are admitted again on resume: the ledger forgets them
                    ledger=dict(self.ledger, admitted=self.ledger["admitted"] - self.unfinished()))

    def restore(self) -> bool:
        """Resumes from the latest checkpoint in the log directory; False if there is none."""
        if self.checkpointer is None or self.checkpointer.latest_step() is None:
            return False
        arrays, meta = self.checkpointer.restore(self.backend.arrays())
        meta = self._local_meta(meta)  # this process's cursor, buffer and ledger (all of it on one process)
        self.step, self.version, self.cursor = meta["step"], meta["version"], meta["cursor"]
        self.backend.restore_arrays(arrays, step=self.step, version=self.version)
        for g in meta["ready"]:
            group = Group(g["gid"], Task(**g["task"]), [Trajectory.from_dict(t) for t in g["trajectories"]],
                           arrived=self.clock())
            self.ready.append(group)
            self.accepted += len(group.trajectories)
        self.accepted += self.version * self.cfg.batch_samples  # consumed before the checkpoint
        self.resume_groups = [Group(g["gid"], Task(**g["task"]),
                                     [Trajectory.from_dict(t) for t in g["trajectories"]],
                                     dropped=list(g.get("dropped", [])))
                              for g in meta["in_flight"]]
        self.ledger = collections.Counter(meta.get("ledger", {}))
        self.consumed = [list(x) for x in meta.get("consumed", [])]
        log.info("resumed at step %d (version %d): %d ready groups, %d in-flight groups to complete",
                 self.step, self.version, len(self.ready), len(self.resume_groups))
        return True

    # ------------------------------------------------------------------ the loop

    async def run(self, on_step: Callable[[int], dict | None] | None = None) -> dict:
        """Runs `config.steps` updates; returns `summary()`. `on_step(step)` (or a coroutine function), after
        each publish, may return scalars logged as `eval_<name>` (`JaxBackend.run_tasks`, `health.eval_stats`)."""
        if hasattr(self._make_env, "prestart"):  # environment processes, started before any task needs one
            self._make_env.prestart(self.cfg.max_concurrent)
        if self.metrics.steps == 0:
            self.metrics.begin()
        await self.backend.start(self._make_env, lambda t: self.latency,
                                 lambda: self.metrics.span("rollout", "generate"))
        producer = self._producer = asyncio.create_task(self._produce())
        producer.add_done_callback(lambda _: self._wake.set())  # a producer that died wakes the trainer
        last = self.clock()
        completed = False
        try:
            while self.step < self.cfg.steps:
                ras0 = len(self.ready)
                if self.cluster.multi and self.cfg.mode == "tiderl" and self.backend.has_ref_devices:
                    ras0 = (await self._gathered_counts_async("ready at start", ras=ras0))["ras"]
                decision = await self._decided("RA2P mode", lambda: self._ra2p_decision(ras0))
                if decision is not None:
                    self.ra2p_mode = decision.mode
                batch, waited, ras, hol = await self._take_batch()
                train = asyncio.ensure_future(self._train_step(batch))
                interrupted = False
                try:
                    out, trajs = await asyncio.shield(train)
                except asyncio.CancelledError:
                    # interrupted while the update runs in its thread, which owns the donated weights until it
                    # returns (a thread cannot be stopped): on one process the step then runs to its end (publish,
                    # its evaluation, its metrics row) and the save that follows holds it; a second interrupt
                    # stops at once. Across processes an interrupt saves nothing new: stop when the thread returns
                    out, trajs = await train
                    if self.cluster.multi:
                        raise
                    interrupted = True
                self._count_step(trajs)
                now = self.clock()
                step_time, last = now - last, now
                counts = await self._gathered_counts_async(  # every process's (process 0 decides and logs from them)
                    f"step {self.step} counts", ready_volume=sum(len(g.trajectories) for g in self.ready),
                    ready_groups=len(self.ready), running=self.running, discarded=self.discarded)
                await self._ers_boundary(waited, step_time, ras, hol, int(out.get("tokens", 0)), counts["ready_volume"])
                await self._ra2p_boundary(ras, step_time, int(out.get("tokens", 0)))
                t_sync = self.clock()
                await self._publish(self.version + 1)
                t_sync = self.clock() - t_sync
                self.version += 1  # only now: the producer admits the next batch on the new weights
                self._wake.set()
                lags = health.version_lags(trajs, self.version - 1)
                stats = self.health.update(self.step, trajs, out, lags)  # warns when the run is not learning
                if self.cfg.filter_groups:  # the share of the groups completed since the last step that were dropped,
                    # and the mean reward of every sample in them (`reward` is the trained, informative groups' alone)
                    stats["zero_variance_dropped"] = self._filtered["dropped"] / max(self._filtered["complete"], 1)
                    if self._filtered["samples"]:
                        stats["sampled_reward"] = self._filtered["reward_sum"] / self._filtered["samples"]
                    self._filtered.clear()
                self.metrics.consume(int(out.get("tokens", 0)), len(trajs), lags,
                                     stats.get("sampled_reward", stats["reward"]))
                evals = await self.metrics.run_hook(on_step, self.step)  # e.g. a held-out evaluation, whose
                last += self.metrics.phases[-1][2] - self.metrics.phases[-1][1] if evals else 0.0  # time ERS ignores
                self.metrics.log_step(self.step, dict(
                    out, **stats, **evals, version=self.version, ready_groups=counts["ready_groups"],
                    trainer_wait_s=waited, ras=ras, hol_s=hol, running=counts["running"], discarded=counts["discarded"],
                    kv_hit_rate=self.backend.kv_hit_rate(), ra2p_decoupled=float(self.ra2p_mode == ra2p.DECOUPLED),
                    ra2p_cost_colocated=decision.cost_colocated if decision else float("nan"),
                    ra2p_cost_decoupled=decision.cost_decoupled if decision else float("nan"),
                    rollout_devices=self.metrics.devices.get("rollout", 0),
                    compile_total_s=self._compile_seconds(),  # so a window's program loads can be read off
                    sync_s=t_sync, sync_bytes=getattr(self.backend, "last_sync_bytes", 0),
                    exchange_total_s=self.cluster.exchange_s,  # multi-host: docs/multihost.md
                    **self._ers_log()))
                if decision is not None:
                    log.info("RA2P: %s (colocated %.2fs, decoupled %.2fs)", decision.mode,
                             decision.cost_colocated, decision.cost_decoupled)
                if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                    self.save()
                if interrupted:
                    raise asyncio.CancelledError
            completed = True
        finally:
            self._stop = True
            self._wake.set()
            await asyncio.gather(producer, return_exceptions=True)  # its failure is raised above
            if completed or not self.cluster.multi:  # across processes a save is collective: all got here
                self.save(wait=True)
            await self.shutdown()
        self._ledger_total = self.global_ledger()
        return self.summary()

    def summary(self) -> dict:
        s = self.metrics.summary()
        s.update(mode=self.cfg.mode, kv_hit_rate=self.backend.kv_hit_rate(), not_learning=len(self.health.warnings),
                 discarded=self.discarded, moves=len(self.moves), ers_refused=self.ers_refused,
                 ers_refusals=dict(self.ers_refusals),
                 borrows=len(self.borrows), borrows_refused=self.borrows_refused,
                 syncs_failed=self.syncs_failed, ledger=dict(self._ledger_total or self.ledger),
                 admission_held_s=self._held_by_staleness_s + (self.clock() - self._held_since
                                                               if self._held_since is not None else 0.0))
        return s

    async def shutdown(self) -> None:
        """Stops the rollout side; unfinished samples are abandoned (the checkpoint lists their
        groups, and a resumed run completes them)."""
        jobs = list(self._sample_tasks) + [g.ref_job for g in self.ready if g.ref_job is not None]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await self.backend.stop()
        if hasattr(self._make_env, "close"):  # an environment process pool
            self._make_env.close()

