"""Checkpoints with orbax-checkpoint: everything a resumed run needs to lose no work.

One checkpoint (a step directory under `directory`) holds:
- `params`, `opt_state` and, when the run has one that is not fixed elsewhere, `ref_params` (the
  reference model, e.g. a frozen copy of the starting policy): the trainer's arrays, saved from and
  restored onto their shardings (each host writes and reads only its shards);
- `meta` (JSON): the step, the skipped-step count, and whatever the run adds: RNG state, data
  cursor, and the runtime state that must survive a crash (the ready buffer's trajectories and the
  in-flight tasks), so that a resume loses no sampled work.

Saves are asynchronous (the step loop goes on while the arrays are written; `wait()` blocks until
the last save is durable), keep the last `keep` checkpoints, and a save is only visible once
complete (orbax writes to a temporary directory and renames), so a crash mid-save leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp
from flax import nnx

from tiderl_jax.model.hf_io import CheckpointError


def _abstract(tree):
    """Shape, dtype and sharding of every array: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _pure(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _like(params_like, pure):
    """`pure` (nested dicts) in the structure of `params_like` (an nnx.State or a plain tree)."""
    if not isinstance(params_like, nnx.State):
        return pure
    restored = jax.tree.map(lambda x: x, params_like)  # a copy of the structure
    nnx.replace_by_pure_dict(restored, pure)
    return restored


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, arrays: Mapping[str, Any], meta: dict[str, Any]) -> None:
        """Starts saving `arrays` (name -> pytree of jax arrays, e.g. params, opt_state, ref_params)
        and `meta` (JSON); returns before the arrays are on disk unless async saving is off."""
        items = {name: ocp.args.StandardSave(_pure(tree)) for name, tree in arrays.items()}
        self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))

    def restore(self, like: Mapping[str, Any], step: int | None = None) -> tuple[dict[str, Any], dict]:
        """(arrays, meta) of `step` (default: the latest). `like` names the array trees to restore
        and gives each one's structure, shapes, dtypes and shardings (the live trees they replace)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; "
                                  f"steps there: {self.all_steps()}")
        items = {name: ocp.args.StandardRestore(_abstract(_pure(tree))) for name, tree in like.items()}
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **items))
        except Exception as e:  # a damaged or mismatched checkpoint: name it, do not crash obscurely
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: "
                                  f"{type(e).__name__}: {e}") from e
        return {name: _like(tree, out[name]) for name, tree in like.items()}, out["meta"]

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
