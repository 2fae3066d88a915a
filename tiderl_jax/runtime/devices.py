"""The device pool: device groups, their roles (rollout, ref, train), the roles' meshes, and the
weight sync that reshards the trainer's parameters onto the rollout mesh.

Devices are cut into equal **groups** (the unit ERS moves). Each role owns a list of groups and gets
its own mesh over its devices (`fsdp x tensor`, the tensor size from the config when it divides the
role's device count). The reference model either has its own groups (RA2P decoupled) or lives on the
train groups (colocated, `ref` empty).

A **move** (`DevicePool.moved`) hands one group from one role to another and returns a new pool; the
caller rebuilds the meshes and reshards what lives on them (parameters, optimizer state, the
engine's weights and KV pools) at a step boundary.

**Weight sync** (`WeightSync.publish`), the state machine of one version change:
prepare (the target shardings on the rollout mesh) -> drain (the caller's engine is between steps)
-> move (`jax.device_put` of the parameters onto those shardings) -> publish (the engine swaps them
in, version + 1); any failure before publish rolls back: the engine keeps its weights and version,
and the failure is recorded and logged, never raised into the training loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh

from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.sharding import ActivationSharding, Rules, make_mesh, place_copy, state_shardings

log = logging.getLogger(__name__)

ROLES = ("rollout", "ref", "train")


@dataclasses.dataclass(frozen=True)
class DevicePool:
    devices: tuple  # all devices, in a fixed order
    group_size: int  # devices per group
    roles: Mapping[str, tuple[int, ...]]  # role -> group ids it owns
    tensor: int = 1  # tensor-parallel size of each role's mesh (when it divides the role's devices)

    @classmethod
    def split(cls, devices, *, group_size: int, rollout: int, train: int, ref: int = 0,
              tensor: int = 1) -> "DevicePool":
        """`rollout`, `ref` and `train` groups of `group_size` devices, in that order."""
        devices = tuple(devices)
        need = (rollout + ref + train) * group_size
        if group_size < 1 or need != len(devices):
            raise ConfigError(f"device split: ({rollout} rollout + {ref} ref + {train} train) groups x "
                              f"{group_size} devices = {need}, but there are {len(devices)} devices")
        if rollout < 1 or train < 1:
            raise ConfigError(f"device split: rollout={rollout} and train={train} groups must be >= 1")
        ids = iter(range(rollout + ref + train))
        roles = {"rollout": tuple(next(ids) for _ in range(rollout)),
                 "ref": tuple(next(ids) for _ in range(ref)),
                 "train": tuple(next(ids) for _ in range(train))}
        return cls(devices, group_size, roles, tensor)

    def devices_of(self, role: str) -> list:
        g = self.group_size
        return [d for gid in sorted(self.roles[role]) for d in self.devices[gid * g:(gid + 1) * g]]

    def num_groups(self, role: str) -> int:
        return len(self.roles[role])

    def mesh(self, role: str) -> Mesh | None:
        """The role's `fsdp x tensor` mesh; None for a role without devices."""
        devs = self.devices_of(role)
        if not devs:
            return None
        tensor = self.tensor if len(devs) % self.tensor == 0 else 1
        return make_mesh({"data": 1, "fsdp": len(devs) // tensor, "tensor": tensor}, devs)

    def moved(self, src: str, dst: str) -> "DevicePool":
        """A pool with one group of `src` handed to `dst` (the highest-numbered one)."""
        if src not in ROLES or dst not in ROLES or src == dst:
            raise ConfigError(f"device move {src} -> {dst}: roles are {ROLES} and must differ")
        if not self.roles[src]:
            raise ConfigError(f"device move {src} -> {dst}: {src} has no group to give")
        gid = max(self.roles[src])
        roles = dict(self.roles)
        roles[src] = tuple(g for g in roles[src] if g != gid)
        roles[dst] = tuple(sorted(roles[dst] + (gid,)))
        return dataclasses.replace(self, roles=roles)


def reshard(tree, mesh: Mesh, rules: Rules):
    """A copy of an nnx.State (params, or anything with `axes` metadata) on `mesh` by the rules
    (never the same buffers: a trainer donates its parameters at every step)."""
    return place_copy(tree, state_shardings(tree, mesh, rules))


def model_on(graphdef, params, mesh: Mesh, rules: Rules):
    """The module `graphdef` with `params` resharded onto `mesh` (activations pinned there too)."""
    model = nnx.merge(graphdef, reshard(params, mesh, rules))
    model.activation_sharding = ActivationSharding(mesh, rules)
    return model


@dataclasses.dataclass
class SyncRecord:
    version: int
    ok: bool
    seconds: float
    stage: str  # the last stage reached: prepare, drain, move, publish
    error: str | None = None


class WeightSync:
    """Moves new weights from the train mesh to a rollout engine: prepare, drain, move, publish."""

    def __init__(self):
        self.history: list[SyncRecord] = []

    def publish(self, params, version: int, *, target_shardings, drain: Callable[[], None],
                swap: Callable[[object, int], None]) -> SyncRecord:
        """`drain()` waits until the engine is between steps; `swap(params, version)` installs the
        moved weights. Returns the record; on failure the engine is left as it was."""
        t0 = time.perf_counter()
        stage = "prepare"
        try:
            shardings = target_shardings
            stage = "drain"
            drain()
            stage = "move"
            # a copy even where the layouts match (sync mode): the trainer donates its buffers
            moved = jax.block_until_ready(place_copy(params, shardings))
            stage = "publish"
            swap(moved, version)
            rec = SyncRecord(version, True, time.perf_counter() - t0, stage)
        except Exception as e:  # roll back: the engine keeps serving the previous version
            rec = SyncRecord(version, False, time.perf_counter() - t0, stage, f"{type(e).__name__}: {e}")
            log.warning("weight sync to version %d failed at %s (%s); rolled back", version, stage, rec.error)
        self.history.append(rec)
        return rec
