"""Goodput of the three controller modes and the machine's limit, same workload, in one run.

    python benchmarks/goodput.py [--quick] [--json out.json] [--steps N] [...flags below]

Workload (every parameter is a flag; defaults in brackets):
- model: a 1.0M-parameter Qwen3-style decoder (hidden 128, 4 layers, vocab 384), the size
  benchmarks/learning.py found trainable in minutes here; warm-started once by SFT on the tasks'
  demonstrations (`--sft-steps` [500] of `--sft-batch` [32]) and every mode starts from those
  weights (cached in `--warm-cache` [.cache/goodput_warm], keyed by model, tasks and steps);
- tasks: `calculator` and `lookup` (`--tasks`), up to `--max-turns` [8] turns of up to
  `--new-tokens` [96] tokens (a tool call is 60-67 tokens of the byte-level tokenizer: a
  32-token turn, this benchmark's first setting, could never call a tool, so no task was
  solvable), contexts up to 1024 tokens (the truncation policy of the rollout loop ends a task
  that would pass it), environment latency log-normal with median `--latency-median` [0.3 s]
  and `--latency-sigma` [1.0] (heavy tail, capped at 5 s): real waiting time;
- per update `--groups` [4] GRPO groups of `--group-size` [4] samples; `--steps` [8] updates per mode,
  of which the first `--skip` [2] are excluded from the rates (they include compilation);
- 8 faked CPU devices, each mode in its own layout: sync puts rollout and training on all 8 (they
  take turns); async (AReaL-like) splits them into rollout 4 and train 4, the reference scored on
  the train devices; tiderl into rollout 4, reference 2 and train 2 (device groups of 2; RA2P runs
  the reference on its own devices or on the train devices, ERS moves groups when a move pays).

Modes (the same `Controller`, different settings): `sync` (staleness 0, rollout and training take
turns, request-level rollout), `async` (staleness 1, disjoint groups, request-level rollout),
`tiderl` (async + CTB + RA2P + ERS), and `limit`: the same work with zero environment latency, in
tiderl's layout (every device as busy as the schedule allows). All devices share two cores here, so
waiting is the only thing a schedule can hide, and `limit` is what the machine does without any.
(A first version ran `limit` in the sync layout; tiderl then beat it, because rollout and training
in two threads keep both cores busier than one phase at a time: that layout is not a bound here.)

Rates are over updates `skip+1 .. steps`: goodput = trained tokens (samples) consumed by those
updates / their wall time; waiting = device-seconds idle over the same span (rollout lane and
train + ref lanes; in sync each device is counted once: idle while neither generating nor
training, as rollout waiting while the trainer waits for data, else as trainer waiting).
Held-out reward: greedy, `--heldout` [16] held-out tasks per kind, after the run.
JSON rows: mode, goodput_tokens_per_s, goodput_samples_per_s, step_time_s, rollout_wait_s,
trainer_wait_s, kv_hit_rate, heldout_reward (+ wall_s, moves, discarded, staleness).
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
sys.path.insert(0, str(ROOT))

from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.rl import evaluate, sft  # noqa: E402
from tiderl_jax.rl.checkpoint import Checkpointer  # noqa: E402
from tiderl_jax.rl.losses import LossConfig  # noqa: E402
from tiderl_jax.rl.trainer import Trainer, TrainerConfig  # noqa: E402
from tiderl_jax.runtime.controller import Controller, ControllerConfig  # noqa: E402

MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=2048,
                    dtype="float32")
MODES = ("sync", "async", "tiderl", "limit")


def _rates(logdir: str, skip: int) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
    a, b = rows[skip - 1] if skip else None, rows[-1]
    span = b["wall_s"] - (a["wall_s"] if a else 0.0)

    def delta(key):
        return b[key] - (a[key] if a else 0.0)
    return dict(goodput_tokens_per_s=delta("consumed_tokens") / span,
                goodput_samples_per_s=delta("consumed_samples") / span,
                step_time_s=span / (len(rows) - skip),
                rollout_wait_s=delta("rollout_wait_total_s"), trainer_wait_s=delta("trainer_wait_total_s"))


def run_mode(mode: str, warm_params, tok, args) -> dict:
    latency = (LatencyModel() if mode == "limit" else
               LatencyModel(args.latency_median, args.latency_sigma, 5.0))
    ccfg = ControllerConfig(mode="tiderl" if mode == "limit" else mode, steps=args.steps,
                            groups_per_step=args.groups, group_size=args.group_size,
                            max_concurrent=args.max_concurrent, task_kinds=tuple(args.tasks),
                            device_group_size=2, rollout_groups=2, ref_groups=0 if mode == "async" else 1,
                            train_groups=2 if mode == "async" else 1, tensor=2)
    tcfg = TrainerConfig(loss=LossConfig(), learning_rate=1e-4, warmup_steps=1, total_steps=args.steps + 1,
                         row_len=1024, micro_rows=4)
    ecfg = EngineConfig(page_size=16, num_pages=4096, max_seq_len=2048, max_running=64, prefill_chunk=512,
                        prefill_budget=2048, max_prefill_rows=16, decode_steps=8)
    rcfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.new_tokens, max_context=1024)
    logdir = tempfile.mkdtemp(prefix=f"goodput_{mode}_")
    c = Controller(init_decoder(MODEL, seed=0), tok, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                   trainer_config=tcfg, latency=latency, logdir=logdir)
    c.load_policy(warm_params)
    t0 = time.perf_counter()
    summary = asyncio.run(c.run())
    wall = time.perf_counter() - t0
    greedy = dataclasses.replace(rcfg, temperature=0.0, mode="request")
    heldout = sum(evaluate.heldout_reward(c.engine, tok, k, args.heldout, greedy) for k in args.tasks) / len(args.tasks)
    c.metrics.close()
    c.checkpointer.close()
    row = dict(mode=mode, **_rates(logdir, args.skip), kv_hit_rate=summary["kv_hit_rate"],
               heldout_reward=heldout, wall_s=wall, moves=summary["moves"], discarded=summary["discarded"],
               staleness=summary["staleness"], logdir=logdir)
    print(f"[{mode}] " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()), flush=True)
    return row


def warm_start(tok, args):
    """The SFT warm start every mode starts from; kept in `--warm-cache` (keyed by everything that
    determines it), since it is the slowest part and the same for every run of these flags."""
    warm = Trainer(init_decoder(MODEL, seed=0), TrainerConfig(
        learning_rate=3e-3, warmup_steps=10, total_steps=max(args.sft_steps, 11), row_len=1024))
    key = f"{MODEL.hidden_size}x{MODEL.num_layers}_{'-'.join(args.tasks)}_{args.sft_steps}x{args.sft_batch}"
    cache = Checkpointer(os.path.join(args.warm_cache, key), keep=1, async_save=False)
    if cache.latest_step() is not None:
        arrays, meta = cache.restore(dict(params=warm.params))
        print(f"warm start: restored {key} from {args.warm_cache} (NLL {meta['nll_first']:.3f} -> "
              f"{meta['nll_last']:.3f})", flush=True)
        cache.close()
        return arrays["params"]
    t0 = time.perf_counter()
    curve = sft.warm_start(warm, tok, args.tasks, args.sft_steps, args.sft_batch, seed=0, log_every=10)
    print(f"warm start: {args.sft_steps} SFT steps of {args.sft_batch}, NLL {curve[0]:.3f} -> "
          f"{sum(curve[-10:]) / len(curve[-10:]):.3f}, {time.perf_counter() - t0:.0f}s", flush=True)
    cache.save(args.sft_steps, dict(params=warm.params),
               dict(nll_first=curve[0], nll_last=sum(curve[-10:]) / len(curve[-10:])))
    cache.close()
    return warm.params


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 updates per mode, 1 skipped, short SFT")
    p.add_argument("--json")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                   help="modes to run, in turn (none: only make the cached warm start)")
    p.add_argument("--tasks", nargs="+", default=["calculator", "lookup"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-concurrent", type=int, default=48)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--latency-median", type=float, default=0.3)
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--warm-cache", default=str(ROOT / ".cache" / "goodput_warm"),
                   help="directory of cached warm starts")
    p.add_argument("--heldout", type=int, default=16)
    args = p.parse_args()
    if args.quick:
        args.steps, args.skip, args.sft_steps, args.heldout = 3, 1, 30, 4
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip {args.skip} must be in [0, --steps {args.steps})")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tiderl_jax").setLevel(logging.INFO)
    tok = Tokenizer.builtin()
    warm = warm_start(tok, args)
    rows = [run_mode(m, warm, tok, args) for m in args.modes]
    print(f"\n{'mode':<8}{'goodput tok/s':>15}{'samples/s':>11}{'step s':>8}{'rollout wait':>14}"
          f"{'trainer wait':>14}{'hit rate':>10}{'held-out':>10}{'moves':>7}")
    for r in rows:
        print(f"{r['mode']:<8}{r['goodput_tokens_per_s']:>15.1f}{r['goodput_samples_per_s']:>11.3f}"
              f"{r['step_time_s']:>8.2f}{r['rollout_wait_s']:>14.1f}{r['trainer_wait_s']:>14.1f}"
              f"{r['kv_hit_rate']:>10.3f}{r['heldout_reward']:>10.3f}{r['moves']:>7}")
    by = {r["mode"]: r for r in rows}
    if {"sync", "async", "tiderl", "limit"} <= by.keys():
        g = {m: by[m]["goodput_tokens_per_s"] for m in by}
        wait = {m: by[m]["rollout_wait_s"] + by[m]["trainer_wait_s"] for m in by}
        change = wait['tiderl'] / max(wait['sync'], 1e-9) - 1
        print(f"\ntiderl / limit {g['tiderl'] / g['limit']:.2f} (target >= 0.90), tiderl / sync "
              f"{g['tiderl'] / g['sync']:.2f}, tiderl / async {g['tiderl'] / g['async']:.2f}; total waiting "
              f"{wait['tiderl']:.1f} device-s, {abs(change):.0%} {'below' if change <= 0 else 'above'} sync's "
              f"{wait['sync']:.1f} (target: >= 77% below)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
