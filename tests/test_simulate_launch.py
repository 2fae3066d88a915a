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


def test_a_rerun_in_the_same_log_directory_starts_each_run_anew(tmp_path):
    # its metrics are not appended to the earlier run's (the plots read them)
    for _ in range(2):
        out = _simulate(tmp_path, "--config.modes=('tiderl',)")
        assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "32" / "tiderl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_a_bad_mode_is_refused_by_name(tmp_path):
    out = _simulate(tmp_path, "--config.modes=('tiderl+magic',)")
    assert out.returncode == 2 and "tiderl+magic" in out.stderr


def test_mode_grammar_baselines_and_ablations():
    sys.path.insert(0, ROOT)
    from launch import simulate
    m = simulate.parse_mode("async@0.125")
    assert (m.base, m.split, m.options, m.off) == ("async", 0.125, set(), set())
    assert simulate.parse_mode("async@oracle").split == "oracle"
    assert simulate.parse_mode("tiderl-ctb-ers").off == {"ctb", "ers"}
    assert simulate.parse_mode("tiderl+bidirl-ers") == ("tiderl", None, {"bidirl"}, {"ers"})
    assert simulate.parse_mode("streamrl").base == "streamrl"
    for bad in ("async@1.5", "async@0", "tiderl@0.25", "sync-ctb", "async-ers", "tiderl-magic", "tiderl+ctb",
                "async@oracle+bidirl", "streamrl+war", "tiderl-ers-ers"):
        try:
            simulate.parse_mode(bad)
        except simulate.ConfigError as e:
            assert repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_baselines_ladder_and_oracle_at_a_small_size(tmp_path):
    """The issue-18 modes run end to end: fixed train shares and the oracle sweep give the layouts they name,
    the ladder's rungs switch the mechanisms (no moves without ERS, request-level KV without CTB), and the
    ladder and baseline tables and the moves plot come out."""
    modes = ("async@0.25", "async@oracle", "streamrl", "tiderl-ctb-ers", "tiderl-ctb", "tiderl")
    out = subprocess.run([sys.executable, "launch/simulate.py", "--config=configs/sim_tiderl_baselines.py",
                          f"--config.logdir={tmp_path}", "--config.sizes=32", "--config.steps=6",
                          "--config.oracle_train_groups=(2,4,6)", f"--config.modes={modes!r}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["mode"]: r for r in json.load(open(tmp_path / "results.json"))["rows"]}
    assert rows["async@0.25"]["layout"] == dict(rollout=6, ref=0, train=2)  # 8 groups of 4 at 32
    oracle = rows["async@oracle"]
    assert set(oracle["oracle_sweep"]) == {"2", "4", "6"}
    assert oracle["goodput_tokens_per_s"] == max(oracle["oracle_sweep"].values())
    assert oracle["layout"]["train"] == oracle["oracle_train_groups"]
    assert rows["tiderl-ctb-ers"]["moves"] == 0 and rows["tiderl-ctb"]["layout"]["ref"] > 0
    # request-level KV (no CTB) hits less than pinned KV across tool calls
    assert rows["tiderl"]["kv_hit_rate"] > rows["tiderl-ctb"]["kv_hit_rate"]
    assert "StreamRL" in out.stdout and "+CTB" in out.stdout and "tiderl / async@oracle" in out.stdout
    assert (tmp_path / "moves.png").stat().st_size > 0
    assert all(len(r["trace"]) == 6 for r in rows.values())
