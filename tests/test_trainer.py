"""The trainer: packing, scoring, the accumulated and sharded train step, SFT, bad input."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from tiderl_jax.trajectory import Trajectory
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import REMAT_POLICIES, init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl.batch import pack
from tiderl_jax.rl.losses import LossConfig
from tiderl_jax.rl.advantages import group_advantages
from tiderl_jax.rl.trainer import Trainer, _warmup_trajectories, step_memory, token_logprobs
from tiderl_jax.rl.trainer_config import TrainerConfig, lr_schedule

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")


def _traj(i, n, reward, group, prompt=5, seed=0):
    rng = np.random.default_rng(seed * 1000 + i)
    t = Trajectory(f"t{i}", "calculator", group)
    t.extend(rng.integers(0, 96, prompt).tolist(), generated=False)
    gen = n - prompt
    t.extend(rng.integers(0, 96, gen).tolist(), generated=True, logprobs=(-rng.random(gen) - 3).tolist(),
             model_logprobs=[0.0] * gen, versions=[0] * gen)
    t.reward = reward
    return t


TRAJS = [_traj(i, n, r, g) for i, (n, r, g) in enumerate(
    [(12, 1.0, 0), (9, 0.0, 0), (15, 0.0, 0), (7, 1.0, 1), (11, 0.0, 1), (6, 1.0, 1), (13, 0.5, 2)])]


def _config(**kw):
    base = dict(loss=LossConfig(kl_coef=0.1), learning_rate=1e-2, warmup_steps=0, total_steps=10,
                row_len=32, micro_rows=4)
    base.update(kw)
    return TrainerConfig(**base)


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def test_pack_first_fit_segments_and_drops():
    long = _traj(99, 40, 1.0, 3)
    empty = Trajectory("e", "calculator", 4, tokens=[1, 2], loss_mask=[False, False],
                       logprobs=[0.0, 0.0], model_logprobs=[0.0, 0.0], versions=[-1, -1])
    p = pack(TRAJS + [long, empty], row_len=32, micro_rows=2)
    assert [i for i, _ in p.dropped] == [7, 8]
    assert "40 tokens exceed" in p.dropped[0][1] and "no model-generated" in p.dropped[1][1]
    assert sorted(p.kept) == list(range(7))
    assert p.arrays["tokens"].shape[1:] == (2, 32) and p.arrays["tokens"].shape[0] in (1, 2, 3, 4)
    for j, i in enumerate(p.kept):  # every kept trajectory is found intact at its placement
        assert p.per_token("tokens", j).tolist() == TRAJS[i].tokens
        assert p.per_token("positions", j).tolist() == list(range(len(TRAJS[i].tokens)))
        assert p.per_token("mask", j).tolist() == [float(m) for m in TRAJS[i].loss_mask]
    assert p.num_tokens == sum(t.num_generated for t in TRAJS)


def test_micro_batch_counts_round_up_to_powers_of_two_or_one_and_a_half_times_one():
    from tiderl_jax.rl.batch import num_micro_batches
    assert [num_micro_batches(rows, 8) for rows in (1, 8, 9, 17, 24, 25, 33, 48, 49, 57, 64, 65)] == \
        [1, 1, 2, 3, 3, 4, 6, 6, 8, 8, 8, 12]
    assert num_micro_batches(1, 8, min_micro=5) == 6


def test_packed_logprobs_equal_each_sequence_alone():
    model = init_decoder(CFG, seed=1)
    p = pack(TRAJS, row_len=32, micro_rows=2)
    a = p.arrays
    for m in range(a["tokens"].shape[0]):
        logp, _ = token_logprobs(model, jnp.asarray(a["tokens"][m]), jnp.asarray(a["positions"][m]),
                                 jnp.asarray(a["segment_ids"][m]), 0.7)
        a.setdefault("logp", np.zeros_like(a["mask"]))[m] = np.asarray(logp)
    # the reference: each sequence in a row of its own, from position 0, padding after it (causal attention keeps
    # its log-probs the padding's); one forward for all of them
    toks = np.zeros((len(TRAJS), 32), np.int32)
    for i, t in enumerate(TRAJS):
        toks[i, :len(t.tokens)] = t.tokens
    logits, _ = model(jnp.asarray(toks), jnp.broadcast_to(jnp.arange(32), toks.shape))
    ref = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1] / 0.7, axis=-1),
                                         jnp.asarray(toks[:, 1:, None]), axis=-1)[..., 0])
    for j, i in enumerate(p.kept):
        n = len(TRAJS[i].tokens)
        np.testing.assert_allclose(p.per_token("logp", j)[1:], ref[i, :n - 1], atol=1e-5)


def test_group_advantages_ragged_groups():
    adv = group_advantages(LossConfig(advantage_estimator="rloo"), [1.0, 0.0, 0.0, 3.0, 1.0, 5.0],
                           [0, 0, 0, 7, 7, 9])
    # group 0: 1 - mean(0, 0) = 1, 0 - 0.5, 0 - 0.5; group 7: 3 - 1, 1 - 3; group 9 alone: 0
    np.testing.assert_allclose(adv, [1.0, -0.5, -0.5, 2.0, -2.0, 0.0], atol=1e-6)


def test_accumulation_over_micro_batches_equals_one_big_batch():
    one = Trainer(init_decoder(CFG, seed=2), _config(micro_rows=8, row_len=32))
    many = Trainer(init_decoder(CFG, seed=2), _config(micro_rows=1, row_len=32))
    m1, m2 = one.rl_step(TRAJS), many.rl_step(TRAJS)
    assert m1["skipped"] == 0 and m2["skipped"] == 0
    for k in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "tokens"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(_params(one), _params(many)):  # summation order differs: Adam amplifies ~1e-7
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_sharded_step_equals_single_device(estimator):
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    ref = init_decoder(CFG, seed=4)
    cfg = _config(loss=LossConfig(kl_coef=0.1, advantage_estimator=estimator))
    single = Trainer(init_decoder(CFG, seed=3), cfg, ref_params=nnx.split(ref)[1])
    sharded_model = shard_model(init_decoder(CFG, seed=3), mesh, DEFAULT_RULES)
    sharded_ref = shard_model(init_decoder(CFG, seed=4), mesh, DEFAULT_RULES)
    sharded = Trainer(sharded_model, cfg, mesh=mesh, ref_params=nnx.split(sharded_ref)[1])
    for _ in range(2):
        m1, m2 = single.rl_step(TRAJS), sharded.rl_step(TRAJS)
        assert m1["kl"] > 0 and m1["kl"] == pytest.approx(m2["kl"], rel=1e-4)
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6)
    for a, b in zip(_params(single), _params(sharded)):
        np.testing.assert_allclose(a, b, atol=2e-5)
    leaf = jax.tree.leaves(sharded.params)[0]
    assert len(leaf.sharding.device_set) == 8  # parameters stayed on the train mesh


def test_rl_step_changes_params_and_metrics_are_finite():
    trainer = Trainer(init_decoder(CFG, seed=5), _config())
    before = _params(trainer)
    m = trainer.rl_step(TRAJS)
    assert all(np.isfinite(v) for v in m.values())
    assert m["tokens"] == sum(t.num_generated for t in TRAJS) and m["sequences"] == len(TRAJS)
    assert 0.0 <= m["clip_fraction"] <= 1.0 and m["entropy"] > 0
    assert any(not np.array_equal(a, b) for a, b in zip(before, _params(trainer)))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_as_the_step_program_returns_leaves_the_step_applied_and_the_state_saveable(sig, monkeypatch, request):
    """The step donates its parameters and optimizer state: Ctrl-C between the program's return and the
    stores must not leave the trainer holding deleted arrays (the main job saves them on Ctrl-C). SIGTERM
    (`interrupts.install`: what a scheduler sends before a kill) is held the same way."""
    import signal

    from tiderl_jax import interrupts

    monkeypatch.setattr(interrupts, "_terminated", False)
    if sig == "SIGTERM":
        previous = signal.getsignal(signal.SIGTERM)
        request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
        interrupts.install()
    trainer = Trainer(init_decoder(CFG, seed=5), _config())
    before = _params(trainer)
    real = trainer._program

    def program(key, build):
        fn = real(key, build)
        if key[0] != "rl":  # the scoring programs before it
            return fn

        def call(*args):
            out = fn(*args)  # the inputs are donated now
            signal.raise_signal(getattr(signal, sig))  # Python raises it at its next check, inside this frame
            return out
        return call
    trainer._program = program
    with pytest.raises(KeyboardInterrupt):
        trainer.rl_step(TRAJS)
    assert trainer.step_count == 1
    after = _params(trainer)  # raises "Array has been deleted" when the stores were skipped
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(trainer.opt_state))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupts.name() == sig


def test_equal_rewards_give_zero_advantage_and_no_update():
    trainer = Trainer(init_decoder(CFG, seed=6), _config(loss=LossConfig()))
    same = [_traj(i, 10, 1.0, 0) for i in range(4)]
    before = _params(trainer)
    m = trainer.rl_step(same)
    assert m["policy_loss"] == 0.0 and m["grad_norm"] == 0.0 and m["skipped"] == 0
    for a, b in zip(before, _params(trainer)):
        np.testing.assert_array_equal(a, b)


def test_non_finite_loss_skips_the_update_and_the_run_goes_on(caplog):
    trainer = Trainer(init_decoder(CFG, seed=7), _config())
    bad = [_traj(i, 10, r, 0) for i, r in enumerate([1.0, float("nan"), 0.0])]
    before = _params(trainer)
    with caplog.at_level(logging.WARNING):
        m = trainer.rl_step(bad)
    assert m["skipped"] == 1.0 and trainer.skipped_steps == 1
    assert "update skipped" in caplog.text
    for a, b in zip(before, _params(trainer)):
        np.testing.assert_array_equal(a, b)
    m = trainer.rl_step(TRAJS)  # the next good batch trains
    assert m["skipped"] == 0.0 and any(not np.array_equal(a, b) for a, b in zip(before, _params(trainer)))


def test_each_update_reports_its_learning_rate_and_a_skipped_one_does_not_advance_it():
    cfg = _config(warmup_steps=2, lr_schedule="cosine")
    trainer = Trainer(init_decoder(CFG, seed=10), cfg)
    bad = [_traj(i, 10, r, 0) for i, r in enumerate([1.0, float("nan"), 0.0])]
    # a warm-up that does not start at 0: a third of the peak (1e-2), two thirds, then the peak
    lrs = [trainer.rl_step(batch)["lr"] for batch in (TRAJS, bad, TRAJS, TRAJS)]
    assert lrs == pytest.approx([1e-2 / 3, 2e-2 / 3, 2e-2 / 3, 1e-2])
    next_lr = float(lr_schedule(cfg)(3))
    assert trainer.learning_rate() == pytest.approx(next_lr) and next_lr < 1e-2  # the cosine decay began


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
def test_the_schedules_over_a_short_run(name):
    peak, total = 1e-3, 6
    lr = lr_schedule(TrainerConfig(learning_rate=peak, lr_schedule=name, warmup_steps=1, total_steps=total,
                                   end_lr_ratio=0.1))
    rates = [float(lr(k)) for k in range(total)]
    assert rates[0] == pytest.approx(peak / 2) and rates[1] == pytest.approx(peak)  # no update at rate 0
    if name == "constant":
        assert rates[1:] == pytest.approx([peak] * (total - 1))
    else:  # from the peak after the warm-up to end_lr_ratio of it at the run's last update, falling
        assert rates[-1] == pytest.approx(0.1 * peak) and all(a > b for a, b in zip(rates[1:], rates[2:]))
        mid = 0.55 * peak if name == "cosine" else peak + (0.1 * peak - peak) * 0.5
        assert float(lr(3)) == pytest.approx(mid)  # half-way through the decay
    with pytest.raises(ConfigError, match="lr_schedule='step' is not one of"):
        TrainerConfig(lr_schedule="step")


def test_empty_and_overlong_batches_are_reported_not_raised():
    trainer = Trainer(init_decoder(CFG, seed=8), _config())
    assert trainer.rl_step([]) == {"dropped": 0.0, "skipped": 1.0}
    m = trainer.rl_step([_traj(0, 40, 1.0, 0)])
    assert m == {"dropped": 1.0, "skipped": 1.0}


def test_sft_lowers_the_nll_of_its_data():
    trainer = Trainer(init_decoder(CFG, seed=9), _config(learning_rate=3e-3))
    p = pack(TRAJS, row_len=32, micro_rows=2)
    first = trainer.sft_step(p)["nll"]
    for _ in range(15):
        last = trainer.sft_step(p)["nll"]
    assert last < 0.85 * first


def test_bad_trainer_configs_are_named():
    with pytest.raises(ConfigError, match="aggregation='sequence'"):
        TrainerConfig(loss=LossConfig(aggregation="sequence"))
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainerConfig(warmup_steps=20, total_steps=10)


def test_ppo_with_gae_trains_the_value_head_and_matches_a_hand_computed_return():
    from tiderl_jax.rl.advantages import gae_advantages

    cfg = _config(loss=LossConfig(advantage_estimator="gae", gamma=1.0, lam=1.0, kl_coef=0.0))
    trainer = Trainer(init_decoder(CFG, seed=10), cfg)
    p = pack(TRAJS, row_len=32, micro_rows=2)
    p.arrays["proximal_logp"], p.arrays["old_values"] = trainer.score_values(p)
    assert not p.arrays["old_values"].any()  # the zero-initialised critic says V = 0 everywhere
    rewards = np.asarray([TRAJS[i].reward for i in p.kept], np.float32)
    adv, ret = gae_advantages(cfg.loss, p, rewards)
    # gamma = lam = 1 and V = 0: every trained token's advantage and return is its sequence's reward
    for j, i in enumerate(p.kept):
        m, r, s, n = p.placements[j]
        trained = np.asarray(TRAJS[i].loss_mask)
        np.testing.assert_allclose(adv[m, r, s:s + n][trained], TRAJS[i].reward, atol=1e-6)
        np.testing.assert_allclose(ret[m, r, s:s + n][~trained], 0.0)
    head_before = np.asarray(trainer.value_params["w"][...]).copy()
    for _ in range(3):
        m = trainer.rl_step(TRAJS)
        assert m["skipped"] == 0 and np.isfinite(m["value_loss"]) and m["value_loss"] > 0
    assert not np.array_equal(head_before, np.asarray(trainer.value_params["w"][...]))
    m2 = trainer.sft_step(p)  # the warm start works with a critic attached (its gradient is 0)
    assert np.isfinite(m2["nll"])


def test_moving_the_trainer_to_another_mesh_changes_nothing_but_placement():
    from tiderl_jax.runtime.devices import DevicePool

    pool = DevicePool.split(jax.devices(), group_size=2, rollout=2, train=2, tensor=2)
    cfg = _config(loss=LossConfig(kl_coef=0.1, advantage_estimator="gae"))
    stay = Trainer(shard_model(init_decoder(CFG, seed=11), pool.mesh("train"), DEFAULT_RULES), cfg,
                   mesh=pool.mesh("train"))
    move = Trainer(shard_model(init_decoder(CFG, seed=11), pool.mesh("train"), DEFAULT_RULES), cfg,
                   mesh=pool.mesh("train"))
    stay.rl_step(TRAJS), move.rl_step(TRAJS)
    bigger = pool.moved("rollout", "train")
    move.move_to(bigger.mesh("train"))
    stay.rl_step(TRAJS[:5]), move.rl_step(TRAJS[:5])
    for a, b in zip(_params(stay), _params(move)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    devices = set(bigger.devices_of("train"))
    for leaf in jax.tree.leaves((move.params, move.opt_state, move.ref_params, move.value_params)):
        assert leaf.sharding.device_set == devices


def test_warmup_loads_the_step_programs_and_changes_nothing():
    """A sharded trainer warmed up for micro-batch counts 1 and 2: the policy, the optimizer state and the step
    count are untouched, and real steps of those counts (TRAJS packs into 2) load no program afterwards."""
    from tiderl_jax.rl.trainer import Scorer, row_layout

    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    ref = shard_model(init_decoder(CFG, seed=4), mesh, DEFAULT_RULES)
    trainer = Trainer(shard_model(init_decoder(CFG, seed=3), mesh, DEFAULT_RULES), _config(micro_rows=2), mesh=mesh,
                      ref_params=nnx.split(ref)[1])
    before, opt = _params(trainer), [np.asarray(x) for x in jax.tree.leaves(trainer.opt_state)]
    assert trainer.warmup([1, 2], row_lens=[16]) > 0 and trainer.step_count == 0 and trainer.compile_s > 0
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(trainer)))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(opt, jax.tree.leaves(trainer.opt_state)))
    assert row_layout(trainer.config, [len(t.tokens) for t in TRAJS]) == (16, 4)  # rows sized to the batch
    assert pack(TRAJS, row_len=16, micro_rows=4).arrays["tokens"].shape[0] == 2
    loaded = trainer.compile_s
    m = trainer.rl_step(TRAJS)
    assert trainer.compile_s == loaded and np.isfinite(m["loss"]) and trainer.step_count == 1
    scorer = Scorer(init_decoder(CFG, seed=4), _config(micro_rows=2))
    scorer.warmup([2], row_lens=[16])
    loaded = scorer.compile_s
    assert all(x is not None for x in scorer.score_trajectories(TRAJS)) and scorer.compile_s == loaded


def test_no_reference_pass_when_no_loss_term_reads_it():
    ref = nnx.split(init_decoder(CFG, seed=12))[1]
    without = Trainer(init_decoder(CFG, seed=11), _config(loss=LossConfig(kl_coef=0.0)), ref_params=ref)
    with_kl = Trainer(init_decoder(CFG, seed=11), _config(loss=LossConfig(kl_coef=0.1)), ref_params=ref)
    a, b = without.rl_step(TRAJS), with_kl.rl_step(TRAJS)
    assert a["time_ref_s"] == 0.0 and a.get("kl", 0.0) == 0.0
    assert b["time_ref_s"] > 0.0 and b["kl"] > 0.0
    assert Trainer(init_decoder(CFG, seed=11), _config(loss=LossConfig(kl_coef=0.0))).ref_params is None


def _on_policy(trainer, trajectories, version, noise=0.0):
    """Copies of `trajectories` sampled by `version` whose behaviour log-probs are the trainer's own (plus noise)."""
    out = []
    rng = np.random.default_rng(5)
    p = pack(trajectories, row_len=trainer.config.row_len, micro_rows=trainer.config.micro_rows)
    logp = trainer.score(p)
    for j, i in enumerate(p.kept):
        t = Trajectory.from_dict(trajectories[i].to_dict())
        own = logp[p.placements[j][0], p.placements[j][1], p.placements[j][2]:][:len(t.tokens)]
        t.logprobs = [float(x + noise * rng.standard_normal()) if m else 0.0 for x, m in zip(own, t.loss_mask)]
        t.versions = [version if m else -1 for m in t.loss_mask]
        out.append(t)
    return out


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_the_proximal_log_probs_from_the_updates_own_forward_update_as_the_separate_pass(kl_coef):
    """An off-policy batch (behaviour log-probs far from the trainer's: truncated importance weights): "auto"
    runs no proximal pass and takes the same step as "always", which scores the batch first; a KL folded into
    the reward reads the proximal log-probs before the update, so there the pass runs."""
    cfg = _config(loss=LossConfig(kl_coef=kl_coef, entropy_coef=0.01))
    ref = nnx.split(init_decoder(CFG, seed=9))[1]
    always = Trainer(init_decoder(CFG, seed=13), dataclasses.replace(cfg, recompute_proximal="always"), ref_params=ref)
    auto = Trainer(init_decoder(CFG, seed=13), cfg, ref_params=ref)
    for _ in range(2):  # the second step starts from updated weights
        m_always, m_auto = always.rl_step(TRAJS), auto.rl_step(TRAJS)
        assert (m_always["proximal_recomputed"], m_auto["proximal_recomputed"], m_auto["proximal_in_step"]) == (1, 0, 1)
        assert m_auto["importance_weight"] < 1.5  # off-policy: the weights differ from 1 (truncated at tis_cap)
        for k in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "approx_kl", "importance_weight",
                  "grad_norm"):
            assert m_auto[k] == pytest.approx(m_always[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(_params(always), _params(auto)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    reward_kl = dataclasses.replace(cfg, loss=LossConfig(kl_coef=0.1, kl_as_reward=True))
    m = Trainer(init_decoder(CFG, seed=13), reward_kl, ref_params=ref).rl_step(TRAJS)
    assert m["proximal_recomputed"] == 1.0 and m["proximal_in_step"] == 0.0


def test_an_on_policy_batch_skips_the_proximal_pass_and_updates_as_with_it():
    cfg = _config(loss=LossConfig(kl_coef=0.0))
    always = Trainer(init_decoder(CFG, seed=13), dataclasses.replace(cfg, recompute_proximal="always"))
    auto = Trainer(init_decoder(CFG, seed=13), cfg)
    always.policy_version = auto.policy_version = 3
    batch = _on_policy(always, TRAJS, 3)
    m_always, m_auto = always.rl_step(batch), auto.rl_step(batch)
    assert m_always["proximal_recomputed"] == 1.0 and m_auto["proximal_recomputed"] == 0.0
    assert m_auto["on_policy"] == 1.0 and m_auto["time_proximal_s"] < 0.01
    # the engine-vs-trainer difference on the same tokens is measured where the pass runs on-policy
    diff = m_always["behaviour_logp_diff_p99"]
    assert 0.0 <= m_always["behaviour_logp_diff_mean"] <= diff < 1e-5
    for a, b in zip(_params(always), _params(auto)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert auto.policy_version == always.policy_version == 4  # each applied step advances it
    # the next batch sampled by version 3 is off-policy for version 4: "auto" takes the proximal log-probs from
    # the update's own forward (the next test), no pass
    m_next = auto.rl_step(batch)
    assert m_next["proximal_recomputed"] == 0.0 and m_next["proximal_in_step"] == 1.0
    # with behaviour log-probs off by a measured amount, the update moves by no more than that drift
    never = Trainer(init_decoder(CFG, seed=13), dataclasses.replace(cfg, recompute_proximal="never"))
    exact = Trainer(init_decoder(CFG, seed=13), dataclasses.replace(cfg, recompute_proximal="always"))
    never.policy_version = exact.policy_version = 0
    noisy = _on_policy(exact, TRAJS, 0, noise=1e-3)
    m_exact, m_never = exact.rl_step(noisy), never.rl_step(noisy)
    assert m_never["proximal_recomputed"] == 0.0 and 5e-4 < m_exact["behaviour_logp_diff_mean"] < 2e-3
    assert m_never["loss"] == pytest.approx(m_exact["loss"], abs=5e-3)
    step = [np.abs(a - b).max() for a, b in zip(_params(exact), _params(Trainer(init_decoder(CFG, seed=13), cfg)))]
    gap = [np.abs(a - b).max() for a, b in zip(_params(exact), _params(never))]
    assert max(gap) < 0.1 * max(step)
    with pytest.raises(ConfigError, match="recompute_proximal='sometimes'"):
        TrainerConfig(recompute_proximal="sometimes")


@pytest.mark.parametrize("aggregation", ["token", "constant"])
def test_rows_sized_to_the_batch_give_the_update_of_full_rows(aggregation):
    from tiderl_jax.rl.trainer import row_layout
    cfg = _config(row_len=64, micro_rows=2, loss=LossConfig(kl_coef=0.1, aggregation=aggregation))
    lengths = [len(t.tokens) for t in TRAJS]  # 73 tokens, the longest 15
    # first fit: 6 rows of 16 (a micro-batch of 6 rows, not 8), 3 of 32, 2 of 48 or one of 96 tokens compute 96
    # token slots each, 2 of 64 compute 128: the shortest of the cheapest, the least attention
    assert row_layout(cfg, lengths) == row_layout(cfg, lengths, pair_cost=0.05) == (16, 6)
    assert row_layout(cfg, lengths[:2]) == (16, 2)
    assert row_layout(cfg, [64, 3]) == (64, 2) and row_layout(dataclasses.replace(cfg, row_buckets=False), [9]) == (64, 2)
    ref = nnx.split(init_decoder(CFG, seed=15))[1]
    sized = Trainer(init_decoder(CFG, seed=14), cfg, ref_params=ref)
    full = Trainer(init_decoder(CFG, seed=14), dataclasses.replace(cfg, row_buckets=False), ref_params=ref)
    a, b = sized.rl_step(TRAJS), full.rl_step(TRAJS)
    assert a["tokens_computed"] == 1 * 6 * 16 and b["tokens_computed"] == 1 * 2 * 64
    assert a["row_len"] == 16 and a["attention_pairs_computed"] == 6 * 16 * 16
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["tokens_real"] == b["tokens_real"]
    for x, y in zip(_params(sized), _params(full)):  # (Adam's first step divides by |g|: float noise shows)
        np.testing.assert_allclose(x, y, atol=2e-5)


def test_rows_are_chosen_by_the_packed_cost_of_the_batch():
    """Lengths of up to 300 in rows of up to 1,024: rows of 512 hold two trajectories each (4 rows, 2,048 tokens)
    where 384 holds one or two (6 rows, 2,304), and no row goes past 512, the power of two above the longest; dear
    enough attention turns the choice to 384."""
    from tiderl_jax.rl.trainer import packing_pair_cost, row_layout
    cfg = _config(row_len=1024, micro_rows=1)
    lengths = [300, 200, 180, 300, 150, 290, 210, 100]
    smollm2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                          num_heads=9, num_kv_heads=3, head_dim=64)
    assert packing_pair_cost(smollm2) == pytest.approx(2.57e-4, rel=0.01)
    assert row_layout(cfg, lengths) == row_layout(cfg, lengths, packing_pair_cost(smollm2)) == (512, 2)
    assert row_layout(cfg, lengths, 0.02) == (384, 2)  # 6 rows of 384 attend over fewer pairs than 4 of 512
    assert row_layout(cfg, [300] * 8) == (384, 2)  # one per 1.5x bucket: no padding, no cross pairs
    assert row_layout(cfg, [500, 100]) == (512, 2)  # two rows of 512, not one of 768 or 1,024
    assert row_layout(cfg, [20] * 4) == (32, 4)  # rows a multiple of 16 tokens (not 24)
    assert row_layout(dataclasses.replace(cfg, attention_impl="pallas_tpu"), [20] * 4) == (128, 1)  # splash's block


def _residual_bytes(model, tokens) -> int:
    """The bytes the backward pass of a full-sequence forward keeps from it (the leaves of jax.vjp's function)."""
    graphdef, params = nnx.split(model)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def loss(p):
        return nnx.merge(graphdef, p)(tokens, positions, segment_ids=jnp.ones_like(tokens))[0].sum()
    _, backward = jax.vjp(loss, params)
    return sum(x.nbytes for x in jax.tree.leaves(backward))


def test_rematerialised_layers_give_the_same_gradients_and_keep_less():
    """trainer.remat: every policy's gradient equals the plain one's (the same forward, recomputed), and each
    keeps less of the forward for the backward than none (full the least); the engine's cached mode ignores it."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 64)), jnp.int32)
    kept, grads = {}, {}
    for name in REMAT_POLICIES:
        trainer = Trainer(init_decoder(CFG, seed=4), _config(remat=name))
        grads[name] = [np.asarray(x) for x in jax.tree.leaves(trainer.gradients(TRAJS)["gradients"])]
        kept[name] = _residual_bytes(trainer.model(), tokens)
    for name in REMAT_POLICIES:
        for a, b in zip(grads[name], grads["none"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert kept["full"] == min(kept.values()) and all(kept[n] < kept["none"] for n in REMAT_POLICIES if n != "none")
    assert kept["full"] < kept["none"] / 5, kept
    model = init_decoder(CFG, seed=4)
    model.remat = "full"
    plain = init_decoder(CFG, seed=4)
    np.testing.assert_array_equal(model(tokens, jnp.broadcast_to(jnp.arange(64), tokens.shape))[0],
                                  plain(tokens, jnp.broadcast_to(jnp.arange(64), tokens.shape))[0])
    with pytest.raises(ConfigError, match="remat='some' is not one of"):
        _config(remat="some")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_give_the_same_step(remat):
    """trainer.scan_layers: the layers as one scan over their stacked weights take the same step as the loop (with
    and without remat), on a mesh; the engine's cached mode ignores it."""
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    after, grads = {}, {}
    for scan in (False, True):
        trainer = Trainer(shard_model(init_decoder(CFG, seed=6), mesh, DEFAULT_RULES),
                          _config(remat=remat, scan_layers=scan), mesh=mesh)
        assert trainer.model().scan_layers is scan
        grads[scan] = [np.asarray(x) for x in jax.tree.leaves(trainer.gradients(TRAJS)["gradients"])]
        trainer.rl_step(TRAJS)
        after[scan] = _params(trainer)
    for a, b in zip(grads[True], grads[False]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    for a, b in zip(after[True], after[False]):  # one Adam step moves an element by about lr = 1e-2: within 0.1%
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    model = init_decoder(CFG, seed=6)
    model.scan_layers = True
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    np.testing.assert_allclose(model(tokens, positions)[0], init_decoder(CFG, seed=6)(tokens, positions)[0],
                               rtol=1e-5, atol=1e-6)
    assert "scan" in str(jax.make_jaxpr(lambda t: model(t, positions)[0])(tokens))  # one scan, not a loop



def test_the_optimizer_state_is_sharded_as_the_parameters():
    """Adam's moments on a mesh take their parameter's layout (FSDP's point: left to XLA, a moment initialised from
    zeros came out replicated, both moments of the whole model on every device); its count is replicated."""
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    trainer = Trainer(shard_model(init_decoder(CFG, seed=1), mesh, DEFAULT_RULES), _config(weight_decay=0.1),
                      mesh=mesh)
    specs = {x.shape: x.sharding.spec for x in jax.tree.leaves(trainer.params) if x.ndim >= 2}
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim >= 2]
    assert len(moments) == 2 * len(jax.tree.leaves(trainer.params)) - 2 * sum(
        x.ndim < 2 for x in jax.tree.leaves(trainer.params))
    assert all(x.sharding.spec == specs[x.shape] for x in moments)
    assert all(x.sharding.spec == PartitionSpec() for x in jax.tree.leaves(trainer.opt_state) if x.ndim == 0)
    assert any(spec != PartitionSpec() for spec in specs.values())
    trainer.rl_step(TRAJS)
    assert all(x.sharding.spec == specs[x.shape] for x in jax.tree.leaves(trainer.opt_state) if x.ndim >= 2)


def test_the_abstract_memory_plan_equals_the_trainers_own():
    """step_memory compiles the update from abstract weights (nothing allocated: how the real presets are planned
    here); its gradient program is the one Trainer.memory_plan compiles from real weights on the same mesh, so
    XLA's analysis is the same; the whole update adds the optimizer's state and returns the weights in place."""
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    config = _config(loss=LossConfig(), row_buckets=False, remat="full")
    trainer = Trainer(shard_model(init_decoder(CFG, seed=1), mesh, DEFAULT_RULES), config, mesh=mesh)
    plan = trainer.memory_plan(_warmup_trajectories(1, config))
    real = next(m for key, m in plan.items() if key[0] == "gradients")
    planned = step_memory(CFG, config, mesh, kind="gradients")
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(planned, field) == getattr(real, field), field
    update = step_memory(CFG, config, mesh)
    assert update.alias_size_in_bytes > 0 and update.argument_size_in_bytes > planned.argument_size_in_bytes / 2


def test_the_sliced_loss_head_equals_the_whole_one_and_its_gradient_too():
    """head_logprobs in slices of 5 positions (rows of 23: a ragged last slice), each rematerialised, against the
    whole [b, t, vocabulary] head: the same log-probs, entropies and gradients."""
    from tiderl_jax.rl.trainer import head_logprobs

    graphdef, params = nnx.split(init_decoder(CFG, seed=6))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 96, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24), tokens.shape)
    weights = jnp.asarray(rng.normal(size=(2, 23)), jnp.float32)

    def loss(p, slice_len):
        model = nnx.merge(graphdef, p)
        hidden, _ = model(tokens, positions, return_hidden=True)
        logp, entropy = head_logprobs(model, hidden[:, :-1], tokens[:, 1:], 0.7, slice_len)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

    (whole, (lp_w, ent_w)), g_w = jax.value_and_grad(loss, has_aux=True)(params, 1024)
    (sliced, (lp_s, ent_s)), g_s = jax.value_and_grad(loss, has_aux=True)(params, 5)
    np.testing.assert_allclose(lp_s, lp_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent_s, ent_w, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
