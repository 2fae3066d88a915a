"""Cluster-scale simulation: the real controller on cost-modelled devices (issue 8).

    python launch/simulate.py --config=configs/sim_tiderl_text.py [--config.sizes=32,1024] [--config.steps=100]

For each cluster size and each mode (sync, async, tiderl, each optionally `+bidirl`: BiDiRL borrowing,
and for async its static planner; `+war`: WAR's speculative-decoding switch; the baselines `async@SHARE`
(a fixed train share of the devices), `async@oracle` (the best static split, every one simulated) and
`streamrl`; the ablations `tiderl-ctb-ers`, `tiderl-ctb`: `parse_mode`) it runs
`runtime.controller.Controller` on a `sim.backend.SimBackend` (virtual clock), then prints one table
(goodput, its ratios to sync and to async at the same size, per-step time, rollout and trainer
waiting, KV hit rate, ERS moves, BiDiRL borrows, wall seconds the simulation took) and the papers'
headline numbers against the simulation's (`ANCHORS`), then what bounds each run (`load_table`: the rollout
replicas' mean decode batch and the share of their decode throughput it uses, their prefill share, how long the
staleness bound held admission) and the reading of the TideRL anchors it gives (`regime`), and writes
`logdir/results.json` (one row per run, the anchors and that reading), `logdir/goodput.png` (goodput vs cluster
size per mode) and, at the smallest size, `logdir/timeline_<mode>.png` (what each device lane did over virtual
time, the controller's own `RunMetrics.plot_timeline`). With the ladder's modes it prints the ablation ladder
beside the paper's, with tiderl and the baselines tiderl against each, and `logdir/moves.png` shows ERS's moves
over time (the rollout's share of the devices after each step) with each step's trained tokens. A drifting
workload (`workloads.Drift`) draws each group's shapes at the step it is admitted. Each run's row is also
appended to `logdir/rows.jsonl` as the run ends (a 1024-accelerator run takes minutes).
"""

import dataclasses
import gc
import json
import logging as pylogging
import os
import sys
import re
import shutil
import textwrap
import time
import typing

from absl import app, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402
from tiderl_jax.policies import bidirl  # noqa: E402
from tiderl_jax.runtime.controller import ControllerConfig  # noqa: E402
from tiderl_jax.sim import backend as sim_backend  # noqa: E402
from tiderl_jax.sim import costs, workloads  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/sim_tiderl_text.py")
distributed.define_flags()


def controller_config(cfg, mode: str, size: int, workload: workloads.Workload,
                      rollout_groups: int | None = None) -> ControllerConfig:
    """The controller's settings for one run: batch scaled with the cluster, the mode's device layout
    (`rollout_groups`: an explicit async split, from BiDiRL's planner or the oracle sweep)."""
    c = cfg.controller
    m = parse_mode(mode)
    group = group_size(cfg, size)
    groups = size // group
    if groups * group != size or groups < 4:
        raise ConfigError(f"size {size}: needs at least 4 device groups of {group}")
    prompts = max(1, round(workload.prompts_per_step * size / workload.devices))
    batch = prompts * workload.group_size
    if m.base == "tiderl":
        ref, train = max(1, round(groups * c.tiderl_ref)), max(1, round(groups * c.tiderl_train))
    elif rollout_groups is not None:  # async+bidirl: the static planner's split; async@oracle: one of the sweep
        ref, train = 0, groups - rollout_groups
    else:  # async / streamrl: the mode's train share (`@share`) or the config's
        share = m.split if isinstance(m.split, float) else c.async_train
        ref, train = 0, min(groups - 1, max(1, round(groups * share)))
    return ControllerConfig(
        mode="async" if m.base == "streamrl" else m.base, bidirl="bidirl" in m.options, steps=cfg.steps,
        groups_per_step=prompts, group_size=workload.group_size, eta=0 if m.base == "sync" else c.eta,
        max_concurrent=c.concurrency_batches * batch, ctb="ctb" not in m.off, ers="ers" not in m.off,
        task_kinds=("calculator",), data_seed=cfg.seed,
        device_group_size=group, rollout_groups=groups - ref - train, ref_groups=ref,
        train_groups=train, tensor=cfg.sim.tp, ers_patience=c.ers_patience, ers_cooldown=c.ers_cooldown)


def group_size(cfg, size: int) -> int:
    """Devices per device group at this cluster size: `size / controller.device_groups` (ERS moves one
    group per step, so a group stays the same share of the cluster as it grows), at least
    `controller.device_group_size` (one node)."""
    c = cfg.controller
    if c.device_groups < 4:
        raise ConfigError(f"controller.device_groups={c.device_groups} must be >= 4 (rollout, ref, train)")
    return max(c.device_group_size, size // c.device_groups)


class Mode(typing.NamedTuple):
    base: str  # sync | async | tiderl | streamrl
    split: float | str | None  # async / streamrl: the train share of the device groups, or "oracle"
    options: set  # bidirl, war
    off: set  # tiderl's mechanisms switched off: ctb, ers


_MODE = re.compile(r"^(sync|async|tiderl|streamrl)(?:@(oracle|[0-9]*\.?[0-9]+))?((?:[+-][a-z0-9]+)*)$")


def parse_mode(mode: str) -> Mode:
    """`base[@split][+option...][-mechanism...]`:
    - base `sync`, `async`, `tiderl`, or `streamrl` (async streaming, the reference pass colocated with the
      actor and their weights swapped per micro-batch: `SimConfig.ref_swap`);
    - `@share` (async / streamrl): the train devices' share of the cluster (the paper's fixed ratios 0.125,
      0.25, 0.5), `@oracle` (async): the best static split, found by simulating every one;
    - options `+bidirl` (async / tiderl: BiDiRL borrowing, async+bidirl also its static planner) and `+war`
      (WAR's speculative-decoding switch in the replicas);
    - `-ctb`, `-ers` (tiderl): that mechanism off (the ablation ladder: `tiderl-ctb-ers` is StreamRL + RA2P,
      `tiderl-ctb` adds ERS, `tiderl` adds CTB)."""
    match = _MODE.match(mode)
    bad = ConfigError(f"mode {mode!r}: one of sync, async, tiderl, streamrl, optionally async@SHARE (0 < SHARE < 1) "
                      f"or async@oracle, with +bidirl and/or +war, and tiderl with -ctb and/or -ers")
    if not match:
        raise bad
    base, split, rest = match.groups()
    flags = re.findall(r"([+-])([a-z0-9]+)", rest)
    options = {f for sign, f in flags if sign == "+"}
    off = {f for sign, f in flags if sign == "-"}
    if len(flags) != len(options) + len(off) or not options <= {"bidirl", "war"} or not off <= {"ctb", "ers"}:
        raise bad
    if off and base != "tiderl":
        raise bad
    if split is not None:
        if base not in ("async", "streamrl") or (split == "oracle" and (base != "async" or options)):
            raise bad
        if split != "oracle":
            split = float(split)
            if not 0 < split < 1:
                raise bad
    if base == "streamrl" and options:
        raise bad
    return Mode(base, split, options, off)


def sim_config(cfg, mode: str = "sync") -> sim_backend.SimConfig:
    m = parse_mode(mode)
    return sim_backend.SimConfig(workload=cfg.workload, accelerator=cfg.accelerator, seed=cfg.seed,
                                 efficiency=costs.Efficiency(**cfg.efficiency.to_dict()),
                                 war_speculation="war" in m.options, ref_swap=m.base == "streamrl",
                                 **cfg.sim.to_dict())


def plan_bidirl(cfg, size: int, war: bool = False) -> tuple[int, dict]:
    """BiDiRL's static planner (`policies.bidirl.plan_partition`) on a time model measured by probes.

    Up to `cfg.bidirl_probes` rollout/train splits (evenly spread over the divisible ones) are each
    simulated in async mode for `cfg.bidirl_probe_steps` steps. Each probe gives, per step, the
    train pool's busy seconds (train_time at its size) and the seconds the rollout pool worked
    (the step time minus its devices' mean waiting: rollout_time at its size). Sizes between probes
    are interpolated linearly. A model from the probe's totals alone (work / devices) would miss
    what bounds the rollout here: a batch waits for its longest samples and its environment calls,
    which no added device shortens. Returns (rollout device groups, what the plan saw)."""
    workload = workloads.workload(cfg.workload)
    g = group_size(cfg, size)
    unit = cfg.sim.tp or 1
    splits = bidirl.candidate_splits(size, g, unit, unit)
    k = max(1, min(cfg.bidirl_probes, len(splits)))
    probes = sorted({splits[round(i * (len(splits) - 1) / max(1, k - 1))] for i in range(k)})
    rollout_at, train_at = {}, {}
    for d in probes:
        probe = controller_config(cfg, "async", size, workload, rollout_groups=d // g)
        probe = dataclasses.replace(probe, steps=cfg.bidirl_probe_steps)
        summary, controller, _ = sim_backend.run(sim_config(cfg, "async+war" if war else "async"), probe,
                                                 num_devices=size,
                                                 logdir=os.path.join(cfg.logdir, f"{size}", f"bidirl_probe_{d}"))
        steps = max(1, summary["steps"])
        train_at[size - d] = controller.metrics.busy_s["train"] / steps
        rollout_at[d] = summary["step_time_s"] - summary["rollout_wait_s"] / d / steps
    plan = bidirl.plan_partition(size, g, lambda d: _interpolate(rollout_at, d), lambda d: _interpolate(train_at, d),
                                 rollout_unit=unit, train_unit=unit)
    seen = dict(probe_rollout_s={str(d): v for d, v in rollout_at.items()},
                probe_train_s={str(d): v for d, v in train_at.items()},
                planned_rollout_devices=plan.best.rollout_devices, planned_step_s=plan.best.step_time_s)
    logging.info("%4d accelerators BiDiRL plan: rollout %d / train %d devices (planned step %.1fs; probes: rollout "
                 "%s, train %s)", size, plan.best.rollout_devices, plan.best.train_devices, plan.best.step_time_s,
                 {d: round(v, 1) for d, v in rollout_at.items()}, {d: round(v, 1) for d, v in train_at.items()})
    return plan.best.rollout_devices // g, seen


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through the measured points, flat beyond them."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    return points[xs[-1]]


def _simulate(cfg, mode: str, size: int, ccfg: ControllerConfig, logdir: str):
    """One simulated run: (summary, controller). A drifting workload's groups draw the shapes of the step they
    are admitted at (`workloads.drift_sampler`). The run's directory is written anew: its metrics would otherwise
    be appended to an earlier run's in the same log directory, and the plots would read both."""
    if os.path.isdir(logdir):
        shutil.rmtree(logdir)
    w = workloads.workload(cfg.workload)
    sampler = workloads.drift_sampler(w, groups_per_step=ccfg.groups_per_step, steps=ccfg.steps, seed=cfg.seed,
                                      sample_tasks=sim_backend.sample_tasks)
    summary, controller, _ = sim_backend.run(sim_config(cfg, mode), ccfg, num_devices=size, logdir=logdir,
                                             shape_sampler=sampler)
    return summary, controller


def run_one(cfg, mode: str, size: int) -> tuple[dict, object]:
    workload = workloads.workload(cfg.workload)
    plan = {}
    rollout_groups = None
    m = parse_mode(mode)
    if m.base == "async" and "bidirl" in m.options:
        rollout_groups, plan = plan_bidirl(cfg, size, war="war" in m.options)
    t0 = time.perf_counter()
    if m.split == "oracle":  # the best run of the sweep is the row
        rollout_groups, plan, (summary, controller) = oracle_split(cfg, size)
        ccfg = controller_config(cfg, mode, size, workload, rollout_groups)
    else:
        ccfg = controller_config(cfg, mode, size, workload, rollout_groups)
        summary, controller = _simulate(cfg, mode, size, ccfg, os.path.join(cfg.logdir, f"{size}", mode))
    row = dict(mode=mode, size=size, steps=summary["steps"], batch_samples=ccfg.batch_samples,
               goodput_tokens_per_s=summary["goodput_tokens_per_s"],
               goodput_samples_per_s=summary["goodput_samples_per_s"], step_time_s=summary["step_time_s"],
               rollout_wait_s=summary["rollout_wait_s"], trainer_wait_s=summary["trainer_wait_s"],
               kv_hit_rate=summary["kv_hit_rate"], moves=summary["moves"], borrows=summary["borrows"],
               borrows_refused=summary["borrows_refused"], discarded=summary["discarded"],
               staleness=summary["staleness"], virtual_s=summary["wall_s"],
               sim_wall_s=time.perf_counter() - t0, sim=summary["sim"],
               decode_batch=summary["decode_load"].get("decode_batch", 0.0),
               decode_batch_limit=summary["decode_load"].get("decode_batch_limit", 0.0),
               decode_capacity_used=summary["decode_load"].get("decode_capacity_used", float("nan")),
               prefill_share=summary["decode_load"].get("prefill_share", 0.0),
               admission_held=summary["admission_held_s"] / summary["wall_s"] if summary["wall_s"] else 0.0,
               layout=dict(rollout=ccfg.rollout_groups, ref=ccfg.ref_groups, train=ccfg.train_groups),
               # the rollout's device count after each step (ERS's moves over time) and each step's tokens
               trace=[dict(wall_s=r["wall_s"], rollout_devices=r.get("rollout_devices", 0), tokens=r.get("tokens", 0))
                      for r in _metrics_rows(controller)], **plan)
    logging.info("%4d accelerators %-6s: goodput %.0f tok/s, step %.1fs, waiting rollout %.0f / trainer %.0f "
                 "device-s, KV hit %.3f, %d moves (%.1fs to simulate)", size, mode, row["goodput_tokens_per_s"],
                 row["step_time_s"], row["rollout_wait_s"], row["trainer_wait_s"], row["kv_hit_rate"],
                 row["moves"], row["sim_wall_s"])
    return row, controller


def _metrics_rows(controller) -> list[dict]:
    path = os.path.join(controller.metrics.logdir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def oracle_split(cfg, size: int) -> tuple[int, dict, tuple]:
    """The best static async split in hindsight: every rollout / train split of the device groups
    (`cfg.oracle_train_groups`: only those train group counts, when set; the best of a partial sweep is a
    lower bound of the oracle) simulated for the run's full length; returns (rollout groups of the best, the
    sweep, the best run's (summary, controller))."""
    g = group_size(cfg, size)
    groups = size // g
    counts = [int(x) for x in cfg.oracle_train_groups] or list(range(1, groups))
    w = workloads.workload(cfg.workload)
    sweep, best_run = {}, None
    for train in counts:
        if not 1 <= train < groups:
            raise ConfigError(f"oracle_train_groups: {train} is not in [1, {groups - 1}] at size {size}")
        ccfg = controller_config(cfg, "async", size, w, rollout_groups=groups - train)
        run = _simulate(cfg, "async", size, ccfg, os.path.join(cfg.logdir, f"{size}", f"oracle_train{train}"))
        sweep[train] = run[0]["goodput_tokens_per_s"]
        if sweep[train] == max(sweep.values()):
            best_run = run
    best = max(sweep, key=sweep.get)
    logging.info("%4d accelerators oracle split: train %d of %d device groups (%s)", size, best, groups,
                 {k: round(v) for k, v in sweep.items()})
    return groups - best, dict(oracle_train_groups=best, oracle_sweep={str(k): v for k, v in sweep.items()}), best_run


def add_ratios(rows: list[dict]) -> None:
    by = {(r["size"], r["mode"]): r for r in rows}
    for r in rows:
        for base in ("sync", "async"):
            b = by.get((r["size"], base))
            r[f"vs_{base}"] = r["goodput_tokens_per_s"] / b["goodput_tokens_per_s"] if b else float("nan")
        o = by.get((r["size"], "async@oracle"))
        r["vs_oracle"] = r["goodput_tokens_per_s"] / o["goodput_tokens_per_s"] if o else float("nan")
        s = by.get((r["size"], "sync"))
        if s:
            r["step_time_vs_sync"] = r["step_time_s"] / s["step_time_s"] - 1
            wait, wait_s = r["rollout_wait_s"] + r["trainer_wait_s"], s["rollout_wait_s"] + s["trainer_wait_s"]
            r["waiting_vs_sync"] = wait / wait_s - 1 if wait_s else float("nan")


# the papers' headline numbers (docs/mechanisms.md, last section), each with how we compute ours: "up to", as
# the papers state them, is the best value over the cluster sizes simulated
ANCHORS = {
    "tiderl": (
        ("goodput tiderl / sync", 5.6, "x", lambda by, n: _ratio(by, n, "tiderl", "sync", "goodput_tokens_per_s")),
        ("goodput tiderl / async", 1.33, "x", lambda by, n: _ratio(by, n, "tiderl", "async", "goodput_tokens_per_s")),
        ("KV hit rate tiderl / async", 1.58, "x", lambda by, n: _ratio(by, n, "tiderl", "async", "kv_hit_rate")),
        ("step time tiderl vs sync", -0.443, "%", lambda by, n: by[(n, "tiderl")].get("step_time_vs_sync")),
        ("waiting tiderl vs sync", -0.776, "%", lambda by, n: by[(n, "tiderl")].get("waiting_vs_sync")),
        # WAR (synchronous agentic RL): 1.4x (low load) to 1.6x (high load) rollout throughput; ours
        # is the goodput of the whole synchronous loop with its speculative-decoding switch
        ("goodput sync+war / sync (WAR, rollout)", 1.6, "x",
         lambda by, n: _ratio(by, n, "sync+war", "sync", "goodput_tokens_per_s")),
    ),
    "bidirl": (
        ("goodput async+bidirl / best of sync, async", 1.94, "x",
         lambda by, n: _ratio(by, n, "async+bidirl", ("sync", "async"), "goodput_tokens_per_s")),
    ),
}


def _ratio(by: dict, size: int, mode: str, base, key: str) -> float | None:
    bases = [by.get((size, b)) for b in ((base,) if isinstance(base, str) else base)]
    if (size, mode) not in by or not all(bases) or not all(b[key] for b in bases):
        return None
    return by[(size, mode)][key] / max(b[key] for b in bases)


def anchors(rows: list[dict], workload: str) -> list[dict]:
    """Published vs simulated, for the anchors of the workload's paper (`ANCHORS`)."""
    by = {(r["size"], r["mode"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    out = []
    for name, published, unit, fn in ANCHORS.get(workload.split("-")[0], ()):
        values = {}
        for n in sizes:
            try:
                values[n] = fn(by, n)
            except KeyError:  # a mode this anchor needs was not run
                pass
        values = {n: v for n, v in values.items() if v is not None and v == v}
        if not values:
            continue
        best = min(values, key=values.get) if unit == "%" else max(values, key=values.get)
        out.append(dict(anchor=name, published=published, unit=unit, simulated=values[best], at_size=best,
                        per_size={str(n): v for n, v in values.items()}))
    return out


def anchor_table(items: list[dict]) -> str:
    def fmt(v, unit):
        return f"{v:+.1%}" if unit == "%" else f"{v:.2f}x"
    lines = [f"{'anchor (published: up to)':<44} {'published':>10} {'simulated':>10}  at size"]
    for a in items:
        lines.append(f"{a['anchor']:<44} {fmt(a['published'], a['unit']):>10} {fmt(a['simulated'], a['unit']):>10}  "
                     f"{a['at_size']}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = (f"{'size':>5} {'mode':<15} {'goodput tok/s':>13} {'vs sync':>8} {'vs async':>9} {'step s':>7} "
            f"{'d step':>7} {'rollout wait':>12} {'trainer wait':>12} {'d wait':>7} {'KV hit':>7} {'moves':>5} "
            f"{'borrows':>7} {'sim s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['size']:>5} {r['mode']:<15} {r['goodput_tokens_per_s']:>13.0f} {r['vs_sync']:>7.2f}x "
                     f"{r['vs_async']:>8.2f}x {r['step_time_s']:>7.1f} {r.get('step_time_vs_sync', 0):>+7.1%} "
                     f"{r['rollout_wait_s']:>12.0f} {r['trainer_wait_s']:>12.0f} {r.get('waiting_vs_sync', 0):>+7.1%} "
                     f"{r['kv_hit_rate']:>7.3f} {r['moves']:>5} {r['borrows']:>7} {r['sim_wall_s']:>6.1f}")
    return "\n".join(lines)


def load_table(rows: list[dict]) -> str:
    """What bounds each run: the rollout replicas' decode load and how long the staleness bound held admission."""
    head = (f"{'size':>5} {'mode':<15} {'decode batch':>12} {'of limit':>9} {'capacity used':>13} "
            f"{'prefill share':>13} {'admission held':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['size']:>5} {r['mode']:<15} {r['decode_batch']:>12.1f} {r['decode_batch_limit']:>9.0f} "
                     f"{r['decode_capacity_used']:>13.1%} {r['prefill_share']:>13.1%} {r['admission_held']:>14.0%}")
    return "\n".join(lines)


def regime(rows: list[dict], eta: int) -> str:
    """Why the TideRL anchors come out as they do, from the tiderl run at the largest size (the numbers of
    `load_table`): a rollout that decodes far below its capacity while the staleness bound holds admission is
    latency-bound, and TideRL's mechanisms do not shorten that path."""
    runs = [r for r in rows if r["mode"] == "tiderl"]
    if not runs:
        return ""
    r = max(runs, key=lambda r: r["size"])
    cap, held = r["decode_capacity_used"], r["admission_held"]
    facts = (f"at {r['size']} accelerators tiderl's rollout replicas decode {r['decode_batch']:.1f} sequences per "
             f"step on average (KV and max_batch allow {r['decode_batch_limit']:.0f}), {cap:.0%} of their decode "
             f"throughput; prefill is {r['prefill_share']:.0%} of their busy time; the staleness bound (eta "
             f"{eta}) held admission {held:.0%} of the run.")
    if cap == cap and cap < 0.5 and held > 0.5:
        return (facts + " The rollout is latency-bound: a step lasts as long as its slowest admitted tasks (turns "
                "of memory-bound decode steps and environment waits), and what TideRL saves (re-prefill with CTB, "
                "trainer time with RA2P, rollout devices with ERS) is not on that path. The load that decides "
                "this (the batch, the concurrency, eta) is ours, not the paper's (sim/workloads.py, the config's "
                "controller section).")
    return facts + " The rollout runs near its capacity: TideRL's savings are on its critical path."


# TideRL's ablation (OSWorld, Qwen3-VL-4B, cumulative; MECHANISMS-style record of the paper): tokens/s per rung
LADDER = (("streamrl", "StreamRL", 20.2e3), ("tiderl-ctb-ers", "+RA2P", 23.1e3), ("tiderl-ctb", "+ERS", 31.8e3),
          ("tiderl", "+CTB", 33.3e3))


def ladder_table(rows: list[dict]) -> str:
    """The ablation ladder beside the paper's: each rung's goodput and its gain over the rung below."""
    by = {(r["size"], r["mode"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    if not any((n, mode) in by for n in sizes for mode, _, _ in LADDER):
        return ""
    head = f"{'rung':<9} {'mode':<15} {'paper tok/s':>11} {'paper gain':>10}" + "".join(
        f" {f'{n}: tok/s':>12} {'gain':>7}" for n in sizes)
    lines = [head, "-" * len(head)]
    for i, (mode, name, paper) in enumerate(LADDER):
        gain = f"{paper / LADDER[i - 1][2] - 1:+.1%}" if i else ""
        line = f"{name:<9} {mode:<15} {paper:>11.0f} {gain:>10}"
        for n in sizes:
            r, below = by.get((n, mode)), by.get((n, LADDER[i - 1][0])) if i else None
            line += f" {r['goodput_tokens_per_s']:>12.0f}" if r else f" {'':>12}"
            line += (f" {r['goodput_tokens_per_s'] / below['goodput_tokens_per_s'] - 1:>+7.1%}" if r and below
                     else f" {'':>7}")
        lines.append(line)
    return "\n".join(lines)


def baselines_table(rows: list[dict]) -> str:
    """tiderl against each fixed-ratio async run and the oracle static split, per size."""
    by = {(r["size"], r["mode"]): r for r in rows}
    fixed = sorted({r["mode"] for r in rows if r["mode"] == "async" or r["mode"].startswith(("async@", "streamrl"))})
    lines = []
    for n in sorted({r["size"] for r in rows}):
        t = by.get((n, "tiderl"))
        if not t:
            continue
        for mode in fixed:
            b = by.get((n, mode))
            if b:
                extra = (f" (train {b['oracle_train_groups']} of {sum(b['layout'].values())} groups)"
                         if "oracle_train_groups" in b else f" (train {b['layout']['train']} groups)")
                lines.append(f"{n:>5} tiderl / {mode:<15} {t['goodput_tokens_per_s'] / b['goodput_tokens_per_s']:>6.2f}x"
                             f"{extra}")
    return "\n".join(lines)


def plot_moves(rows: list[dict], path: str) -> str | None:
    """ERS's moves over time: the rollout's share of the devices after each step, per size, for the modes
    that move (tiderl and the ladder's +ERS), with each step's trained tokens (the workload's drift)."""
    runs = [r for r in rows if r.get("trace") and r["mode"] in ("tiderl", "tiderl-ctb")]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in runs:
        steps = range(1, len(r["trace"]) + 1)
        ax.step(steps, [t["rollout_devices"] / r["size"] for t in r["trace"]], where="post",
                label=f"{r['mode']} @ {r['size']} ({r['moves']} moves)")
        ax2.plot(steps, [t["tokens"] for t in r["trace"]], label=f"{r['mode']} @ {r['size']}", alpha=0.7)
    ax.set_ylabel("rollout share of devices")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    ax2.set_ylabel("trained tokens per step")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_goodput(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["size"], r["goodput_tokens_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("accelerators")
    ax.set_ylabel("goodput (trained tokens / s)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv):
    del argv
    cfg = _CONFIG.value
    console.setup(cfg.logdir)
    pylogging.getLogger("tiderl_jax").setLevel(pylogging.WARNING)  # per-step lines: thousands of them
    try:
        sizes = cfg.sizes if isinstance(cfg.sizes, tuple) else config_lib.parse_tuple(str(cfg.sizes))
        if not sizes or not all(isinstance(n, int) and n >= 1 for n in sizes):
            raise ConfigError(f"sizes={sizes}: give accelerator counts, e.g. --config.sizes=32,1024")
        for mode in cfg.modes:
            for size in sizes:
                controller_config(cfg, mode, size, workloads.workload(cfg.workload))
        for mode in cfg.modes:
            sim_config(cfg, mode)
        for size in sizes:
            groups = size // group_size(cfg, size)
            bad = [int(x) for x in cfg.oracle_train_groups if not 1 <= int(x) < groups]
            if bad and any(parse_mode(m).split == "oracle" for m in cfg.modes):
                raise ConfigError(f"oracle_train_groups {bad}: not in [1, {groups - 1}] at size {size}")
    except (ConfigError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(cfg.logdir, exist_ok=True)
    rows = []
    for size in sizes:
        for mode in cfg.modes:
            row, controller = run_one(cfg, mode, size)
            rows.append(row)
            with open(os.path.join(cfg.logdir, "rows.jsonl"), "a") as f:  # each run as it ends (a long sweep)
                f.write(json.dumps(row, default=str) + "\n")
            if cfg.timelines and size == min(sizes):
                row["timeline"] = controller.metrics.plot_timeline(os.path.join(cfg.logdir, f"timeline_{mode}.png"))
    add_ratios(rows)
    w = workloads.workload(cfg.workload)
    print(f"\nworkload {w.name} ({w.model} on {cfg.accelerator or w.accelerator}), {cfg.steps} steps per run; "
          f"waiting in device-seconds; d step / d wait: change vs sync at the same size")
    print(table(rows))
    items = anchors(rows, w.name)
    if items:
        print(f"\nthe paper's headline numbers vs this simulation ({w.source.split(' (')[0]})")
        print(anchor_table(items))
    print("\nwhat bounds each run: the rollout replicas' mean decode batch, the most their KV and max_batch allow, "
          "the share of their decode throughput used, of their busy time in prefill, and of the run the "
          "staleness bound held admission")
    print(load_table(rows))
    ladder = ladder_table(rows)
    if ladder:
        print("\nthe ablation ladder (each rung a configuration of the one controller) beside the paper's (OSWorld, "
              "Qwen3-VL-4B; ours on this workload)")
        print(ladder)
    versus = baselines_table(rows)
    if versus:
        print("\ntiderl against fixed-ratio async (the paper's 0.125 / 0.25 / 0.5 read as the train share of the "
              "devices), StreamRL-like streaming and the oracle static split")
        print(versus)
    moves = plot_moves(rows, os.path.join(cfg.logdir, "moves.png"))
    why = regime(rows, cfg.controller.eta) if items else ""
    if why:
        print("\n" + textwrap.fill(why, 120))
    out = dict(config=json.loads(cfg.to_json()), workload=dataclasses.asdict(w), rows=rows, anchors=items,
               regime=why)
    with open(os.path.join(cfg.logdir, "results.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {os.path.join(cfg.logdir, 'results.json')}, "
          f"{plot_goodput(rows, os.path.join(cfg.logdir, 'goodput.png'))}" + (f", {moves}" if moves else ""))
    # the runs' objects (millions at 1024 accelerators) go with the process: frozen, the interpreter's
    # final collection does not walk them
    gc.freeze()


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/simulate.py"))
