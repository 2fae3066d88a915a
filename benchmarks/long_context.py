"""LongStraw vs the standard gradient on one long prompt: peak memory, time and gradient cosine.

    python benchmarks/long_context.py [--quick] [--json out.json] [--part gradient|trainer|both]
        [--device_gib 1.0]

Part `gradient` (the functions of `tiderl_jax/rl/longstraw.py` alone). One prompt (4096 tokens; 1024
with --quick) and G = 2, 4, 8 right-padded responses of up to 256 tokens (128 with --quick; lengths
drawn between half and all of that), on a small Qwen3-style model (vocab 384, hidden 128, 2 layers,
2 query heads of 64 over 1 KV head, MLP 384: 0.44M parameters, so attention over the long context
dominates, as it does at scale). Three gradients of the same loss (a PPO-clip token-mean loss per
response, summed over the group):

- `standard`: G full sequences [prompt + response] in one batch (`standard_grad`);
- `exact`: LongStraw, prompt once, responses replayed one at a time, KV cotangents pulled back;
- `approximate`: LongStraw with the prompt state held constant (the paper's mode).

Part `trainer` (the train step itself: `Trainer.gradients`, i.e. `rl_step` up to its summed
gradient: proximal scoring, advantages, the gradient program). One GRPO group of G = 2, 4, 8, 16
samples sharing a prompt, responses of 128 tokens (64 with --quick), the same model, the group in one
micro-batch (`micro_rows` = G). Modes are `trainer.shared_prompt`: `standard` ("off": every sample
packed as a full sequence), `exact`, `approximate`; context parallelism 1, 2, 4, 8 is a train mesh
`{"context": n}` (the shared prompt's tokens and K/V sharded over it, ring attention; the packed path
has no context parallelism, so `standard` runs at 1 only). Two tables:

1. at a fixed prompt (2048 tokens, where the packed path at G = 16 needs ~6 GiB; 1024 with --quick),
   every (mode, G, context parallelism):
   `peak_bytes` (per device: the largest XLA memory analysis among the step's programs, argument +
   output + temporaries - aliased), `rss_growth_bytes` (the process's peak resident-set growth over
   one step), `seconds` (one step, compiled), `grad_cosine_to_standard` (vs the packed gradient);
2. the longest prompt each (mode, context parallelism) holds at G = 16 under a per-device memory
   budget (`--device_gib`, default 1 GiB: the 24 GiB machine's share per faked device, less room for
   the process), searched by doubling from 256 tokens with `Trainer.memory_plan` (compile only: at
   the longest prompts a step would take minutes on two cores).

Peak memory in both parts is XLA's compiled memory analysis: deterministic, and what the program
needs wherever it runs. `rss_growth_bytes` is the cross-check on this machine (Linux: VmHWM after
resetting it via /proc/self/clear_refs; the arguments are already resident, so it compares with
peak_bytes minus arguments; noisier, since the allocator keeps freed memory). `seconds` excludes
compiling.

Targets (issue 5, gradient part): approximate peak grows <= 10% from G=2 to G=8; exact peak < standard
peak at G=8. Trainer part: approximate peak at G = 16 within 10% of G = 2; the longest prompt at
context parallelism 8 >= 4x that at 1; exact cosine >= 0.99999.

JSON rows: part, mode, group_size, context_parallel, prompt_tokens, peak_bytes, seconds,
grad_cosine_to_standard (+ response_tokens, rss_growth_bytes, compile_seconds; table 2's rows have
`longest: true`, no seconds or cosine).
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # context parallelism 8
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tiderl_jax.trajectory import Trajectory  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model  # noqa: E402
from tiderl_jax.rl.longstraw import longstraw_grad, standard_grad, tree_cosine  # noqa: E402
from tiderl_jax.rl.trainer import Trainer  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402

MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=64, qk_norm=True, max_position_embeddings=8192)
GROUP_SIZES = (2, 4, 8)
MODES = ("standard", "exact", "approximate")
TRAINER_GROUPS = (2, 4, 8, 16)
CONTEXT = (1, 2, 4, 8)
SHARED_PROMPT = {"standard": "off", "exact": "exact", "approximate": "approximate"}


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
    peak = _peak(compiled.memory_analysis())
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


def _peak(mem) -> int:
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)


def group_trajectories(prompt_len: int, group_size: int, response_len: int, seed: int = 0) -> list[Trajectory]:
    """One GRPO group: G samples of one prompt, each a response of `response_len` generated tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, MODEL.vocab_size, prompt_len).tolist()
    out = []
    for g in range(group_size):
        t = Trajectory(f"long-{g}", "long_context", group=0, reward=float(rng.normal()))
        t.extend(prompt, generated=False)
        t.extend(rng.integers(0, MODEL.vocab_size, response_len).tolist(), generated=True,
                 logprobs=(-6 + 0.1 * rng.normal(size=response_len)).tolist(),
                 model_logprobs=[0.0] * response_len, versions=[0] * response_len)
        out.append(t)
    return out


def make_trainer(mode: str, context: int, prompt_len: int, response_len: int, group_size: int) -> Trainer:
    """The trainer of one row: `trainer.shared_prompt` = the mode, on a train mesh {"context": n}."""
    cfg = TrainerConfig(learning_rate=1e-4, warmup_steps=0, total_steps=10, row_len=prompt_len + response_len,
                        micro_rows=group_size, shared_prompt=SHARED_PROMPT[mode],
                        shared_prompt_min_tokens=min(256, prompt_len))
    model = init_decoder(MODEL, seed=0)
    if context == 1:
        return Trainer(model, cfg)
    mesh = make_mesh({"context": context}, jax.devices()[:context])
    return Trainer(shard_model(model, mesh, DEFAULT_RULES), cfg, mesh=mesh)


def trainer_case(mode, context, trajectories, prompt_len, response_len):
    """One step's gradient through the trainer -> (row fields, gradients on the host)."""
    trainer = make_trainer(mode, context, prompt_len, response_len, len(trajectories))
    trainer.program_memory = {}
    t0 = time.perf_counter()
    trainer.gradients(trajectories)  # compiles (ahead of time, keeping the memory analyses) and runs
    compile_s = time.perf_counter() - t0
    can_reset = _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = trainer.gradients(trajectories)
    grads = jax.block_until_ready(out["gradients"])
    seconds = time.perf_counter() - t0
    rss_growth = (_status_kib("VmHWM") - rss_before) * 1024 if can_reset else None
    if not np.isfinite(out["loss"]):
        raise RuntimeError(f"trainer {mode} context {context}: loss is {out['loss']}")
    peak = max(_peak(m) for m in trainer.program_memory.values())
    return dict(peak_bytes=peak, seconds=seconds, rss_growth_bytes=rss_growth,
                compile_seconds=compile_s - seconds), jax.device_get(grads)


def longest_prompt(mode: str, context: int, group_size: int, response_len: int, budget: int,
                   start: int = 256, limit: int = 1 << 20) -> tuple[int, int]:
    """The longest prompt (doubling from `start`) whose step fits `budget` bytes per device, by
    `Trainer.memory_plan` (compile only) -> (prompt tokens, its peak bytes); (0, peak) if none."""
    best, best_peak, n = 0, 0, start
    while n <= limit:
        trainer = make_trainer(mode, context, n, response_len, group_size)
        plan = trainer.memory_plan(group_trajectories(n, group_size, response_len))
        peak = max(_peak(m) for m in plan.values())
        print(f"  {mode} context {context}: prompt {n}: {peak / 2**20:.0f} MiB per device", flush=True)
        if peak > budget:
            return best, best_peak or peak
        best, best_peak, n = n, peak, n * 2
    return best, best_peak


def trainer_part(args) -> list[dict]:
    prompt_len, response_len = (1024, 64) if args.quick else (2048, 128)
    cases = [(m, c) for m in MODES for c in CONTEXT if m != "standard" or c == 1]
    rows, total = [], len(TRAINER_GROUPS) * len(cases)
    for g in TRAINER_GROUPS:
        trajectories = group_trajectories(prompt_len, g, response_len, seed=g)
        standard = None
        for mode, context in cases:  # standard first: the others are compared with it
            fields, grads = trainer_case(mode, context, trajectories, prompt_len, response_len)
            standard = grads if mode == "standard" else standard
            rows.append(dict(part="trainer", mode=mode, group_size=g, context_parallel=context,
                             prompt_tokens=prompt_len, response_tokens=response_len, **fields,
                             grad_cosine_to_standard=float(tree_cosine(grads, standard))))
            r = rows[-1]
            print(f"[trainer {len(rows)}/{total}] G={g} {mode} context {context}: "
                  f"{r['peak_bytes'] / 2**20:.0f} MiB, {r['seconds']:.2f} s, cosine "
                  f"{r['grad_cosine_to_standard']:.6f}", flush=True)
    budget = int(args.device_gib * 2**30)
    g = TRAINER_GROUPS[-1]
    print(f"\nlongest prompt per (mode, context parallelism) at G = {g} within {args.device_gib} GiB per device:")
    for mode, context in cases:
        n, peak = longest_prompt(mode, context, g, response_len, budget,
                                 limit=(1 << 16) if args.quick else (1 << 20))
        rows.append(dict(part="trainer", longest=True, mode=mode, group_size=g, context_parallel=context,
                         prompt_tokens=n, response_tokens=response_len, peak_bytes=peak, seconds=None,
                         grad_cosine_to_standard=None))

    print(f"\ntrainer step, prompt {prompt_len} tokens, G responses of {response_len} tokens, the group in "
          "one micro-batch; peak = the largest XLA memory analysis among the step's programs, per device")
    print(f"{'mode':<13}{'G':>3}{'context':>8}{'peak MiB':>10}{'RSS growth MiB':>16}{'seconds':>9}{'cosine':>11}")
    for r in rows:
        if r.get("longest"):
            continue
        rss = "n/a" if r["rss_growth_bytes"] is None else f"{r['rss_growth_bytes'] / 2**20:.0f}"
        print(f"{r['mode']:<13}{r['group_size']:>3}{r['context_parallel']:>8}{r['peak_bytes'] / 2**20:>10.1f}"
              f"{rss:>16}{r['seconds']:>9.2f}{r['grad_cosine_to_standard']:>11.7f}")
    print(f"\nlongest prompt held at G = {g} ({args.device_gib} GiB per device):")
    print(f"{'mode':<13}{'context':>8}{'prompt tokens':>15}{'peak MiB':>10}")
    longest = {}
    for r in rows:
        if r.get("longest"):
            longest[r["mode"], r["context_parallel"]] = r["prompt_tokens"]
            print(f"{r['mode']:<13}{r['context_parallel']:>8}{r['prompt_tokens']:>15}{r['peak_bytes'] / 2**20:>10.1f}")
    peak = {(r["mode"], r["group_size"], r["context_parallel"]): r["peak_bytes"] for r in rows if not r.get("longest")}
    growth = peak["approximate", 16, 1] / peak["approximate", 2, 1]
    worst = min(r["grad_cosine_to_standard"] for r in rows if r["mode"] == "exact" and not r.get("longest"))
    print(f"\napproximate peak G=16 / G=2 (context 1): {growth:.4f} (target <= 1.10: "
          f"{'met' if growth <= 1.10 else 'MISSED'})")
    for mode in ("exact", "approximate"):
        ratio = longest[mode, 8] / max(longest[mode, 1], 1)
        print(f"{mode}: longest prompt at context 8 / context 1: {ratio:.1f}x (target >= 4: "
              f"{'met' if ratio >= 4 else 'MISSED'})")
    print(f"exact cosine to standard, worst row: {worst:.7f} (target >= 0.99999: "
          f"{'met' if worst >= 0.99999 else 'MISSED'})")
    return rows


def gradient_part(args) -> list[dict]:
    prompt_len, response_len = (1024, 128) if args.quick else (4096, 256)

    graphdef, params = nnx.split(init_decoder(MODEL, seed=0))
    rows = []
    for g in GROUP_SIZES:
        group = make_group(g, prompt_len, response_len, seed=g)
        standard = None
        for mode in MODES:  # standard first: the others are compared with it
            fields, grads = run_case(graphdef, params, mode, group)
            standard = grads if mode == "standard" else standard
            rows.append(dict(part="gradient", mode=mode, group_size=g, context_parallel=1, prompt_tokens=prompt_len,
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
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short version (1024-token prompts)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--part", choices=("gradient", "trainer", "both"), default="both")
    p.add_argument("--device_gib", type=float, default=1.0,
                   help="per-device memory budget of the longest-prompt search (trainer part)")
    args = p.parse_args()
    rows = []
    if args.part in ("gradient", "both"):
        rows += gradient_part(args)
    if args.part in ("trainer", "both"):
        rows += trainer_part(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
