"""benchmarks/goodput.py's fairness machinery (issue 18): modes interleaved over rounds with the order rotated,
medians and per-round paired ratios, each run's window rates and what bounds it, read from its own metrics."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def goodput():
    spec = importlib.util.spec_from_file_location("goodput_bench", ROOT / "benchmarks" / "goodput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_rotate_the_order_so_no_mode_is_always_first(goodput):
    order = []
    rows = goodput.rounds(["sync", "async", "tiderl"], 3, lambda m, r: order.append((r, m)) or dict(mode=m))
    assert order == [(0, "sync"), (0, "async"), (0, "tiderl"), (1, "async"), (1, "tiderl"), (1, "sync"),
                     (2, "tiderl"), (2, "sync"), (2, "async")]
    assert [r["round"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_medians_and_paired_ratios(goodput):
    def row(mode, r, g, bound="rollout"):
        return dict(mode=mode, round=r, goodput_tokens_per_s=g, bound=bound, step_time_s=1.0, rollout_wait_s=0.0,
                    trainer_wait_s=0.0, rollout_idle=0.1, trainer_idle=0.2, compile_s=0.0, kv_hit_rate=0.5, moves=0)
    rows = [row("async", 0, 100), row("tiderl", 0, 120), row("async", 1, 50), row("tiderl", 1, 55, "trainer"),
            row("async", 2, 200), row("tiderl", 2, 180)]
    s = goodput.medians(rows)
    assert (s["async"]["median"], s["async"]["low"], s["async"]["high"]) == (100, 50, 200)
    # ratios within a round (1.2, 1.1, 0.9), not medians of each side (120 / 100)
    assert s["tiderl/async"]["median"] == pytest.approx(1.1)
    assert (s["tiderl/async"]["low"], s["tiderl/async"]["high"]) == (pytest.approx(0.9), pytest.approx(1.2))
    assert s["tiderl"]["bound"] == "rollout" and "tiderl/sync" not in s and "async-aa/async" not in s
    # the A/A control: async run again under its own name gives the noise band of async's goodput, paired per round
    s = goodput.medians(rows + [row("async-aa", 0, 90), row("async-aa", 1, 60), row("async-aa", 2, 200)])
    assert s["async-aa/async"]["median"] == pytest.approx(1.0)
    assert (s["async-aa/async"]["low"], s["async-aa/async"]["high"]) == (pytest.approx(0.9), pytest.approx(1.2))


def test_the_aa_control_runs_async_under_its_own_name(goodput, monkeypatch):
    calls = []

    def run_mode(mode, *a, label, **kw):
        if mode == "async-aa":
            return real(mode, *a, label=label, **kw)
        calls.append((mode, label))
        return dict(mode=mode, goodput_tokens_per_s=1.0)
    real = goodput.run_mode
    monkeypatch.setattr(goodput, "run_mode", run_mode)
    row = real("async-aa", None, None, None, steps=3, skip=1, heldout=0, label="round 1/1")
    assert calls == [("async", "round 1/1 (A/A)")] and row["mode"] == "async-aa"


def _metrics(tmp_path, rows):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(tmp_path)


def test_window_rates_bound_and_compiles_come_from_the_runs_own_metrics(goodput, tmp_path):
    # a disaggregated run (4 rollout devices, 4 train + ref): the trainer idles 60% of the window, the
    # rollout 20%: the rollout bounds it; 1.5 s of program loads fell inside the window
    rows = [dict(wall_s=10.0, consumed_tokens=1000, consumed_samples=10, rollout_wait_total_s=5.0,
                 trainer_wait_total_s=5.0, rollout_devices=4, compile_total_s=30.0),
            dict(wall_s=20.0, consumed_tokens=2000, consumed_samples=20, rollout_wait_total_s=9.0,
                 trainer_wait_total_s=17.0, rollout_devices=4, compile_total_s=31.5),
            dict(wall_s=30.0, consumed_tokens=3000, consumed_samples=30, rollout_wait_total_s=13.0,
                 trainer_wait_total_s=29.0, rollout_devices=4, compile_total_s=31.5)]
    r = goodput._rates(_metrics(tmp_path, rows), skip=1)
    assert r["goodput_tokens_per_s"] == pytest.approx(100.0) and r["step_time_s"] == pytest.approx(10.0)
    assert r["rollout_idle"] == pytest.approx(8 / 80) and r["trainer_idle"] == pytest.approx(24 / 80)
    assert r["bound"] == "rollout" and r["compile_s"] == pytest.approx(1.5)
    # the rollout devices mostly idle while the trainer starves: the environment's waiting bounds it
    # (window idle shares: rollout (8 + 40) / 80 = 0.6, trainer (24 + 40) / 80 = 0.8)
    for x, extra in zip(rows[1:], (20.0, 40.0)):
        x["rollout_wait_total_s"] += extra
        x["trainer_wait_total_s"] += extra
    assert goodput._rates(_metrics(tmp_path, rows), skip=1)["bound"] == "waiting"
    # the rollout idles more than the trainer: the trainer bounds it
    for x in rows:
        x["trainer_wait_total_s"] = 0.0
    assert goodput._rates(_metrics(tmp_path, rows), skip=1)["bound"] == "trainer"


def test_regime_map_sweeps_one_setting_at_a_time_and_plots(goodput, tmp_path, monkeypatch):
    """benchmarks/regime_map.py's glue, with goodput's measurement stubbed: each point changes one setting from
    the centre, the ratios and bounds of its summary land in the rows, and the plot is written."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setitem(sys.modules, "goodput", goodput)
    spec = importlib.util.spec_from_file_location("regime_map", ROOT / "benchmarks" / "regime_map.py")
    regime_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regime_map)
    seen = []

    def measure(modes, warm, tok, args):
        seen.append((args.latency_median, args.max_turns, args.eta, args.rounds, args.warmup_steps))
        ratio = 1.5 if args.latency_median > 1 else 1.0
        # the A/A band: async-aa / async within [0.9, 1.05] at every point
        return dict(rows=[dict(mode=m, round=0) for m in modes], summary={
            "async": dict(bound="waiting" if ratio > 1 else "trainer"), "tiderl": dict(bound="rollout"),
            "tiderl/async": dict(median=ratio - 0.15 * (args.eta == 2), low=ratio - 0.2, high=ratio + 0.1),
            "async-aa/async": dict(median=1.0, low=0.9, high=1.05)})
    monkeypatch.setattr(goodput, "measure", measure)
    monkeypatch.setattr(goodput, "warm_start", lambda tok, args: None)
    out = tmp_path / "map.json"
    monkeypatch.setattr(sys, "argv", ["regime_map.py", "--points", "centre", "latency 1.5 s", "eta 2", "--json",
                                      str(out), "--plot", str(tmp_path / "map.png")])
    regime_map.main()
    assert seen == [(0.3, 8, 1, 2, 0), (1.5, 8, 1, 2, 0), (0.3, 8, 2, 2, 0)]
    rows = [r for r in json.load(open(out))["rows"] if r["ratio"] == "tiderl/async"]
    # harm only where tiderl / async's median is below the A/A band's low end: eta 2's 0.85 < 0.9
    assert [(r["point"], r["median"], r["async_bound"], r["harm"]) for r in rows] == [
        ("centre", 1.0, "trainer", False), ("latency 1.5 s", 1.5, "waiting", False),
        ("eta 2", pytest.approx(0.85), "trainer", True)]
    assert (tmp_path / "map.png").stat().st_size > 0
