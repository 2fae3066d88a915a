"""launch/train.py's warm start: SFT in chunks until the sampled policy reaches the target on the probe tasks
(checked every `probe_every` steps from `min_steps` on), or the step cap."""

import importlib.util
import pathlib
import sys

import pytest
from ml_collections import ConfigDict

from tiderl_jax.agents.trajectory import Trajectory

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("launch_train", ROOT / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch_train"] = module
    spec.loader.exec_module(module)
    return module


class _Controller:
    engine = object()

    def __init__(self):
        self.loaded = []

    def load_policy(self, params):
        self.loaded.append(params)


def _run(train, monkeypatch, successes, **sft):
    """Runs `_warm_start` with SFT and sampling stubbed: probe i succeeds at `successes[i]`."""
    chunks, probes = [], iter(successes)

    def warm_start(trainer, tok, kinds, n, batch, seed, log_every, first_task):
        chunks.append((n, first_task))
        return [1.0] * n

    def sample_groups(engine, tok, tasks, samples, config):
        rate = next(probes)
        return [Trajectory("t", "calculator", 0, reward=float(i < rate * len(tasks) * samples))
                for i in range(len(tasks) * samples)]
    monkeypatch.setattr(train.sft, "warm_start", warm_start)
    monkeypatch.setattr(train.evaluate, "sample_groups", sample_groups)
    cfg = ConfigDict(dict(tasks=("calculator",), seed=0, sft=dict(
        dict(steps=100, batch_size=4, log_every=10, target=0.25, min_steps=30, probe_every=10, probe_tasks=4,
             probe_samples=2), **sft)))
    controller = _Controller()
    curve = train._warm_start(controller, type("W", (), {"params": "weights"})(), None, cfg,
                              train.RolloutConfig())
    return curve, chunks, controller


def test_the_warm_start_stops_at_the_first_probe_that_reaches_the_target(train, monkeypatch):
    curve, chunks, controller = _run(train, monkeypatch, [0.0, 0.125, 0.25, 1.0])
    # probes at 30, 40, 50: the third reaches 0.25; each chunk continues the demonstration stream
    assert len(curve) == 50 and chunks == [(10, 0), (10, 40), (10, 80), (10, 120), (10, 160)]
    assert controller.loaded == ["weights"] * 3


def test_the_warm_start_stops_at_its_cap_and_without_a_target_runs_it_whole(train, monkeypatch):
    curve, _, controller = _run(train, monkeypatch, [0.0] * 10)
    assert len(curve) == 100 and len(controller.loaded) == 7  # probes at 30..90; none at the cap
    curve, chunks, controller = _run(train, monkeypatch, [], target=0.0)
    assert len(curve) == 100 and chunks == [(100, 0)] and not controller.loaded
