"""The controller across processes (`jax.distributed`; docs/multihost.md). A mixin of `Controller`.

Every process runs the controller. What each one owns and what they share:

- **Its share of the work.** The config's counts are global; a process admits `groups_per_step / P` groups
  per version and `max_concurrent / P` samples at once, on its own rollout replicas (its own device groups:
  `rollout_groups / P` of them, and `ref_groups / P`, `train_groups / P`), from its own tasks: train task i is
  process i % P's (deterministic by process index, so a rerun with the same count reproduces the run).
- **The update.** At each step every process waits for its local groups, then one exchange gives every process
  the whole batch (the groups in task order, as one process would train them); the trainer's step runs on the
  global train mesh (fsdp across the processes' train devices, tensor within a host), every process feeding the
  same arrays. The weight sync then moves the new weights in two phases: gathered within the train devices,
  then copied onto each host's own replicas (`model.sharding.local_replica`).
- **Decisions.** Those that read signals (RA2P's mode and device moves, ERS's moves, BiDiRL's borrows) are taken
  on process 0, from the counts gathered from every process (ready groups and samples summed, the trainer's wait and the
  head-of-line latency their maximum) and its own lane timings (every host's lanes have the same shape), and
  broadcast: every process applies process 0's decision, whatever its own signals say (a trainer borrow lends
  as many idle rollout devices on every process: the fewest any has; the larger train mesh spans them all).
  Admission is each process's over its own share (the capacity rule on its own counts; the policy version is
  the same everywhere). The checkpoint steps and the step budget are the config's, the same everywhere; a process
  whose run must stop (`_check_run`) says so at the next exchange, and every process stops, naming it.
- **State.** A checkpoint is written by every process (orbax; process 0 writes the JSON meta), its meta holding
  every process's cursor, ready buffer, groups in flight and ledger; a resume with the same process count takes
  back its own. Metrics, plots and TensorBoard are process 0's, with the gathered counts in them.

A process that fails at a step boundary tells the others (their exchange raises, naming it); one that dies or
hangs is named by the heartbeat watchdog (`distributed.Cluster.start_watchdog`).

The exchanges here are awaited (`Cluster.allgather_async`, `broadcast_async`): while a process waits for a slower
one, its rollouts, environments, engine steps and HTTP server go on. The checkpoint meta, the final ledger and its
accounts are exchanged synchronously (`save`, `global_ledger`, `_gathered_counts`: their callers are not async;
a save's orbax barrier blocks the loop anyway), and so are a trainer borrow's two (`Borrowing._train_borrow`:
the rollout replicas counted idle must still be idle when lent).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from tiderl_jax import distributed
from tiderl_jax.model.config import ConfigError
from tiderl_jax.runtime.group import Group

log = logging.getLogger("tiderl_jax.runtime.controller")

# the counts of a ControllerConfig that are split over the processes
SHARED_COUNTS = ("groups_per_step", "max_concurrent", "rollout_groups", "ref_groups", "train_groups")


def local_config(cfg, processes: int):
    """This process's share of a controller config (SHARED_COUNTS divided; a ConfigError naming the key that does
    not divide)."""
    if processes == 1:
        return cfg
    changes = {}
    for key in SHARED_COUNTS:
        value = getattr(cfg, key)
        if cfg.mode == "sync" and key.endswith("_groups"):
            continue  # sync has no device groups
        if value % processes:
            raise ConfigError(f"controller.{key}={value} does not split evenly over {processes} processes "
                              f"(each process takes an equal share)")
        changes[key] = value // processes
    return dataclasses.replace(cfg, **changes)


def process_devices() -> tuple:
    """Every process's devices, process by process (a multi-process pool's view of the others: its train mesh
    spans them)."""
    import jax
    hosts = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in range(jax.process_count())]
    if len({len(h) for h in hosts}) != 1:
        raise ConfigError(f"the processes have different device counts ({[len(h) for h in hosts]}); every host "
                          f"must drive as many devices as the others")
    return tuple(tuple(h) for h in hosts)


class Multihost:
    """The controller's exchanges with the other processes (module docstring). Single-process: no-ops."""

    def _task_index(self, local: int) -> int:
        """The train task (and group id) of this process's `local`-th task."""
        c = self.cluster
        return local * c.count + c.index

    async def _exchange_batch(self, local: list, waited: float, ras: int, hol: float):
        """Every process's groups of this update (`_train_step` puts them in task order) and the gathered signals: the trainer's wait and
        the head-of-line latency are the longest, the ready groups at start summed."""
        for g in local:  # decoupled ref scores travel with the trajectories
            if g.ref_job is not None:
                await g.ref_job
        parts = await self.cluster.allgather_async(f"step {self.step + 1} batch", dict(
            groups=[(g.gid, g.task, g.trajectories) for g in local], waited=waited, ras=ras, hol=hol))
        mine = {g.gid: g for g in local}
        batch = [mine.get(gid) or Group(gid, task, list(trajs), arrived=self.clock())
                 for part in parts for gid, task, trajs in part["groups"]]
        return (batch, max(p["waited"] for p in parts), sum(p["ras"] for p in parts),
                max(p["hol"] for p in parts))

    def _gathered_counts(self, what: str, **counts) -> dict:
        """`counts` summed over the processes (one exchange; it blocks: for callers off the event loop)."""
        if not self.cluster.multi:
            return counts
        parts = self.cluster.allgather(what, counts)
        return {k: sum(p[k] for p in parts) for k in counts}

    async def _gathered_counts_async(self, what: str, **counts) -> dict:
        """`_gathered_counts` from the event loop, which goes on meanwhile."""
        if not self.cluster.multi:
            return counts
        parts = await self.cluster.allgather_async(what, counts)
        return {k: sum(p[k] for p in parts) for k in counts}

    async def _decided(self, what: str, decide, blocking: bool = False):
        """Process 0's `decide()`, on every process (the others do not call it; it runs here, on the loop).
        `blocking`: the loop waits too (nothing may change before the caller acts on the decision)."""
        if not self.cluster.multi:
            return decide()
        obj = decide() if self.cluster.primary else None
        if blocking:
            return self.cluster.broadcast(what, obj)
        return await self.cluster.broadcast_async(what, obj)

    def _failed_here(self, what: str, e: BaseException) -> None:
        """Tells the others this process cannot reach the exchange `what` (theirs raises, naming it)."""
        if self.cluster.multi and not isinstance(e, distributed.ClusterError):
            self.cluster.fail(what, f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ checkpoints

    def _global_meta(self, meta: dict) -> dict:
        """The checkpoint meta of every process in one (all processes call it at the same step)."""
        if not self.cluster.multi:
            return meta
        parts = self.cluster.allgather(f"checkpoint meta at step {self.step}", {
            k: meta[k] for k in ("cursor", "ready", "in_flight", "ledger")})
        return dict(step=meta["step"], version=meta["version"], consumed=meta["consumed"], processes=parts)

    def _local_meta(self, meta: dict) -> dict:
        """This process's part of a checkpoint meta (the same process count as the run that wrote it)."""
        parts = meta.get("processes")
        count = len(parts) if parts is not None else 1
        if count != self.cluster.count:
            raise ConfigError(f"the checkpoint in {self.logdir}/checkpoints was written by {count} process"
                              f"{'es' if count > 1 else ''}, this run has {self.cluster.count}: resume with "
                              f"--num_processes={count}")
        return meta if parts is None else dict(meta, **parts[self.cluster.index])

    def global_ledger(self) -> collections.Counter:
        """Every process's ledger summed (all processes call it)."""
        if not self.cluster.multi:
            return collections.Counter(self.ledger)
        total = collections.Counter()
        for part in self.cluster.allgather("ledger", dict(self.ledger)):
            total.update(part)
        return total
