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


def test_shared_lanes_count_each_device_once(tmp_path):
    # sync: rollout and train take turns on the same 8 devices. Over 10 s: generate 0-3 and 4-5
    # (the trainer waits for data 0-6), train 6-9; idle 3-4 and 5-6 (rollout waiting, 2 s) and
    # 9-10 (trainer waiting, 1 s), each x 8 devices; busy time is never counted as waiting.
    m = RunMetrics(str(tmp_path), total_steps=1, devices={"rollout": 8, "train": 8},
                   shared=("rollout", "train"))
    m.spans += [("rollout", "generate", 0.0, 3.0), ("rollout", "generate", 4.0, 5.0),
                ("train", "train", 6.0, 8.5), ("train", "sync", 8.0, 9.0)]
    m.data_waits.append((0.0, 6.0))
    m.now = lambda: 10.0
    assert m.waiting() == {"rollout": pytest.approx(16.0), "train": pytest.approx(8.0)}
    # replicas that finished their share while others still generate: idle inside the span
    m.idle_in_spans["rollout"] += 5.0
    assert m.waiting() == {"rollout": pytest.approx(21.0), "train": pytest.approx(8.0)}
    m.close()
    with pytest.raises(ValueError, match="same device count"):
        RunMetrics(str(tmp_path / "x"), total_steps=1, devices={"rollout": 8, "train": 4},
                   shared=("rollout", "train"))


def test_the_timeline_draws_each_lane_and_kind_as_one_collection(tmp_path, monkeypatch):
    """A sync run records thousands of spans; drawn one collection each, its timeline took 100 s."""
    import matplotlib.axes

    m = RunMetrics(str(tmp_path), total_steps=1, devices={"rollout": 2, "train": 2})
    m.spans += [("rollout", "generate", i, i + 0.5) for i in range(1000)]
    m.spans += [("train", "train", i + 0.5, i + 0.75) for i in range(1000)]
    m.spans += [("train", "sync", i + 0.75, i + 0.75) for i in range(1000)]  # zero-length: drawn 1e-3 wide
    calls = []
    draw = matplotlib.axes.Axes.broken_barh
    def counted(ax, ranges, yrange, **kw):
        calls.append((list(ranges), yrange))
        return draw(ax, ranges, yrange, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh", counted)
    m.plot_timeline(str(tmp_path / "timeline.png"))
    m.close()
    assert len(calls) == 3  # rollout/generate, train/train, train/sync
    by_row = {(yrange[0], len(ranges)): ranges for ranges, yrange in calls}
    rows = sorted(y for y, _ in by_row)
    generate = by_row[rows[0], 1000]  # the rollout lane (row 0), every span in place
    assert generate[:2] == [(0, 0.5), (1, 0.5)] and generate[-1] == (999, 0.5)
    assert sorted(len(r) for r, _ in calls) == [1000, 1000, 1000]
    assert min(w for r, _ in calls for _, w in r) == pytest.approx(1e-3)
