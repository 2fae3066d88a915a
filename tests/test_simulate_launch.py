"""launch/simulate.py end to end on a small cluster: every mode (with the bidirl and war options) runs,
the table, the papers' anchors, results.json and the plots come out; a bad mode is refused by name."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simulate(tmp_path, *flags):
    return subprocess.run([sys.executable, "launch/simulate.py", "--config=configs/sim_tiderl_text.py",
                           f"--config.logdir={tmp_path}", "--config.sizes=32", "--config.steps=3", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_mode_runs_and_the_outputs_are_written(tmp_path):
    modes = ("sync", "sync+war", "async", "tiderl", "tiderl+bidirl")
    out = _simulate(tmp_path, f"--config.modes={modes!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    for mode in modes:
        assert f"   32 {mode} " in out.stdout
    assert "goodput tiderl / sync" in out.stdout and "goodput sync+war / sync" in out.stdout
    results = json.load(open(tmp_path / "results.json"))
    assert [r["mode"] for r in results["rows"]] == list(modes)
    assert all(r["goodput_tokens_per_s"] > 0 and r["steps"] == 3 for r in results["rows"])
    anchors = {a["anchor"]: a for a in results["anchors"]}
    assert anchors["goodput tiderl / sync"]["published"] == 5.6
    assert anchors["goodput tiderl / sync"]["simulated"] == next(r["vs_sync"] for r in results["rows"]
                                                                 if r["mode"] == "tiderl")
    assert (tmp_path / "goodput.png").stat().st_size > 0 and (tmp_path / "timeline_tiderl.png").stat().st_size > 0
    # what bounds each run, and the reading of the anchors it gives
    assert "what bounds each run" in out.stdout and "latency-bound" in results["regime"]
    assert all(0 < r["decode_batch"] <= r["decode_batch_limit"] and 0 < r["decode_capacity_used"] <= 1
               and 0 <= r["admission_held"] <= 1 for r in results["rows"])


def test_a_bad_mode_is_refused_by_name(tmp_path):
    out = _simulate(tmp_path, "--config.modes=('tiderl+magic',)")
    assert out.returncode == 2 and "tiderl+magic" in out.stderr
