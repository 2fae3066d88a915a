"""Simulator speed (issue 8 item 8): wall seconds to simulate RL steps at 1024 accelerators, the compiled
event core against its Python source, in one run.

    python benchmarks/sim_speed.py [--quick] [--json out.json] [--steps 100] [--size 1024]

Each row is one `launch/simulate.py` process (TideRL text preset, `configs/sim_tiderl_text.py`) for one
mode: `core` = `compiled` (the Cython extensions setup.py builds from tiderl_jax/sim/kv.py and replicas.py) or
`python` (the same modules uncompiled, TIDERL_SIM_PYTHON=1). Processes alternate between the two cores,
python first, so machine noise falls on both. JSON keys: `mode`, `size`, `steps`, `core`, `sim_wall_s`
(the simulation itself, from results.json), `process_wall_s` (the whole process: imports, config, plots),
`speedup` (python's sim_wall_s / this row's, same mode), `goodput_tokens_per_s` (both cores must agree:
the run is the same to the bit). Target: 100 steps at 1024 accelerators in under 60 s (`process_wall_s`).
`--quick`: 10 steps of async only.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def simulate(mode: str, size: int, steps: int, core: str, logdir: str) -> dict:
    env = dict(os.environ, TIDERL_SIM_PYTHON="1" if core == "python" else "0")
    cmd = [sys.executable, str(ROOT / "launch" / "simulate.py"),
           "--config=" + str(ROOT / "configs" / "sim_tiderl_text.py"),
           f"--config.sizes={size}", f"--config.modes={mode}", f"--config.steps={steps}", "--config.timelines=False",
           f"--config.logdir={logdir}"]
    probe = "import tiderl_jax.sim.replicas as b; print(b.__file__)"
    module = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    if (core == "compiled") != (not module.endswith(".py")):
        raise SystemExit(f"core {core!r} asked for, but tiderl_jax.sim.replicas is {module}: build the extensions "
                         "with `pip install -e .` (or `make venv`)")
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(os.path.join(logdir, "results.json")) as f:
        (row,) = json.load(f)["rows"]
    return dict(mode=mode, size=size, steps=row["steps"], core=core, sim_wall_s=row["sim_wall_s"],
                process_wall_s=wall, goodput_tokens_per_s=row["goodput_tokens_per_s"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 steps, async only")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--modes", default="async,tiderl,sync", help="modes timed on the compiled core")
    p.add_argument("--python-modes", default="async", help="modes also timed on the Python source")
    args = p.parse_args()
    steps = 10 if args.quick else args.steps
    modes = ["async"] if args.quick else args.modes.split(",")
    python_modes = ["async"] if args.quick else [m for m in args.python_modes.split(",") if m]
    runs = [(m, "python") for m in python_modes] + [(m, "compiled") for m in modes]
    runs.sort(key=lambda r: (modes.index(r[0]) if r[0] in modes else len(modes), r[1] != "python"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, core) in enumerate(runs):
            row = simulate(mode, args.size, steps, core, os.path.join(tmp, f"{i}"))
            rows.append(row)
            print(f"[{i + 1}/{len(runs)}] {mode} on the {core} core: {row['process_wall_s']:.1f} s "
                  f"({row['sim_wall_s']:.1f} s simulating)", flush=True)
    python = {r["mode"]: r for r in rows if r["core"] == "python"}
    for r in rows:
        ref = python.get(r["mode"])
        r["speedup"] = ref["sim_wall_s"] / r["sim_wall_s"] if ref else None
        if ref and ref["goodput_tokens_per_s"] != r["goodput_tokens_per_s"]:
            raise SystemExit(f"{r['mode']}: the compiled core's goodput {r['goodput_tokens_per_s']} differs from "
                             f"the Python source's {ref['goodput_tokens_per_s']}")
    print(f"\n{steps} steps at {args.size} accelerators (target: 100 steps in under 60 s)")
    print(f"{'mode':8s} {'core':9s} {'process s':>10s} {'simulating s':>13s} {'speedup':>8s} {'goodput tok/s':>14s}")
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['mode']:8s} {r['core']:9s} {r['process_wall_s']:10.1f} {r['sim_wall_s']:13.1f} {speedup:>8s} "
              f"{r['goodput_tokens_per_s']:14.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
