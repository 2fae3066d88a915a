"""Where TideRL beats asynchronous training on this CPU and where it does not: tiderl / async (and tiderl / sync)
over a sweep of the workload, with what bounds each point, from the runs' own metrics (issue 18).

    python benchmarks/regime_map.py [--quick] [--json out.json] [--rounds 2] [--modes async tiderl]
                                    [--points NAME ...]

Every point is benchmarks/goodput.py's workload with one setting changed from its defaults (the centre):
environment latency (median 0.05 s and 1.5 s against 0.3 s), turns (at most 3 against 8), context (512 tokens
against 1024), GRPO group size (8 against 4), groups per update (8 against 4) and the staleness bound (eta 2
against 1). At each point goodput.py's fair measurement runs (`goodput.measure`: every program loaded before a
run's window, the modes interleaved over `--rounds` rounds with the order rotated; no warm-up pass per point:
the persistent compile cache is already warm and each run loads its programs before its window), and the point
gets the median of the per-round ratios with their range, and the bound goodput.py reads off each run (the rollout
lane's and the trainer lanes' idle shares: `rollout`, `trainer` or `waiting`). With `async-aa` among the modes
(goodput.py's A/A control: async run twice per round), async-aa / async is the point's noise band, and a point
where tiderl / async's median falls below that band's low end (and below 1) is marked as harm ("below A/A").

Output: a table, `--json` rows (one per point and ratio: point, setting, value, ratio, median, low, high,
async_bound, tiderl_bound, harm, rounds; and the runs themselves under `runs`), and `--plot` [regime_map.png]: the
ratios per point with their ranges, each marked with what bounded async there.
"""

import argparse
import json
import logging
import sys

import goodput  # noqa: E402 (benchmarks/goodput.py: sets the environment before JAX loads)

from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402

# (name, setting, value): one change from goodput.py's defaults per point
POINTS = (("centre", None, None), ("latency 0.05 s", "latency_median", 0.05), ("latency 1.5 s", "latency_median", 1.5),
          ("3 turns", "max_turns", 3), ("context 512", "max_context", 512), ("group size 8", "group_size", 8),
          ("8 groups", "groups", 8), ("eta 2", "eta", 2))


def plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({r["ratio"] for r in rows})
    points = list(dict.fromkeys(r["point"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, ratio in enumerate(ratios):
        xs, ys, lo, hi, labels = [], [], [], [], []
        for i, p in enumerate(points):
            r = next((r for r in rows if r["point"] == p and r["ratio"] == ratio), None)
            if r:
                xs.append(i + 0.15 * (k - (len(ratios) - 1) / 2))
                ys.append(r["median"])
                lo.append(r["median"] - r["low"])
                hi.append(r["high"] - r["median"])
                labels.append(r["async_bound"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=ratio)
        for x, y, b in zip(xs, ys, labels):
            ax.annotate(b, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels(points, rotation=20, fontsize=8)
    ax.set_ylabel("goodput ratio (median, range over rounds)")
    ax.set_title("TideRL on this CPU over the workload (labels: what bounds async)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two points, one round of 3 updates")
    p.add_argument("--json")
    p.add_argument("--plot", default="regime_map.png")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["async", "tiderl"], choices=goodput.MODES)
    p.add_argument("--points", nargs="+", default=[n for n, _, _ in POINTS], choices=[n for n, _, _ in POINTS])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2)
    goodput.add_workload_flags(p)
    args = p.parse_args()
    if args.quick:
        args.points, args.rounds, args.steps, args.skip = args.points[:2], 1, 3, 1
    args.warmup_steps, args.heldout = 0, 0
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tiderl_jax").setLevel(logging.WARNING)
    tok = Tokenizer.builtin()
    warm = goodput.warm_start(tok, args)
    rows, runs = [], []
    for name, setting, value in POINTS:
        if name not in args.points:
            continue
        point = argparse.Namespace(**vars(args))
        if setting:
            setattr(point, setting, value)
        print(f"\n== {name} ==", flush=True)
        out = goodput.measure(args.modes, warm, tok, point)
        runs += [dict(r, point=name) for r in out["rows"]]
        s = out["summary"]
        aa = s.get("async-aa/async")
        for ratio in ("tiderl/async", "tiderl/sync", "async-aa/async"):
            if ratio in s:
                # harm: tiderl's median below async's A/A noise band (async-aa / async's low end over the rounds)
                harm = (s[ratio]["median"] < min(aa["low"], 1.0)) if ratio == "tiderl/async" and aa else None
                rows.append(dict(point=name, setting=setting, value=value, ratio=ratio, rounds=args.rounds,
                                 async_bound=s.get("async", {}).get("bound"), tiderl_bound=s["tiderl"]["bound"],
                                 harm=harm, **{k: s[ratio][k] for k in ("median", "low", "high")}))
    print(f"\n{'point':<16}{'ratio':<16}{'median':>8}{'range':>18}{'async bound':>13}{'tiderl bound':>14}"
          f"{'below A/A':>11}")
    for r in rows:
        print(f"{r['point']:<16}{r['ratio']:<16}{r['median']:>8.2f}   [{r['low']:.2f}, {r['high']:.2f}]"
              f"{r['async_bound'] or '':>13}{r['tiderl_bound']:>14}{'' if r['harm'] is None else r['harm']!s:>11}")
    print(f"\nwrote {plot(rows, args.plot)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, runs=runs), f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
