"""XLA:CPU's own matmul libraries (its default, oneDNN, XNNPACK) on SmolLM2-135M's engine and train step, in one run.

    python benchmarks/xla_cpu_flags.py [--quick] [--rounds N] [--json out.json]

XLA:CPU can hand its dots to oneDNN (`--xla_cpu_use_onednn=true`) or XNNPACK (`--xla_cpu_use_xnnpack=true`)
instead of its own kernels: the tuned libraries a GEMM custom call would bring, without one. XLA_FLAGS are read
once per process, so each candidate runs in its own child process, the candidates alternated over `--rounds`
rounds (default 2) on this shared machine; each case keeps its best time over the rounds. The child (SmolLM2's
shape, random weights, float32, one device, the engine's `cpu` attention) measures:

- `decode_b4`, `decode_b32`: engine.generate of 4 / 32 greedy rows, 64-token prompts already in the prefix cache,
  64 new tokens each: decode tokens/s;
- `prefill_512`: engine.generate of 4 rows of 512 new prompt tokens (no cache hit), one new token each: prompt
  tokens/s;
- `train_2x512`: forward and backward of the decoder (value_and_grad of the mean log-likelihood) over 2 rows of
  512 tokens: tokens/s.

Rows (JSON keys): flags, case, tokens_per_s, ratio_vs_default, same_tokens (the greedy tokens equal the
default's; a library that reorders float32 sums may flip a near-tie).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import ROOT, setup  # noqa: E402

CANDIDATES = {"default": "", "onednn": "--xla_cpu_use_onednn=true", "xnnpack": "--xla_cpu_use_xnnpack=true"}


def child(quick: bool) -> dict:
    setup(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.model.decoder import init_decoder
    from tiderl_jax.model.packaged import SMOLLM2_135M_SHAPE

    shape = SMOLLM2_135M_SHAPE
    rng = np.random.default_rng(0)
    new = 16 if quick else 64
    out = {}
    model = init_decoder(shape, seed=0)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=4096, max_seq_len=1024, max_running=32,
                                        decode_steps=16, prefill_chunk=512, attention_impl="cpu"))
    for rows in (4, 32):
        prompts = [rng.integers(10, shape.vocab_size, 64).tolist() for _ in range(rows)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=new)
        for _ in range(2):  # compiles (the second pass's batches can differ); the prompts stay in the prefix cache
            engine.generate(prompts, greedy)
        t0 = time.perf_counter()
        result = engine.generate(prompts, greedy)
        out[f"decode_b{rows}"] = (rows * new / (time.perf_counter() - t0), [r.new_tokens for r in result])
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    best = 0.0
    for _ in range(2):  # fresh prompts each time: no prefix-cache hit
        prompts = [rng.integers(10, shape.vocab_size, 512).tolist() for _ in range(4)]
        t0 = time.perf_counter()
        engine.generate(prompts, one)
        best = max(best, 4 * 512 / (time.perf_counter() - t0))
    out["prefill_512"] = (best, None)  # the first call compiles: the second is the measure (best of 2)
    del engine

    tokens = jnp.asarray(rng.integers(10, shape.vocab_size, (2, 512)), jnp.int32)
    graphdef, params = nnx.split(model)

    def loss(p):
        x = tokens[:, :-1]
        logits, _ = nnx.merge(graphdef, p)(x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape))
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1).mean()
    grad = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(grad(params))
    secs = []
    for _ in range(2 if quick else 3):
        t0 = time.perf_counter()
        jax.block_until_ready(grad(params))
        secs.append(time.perf_counter() - t0)
    out["train_2x512"] = (2 * 511 / min(secs), None)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 new tokens per decode row, one round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.quick)))
        return
    rounds = args.rounds or (1 if args.quick else 2)
    best: dict[str, dict] = {name: {} for name in CANDIDATES}
    for r in range(rounds):
        for name, flags in CANDIDATES.items():
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(),
                       JAX_PLATFORMS="cpu")
            done = subprocess.run([sys.executable, __file__, "--child", *(["--quick"] if args.quick else [])],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} ({flags or 'no flags'}) failed:\n{done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for case, (rate, toks) in result.items():
                if rate > best[name].get(case, (0.0, None))[0]:
                    best[name][case] = (rate, toks)
            print(f"round {r + 1}/{rounds} {name}: " + ", ".join(f"{c} {v[0]:.0f}" for c, v in result.items()),
                  flush=True)
    rows = []
    for name, flags in CANDIDATES.items():
        for case, (rate, toks) in best[name].items():
            base, base_toks = best["default"][case]
            rows.append(dict(flags=flags or "(default)", case=case, tokens_per_s=rate, ratio_vs_default=rate / base,
                             same_tokens=None if toks is None else toks == base_toks))
    print(f"\n{'flags':<30} {'case':<12} {'tokens/s':>9} {'vs default':>10} {'same tokens':>11}")
    for r in rows:
        print(f"{r['flags']:<30} {r['case']:<12} {r['tokens_per_s']:>9.1f} {r['ratio_vs_default']:>9.2f}x "
              f"{'-' if r['same_tokens'] is None else str(r['same_tokens']):>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
