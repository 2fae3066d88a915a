"""Speed of the model's two forward modes on the CPU default, one device vs the 8-device mesh.

    python benchmarks/model_speed.py [--quick] [--json out.json]

Rows (JSON keys): case, devices, batch, tokens, seconds, tokens_per_s, ratio_vs_single.
`forward` is the full-sequence pass (training / scoring shape), `decode` is the reference generator
(prefill + one jitted scan of decode steps over the dense cache). All candidates run in this one
process, after a warm-up call each, so their ratios are comparable on a noisy machine. The faked CPU
devices share the same cores: the mesh rows measure sharding overhead here, not a speed-up.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import best_of  # noqa: E402  (no side effects at import)
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import Decoder  # noqa: E402
from tiderl_jax.model.generate import generate  # noqa: E402
from tiderl_jax.model.sharding import (DEFAULT_RULES, data_sharding, init_sharded,  # noqa: E402
                                       make_mesh)

TINY = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short version (smaller shapes, 1 repeat)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    batch, seq, new = (8, 128, 16) if args.quick else (32, 256, 64)
    repeats = 1 if args.quick else 3

    meshes = {
        "single": make_mesh({"fsdp": 1}, jax.devices()[:1]),
        "mesh fsdp4 x tensor2": make_mesh({"fsdp": 4, "tensor": 2}),
    }
    rows = []
    for name, mesh in meshes.items():
        model = init_sharded(lambda: Decoder(TINY, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
        tokens = np.random.default_rng(0).integers(0, 256, (batch, seq)).astype(np.int32)
        sh = data_sharding(mesh, DEFAULT_RULES, tokens.shape)
        tok_d = jax.device_put(tokens, sh)
        pos_d = jax.device_put(np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape), sh)
        forward = nnx.jit(lambda m, t, p: m(t, p)[0].sum())
        secs = best_of(lambda: float(forward(model, tok_d, pos_d)), repeats)
        rows.append(dict(case=f"forward / {name}", devices=mesh.size, batch=batch, tokens=batch * seq,
                         seconds=secs, tokens_per_s=batch * seq / secs))
        print(f"[{len(rows)}/4] {rows[-1]['case']}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        prompts = [list(map(int, row[:32])) for row in tokens]
        secs = best_of(lambda: generate(model, prompts, max_new_tokens=new, temperature=1.0), repeats)
        rows.append(dict(case=f"decode / {name}", devices=mesh.size, batch=batch, tokens=batch * new,
                         seconds=secs, tokens_per_s=batch * new / secs))
        print(f"[{len(rows)}/4] {rows[-1]['case']}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    single = {r["case"].split(" / ")[0]: r["tokens_per_s"] for r in rows if r["devices"] == 1}
    for r in rows:
        r["ratio_vs_single"] = r["tokens_per_s"] / single[r["case"].split(" / ")[0]]

    print(f"\nmodel {TINY.num_params / 1e6:.2f}M params, batch {batch}, prompt/seq {seq}, {new} new tokens")
    print(f"{'case':<34}{'devices':>8}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'vs single':>11}")
    for r in rows:
        print(f"{r['case']:<34}{r['devices']:>8}{r['tokens']:>8}{r['seconds']:>10.3f}"
              f"{r['tokens_per_s']:>11.0f}{r['ratio_vs_single']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
