"""LongStraw vs the standard gradient on one long prompt: peak memory, time and gradient cosine.

    python benchmarks/long_context.py [--quick] [--json out.json]

One prompt (4096 tokens; 1024 with --quick) and G = 2, 4, 8 right-padded responses of up to 256
tokens (128 with --quick; lengths drawn between half and all of that), on a small Qwen3-style model
(vocab 384, hidden 128, 2 layers, 2 query heads of 64 over 1 KV head, MLP 384: 0.44M parameters, so
attention over the long context dominates, as it does at scale). Three gradients of the same loss
(a PPO-clip token-mean loss per response, summed over the group; `tiderl_jax/rl/longstraw.py`):

- `standard`: G full sequences [prompt + response] in one batch (`standard_grad`);
- `exact`: LongStraw, prompt once, responses replayed one at a time, KV cotangents pulled back;
- `approximate`: LongStraw with the prompt state held constant (the paper's mode).

`peak_bytes` is XLA's compiled memory analysis of the whole jitted gradient program (argument +
output + temporary buffers - aliased): deterministic, and what the program needs wherever it runs.
As a cross-check on this machine, `rss_growth_bytes` is the process's measured peak resident-set
growth while the program runs (Linux: VmHWM after resetting it via /proc/self/clear_refs; the
arguments are already resident, so it compares with peak_bytes minus arguments; noisier, since
the allocator keeps freed memory). `seconds` is one run of the compiled program (compile excluded);
`grad_cosine_to_standard` compares with the standard gradient at the same G.
Targets (issue 5): approximate peak grows <= 10% from G=2 to G=8; exact peak < standard peak at G=8.
The full run needs about 9 GiB of free memory (the standard gradient at G=8) and ~5 minutes.

JSON rows: mode, group_size, prompt_tokens, peak_bytes, seconds, grad_cosine_to_standard
(+ response_tokens, rss_growth_bytes, compile_seconds).
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.rl.longstraw import longstraw_grad, standard_grad, tree_cosine  # noqa: E402

MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=64, qk_norm=True, max_position_embeddings=8192)
GROUP_SIZES = (2, 4, 8)
MODES = ("standard", "exact", "approximate")


def ppo_clip_loss(logp, mask, extra):
    """Token-mean PPO-clip surrogate of one response (advantage [], old log-probs [R])."""
    ratio = jnp.exp(logp - extra["old_logp"])
    adv = extra["advantage"]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
    return -(surrogate * mask).sum() / jnp.maximum(mask.sum(), 1)


def gradient_program(graphdef, mode):
    """The jitted (params, prompt, responses, mask, extra) -> (loss, grads) program of one mode."""
    if mode == "standard":
        return jax.jit(lambda p, *group: standard_grad((graphdef, p), *group[:3], ppo_clip_loss, group[3]))
    return jax.jit(lambda p, *group: longstraw_grad((graphdef, p), *group[:3], ppo_clip_loss, group[3],
                                                    mode=mode))


def make_group(group_size, prompt_len, response_len, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(response_len // 2, response_len + 1, group_size)
    return (jnp.asarray(rng.integers(0, MODEL.vocab_size, prompt_len), jnp.int32),
            jnp.asarray(rng.integers(0, MODEL.vocab_size, (group_size, response_len)), jnp.int32),
            jnp.asarray(np.arange(response_len)[None, :] < lengths[:, None]),
            {"advantage": jnp.asarray(rng.normal(size=group_size), jnp.float32),
             "old_logp": jnp.asarray(-6 + 0.1 * rng.normal(size=(group_size, response_len)), jnp.float32)})


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_case(graphdef, params, mode, group):
    """Compiles and runs one gradient program -> (row fields, grads on the host)."""
    t0 = time.perf_counter()
    compiled = gradient_program(graphdef, mode).lower(params, *group).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    can_reset = _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    loss, grads = jax.block_until_ready(compiled(params, *group))
    seconds = time.perf_counter() - t0
    rss_growth = (_status_kib("VmHWM") - rss_before) * 1024 if can_reset else None
    if not np.isfinite(float(loss)):
        raise RuntimeError(f"{mode}: loss is {float(loss)}")
    return dict(peak_bytes=int(peak), seconds=seconds, rss_growth_bytes=rss_growth,
                compile_seconds=compile_s), jax.device_get(grads)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short version (1024-token prompt)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args()
    prompt_len, response_len = (1024, 128) if args.quick else (4096, 256)

    graphdef, params = nnx.split(init_decoder(MODEL, seed=0))
    rows = []
    for g in GROUP_SIZES:
        group = make_group(g, prompt_len, response_len, seed=g)
        standard = None
        for mode in MODES:  # standard first: the others are compared with it
            fields, grads = run_case(graphdef, params, mode, group)
            standard = grads if mode == "standard" else standard
            rows.append(dict(mode=mode, group_size=g, prompt_tokens=prompt_len,
                             response_tokens=response_len, **fields,
                             grad_cosine_to_standard=float(tree_cosine(grads, standard))))
            r = rows[-1]
            print(f"[{len(rows)}/{len(GROUP_SIZES) * len(MODES)}] G={g} {mode}: "
                  f"{r['peak_bytes'] / 2**20:.0f} MiB, {r['seconds']:.2f} s", flush=True)

    print(f"\nmodel {MODEL.num_params / 1e6:.2f}M params, prompt {prompt_len} tokens, responses <= "
          f"{response_len} tokens; peak = XLA compiled memory analysis")
    print(f"{'mode':<13}{'G':>3}{'peak MiB':>10}{'RSS growth MiB':>16}{'seconds':>9}{'compile s':>11}"
          f"{'cosine':>10}")
    for r in rows:
        rss = "n/a" if r["rss_growth_bytes"] is None else f"{r['rss_growth_bytes'] / 2**20:.0f}"
        print(f"{r['mode']:<13}{r['group_size']:>3}{r['peak_bytes'] / 2**20:>10.1f}{rss:>16}"
              f"{r['seconds']:>9.2f}{r['compile_seconds']:>11.1f}{r['grad_cosine_to_standard']:>10.5f}")
    peak = {(r["mode"], r["group_size"]): r["peak_bytes"] for r in rows}
    growth = peak["approximate", 8] / peak["approximate", 2]
    ratio = peak["exact", 8] / peak["standard", 8]
    print(f"\napproximate peak G=8 / G=2: {growth:.4f} (target <= 1.10: "
          f"{'met' if growth <= 1.10 else 'MISSED'})")
    print(f"exact peak / standard peak at G=8: {ratio:.4f} (target < 1: {'met' if ratio < 1 else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
