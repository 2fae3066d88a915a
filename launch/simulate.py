"""Cluster-scale simulation: the real controller on cost-modelled devices (issue 8).

    python launch/simulate.py --config=configs/sim_tiderl_text.py [--config.sizes=32,1024] [--config.steps=100]

For each cluster size and each mode (sync, async, tiderl) it runs `runtime.controller.Controller` on a
`sim.backend.SimBackend` (virtual clock), then prints one table (goodput, its ratios to sync and to
async at the same size, per-step time, rollout and trainer waiting, KV hit rate, ERS moves, wall
seconds the simulation took) and writes `logdir/results.json` (one row per run), `logdir/goodput.png`
(goodput vs cluster size per mode) and, at the smallest size, `logdir/timeline_<mode>.png` (what each
device lane did over virtual time, the controller's own `RunMetrics.plot_timeline`).
"""

import dataclasses
import json
import logging as pylogging
import os
import sys
import time

from absl import app, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402
from tiderl_jax.runtime.controller import ControllerConfig  # noqa: E402
from tiderl_jax.sim import backend as sim_backend  # noqa: E402
from tiderl_jax.sim import costs, workloads  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/sim_tiderl_text.py")


def controller_config(cfg, mode: str, size: int, workload: workloads.Workload) -> ControllerConfig:
    """The controller's settings for one run: batch scaled with the cluster, the mode's device layout."""
    c = cfg.controller
    groups = size // c.device_group_size
    if groups * c.device_group_size != size or groups < 4:
        raise ConfigError(f"size {size}: needs at least 4 device groups of {c.device_group_size}")
    prompts = max(1, round(workload.prompts_per_step * size / workload.devices))
    batch = prompts * workload.group_size
    if mode == "tiderl":
        ref, train = max(1, round(groups * c.tiderl_ref)), max(1, round(groups * c.tiderl_train))
    else:
        ref, train = 0, max(1, round(groups * c.async_train))
    return ControllerConfig(
        mode=mode, steps=cfg.steps, groups_per_step=prompts, group_size=workload.group_size,
        eta=0 if mode == "sync" else c.eta, max_concurrent=c.concurrency_batches * batch,
        task_kinds=("calculator",), data_seed=cfg.seed,
        device_group_size=c.device_group_size, rollout_groups=groups - ref - train, ref_groups=ref,
        train_groups=train, tensor=cfg.sim.tp, ers_patience=c.ers_patience, ers_cooldown=c.ers_cooldown)


def sim_config(cfg) -> sim_backend.SimConfig:
    return sim_backend.SimConfig(workload=cfg.workload, accelerator=cfg.accelerator, seed=cfg.seed,
                                 efficiency=costs.Efficiency(**cfg.efficiency.to_dict()), **cfg.sim.to_dict())


def run_one(cfg, mode: str, size: int) -> tuple[dict, object]:
    workload = workloads.workload(cfg.workload)
    ccfg = controller_config(cfg, mode, size, workload)
    t0 = time.perf_counter()
    summary, controller, backend = sim_backend.run(sim_config(cfg), ccfg, num_devices=size,
                                                   logdir=os.path.join(cfg.logdir, f"{size}", mode))
    row = dict(mode=mode, size=size, steps=summary["steps"], batch_samples=ccfg.batch_samples,
               goodput_tokens_per_s=summary["goodput_tokens_per_s"],
               goodput_samples_per_s=summary["goodput_samples_per_s"], step_time_s=summary["step_time_s"],
               rollout_wait_s=summary["rollout_wait_s"], trainer_wait_s=summary["trainer_wait_s"],
               kv_hit_rate=summary["kv_hit_rate"], moves=summary["moves"], discarded=summary["discarded"],
               staleness=summary["staleness"], virtual_s=summary["wall_s"],
               sim_wall_s=time.perf_counter() - t0, sim=summary["sim"],
               layout=dict(rollout=ccfg.rollout_groups, ref=ccfg.ref_groups, train=ccfg.train_groups))
    logging.info("%4d accelerators %-6s: goodput %.0f tok/s, step %.1fs, waiting rollout %.0f / trainer %.0f "
                 "device-s, KV hit %.3f, %d moves (%.1fs to simulate)", size, mode, row["goodput_tokens_per_s"],
                 row["step_time_s"], row["rollout_wait_s"], row["trainer_wait_s"], row["kv_hit_rate"],
                 row["moves"], row["sim_wall_s"])
    return row, controller


def add_ratios(rows: list[dict]) -> None:
    by = {(r["size"], r["mode"]): r for r in rows}
    for r in rows:
        for base in ("sync", "async"):
            b = by.get((r["size"], base))
            r[f"vs_{base}"] = r["goodput_tokens_per_s"] / b["goodput_tokens_per_s"] if b else float("nan")
        s = by.get((r["size"], "sync"))
        if s:
            r["step_time_vs_sync"] = r["step_time_s"] / s["step_time_s"] - 1
            wait, wait_s = r["rollout_wait_s"] + r["trainer_wait_s"], s["rollout_wait_s"] + s["trainer_wait_s"]
            r["waiting_vs_sync"] = wait / wait_s - 1 if wait_s else float("nan")


def table(rows: list[dict]) -> str:
    head = (f"{'size':>5} {'mode':<7} {'goodput tok/s':>13} {'vs sync':>8} {'vs async':>9} {'step s':>7} "
            f"{'d step':>7} {'rollout wait':>12} {'trainer wait':>12} {'d wait':>7} {'KV hit':>7} {'moves':>5} "
            f"{'sim s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['size']:>5} {r['mode']:<7} {r['goodput_tokens_per_s']:>13.0f} {r['vs_sync']:>7.2f}x "
                     f"{r['vs_async']:>8.2f}x {r['step_time_s']:>7.1f} {r.get('step_time_vs_sync', 0):>+7.1%} "
                     f"{r['rollout_wait_s']:>12.0f} {r['trainer_wait_s']:>12.0f} {r.get('waiting_vs_sync', 0):>+7.1%} "
                     f"{r['kv_hit_rate']:>7.3f} {r['moves']:>5} {r['sim_wall_s']:>6.1f}")
    return "\n".join(lines)


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
    logging.set_verbosity(logging.INFO)
    pylogging.getLogger("tiderl_jax").setLevel(pylogging.WARNING)  # per-step lines: thousands of them
    try:
        sizes = [int(s) for s in (cfg.sizes if not isinstance(cfg.sizes, (int, str)) else str(cfg.sizes).split(","))]
        for mode in cfg.modes:
            for size in sizes:
                controller_config(cfg, mode, size, workloads.workload(cfg.workload))
        sim_config(cfg)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(cfg.logdir, exist_ok=True)
    rows = []
    for size in sizes:
        for mode in cfg.modes:
            row, controller = run_one(cfg, mode, size)
            rows.append(row)
            if cfg.timelines and size == min(sizes):
                row["timeline"] = controller.metrics.plot_timeline(os.path.join(cfg.logdir, f"timeline_{mode}.png"))
    add_ratios(rows)
    w = workloads.workload(cfg.workload)
    print(f"\nworkload {w.name} ({w.model} on {cfg.accelerator or w.accelerator}), {cfg.steps} steps per run; "
          f"waiting in device-seconds; d step / d wait: change vs sync at the same size")
    print(table(rows))
    out = dict(config=json.loads(cfg.to_json()), workload=dataclasses.asdict(w), rows=rows)
    with open(os.path.join(cfg.logdir, "results.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {os.path.join(cfg.logdir, 'results.json')}, "
          f"{plot_goodput(rows, os.path.join(cfg.logdir, 'goodput.png'))}")


if __name__ == "__main__":
    app.run(main)
