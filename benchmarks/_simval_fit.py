"""benchmarks/sim_validation.py's fit and simulation: raw measurements -> `MeasuredCosts` per mode (`fit`,
`fit_call_overhead`), goodput.py's configuration simulated on `SimBackend` with the real controller (`simulate`,
the rollout loop alone: `simulate_rollout`), and goodput.py's measured JSON rows read back (`load_measured`)."""

import dataclasses
import json
import os
import statistics
import tempfile

from _env import setup

ROOT = setup(devices=8)


from tiderl_jax.agents import tasks as task_lib  # noqa: E402
from tiderl_jax.runtime.controller import ControllerConfig  # noqa: E402
from tiderl_jax.sim import backend as sim_backend  # noqa: E402
from tiderl_jax.sim import costs, workloads  # noqa: E402

from _simval_workload import (ENGINE, GROUP_SIZE, GROUPS, KINDS, KV_MODE, LATENCY, LAYOUTS, LONG,  # noqa: E402
                              MAX_CONCURRENT, MODES, ROLLOUT_IN_FLIGHT, SKIP, STEPS, TRAINER, demo_shapes,
                              goodput_workload, replay_sampler, shape_sampler, shared_prefix)


def fit(raw: dict, log=print, rollout: bool = True) -> dict[str, costs.MeasuredCosts]:
    """`MeasuredCosts` per mode from the raw measurements (`calibrate`; `--calibration` re-fits a saved
    run's raw measurements with this code). `rollout`: the rollout loop was measured alone."""
    overlap = {n: (raw[f"overlap_{n}_rollout_x"], raw[f"overlap_{n}_train_x"])
               for n in sorted({LAYOUTS[m][2] for m in MODES if m != "sync"})}
    fits = {}
    for n in sorted({LAYOUTS[m][0] for m in MODES}):
        d4, d16 = raw[f"decode_{n}_b4"], raw[f"decode_{n}_b16"]
        per_seq = max(0.0, (d16 - d4) / 12)
        # attention: decode per context token read, prefill per (new, earlier) token pair, from the long contexts
        per_kv = max(0.0, (raw[f"decode_{n}_b16_long"] - d16) / max(1, raw[f"decode_{n}_b16_long_kv"]
                                                                     - raw[f"decode_{n}_b16_kv"]))
        per_pair = max(0.0, (raw[f"prefill_{n}_c{LONG}"] - raw[f"prefill_{n}_c0"])
                       / max(1.0, raw[f"prefill_{n}_c{LONG}_pairs"] - raw[f"prefill_{n}_c0_pairs"]))
        # the short measurements' own context and pairs, taken out of their fixed and per-sequence/token parts:
        # d(B) = step + per_seq * B + per_kv * context (the same context per sequence at 4 and 16)
        (p1, n1, q1), (p4, n4, q4) = [tuple(raw[f"prefill_{n}_{k}{x}"] for x in ("", "_tokens", "_pairs"))
                                      for k in (1, 4)]
        per_tok = max(0.0, (p4 - p1 - per_pair * (q4 - q1)) / max(1, n4 - n1))
        fits[n] = dict(decode_step_s=max(0.0, d4 - 4 * per_seq),
                       decode_per_seq_s=max(0.0, per_seq - per_kv * raw[f"decode_{n}_b16_kv"] / 16),
                       decode_per_kv_token_s=per_kv, prefill_fixed_s=max(0.0, p1 - per_tok * n1 - per_pair * q1),
                       prefill_per_token_s=per_tok, prefill_per_pair_s=per_pair)
        log(f"rollout on {n} devices: decode step {d4 * 1e3:.2f} ms (4 seqs) / {d16 * 1e3:.2f} ms (16) / "
            f"{raw[f'decode_{n}_b16_long'] * 1e3:.2f} ms (16 of {LONG} tokens); prefill {p1 * 1e3:.1f} ms "
            f"({n1} tokens) / "
            f"{p4 * 1e3:.1f} ms ({n4}); 4 x 48 tokens after 0 / {LONG} cached {raw[f'prefill_{n}_c0'] * 1e3:.1f} / "
            f"{raw[f'prefill_{n}_c{LONG}'] * 1e3:.1f} ms")
    for n in sorted({LAYOUTS[m][2] for m in MODES}):
        t = {k: raw[f"train_{n}_{k}"] for k in ("tokens", "time_proximal_s", "time_ref_s", "time_update_s")}
        log(f"train on {n} devices ({t['tokens']} tokens): proximal {t['time_proximal_s']:.2f}s, "
            f"ref {t['time_ref_s']:.2f}s, update {t['time_update_s']:.2f}s")
    log(f"ref pass on 2 devices: {raw['ref_2']:.2f}s ({raw['ref_2_tokens']} tokens); weight sync: " +
        ", ".join(f"{k[5:]} {v * 1e3:.0f} ms" for k, v in raw.items() if k.startswith("sync_")))
    if "programs_2_update_s" in raw:
        log("programs of a new trainer / scorer (first call minus a warm one): " + ", ".join(
            f"{n} devices: score {raw[f'programs_{n}_score_s']:.2f}s, update {raw[f'programs_{n}_update_s']:.2f}s, "
            f"ref {raw[f'programs_{n}_ref_s']:.2f}s" for n in sorted({LAYOUTS[m][2] for m in MODES})))
    log("shared cores (rollout on 4 devices, training on n): " + ", ".join(
        f"n={n}: rollout x{xr:.1f}, train x{xt:.2f}" for n, (xr, xt) in overlap.items()) + " while the other runs")
    out = {}
    for m in MODES:
        roll, ref, train = LAYOUTS[m]
        # the trainer computes whole packed micro-batches: its times per micro-batch of the measured batch
        micro, ref_micro = raw["train_micro"], raw["ref_2_micro"]
        out[m] = costs.MeasuredCosts(
            **fits[roll], score_fixed_s=0.0, score_per_token_s=0.0,
            score_per_micro_s=raw[f"train_{train}_time_proximal_s"] / micro,
            update_fixed_s=0.0, update_per_token_s=0.0, update_per_micro_s=raw[f"train_{train}_time_update_s"] / micro,
            ref_fixed_s=0.0, ref_per_token_s=0.0, ref_per_micro_s=raw["ref_2"] / ref_micro,
            sync_s=raw[f"sync_{roll}_{train}"], switch_s=10.0,
            rollout_overlap_x=1.0 if m == "sync" else overlap[train][0],
            train_overlap_x=1.0 if m == "sync" else overlap[train][1], program_s=raw.get("program_s", 0.0),
            score_program_s=raw.get(f"programs_{train}_score_s", 0.0),
            update_program_s=raw.get(f"programs_{train}_update_s", 0.0),
            ref_program_s=raw.get(f"programs_{ref}_ref_s", 0.0) if ref else 0.0,
            source=f"benchmarks/sim_validation.py on this CPU: rollout {roll}, ref {ref}, train {train} fake devices")
    if rollout:  # the rollout loop's time per engine call beyond the model, per mode's rollout
        for kv, mode, in_flight in (("request_8", "sync", GROUPS), ("request", "async", 2 * GROUPS),
                                    ("ctb", "tiderl", 2 * GROUPS)):
            raw[f"call_overhead_{kv}_s"] = fit_call_overhead(out[mode], raw[f"rollout_{kv}_shapes"], kv.split("_")[0],
                                                             raw[f"rollout_{kv}_wall_s"], in_flight, mode)
            log(f"rollout loop ({kv}): {raw[f'call_overhead_{kv}_s'] * 1e3:.1f} ms of host time per engine call "
                f"beyond the engine's own")
        out = {m: dataclasses.replace(c, call_overhead_s=raw[f"call_overhead_{KV_MODE[m]}_s"]) for m, c in out.items()}
    return out


def fit_call_overhead(measured: costs.MeasuredCosts, shapes: list[list[tuple]], kv_mode: str, wall_s: float,
                      in_flight: int = ROLLOUT_IN_FLIGHT, mode: str = "") -> float:
    """`MeasuredCosts.call_overhead_s` that makes the simulated rollout loop alone (`simulate_rollout`: the
    same samples, no programs to load) take the `wall_s` the real one took (`_Lab.rollout`): what the
    real loop spends per engine call beyond the engine's own calls measured alone (the driver's thread
    hand-off, its commands, the tasks' Python, environment steps). 0 when the simulation is slower already."""
    def wall(x):
        return simulate_rollout(dataclasses.replace(measured, call_overhead_s=x, program_s=0.0), shapes, kv_mode,
                                in_flight, mode)["wall_s"]
    lo, hi = 0.0, 0.05
    if wall(lo) >= wall_s:
        return 0.0
    while wall(hi) < wall_s and hi < 10.0:
        lo, hi = hi, hi * 2
    for _ in range(30):  # bisection (the simulated wall grows with the overhead)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if wall(mid) < wall_s else (lo, mid)
    return (lo + hi) / 2


# ------------------------------------------------------------------ simulation

def simulate(mode: str, measured: costs.MeasuredCosts, shapes: dict, seed: int, programs: set | None = None,
             replay: list | None = None) -> dict:
    """goodput.py's `run_mode` on `SimBackend`: rates over updates SKIP+1..STEPS (goodput.py's `_rates`).
    `programs`: the engine programs the simulated process has run (goodput.py runs its modes in turn in
    one process, so a mode finds in memory what an earlier one compiled on the same devices); `replay`: the
    real policy's samples per group (`replay_sampler`), else the demonstrations' shapes."""
    w = goodput_workload(shapes)
    ccfg = ControllerConfig(mode="tiderl" if mode == "limit" else mode, steps=STEPS, groups_per_step=GROUPS,
                            group_size=GROUP_SIZE, max_concurrent=MAX_CONCURRENT, task_kinds=KINDS,
                            device_group_size=2, rollout_groups=2, ref_groups=0 if mode == "async" else 1,
                            train_groups=2 if mode == "async" else 1, tensor=2)
    sim = sim_backend.SimConfig(workload=w, tp=0, page_size=ENGINE["page_size"], kv_pages=ENGINE["num_pages"],
                                max_batch=ENGINE["max_running"], decode_chunk=ENGINE["decode_steps"],
                                measured=measured, engine_steps=True, shared_prefix_tokens=shared_prefix(shapes),
                                prefill_chunk=ENGINE["prefill_chunk"], prefill_budget=ENGINE["prefill_budget"],
                                max_seq_len=ENGINE["max_seq_len"],
                                train_row_len=TRAINER["row_len"], train_micro_rows=TRAINER["micro_rows"], seed=seed)
    logdir = tempfile.mkdtemp(prefix=f"simval_{mode}_")
    summary, _, _ = sim_backend.run(sim, ccfg, num_devices=8, logdir=logdir,
                                    shape_sampler=(shape_sampler if replay is None else replay_sampler)(
                                        shapes if replay is None else replay, None if mode == "limit" else LATENCY),
                                    programs=programs)
    rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
    a, b = rows[SKIP - 1], rows[-1]
    span = b["wall_s"] - a["wall_s"]
    return dict(goodput_tokens_per_s=(b["consumed_tokens"] - a["consumed_tokens"]) / span,
                late_goodput_tokens_per_s=_window_rate(rows, LATE),
                step_time_s=span / (len(rows) - SKIP), kv_hit_rate=summary["kv_hit_rate"],
                moves=summary["moves"], discarded=summary["discarded"])


LATE = 5  # updates skipped by the second comparison (goodput.py's own logs): past the programs' first loads


def _window_rate(rows: list[dict], skip: int) -> float:
    """Consumed tokens per second over updates skip+1..last of metrics.jsonl rows (goodput.py's `_rates`)."""
    a, b = rows[skip - 1], rows[-1]
    return (b["consumed_tokens"] - a["consumed_tokens"]) / (b["wall_s"] - a["wall_s"])


def simulate_rollout(measured: costs.MeasuredCosts, shapes: list[list[tuple]], kv_mode: str, in_flight: int,
                     mode: str = "") -> dict:
    """`_Lab.rollout`'s scenario on `SimBackend` (no training, so no shared cores): the same sample shapes
    (group g: shapes[g], one per sample), no environment latency, `in_flight` groups at a time. Returns the
    virtual seconds, the engine calls (events) and prefill events simulated, and the KV hit rate."""
    import asyncio

    from tiderl_jax.runtime.pool import split_devices

    mode = mode or ("tiderl" if kv_mode == "ctb" else "async")  # (sync: one engine on all 8 devices)
    every = [r for g in shapes for r in g]
    w = dataclasses.replace(goodput_workload(demo_shapes(4)), turns=workloads.Fixed(
        round(statistics.mean(len(r[1]) for r in every))))
    sim = sim_backend.SimConfig(workload=w, tp=0, page_size=ENGINE["page_size"], kv_pages=ENGINE["num_pages"],
                                max_batch=ENGINE["max_running"], decode_chunk=ENGINE["decode_steps"],
                                measured=dataclasses.replace(measured, rollout_overlap_x=1.0, train_overlap_x=1.0),
                                engine_steps=True, shared_prefix_tokens=shared_prefix(demo_shapes(4)),
                                prefill_chunk=ENGINE["prefill_chunk"], prefill_budget=ENGINE["prefill_budget"],
                                max_seq_len=ENGINE["max_seq_len"])
    pool = None if mode == "sync" else split_devices(range(8), mode=mode, group_size=2, rollout=2,
                                                     ref=1 if mode == "tiderl" else 0,
                                                     train=1 if mode == "tiderl" else 2, tensor=2)
    b = sim_backend.SimBackend(sim, mode=mode, pool=pool, num_devices=8)
    b.shape_sampler = lambda g, rng, n: [workloads.TaskSample(r[0], tuple(r[1]), tuple(r[2]), (0.0,) * len(r[2]), False)
                                         for r in shapes[g][:n]]
    events = []
    walk = b._walk

    def counted(r, until):  # one entry per event timed (a re-timed event is counted once: last wins)
        t = walk(r, until)
        events.append((r.span_start, r.one_step))
        return t
    b._walk = counted

    async def main():
        await b.start(None, None, None)
        slots = asyncio.Semaphore(in_flight)

        async def group(g):
            async with slots:
                task = task_lib.make_task(KINDS[g % len(KINDS)], g // len(KINDS), "train", 0)
                await b.generate_group(task, g, list(range(len(shapes[g]))), len(shapes[g]))
        t0 = b.loop.time()
        await asyncio.gather(*(group(g) for g in range(len(shapes))))
        wall = b.loop.time() - t0
        await b.stop()
        return wall
    try:
        asyncio.set_event_loop(b.loop)
        wall = b.loop.run_until_complete(main())
    finally:
        asyncio.set_event_loop(None)
        b.loop.close()
    starts = {}
    for start, one in events:
        starts[start] = one
    return dict(wall_s=wall, calls=len(starts), one_step_calls=sum(starts.values()), kv_hit_rate=b.kv_hit_rate())


def load_measured(paths: list[str]) -> tuple[dict[str, list[float]], list[str], dict[str, list[float]]]:
    """Per mode: goodput.py's goodput of each run, the files used, and each run's goodput over updates
    LATE+1.. from the run's own metrics.jsonl (its `logdir`, where it still exists)."""
    by, used, late = {}, [], {}
    for p in paths:
        if not os.path.exists(p):
            continue
        used.append(p)
        for row in json.load(open(p)):
            by.setdefault(row["mode"], []).append(float(row["goodput_tokens_per_s"]))
            log = os.path.join(row.get("logdir", ""), "metrics.jsonl")
            if os.path.exists(log):
                rows = [json.loads(line) for line in open(log)]
                if len(rows) > LATE:
                    late.setdefault(row["mode"], []).append(_window_rate(rows, LATE))
    return by, used, late
