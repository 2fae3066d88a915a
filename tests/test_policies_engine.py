"""The engine's pure policies on hand-built signals: prefill budgets (static, P-PAS) and preemption."""

import pytest

from tiderl_jax.policies.preemption import PreemptionCandidate, choose_victim
from tiderl_jax.policies.prefill_budget import PrefillSignals, choose_prefill_budget, under_prefill_pressure


@pytest.mark.parametrize("prefilling, decoding, pressure", [
    (0, 0, False), (1, 5, False), (2, 0, False), (2, 1, True), (7, 30, True),
])
def test_ppas_pressure_rule(prefilling, decoding, pressure):
    s = PrefillSignals(prefilling, decoding)
    assert under_prefill_pressure(s) is pressure
    budget = choose_prefill_budget("ppas", s, full_budget=16384, pressure_budget=2048)
    assert budget == (2048 if pressure else 16384)
    assert choose_prefill_budget("static", s, full_budget=16384, pressure_budget=2048) == 16384


def test_unknown_budget_policy():
    with pytest.raises(ValueError, match="'fancy'"):
        choose_prefill_budget("fancy", PrefillSignals(0, 0), full_budget=1, pressure_budget=1)


def _c(i, priority=0.0, arrival=0, paused=False, pinned=False, pages=3):
    return PreemptionCandidate(i, priority, arrival, paused, pinned, pages)


def test_victim_order_paused_then_priority_then_latest():
    cands = [_c(1, arrival=1), _c(2, arrival=5), _c(3, priority=-1.0, arrival=2), _c(4, paused=True, arrival=0)]
    assert choose_victim(cands, 99, requester_priority=0.0, requester_arrival=0) == 4  # paused first
    cands = cands[:3]
    assert choose_victim(cands, 99, requester_priority=0.0, requester_arrival=0) == 3  # lowest priority
    cands = cands[:2]
    assert choose_victim(cands, 99, requester_priority=0.0, requester_arrival=0) == 2  # latest arrival


def test_paused_go_before_ready_whatever_their_priority():
    ready = PreemptionCandidate(1, -5.0, 9, True, False, 3, ready=True)  # resumed, awaiting a slot
    paused = PreemptionCandidate(2, 5.0, 0, True, False, 3)  # waiting on its tool
    assert choose_victim([ready, paused], 99, requester_priority=0.0, requester_arrival=0) == 2
    assert choose_victim([ready], 99, requester_priority=0.0, requester_arrival=0) == 1  # still a candidate


def test_victims_must_be_outranked_unpinned_and_hold_pages():
    cands = [_c(1, arrival=1), _c(2, priority=5.0, arrival=9), _c(3, arrival=7, pinned=True), _c(4, arrival=8, pages=0)]
    # requester arrived at 3: only 1 arrived earlier (not outranked); 2 has higher priority; 3 pinned; 4 empty
    assert choose_victim(cands, 99, requester_priority=0.0, requester_arrival=3) is None
    assert choose_victim(cands, 1, requester_priority=0.0, requester_arrival=0) is None  # never itself
    assert choose_victim(cands + [_c(5, arrival=6)], 99, requester_priority=0.0, requester_arrival=3) == 5


def test_memory_admission():
    from tiderl_jax.policies.preemption import can_admit
    assert can_admit(5, free_pages=10, reserved_pages=5, num_running=2)
    assert not can_admit(6, free_pages=10, reserved_pages=5, num_running=2)
    assert can_admit(60, free_pages=10, reserved_pages=0, num_running=0)  # an idle engine admits
