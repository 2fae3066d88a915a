"""Goodput of the three controller modes and the machine's limit, same workload, in one run.

    python benchmarks/goodput.py [--quick] [--json out.json] [--steps N] [...flags below]

Workload (every parameter is a flag; defaults in brackets):
- model: a 0.84M-parameter Qwen3-style decoder (hidden 128, 4 layers, vocab 384), the size
  benchmarks/learning.py found trainable in minutes here; every mode starts from the same warm-started
  weights: by default the main job's shipped policy (`--warm-from` [checkpoints/tiny_agentic_sft], SFT on
  the tasks' demonstrations until it succeeds sometimes; checkpoints/README.md), or with `--warm-from ""`
  a warm start made here (`--sft-steps` [500] of `--sft-batch` [32], cached in `--warm-cache`
  [.cache/goodput_warm], keyed by model, tasks and steps);
- tasks: `calculator` and `lookup` (`--tasks`), up to `--max-turns` [8] turns of up to
  `--new-tokens` [96] tokens (a tool call is 60-67 tokens of the byte-level tokenizer: a
  32-token turn, this benchmark's first setting, could never call a tool, so no task was
  solvable), contexts up to 1024 tokens (the truncation policy of the rollout loop ends a task
  that would pass it), environment latency log-normal with median `--latency-median` [0.3 s]
  and `--latency-sigma` [1.0] (heavy tail, capped at 5 s): real waiting time;
- per update `--groups` [4] GRPO groups of `--group-size` [4] samples, staleness bound `--eta` [1] for
  async and tiderl; `--steps` [8] updates per run, of which the first `--skip` [2] are excluded from the
  rates;
- 8 faked CPU devices, each mode in its own layout: sync puts rollout and training on all 8 (they
  take turns); async (AReaL-like) splits them into rollout 4 and train 4, the reference scored on
  the train devices; tiderl the same (device groups of 2; ERS moves groups when a move pays), or with
  `--ref-groups 1` into rollout 4, reference 2 and train 2 (RA2P runs the reference on its own devices or
  on the train devices). Measured (issue 18, one round, 8 updates): async 154 tokens/s; tiderl in async's
  layout 153; tiderl with the reference group and ERS off 125 (its trainer on 2 devices takes longer than the
  reference pipelining saves; RA2P's choice compares the reference's placements, not what its devices would
  do for the trainer); with ERS on, before its move-cost estimate counted a new mesh's compile, 89 (ERS moved
  the reference group to rollout and the engine compiled 66 programs for 6 devices inside the window).

Modes (the same `Controller`, different settings): `sync` (staleness 0, rollout and training take
turns, request-level rollout), `async` (staleness 1, disjoint groups, request-level rollout),
`tiderl` (async + CTB + RA2P + ERS), and `limit`: the same work with zero environment latency, in
tiderl's layout (every device as busy as the schedule allows). All devices share two cores here, so
waiting is the only thing a schedule can hide, and `limit` is what the machine does without any.
(A first version ran `limit` in the sync layout; tiderl then beat it, because rollout and training
in two threads keep both cores busier than one phase at a time: that layout is not a bound here.)

**Fairness.** A mode's first run on its device layout compiles its programs (engine buckets, the
trainer's and scorer's packed micro-batch counts); whichever mode came first used to pay that inside its
measured updates (async, first on the 4-device layouts: updates 3-5 took 19-27 s against a steady 5 s).
So: a warm-up pass first runs every mode for `--warmup-steps` [3] updates, unmeasured, which fills the
persistent compile cache for every layout, and every run loads all its programs before its first update
(`JaxBackend.warmup`: the engine's whole shape-bucket grid, 66 programs with the engine's buckets spaced in
powers of four as the main job's, and the trainer's and ref scorer's step programs for every packed micro-batch
count the batch can take), since each run builds a new engine and trainer; a run prints any program it still
loaded during its steps (the warm-up pass compiles, the others only load); then `--rounds` [3] measured rounds run every mode once each,
the order rotated by one mode per round (round r starts with mode r), so no mode is always first or last
on a loaded machine. The table gives each mode's median over the rounds with its range, and the ratios
tiderl / async, tiderl / sync and tiderl / limit as the median (and range) of the per-round ratios
(paired: the same round's runs). `compile_s` is the compile / program-load seconds that still fell
inside a run's measured window (the controller logs its backend's total each update): it should be ~0.

Rates are over updates `skip+1 .. steps`: goodput = trained tokens (samples) consumed by those
updates / their wall time; waiting = device-seconds idle over the same span (rollout lane and
train + ref lanes; in sync each device is counted once: idle while neither generating nor
training, as rollout waiting while the trainer waits for data, else as trainer waiting).
**What bounds a run** (`bound`, from its own metrics over the window): the idle share of the rollout lane
(its waiting / its device-seconds) against that of the train + ref lanes: `trainer` when the rollout
devices idle more (they wait for the next weights), else `rollout` when the rollout devices are busy at
least half the time, else `waiting`: the trainer starves while the rollout devices mostly idle, the
samples being out in their environments.
Held-out reward: greedy, `--heldout` [16] held-out tasks per kind, after the run.
JSON rows (one per measured run): mode, round, goodput_tokens_per_s, goodput_samples_per_s, step_time_s,
rollout_wait_s, trainer_wait_s, rollout_idle, trainer_idle, bound, compile_s, kv_hit_rate, heldout_reward
(`--heldout` > 0; + wall_s, moves, discarded, staleness, logdir).
"""

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(devices=8)

from tiderl_jax.agents.env import LatencyModel  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import EngineConfig  # noqa: E402
from tiderl_jax.model.config import ModelConfig  # noqa: E402
from tiderl_jax.model.decoder import init_decoder  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.rl import evaluate, sft  # noqa: E402
from tiderl_jax.rl.batch import num_micro_batches  # noqa: E402
from tiderl_jax.rl.checkpoint import Checkpointer  # noqa: E402
from tiderl_jax.rl.losses import LossConfig  # noqa: E402
from tiderl_jax.rl.trainer import Trainer  # noqa: E402
from tiderl_jax.rl.trainer_config import TrainerConfig  # noqa: E402
from tiderl_jax.runtime.controller import Controller, ControllerConfig  # noqa: E402

MODEL = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=2048,
                    dtype="float32")
MODES = ("sync", "async", "tiderl", "limit", "async-aa")
# `async-aa`: async run again under its own name (an A/A control): async-aa / async per round is this workload's
# run-to-run noise on this machine (what the policy happens to generate, which groups the staleness bound drops,
# the machine's load), against which "tiderl >= async within the noise" is read
ROLLOUT_DEVICES, TRAIN_DEVICES = 4, 4  # every layout: 4 rollout devices, 4 for train + ref (sync: all 8 both)


def _rates(logdir: str, skip: int) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(logdir, "metrics.jsonl"))]
    a, b = rows[skip - 1] if skip else None, rows[-1]
    span = b["wall_s"] - (a["wall_s"] if a else 0.0)

    def delta(key):
        return b.get(key, 0.0) - (a.get(key, 0.0) if a else 0.0)
    # device-seconds each side held over the window (ERS moves change the rollout count at a boundary)
    total = ROLLOUT_DEVICES + TRAIN_DEVICES
    rollout_held = sum((r["wall_s"] - (p["wall_s"] if p else 0.0)) * (p or r)["rollout_devices"]
                       for p, r in zip([a] + rows[skip:-1], rows[skip:]))
    shared = rows[-1]["rollout_devices"] == total  # sync: every device in both lanes
    train_held = rollout_held if shared else span * total - rollout_held
    r_idle = delta("rollout_wait_total_s") / max(rollout_held, 1e-9)
    t_idle = delta("trainer_wait_total_s") / max(train_held, 1e-9)
    bound = "trainer" if r_idle > t_idle else ("rollout" if r_idle < 0.5 else "waiting")
    return dict(goodput_tokens_per_s=delta("consumed_tokens") / span,
                goodput_samples_per_s=delta("consumed_samples") / span,
                step_time_s=span / (len(rows) - skip),
                rollout_wait_s=delta("rollout_wait_total_s"), trainer_wait_s=delta("trainer_wait_total_s"),
                rollout_idle=r_idle, trainer_idle=t_idle, bound=bound, compile_s=delta("compile_total_s"))


def run_mode(mode: str, warm_params, tok, args, *, steps: int, skip: int, heldout: int, label: str) -> dict:
    """One run of `mode` for `steps` updates, rates over updates `skip+1..steps` (`_rates`)."""
    if mode == "async-aa":
        return dict(run_mode("async", warm_params, tok, args, steps=steps, skip=skip, heldout=heldout,
                             label=f"{label} (A/A)"), mode=mode)
    latency = (LatencyModel() if mode == "limit" else
               LatencyModel(args.latency_median, args.latency_sigma, 5.0))
    ccfg = ControllerConfig(mode="tiderl" if mode == "limit" else mode, steps=steps,
                            groups_per_step=args.groups, group_size=args.group_size,
                            eta=None if mode == "sync" else args.eta,
                            max_concurrent=args.max_concurrent, task_kinds=tuple(args.tasks),
                            device_group_size=2, rollout_groups=2, ref_groups=args.ref_groups if mode in ("tiderl", "limit") else 0,
                            train_groups=2 - (args.ref_groups if mode in ("tiderl", "limit") else 0), tensor=2)
    tcfg = TrainerConfig(loss=LossConfig(), learning_rate=1e-4, warmup_steps=1, total_steps=steps + 1,
                         row_len=args.max_context, micro_rows=4)
    ecfg = EngineConfig(page_size=16, num_pages=4096, max_seq_len=2048, max_running=64, prefill_chunk=512,
                        prefill_budget=2048, max_prefill_rows=16, decode_steps=8, bucket_growth=4)
    rcfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.new_tokens, max_context=args.max_context)
    logdir = tempfile.mkdtemp(prefix=f"goodput_{mode}_")
    c = Controller(init_decoder(MODEL, seed=0), tok, config=ccfg, engine_config=ecfg, rollout_config=rcfg,
                   trainer_config=tcfg, latency=latency, logdir=logdir)
    c.load_policy(warm_params)
    # every program the run can ask for, loaded before its first update (a new Controller builds a new engine
    # and trainer, whose programs load again even when the persistent cache holds them)
    micro = [1 << k for k in range(num_micro_batches(ccfg.batch_samples, tcfg.micro_rows).bit_length())]
    warm_s = c.backend.warmup(micro)
    loaded = c.engine.programs(), set(c.backend.trainer._programs)
    t0 = time.perf_counter()
    summary = asyncio.run(c.run())
    wall = time.perf_counter() - t0
    new = sorted(map(str, c.engine.programs() - loaded[0])) + sorted(map(str, set(c.backend.trainer._programs) - loaded[1]))
    if new:  # programs the run loaded after its warm-up (in its steps)
        print(f"[{label} {mode}] {len(new)} programs loaded during the run: {'; '.join(new)[:400]}", flush=True)
    greedy = dataclasses.replace(rcfg, temperature=0.0, mode="request")
    score = (sum(evaluate.heldout_reward(c.engine, tok, k, heldout, greedy) for k in args.tasks) / len(args.tasks)
             if heldout else None)
    c.metrics.close()
    c.checkpointer.close()
    row = dict(mode=mode, **_rates(logdir, skip), kv_hit_rate=summary["kv_hit_rate"],
               heldout_reward=score, wall_s=wall, moves=summary["moves"], discarded=summary["discarded"],
               staleness=summary["staleness"], warmup_s=warm_s, logdir=logdir)
    print(f"[{label} {mode}] " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items()), flush=True)
    return row


def rounds(modes: list[str], n: int, run) -> list[dict]:
    """`n` measured rounds of every mode, the order rotated by one per round; `run(mode, round)` -> row."""
    rows = []
    for r in range(n):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            rows.append(dict(run(mode, r), round=r))
    return rows


def medians(rows: list[dict]) -> dict:
    """Per mode the median goodput over rounds with (min, max); per pair of modes the median (min, max) of
    the per-round ratios; the bound seen most often per mode."""
    by = collections.defaultdict(dict)
    for r in rows:
        by[r["mode"]][r["round"]] = r
    out = {}
    for mode, runs in by.items():
        g = [x["goodput_tokens_per_s"] for x in runs.values()]
        bounds = collections.Counter(x["bound"] for x in runs.values())
        out[mode] = dict(median=statistics.median(g), low=min(g), high=max(g),
                         bound=bounds.most_common(1)[0][0],
                         **{k: statistics.median(x[k] for x in runs.values())
                            for k in ("step_time_s", "rollout_wait_s", "trainer_wait_s", "rollout_idle",
                                      "trainer_idle", "compile_s", "kv_hit_rate", "moves")})
    for a, b in (("tiderl", "async"), ("tiderl", "sync"), ("tiderl", "limit"), ("async", "sync"), ("async-aa", "async")):
        if a in by and b in by:
            ratios = [by[a][k]["goodput_tokens_per_s"] / by[b][k]["goodput_tokens_per_s"]
                      for k in by[a] if k in by[b]]
            out[f"{a}/{b}"] = dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios))
    return out


def print_table(summary: dict, modes: list[str], n: int) -> None:
    print(f"\n{'mode':<8}{'goodput tok/s (median, range over ' + str(n) + ' rounds)':>44}{'step s':>8}"
          f"{'rollout idle':>13}{'train idle':>11}{'bound':>9}{'compile s':>10}{'hit rate':>9}{'moves':>6}")
    for m in modes:
        r = summary[m]
        print(f"{m:<8}{r['median']:>26.1f}  [{r['low']:>6.1f}, {r['high']:>6.1f}]{'':>6}{r['step_time_s']:>8.2f}"
              f"{r['rollout_idle']:>13.2f}{r['trainer_idle']:>11.2f}{r['bound']:>9}{r['compile_s']:>10.1f}"
              f"{r['kv_hit_rate']:>9.3f}{r['moves']:>6.0f}")
    for key in ("tiderl/async", "tiderl/sync", "tiderl/limit", "async/sync", "async-aa/async"):
        if key in summary:
            r = summary[key]
            print(f"{key:<14} {r['median']:.2f}x  [{r['low']:.2f}, {r['high']:.2f}] (per-round ratios)")


def warm_start(tok, args):
    """The warm-started weights every mode starts from: the checkpoint `--warm-from` (it must have this
    benchmark's model shape), else an SFT warm start kept in `--warm-cache` (keyed by everything that
    determines it), since it is the slowest part and the same for every run of these flags."""
    if args.warm_from:
        from flax import nnx

        from tiderl_jax.model.hf_io import load_hf_checkpoint, read_hf_config
        cfg = read_hf_config(args.warm_from, dtype=MODEL.dtype)
        if cfg != MODEL:
            raise SystemExit(f"--warm-from {args.warm_from}: its model ({cfg}) is not this benchmark's ({MODEL})")
        print(f"warm start: {args.warm_from}", flush=True)
        return nnx.split(load_hf_checkpoint(args.warm_from, dtype=MODEL.dtype))[1]
    warm = Trainer(init_decoder(MODEL, seed=0), TrainerConfig(
        learning_rate=3e-3, lr_schedule="cosine", warmup_steps=10, total_steps=max(args.sft_steps, 11), row_len=1024))
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


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", default=["calculator", "lookup"])
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--eta", type=int, default=1, help="staleness bound of async and tiderl")
    p.add_argument("--max-concurrent", type=int, default=48)
    p.add_argument("--ref-groups", type=int, default=0, choices=(0, 1),
                   help="tiderl's (and limit's) reference groups of 2 devices, taken from its 4 train devices")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--max-context", type=int, default=1024, help="tokens per trajectory (also the trainer's row)")
    p.add_argument("--latency-median", type=float, default=0.3)
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--warm-from", default=str(ROOT / "checkpoints" / "tiny_agentic_sft"),
                   help='an HF checkpoint of this model to start from ("": an SFT warm start made here)')
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--warm-cache", default=str(ROOT / ".cache" / "goodput_warm"),
                   help="directory of cached warm starts")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round of 3 updates per mode, 1 skipped, short SFT")
    p.add_argument("--json")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                   help="modes to run (none: only make the cached warm start)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds, modes interleaved")
    p.add_argument("--warmup-steps", type=int, default=3, help="updates of each mode's unmeasured warm-up run "
                                                                "(0: none)")
    p.add_argument("--heldout", type=int, default=16, help="greedy held-out tasks per kind after each mode's "
                                                           "last-round run (0: none)")
    add_workload_flags(p)
    args = p.parse_args()
    if args.quick:
        args.steps, args.skip, args.sft_steps, args.heldout, args.rounds, args.warmup_steps = 3, 1, 30, 4, 1, 2
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip {args.skip} must be in [0, --steps {args.steps})")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tiderl_jax").setLevel(logging.INFO)
    tok = Tokenizer.builtin()
    warm = warm_start(tok, args)
    summary = measure(args.modes, warm, tok, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary["rows"], f, indent=2)


def measure(modes: list[str], warm, tok, args) -> dict:
    """The warm-up pass, then the interleaved rounds; prints the table; returns {rows, summary}."""
    if args.warmup_steps:
        for m in modes:
            run_mode(m, warm, tok, args, steps=args.warmup_steps, skip=args.warmup_steps - 1, heldout=0,
                     label="warm-up")
    rows = rounds(modes, args.rounds, lambda m, r: run_mode(
        m, warm, tok, args, steps=args.steps, skip=args.skip,
        heldout=args.heldout if r == args.rounds - 1 else 0, label=f"round {r + 1}/{args.rounds}"))
    summary = medians(rows)
    if modes:
        print_table(summary, modes, args.rounds)
    return dict(rows=rows, summary=summary)


if __name__ == "__main__":
    main()
