"""The runtime's decision rules on hand-built signals: staleness (§8), RA2P (§1b) and ERS (§1c)."""

import dataclasses
import math

import pytest

from tiderl_jax.policies import ers, ra2p, staleness
from tiderl_jax.policies.ers import ERSConfig, ERSHistory, ERSSignals, Move, decide
from tiderl_jax.policies.ra2p import RA2PSignals, choose_mode
from tiderl_jax.policies.staleness import capacity, is_fresh, staleness_config, version_lag

# ---------------------------------------------------------------- staleness


def test_capacity_is_the_smaller_of_concurrency_and_staleness():
    # version 3, eta 1, batch 4: at most (1 + 3 + 1) * 4 = 20 samples ever started
    assert capacity(8, running=2, eta=1, version=3, batch_size=4, accepted=12) == 6  # both allow 6
    assert capacity(8, running=2, eta=1, version=3, batch_size=4, accepted=16) == 2  # staleness binds
    assert capacity(3, running=2, eta=1, version=3, batch_size=4, accepted=0) == 1  # concurrency binds
    assert capacity(8, running=4, eta=1, version=3, batch_size=4, accepted=20) == 0  # over: not negative
    assert capacity(2, running=4, eta=1, version=3, batch_size=4, accepted=0) == 0


def test_eta_zero_gives_synchronous_on_policy_batches():
    batch, version, accepted, running = 4, 0, 0, 0
    for _ in range(3):
        started = capacity(100, running, 0, version, batch, accepted)
        assert started == batch  # exactly this version's batch, however much concurrency is free
        running += started
        assert capacity(100, running, 0, version, batch, accepted) == 0
        accepted, running = accepted + running, 0  # all finish, on the current weights
        assert capacity(100, running, 0, version, batch, accepted) == 0  # blocked until the update
        version += 1
    assert capacity(100, 0, 1, 0, batch, 0) == 2 * batch  # eta 1: one batch ahead


def test_acceptance_counts_the_oldest_generated_token():
    versions = [-1, -1, 3, 3, -1, 4, 5]  # prompt/observation tokens are -1
    assert version_lag(versions, 5) == 2
    assert not is_fresh(versions, 5, eta=1)
    assert is_fresh(versions, 5, eta=2)
    assert is_fresh(4, 5, eta=1) and not is_fresh(3, 5, eta=1)  # the sample's min version
    assert is_fresh([5, 5], 5, eta=0)
    assert version_lag([-1, -1], 5) == 0  # nothing generated: nothing stale


def test_a_token_newer_than_the_trainer_is_an_error():
    with pytest.raises(ValueError, match="current_version=5"):
        version_lag([4, 6], 5)


def test_mode_parameters():
    assert staleness_config("sync") == staleness_config("sync", 0)
    assert (staleness_config("sync").eta, staleness_config("sync").overlap) == (0, False)
    assert (staleness_config("async").eta, staleness_config("async").overlap) == (1, True)
    assert staleness_config("async", 4).eta == 4
    assert staleness_config("tiderl", 0).overlap
    with pytest.raises(ValueError, match="eta=2 with mode 'sync'"):
        staleness_config("sync", 2)
    with pytest.raises(ValueError, match="eta=0 with mode 'async'"):
        staleness_config("async", 0)
    with pytest.raises(ValueError, match="'fancy'"):
        staleness_config("fancy")
    with pytest.raises(ValueError, match="eta=-1"):
        staleness_config("tiderl", -1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_concurrent=0), "max_concurrent"), (dict(batch_size=0), "batch_size"),
    (dict(running=-1), "running"), (dict(eta=-1), "eta"), (dict(version=-1), "version"),
    (dict(accepted=-1), "accepted"),
])
def test_capacity_rejects_bad_input_by_name(kwargs, field):
    args = dict(max_concurrent=8, running=0, eta=1, version=0, batch_size=4, accepted=0) | kwargs
    with pytest.raises(ValueError, match=field):
        capacity(**args)


def test_consumption_order_is_oldest_version_first_then_arrival():
    from tiderl_jax.policies.staleness import consumption_order
    assert consumption_order([3, 2, 3, 1, 2]) == [3, 1, 4, 0, 2]
    assert consumption_order([]) == []


# ---------------------------------------------------------------- RA2P


def _ra2p(**kw):
    base = dict(num_microbatches=4, ready_at_start=4, tprm_s=0.0, t_ref_s=1.0, t_act_s=3.0,
                t_swap_s=2.0, ref_share=0.25, act_share=0.75, fill_drain_s=0.0)
    return RA2PSignals(**(base | kw))


def test_all_ready_goes_colocated_one_burst_on_all_devices():
    # C_col = one swap 2 + 4 * (1 + 3) = 18. Decoupled: the ref stage takes 1 / 0.25 = 4 s and the
    # actor 3 / 0.75 = 4 s per micro-batch: ref ends 4, 8, 12, 16; actor 8, 12, 16, 20.
    d = choose_mode(_ra2p())
    assert (d.mode, d.cost_colocated, d.cost_decoupled) == ("colocated", 18.0, 20.0)
    assert ra2p.colocated_replay(_ra2p()) == (18.0, 1)


def test_trickling_arrivals_go_decoupled():
    # RAS 0, arrivals at 4, 8, 12, 16. Colocated: burst [0] 4 -> 10, burst [1] 10 -> 16, burst
    # [2, 3] 16 -> 26 (three swaps). Decoupled: ref 8, 12, 16, 20; actor 12, 16, 20, 24.
    s = _ra2p(ready_at_start=0, tprm_s=4.0)
    d = choose_mode(s)
    assert (d.mode, d.cost_colocated, d.cost_decoupled) == ("decoupled", 26.0, 24.0)
    assert ra2p.colocated_replay(s)[1] == 3


def test_the_choice_moves_towards_decoupled_as_fewer_are_ready_at_start():
    # The paper's regimes: aggregation pays when the batch is ready, streaming when it trickles in.
    choices = [choose_mode(_ra2p(ready_at_start=r, tprm_s=4.0)).mode for r in range(4, -1, -1)]
    assert choices == ["colocated", "colocated", "colocated", "decoupled", "decoupled"]


def test_slow_split_keeps_colocated_even_when_trickling():
    # RAS 1, late ones 10 s apart, each colocated burst (0.5 + 3 s) ends before the next arrival:
    # C_col = 30 + 3.5; the half-speed split: last arrival 30, ref + 2 = 32, actor + 4 = 36.
    s = _ra2p(ready_at_start=1, tprm_s=10.0, t_ref_s=1.0, t_act_s=2.0, t_swap_s=0.5,
              ref_share=0.5, act_share=0.5)
    d = choose_mode(s)
    assert (d.mode, d.cost_colocated, d.cost_decoupled) == ("colocated", 33.5, 36.0)
    assert ra2p.colocated_replay(s)[1] == 4


def test_a_tie_goes_to_the_stated_default():
    # C_col = 1 + 2 * (1 + 1) = 5; decoupled: ref 1, 2; actor 2, 3; + fill 2 = 5
    s = _ra2p(num_microbatches=2, ready_at_start=2, t_ref_s=1.0, t_act_s=1.0, t_swap_s=1.0,
              ref_share=1.0, act_share=1.0, fill_drain_s=2.0)
    assert choose_mode(s) == ra2p.Decision(ra2p.TIE_MODE, 5.0, 5.0)
    assert ra2p.TIE_MODE == "colocated"


def test_bursts_aggregate_what_arrived_meanwhile():
    # ready 2 at 0; late ones at 1, 2, 3, 4. Burst 1 (2 mbs): 0 -> 1 + 2 * 1.5 = 4; it finds the
    # 4 late ones arrived: burst 2 takes all of them (4 -> 4 + 1 + 6 = 11).
    s = _ra2p(num_microbatches=6, ready_at_start=2, tprm_s=1.0, t_ref_s=0.5, t_act_s=1.0, t_swap_s=1.0)
    assert ra2p.colocated_replay(s) == (11.0, 2)
    assert ra2p.colocated_replay(dataclasses.replace(s, ready_at_start=0, tprm_s=100.0))[1] == 6
    assert ra2p.colocated_replay(dataclasses.replace(s, ready_at_start=0, tprm_s=0.0))[1] == 1


def test_ras_above_m_is_clipped_and_m_zero_costs_nothing_but_the_fixed_overhead():
    assert choose_mode(_ra2p(ready_at_start=9)) == choose_mode(_ra2p(ready_at_start=4))
    d = choose_mode(_ra2p(num_microbatches=0, ready_at_start=3, fill_drain_s=1.0))
    assert (d.mode, d.cost_colocated, d.cost_decoupled) == ("colocated", 0.0, 1.0)


@pytest.mark.parametrize("field, value", [
    ("ref_share", 0.0), ("act_share", 0.0), ("num_microbatches", -1), ("tprm_s", -1.0), ("fill_drain_s", -1.0),
])
def test_ra2p_rejects_bad_signals_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        _ra2p(**{field: value})


# ---------------------------------------------------------------- ERS

ONE_STEP = ERSConfig(patience=1)


def _ers(**kw):
    """Balanced by default: a full batch ready, no idling, short head-of-line wait, RAS below break-even."""
    base = dict(ready_volume=8, ideal_batch=8, trainer_idle_s=0.0, hol_latency_s=1.0, step_time_s=10.0,
                ras=2.0, break_even_ras=3.0, rollout_groups=2, train_groups=2)
    return ERSSignals(**(base | kw))


STARVED = dict(ready_volume=3, trainer_idle_s=4.0)  # generation deficit
BACKLOG = dict(hol_latency_s=8.0)  # consumption deficit (8 > 0.5 * 10)


def test_balanced_signals_do_not_move():
    move, history = decide(_ers(), ERSHistory(), ONE_STEP)
    assert move is None and history.generation_streak == history.consumption_streak == 0


def test_generation_deficit_moves_a_group_to_rollout_and_colocates():
    move, history = decide(_ers(**STARVED), ERSHistory(), ONE_STEP)
    assert move == Move("train", "rollout", "colocated", "generation deficit")
    assert history == ERSHistory(last_move_to="rollout")
    # a short buffer alone is no deficit while the trainer did not idle (beyond 5% of the step)
    assert decide(_ers(ready_volume=3, trainer_idle_s=0.4), ERSHistory(), ONE_STEP)[0] is None


@pytest.mark.parametrize("signals", [BACKLOG, dict(ras=3.5)])
def test_consumption_deficit_moves_a_group_to_train_and_decouples(signals):
    move, _ = decide(_ers(**signals), ERSHistory(), ONE_STEP)
    assert move == Move("rollout", "train", "decoupled", "consumption deficit")
    assert decide(_ers(ras=3.5, break_even_ras=math.inf), ERSHistory(), ONE_STEP)[0] is None


def test_generation_deficit_takes_precedence():
    move, _ = decide(_ers(**STARVED, **BACKLOG), ERSHistory(), ONE_STEP)
    assert move.to_role == "rollout"


def test_a_one_off_deficit_does_not_move_a_persistent_one_does():
    config = ERSConfig(patience=2)
    move, history = decide(_ers(**STARVED), ERSHistory(), config)
    assert move is None and history.generation_streak == 1
    move, history = decide(_ers(), history, config)  # the deficit went away: the streak restarts
    assert move is None and history.generation_streak == 0
    move, history = decide(_ers(**STARVED), history, config)
    assert move is None
    move, history = decide(_ers(**STARVED), history, config)
    assert move is not None and move.to_role == "rollout"
    after = _ers(**STARVED, rollout_groups=3, train_groups=3)
    move, history = decide(after, history, config)
    assert move is None  # after a move the deficit must persist again
    move, history = decide(after, history, config)
    assert move is not None and move.to_role == "rollout"


def test_no_ping_pong_within_the_cooldown():
    config = ERSConfig(patience=1, cooldown=3)
    move, history = decide(_ers(**STARVED), ERSHistory(), config)
    assert move.to_role == "rollout"
    after = _ers(**BACKLOG, rollout_groups=3, train_groups=1)
    for _ in range(3):  # the reverse move is refused for 3 boundaries, though the deficit persists
        move, history = decide(after, history, config)
        assert move is None
    move, history = decide(after, history, config)
    assert move == Move("rollout", "train", "decoupled", "consumption deficit")


def test_the_same_direction_is_not_held_by_the_cooldown():
    config = ERSConfig(patience=1, cooldown=3)
    _, history = decide(_ers(**STARVED, rollout_groups=1, train_groups=3), ERSHistory(), config)
    move, _ = decide(_ers(**STARVED, rollout_groups=2, train_groups=2), history, config)
    assert move is not None and move.to_role == "rollout"


def test_minimums_are_never_crossed():
    assert decide(_ers(**STARVED, train_groups=1), ERSHistory(), ONE_STEP)[0] is None
    assert decide(_ers(**BACKLOG, rollout_groups=1), ERSHistory(), ONE_STEP)[0] is None
    config = ERSConfig(patience=1, min_train_groups=2)
    assert decide(_ers(**STARVED, train_groups=2), ERSHistory(), config)[0] is None
    with pytest.raises(ValueError, match="train_groups=1 is below its minimum 2"):
        decide(_ers(train_groups=1), ERSHistory(), config)


@pytest.mark.parametrize("phase", ["cold_start", "eval"])
def test_cold_start_and_eval_maximise_rollout(phase):
    config = ERSConfig(patience=3, cooldown=5)
    history = ERSHistory(last_move_to="train")  # just moved to train: phases override the cooldown
    groups = dict(rollout_groups=1, train_groups=3)
    for _ in range(2):  # one group per boundary, with no deficit at all, even against a backlog
        move, history = decide(_ers(**BACKLOG, **groups, phase=phase), history, config)
        assert move == Move("train", "rollout", "colocated", phase)
        groups = dict(rollout_groups=groups["rollout_groups"] + 1, train_groups=groups["train_groups"] - 1)
    assert decide(_ers(phase=phase, **groups), history, config)[0] is None  # train at its minimum


def _econ(**kw):
    return ers.MoveEconomics(**(dict(train_busy_s=8.0, rollout_busy_s=3.0, move_cost_s=5.0,
                                     horizon_steps=10) | kw))


def test_a_move_must_pay_for_itself():
    # backlog, trainer-bound: t = 8 on 2 groups -> 8 * 2/3; rollout r = 3 on 2 groups -> 6 on one.
    # now max(8, 3) = 8, after max(5.33, 6) = 6: 2 s per step, 20 s over 10 steps > 5 s cost.
    move, _ = decide(_ers(**BACKLOG), ERSHistory(), ONE_STEP, _econ())
    assert move == Move("rollout", "train", "decoupled", "consumption deficit", 20.0, 5.0)
    move, history = decide(_ers(**BACKLOG), ERSHistory(), ONE_STEP, _econ(move_cost_s=25.0))
    assert move is None and "does not pay" in history.refused and history.consumption_streak == 1
    assert history.refused_kind == "does not pay" and history.refused_kind in ers.REFUSALS
    move, _ = decide(_ers(**BACKLOG), ERSHistory(), ONE_STEP, _econ(horizon_steps=2))
    assert move is None  # 4 s of gain left in the run


def test_a_gain_within_the_noise_of_a_step_does_not_move():
    # the backlog case above saves 2 s of an 8 s step (25%); a 30 s step makes it 6.7%: still a move at the
    # default 2% floor, none at a 10% floor, whatever the horizon pays
    history = ERSHistory()
    slow = _ers(**{**BACKLOG, "step_time_s": 30.0, "hol_latency_s": 20.0})
    assert decide(slow, history, ONE_STEP, _econ())[0] is not None
    high = dataclasses.replace(ONE_STEP, min_gain_fraction=0.1)
    move, history = decide(slow, history, high, _econ(horizon_steps=1000))
    assert move is None and "within the noise" in history.refused and history.refused_kind == "within noise"
    with pytest.raises(ValueError, match="min_gain_fraction"):
        ers.ERSConfig(min_gain_fraction=-0.1)


def test_a_move_that_predicts_a_loss_does_not_pay_whatever_the_noise_floor():
    # rollout and trainer balanced: every move slows the step, which is not a question of noise
    for floor in (0.0, 0.02, 0.5):
        config = dataclasses.replace(ONE_STEP, min_gain_fraction=floor)
        move, history = decide(_ers(**BACKLOG), ERSHistory(), config, _econ(train_busy_s=3.0, rollout_busy_s=3.0))
        assert move is None and history.refused_kind == "does not pay"
        assert "would cost" in history.refused and "noise" not in history.refused


def test_predicted_gains_are_averaged_since_the_last_move():
    # the backlog case saves 2 s a step (rollout -> train); a step whose batch loaded the trainer less predicts a
    # loss. Averaged at weight 0.5 since the last move, the evidence of both steps decides, not the last alone
    backlog, light = _ers(**BACKLOG), _econ(train_busy_s=5.5, rollout_busy_s=3.0)
    raw_light = ers.move_gain(backlog, light, "train")
    assert raw_light == pytest.approx(-0.5)  # now max(5.5, 3) = 5.5, after max(3.67, 6) = 6
    patient = ERSConfig(patience=2)
    move, history = decide(backlog, ERSHistory(), patient, _econ())
    assert move is None and dict(history.gains)[("rollout", "train")] == pytest.approx(2.0)
    move, history = decide(backlog, history, patient, light)
    # the average of the two steps, 0.75 s a step over 10 steps, pays the 5 s move; the move starts it afresh
    assert move is not None and move.gain_s == pytest.approx(10 * (0.5 * 2.0 + 0.5 * raw_light))
    assert history.gains == ()
    # the last step alone (weight 1) predicts a loss: no move
    one_step = dataclasses.replace(patient, gain_weight=1.0)
    _, h = decide(backlog, ERSHistory(), one_step, _econ())
    move, h = decide(backlog, h, one_step, light)
    assert move is None and dict(h.gains)[("rollout", "train")] == pytest.approx(raw_light)
    _, fresh = decide(_ers(), ERSHistory(last_move_to="train"), patient, _econ())
    assert dict(fresh.gains)[("rollout", "train")] == ers.move_gain(_ers(), _econ(), "train", "rollout")
    with pytest.raises(ValueError, match="gain_weight"):
        ERSConfig(gain_weight=0.0)


def test_no_scaling_means_no_gain():
    # fake devices that share the same cores: a group more computes nothing faster
    assert ers.move_gain(_ers(**BACKLOG), _econ(scaling=0.0), "train") == 0.0
    assert ers.move_gain(_ers(**STARVED), _econ(scaling=0.0), "rollout") == 0.0
    assert decide(_ers(**BACKLOG), ERSHistory(), ONE_STEP, _econ(scaling=0.0))[0] is None


def test_generation_deficit_gain_counts_the_slower_trainer():
    # trainer computes 6 s and idles 4 s (R = 10), rollout computes 6 s. On 2 train groups, losing
    # one doubles t to 12 > 10 now: a loss. On 3, t' = 9 and R' = 10 - 6 + 6 * 2/3 = 8: 1 s a step.
    starved = _ers(**STARVED)
    assert ers.move_gain(starved, _econ(train_busy_s=6.0, rollout_busy_s=6.0), "rollout") == -2.0
    three = _ers(**STARVED, train_groups=3)
    assert ers.move_gain(three, _econ(train_busy_s=6.0, rollout_busy_s=6.0), "rollout") == pytest.approx(1.0)
    move, _ = decide(three, ERSHistory(), ONE_STEP, _econ(train_busy_s=6.0, rollout_busy_s=6.0))
    assert move is not None and move.to_role == "rollout" and move.gain_s == pytest.approx(10.0)


def test_phases_move_regardless_of_economics():
    move, _ = decide(_ers(phase="eval"), ERSHistory(), ONE_STEP, _econ(move_cost_s=1e9))
    assert move is not None and move.to_role == "rollout"


@pytest.mark.parametrize("before, after, ratio, expected", [
    (1, 2, 0.5, 1.0), (2, 3, 2 / 3, 1.0), (2, 1, 2.0, 1.0),  # linear
    (2, 3, 1.0, 0.0), (2, 1, 1.0, 0.0),  # nothing changed: no scaling
    (2, 3, 0.8, 1 / 3), (2, 3, 1.2, 0.0),  # partial; slower with more devices: clipped
])
def test_measured_scaling(before, after, ratio, expected):
    assert ers.measured_scaling(before, after, ratio) == pytest.approx(expected)


def test_measured_scaling_rejects_bad_input_and_keeps_the_prior_when_nothing_moved():
    assert ers.measured_scaling(2, 2, 0.7, prior=0.4) == 0.4
    with pytest.raises(ValueError, match="positive time ratio"):
        ers.measured_scaling(2, 3, 0.0)


def test_mode_names_match_ra2p():
    assert ers.RA2P_MODE_AFTER_MOVE_TO == {"rollout": ra2p.COLOCATED, "train": ra2p.DECOUPLED}


@pytest.mark.parametrize("make, field", [
    (lambda: _ers(phase="warmup"), "phase"),
    (lambda: _ers(train_groups=-1), "train_groups"),
    (lambda: _ers(hol_latency_s=-1.0), "hol_latency_s"),
    (lambda: ERSConfig(patience=0), "patience"),
    (lambda: _econ(scaling=1.5), "scaling"),
    (lambda: _econ(move_cost_s=-1.0), "move_cost_s"),
    (lambda: ERSConfig(min_rollout_groups=0), "min_rollout_groups"),
    (lambda: ERSConfig(cooldown=-1), "cooldown"),
])
def test_ers_rejects_bad_input_by_name(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_generation_deficit_gives_a_ref_group_first():
    # docs/mechanisms.md (ERS): a generation deficit moves one group ref/train -> rollout; colocated from then on,
    # so the ref devices are the ones that would idle
    move, history = decide(_ers(**STARVED, ref_groups=1), ERSHistory(), ONE_STEP)
    assert move == Move("ref", "rollout", "colocated", "generation deficit")
    # with the train role at its minimum, the ref group still moves
    move, _ = decide(_ers(**STARVED, ref_groups=1, train_groups=1), ERSHistory(), ONE_STEP)
    assert move is not None and move.from_role == "ref"
    # a consumption deficit still feeds the trainer
    move, _ = decide(_ers(**BACKLOG, ref_groups=1), ERSHistory(), ONE_STEP)
    assert move == Move("rollout", "train", "decoupled", "consumption deficit")
    # right after a move to train, giving a ref group to rollout is the reverse direction: cooldown
    config = ERSConfig(patience=1, cooldown=2)
    assert decide(_ers(**STARVED, ref_groups=1), ERSHistory(last_move_to="train"), config)[0] is None


def test_moving_the_last_ref_group_costs_the_trainer_the_ref_pass():
    # trainer computes 6 s and idles 4 s (R = 10), rollout computes 6 s on 2 groups, the ref pass
    # 2 s on its one group. The last ref group to rollout: t' = 6 + 2 * speed(1) / speed(2) = 7,
    # R' = 10 - 6 + 6 * 2/3 = 8: gain 10 - 8 = 2 s a step. With two ref groups the trainer keeps t.
    e = _econ(train_busy_s=6.0, rollout_busy_s=6.0, ref_busy_s=2.0)
    one = _ers(**STARVED, ref_groups=1)
    assert ers.move_gain(one, e, "rollout", "ref") == pytest.approx(2.0)
    slow_ref = _econ(train_busy_s=6.0, rollout_busy_s=6.0, ref_busy_s=12.0)  # t' = 12 > R: a loss
    assert ers.move_gain(one, slow_ref, "rollout", "ref") == pytest.approx(-2.0)
    assert ers.move_gain(_ers(**STARVED, ref_groups=2), slow_ref, "rollout", "ref") == pytest.approx(2.0)
    move, _ = decide(one, ERSHistory(), ONE_STEP, slow_ref)
    assert move is None
    move, _ = decide(one, ERSHistory(), ONE_STEP, e)
    assert move.from_role == "ref" and move.gain_s == pytest.approx(20.0)


@pytest.mark.parametrize("before, after, ratio, expected", [
    (4, 5, 0.59, 1.0), (4, 5, 0.8, 1.0),  # at or beyond linear (the formula's pole lies there)
    (5, 4, 1.4, 1.0), (5, 4, 0.9, 0.0),  # fewer groups: beyond linear; faster with fewer: none
])
def test_measured_scaling_clips_beyond_linear_to_one(before, after, ratio, expected):
    assert ers.measured_scaling(before, after, ratio) == pytest.approx(expected)


def test_move_gain_with_the_rollouts_own_scaling_and_the_trainers_coupling():
    # trainer computes 6 s and idles 4 s (R = 10), rollout computes 8 s on 2 groups. A latency-bound
    # rollout (rollout_scaling 0) gains nothing from a group; with coupling k = 0.5 the production
    # follows the trainer: train 2 -> 3 groups, t' = 4, R' = 10 + 0.5 * (4 - 6) = 9: 1 s a step.
    starved = _ers(**STARVED)
    e = _econ(train_busy_s=6.0, rollout_busy_s=8.0, rollout_scaling=0.0, train_coupling=0.5)
    # train -> rollout: t' = 12 and the production follows it, R' = 10 + 0.5 * 6 = 13
    assert ers.move_gain(starved, e, "rollout", "train") == pytest.approx(10 - 13)
    assert ers.move_gain(starved, e, "train", "rollout") == pytest.approx(1.0)
    assert ers.move_gain(starved, dataclasses.replace(e, train_coupling=0.0), "train", "rollout") == 0.0
    # the rollout's own scaling replaces `scaling` on its side only: r' = 8 * 2/3
    linear_rollout = _econ(train_busy_s=6.0, rollout_busy_s=8.0, scaling=0.0, rollout_scaling=1.0)
    assert ers.move_gain(_ers(**STARVED, train_groups=3), linear_rollout, "rollout", "train") == \
        pytest.approx(10 - (10 - 8 + 8 * 2 / 3))
    # a ref group joining train: the last one brings the ref pass (2 s on 1 group = 1 s on 2), then all
    # of it speeds up: t' = (6 + 1) * 2/3
    one_ref = _ers(**STARVED, ref_groups=1)
    e_ref = dataclasses.replace(e, ref_busy_s=2.0)
    assert ers.move_gain(one_ref, e_ref, "train", "ref") == pytest.approx(10 - (10 + 0.5 * (7 * 2 / 3 - 6)))
    assert ers.move_gain(one_ref, e_ref, "ref", "train") == -float("inf")  # nothing moves to ref
    for bad in (dict(rollout_scaling=1.5), dict(train_coupling=-0.1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            _econ(**bad)


def test_a_rollout_that_outpaces_the_trainer_produces_a_batch_in_less_than_its_busy_time():
    # backlog, trainer computes 8 s on 2 groups, the rollout was busy 10 s on 2 groups: as if one batch took
    # it 10 s, a group more for the trainer (t' = 8 * 2/3) would leave a rollout of r' = 20:
    # max(8, 10) - max(5.33, 20), a loss. But it delivered 2.5 batches in the step (the backlog grew): a batch
    # took it 10 / 2.5 = 4 s, and R' = 4 + (20 - 10) / 2.5 = 8: max(8, 4) - max(5.33, 8) = 0
    backlog = _ers(**BACKLOG)
    e = _econ(train_busy_s=8.0, rollout_busy_s=10.0)
    assert ers.move_gain(backlog, e, "train", "rollout") == pytest.approx(10 - 20)
    assert ers.move_gain(backlog, dataclasses.replace(e, produced_batches=2.5), "train", "rollout") == \
        pytest.approx(8 - 8)
    # 4 batches: R' = 2.5 + 2.5 = 5, the trainer bounds the step: 8 - 5.33 a step
    assert ers.move_gain(backlog, dataclasses.replace(e, produced_batches=4.0), "train", "rollout") == \
        pytest.approx(8 - 8 * 2 / 3)
    # the default (1 batch a step) is the rollout keeping pace; nothing delivered gives no rate to use
    assert ers.move_gain(backlog, dataclasses.replace(e, produced_batches=0.0), "train", "rollout") == \
        ers.move_gain(backlog, e, "train", "rollout")
    with pytest.raises(ValueError, match="produced_batches"):
        _econ(produced_batches=-1.0)


def test_with_economics_the_best_allowed_move_wins():
    # a generation deficit whose cause is the staleness cycle, not rollout capacity: the ref group
    # joins the trainer (the paper's direction, ref -> rollout, would gain nothing)
    e = _econ(train_busy_s=6.0, rollout_busy_s=8.0, rollout_scaling=0.1, train_coupling=0.5, ref_busy_s=2.0,
              move_cost_s=1.0)
    # gains per step: ref -> train 0.67, rollout -> train 0.2, ref -> rollout 0.17
    assert ers.move_gain(_ers(**STARVED, ref_groups=1), e, "train", "ref") == pytest.approx(10 - (10 + 0.5 * (
        (6 + 1) * 2 / 3 - 6)))
    move, history = decide(_ers(**STARVED, ref_groups=1), ERSHistory(), ONE_STEP, e)
    assert (move.from_role, move.to_role, move.ra2p_mode) == ("ref", "train", "colocated")
    assert history.last_move_to == "train"
    # with ref groups left the ref pass stays decoupled on them
    move, _ = decide(_ers(**STARVED, ref_groups=2), ERSHistory(), ONE_STEP, e)
    assert (move.from_role, move.to_role, move.ra2p_mode) == ("ref", "train", "decoupled")
    # a rollout that scales and no coupling: the paper's direction
    move, _ = decide(_ers(**STARVED, ref_groups=1, train_groups=3), ERSHistory(), ONE_STEP,
                     _econ(train_busy_s=6.0, rollout_busy_s=6.0, move_cost_s=1.0))
    assert (move.from_role, move.to_role) == ("ref", "rollout")
    # moves back toward the side the last move took from wait out the cooldown, whichever role they use
    config = ERSConfig(patience=1, cooldown=2)
    move, history = decide(_ers(**STARVED), ERSHistory(last_move_to="rollout"), config, e)
    assert move is None and "cooldown" in history.refused and history.refused_kind == "cooldown"
    # no allowed move pays: refused with the best one named
    move, history = decide(_ers(**STARVED), ERSHistory(), ONE_STEP, dataclasses.replace(e, move_cost_s=1e6))
    assert move is None and "best move (rollout -> train)" in history.refused


def test_ra2p_repartition_gives_the_ref_group_to_the_actor_when_colocated_on_more_devices_pays():
    # 4 micro-batches all ready, ref 1 s and actor 2 s each on 1 train group, the ref group as fast (share 1):
    # now decoupled pipelines to 1 + 4 * 2 = 9 s; colocated on 2 groups at linear scaling: 4 * 3 / 2 = 6 s
    s = RA2PSignals(num_microbatches=4, ready_at_start=4, tprm_s=0.0, t_ref_s=1.0, t_act_s=2.0, t_swap_s=0.0,
                    ref_share=1.0, act_share=1.0)
    assert ra2p.partition_cost(s, 1, 1, 1, 1, 1.0) == min(choose_mode(s).cost_colocated, choose_mode(s).cost_decoupled)
    p = ra2p.repartition(s, train_groups=1, ref_groups=1, max_ref_groups=1, scaling=1.0)
    assert (p.from_role, p.to_role, p.cost_now_s, p.cost_after_s, p.gain_s) == ("ref", "train", 9.0, 6.0, 3.0)
    # devices that do not speed anything up (scaling 0): joining loses the pipelining, 12 s against 9 s
    p = ra2p.repartition(s, 1, 1, 1, 0.0)
    assert (p.from_role, p.to_role, p.gain_s) == ("ref", "train", -3.0)


def test_ra2p_repartition_carves_a_ref_group_out_when_decoupling_pays():
    # micro-batches trickling in (one every 2.5 s, none ready): colocated serialises ref and actor, 3 s a burst,
    # ending at 14.5 s; apart (scaling 0: the same speeds) the ref pass overlaps the arrivals, ending at 13 s
    s = RA2PSignals(num_microbatches=4, ready_at_start=0, tprm_s=2.5, t_ref_s=2.0, t_act_s=1.0, t_swap_s=0.0,
                    ref_share=1.0, act_share=1.0)
    p = ra2p.repartition(s, train_groups=3, ref_groups=0, max_ref_groups=1, scaling=0.0)
    assert (p.from_role, p.to_role, p.cost_now_s, p.cost_after_s) == ("train", "ref", 14.5, 13.0)
    # the config's bound: no ref group allowed, none held -> no option at all; one train group cannot give one
    assert ra2p.repartition(s, 3, 0, 0, 0.0) is None
    assert ra2p.repartition(s, 1, 0, 1, 0.0) is None
    with pytest.raises(ValueError, match="scaling"):
        ra2p.repartition(s, 1, 0, 1, 2.0)


def test_ra2p_decide_repartition_applies_patience_noise_floor_cost_and_cooldown():
    join = ra2p.Partition("ref", "train", gain_s=3.0, cost_now_s=9.0, cost_after_s=6.0)
    rules = dict(ref_groups=1, mode_now="decoupled", step_time_s=9.0, horizon_steps=10, cost_s=5.0,
                 min_gain_fraction=0.02, patience=2, cooldown=3)
    move, h = ra2p.decide_repartition(join, **rules)
    assert move is None and (h.wanted, h.streak) == (("ref", "train"), 1)  # patience: once is not enough
    move, h = ra2p.decide_repartition(join, h, **rules)
    assert (move.from_role, move.to_role, move.mode, move.gain_s, move.cost_s) == ("ref", "train", "colocated",
                                                                                   30.0, 5.0)
    assert h == ra2p.RepartitionHistory()
    # a boundary without a paying move breaks the streak
    _, h = ra2p.decide_repartition(join, **rules)
    _, h = ra2p.decide_repartition(None, h, **rules)
    assert (h.wanted, h.streak) == (None, 0)
    # within the noise floor (2% of 9 s = 0.18 s), or not paying its cost over the steps left: never wanted
    small = dataclasses.replace(join, gain_s=0.1)
    h = ra2p.RepartitionHistory(("ref", "train"), 5)
    assert ra2p.decide_repartition(small, h, **rules) == (None, ra2p.RepartitionHistory())
    assert ra2p.decide_repartition(join, h, **{**rules, "cost_s": 31.0}) == (None, ra2p.RepartitionHistory())
    # back toward where a recent move took a group from: held, the streak kept; after the cooldown it goes
    move, h = ra2p.decide_repartition(join, h, **rules, last_move_to="rollout", boundaries_since_move=3)
    assert move is None and "cooldown" in h.refused and h.streak == 6
    move, _ = ra2p.decide_repartition(join, h, **rules, last_move_to="rollout", boundaries_since_move=4)
    assert move is not None
    # a group carved out for the reference runs it decoupled; a join that leaves ref groups keeps the mode
    carve = ra2p.Partition("train", "ref", gain_s=1.5, cost_now_s=14.5, cost_after_s=13.0)
    move, _ = ra2p.decide_repartition(carve, ra2p.RepartitionHistory(("train", "ref"), 1), **rules)
    assert move.mode == "decoupled"
    move, _ = ra2p.decide_repartition(join, ra2p.RepartitionHistory(("ref", "train"), 1),
                                      **{**rules, "ref_groups": 2})
    assert move.mode == "decoupled"


def test_a_ref_group_ra2p_leaves_idle_goes_to_train_after_patience():
    # balanced signals (no deficit), but RA2P ran the ref pass colocated: its devices sat out the step
    config = ERSConfig(patience=2)
    idle = _ers(ref_groups=1, ref_idle=True)
    move, history = decide(idle, ERSHistory(), config)
    assert move is None and history.idle_ref_streak == 1
    move, history = decide(idle, history, config)
    assert move == Move("ref", "train", "colocated", "idle ref group")
    # a used ref group (decoupled), or none at all, is never idle
    for s in (_ers(ref_groups=1), _ers(ref_idle=True)):
        _, h = decide(s, ERSHistory(idle_ref_streak=5), ONE_STEP)
        assert h.idle_ref_streak == 0
    # with economics only the ref group's moves are candidates: a trainer-bound step takes it to train,
    # a rollout that scales and bounds the step takes it to rollout
    move, _ = decide(_ers(ref_groups=1, ref_idle=True), ERSHistory(), ONE_STEP, _econ(move_cost_s=1.0))
    assert (move.from_role, move.to_role, move.reason) == ("ref", "train", "idle ref group")
    move, _ = decide(_ers(ref_groups=1, ref_idle=True, trainer_idle_s=0.4), ERSHistory(), ONE_STEP,
                     _econ(train_busy_s=3.0, rollout_busy_s=9.0, move_cost_s=1.0))
    assert (move.from_role, move.to_role) == ("ref", "rollout")
    move, history = decide(idle, ERSHistory(), ONE_STEP, _econ(move_cost_s=1e6))
    assert move is None and "idle ref group: the best move (ref -> train)" in history.refused


def test_per_move_costs_choose_the_best_move_net_of_its_cost():
    # STARVED on 3 train groups: ref -> rollout gains more per step than ref -> train, but costs more
    # (the engine's whole bucket grid against the trainer's programs); net of cost ref -> train wins
    s = _ers(**STARVED, ref_groups=1, train_groups=3)
    e = _econ(train_busy_s=6.0, rollout_busy_s=6.0, move_cost_s=1.0, train_coupling=0.5)
    g_roll, g_train = ers.move_gain(s, e, "rollout", "ref"), ers.move_gain(s, e, "train", "ref")
    assert g_roll > g_train > 0
    assert decide(s, ERSHistory(), ONE_STEP, e)[0].to_role == "rollout"
    costs = {("ref", "rollout"): 10 * (g_roll - g_train) + 1.5, ("ref", "train"): 1.0}
    move, _ = decide(s, ERSHistory(), ONE_STEP, dataclasses.replace(e, move_costs=costs))
    assert (move.from_role, move.to_role, move.cost_s) == ("ref", "train", 1.0)
    assert dataclasses.replace(e, move_costs=costs).cost("train", "rollout") == 1.0  # the default
    with pytest.raises(ValueError, match="move_costs"):
        _econ(move_costs={("ref", "train"): -1.0})


def test_jax_backend_move_costs_are_the_rebuilt_parts_program_loads():
    from types import SimpleNamespace

    from tiderl_jax.runtime.backend import JaxBackend
    from tiderl_jax.runtime.pool import DevicePool
    b = JaxBackend.__new__(JaxBackend)
    b.trainer, b.ref_scorer = (SimpleNamespace(compile_s=x) for x in (4.0, 2.0))
    # a move rebuilds one rollout replica: the costliest replica's program loads bound it
    b.service = SimpleNamespace(engines=[SimpleNamespace(compile_s=x) for x in (30.0, 12.0)])
    b.pool = DevicePool.split(list(range(8)), group_size=2, rollout=2, ref=1, train=1)
    costs = b.move_costs()
    assert costs[("ref", "train")] == 4.0  # the last ref group goes: only the trainer rebuilds
    assert costs[("ref", "rollout")] == 30.0
    assert costs[("rollout", "train")] == 34.0 and costs[("train", "ref")] == 6.0
    b._warm_s = {"rollout": 40.0, "train": 3.0}  # a warm-up's seconds bound each part's estimate from below
    costs = b.move_costs()
    assert costs[("ref", "rollout")] == 40.0 and costs[("ref", "train")] == 4.0 and costs[("train", "ref")] == 7.0
    b.pool = None  # sync: nothing moves
    assert b.move_costs() == {}


def test_train_coupling_and_staleness_room():
    assert ers.train_coupling(5.0, 10.0, 1) == pytest.approx(0.25)
    assert ers.train_coupling(20.0, 10.0, 0) == 1.0 and ers.train_coupling(1.0, 0.0, 1) == 0.0
    with pytest.raises(ValueError, match="held_s"):
        ers.train_coupling(-1.0, 10.0, 1)
    # capacity is the smaller of max_concurrent's room and the staleness bound's
    assert staleness.staleness_room(running=3, eta=1, version=2, batch_size=4, accepted=9) == 4
    assert capacity(100, 3, 1, 2, 4, 9) == 4 and capacity(5, 3, 1, 2, 4, 9) == 2
