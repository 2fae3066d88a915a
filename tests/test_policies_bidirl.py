"""BiDiRL's static planner and bidirectional borrowing rule on hand-built time models (docs/mechanisms.md, BiDiRL)."""

import math

import pytest

from tiderl_jax.policies import bidirl
from tiderl_jax.policies.bidirl import BorrowSignals, decide_borrow, plan_partition


def test_planner_balances_rollout_and_training():
    # rollout 960 device-seconds per step, training 320: 24/8 gives 40 s each
    plan = plan_partition(32, 8, lambda d: 960 / d, lambda d: 320 / d)
    assert [p.rollout_devices for p in plan.candidates] == [8, 16, 24]
    assert [p.step_time_s for p in plan.candidates] == [120, 60, 40]
    assert (plan.best.rollout_devices, plan.best.train_devices) == (24, 8)
    assert plan.best.step_time_s == 40 and plan.best.imbalance_s == 0


def test_ties_go_to_the_more_balanced_partition():
    # rollout does not scale (50 s everywhere): every split takes 50 s; 24/8 balances it exactly
    plan = plan_partition(32, 8, lambda d: 50.0, lambda d: 400 / d)
    assert [p.step_time_s for p in plan.candidates] == [50, 50, 50]
    assert plan.best.rollout_devices == 24
    # all equal and balanced: the even device split
    assert plan_partition(32, 8, lambda d: 10.0, lambda d: 10.0).best.rollout_devices == 16
    # within the tolerance counts as a tie
    near = plan_partition(32, 8, lambda d: {8: 49.9, 16: 50.0, 24: 50.0}[d], lambda d: 400 / d, tie_tolerance=0.01)
    assert near.best.rollout_devices == 24
    assert plan_partition(32, 8, lambda d: {8: 49.9, 16: 50.0, 24: 50.0}[d],
                          lambda d: 400 / d).best.rollout_devices == 8


def test_layouts_must_let_each_pool_host_both_roles():
    # TP-8 rollout replicas, trainer model-parallel groups of 4, allocation in groups of 4
    assert bidirl.candidate_splits(24, 4, rollout_unit=8, train_unit=4) == [8, 16]
    assert bidirl.candidate_splits(24, 4) == [4, 8, 12, 16, 20]
    plan = plan_partition(24, 4, lambda d: 240 / d, lambda d: 24 / d, rollout_unit=8, train_unit=4)
    assert plan.best.rollout_devices == 16  # 20 would balance better but its train pool of 4 cannot host rollout
    with pytest.raises(ValueError, match="no divisible layout of total_devices=8"):
        plan_partition(8, 4, lambda d: 1.0, lambda d: 1.0, rollout_unit=8)
    with pytest.raises(ValueError, match="total_devices=30 is not a multiple of group_size=8"):
        bidirl.candidate_splits(30, 8)


def test_a_bad_time_model_is_named():
    with pytest.raises(ValueError, match=r"rollout_time\(8\)=0.0"):
        plan_partition(16, 8, lambda d: 0.0, lambda d: 1.0)
    with pytest.raises(ValueError, match=r"train_time\(8\)=inf"):
        plan_partition(16, 8, lambda d: 1.0, lambda d: math.inf)


def signals(**kw):
    base = dict(borrower=bidirl.TRAIN, remaining_s=60.0, own_devices=16, idle_devices=16, idle_for_s=math.inf,
                switch_in_s=2.0, switch_out_s=2.0, merge_s=1.0, borrower_unit=8)
    return BorrowSignals(**{**base, **kw})


def test_borrow_when_the_gain_pays_the_switches():
    d = decide_borrow(signals())
    # twice the devices for the remaining 60 s: finish in 30, gain 30 > 2 + 2 + 1
    assert (d.borrow, d.devices, d.lender, d.gain_s, d.cost_s) == (True, 16, bidirl.ROLLOUT, 30.0, 5.0)


def test_the_lenders_return_limits_the_gain():
    # lender idle 14 s: the borrowed devices work 14 - 2 - 2 = 10 s, finish 60 - 10 = 50
    d = decide_borrow(signals(idle_for_s=14.0))
    assert d.borrow and d.gain_s == pytest.approx(10.0)
    # idle 8 s: 4 s of work saves 4 s < 5 s of switches and merge
    d = decide_borrow(signals(idle_for_s=8.0))
    assert not d.borrow and d.devices == 0 and d.gain_s == pytest.approx(4.0)
    assert "does not pay" in d.reason
    assert decide_borrow(signals(idle_for_s=4.0)).gain_s == 0.0  # the switches alone fill the window


def test_gradient_merge_is_charged_only_when_the_trainer_borrows():
    trainer = decide_borrow(signals(idle_for_s=8.5))  # gain 4.5 < 2 + 2 + 1
    rollout = decide_borrow(signals(borrower=bidirl.ROLLOUT, idle_for_s=8.5))  # gain 4.5 > 2 + 2
    assert (trainer.borrow, trainer.cost_s) == (False, 5.0)
    assert (rollout.borrow, rollout.cost_s, rollout.lender) == (True, 4.0, bidirl.TRAIN)


def test_only_whole_borrower_units_are_borrowed():
    d = decide_borrow(signals(idle_devices=12))  # one unit of 8: k = 0.5, finish 40
    assert (d.borrow, d.devices, d.gain_s) == (True, 8, 20.0)
    d = decide_borrow(signals(idle_devices=5))
    assert (d.borrow, d.devices, d.gain_s) == (False, 0, 0.0)
    assert "no whole train unit of 8" in d.reason
    d = decide_borrow(signals(scaling=0.5))  # borrowed devices at half speed: k = 0.5
    assert d.gain_s == 20.0


def test_bad_borrow_signals_are_named():
    with pytest.raises(ValueError, match="borrower='ref'"):
        signals(borrower="ref")
    with pytest.raises(ValueError, match="switch_in_s=-1"):
        signals(switch_in_s=-1.0)
    with pytest.raises(ValueError, match="own_devices=0"):
        signals(own_devices=0)
    with pytest.raises(ValueError, match="scaling=0"):
        signals(scaling=0)


def test_measured_scaling_of_a_borrow():
    # 8 own devices, 8 borrowed: the rate going from 10 to 15 samples/s means each borrowed device
    # added half of an own one; no gain (or a loss) clips to the floor, more than linear to 1
    assert bidirl.measured_scaling(10.0, 15.0, 8, 8) == pytest.approx(0.5)
    assert bidirl.measured_scaling(10.0, 9.0, 8, 8) == bidirl.MIN_SCALING
    assert bidirl.measured_scaling(10.0, 40.0, 8, 8) == 1.0
    with pytest.raises(ValueError, match="rate_before"):
        bidirl.measured_scaling(0.0, 1.0, 8, 8)
