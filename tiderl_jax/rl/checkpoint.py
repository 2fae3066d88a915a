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
from typing import Any

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

    def save(self, step: int, params, opt_state, meta: dict[str, Any], *, ref_params=None) -> None:
        """Starts saving (returns before the arrays are on disk unless async saving is off)."""
        items = dict(params=ocp.args.StandardSave(_pure(params)),
                     opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta))
        if ref_params is not None:
            items["ref_params"] = ocp.args.StandardSave(_pure(ref_params))
        self.manager.save(step, args=ocp.args.Composite(**items))

    def restore(self, params_like, opt_state_like, step: int | None = None, *, ref_params_like=None):
        """(params, opt_state, meta) of `step` (default: the latest), placed like `params_like` and
        `opt_state_like` (same structure, shapes and shardings); with `ref_params_like`,
        (params, opt_state, meta, ref_params)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; "
                                  f"steps there: {self.all_steps()}")
        items = dict(params=ocp.args.StandardRestore(_abstract(_pure(params_like))),
                     opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                     meta=ocp.args.JsonRestore())
        if ref_params_like is not None:
            items["ref_params"] = ocp.args.StandardRestore(_abstract(_pure(ref_params_like)))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # a damaged or mismatched checkpoint: name it, do not crash obscurely
            raise CheckpointError(f"cannot restore step {step} from {self.directory}: "
                                  f"{type(e).__name__}: {e}") from e
        result = (_like(params_like, out["params"]), out["opt_state"], out["meta"])
        if ref_params_like is not None:
            result += (_like(ref_params_like, out["ref_params"]),)
        return result

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
