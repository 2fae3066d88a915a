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
from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from tiderl_jax.model.sharding import ActivationSharding, Rules, place_copy, state_shardings

from tiderl_jax.runtime.pool import ROLES, DevicePool  # noqa: F401 (re-exported: the pool lives there)

log = logging.getLogger(__name__)

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
    bytes: int = 0  # of the weights moved (a LoRA-trained policy's: its adapters alone)


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
            rec = SyncRecord(version, True, time.perf_counter() - t0, stage,
                             bytes=sum(x.nbytes for x in jax.tree.leaves(moved)))
        except Exception as e:  # roll back: the engine keeps serving the previous version
            rec = SyncRecord(version, False, time.perf_counter() - t0, stage, f"{type(e).__name__}: {e}")
            log.warning("weight sync to version %d failed at %s (%s); rolled back", version, stage, rec.error)
        self.history.append(rec)
        return rec
