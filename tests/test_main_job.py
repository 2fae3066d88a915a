"""The main job (`launch/train.py`) end to end at tiny settings: the success path with its outputs (the
summary's counts, clocks and ledger, the config, the rollouts, the exported policy that generate.py runs),
Ctrl-C in each phase (saved, and the same command resumes), a finished run left alone and continued with
a raised step budget, the warm start from scratch on the visual task, a further warm-start stage from a
checkpoint (`launch/sft.py --init`), and an engine that fails (the run ends with the error named, no traceback,
nothing hangs)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e  # make test-e2e

# (dynamic sampling off: 32 new tokens in 2 turns solve almost nothing, so nearly every group has one reward)
TINY = ["--config.controller.filter_groups=false", "--config.controller.steps=3", "--config.eval.tasks=4", "--config.eval.every=2", "--config.eval.during_tasks=2",
        "--config.controller.groups_per_step=2",
        "--config.controller.group_size=2", "--config.controller.max_concurrent=8", "--config.rollout.max_turns=2",
        "--config.rollout.max_new_tokens=32", "--config.latency.median_s=0.01", "--config.latency.sigma=0.0"]


def _start(logdir, *args):
    return subprocess.Popen([sys.executable, "launch/train.py", f"--config.logdir={logdir}", *TINY, *args],
                            cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _interrupt_at(proc, marker: str, timeout: float = 240, sig: int = signal.SIGINT) -> str:
    """Reads the job's output until `marker` appears, sends `sig` (Ctrl-C's by default), returns all the output."""
    seen, t0 = [], time.monotonic()
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            os.kill(proc.pid, sig)
            break
        assert time.monotonic() - t0 < timeout, "".join(seen)[-3000:]
    rest, _ = proc.communicate(timeout=120)
    return "".join(seen) + rest


def _finish(proc) -> str:
    out, _ = proc.communicate(timeout=300)
    return out


@pytest.mark.timeout(900)
def test_interrupted_in_each_phase_it_resumes_and_reports_the_learning_statistics(tmp_path):
    out = _interrupt_at(_start(tmp_path), "held-out before (greedy)")
    assert "interrupted by SIGINT in held-out before" in out, out[-3000:]
    assert "Traceback" not in out
    proc = _start(tmp_path)
    interrupted = out = _interrupt_at(proc, "RL step 1/3")
    assert proc.returncode == 130 and "run the same command to resume" in out, out[-3000:]
    assert "Traceback" not in out
    proc = _start(tmp_path)
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "Traceback" not in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout_tasks"] == 4 and summary["steps"] >= 1 and summary["step"] == 3
    low, high = summary["heldout_gain_ci95"]
    assert low <= summary["heldout_gain"] <= high
    assert summary["rl_wall_s"] > 0 and summary["total_wall_s"] > summary["rl_wall_s"] and "wall_s" not in summary
    assert set(summary["phases_s"]) >= {"start", "RL", "held-out after", "export"}
    assert summary["heldout_after"]["greedy"]["tasks"] == 4
    ledger = summary["ledger"]  # the whole run's, across the interruptions: every sample accounted for
    assert ledger["unexplained"] == 0 and ledger["completed_as"]["unexplained"] == 0, ledger
    assert ledger["admitted"] > 0 and 0 < ledger["completed_as"]["trained"] <= 3 * 4  # 3 updates of 2 groups x 2
    for png in ("learning.png", "timeline.png", "reward_curve.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert png in summary["files"]["plots"]
    # step 2 ran in the interrupted invocation when the interrupt came during its update (which then runs to the
    # step's end), else in the resumed one
    _assert_evaluated_every_2_updates(tmp_path, interrupted + out, [2])
    assert summary["files"]["rollouts"].endswith("rollouts/during_rl_step_*.jsonl")
    assert "held-out greedy" in out and "95% CI" in out and "RL wall time" in out and "total wall time" in out
    assert json.loads((tmp_path / "config.json").read_text())["controller"]["steps"] == 3
    for when in ("before", "after"):
        for name in ("greedy", "sampled"):
            rows = [json.loads(line) for line in open(tmp_path / "rollouts" / f"heldout_{when}_{name}.jsonl")]
            assert len(rows) == 4 and all({"text", "tokens", "reward", "turns", "end_reason"} <= set(r) for r in rows)
    export = tmp_path / "hf_export"
    assert json.loads((export / "export.json").read_text())["step"] == 3
    assert json.loads((export / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    r = subprocess.run([sys.executable, "launch/generate.py", f"--checkpoint={export}", "--prompt=2+3=",
                        "--max_new_tokens=4", "--max_seq_len=128", "--num_pages=32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "generated" in r.stdout, r.stderr[-2000:]
    # the same command again: the run is finished, nothing is re-run or overwritten
    written = (tmp_path / "summary.json").stat().st_mtime_ns
    proc = _start(tmp_path)
    out = _finish(proc)
    assert proc.returncode == 0 and "holds a finished run (3 RL steps" in out, out[-3000:]
    assert (tmp_path / "summary.json").stat().st_mtime_ns == written
    # a raised step budget continues it
    proc = _start(tmp_path, "--config.controller.steps=4")
    out = _finish(proc)
    assert proc.returncode == 0 and "continuing the finished run" in out and "resumed from" in out, out[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 4
    _assert_evaluated_every_2_updates(tmp_path, out, [4])
    assert json.loads((tmp_path / "summary.3_steps.json").read_text())["step"] == 3
    # the same log directory with another configuration is refused, not silently resumed
    r = subprocess.run([sys.executable, "launch/train.py", f"--config.logdir={tmp_path}", *TINY,
                        "--config.controller.steps=4", "--config.controller.mode=sync", "--config.controller.eta=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds a run of another configuration (controller.eta: 1 -> 0, controller.mode" in \
        r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_in_rl_saves_the_step_and_the_printed_command_resumes_from_it(tmp_path, sig):
    # SIGTERM is what Slurm, Kubernetes and preemptible VMs send before a kill: the same as Ctrl-C
    proc = _start(tmp_path)
    out = _interrupt_at(proc, "RL step 1/3", sig=getattr(signal, sig))
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    m = re.search(rf"interrupted by {sig} in RL at RL step (\d)/3: saved in {tmp_path}; run the same command "
                  r"to resume: (.+)", out)
    assert m, out[-3000:]
    step, command = int(m.group(1)), shlex.split(m.group(2))
    assert command == [sys.executable, "launch/train.py", f"--config.logdir={tmp_path}", *TINY]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _interrupt_at(proc, "resumed from", sig=getattr(signal, sig))  # where it goes on from: enough, stopped again
    assert f"resumed from {tmp_path} at step {step}/3" in out, out[-3000:]
    assert proc.returncode == 130 and f"interrupted by {sig} in " in out, out[-3000:]


def _assert_evaluated_every_2_updates(logdir, out: str, printed: list[int]) -> None:
    """eval.every=2: the updates 2, 4, ... and only they have the held-out results of the evaluation during RL
    (eval.during_tasks=2) in metrics.jsonl and their rollouts in rollouts/; this invocation printed `printed`."""
    rows = {}
    for line in open(logdir / "metrics.jsonl"):
        row = json.loads(line)
        rows[row["step"]] = row  # a resumed run logs its later steps again: the last wins
    for step, row in rows.items():
        evals = {k for k in row if k.startswith("eval_")}
        if step % 2:
            assert not evals, row
        else:
            assert evals >= {"eval_success", "eval_solved", "eval_tasks", "eval_reward"} and row["eval_tasks"] == 2
            assert 0 <= row["eval_success"] <= 1
            assert len(open(logdir / "rollouts" / f"during_rl_step_{step}.jsonl").readlines()) == 2
    assert any(step % 2 == 0 for step in rows)
    for step in printed:
        assert f"held-out during RL (step {step}, greedy): " in out, out[-3000:]


@pytest.mark.timeout(600)
def test_the_visual_task_warm_starts_from_scratch_and_an_interrupted_warm_start_resumes(tmp_path):
    vision = ["--config.tasks=visual", "--config.warm_start=scratch", "--config.model.image_patch_dim=48",
              "--config.model.max_image_patches=16", "--config.sft.steps=6", "--config.sft.target=0",
              "--config.sft.log_every=1", "--config.sft.batch_size=4", "--config.sft.row_len=1024",
              "--config.controller.steps=1"]
    proc = _start(tmp_path, *vision)
    out = _interrupt_at(proc, "warm start step 2/6")
    assert proc.returncode == 130 and "warm start: saved at step" in out and "Traceback" not in out, out[-3000:]
    proc = _start(tmp_path, *vision)
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "warm start: resumed at step" in out
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1


@pytest.mark.timeout(300)
def test_a_further_warm_start_stage_starts_from_the_init_checkpoint(tmp_path):
    """`launch/sft.py --init=DIR` (the second stage of the shipped warm start, checkpoints/README.md): the first step's
    NLL is the warm-started policy's (random weights start near ln(384) = 5.95), and warm_start.json names the init."""
    out = tmp_path / "stage2"
    r = subprocess.run([sys.executable, "launch/sft.py", "--config=configs/tiny_agentic.py",
                        "--init=checkpoints/tiny_agentic_sft", f"--out={out}", "--config.tasks=lookup",
                        "--config.sft.steps=2", "--config.sft.target=0", "--config.sft.batch_size=4",
                        "--config.sft.shortcut_rate=0.6"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    meta = json.loads((out / "warm_start.json").read_text())
    assert meta["init"] == "checkpoints/tiny_agentic_sft" and meta["steps"] == 2 and meta["tasks"] == ["lookup"]
    assert meta["nll_first"] < 1.0 and meta["sft"]["shortcut_rate"] == 0.6
    assert (out / "model.safetensors").exists()


@pytest.mark.timeout(300)
def test_a_failing_engine_step_ends_the_run_with_the_error_named(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "launch/train.py", f"--config.logdir={tmp_path}", *TINY,
                        "--config.engine.attention_impl=pallas_gpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "runs JAX's GPU paged-attention kernel, and this engine runs on cpu" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and (tmp_path / "error.log").exists()
    assert time.monotonic() - t0 < 200
