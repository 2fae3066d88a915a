"""Workload presets and their sampling distributions (issue 8)."""

import dataclasses
import math

import numpy as np
import pytest

from tiderl_jax.sim import costs, hardware, workloads
from tiderl_jax.sim.workloads import ClippedLognormal, Fixed, Workload, sample_task


def fixed_workload(max_context, **kw):
    base = dict(name="hand", source="test", model="qwen2.5-7b", accelerator="h100", devices=8, max_turns=5,
                max_context=max_context, prompts_per_step=1, group_size=1, prompt_tokens=Fixed(100),
                turns=Fixed(5), tokens_per_turn=Fixed(300), observation_tokens=Fixed(200),
                env_latency_s=Fixed(2.5), from_paper=(), assumed=workloads.PARAMETERS)
    return Workload(**{**base, **kw})


def test_presets_state_every_parameter_as_the_papers_or_ours():
    for w in workloads.PRESETS.values():
        assert sorted(w.from_paper + w.assumed) == sorted(workloads.PARAMETERS), w.name
        assert w.source and w.notes
        costs.model_shape(w.model)  # every name resolves
        hardware.accelerator(w.accelerator)
    text = workloads.workload("tiderl-text-7b")
    assert (text.devices, text.max_turns, text.max_context) == (32, 20, 8192)
    assert {"devices", "max_turns", "max_context", "model"} <= set(text.from_paper)
    assert "env_latency_s" in text.assumed and "accelerator" in text.assumed
    assert workloads.workload("tiderl-text-14b").model == "qwen2.5-14b"
    assert workloads.workload("tiderl-multimodal").max_turns == 50
    math_rl = workloads.workload("bidirl-math")
    assert math_rl.devices == 32 and "devices" in math_rl.from_paper and math_rl.max_turns == 1
    with pytest.raises(ValueError, match="unknown workload 'swe-bench'"):
        workloads.workload("swe-bench")


def test_a_parameter_left_unattributed_or_attributed_twice_is_refused():
    with pytest.raises(ValueError, match=r"missing \['turns'\]"):
        fixed_workload(1000, assumed=tuple(p for p in workloads.PARAMETERS if p != "turns"))
    with pytest.raises(ValueError, match=r"listed twice \['devices'\]"):
        fixed_workload(1000, from_paper=("devices",))
    with pytest.raises(ValueError, match="turns reach 9 > max_turns=5"):
        fixed_workload(1000, turns=Fixed(9))
    with pytest.raises(ValueError, match="group_size=0"):
        fixed_workload(1000, group_size=0)


def test_lognormal_median_mean_and_clipping():
    d = ClippedLognormal(median=2.0, sigma=1.0)
    assert d.mean() == pytest.approx(2.0 * math.exp(0.5))
    x = d.sample(np.random.default_rng(0), 20_000)
    assert np.median(x) == pytest.approx(2.0, rel=0.05)
    assert x.mean() == pytest.approx(d.mean(), rel=0.1)
    clipped = ClippedLognormal(median=100, sigma=2.0, low=10, high=400, integer=True).sample(
        np.random.default_rng(0), 5_000)
    assert clipped.dtype == np.int64 and clipped.min() == 10 and clipped.max() == 400
    assert isinstance(ClippedLognormal(5, 0.5, integer=True).sample(np.random.default_rng(1)), int)
    assert ClippedLognormal(5, 0.0).sample(np.random.default_rng(1)) == pytest.approx(5.0)  # sigma 0: the median
    with pytest.raises(ValueError, match="median=0"):
        ClippedLognormal(median=0, sigma=1)
    with pytest.raises(ValueError, match="low=3"):
        ClippedLognormal(median=2, sigma=1, low=3)
    with pytest.raises(ValueError, match="Fixed.value=-1"):
        Fixed(-1)


def test_a_task_alternates_turns_and_environment_calls():
    t = sample_task(fixed_workload(10_000), np.random.default_rng(0))
    assert t.gen_tokens == (300,) * 5 and t.obs_tokens == (200,) * 4 and t.env_latency_s == (2.5,) * 4
    assert not t.truncated and t.context_tokens == 100 + 1500 + 800


def test_max_context_truncates_generation_and_observations():
    # 100 + 300 + 200 + 300 = 900; the next observation would reach 1100 >= 1000: stop before it
    t = sample_task(fixed_workload(1000), np.random.default_rng(0))
    assert (t.gen_tokens, t.obs_tokens, t.truncated) == ((300, 300), (200,), True)
    # the second turn's 300 tokens would reach 900 >= 800: it generates the 200 that fit
    t = sample_task(fixed_workload(800), np.random.default_rng(0))
    assert (t.gen_tokens, t.obs_tokens, t.truncated, t.context_tokens) == ((300, 200), (200,), True, 800)


def test_sampled_presets_respect_their_limits_and_seeds():
    for w in workloads.PRESETS.values():
        rng = np.random.default_rng(7)
        for _ in range(200):
            t = sample_task(w, rng)
            assert 1 <= len(t.gen_tokens) <= w.max_turns
            assert t.context_tokens <= w.max_context
            assert len(t.obs_tokens) == len(t.env_latency_s)
            assert len(t.obs_tokens) == len(t.gen_tokens) - 1  # a call between every two turns, none after
    math_rl = sample_task(workloads.BIDIRL_MATH, np.random.default_rng(0))
    assert len(math_rl.gen_tokens) == 1 and math_rl.obs_tokens == ()
    w = workloads.TIDERL_TEXT_7B
    assert sample_task(w, np.random.default_rng(3)) == sample_task(w, np.random.default_rng(3))
    assert dataclasses.replace(w, devices=64).devices == 64  # presets are values: vary by replace


def test_drift_schedules_interpolate_between_knots_and_scale_the_medians():
    d = workloads.Drift(tokens_per_turn=((0.0, 0.5), (0.5, 3.0), (1.0, 1.5)), turns=((0.0, 2.0), (1.0, 1.0)))
    assert d.factors(0.0, 0, 0) == (0.5, 2.0)
    assert d.factors(0.25, 0, 0) == pytest.approx((1.75, 1.75))
    assert d.factors(1.0, 0, 0) == (1.5, 1.0)
    w = fixed_workload(100_000, max_turns=20, turns=ClippedLognormal(median=4, sigma=0.5, low=1, high=10, integer=True),
                       tokens_per_turn=ClippedLognormal(median=100, sigma=0.5, low=8, high=150, integer=True), drift=d)
    early, mid = w.at(0.0), w.at(0.5)
    assert early.drift is None and early.tokens_per_turn.median == 50 and early.turns.median == 8
    assert mid.tokens_per_turn.median == 150  # 300 clipped to the distribution's range
    assert fixed_workload(1000).at(0.3) is not None and fixed_workload(1000).at(0.3).drift is None
    # per-step variance: reproducible by (seed, step), different between steps
    v = workloads.Drift(step_sigma=0.3)
    assert v.factors(0.5, 3, 0) == v.factors(0.5, 3, 0) != v.factors(0.5, 4, 0)
    with pytest.raises(ValueError, match="knots"):
        workloads.Drift(turns=((0.2, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="step_sigma"):
        workloads.Drift(step_sigma=-1)


def test_the_drifting_preset_moves_its_shapes_over_the_run():
    from tiderl_jax.sim.backend import sample_tasks

    w = workloads.workload("webshop-drift-7b")
    assert "drift" in w.assumed and w.drift is not None
    assert {"webshop-7b", "alfworld-7b"} <= set(workloads.PRESETS)
    sampler = workloads.drift_sampler(w, groups_per_step=4, steps=100, seed=0, sample_tasks=sample_tasks)
    assert workloads.drift_sampler(workloads.workload("webshop-7b"), groups_per_step=4, steps=100, seed=0,
                                   sample_tasks=sample_tasks) is None

    def mean_turns(step):
        shapes = [s for g in range(step * 4, step * 4 + 4)
                  for s in sampler(g, np.random.default_rng([0, g]), 64)]
        return np.mean([len(s.gen_tokens) for s in shapes]), np.mean([np.mean(s.gen_tokens) for s in shapes])
    (turns0, tokens0), (turns50, tokens50) = mean_turns(0), mean_turns(50)
    assert turns0 > 1.5 * turns50 and tokens50 > 2 * tokens0  # many short turns early, fewer longer ones mid-run
