"""Backends: the devices the controller drives.

The controller (`controller.py`) decides what runs when; a backend runs it and says how long it
took. Two implement the same interface, so the simulator runs the controller's own code
(docs/architecture.md, "The one idea"):

- `JaxBackend` (here): the rollout service on the rollout devices (one engine over the whole rollout mesh,
  or with `replicas="group"` one engine replica per rollout device group behind the router), the trainer
  on the train mesh, the reference scorer on the ref mesh, weight sync between them; wall-clock time.
  With `replicas="group"` it also hot-switches devices for BiDiRL (`lend` / `take_back`, `hot_switch.py`).
  With `rollout.agent` / `agent_command` the train samples come from external agents over the OpenAI API
  (`agents/external.py`: the service served on loopback, each sample one agent session).
- `sim.backend.SimBackend`: cost-modelled devices on a virtual clock.

The interface (`Backend`): `clock()` is the controller's only time source; `pool` holds the device
groups (None when every device does everything: the sync mode); a generation, a ref pass, a train
step, a weight sync and a device move are coroutines that return when the work is done. Times the
controller's policies read come back with the results: a train step reports its parts
(`time_proximal_s`, `time_ref_s`, `time_update_s`) and the compile seconds it spent, a ref pass
whether it compiled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
from flax import nnx

from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model.decoder import Decoder, split_adapters
from tiderl_jax.model.sharding import DEFAULT_RULES, Rules, local_replica, place_copy
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.policies import routing
from tiderl_jax.rl.trainer import Scorer, Trainer
from tiderl_jax.rl.trainer_config import TrainerConfig
from tiderl_jax.runtime.devices import WeightSync, model_on
from tiderl_jax.runtime.hot_switch import HotSwitches
from tiderl_jax.runtime.pool import Backend, DevicePool, group_mesh, lanes_of, split_devices  # noqa: F401
from tiderl_jax.serving.service import RolloutService, ServiceConfig

REPLICAS = ("mesh", "group")
log = logging.getLogger(__name__)


class JaxBackend(HotSwitches):
    """The real devices (see the module docstring; BiDiRL's switches: `hot_switch.HotSwitches`)."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer, *, kv_mode: str, pool: DevicePool | None,
                 engine_config: EngineConfig, rollout_config: RolloutConfig, trainer_config: TrainerConfig,
                 rules: Rules = DEFAULT_RULES, devices: Sequence | None = None, tensor: int = 1,
                 engine_workers: dict | bool = False, replicas: str = "mesh", router: str = "least_loaded",
                 replica_devices: int = 1, router_config: routing.RouterConfig = routing.RouterConfig()):
        """`replicas`: "mesh", one engine over the whole rollout mesh; "group", one engine replica per rollout
        device group (the pool's groups; without a pool, chunks of `replica_devices` devices), each a replica
        of the rollout service that ERS moves whole. `router`: the service's policy (`policies.routing`), with its
        settings `router_config` (MISA-T's target mixture, ...)."""
        if replicas not in REPLICAS:
            raise ValueError(f"replicas={replicas!r} is not one of {REPLICAS}")
        self.rules = rules
        self.tensor = tensor
        self.replica_mode = replicas
        self.pool = pool
        self.multi = jax.process_count() > 1  # across processes: docs/multihost.md
        self.devices = list(devices or (jax.local_devices() if self.multi else jax.devices()))
        graphdef, params = nnx.split(model)
        if pool is None:  # one mesh for everything; nothing moves
            roll_mesh = train_mesh = group_mesh(self.devices, tensor)
            if self.multi:  # the trainer over every process's devices, each process's engine over its own
                train_mesh = group_mesh(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)), tensor)
            ref_mesh = None
        else:
            roll_mesh, train_mesh, ref_mesh = (pool.mesh(r) for r in ("rollout", "train", "ref"))
        self.trainer = Trainer(model_on(graphdef, params, train_mesh, rules), trainer_config,
                               mesh=train_mesh, rules=rules)
        self.trainer.policy_version = 0  # the engines' weights too: each step advances both by one
        # the reference model exists only when a loss term or the reward reads it (`LossConfig.uses_reference`):
        # no KL, no reference pass anywhere (RA2P then has nothing to place, and ref devices stay idle)
        self.uses_reference = trainer_config.loss.uses_reference
        if self.uses_reference and self.trainer.ref_params is None:  # the starting policy
            self.trainer.ref_params = place_copy(self.trainer.params, _shardings(self.trainer.params))
        self.ref_scorer = (Scorer(model_on(graphdef, params, ref_mesh, rules), trainer_config, mesh=ref_mesh,
                                  rules=rules) if ref_mesh is not None and self.uses_reference else None)
        if ref_mesh is not None and not self.uses_reference:
            log.warning("the ref devices (%d) stay idle: no loss term reads the reference model (loss.kl_coef=0); "
                        "set controller.ref_groups=0 to give them to the rollout or the trainer",
                        len(ref_mesh.devices.flat))
        self.engine_config = engine_config
        self._group_of: dict[int, object] = {}  # replica id -> its device group (pool group id or device tuple)
        self._worker_options = engine_workers if isinstance(engine_workers, dict) else {}
        if replicas == "group":
            groups = self._rollout_groups(replica_devices)
        if engine_workers:  # Belayer: each replica's engine in a worker process with a warm standby (faults/)
            engines = [_worker_engine(model, engine_config, **self._worker_options)
                       for _ in (groups if replicas == "group" else [None])]
        elif replicas == "group":
            engines = [Engine(model_on(graphdef, params, self._group_mesh(g), rules), engine_config) for g in groups]
        else:
            engines = [Engine(model_on(graphdef, params, roll_mesh, rules), engine_config)]
        self.engine_workers = bool(engine_workers)
        self.service = RolloutService(engines, ServiceConfig(policy=router, router=router_config))
        if replicas == "group":
            self._group_of = {rep.id: g for rep, g in zip(self.service.replicas, groups)}
        self.runner = RolloutRunner(self.service, tokenizer, dataclasses.replace(
            rollout_config, mode=kv_mode))  # "ctb" | "request" (ControllerConfig.kv_mode)
        self.agents = None  # external agents make the train samples (rollout.agent / agent_command)
        if rollout_config.agent or rollout_config.agent_command:
            from tiderl_jax.agents.external import ExternalAgents
            self.agents = ExternalAgents(rollout_config.agent, rollout_config.agent_command,
                                         rollout_config.agent_timeout_s, max_context=rollout_config.max_context)
        self.sync = WeightSync()
        self.last_sync_error: str | None = None  # the last failed publish's error and stage (None after a success)
        self.last_sync_bytes = 0  # the weights the last publish moved, over its replicas (LoRA: the adapters)
        self._init_switches()

    clock = staticmethod(time.perf_counter)

    @property
    def engine(self) -> Engine:
        """The first live replica's engine (the only one with `replicas="mesh"`)."""
        return (self.service.live() or self.service.replicas)[0].engine

    @property
    def engines(self) -> list[Engine]:
        return self.service.engines

    def _rollout_groups(self, replica_devices: int) -> list:
        """The rollout's device groups: the pool's group ids, or (no pool) tuples of `replica_devices` devices."""
        if self.pool is not None:
            return sorted(self.pool.roles["rollout"])
        n = max(1, replica_devices)
        if len(self.devices) % n:
            raise ValueError(f"{len(self.devices)} devices do not split into rollout replicas of {n}")
        return [tuple(self.devices[i:i + n]) for i in range(0, len(self.devices), n)]

    def _group_mesh(self, group):
        return self.pool.group_mesh(group) if isinstance(group, int) else group_mesh(group, self.tensor)

    def lanes(self) -> dict[str, int]:
        return lanes_of(self.pool, len(self.devices))

    @property
    def has_ref_devices(self) -> bool:
        return self.ref_scorer is not None

    # ---------------------------------------------------------------- rollout

    async def start(self, make_env, latency_for, step_span) -> None:
        self.runner.step_span = step_span
        await self.runner.start(make_env, latency_for)
        if self.agents is not None:  # the service over HTTP, on this loop
            await self.agents.start(self.service, self.runner.tok, make_env, self.runner.config.mode)

    async def stop(self) -> None:
        if self.agents is not None:
            await self.agents.stop()
        await self.runner.stop()
        if self.engine_workers:
            for engine in self.engines:
                engine.client.close()

    async def generate(self, task, group, sample, expected_group_size) -> Trajectory:
        if self.agents is not None:
            return await self.agents.run(task, group, sample)
        return await self.runner.submit(task, group, expected_group_size=expected_group_size, sample=sample)

    async def run_tasks(self, tasks, *, temperature: float, seed: int) -> list[Trajectory]:
        """One sample of each task through the running rollout loop, at this temperature and seed: a held-out
        evaluation during RL (`Controller.run(on_step=...)`), on the latest published weights, its engine steps
        shared with the training samples. Group ids -1, -2, ...: apart from the controller's GRPO groups."""
        return list(await asyncio.gather(*(self.runner.submit(t, -1 - i, sample=0, temperature=temperature, seed=seed)
                                           for i, t in enumerate(tasks))))

    def kv_hit_rate(self) -> float:
        return self.service.kv_hit_rate()

    # ---------------------------------------------------------------- scoring, training, sync, moves

    async def score_ref(self, trajectories):
        compiled = self.ref_scorer.compile_s
        scores = await asyncio.to_thread(self.ref_scorer.score_trajectories, trajectories)
        return [None if s is None else s.tolist() for s in scores], self.ref_scorer.compile_s != compiled

    async def train(self, trajectories) -> dict:
        compiled = self.trainer.compile_s
        self._training = True
        try:
            out = await asyncio.to_thread(self.trainer.rl_step, trajectories)
        finally:
            self._training = False
        return dict(out, compile_s=self.trainer.compile_s - compiled)

    async def publish(self, version: int) -> bool:
        """The trainer's weights to the engine as `version`; False (the reason in `last_sync_error`)
        when the sync failed and rolled back."""
        params = self.trainer.params
        lora = self.trainer.lora  # only the adapters change: only they move (the engines keep the base)
        if lora:
            params = split_adapters(params)[0]
        if self.multi:  # the two-phase move: gathered within the train devices (every process at once), then
            params = await asyncio.to_thread(local_replica, params)  # copied onto this host's replicas below
        if self.engine_workers:  # a host copy to each replica's parameter service, its worker and its standby
            await asyncio.gather(*(asyncio.to_thread(e.update_params, params, version)
                                   for e in self.engines))
            return True

        def swap(rep):  # between two of this replica's engine steps
            target = rep.engine.runner.param_shardings
            return self.sync.publish(params, version, target_shardings=split_adapters(target)[0] if lora and target is not None else target,
                                     drain=lambda: None, swap=rep.engine.update_params)
        # replicas lent to the trainer: they serve this version when they come back
        paused = [rep for rep in self._paused_replicas() if rep.driver is not None]
        live = self.service.live() + paused
        records = list(await asyncio.gather(self.service.command_all(swap),
                                            *(rep.driver.command(lambda rep=rep: swap(rep)) for rep in paused)))
        records = records[0] + records[1:]
        failed = [(rep.id, r) for rep, r in zip(live, records) if not r.ok]
        self.last_sync_bytes = sum(r.bytes for r in records if r.ok)
        self.last_sync_error = "; ".join(
            f"{r.error} (at the {r.stage} stage" + (f", replica {i})" if len(records) > 1 else ")") for i, r in failed
        ) or None
        return not failed

    async def move(self, from_role: str, to_role: str) -> None:
        """One device group changes role; only the parts whose devices changed move (the trainer
        reshards, the engine rebuilds on its new mesh, the reference scorer moves to its new mesh or,
        with no ref group left, goes: the ref pass then runs colocated in the train step)."""
        if self._lent is not None:
            raise RuntimeError("JaxBackend.move: devices are lent (BiDiRL); take_back before an ERS move")
        old, self.pool = self.pool, self.pool.moved(from_role, to_role)
        changed = {from_role, to_role}
        if "train" in changed:
            await asyncio.to_thread(self.trainer.move_to, self.pool.mesh("train"))
        if "ref" in changed and self.uses_reference:
            ref_mesh = self.pool.mesh("ref")
            self.ref_scorer = None if ref_mesh is None else await asyncio.to_thread(
                lambda: Scorer(model_on(self.trainer.graphdef, self.trainer.ref_params, ref_mesh, self.rules),
                               self.trainer.config, mesh=ref_mesh, rules=self.rules))
        if "rollout" in changed and self.replica_mode == "group":  # a whole replica leaves or joins
            if from_role == "rollout":
                gid = max(old.roles["rollout"])
                rid = next(r for r, g in self._group_of.items() if g == gid)
                engine = self.service.replica(rid).engine
                await self.service.remove_replica(rid)
                del self._group_of[rid]
                if self.engine_workers:  # the worker and its standby end with the replica
                    await asyncio.to_thread(engine.client.close)
            else:
                gid = next(g for g in self.pool.roles["rollout"] if g not in old.roles["rollout"])
                version = self.engine.version
                engine = await asyncio.to_thread(lambda: self._new_worker(version) if self.engine_workers else Engine(
                    model_on(self.trainer.graphdef, self.trainer.params, self.pool.group_mesh(gid), self.rules),
                    self.engine_config, version=version))
                self._group_of[self.service.add_replica(engine)] = gid
        elif "rollout" in changed:
            engine_model = model_on(self.trainer.graphdef, self.trainer.params, self.pool.mesh("rollout"), self.rules)
            await self.runner.command(lambda: self.engine.move_to(engine_model))

    def _new_worker(self, version: int):
        """A worker replica (Belayer) with the trainer's current weights as `version` (its standby warms up too)."""
        model = nnx.merge(self.trainer.graphdef, self.trainer.params)
        engine = _worker_engine(model, self.engine_config, **self._worker_options)
        engine.update_params(self.trainer.params, version)
        return engine

    def compile_s(self) -> float:
        return sum(e.compile_s for e in self.engines) + self._lent_compile_s() + self.trainer.compile_s

    def move_costs(self) -> dict[tuple[str, str], float]:
        """ERS's predicted seconds of each move before one is measured: a move rebuilds only the parts whose
        devices change, and their programs load again on the new mesh, so each part costs the program-load
        seconds it has spent so far (the engine's bucket grid, the trainer's step programs, the ref scorer's, or
        the trainer's for a ref scorer not built yet; nothing for a scorer that goes), at least the seconds its
        `warmup` took (programs an earlier engine of this process compiled load in no time, yet a new mesh's
        compile: measured, goodput.py's engine on 6 devices compiled for 22-32 s inside a run whose estimate
        had been its 0 s of loads). Still low when the new mesh's programs are in no cache: the controller
        replaces a move's estimate by its measured cost once it has made one."""
        warm = getattr(self, "_warm_s", {})
        parts = {"rollout": max(e.compile_s for e in self.engines), "train": self.trainer.compile_s,
                 "ref": self.ref_scorer.compile_s if self.ref_scorer is not None else self.trainer.compile_s}
        parts = {r: max(v, warm.get(r, warm.get("train", 0.0) if r == "ref" else 0.0)) for r, v in parts.items()}
        if self.pool is None:
            return {}
        costs = {}
        for frm in ("rollout", "ref", "train"):
            for to in ("rollout", "ref", "train"):
                if frm == to or self.pool.num_groups(frm) == 0:
                    continue
                ref_stays = "ref" not in (frm, to) or self.pool.num_groups("ref") - (frm == "ref") > 0
                costs[(frm, to)] = sum(parts[r] for r in {frm, to} if r != "ref" or ref_stays)
        return costs

    def warmup(self, micro_counts: Sequence[int], engine_programs=None) -> float:
        """Loads the programs the run will ask for before it starts: the engine's whole shape-bucket grid (or
        `engine_programs`: those an engine of the same config ran, `Engine.programs()`) and the trainer's (and
        the decoupled ref scorer's) step programs for each packed micro-batch count; returns seconds. (An
        engine worker warms itself up.) Programs of a mesh an ERS move creates load at the move."""
        t0 = time.perf_counter()
        self._warm_s = {}  # seconds per part: `move_costs` reads them
        if not self.engine_workers:  # every replica: programs are compiled per device group
            self._warm_s["rollout"] = max(e.warmup(engine_programs) for e in self.engines)
        self._warm_s["train"] = self.trainer.warmup(micro_counts)
        if self.ref_scorer is not None:
            self._warm_s["ref"] = self.ref_scorer.warmup(micro_counts)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- state

    def arrays(self) -> dict[str, Any]:
        arrays = {"params": self.trainer.params, "opt_state": self.trainer.opt_state}
        if self.trainer.ref_params is not None:
            arrays["ref"] = self.trainer.ref_params
        if self.trainer.value_params is not None:
            arrays["value"] = self.trainer.value_params
        return arrays

    def restore_arrays(self, arrays: dict[str, Any], *, step: int, version: int) -> None:
        self.trainer.params, self.trainer.opt_state = arrays["params"], arrays["opt_state"]
        self.trainer.step_count, self.trainer.policy_version = step, version
        self.trainer.ref_params = arrays.get("ref")
        if "value" in arrays:
            self.trainer.value_params = arrays["value"]
        params = local_replica(self.trainer.params) if self.multi else self.trainer.params
        for engine in self.engines:
            engine.update_params(params, version)  # the engine copies them

    def load_policy(self, params, version: int) -> None:
        """Starts from these weights (the warm start): the actor, the reference model and the
        rollout engine all take them."""
        self.trainer.params = place_copy(params, _shardings(self.trainer.params))
        self.trainer.policy_version = version
        if self.trainer.ref_params is not None:
            self.trainer.ref_params = place_copy(params, _shardings(self.trainer.ref_params))
        if self.ref_scorer is not None:
            self.ref_scorer.params = place_copy(params, _shardings(self.ref_scorer.params))
        if self.multi:
            params = local_replica(params)
        for engine in self.engines:
            if self.engine_workers:
                engine.update_params(params, version)
            else:
                engine.update_params(place_copy(params, _shardings(engine.runner.params)), version)


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _worker_engine(model: Decoder, engine_config: EngineConfig, warmup: bool = True, health_threshold: int = 3):
    """An `Engine` look-alike over an engine worker process with a warm standby (both compiled before
    the run starts; the persistent compile cache is shared with them when one is set)."""
    import os

    from tiderl_jax.faults.engine_worker import EngineClient, ParamService, WorkerSpec
    from tiderl_jax.faults.worker_engine import WorkerEngine
    env = {k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES") if k in os.environ}
    client = EngineClient(WorkerSpec(model.cfg, engine_config, warmup=warmup, env=env),
                          ParamService(nnx.split(model)[1], 0), health_threshold=health_threshold)
    return WorkerEngine(client, model.cfg, engine_config)
