"""P-PAS at CPU scale: end-to-end request latency under static small, static large and adaptive budgets.

    python benchmarks/prefill_budget.py [--quick] [--json out.json]

The engine batches decodes with chunks of pending prefills; the prefill budget caps the prompt tokens
per step (`tiderl_jax/policies/prefill_budget.py`). P-PAS (docs/mechanisms.md) uses the small cap only
under prefill pressure (>= 2 requests prefilling while >= 1 decodes). The paper's budgets are 2048
vs 16384 tokens on GPUs; here 256 vs 2048 (the same 1:8 ratio, scaled to a 2-core CPU).

Regimes (the tiny Qwen2 model of engine_throughput.py, sampling, fixed output lengths):
- `bursts`: 16 requests decode long outputs (prompt 64, 192 new tokens) while two bursts of
  6 long prompts (768 tokens, 24 new tokens) arrive at 0.3 s and 2.5 s;
- `light`: 12 requests with 512..1024-token prompts and 24 new tokens, Poisson arrivals
  (mean gap 0.6 s): rarely more than one at a time.
Every policy runs the same requests in this one process after one shared warm-up (all shape
buckets compiled), so the latencies compare. The claim checked: P-PAS within 10% of the better
static budget (p50 and p95) in each regime.
JSON rows: regime, policy, e2e_latency_p50_s, e2e_latency_p95_s (+ ratio_vs_best_static_p50/p95).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()

import numpy as np  # noqa: E402

from benchmarks.engine_throughput import MODEL  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402

POLICIES = {
    "static small (256)": dict(prefill_policy="static", prefill_budget=256),
    "static large (2048)": dict(prefill_policy="static", prefill_budget=2048),
    "p-pas (2048 / 256)": dict(prefill_policy="ppas", prefill_budget=2048, prefill_pressure_budget=256),
}
BASE = dict(page_size=16, num_pages=4096, max_seq_len=1152, max_running=32, prefill_chunk=512,
            max_prefill_rows=8, decode_steps=8)


def regime(name, quick, seed=0):
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(0, MODEL.vocab_size, n).tolist()  # noqa: E731
    if name == "bursts":
        n_bg, burst, new_bg = (8, 4, 96) if quick else (16, 6, 192)
        reqs = [dict(prompt=tok(64), new=new_bg, at=0.0) for _ in range(n_bg)]
        for at in (0.3, 2.5):
            reqs += [dict(prompt=tok(768), new=24, at=at) for _ in range(burst)]
        return reqs
    n = 6 if quick else 12
    arrivals = np.cumsum(rng.exponential(0.6, n))
    return [dict(prompt=tok(int(rng.integers(512, 1025))), new=24, at=float(a)) for a in arrivals]


def run(engine, reqs):
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["at"])
    handles, nxt = {}, 0
    start = time.perf_counter()
    while nxt < len(order) or engine.has_work():
        now = time.perf_counter() - start
        while nxt < len(order) and reqs[order[nxt]]["at"] <= now:
            i = order[nxt]
            handles[i] = engine.submit(Request(reqs[i]["prompt"], SamplingParams(
                temperature=1.0, max_new_tokens=reqs[i]["new"], seed=i)))
            nxt += 1
        if engine.has_work():
            engine.step()
        else:
            time.sleep(min(0.002, max(0.0, reqs[order[nxt]]["at"] - now)))
    lat = [engine.get(handles[i]).latency_s for i in range(len(reqs))]
    for h in handles.values():
        engine.forget(h)
    return np.asarray(lat)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    model = init_decoder(MODEL, seed=0)
    engines = {name: Engine(model, EngineConfig(**BASE, **kw)) for name, kw in POLICIES.items()}
    first = next(iter(engines.values()))
    print(f"warm-up: {first.num_programs()} programs", flush=True)
    print(f"warm-up took {first.warmup():.1f}s", flush=True)  # compiled programs are shared
    rows = []
    for reg in ("bursts", "light"):
        reqs = regime(reg, args.quick)
        for name, engine in engines.items():
            run(engine, regime(reg, args.quick, seed=1))  # untimed pass: same shapes, other tokens
            engine.pool.drop_cached()
            lat = run(engine, reqs)
            rows.append(dict(regime=reg, policy=name, e2e_latency_p50_s=float(np.percentile(lat, 50)),
                             e2e_latency_p95_s=float(np.percentile(lat, 95))))
            print(f"[{reg}] {name}: p50 {rows[-1]['e2e_latency_p50_s']:.2f}s "
                  f"p95 {rows[-1]['e2e_latency_p95_s']:.2f}s", flush=True)
    for reg in ("bursts", "light"):
        statics = [r for r in rows if r["regime"] == reg and r["policy"].startswith("static")]
        for r in rows:
            if r["regime"] == reg:
                for q in ("p50", "p95"):
                    best = min(s[f"e2e_latency_{q}_s"] for s in statics)
                    r[f"ratio_vs_best_static_{q}"] = r[f"e2e_latency_{q}_s"] / best
    print(f"\n{'regime':<8}{'policy':<22}{'p50 s':>8}{'p95 s':>8}{'p50/best static':>17}{'p95/best static':>17}")
    for r in rows:
        print(f"{r['regime']:<8}{r['policy']:<22}{r['e2e_latency_p50_s']:>8.2f}{r['e2e_latency_p95_s']:>8.2f}"
              f"{r['ratio_vs_best_static_p50']:>17.2f}{r['ratio_vs_best_static_p95']:>17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
