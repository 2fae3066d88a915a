"""Whether a main job fits its devices, from its config alone: the train step's bytes per device (XLA's memory
analysis of the update compiled from abstract weights, `rl/trainer.py`'s `step_memory`) on the train mesh the
device pool builds, and a rollout replica's weights and KV page pool per device on its group's mesh.

`check_fits` runs at start-up on a GPU or TPU, before any weight is loaded, and refuses a config whose train step
or engine exceeds the device's memory, naming the keys that change it. `benchmarks/memory_plan.py` prints the
plans of the real presets (docs/accelerators.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import Rules, spec_for, state_shardings
from tiderl_jax.runtime.pool import group_mesh


def train_devices(controller) -> int:
    """The train side's device count: its groups (async / tiderl), or every group (sync: one mesh for all)."""
    groups = controller.train_groups
    if controller.mode == "sync":
        groups += controller.rollout_groups + controller.ref_groups
    return groups * controller.device_group_size


def train_mesh_shape(controller) -> dict:
    n, t = train_devices(controller), controller.tensor
    t = t if n % t == 0 else 1
    return {"fsdp": n // t, "tensor": t}


# The depths a deep model's train step is compiled at: from 4 layers on, its bytes per device grow by the same
# amount with each decoder layer (that layer's weights, gradient and moments, its activations kept for the
# backward), so two shallow compiles give the whole model's line (`train_step_bytes(exact=False)`). Measured on
# Qwen2.5-0.5B's update at rows of 4,096 (fsdp 4): 15.86 GB at 4 layers, 20.76 at 8, and 40.4 compiled whole (24
# layers), as the line through 4 and 8 gives; 2 layers (10.92) lie below it. A whole-depth compile takes minutes
# on a CPU (816 s there) where the shallow ones take seconds.
SHALLOW = (4, 8)


def train_step_bytes(model: ModelConfig, trainer, controller, rules: Rules, devices=None, *,
                     exact: bool = False) -> int:
    """Peak bytes per device of one update (arguments + outputs + temporaries - donated buffers): compiled at
    the model's depth (`exact`, or a model of at most SHALLOW[1] layers), else the line through two shallow
    compiles (`SHALLOW` layers) at its depth."""
    from tiderl_jax.rl.trainer import step_memory

    devices = list(devices or jax.devices())[:train_devices(controller)]
    if len(devices) < train_devices(controller):
        raise ConfigError(f"the train side needs {train_devices(controller)} devices; {len(devices)} are here")
    mesh = group_mesh(devices, controller.tensor)

    def peak(layers: int) -> int:
        mem = step_memory(dataclasses.replace(model, num_layers=layers), trainer, mesh, rules)
        return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                   - mem.alias_size_in_bytes)
    if exact or model.num_layers <= SHALLOW[1]:
        return peak(model.num_layers)
    (l1, l2), (p1, p2) = SHALLOW, (peak(SHALLOW[0]), peak(SHALLOW[1]))
    return p1 + (p2 - p1) * (model.num_layers - l1) // (l2 - l1)


def engine_bytes(model: ModelConfig, engine, controller, rules: Rules, devices=None) -> tuple[int, int]:
    """(KV page pool, weights) bytes per device of one rollout replica on a device group: the pool's
    [pages, kv_heads, page_size, head_dim] keys and values in the model's dtype, and the parameters (held in
    their own dtype), each as its sharding on the group's mesh cuts it."""
    devices = list(devices or jax.devices())[:controller.device_group_size]
    mesh = group_mesh(devices, controller.tensor)
    pool = (engine.num_pages, model.num_kv_heads, engine.page_size, model.head_dim)
    spec = spec_for(pool, (None, "kv_heads", None, "head_dim"), rules, mesh)
    kv = 2 * model.num_layers * _shard_bytes(pool, jax.numpy.dtype(model.dtype), jax.sharding.NamedSharding(mesh, spec))
    state = nnx.split(nnx.eval_shape(lambda: init_decoder(model, seed=0)))[1]
    weights = sum(_shard_bytes(x.shape, x.dtype, s) for x, s in
                  zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings(state, mesh, rules))))
    return int(kv), int(weights)


def _shard_bytes(shape, dtype, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(shape))) * jax.numpy.dtype(dtype).itemsize


def check_fits(c, platform: str, *, limit: int | None = None) -> None:
    """On a GPU or TPU (or with `limit` bytes given), ConfigError when the train step or a rollout replica needs
    more than a device holds, naming the keys that change it; nothing on the CPU (its memory is the host's)."""
    if limit is None:
        if platform == "cpu":
            return
        limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if not limit:
            return
    from tiderl_jax import config as config_lib

    controller, trainer, engine, _, _ = config_lib.rl_configs(c)
    model, rules = config_lib.model_config(c), config_lib.sharding_rules(c)
    train = train_step_bytes(model, trainer, controller, rules)
    gib = 2 ** 30
    if train > limit:
        raise ConfigError(
            f"the train step needs {train / gib:.1f} GiB per device of the {limit / gib:.1f} GiB here (rows of "
            f"trainer.row_len={trainer.row_len} tokens, trainer.micro_rows={trainer.micro_rows} per micro-batch, "
            f"trainer.remat={trainer.remat!r}, {train_mesh_shape(controller)}): set trainer.remat=full, lower "
            f"trainer.micro_rows or trainer.row_len, or give the train side more devices "
            f"(controller.train_groups, controller.device_group_size)")
    kv, weights = engine_bytes(model, engine, controller, rules)
    if kv + weights > limit:
        raise ConfigError(
            f"a rollout replica needs {(kv + weights) / gib:.1f} GiB per device of the {limit / gib:.1f} GiB here "
            f"(weights {weights / gib:.1f} GiB, KV pool {kv / gib:.1f} GiB of engine.num_pages={engine.num_pages} "
            f"pages of engine.page_size={engine.page_size}): lower engine.num_pages, or raise controller.tensor "
            f"or controller.device_group_size")
