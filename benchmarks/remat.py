"""Rematerialisation (`trainer.remat`): the train step's per-device memory and gradient time by policy.

    python benchmarks/remat.py [--quick] [--json out.json]

For each model and row length, every policy of `model/decoder.py`'s REMAT_POLICIES: XLA's memory analysis of
the step's gradient program (`Trainer.memory_plan`: compiled, not run; `train_peak_bytes` = arguments + outputs
+ temporaries - aliased, `temp_bytes` the temporaries alone), and the seconds of one warm gradient (the
recomputed forward's price), all in this one process. XLA:CPU runs with its memory-minimising scheduler, as the
main job does with remat on (`config.CPU_MEMORY_SCHEDULER`: the default concurrency-optimised one runs every
layer's recomputation up front and keeps what remat frees). Models: the main job's (`configs/tiny_agentic.py`)
and SmolLM2-135M's shape with random weights (`--quick`: the main job's only, rows of 1,024).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()
from tiderl_jax.config import CPU_MEMORY_SCHEDULER  # noqa: E402  (JAX-free until a backend starts)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_MEMORY_SCHEDULER).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import REMAT_POLICIES, init_decoder  # noqa: E402
from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE  # noqa: E402
from tiderl_jax.rl.trainer import Trainer  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402
from tiderl_jax.trajectory import Trajectory  # noqa: E402


def main_job_model() -> ModelConfig:
    from configs import tiny_agentic
    from tiderl_jax.config import model_config
    return model_config(tiny_agentic.get_config())


def trajectories(cfg: ModelConfig, row_len: int, rows: int) -> list[Trajectory]:
    """`rows` trajectories that each fill a row: a quarter prompt, the rest generated."""
    rng, out = np.random.default_rng(0), []
    for i in range(rows):
        t = Trajectory(f"t{i}", "bench", i // 2)
        t.extend(rng.integers(0, cfg.vocab_size, row_len // 4).tolist(), generated=False)
        n = row_len - row_len // 4
        t.extend(rng.integers(0, cfg.vocab_size, n).tolist(), generated=True, logprobs=[-1.0] * n,
                 model_logprobs=[-1.0] * n, versions=[0] * n)
        t.reward = float(i % 2)
        out.append(t)
    return out


def measure(name: str, cfg: ModelConfig, row_len: int, rows: int, policy: str) -> dict:
    config = TrainerConfig(row_len=row_len, micro_rows=rows, remat=policy, total_steps=10)
    batch = trajectories(cfg, row_len, rows)
    plan = Trainer(init_decoder(cfg, seed=0), config).memory_plan(batch)
    mem = next(m for key, m in plan.items() if "gradients" in str(key))
    trainer = Trainer(init_decoder(cfg, seed=0), config)
    trainer.gradients(batch)  # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.gradients(batch)["gradients"])
    return dict(model=name, row_len=row_len, rows=rows, remat=policy,
                train_peak_bytes=int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                     + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
                temp_bytes=int(mem.temp_size_in_bytes), gradient_s=round(time.perf_counter() - t0, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the main job's model only, rows of 1,024")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    cases = [("tiny_agentic", main_job_model(), 1024, 4)]
    if not args.quick:
        cases += [("tiny_agentic", main_job_model(), 4096, 2), ("smollm2_135m_shape", SMOLLM2_135M_SHAPE, 1024, 2)]
    rows = []
    print(f"{'model':<20} {'row_len':>7} {'rows':>4} {'remat':<34} {'peak MiB':>9} {'temp MiB':>9} "
          f"{'vs none':>8} {'grad s':>7}")
    for name, cfg, row_len, n in cases:
        base = None
        for policy in REMAT_POLICIES:
            r = measure(name, cfg, row_len, n, policy)
            base = base or r["train_peak_bytes"]
            rows.append(r)
            print(f"{name:<20} {row_len:>7} {n:>4} {policy:<34} {r['train_peak_bytes'] / 2**20:>9.1f} "
                  f"{r['temp_bytes'] / 2**20:>9.1f} {r['train_peak_bytes'] / base:>8.2f} {r['gradient_s']:>7.2f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
