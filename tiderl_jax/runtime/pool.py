"""What the controller needs from the devices, without JAX: device groups and the backend protocol.

The simulator (`sim/`) imports this module and the controller, never JAX model code; the JAX parts
(meshes, the real backend) are imported only where they are built.

**Device groups.** Devices are cut into equal groups (the unit ERS moves). Each role (rollout, ref,
train) owns a list of groups and gets its own mesh over its devices (`fsdp x tensor`, the tensor size
when it divides the role's device count). The reference model either has its own groups (RA2P
decoupled) or lives on the train groups (colocated, `ref` empty). A move (`DevicePool.moved`) hands
one group from one role to another and returns a new pool; the backend rebuilds what lives on the
meshes at a step boundary. Devices may be JAX devices or plain ids (the simulator's).

**Backend.** The controller decides; a backend runs the work and says how long it took
(`runtime/backend.py` has the real one, `sim/backend.py` the simulated one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

from tiderl_jax.model.config import ConfigError

ROLES = ("rollout", "ref", "train")


@dataclasses.dataclass(frozen=True)
class DevicePool:
    devices: tuple  # all devices, in a fixed order
    group_size: int  # devices per group
    roles: Mapping[str, tuple[int, ...]]  # role -> group ids it owns
    tensor: int = 1  # tensor-parallel size of each role's mesh (when it divides the role's devices)
    # across processes (jax.distributed): every process's devices, process by process; `devices` are this process's.
    # The train mesh then spans every process's train devices (the same local groups on each: moves are the same
    # on every process); rollout replicas and a decoupled reference stay on this process's devices.
    hosts: tuple | None = None

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

    def mesh(self, role: str):
        """The role's `fsdp x tensor` mesh (a jax Mesh); None for a role without devices. Across processes the
        train mesh is over every process's train devices (process-major: tensor within a host, fsdp across)."""
        devs = self.devices_of(role)
        if devs and role == "train" and self.hosts is not None:
            where = [self.devices.index(d) for d in devs]
            devs = [host[i] for host in self.hosts for i in where]
            t = self.tensor if len(where) % self.tensor == 0 else 1
            from tiderl_jax.model.sharding import make_mesh
            return make_mesh({"data": 1, "fsdp": len(devs) // t, "tensor": t}, devs)
        return group_mesh(devs, self.tensor) if devs else None

    def group_devices(self, gid: int) -> list:
        return list(self.devices[gid * self.group_size:(gid + 1) * self.group_size])

    def group_mesh(self, gid: int):
        """One device group's `fsdp x tensor` mesh (a rollout replica's)."""
        return group_mesh(self.group_devices(gid), self.tensor)

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


def group_mesh(devices: Sequence, tensor: int):
    """An `fsdp x tensor` mesh over `devices` (tensor 1 when it does not divide them); a jax Mesh."""
    from tiderl_jax.model.sharding import make_mesh  # JAX only when a mesh is built

    t = tensor if len(devices) % tensor == 0 else 1
    return make_mesh({"data": 1, "fsdp": len(devices) // t, "tensor": t}, list(devices))


def split_devices(devices: Sequence, *, mode: str, group_size: int, rollout: int, ref: int, train: int,
                  tensor: int, hosts: tuple | None = None) -> DevicePool | None:
    """The device groups of a mode: None for sync (one set for everything), else the pool (`hosts`: every
    process's devices, for a train mesh across processes)."""
    if mode == "sync":
        return None
    pool = DevicePool.split(devices, group_size=group_size, rollout=rollout, ref=ref, train=train, tensor=tensor)
    return dataclasses.replace(pool, hosts=hosts)


def lanes_of(pool: DevicePool | None, num_devices: int) -> dict[str, int]:
    """Devices per metrics lane (sync: rollout and train both hold all of them, taking turns)."""
    if pool is None:
        return {"rollout": num_devices, "train": num_devices}
    return {r: len(pool.devices_of(r)) for r in ROLES}


class Backend(Protocol):
    pool: DevicePool | None

    def clock(self) -> float: ...
    def lanes(self) -> dict[str, int]: ...
    @property
    def has_ref_devices(self) -> bool: ...
    async def start(self, make_env: Callable, latency_for: Callable, step_span: Callable) -> None: ...
    async def stop(self) -> None: ...
    async def generate(self, task: Any, group: int, sample: int, expected_group_size: int) -> Any: ...
    def kv_hit_rate(self) -> float: ...
    async def score_ref(self, trajectories: Sequence) -> tuple[list, bool]: ...
    async def train(self, trajectories: Sequence) -> dict: ...
    async def publish(self, version: int) -> bool: ...
    async def move(self, from_role: str, to_role: str) -> None: ...
    def compile_s(self) -> float: ...
    def arrays(self) -> dict[str, Any] | None: ...
    def restore_arrays(self, arrays: dict[str, Any], *, step: int, version: int) -> None: ...
    def load_policy(self, params, version: int) -> None: ...
