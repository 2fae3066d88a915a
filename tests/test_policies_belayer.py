"""Belayer's pure decisions: health threshold, the environment-checkpoint rule, failure classes, retries."""

import math

import pytest

from tiderl_jax.policies import belayer as B


def _run(checks, threshold):
    state = B.HealthState()
    for ok in checks:
        state = B.observe(state, ok, threshold)
    return state


def test_health_fails_only_after_threshold_consecutive_failed_checks():
    assert not _run([False, False], 3).failed
    assert _run([False, False, False], 3).failed
    # a passing check resets the count: 2 + 2 failures with an ok between never reach 3 in a row
    state = _run([False, False, True, False, False], 3)
    assert not state.failed and state.consecutive_failures == 2 and state.checks == 5
    assert _run([True, False], 1).failed
    assert _run([True] * 10, 1) == B.HealthState(0, 10, False)


def test_health_failure_is_final():
    state = _run([False, False], 2)
    assert state.failed
    after = B.observe(state, True, 2)
    assert after.failed and after.checks == 3


def test_health_threshold_must_be_positive():
    with pytest.raises(ValueError, match="threshold=0"):
        B.observe(B.HealthState(), True, 0)


def test_redo_cost_sums_env_and_generation_time():
    assert B.redo_cost([0.5, 1.0], [2.0, 0.25]) == 3.75
    assert B.redo_cost([], []) == 0.0
    with pytest.raises(ValueError, match="env_s"):
        B.redo_cost([-1.0], [])
    with pytest.raises(ValueError, match="gen_s"):
        B.redo_cost([], [math.nan])


def test_visible_overhead_is_what_outlasts_generation():
    assert B.visible_overhead(0.3, 1.0) == 0.0
    assert B.visible_overhead(1.5, 1.0) == 0.5
    assert B.visible_overhead(0.2, 0.0) == 0.2
    with pytest.raises(ValueError, match="overlap_s"):
        B.visible_overhead(0.2, -1.0)


@pytest.mark.parametrize("p_fail, redo, ckpt, overlap, want", [
    (0.1, 10.0, 2.0, 1.0, True),     # 1.0 >= 1.0: the boundary case checkpoints
    (0.1, 9.0, 2.0, 1.0, False),     # 0.9 < 1.0
    (0.0, 100.0, 0.5, 1.0, True),    # fully overlapped: free, taken even at p_fail 0
    (0.0, 100.0, 1.5, 1.0, False),   # visible cost and no failure expected
    (1.0, 0.4, 1.5, 1.0, False),     # certain failure, but redoing is cheaper than the snapshot
    (1.0, 0.5, 1.5, 1.0, True),
    (0.05, 0.0, 0.0, 0.0, True),     # nothing to redo, nothing to pay
])
def test_checkpoint_rule(p_fail, redo, ckpt, overlap, want):
    assert B.should_checkpoint(p_fail, redo, ckpt, overlap) is want


def test_checkpoint_rule_rejects_bad_inputs():
    with pytest.raises(ValueError, match="p_fail=1.5"):
        B.should_checkpoint(1.5, 1.0, 0.1, 0.0)
    with pytest.raises(ValueError, match="redo_cost_s=-1"):
        B.should_checkpoint(0.5, -1.0, 0.1, 0.0)
    with pytest.raises(ValueError, match="checkpoint_s"):
        B.should_checkpoint(0.5, 1.0, math.inf * 0, 0.0)


def test_p_fail_within():
    assert B.p_fail_within(0.0, 100.0) == 0.0
    assert B.p_fail_within(1.0, 0.0) == 0.0
    assert B.p_fail_within(0.5, 2.0) == pytest.approx(1 - math.exp(-1))
    with pytest.raises(ValueError, match="failure_rate_per_s"):
        B.p_fail_within(-0.1, 1.0)


def test_failure_classes():
    for kind in (B.WORKER_CRASH, B.SANDBOX_CRASH, B.TIMEOUT):
        assert B.classify(kind) is B.FailureClass.INFRASTRUCTURE
    for kind in (B.MALFORMED_TASK, B.UNPARSABLE_ANSWER):
        assert B.classify(kind) is B.FailureClass.DATA
    with pytest.raises(ValueError, match="'oom' is not one of"):
        B.classify("oom")


def test_infrastructure_failures_retry_within_budget_then_drop():
    first = B.decide_retry(B.SANDBOX_CRASH, 0, 2, "exit -9")
    assert first.action == B.RETRY and first.failure_class is B.FailureClass.INFRASTRUCTURE
    assert "retry 1 of 2" in first.reason and "exit -9" in first.reason
    assert B.decide_retry(B.TIMEOUT, 1, 2).action == B.RETRY
    last = B.decide_retry(B.TIMEOUT, 2, 2)
    assert last.action == B.DROP and "exhausted after 2 retries" in last.reason and "timeout" in last.reason
    assert B.decide_retry(B.WORKER_CRASH, 0, 0).action == B.DROP


def test_data_failures_drop_at_once_with_reason():
    d = B.decide_retry(B.UNPARSABLE_ANSWER, 0, 5, "no integer in the reply")
    assert d.action == B.DROP and d.failure_class is B.FailureClass.DATA
    assert "unparsable_answer: no integer in the reply" in d.reason
    assert B.decide_retry(B.MALFORMED_TASK, 0, 5).action == B.DROP
    with pytest.raises(ValueError, match="attempts=-1"):
        B.decide_retry(B.TIMEOUT, -1, 2)
    with pytest.raises(ValueError, match="'disk_full'"):
        B.decide_retry("disk_full", 0, 2)
