"""Memory plans of the real presets: the train step's and the engine's bytes per device, compiled, never run.

    python benchmarks/memory_plan.py [--quick] [--json out.json] [--presets a,b] [--row_lens 4096,16384]

For each preset (`configs/qwen2_5_0_5b.py`, `qwen3_1_7b.py`, `llama3_1_8b.py`) on the meshes its main job
builds on one 8-GPU host (8 faked CPU devices here: the train side's `train_groups x device_group_size` devices
with the controller's tensor parallelism, each rollout replica one device group), at each row length with
remat off and on:

- `train_peak_bytes`: XLA's memory analysis of one whole update (forward, backward and the AdamW update of a
  micro-batch of `trainer.micro_rows` full rows; arguments + outputs + temporaries - donated) compiled for the
  train mesh from abstract weights (`rl/trainer.py`'s `step_memory`: nothing is allocated), at 4 and 8 decoder
  layers and extrapolated to the model's depth (`runtime/memory.py`; `--exact` compiles the whole depth);
- `engine_kv_bytes` / `engine_weight_bytes`: a rollout replica's KV page pool (`engine.num_pages` pages) and its
  weights per device, from their shapes and shardings on the replica's mesh (both are single allocations);
- `fits_80gb` / `fits_141gb`: both sides under an H100's 80 GB and an H200's 141 GB per device.

The row lengths default to 4,096 and 16,384 tokens (a row is the longest trajectory trained on); `--quick` plans
Qwen2.5-0.5B at 4,096 only. The table in docs/accelerators.md comes from a full run.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(devices=8)
from tiderl_jax.config import CPU_MEMORY_SCHEDULER  # noqa: E402  (JAX-free until a backend starts)

# the memory-minimising scheduler an accelerator's XLA uses in spirit: XLA:CPU's default orders for concurrency
# and keeps what remat frees (benchmarks/remat.py)
# and LLVM's least effort: XLA's memory analysis is its buffer assignment, made before code generation (the same
# bytes at any backend level; the compiles take half the time)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_MEMORY_SCHEDULER
                           + " --xla_backend_optimization_level=0").strip()

PRESETS = ("qwen2_5_0_5b", "qwen3_1_7b", "llama3_1_8b")
GB = 1e9
LIMITS = {"80gb": 80 * GB, "141gb": 141 * GB}


def plan(preset: str, row_len: int, remat: str, exact: bool = False) -> dict:
    import dataclasses

    from tiderl_jax import config as config_lib
    from tiderl_jax.runtime.memory import engine_bytes, train_mesh_shape, train_step_bytes

    c = config_lib.load_config_file(str(ROOT / "configs" / f"{preset}.py"))
    controller, trainer, engine, _, _ = config_lib.rl_configs(c)
    trainer = dataclasses.replace(trainer, row_len=row_len, remat=remat)
    model = config_lib.model_config(c)
    t0 = time.perf_counter()
    train = train_step_bytes(model, trainer, controller, config_lib.sharding_rules(c), exact=exact)
    kv, weights = engine_bytes(model, engine, controller, config_lib.sharding_rules(c))
    row = dict(preset=preset, mesh=train_mesh_shape(controller), row_len=row_len, remat=remat,
               micro_rows=trainer.micro_rows, train_peak_bytes=train, engine_kv_bytes=kv,
               engine_weight_bytes=weights, train_plan="compiled" if exact else "4 + 8 layers, extrapolated",
               compile_s=round(time.perf_counter() - t0, 1))
    for name, limit in LIMITS.items():
        row[f"fits_{name}"] = bool(train <= limit and kv + weights <= limit)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="Qwen2.5-0.5B at rows of 4,096 only")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--row_lens", default="4096,16384")
    p.add_argument("--remat", default="none,full", help="the trainer.remat values to plan")
    p.add_argument("--exact", action="store_true",
                   help="compile the train step at the model's whole depth (minutes per plan on a CPU) instead of "
                        "extrapolating from 4 and 8 layers")
    args = p.parse_args()
    presets = ["qwen2_5_0_5b"] if args.quick else args.presets.split(",")
    row_lens = [4096] if args.quick else [int(x) for x in args.row_lens.split(",")]
    print(f"{'preset':<14} {'train mesh':<22} {'row_len':>7} {'remat':<5} {'train GB':>9} {'engine KV GB':>12} "
          f"{'weights GB':>10} {'80 GB':>6} {'141 GB':>6} {'compile s':>9}")
    rows = []
    for preset in presets:
        for row_len in row_lens:
            for remat in args.remat.split(","):
                r = plan(preset, row_len, remat, args.exact)
                rows.append(r)
                mesh = "x".join(f"{k} {v}" for k, v in r["mesh"].items())
                print(f"{preset:<14} {mesh:<22} {row_len:>7} {remat:<5} {r['train_peak_bytes'] / GB:>9.1f} "
                      f"{r['engine_kv_bytes'] / GB:>12.1f} {r['engine_weight_bytes'] / GB:>10.1f} "
                      f"{'yes' if r['fits_80gb'] else 'no':>6} {'yes' if r['fits_141gb'] else 'no':>6} "
                      f"{r['compile_s']:>9.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
