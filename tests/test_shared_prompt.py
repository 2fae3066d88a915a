"""LongStraw inside the trainer: shared-prompt groups trained prompt-once equal the packed path (exact)."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl import shared_prompt
from tiderl_jax.rl.longstraw import tree_cosine
from tiderl_jax.rl.losses import LossConfig
from tiderl_jax.rl.trainer import Scorer, Trainer
from tiderl_jax.rl.trainer_config import TrainerConfig

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")


def _multi_turn(i, group, prompt, turns, reward, seed):
    """A trajectory of `prompt`, then per turn (generated, observation) token counts."""
    rng = np.random.default_rng(seed)
    t = Trajectory(f"t{i}", "calculator", group)
    t.extend(list(prompt), generated=False)
    for gen, obs in turns:
        t.extend(rng.integers(0, 96, gen).tolist(), generated=True, logprobs=(-rng.random(gen) - 3).tolist(),
                 model_logprobs=[0.0] * gen, versions=[0] * gen)
        if obs:
            t.extend(rng.integers(0, 96, obs).tolist(), generated=False)
    t.reward = reward
    return t


def _batch():
    rng = np.random.default_rng(0)
    long_a, long_b = rng.integers(0, 96, 37).tolist(), rng.integers(0, 96, 21).tolist()
    out = []
    # group 0: a 37-token shared prompt, multi-turn (observations inside the response), ragged
    for j, (turns, r) in enumerate([([(5, 4), (3, 0)], 1.0), ([(7, 0)], 0.0), ([(2, 6), (4, 3), (2, 0)], 0.5)]):
        out.append(_multi_turn(len(out), 0, long_a, turns, r, seed=10 + j))
    # group 1: a 21-token shared prompt, one turn
    for j, r in enumerate([1.0, 0.0]):
        out.append(_multi_turn(len(out), 1, long_b, [(6 + j, 0)], r, seed=20 + j))
    # group 2: prompts that differ after 3 tokens: packed
    for j, r in enumerate([0.0, 1.0]):
        out.append(_multi_turn(len(out), 2, long_a[:3] + rng.integers(0, 96, 9).tolist(), [(5, 0)], r, seed=30 + j))
    # group 3: same prompt shape as group 1 (stacked into one shape class with it)
    for j, r in enumerate([0.0, 2.0]):
        out.append(_multi_turn(len(out), 3, long_b[::-1], [(3 + 2 * j, 0)], r, seed=40 + j))
    return out


def _config(mode, **kw):
    base = dict(loss=LossConfig(kl_coef=0.1), learning_rate=1e-2, warmup_steps=0, total_steps=10,
                row_len=64, micro_rows=2, temperature=0.8, shared_prompt=mode, shared_prompt_min_tokens=16)
    base.update(kw)
    return TrainerConfig(**base)


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def test_split_finds_the_shared_groups_and_their_prompts():
    trajs = _batch()
    shared, rest = shared_prompt.split(trajs, range(len(trajs)), min_tokens=16, max_response=64)
    assert sorted(g.prompt_len for g in shared.groups) == [21, 21, 37]
    assert rest == [5, 6]  # group 2's prefix is 3 tokens
    assert len(shared.classes) == 2  # groups 1 and 3 share (bucket 32, G 2, response bucket 8)
    for i in shared.where:  # each response is the trajectory after its prompt, its mask the loss mask
        p = next(g.prompt_len for g in shared.groups if i in g.members)
        n = len(trajs[i].tokens) - p
        assert shared.per_token("responses", i, n).tolist() == trajs[i].tokens[p:]
        assert shared.per_token("mask", i, n).tolist() == [float(m) for m in trajs[i].loss_mask[p:]]
    # the prefix stops at the first generated token even when samples agree beyond it
    a, b = _multi_turn(0, 0, [1, 2, 3], [(4, 0)], 0.0, seed=1), _multi_turn(1, 0, [1, 2, 3], [(4, 0)], 1.0, seed=1)
    assert a.tokens == b.tokens and shared_prompt.shared_prefix([a, b]) == 3
    assert shared_prompt.prompt_bucket(37) == 48 and shared_prompt.prompt_bucket(5000) == 6144


def test_exact_mode_equals_the_packed_step_and_approximate_differs():
    loss = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    ref = nnx.split(init_decoder(CFG, seed=9))[1]
    trainers = {mode: Trainer(init_decoder(CFG, seed=8), _config(mode, loss=loss), ref_params=ref)
                for mode in ("off", "exact", "approximate")}
    grads = {mode: t.gradients(_batch()) for mode, t in trainers.items()}  # changes nothing
    assert float(tree_cosine(grads["exact"]["gradients"], grads["off"]["gradients"])) > 0.99999
    assert float(tree_cosine(grads["approximate"]["gradients"], grads["off"]["gradients"])) < 0.9999
    for k in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "tokens", "sequences"):
        # the same forward: every loss term agrees in approximate mode too; its gradient misses the prompt's share
        assert grads["approximate"][k] == pytest.approx(grads["off"][k], rel=1e-4, abs=1e-6), k
    assert grads["approximate"]["grad_norm"] != pytest.approx(grads["off"]["grad_norm"], rel=1e-3)
    metrics = {mode: trainers[mode].rl_step(_batch()) for mode in ("off", "exact")}
    assert trainers["off"].step_count == 1
    assert metrics["off"]["shared_groups"] == 0 and metrics["exact"]["shared_groups"] == 3
    for k in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "grad_norm", "tokens", "sequences"):
        assert metrics["exact"][k] == pytest.approx(metrics["off"][k], rel=1e-4, abs=1e-6), k
    # Adam's first step ~ lr * sign(g): float noise on a near-zero gradient shows as 0.3% of lr (the packed rows
    # and the shared classes sum in different orders)
    for a, b in zip(_params(trainers["exact"]), _params(trainers["off"])):
        np.testing.assert_allclose(a, b, atol=3e-5)


def test_shared_groups_take_the_proximal_log_probs_from_the_updates_forward_as_the_separate_pass():
    ref = nnx.split(init_decoder(CFG, seed=9))[1]
    auto = Trainer(init_decoder(CFG, seed=8), _config("exact"), ref_params=ref)
    always = Trainer(init_decoder(CFG, seed=8), _config("exact", recompute_proximal="always"), ref_params=ref)
    m_auto, m_always = auto.rl_step(_batch()), always.rl_step(_batch())
    assert m_auto["shared_groups"] == 3 and (m_auto["proximal_in_step"], m_always["proximal_recomputed"]) == (1, 1)
    for k in ("loss", "policy_loss", "kl", "importance_weight", "grad_norm"):
        assert m_auto[k] == pytest.approx(m_always[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(_params(auto), _params(always)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_reference_logprobs_scored_ahead_are_used_in_both_paths():
    """RA2P scores the reference ahead (info["ref_logp"], per token of the whole trajectory)."""
    with_ref = Trainer(init_decoder(CFG, seed=8), _config("exact"), ref_params=nnx.split(init_decoder(CFG, seed=9))[1])
    want = with_ref.rl_step(_batch())
    ahead = _batch()
    logp = Scorer(init_decoder(CFG, seed=9), _config("off")).score_trajectories(ahead)
    for t, lp in zip(ahead, logp):
        t.info["ref_logp"] = lp.tolist()
    got = Trainer(init_decoder(CFG, seed=8), _config("exact")).rl_step(ahead)
    for k in ("loss", "kl", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=1e-4), k


def test_sharded_exact_step_equals_the_packed_one_with_dr_grpo_aggregation_and_configs_are_checked():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    loss = LossConfig(advantage_estimator="dr_grpo", aggregation="constant")  # norm_len: the row length
    single = Trainer(init_decoder(CFG, seed=3), _config("off", loss=loss))
    sharded = Trainer(shard_model(init_decoder(CFG, seed=3), mesh, DEFAULT_RULES), _config("exact", loss=loss),
                      mesh=mesh)
    m1, m2 = single.rl_step(_batch()), sharded.rl_step(_batch())
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6) and m2["shared_groups"] == 3
    for a, b in zip(_params(single), _params(sharded)):  # within 1% of one step (Adam moves each weight by up to
        np.testing.assert_allclose(a, b, atol=1e-4)        # lr = 1e-2; 2e-5 apart on one element of this CPU)
    with pytest.raises(ConfigError, match="shared_prompt='fast'"):
        _config("fast")
    with pytest.raises(ConfigError, match="value head"):
        _config("exact", loss=LossConfig(advantage_estimator="gae"))
    with pytest.raises(ConfigError, match="shared_prompt_min_tokens"):
        _config("exact", shared_prompt_min_tokens=0)


def test_a_real_controller_step_trains_shared_groups_exactly(tmp_path):
    """The controller's first update with `exact` equals a packed trainer's on the same trajectories."""
    from tests.test_controller import CFG as CTRL_CFG, _controller
    c = _controller(tmp_path, "sync", steps=1, groups_per_step=2, group_size=3)
    c.trainer.config = dataclasses.replace(c.trainer.config, shared_prompt="exact", shared_prompt_min_tokens=8)
    start = [np.asarray(x) for x in jax.tree.leaves(c.trainer.params)]
    seen, inner = [], c.trainer.rl_step

    def record(trajectories, **kw):
        seen.append([Trajectory.from_dict(t.to_dict()) for t in trajectories])
        m = inner(trajectories, **kw)
        seen[-1] = (seen[-1], m)
        return m
    c.trainer.rl_step = record
    asyncio.run(c.run())
    (trajs, metrics), = [s for s in seen if s[1]]  # warm-ups return {}
    assert metrics["shared_groups"] >= 1 and metrics["skipped"] == 0
    model = init_decoder(CTRL_CFG, seed=0)  # the controller's policy before its first update
    assert all(np.array_equal(a, b) for a, b in zip(start, jax.tree.leaves(nnx.split(model)[1])))
    host = lambda tree: None if tree is None else jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)  # noqa: E731
    packed = Trainer(model, dataclasses.replace(c.trainer.config, shared_prompt="off"),
                     ref_params=host(c.trainer.ref_params))
    want = packed.rl_step(trajs)
    assert want["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
    for a, b in zip(_params(c.trainer), _params(packed)):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert float(tree_cosine(host(c.trainer.params), packed.params)) > 0.999999


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_context_parallel_train_mesh_equals_one_device(mode):
    """A train mesh with a context axis: shared prompts run ring attention over 4 devices; the step equals
    the one-device step of the same mode (and exact equals the packed one)."""
    mesh = make_mesh({"context": 4}, jax.devices()[:4])
    one = Trainer(init_decoder(CFG, seed=3), _config(mode))
    four = Trainer(shard_model(init_decoder(CFG, seed=3), mesh, DEFAULT_RULES), _config(mode), mesh=mesh)
    g1, g4 = one.gradients(_batch()), four.gradients(_batch())
    assert g4["loss"] == pytest.approx(g1["loss"], rel=1e-5, abs=1e-7)
    assert float(tree_cosine(jax.device_get(g4["gradients"]), g1["gradients"])) > 0.99999
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(g1["gradients"]))
    for a, b in zip(jax.tree.leaves(jax.device_get(g4["gradients"])), jax.tree.leaves(g1["gradients"])):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)
    if mode == "approximate":  # what approximate changes is the gradient; the update on top is checked for exact
        return
    m1, m4 = one.rl_step(_batch()), four.rl_step(_batch())
    assert m4["shared_groups"] == 3 and m1["loss"] == pytest.approx(m4["loss"], rel=1e-4, abs=1e-6)
    for a, b in zip(_params(one), _params(four)):  # Adam's first step ~ lr * sign(g): tiny gradients flip
        np.testing.assert_allclose(a, b, atol=1e-4)
