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

import contextlib
import logging
import os
import threading
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


def _shapes(tree) -> dict[str, tuple]:
    """Array path -> shape of every leaf with a shape (live arrays, or orbax's stored array metadata)."""
    def name(key) -> str:  # a dict key, index or attribute alike (orbax stores integer keys as strings)
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def _shape_mismatch(like, stored) -> str:
    """What differs between the target tree `like` and a checkpoint item's stored metadata, "" if nothing
    is seen to. Path by path where both spell their paths alike (parameter trees), else the multiset of
    shapes when both have as many arrays (a restore pairs arrays one to one, so different multisets cannot
    restore); otherwise "" (orbax decides)."""
    want, have = _shapes(like), _shapes(getattr(stored, "tree", stored))
    if want.keys() == have.keys():
        bad = [p for p in want if want[p] != have[p]]
        if bad:
            return (f"{len(bad)} arrays differ in shape, first {bad[0]}: {have[bad[0]]} in the checkpoint, "
                    f"{want[bad[0]]} in the target")
        return ""
    if len(want) == len(have) and sorted(want.values()) != sorted(have.values()):
        extra = sorted(set(have.values()) - set(want.values()))
        return (f"its array shapes differ from the target's (shapes only in the checkpoint: {extra[:3]}"
                f"{' ...' if len(extra) > 3 else ''})")
    return ""


class _UnregisteredItems(logging.Filter):
    """Drops orbax's warning that a fresh manager (a resumed run's) has no handler yet for an item it then restores
    with the arguments it is given: 'Item "params" was found in the checkpoint, but could not be restored ...'."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "was found in the checkpoint, but could not be restored" not in record.getMessage()


@contextlib.contextmanager
def _quiet_unregistered_items():
    logger, quiet = logging.getLogger("absl"), _UnregisteredItems()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def latest_saved_step(self) -> int | None:
        """The newest step whose save has finished on disk (orbax renames a step's directory to its number when
        it finalises it): unlike `latest_step`, never a save still in flight, which a process that exits now
        abandons."""
        steps = [int(n) for n in os.listdir(self.directory) if n.isdigit()] if os.path.isdir(self.directory) else []
        return max(steps, default=None)

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
        with _quiet_unregistered_items():
            try:  # shapes first: orbax's failed reads leave background tasks behind (and a less clear error)
                stored = self.manager.item_metadata(step)
                mismatch = {name: _shape_mismatch(_pure(tree), stored[name]) for name, tree in like.items()
                            if name in stored}
            except Exception:  # noqa: BLE001 - no readable metadata: the restore below names what is wrong
                mismatch = {}
            for name, what in mismatch.items():
                if what:
                    raise CheckpointError(f"cannot restore step {step} from {self.directory}: {name!r}: {what}")
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **items))
            except Exception as e:  # a damaged or mismatched checkpoint: name it, do not crash obscurely
                first = (str(e).strip().splitlines() or [""])[0]  # orbax appends the whole tree dump
                first = first.split(" See full TensorStore details")[0]  # and TensorStore its spec's repr
                raise CheckpointError(f"cannot restore step {step} from {self.directory}: "
                                      f"{type(e).__name__}: {first}") from e
        return {name: _like(tree, out[name]) for name, tree in like.items()}, out["meta"]

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def settled_step(self, timeout_s: float = 30.0) -> int | None:
        """`latest_saved_step` once a save in flight has finished, waiting up to `timeout_s` for it (a process
        about to exit: what it names as the checkpoint to resume from is then what is on disk; a save still
        unfinished after the timeout is left to whatever happens to it, and the older step named)."""
        waiter = threading.Thread(target=self.manager.wait_until_finished, daemon=True)
        waiter.start()
        waiter.join(timeout_s)
        return self.latest_saved_step()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
