"""Router policies on hand-built replica states (docs/mechanisms.md, router baselines, WAR, MISA-T)."""

import pytest

from tiderl_jax.policies import war as W
from tiderl_jax.policies.misa_t import MISATConfig
from tiderl_jax.policies.routing import POLICIES, Replica, Request, RouterConfig, RouterState, route

# MISA-T at the scale of these views: 100-token sessions, short residencies
SMALL = RouterConfig(misa_t=MISATConfig(prior_kv_tokens={"agentic": 100, "rlvr": 100, "rlhf": 100},
                                        prior_residency_s={"agentic": 3.0, "rlvr": 2.0, "rlhf": 1.0}))


def rep(i, load=0, cached=None, free=10_000, used=0, pinned=0, tps=0.0, queued=0):
    return Replica(i, running=load, kv_used_tokens=used, kv_pinned_tokens=pinned, kv_free_tokens=free,
                   tokens_per_s=tps, cached_tokens=cached or {}, queued_tokens=queued)


def req(i, session=None, turn=0, kv=None, prompt=100, cls="agentic", waiting=0.0, turns=0.0):
    return Request(i, session if session is not None else f"s{i}", cls=cls, turn=turn, prompt_tokens=prompt,
                   kv_replica=kv, waiting_s=waiting, group_remaining_turns=turns)


def placed(routing):
    return [(p.request_id, p.replica, p.reason) for p in routing.placements]


def test_round_robin_cycles_and_carries_its_cursor():
    replicas = [rep(2), rep(0), rep(1)]
    r = route("round_robin", [req(i) for i in range(4)], replicas)
    assert [p.replica for p in r.placements] == [0, 1, 2, 0]
    r = route("round_robin", [req(10), req(11)], replicas, r.state)
    assert [p.replica for p in r.placements] == [1, 2]
    # a limit skips full replicas; all full: held
    r = route("round_robin", [req(i) for i in range(3)], [rep(0, load=2), rep(1), rep(2, load=2)],
              config=RouterConfig(concurrency_limit=2))
    assert [p.replica for p in r.placements] == [1, 1] and r.held == (2,)


def test_least_loaded_picks_the_least_loaded():
    replicas = [rep(0, load=3), rep(1, load=1), rep(2, load=2)]
    r = route("least_loaded", [req(i) for i in range(3)], replicas)
    assert [p.replica for p in r.placements] == [1, 1, 2]  # 1 (1), then 1 and 2 tie at 2: the lower KV use, id
    r = route("least_loaded", [req(1)], [rep(0, load=1, used=500), rep(1, load=1, used=100)])
    assert placed(r) == [(1, 1, "least-loaded")]


def test_cache_aware_follows_the_prefix_until_the_balance_threshold():
    config = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    # session x has 80 of its 100 prompt tokens cached on replica 1, which carries 4 more requests: prefix
    r = route("cache_aware", [req(1, session="x")], [rep(0, load=2), rep(1, load=6, cached={"x": 80})], config=config)
    assert placed(r) == [(1, 1, "prefix")]
    # 5 more than the least loaded (and 3.5x): the balance threshold sends it to the least loaded
    r = route("cache_aware", [req(1, session="x")], [rep(0, load=2), rep(1, load=7, cached={"x": 80})], config=config)
    assert placed(r) == [(1, 0, "balance")]
    # too little of the prompt cached (below cache_threshold 0.5): least loaded
    r = route("cache_aware", [req(1, session="x")], [rep(0, load=2), rep(1, load=3, cached={"x": 40})], config=config)
    assert placed(r) == [(1, 0, "least-loaded")]
    # the most cached wins over a smaller cached prefix
    r = route("cache_aware", [req(1, session="x")], [rep(0, cached={"x": 60}), rep(1, load=1, cached={"x": 90})])
    assert placed(r) == [(1, 1, "prefix")]


def test_cache_aware_holds_at_its_fixed_concurrency_limit():
    config = RouterConfig(concurrency_limit=3)
    replicas = [rep(0, load=3, cached={"x": 90}), rep(1, load=2)]
    r = route("cache_aware", [req(1, session="x"), req(2), req(3)], replicas, config=config)
    assert placed(r) == [(1, 1, "least-loaded")]  # its prefix replica is at the limit
    assert r.held == (2, 3)  # every replica at the limit: held, not dropped


@pytest.mark.parametrize("heavy", [False, True])
def test_war_matches_war_place(heavy):
    replicas = [rep(0, load=1, used=2048, free=6144), rep(1, load=0, free=8192, cached={"b": 500}),
                rep(2, load=2, used=4096, pinned=2048, free=4096)]
    requests = [req(1, session="a", turn=2, kv=0, waiting=40, turns=3), req(2, session="b", waiting=5, turns=1),
                req(3, session="c", turn=1, kv=2, waiting=10, turns=2), req(4, session="d", waiting=1, turns=4)]
    config = RouterConfig(war=W.WARConfig(heavy_load=0.0 if heavy else 1.0), war_footprint_tokens=2048, war_max_batch=8)
    r = route("war", requests, replicas, config=config)
    states = [W.ReplicaState(0, 1, 4), W.ReplicaState(1, 0, 4), W.ReplicaState(2, 2, 3)]  # windows: KV not pinned
    signals = [W.RequestSignals(1, 40, 3, {}, 0), W.RequestSignals(2, 5, 1, {1: 500}, None),
               W.RequestSignals(3, 10, 2, {}, 2), W.RequestSignals(4, 1, 4, {}, None)]
    expected, queued = W.place(signals, states, config.war)
    assert placed(r) == [(p.request_id, p.replica, p.reason) for p in expected]
    assert list(r.held) == queued


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_continuation_goes_to_the_replica_holding_its_kv(policy):
    replicas = [rep(0, cached={"x": 400}, tps=1000.0), rep(1, load=3, cached={"y": 400}, tps=1000.0),
                rep(2, load=1, tps=1000.0)]
    requests = [req(1, session="y", turn=3, kv=1, prompt=420), req(2, session="x", turn=1, kv=0, prompt=420)]
    r = route(policy, requests, replicas, config=SMALL)
    assert {(p.request_id, p.replica) for p in r.placements} == {(1, 1), (2, 0)}
    assert not any(p.rerouted for p in r.placements) and r.held == ()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_continuation_pinned_on_a_full_replica_is_placed_there_not_held(policy):
    # every replica at cache_aware's limit and at WAR's window (its KV pinned by paused sessions): a turn that
    # resumes a pinned session goes to its replica anyway (holding it would keep its KV pinned while the
    # replica's running turns wait for pages); the same turn without the pin, and a new session, may be held
    full = [rep(w, load=2, used=4096, pinned=4000, free=0, tps=1000.0, cached={"x": 400, "y": 400}) for w in (0, 1)]
    config = RouterConfig(concurrency_limit=2, war_footprint_tokens=2048, war_max_batch=2, misa_t=SMALL.misa_t)
    requests = [Request(1, "x", turn=2, prompt_tokens=420, kv_replica=1, kv_pinned=True),
                Request(2, "y", turn=2, prompt_tokens=420, kv_replica=0, kv_pinned=False), req(3, session="z")]
    r = route(policy, requests, full, config=config)
    assert (1, 1, "pinned") in placed(r) or (1, 1, "sticky") in placed(r)
    assert sorted([p.request_id for p in r.placements] + list(r.held)) == [1, 2, 3]
    if policy in ("cache_aware", "round_robin", "least_loaded"):  # their limit holds the others
        assert placed(r) == [(1, 1, "pinned")] and sorted(r.held) == [2, 3]
    # a pinned session whose replica died is re-routed as before, never "pinned" to a dead replica
    r = route(policy, [Request(1, "x", turn=2, prompt_tokens=420, kv_replica=5, kv_pinned=True)], full, config=config)
    assert all(p.reason != "pinned" for p in r.placements)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_session_whose_replica_died_is_rerouted_never_dropped(policy):
    replicas = [rep(0, load=1), rep(2)]  # replica 1 died
    r = route(policy, [req(1, session="x", turn=4, kv=1), req(2, session="y", turn=1, kv=0)], replicas, config=SMALL)
    moved = {p.request_id: p for p in r.placements}
    assert moved[1].replica in (0, 2) and moved[1].rerouted
    assert moved[2].replica == 0 and not moved[2].rerouted
    # no replica alive: everything held, nothing dropped
    r = route(policy, [req(1, session="x", turn=4, kv=1), req(3)], [], config=SMALL)
    assert r.placements == () and sorted(r.held) == [1, 3]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_is_placed_or_held_exactly_once(policy):
    replicas = [rep(0, load=5, cached={"s1": 90}, tps=500.0), rep(1, load=1, tps=800.0), rep(3, load=7)]
    requests = [req(i, turn=i % 3, kv=(i % 4) if i % 3 else None, cls=("agentic", "rlvr", "rlhf")[i % 3],
                    waiting=float(i), turns=float(i % 5)) for i in range(40)]
    config = RouterConfig(concurrency_limit=9, misa_t=SMALL.misa_t)
    r = route(policy, requests, replicas, config=config)
    ids = [p.request_id for p in r.placements] + list(r.held)
    assert sorted(ids) == list(range(40))
    assert all(p.replica in (0, 1, 3) for p in r.placements)


def test_misa_t_holds_new_sessions_over_its_cap_and_places_by_cost():
    # C = 600 tokens, 100-token sessions: cap 6; 4 sessions already admitted
    replicas = [rep(0, used=0, free=300, tps=1000.0, queued=2000), rep(1, used=0, free=300, tps=1000.0)]
    state = RouterState()
    r = route("misa_t", [req(i, cls="agentic") for i in range(4)], replicas, state, SMALL, now_s=0.0)
    assert len(r.placements) == 4
    r = route("misa_t", [req(10 + i, cls="rlvr") for i in range(4)], replicas, r.state, SMALL, now_s=1.0)
    assert len(r.placements) + len(r.held) == 4 and len(r.held) >= 2  # at most 2 more under the cap
    # cost: replica 0's queue (2 s) outweighs recomputing 100 tokens on replica 1 (0.1 s)
    assert all(p.replica == 1 for p in r.placements)
    # a session ends: its slot is free at the next call
    from tiderl_jax.policies.routing import SessionEnd
    before = len(r.state.misa_t.active)
    r2 = route("misa_t", [], replicas, r.state, SMALL, now_s=2.0, ended=[SessionEnd("s0", "agentic", 100)])
    assert len(r2.state.misa_t.active) == before - 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        route("fastest", [], [])
    with pytest.raises(ValueError, match="duplicate replica"):
        route("least_loaded", [], [rep(0), rep(0)])
    with pytest.raises(ValueError, match="duplicate request"):
        route("least_loaded", [req(1), req(1)], [rep(0)])
    with pytest.raises(ValueError, match="class 'chat'"):
        route("least_loaded", [req(1, cls="chat")], [rep(0)])
    with pytest.raises(ValueError, match="kv_pinned_tokens"):
        Replica(0, kv_used_tokens=1, kv_pinned_tokens=2)


def test_each_policy_says_what_its_caller_must_measure_and_which_classes_a_request_may_name():
    from tiderl_jax.policies import routing

    assert {n for n, p in POLICIES.items() if p.reads_prefix_cache} == {"cache_aware", "misa_t"}
    assert {n for n, p in POLICIES.items() if p.class_quotas} == {"misa_t"}
    r = POLICIES["least_loaded"]([req(1)], [rep(0)])  # called as the policy itself
    assert placed(r) == [(1, 0, "least-loaded")]
    two = {"agentic": 1.0, "tool": 1.0}
    tool = RouterConfig(misa_t=MISATConfig(target=two, prior_kv_tokens=two, prior_residency_s=two))
    assert routing.classes() == ("agentic", "rlvr", "rlhf") and routing.classes(tool)[-1] == "tool"
    assert placed(route("misa_t", [req(1, cls="tool")], [rep(0)], config=tool))
    with pytest.raises(ValueError, match="class 'tool' is not one of"):
        route("least_loaded", [req(1, cls="tool")], [rep(0)])
