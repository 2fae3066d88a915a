"""WAR placement, concurrency window and speculative-decoding rule on hand-built signals (docs/mechanisms.md, WAR)."""

import pytest

from tiderl_jax.policies import war
from tiderl_jax.policies.war import ReplicaState, RequestSignals, WARConfig, place, use_speculation

ALWAYS_HEAVY = WARConfig(heavy_load=0.0)


def req(i, waiting=0.0, turns=1.0, cached=None, last=None):
    return RequestSignals(i, waiting_s=waiting, group_remaining_turns=turns, cached_tokens=cached or {},
                          last_replica=last)


def test_light_load_is_least_loaded_with_sticky_sessions():
    replicas = [ReplicaState(0, in_flight=1, window=4), ReplicaState(1, in_flight=0, window=4)]
    assert not war.is_heavy(3, replicas)  # 1 + 3 <= 8
    placements, queued = place([req(10, waiting=3, last=0), req(11, waiting=2), req(12, waiting=1, last=1)],
                               replicas)
    assert [(p.request_id, p.replica, p.reason) for p in placements] == [
        (10, 0, "sticky"),  # back to its KV although replica 0 is busier
        (11, 1, "least-loaded"),  # 0/4 vs 2/4
        (12, 1, "sticky")]
    assert queued == []


def test_a_full_sticky_replica_sends_the_request_to_the_least_loaded():
    replicas = [ReplicaState(0, in_flight=2, window=2), ReplicaState(1, 1, 4), ReplicaState(2, 1, 2)]
    placements, _ = place([req(1, last=0)], replicas)
    assert (placements[0].replica, placements[0].reason) == (1, "least-loaded")  # load 1/4 < 1/2
    placements, _ = place([req(1, last=7)], replicas)  # a replica that no longer exists
    assert placements[0].replica == 1


def test_heavy_load_serves_overdue_requests_first_then_groups_close_to_done():
    replicas = [ReplicaState(0, 0, 1), ReplicaState(1, 0, 1)]
    a = req(1, waiting=100, turns=5)  # 70 s past the 30 s threshold
    b = req(2, waiting=10, turns=1, cached={1: 500})
    c = req(3, waiting=20, turns=3, cached={0: 900})
    assert war.is_heavy(3, replicas)  # 3 > 2 slots
    placements, queued = place([c, b, a], replicas)
    assert [(p.request_id, p.replica) for p in placements] == [(1, 0), (2, 1)]
    assert {p.reason for p in placements} == {"scored"}
    assert queued == [3]  # more remaining turns; its cache does not outrank b's fewer turns


def test_waiting_below_the_threshold_does_not_outrank_fewer_turns():
    replicas = [ReplicaState(0, 0, 1)]
    placements, queued = place([req(1, waiting=29, turns=4), req(2, waiting=0, turns=2)], replicas)
    assert [p.request_id for p in placements] == [2] and queued == [1]
    placements, _ = place([req(1, waiting=31, turns=4), req(2, waiting=0, turns=2)], replicas)
    assert [p.request_id for p in placements] == [1]


def test_cache_hit_outranks_load_and_picks_the_request_among_ties():
    replicas = [ReplicaState(0, in_flight=2, window=4), ReplicaState(1, in_flight=0, window=4)]
    placements, _ = place([req(1, cached={0: 100}), req(2)], replicas, ALWAYS_HEAVY)
    assert {(p.request_id, p.replica) for p in placements} == {(1, 0), (2, 1)}
    # one slot, two requests equal in waiting and turns: the one with its context cached there wins
    replicas = [ReplicaState(0, 1, 1), ReplicaState(1, 0, 1)]
    placements, queued = place([req(1), req(2, cached={1: 50})], replicas, ALWAYS_HEAVY)
    assert [(p.request_id, p.replica) for p in placements] == [(2, 1)] and queued == [1]


def test_bad_placement_inputs_are_named():
    with pytest.raises(ValueError, match="duplicate replica ids"):
        place([], [ReplicaState(0, 0, 1), ReplicaState(0, 0, 1)])
    with pytest.raises(ValueError, match="window=0"):
        ReplicaState(0, 0, 0)
    with pytest.raises(ValueError, match="waiting_s=-1"):
        req(1, waiting=-1.0)
    with pytest.raises(ValueError, match=r"cached_tokens\[0\]=-5"):
        req(1, cached={0: -5})


def test_concurrency_window_is_what_the_kv_holds_within_the_batch_limits():
    assert war.concurrency_window(10_000, 900, max_batch=64) == 11
    assert war.concurrency_window(10_000, 900, max_batch=8) == 8
    assert war.concurrency_window(10_000, 20_000, max_batch=8) == 1
    assert war.concurrency_window(10_000, 20_000, max_batch=8, min_window=2) == 2
    with pytest.raises(ValueError, match="footprint_tokens=0"):
        war.concurrency_window(10, 0, max_batch=8)
    with pytest.raises(ValueError, match="min_window=9"):
        war.concurrency_window(10, 1, max_batch=8, min_window=9)


def test_speculation_only_at_small_batches_and_when_it_pays_per_token():
    d = use_speculation(8, t_spec_s=0.030, accepted_tokens=2.5, t_decode_s=0.020)
    assert d.use and d.spec_s_per_token == pytest.approx(0.012)
    assert not use_speculation(32, 0.030, 2.5, 0.020).use  # batch above 16
    assert use_speculation(16, 0.030, 2.5, 0.020).use
    assert use_speculation(32, 0.030, 2.5, 0.020, spec_max_batch=32).use
    d = use_speculation(8, 0.030, 1.2, 0.020)  # 25 ms per token > 20 ms
    assert not d.use and d.spec_s_per_token == pytest.approx(0.025)
    assert not use_speculation(8, 0.5, 2.0, 0.25).use  # equal per-token time does not pay
    assert not use_speculation(0, 0.030, 2.5, 0.020).use
    assert not use_speculation(8, 0.030, 2.5, 0.0125, margin=0.1).use  # 12 ms vs 12.5: saves 4% < 10%
    assert use_speculation(8, 0.030, 2.5, 0.0125).use
    with pytest.raises(ValueError, match="margin=1"):
        use_speculation(8, 0.030, 2.5, 0.020, margin=1)
    with pytest.raises(ValueError, match="accepted_tokens=0"):
        use_speculation(8, 0.030, 0, 0.020)


def test_speculation_pays_is_use_speculations_rule():
    for batch in (0, 1, 8, 16, 17, 64):
        for t_spec in (0.001, 0.02, 0.05, 0.5):
            for accepted in (1.0, 2.5):
                d = war.use_speculation(batch, t_spec, accepted, 0.02)
                assert war.speculation_pays(batch, t_spec, accepted, 0.02) == d.use
                assert d.reason  # explained when read


def test_the_switch_measures_each_kind_first_probes_on_its_class_s_count_and_holds_a_tie():
    cfg = war.SpecSwitchConfig(probe_every=3, margin=0.1)
    h = war.SpecClassHistory()
    use, h, d = war.switch_speculation(4, None, None, None, h, cfg)
    assert (use, h.decisions, d) == (False, 1, None)  # plain measured first
    use, h, d = war.switch_speculation(4, 0.010, None, None, h, cfg)
    assert (use, d) == (True, None)  # then speculation once
    use, h, d = war.switch_speculation(4, 0.010, 0.019, 2.0, h, cfg)  # the class's 3rd decision: a probe
    assert (use, d, h.last_use) == (True, None, False)  # the kind not chosen last
    use, h, d = war.switch_speculation(4, 0.010, 0.019, 2.0, h, cfg)  # saves 5% < the 10% margin: stays off
    assert not use and "10% under" in d.reason
    use, h, _ = war.switch_speculation(4, 0.010, 0.016, 2.0, h, cfg)  # saves 20%: on
    assert use and h.last_use
    use, h, _ = war.switch_speculation(4, 0.010, 0.019, 2.0, h, cfg)  # the 6th: a probe runs plain
    assert not use and h.last_use
    use, h, _ = war.switch_speculation(4, 0.010, 0.019, 2.0, h, cfg)  # on, it stays on while it saves anything
    assert use and h.decisions == 7
    assert war.switch_speculation(17, 0.010, 0.001, 9.0, h, cfg)[:2] == (False, h)  # above the batch: not counted
    with pytest.raises(ValueError, match="probe_every"):
        war.SpecSwitchConfig(probe_every=0)
