"""Scanned layers (`trainer.scan_layers`): the train step's compile time and memory by depth, scanned or not.

    python benchmarks/scan_layers.py [--quick] [--json out.json]

SmolLM2-135M's shape with 4 to 30 layers on a mesh of 8 faked CPU devices (fsdp 4 x tensor 2), micro-batches of 2
rows of 512 tokens, compiled from abstract weights and never run (`rl/trainer.py`'s `step_memory`), the
persistent compile cache off: for each depth, `scan_layers` off and on, `remat` none and full, the seconds to
lower and compile the whole update (`program="update"`: forward, backward, AdamW) and the gradient program alone
(`program="gradients"`), and XLA's temporaries per device. Rows: `layers, scan_layers, remat, program, compile_s,
temp_bytes`. XLA:CPU runs with its memory-minimising scheduler, as the main job does with remat on.
`--quick`: 4 and 8 layers.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

setup(8)
from tiderl_jax.config import CPU_MEMORY_SCHEDULER  # noqa: E402  (JAX-free until a backend starts)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_MEMORY_SCHEDULER).strip()

import jax  # noqa: E402

from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE  # noqa: E402
from tiderl_jax.model.sharding import make_mesh  # noqa: E402
from tiderl_jax.rl.trainer import step_memory  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 and 8 layers")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # every compile timed whole
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    rows = []
    print(f"{'layers':>6} {'scan':>5} {'remat':>5} {'program':>9} {'compile s':>9} {'temp MiB':>9}")
    for layers in (4, 8) if args.quick else (4, 8, 16, 30):
        model = dataclasses.replace(SMOLLM2_135M_SHAPE, num_layers=layers)
        for remat in ("none", "full"):
            for scan in (False, True):
                for program in ("update", "gradients"):
                    config = TrainerConfig(row_len=512, micro_rows=2, scan_layers=scan, remat=remat)
                    t0 = time.perf_counter()
                    memory = step_memory(model, config, mesh, kind="rl" if program == "update" else "gradients")
                    row = dict(layers=layers, scan_layers=scan, remat=remat, program=program,
                               compile_s=time.perf_counter() - t0, temp_bytes=int(memory.temp_size_in_bytes))
                    rows.append(row)
                    print(f"{layers:>6} {str(scan):>5} {remat:>5} {program:>9} {row['compile_s']:>9.1f} "
                          f"{row['temp_bytes'] / 2 ** 20:>9.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
