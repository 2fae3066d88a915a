"""Logical-axis sharding: parameter axis names -> mesh axes (`data`, `fsdp`, `tensor`, `context`).

Every parameter of the decoder names its axes (`embed`, `vocab`, `mlp`, `q_heads`, `kv_heads`,
`head_dim`, `norm`, and a vision model's `patch`, `image_patches`); activations and caches use `batch`, `seq`, `cache_seq`. A rule table from the
config maps each logical name to zero, one or several mesh axes. `spec_for` turns one array's names
into a `PartitionSpec`, dropping a mesh axis where it would not divide the dimension evenly (a tiny
model's 2 KV heads on a 4-way tensor axis are replicated rather than refused) or where an earlier
dimension of the same array already uses it.

Meshes are built with Auto axis types: the model is classic GSPMD code (jit with in/out shardings),
and `jax.make_mesh` defaults to Explicit axes, which would demand explicit output shardings on
every sharded contraction (docs/architecture.md, Conventions).
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tiderl_jax.model.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "context")

# FSDP shards the embedding dimension of every weight; tensor parallelism splits heads, the MLP's
# hidden dimension and the vocabulary (Megatron style). Batch goes over data and fsdp. Context
# parallelism shards the sequence (a long shared prompt's tokens and K/V: rl/context_parallel.py);
# every mesh has the axis, of size 1 unless a train mesh asks for more.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", "context"),
    ("cache_seq", "context"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("patch", None),  # flattened pixels of one image patch
    ("image_patches", None),  # patch index within an image (the patch position embedding)
)

Rules = Sequence[tuple[str, str | Sequence[str] | None]]


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes (data, fsdp, tensor, context).

    One axis may be -1: it takes whatever the others leave. The product must equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"mesh: unknown axis name(s) {unknown}; axes are {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if fixed <= 0 or len(devices) % fixed:
            raise ConfigError(
                f"mesh: {dict(zip(MESH_AXES, sizes))} cannot fill {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // fixed
    if any(s <= 0 for s in sizes) or math.prod(sizes) != len(devices):
        raise ConfigError(
            f"mesh: shape {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"{len(devices)} given; set one axis to -1 to fill")
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def rules_from_config(rules: Iterable) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Normalises a rule table (lists from a config) to ((logical, (mesh axes...)), ...)."""
    out = []
    for entry in rules:
        if len(entry) != 2:
            raise ConfigError(f"sharding rule {entry!r} must be a (logical_name, mesh_axes) pair")
        name, axes = entry
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        axes = tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ConfigError(f"sharding rule for {name!r} names unknown mesh axes {bad}")
        out.append((name, axes))
    return tuple(out)


def spec_for(shape: Sequence[int], names: Sequence[str | None] | None, rules: Rules,
             mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of one array of `shape` whose axes are called `names`.

    Each logical name takes the mesh axes of its rule, in order, while they divide the dimension
    and have not been used by an earlier dimension; unnamed or unknown names are replicated.
    """
    if names is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"axis names {tuple(names)} do not match shape {tuple(shape)}")
    table = dict(rules_from_config(rules))
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, names):
        chosen = []
        size = 1
        for axis in table.get(name, ()) if name else ():
            n = mesh.shape[axis]
            if axis in used or n == 1 or dim % (size * n):
                continue
            chosen.append(axis)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


class ActivationSharding:
    """Pins activations to their logical layout inside a jitted forward (`with_sharding_constraint`).

    A model placed on a mesh by `shard_model` / `init_sharded` / `load_hf_checkpoint` carries one, so
    GSPMD keeps the batch split over (data, fsdp) and the vocabulary over tensor instead of choosing
    a layout per call. Static: hashed by identity of the mesh and the rules.
    """

    def __init__(self, mesh: Mesh, rules: Rules):
        self.mesh = mesh
        self.rules = rules_from_config(rules)

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        spec = spec_for(x.shape, names, self.rules, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def __eq__(self, other):
        return isinstance(other, ActivationSharding) and (self.mesh, self.rules) == (other.mesh, other.rules)

    def __hash__(self):
        return hash((self.mesh, self.rules))


def _axes_of(variable: nnx.Variable):
    return variable.get_metadata().get("axes")


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules):
    """A pytree like `state` (abstract or concrete) of NamedShardings, from each leaf's axis names."""

    def one(v):
        value = v.get_value() if _is_variable(v) else v
        names = _axes_of(v) if _is_variable(v) else None
        return NamedSharding(mesh, spec_for(value.shape, names, rules, mesh))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Moves every parameter of `model` onto its NamedSharding on `mesh` (in place; returns model)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    model.activation_sharding = ActivationSharding(mesh, rules)
    return model


def init_sharded(module_fn, mesh: Mesh, rules: Rules) -> nnx.Module:
    """Builds `module_fn()` with every parameter created directly in its sharding (no host copy).

    The initialiser runs under jit with out_shardings, so each device computes only its own shard.
    """
    abstract = nnx.eval_shape(module_fn)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)

    def build():
        return nnx.split(module_fn())[1]

    state = jax.jit(build, out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    model.activation_sharding = ActivationSharding(mesh, rules)
    return model


def data_sharding(mesh: Mesh, rules: Rules, shape: Sequence[int],
                  names: Sequence[str | None] = ("batch", "seq")) -> NamedSharding:
    """Sharding of an activation-like input (tokens, positions) of `shape` named `names`."""
    return NamedSharding(mesh, spec_for(shape, names, rules, mesh))


def place_copy(tree, shardings):
    """`tree` on `shardings`, in buffers of its own. `jax.device_put` may hand back buffers shared
    with the source (same layout, or a replicated leaf whose target devices already hold a
    replica), and a train step that donates its parameters would then delete them under whoever
    shares them (a rollout engine, a reference model)."""
    moved = put(tree, shardings)
    return jax.jit(lambda t: jax.tree.map(lambda x: x.copy(), t), out_shardings=shardings)(moved)


# ---------------------------------------------------------------------- across processes (jax.distributed)
# A process reads and writes only its own devices' buffers. A layout whose devices span processes is moved in
# two phases (docs/multihost.md): reshard within the source devices to a layout every process holds whole (an
# all-gather, a collective every process takes part in), then a same-layout copy from a local device.


def local_replica(tree):
    """Each array leaf's whole value on one of this process's devices: unchanged where the leaf is already on this
    process's devices only, else all-gathered within its own devices first (one program for the tree; every
    process must call it at the same point)."""
    leaves, treedef = jax.tree.flatten(tree)
    spanning = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if not spanning:
        return tree
    whole = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in spanning)
    gathered = _gather(whole)([leaves[i] for i in spanning])
    for i, x in zip(spanning, gathered):
        leaves[i] = x.addressable_data(0)
    return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=64)
def _gather(shardings: tuple):
    """One jitted all-gather per target layout (a new function per call would trace and look up its program
    every time: measured, most of a cross-process weight sync's seconds)."""
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def host_value(x) -> np.ndarray:
    """An array's whole value as numpy on this host (an all-gather when it spans processes: `local_replica`)."""
    return np.asarray(local_replica(x))




def from_host(x, sharding):
    """A host value on `sharding`. Across processes each process fills its own devices' shards from its copy,
    which must be the same on every process (no communication: `jax.device_put` of a host value onto devices of
    several processes would first check, in a collective of its own, that every process passed the same)."""
    x = np.asarray(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def put(tree, shardings):
    """`jax.device_put` that also crosses processes: a leaf moves directly when source and target are this
    process's devices alone or the same devices, else through `local_replica` (the two-phase move) and
    `from_host`. `shardings` is one sharding or a prefix tree of `tree` (as for `jax.device_put`)."""
    if isinstance(shardings, jax.sharding.Sharding):
        targets, prefix, subs = [shardings], None, [tree]
    else:
        targets, prefix = jax.tree.flatten(shardings)
        subs = prefix.flatten_up_to(tree)
    pieces = [jax.tree.flatten(sub) for sub in subs]
    crossing = [(i, j) for i, (leaves, _) in enumerate(pieces) for j, x in enumerate(leaves)
                if _crosses(x, targets[i])]
    if not crossing:
        return jax.device_put(tree, shardings)
    whole = local_replica([pieces[i][0][j] for i, j in crossing])
    for (i, j), x in zip(crossing, whole):
        pieces[i][0][j] = x if targets[i].is_fully_addressable else from_host(x, targets[i])
    subs = [treedef.unflatten(leaves) for leaves, treedef in pieces]
    return jax.device_put(subs[0] if prefix is None else prefix.unflatten(subs), shardings)


def _crosses(x, sharding) -> bool:
    """Whether `jax.device_put(x, sharding)` would move data between processes (or check it across them)."""
    if not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_addressable:
        return isinstance(x, jax.Array) and not x.is_fully_addressable
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.sharding.device_set != sharding.device_set
    return True  # a host value or this process's array onto devices of several processes: `from_host`
