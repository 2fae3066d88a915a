"""Orbax checkpoints: a resumed run equals an uninterrupted one, and nothing of the runtime is lost."""

import dataclasses
import gc
import logging

import jax
import numpy as np
import pytest

from test_trainer import CFG, TRAJS, _config, _params, _traj
from tiderl_jax.trajectory import Trajectory
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.hf_io import CheckpointError
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl.checkpoint import Checkpointer
from tiderl_jax.rl.trainer import Trainer

BATCHES = [TRAJS, TRAJS[:4], [_traj(i, 10, float(i % 2), i // 2, seed=5) for i in range(6)], TRAJS[2:]]


def _run(trainer, batches):
    for b in batches:
        trainer.rl_step(b)


def test_two_steps_restart_two_steps_equals_four_straight(tmp_path):
    straight = Trainer(init_decoder(CFG, seed=1), _config())
    _run(straight, BATCHES)

    first = Trainer(init_decoder(CFG, seed=1), _config())
    _run(first, BATCHES[:2])
    ckpt = Checkpointer(tmp_path / "ckpt")
    rng = np.random.default_rng(7)
    rng.random(3)
    ready = [TRAJS[0], TRAJS[3]]
    ckpt.save(first.step_count, dict(params=first.params, opt_state=first.opt_state, ref=first.ref_params),
              {"step": first.step_count, "rng": rng.bit_generator.state, "cursor": 2,
               "ready": [t.to_dict() for t in ready], "in_flight": ["calculator/train/0/9"]})
    ckpt.close()
    del first

    # a new process would start here: a freshly initialised trainer (other seed) is overwritten
    resumed = Trainer(init_decoder(CFG, seed=99), _config())
    ckpt = Checkpointer(tmp_path / "ckpt")
    arrays, meta = ckpt.restore(dict(params=resumed.params, opt_state=resumed.opt_state, ref=resumed.ref_params))
    resumed.params, resumed.opt_state, resumed.ref_params = arrays["params"], arrays["opt_state"], arrays["ref"]
    resumed.step_count = meta["step"]
    _run(resumed, BATCHES[meta["cursor"]:])
    for a, b in zip(_params(straight), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    # the runtime state came back whole: RNG stream, ready buffer, in-flight tasks
    again = np.random.default_rng()
    again.bit_generator.state = meta["rng"]
    assert again.random() == rng.random()
    assert [Trajectory.from_dict(d) for d in meta["ready"]] == ready
    assert meta["in_flight"] == ["calculator/train/0/9"]


def test_keep_last_n_and_latest(tmp_path):
    trainer = Trainer(init_decoder(CFG, seed=2), _config())
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        trainer.rl_step(TRAJS)
        ckpt.save(step, dict(params=trainer.params, opt_state=trainer.opt_state), {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    _, meta = ckpt.restore(dict(params=trainer.params, opt_state=trainer.opt_state), step=2)
    assert meta == {"step": 2}
    with pytest.raises(CheckpointError, match="no checkpoint of step 1"):
        ckpt.restore(dict(params=trainer.params), step=1)
    ckpt.close()


def test_a_resumed_run_restores_without_library_warnings(tmp_path, caplog):
    """A fresh manager (a resumed run's) reads the latest step quietly: orbax warns about every item it has no
    handler for yet ('Item "params" was found in the checkpoint, but could not be restored'), which reached the
    main job's output on each resume."""
    trainer = Trainer(init_decoder(CFG, seed=2), _config())
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, dict(params=trainer.params, opt_state=trainer.opt_state), {"step": 1})
    ckpt.close()
    caplog.set_level(logging.WARNING)
    arrays, meta = Checkpointer(tmp_path).restore(dict(params=trainer.params, opt_state=trainer.opt_state))
    assert meta == {"step": 1} and set(arrays) == {"params", "opt_state"}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_restore_onto_a_mesh_keeps_the_shardings(tmp_path):
    single = Trainer(init_decoder(CFG, seed=3), _config())
    single.rl_step(TRAJS)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, dict(params=single.params, opt_state=single.opt_state), {"step": 1})
    ckpt.wait()
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    sharded = Trainer(shard_model(init_decoder(CFG, seed=0), mesh, DEFAULT_RULES), _config(), mesh=mesh)
    arrays, _ = ckpt.restore(dict(params=sharded.params, opt_state=sharded.opt_state))
    params = arrays["params"]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded.params)):
        assert a.sharding == b.sharding
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_missing_or_mismatched_checkpoints_are_named_errors(tmp_path):
    trainer = Trainer(init_decoder(CFG, seed=4), _config())
    empty = Checkpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        empty.restore(dict(params=trainer.params))
    empty.close()
    ckpt = Checkpointer(tmp_path / "other")
    ckpt.save(1, dict(params=trainer.params, opt_state=trainer.opt_state), {"step": 1})
    ckpt.wait()
    bigger = Trainer(init_decoder(dataclasses.replace(CFG, hidden_size=64), seed=0), _config())
    # named from the stored shapes, before orbax reads anything (its failed reads left tasks and coroutines
    # behind, reported later as unraisable exceptions in whatever test ran then)
    with pytest.raises(CheckpointError, match=r"cannot restore step 1 .*'params': \d+ arrays differ in shape, "
                                              r"first embed: \(\d+, 32\) in the checkpoint, \(\d+, 64\) in the target"):
        ckpt.restore(dict(params=bigger.params, opt_state=bigger.opt_state))
    arrays, meta = ckpt.restore(dict(params=trainer.params, opt_state=trainer.opt_state))  # the right shapes
    assert meta["step"] == 1
    ckpt.close()
    gc.collect()  # anything left behind is reported here, as an error


def test_latest_saved_step_is_the_newest_finished_save_never_one_in_flight(tmp_path):
    """What an interrupted multi-process run names as the checkpoint to resume from: the newest step directory
    orbax has finalised (renamed to its number), not a save still in flight (its temporary directory)."""
    from tiderl_jax.rl.checkpoint import Checkpointer
    ck = Checkpointer(tmp_path / "ck")
    assert ck.latest_saved_step() is None
    (tmp_path / "ck" / "2").mkdir()
    (tmp_path / "ck" / "3.orbax-checkpoint-tmp-1765000000").mkdir()
    assert ck.latest_saved_step() == 2
    (tmp_path / "ck" / "10").mkdir()
    assert ck.latest_saved_step() == 10
    # a save just started (asynchronous): settled_step waits for it and names it
    ck.save(11, {"params": {"w": jax.numpy.ones((4, 4))}}, {"step": 11})
    assert ck.settled_step() == 11 and (tmp_path / "ck" / "11").is_dir()
    ck.close()
