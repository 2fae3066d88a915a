"""Run metrics: waiting from spans, goodput, staleness; JSONL, TensorBoard events, timeline PNG."""

import json
import os
import time

import pytest

from tiderl_jax.runtime.metrics import RunMetrics


def test_waiting_goodput_and_outputs(tmp_path):
    m = RunMetrics(str(tmp_path), total_steps=2, devices={"rollout": 4, "train": 4})
    with m.span("rollout", "generate"):
        time.sleep(0.2)
    with m.span("train", "train"):
        time.sleep(0.1)
    m.consume(tokens=300, samples=6, lags={0: 200, 1: 100}, reward=0.5)
    m.log_step(1, {"reward": 0.5, "loss": 0.1})
    m.set_devices("rollout", 6)  # an ERS move: the rollout lane grows
    m.set_devices("train", 2)
    with m.span("rollout", "generate"):
        time.sleep(0.1)
    m.consume(tokens=100, samples=2, lags={0: 100}, reward=1.0)
    m.log_step(2, {"reward": 1.0, "loss": 0.05})
    s = m.summary()
    wall = s["wall_s"]
    # rollout: held 4 devices until the move, then 6; busy 0.2 s x 4 + 0.1 s x 6
    assert s["rollout_wait_s"] == pytest.approx(m.device_s["rollout"] + 6 * (wall - m._held_since["rollout"])
                                                - (0.2 * 4 + 0.1 * 6), abs=0.05)
    assert s["rollout_wait_s"] < 10 * wall and s["trainer_wait_s"] > 0
    assert s["goodput_tokens_per_s"] == pytest.approx(400 / wall, rel=0.01)
    assert s["staleness"] == {0: 300, 1: 100} and s["mean_reward"] == 0.75 and s["steps"] == 2
    png = m.plot_timeline(str(tmp_path / "timeline.png"))
    m.close()
    assert os.path.getsize(png) > 1000
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["loss"] == 0.05
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))
