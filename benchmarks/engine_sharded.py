"""The C++ paged-attention kernel on a tensor-parallel engine (per kv-head shard) against the `xla` path, in one run.

    python benchmarks/engine_sharded.py [--quick] [--json out.json]

SmolLM2-135M's shape (9 heads over 3 kv heads; random weights) on engines of 1 and 3 faked CPU devices (tensor
parallel over the kv heads), greedy: 8 prompts of 960 tokens, 32 new tokens each (`--quick`: 4 prompts of 480, 16
new), each engine run once untimed (compiles; the prompts' pages stay in the prefix cache, so the timed runs are
almost all decoding over 1K-token contexts), then timed twice, the faster kept. The faked devices share this machine's cores, so the
sharded rows measure the kernel's effect on a sharded engine, not a speed-up from sharding. Rows: `devices,
attention_impl, tokens_per_s, ratio_vs_xla, same_tokens` (the kernel's greedy tokens equal the xla path's).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

setup(8)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE  # noqa: E402
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 prompts, 16 new tokens")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    n, length, new = (4, 480, 16) if args.quick else (8, 960, 32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, SMOLLM2_135M_SHAPE.vocab_size, length).tolist() for _ in range(n)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    rows = []
    print(f"{'devices':>7} {'attention':>9} {'tokens/s':>9} {'vs xla':>7} {'same tokens':>11}")
    for devices in (1, SMOLLM2_135M_SHAPE.num_kv_heads):
        mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": devices}, devices=jax.devices()[:devices])
        tokens, rates = {}, {}
        for impl in ("xla", "cpu"):
            model = shard_model(init_decoder(SMOLLM2_135M_SHAPE, seed=0), mesh, DEFAULT_RULES)
            engine = Engine(model, EngineConfig(page_size=16, num_pages=n * (length + new) // 16 + 64,
                                                max_seq_len=length + new + 16, max_running=n, decode_steps=16,
                                                attention_impl=impl))
            engine.generate(prompts, sampling)  # compiles; fills the prefix cache
            seconds = []
            for _ in range(2):
                t0 = time.perf_counter()
                out = engine.generate(prompts, sampling)
                seconds.append(time.perf_counter() - t0)
            rates[impl] = n * new / min(seconds)
            tokens[impl] = [o.new_tokens for o in out]
            row = dict(devices=devices, attention_impl=impl, tokens_per_s=rates[impl],
                       ratio_vs_xla=rates[impl] / rates["xla"], same_tokens=tokens[impl] == tokens["xla"])
            rows.append(row)
            print(f"{devices:>7} {impl:>9} {row['tokens_per_s']:>9.1f} {row['ratio_vs_xla']:>6.2f}x "
                  f"{str(row['same_tokens']):>11}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
