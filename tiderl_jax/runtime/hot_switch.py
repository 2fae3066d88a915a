"""BiDiRL's hot switches on the real devices: `JaxBackend`'s `lend` / `take_back` (the contract is the
simulator's, `sim/switches.py`; the decisions are `runtime/borrowing.py`'s, by `policies.bidirl`).

Both directions need `replicas="group"` (one engine replica per rollout device group: the unit lent).

- **The rollout borrows train devices** (`lend("train", "rollout", n)`, while the trainer waits for data):
  each lent train group gets an `Engine` on its own mesh with the current policy weights (the trainer's,
  under the version the rollout serves) and joins the rollout service (`service.add_replica`); the router
  sends it turns from the next tick on. `take_back` removes those replicas (`service.remove_replica`: the
  turns running there finish, then their sessions' KV is released and their next turns run on the other
  replicas from their whole context) and the devices are the trainer's again. The trainer's state stays
  resident on them meanwhile (its step does not run while it waits for data); the borrowed engines are kept
  per train group, so a later borrow of the same group only copies the weights in (its programs stay
  compiled; its first borrow warms it up with the programs the rollout's replicas ran).
- **The trainer borrows idle rollout replicas** (`lend("rollout", "train", n)`, while admission is blocked):
  whole replicas with no task (no session, no turn, no queued command), always leaving one replica
  serving, are paused (the router skips them; their engines and weights stay), and the trainer's
  parameters, optimizer state, reference and value parameters move onto one `fsdp x tensor` mesh over its
  own devices plus the borrowed ones (`Trainer.move_to`). We chose one larger mesh over a data-parallel copy
  with a separate gradient merge: the step is the same program on more devices (the batch is split over
  `fsdp`, GSPMD reduces the gradients inside the step), so the result is the same update up to the float
  order of that reduction, with no second optimizer state to keep consistent. `take_back` moves the state
  back onto the home mesh and un-pauses the replicas (a publish made while they were paused reached them
  too). The trainer's programs are kept per layout (home and each borrowed device set), so neither a
  repeated borrow nor the return recompiles.

**Costs** (`switch_costs`): each switch's wall seconds are measured and logged (`switch_log`: direction,
phase, seconds, bytes moved, compile seconds spent in it, sessions moved). Once a direction has been
measured, its switch-in and switch-out are the last measured ones less the compile seconds spent in them
(paid once per layout: a repeated switch does not pay them again; the log keeps them). Before that, an
estimate from the bytes moved (ours): `SWITCH_FIXED_S + bytes / SWITCH_BYTES_PER_S`, where a rollout
borrow's switch-in copies the policy weights onto one borrowed group and its switch-out moves nothing, and
a trainer borrow's switch-in and switch-out each move parameters, optimizer state and reference (and value)
parameters. The trainer borrow's `merge_s` is the gradient reduction the larger mesh adds to the step:
twice the parameter bytes (a reduce-scatter and an all-gather) at the bandwidth the switches measured
(bytes / seconds of the last measured switch with bytes), else at `SWITCH_BYTES_PER_S`.
"""

from __future__ import annotations

import asyncio
import time

import jax

from tiderl_jax import distributed
from tiderl_jax.model.config import ConfigError
from tiderl_jax.runtime.pool import group_mesh

SWITCH_BYTES_PER_S = 1e9  # (ours) bytes per second a switch moves, assumed until one is measured
SWITCH_FIXED_S = 0.05  # (ours) fixed seconds of a switch (program lookups, placement), until measured


def tree_bytes(tree) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


class HotSwitches:
    """BiDiRL's `lend` / `take_back` of `JaxBackend` (module docstring); `_init_switches` sets its state."""

    def _init_switches(self) -> None:
        self.switch_log: list[dict] = []  # every switch, as measured (module docstring)
        self._measured_switch: dict[tuple[str, str], dict] = {}  # (lender, borrower) -> in / out seconds
        self._borrowed_engines: dict[int, object] = {}  # train group id -> its engine, kept across borrows
        self._lent: dict | None = None  # the borrow in progress
        self._train_layouts: dict[tuple, dict] = {}  # borrowed mesh devices -> the trainer's programs there
        self._training = False

    def cannot_lend(self) -> str | None:
        """Why this backend cannot hot-switch devices (None: it can)."""
        if self.pool is None:
            return "BiDiRL lends devices between separate rollout and train pools; sync mode has one mesh"
        if self.replica_mode != "group":
            return ("BiDiRL on the JAX backend lends whole rollout replicas: set controller.rollout_replicas="
                    "'group' (one engine replica per device group), not 'mesh'")
        if self.engine_workers:
            return "BiDiRL does not lend the devices of engine workers (their engines live in worker processes)"
        return None

    # ---------------------------------------------------------------- what the controller reads

    def borrow_unit(self, role: str) -> int:
        """Devices per unit a borrow moves: one device group (a rollout replica; a trainer borrows whole idle
        replicas)."""
        return self.pool.group_size if self.pool is not None else len(self.devices)

    def _idle_replicas(self) -> list:
        """The own rollout replicas with no task (no session, no turn, no queued command, no engine work), at
        most all but one of the live ones (the service keeps a replica serving)."""
        if self.pool is None or self.replica_mode != "group" or self._lent is not None:
            return []
        live = [r for r in self.service.live() if r.id in self._group_of]
        idle = [r for r in live if not r.in_turn and not r.sessions and not r.engine.has_work()
                and not (r.driver is not None and r.driver.busy)]
        return idle[:max(0, len(self.service.live()) - 1)]

    def idle_devices(self, role: str) -> int:
        """Rollout devices whose replica has no task; train devices while no train step runs."""
        if self.pool is None or self._lent is not None:
            return 0
        if role == "rollout":
            return sum(len(self.pool.group_devices(self._group_of[r.id])) for r in self._idle_replicas())
        return 0 if self._training else len(self.pool.devices_of("train"))

    def _state_bytes(self) -> int:
        t = self.trainer
        return tree_bytes((t.params, t.opt_state, t.ref_params, t.value_params))

    def _bandwidth(self) -> float:
        for rec in reversed(self.switch_log):
            moved = rec["seconds"] - rec["compile_s"]
            if rec["bytes"] > 0 and moved > 0:
                return rec["bytes"] / moved
        return SWITCH_BYTES_PER_S

    def switch_costs(self, lender: str, borrower: str) -> dict[str, float]:
        """Seconds of a hot switch of one borrower unit: measured, or estimated from bytes (module docstring)."""
        param_bytes = tree_bytes(self.trainer.params)
        merge = 2.0 * param_bytes / self._bandwidth() if borrower == "train" else 0.0
        if borrower == "rollout":
            costs = dict(switch_in_s=SWITCH_FIXED_S + param_bytes / SWITCH_BYTES_PER_S, switch_out_s=SWITCH_FIXED_S)
        else:
            state = SWITCH_FIXED_S + self._state_bytes() / SWITCH_BYTES_PER_S
            costs = dict(switch_in_s=state, switch_out_s=state)
        costs.update(self._measured_switch.get((lender, borrower), {}))  # a phase measured replaces its estimate
        return dict(costs, merge_s=merge)

    # ---------------------------------------------------------------- the switches

    async def lend(self, lender: str, borrower: str, devices: int) -> None:
        """Switches `devices` idle devices of `lender` (whole groups) to `borrower` until `take_back`."""
        why = self.cannot_lend()
        if why:
            raise ConfigError(why)
        if self._lent is not None:
            raise RuntimeError("JaxBackend.lend: devices are already lent (take_back first)")
        groups = devices // self.pool.group_size
        if groups < 1:
            raise ValueError(f"JaxBackend.lend: {devices} device(s) make no whole device group of "
                             f"{self.pool.group_size}")
        t0, compiled = time.perf_counter(), self.compile_s()
        if (lender, borrower) == ("train", "rollout"):
            record = await self._lend_train_devices(groups)
        elif (lender, borrower) == ("rollout", "train"):
            record = await self._lend_rollout_replicas(groups)
        else:
            raise ValueError(f"JaxBackend.lend: cannot lend {lender} devices to {borrower} (rollout <-> train)")
        self._lent.update(lender=lender, borrower=borrower)
        self._log_switch("in", lender, borrower, t0, compiled, record)

    async def _lend_train_devices(self, groups: int) -> dict:
        gids = sorted(self.pool.roles["train"])[:groups]
        if len(gids) < groups:
            raise ValueError(f"JaxBackend.lend: {groups} train group(s) asked, the trainer has {len(gids)}")
        version = self.engine.version
        programs = frozenset().union(*(r.engine.programs() for r in self.service.live()))

        def build():
            from tiderl_jax.engine.engine import Engine
            from tiderl_jax.runtime.devices import model_on
            out = []
            for gid in gids:
                engine = self._borrowed_engines.get(gid)
                if engine is None:  # first borrow of this group: its programs compile here, once
                    engine = Engine(model_on(self.trainer.graphdef, self.trainer.params, self.pool.group_mesh(gid),
                                             self.rules), self.engine_config, version=version)
                    engine.warmup(programs)
                    self._borrowed_engines[gid] = engine
                else:
                    engine.update_params(self.trainer.params, version)  # copied onto its shardings
                jax.block_until_ready(engine.runner.params)
                out.append(engine)
            return out
        engines = await asyncio.to_thread(build)
        replicas = {self.service.add_replica(e): gid for e, gid in zip(engines, gids)}
        self._lent = dict(replicas=replicas)
        return dict(groups=gids, replicas=list(replicas), bytes=tree_bytes(self.trainer.params) * len(gids))

    async def _lend_rollout_replicas(self, groups: int) -> dict:
        chosen = self._idle_replicas()[:groups]
        if not chosen:
            raise ValueError("JaxBackend.lend: no idle rollout replica to lend (each has a task, or only one "
                             "replica serves)")
        for rep in chosen:  # paused: the router skips them from now on (checked idle in this same tick)
            rep.alive = False
        gids = [self._group_of[r.id] for r in chosen]
        extra = [d for g in gids for d in self.pool.group_devices(g)]
        trainer = self.trainer
        home_mesh, home_programs = trainer.mesh, trainer._programs
        devices = tuple(self.pool.devices_of("train")) + tuple(extra)
        if self.pool.hosts is not None:  # across processes: every process's train and lent devices, process-major
            by_id = {d.id: d for d in jax.devices()}
            ids = await distributed.cluster().allgather_async("BiDiRL: the devices lent to the trainer",
                                                              [d.id for d in devices])  # chosen: paused above
            devices = tuple(by_id[i] for host in ids for i in host)
        mesh = group_mesh(devices, self.tensor)
        self._lent = dict(paused=chosen, home_mesh=home_mesh, home_programs=home_programs, groups=gids)
        try:
            await asyncio.to_thread(self._move_trainer, mesh, self._train_layouts.setdefault(
                tuple(d.id for d in devices), {}))
        except BaseException:
            trainer._programs = home_programs
            for rep in chosen:
                rep.alive = True
            self._lent = None
            raise
        return dict(groups=gids, replicas=[r.id for r in chosen], bytes=self._state_bytes())

    def _move_trainer(self, mesh, programs: dict) -> None:
        """The trainer's state onto `mesh`, its programs there being `programs` (`Trainer.move_to` clears the
        dict it holds: it is handed an empty one, and the kept ones are put back after)."""
        trainer = self.trainer
        trainer._programs = {}
        trainer.move_to(mesh)
        trainer._programs = programs
        jax.block_until_ready((trainer.params, trainer.opt_state, trainer.ref_params, trainer.value_params))

    async def take_back(self) -> None:
        """Ends the borrow: every device back in its own role (module docstring)."""
        lent = self._lent
        if lent is None:
            return
        t0, compiled = time.perf_counter(), self.compile_s()
        if lent["borrower"] == "rollout":
            moved = 0
            for rid in lent["replicas"]:
                moved += await self.service.remove_replica(rid)
            record = dict(groups=list(lent["replicas"].values()), replicas=list(lent["replicas"]), bytes=0,
                          sessions_moved=moved)
        else:
            await asyncio.to_thread(self._move_trainer, lent["home_mesh"], lent["home_programs"])
            for rep in lent["paused"]:  # routed to again from the service's next tick
                rep.alive = True
            record = dict(groups=lent["groups"], replicas=[r.id for r in lent["paused"]], bytes=self._state_bytes())
        self._lent = None
        self._log_switch("out", lent["lender"], lent["borrower"], t0, compiled, record)

    def _log_switch(self, phase: str, lender: str, borrower: str, t0: float, compiled: float, record: dict) -> None:
        seconds = time.perf_counter() - t0
        compile_s = max(0.0, self.compile_s() - compiled)
        self.switch_log.append(dict(record, lender=lender, borrower=borrower, phase=phase, seconds=seconds,
                                    compile_s=compile_s))
        # a repeated switch pays no compile (programs are kept per layout): what the next decision weighs
        self._measured_switch.setdefault((lender, borrower), {})[f"switch_{phase}_s"] = max(0.0, seconds - compile_s)

    def _paused_replicas(self) -> list:
        """Rollout replicas lent to the trainer (a publish reaches them too)."""
        return list(self._lent["paused"]) if self._lent is not None and "paused" in self._lent else []

    def _lent_compile_s(self) -> float:
        """Compile seconds of the borrowed engines not in the service now (kept for their next borrow)."""
        serving = {id(e) for e in self.service.engines}
        return sum(e.compile_s for e in self._borrowed_engines.values() if id(e) not in serving)

