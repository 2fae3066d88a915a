"""Smoke test of benchmarks/learning.py: the warm start -> GRPO pipeline runs end to end on a tiny model.

Not a learning claim (the benchmark makes that): a few SFT steps and one stopping probe, then 2
GRPO iterations of 2 tasks x 2 samples through the real engine, rollout loop, trainer and weight
updates; rewards, losses and gradient norms are finite, no step is skipped, the engine gets every
new version and the GRPO steps move the parameters.

A model this small never solves a task, so every GRPO group has all-equal rewards and zero
advantage; the entropy bonus gives the RL loss a gradient regardless, so the test sees the update
path change the parameters.
"""

import dataclasses
import importlib.util
import math
import pathlib

import pytest

from tiderl_jax.model.config import ModelConfig
from tiderl_jax.rl.losses import LossConfig

pytestmark = pytest.mark.e2e  # make test-e2e

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "learning.py"
_spec = importlib.util.spec_from_file_location("learning_benchmark", _PATH)
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)

SMOKE = dataclasses.replace(
    learning.Settings(),
    model=ModelConfig(arch="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=1024),
    sft_steps=3, sft_batch=4, sft_min_steps=3, probe_every=3, probe_tasks=2, probe_samples=1,
    iterations=2, tasks_per_iteration=2, group_size=2, heldout_tasks=2, heldout_samples=1, max_turns=2,
    max_new_tokens=32, max_context=384, row_len=576, sft_row_len=320, micro_rows=4,
    loss=LossConfig(entropy_coef=0.01))


def test_warm_start_then_grpo_runs_and_changes_the_policy():
    row = learning.run(SMOKE)
    assert row["task"] == "calculator" and row["steps"] == 2 and row["sft_steps"] == 3
    assert len(row["sft_nll_curve"]) == 3 and all(math.isfinite(x) and x > 0 for x in row["sft_nll_curve"])
    for key in ("heldout_reward_before", "heldout_reward_after", "heldout_greedy_before", "heldout_greedy_after"):
        assert 0.0 <= row[key] <= 1.0, key
    assert len(row["history"]) == 2
    for h in row["history"]:
        assert h["skipped"] == 0.0 and h["tokens"] > 0
        for key in ("reward", "loss", "policy_loss", "entropy", "grad_norm"):
            assert math.isfinite(h[key]), (key, h)
    versions = [h["version"] for h in row["history"]]  # every GRPO step's weights reached the engine
    assert versions == sorted(set(versions)) and versions[-1] == row["engine_version"]
    assert len(row["sft_probes"]) == 1  # the warm start's stopping probe ran (and did not stop it)
    assert row["grpo_param_delta"] > 0
