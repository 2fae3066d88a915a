"""CTB's decision rules on hand-built signals (docs/mechanisms.md, CTB)."""

from tiderl_jax.policies.ctb import (CTBWeights, TaskKVSignals, admit_tasks, choose_evictions,
                                     estimate_footprint, expected_remaining_turns, task_priority)


def _t(i, *, ev=False, group=0.0, active=False, ctx=100, wait=0.0):
    return TaskKVSignals(i, ev, group, active, ctx, wait)


def test_priority_orders_eval_then_group_then_active_then_context():
    w = CTBWeights()
    assert task_priority(_t(1, ev=True), w) > task_priority(_t(2, group=1.0, active=True, ctx=5000), w)
    assert task_priority(_t(1, group=0.9), w) > task_priority(_t(2, group=0.1, active=True), w)
    assert task_priority(_t(1, active=True), w) > task_priority(_t(2, ctx=5000), w)
    assert task_priority(_t(1, ctx=200), w) > task_priority(_t(2, ctx=100), w)
    flipped = CTBWeights(context_len=-0.001)
    assert task_priority(_t(1, ctx=200), flipped) < task_priority(_t(2, ctx=100), flipped)


def test_footprint_uses_observed_growth_after_the_first_turn():
    assert estimate_footprint(300, 0, 0, initial_growth=128) == 428
    assert estimate_footprint(700, 2, 400) == 900  # grew 200 per turn
    assert estimate_footprint(700, 2, 400, margin_turns=2) == 1100


def test_expected_remaining_turns_from_finished_tasks():
    assert expected_remaining_turns(0, [], max_turns=8) == 8.0  # nothing observed: worst case
    assert expected_remaining_turns(3, [], max_turns=8) == 5.0
    # tasks that ran 2, 4 and 6 turns; one that has done 3 is like the 4- and 6-turn ones: 1 or 3 more
    assert expected_remaining_turns(3, [2, 4, 6], max_turns=8) == 2.0
    assert expected_remaining_turns(0, [2, 4, 6], max_turns=8) == 4.0
    assert expected_remaining_turns(6, [2, 4, 6], max_turns=8) == 2.0  # none ran longer: the prior
    assert expected_remaining_turns(8, [], max_turns=8) == 0.0


def test_admission_is_fifo_within_the_budget():
    q = [(1, 300), (2, 300), (3, 100)]
    assert admit_tasks(q, budget_tokens=1000, used_tokens=0) == [1, 2, 3]
    assert admit_tasks(q, budget_tokens=1000, used_tokens=500) == [1]  # 3 would fit but may not overtake 2
    assert admit_tasks([(9, 5000)], budget_tokens=1000, used_tokens=0) == [9]  # an idle rank takes any task
    assert admit_tasks([(9, 5000)], budget_tokens=1000, used_tokens=1) == []


def test_eviction_takes_waiting_tasks_lowest_priority_first():
    tasks = [_t(1, ctx=300, group=0.5), _t(2, ctx=200), _t(3, ctx=400, active=True), _t(4, ctx=100, ev=True)]
    assert choose_evictions(tasks, 150) == [2]
    assert choose_evictions(tasks, 450) == [2, 1]
    assert choose_evictions(tasks, 10_000) == [2, 1, 4]  # never the active task
    assert choose_evictions(tasks, 0) == []


def test_readiness_aware_eviction_takes_the_longest_expected_wait():
    tasks = [_t(1, ctx=300, wait=0.1), _t(2, ctx=300, wait=2.0, group=0.9), _t(3, ctx=300, wait=0.5)]
    assert choose_evictions(tasks, 100, readiness_aware=True) == [2]
    assert choose_evictions(tasks, 100) == [3]  # equal priority (1, 3): the longer wait goes first
