"""MISA-T's session admission on hand-built states and a simulated stream (docs/mechanisms.md, MISA-T)."""

import random

import pytest

from tiderl_jax.policies import misa_t as M
from tiderl_jax.policies.misa_t import Active, Held, MISATConfig, MISATState, SessionEnd, admit, observe
from tiderl_jax.policies.routing import Request

# every class 100 tokens per session: C = 600 gives a global cap of 6 sessions
K = {"agentic": 100.0, "rlvr": 100.0, "rlhf": 100.0}
RES = {"agentic": 3.0, "rlvr": 2.0, "rlhf": 1.0}
CFG = MISATConfig(prior_kv_tokens=K, prior_residency_s=RES)


def new(i, cls="agentic", session=None):
    return Request(i, session if session is not None else f"s{i}", cls=cls)


def active(*classes):
    return tuple(Active(f"a{i}", b, 0.0, K[b]) for i, b in enumerate(classes))


def test_default_target_is_the_papers_mixture():
    cfg = MISATConfig()
    assert {b: round(cfg.target_share(b) * 100, 1) for b in M.CLASSES} == {"agentic": 48.6, "rlvr": 33.1, "rlhf": 18.2}
    assert M.mixture_deviation(M.PAPER_TARGET, M.PAPER_TARGET) == pytest.approx(0.0)
    # consumed all agentic: 0.5 * (|0.486 - 1| + 0.331 + 0.182) / 0.999
    assert M.mixture_deviation({"a": 0.5, "b": 0.5}, {"a": 3, "b": 1}) == pytest.approx(0.25)
    assert M.mixture_deviation(M.PAPER_TARGET, {}) == 0.0


def test_quotas_follow_time_aware_demand():
    # R = N * k * T: agentic 2 * 100 * 3 = 600, rlvr 1 * 100 * 2 = 200, rlhf (held) 1 * 100 * 1 = 100
    state = MISATState(active=active("agentic", "agentic", "rlvr"), ledger=(Held("h", "rlhf", 0),))
    assert M.demand(state, CFG) == {"agentic": 600.0, "rlvr": 200.0, "rlhf": 100.0}
    # M_b = C * R_b / 900 with C = 1800 -> 1200, 400, 200; K_b = floor(M_b / 100)
    assert M.class_quotas(1800, state, CFG) == {"agentic": 12, "rlvr": 4, "rlhf": 2}
    # a class with no demand still gets one session (max(1, .))
    assert M.class_quotas(1800, MISATState(active=active("agentic")), CFG) == {"agentic": 18, "rlvr": 1, "rlhf": 1}
    # the time factor: the same sessions with agentic residency 10x longer take a larger share
    long = MISATConfig(prior_kv_tokens=K, prior_residency_s={**RES, "agentic": 30.0})
    assert M.class_quotas(1800, state, long)["agentic"] > 12


def test_continuations_are_always_admitted():
    state = MISATState(active=active(*["rlvr"] * 6))  # cap 6 full, KV full
    adm = admit(state, [Request(1, "a0", cls="rlvr", turn=3), Request(2, "unknown", cls="agentic", turn=2),
                        new(3)], capacity_tokens=600, now_s=0.0, config=CFG)
    assert [(a.request_id, a.reason) for a in adm.admitted] == [(1, "continuation"), (2, "continuation")]
    assert adm.held == (3,)
    assert "unknown" in {a.session for a in adm.state.active}  # counted from now on


def test_the_global_cap_class_quota_and_kv_room_are_respected():
    # cap 6; quotas from demand; admit the class most under target first
    reqs = [new(i, "rlvr") for i in range(8)] + [new(10 + i, "agentic") for i in range(8)]
    adm = admit(MISATState(), reqs, capacity_tokens=600, now_s=0.0, config=CFG)
    per = {b: sum(1 for a in adm.state.active if a.cls == b) for b in M.CLASSES}
    # R: agentic 8 * 100 * 3, rlvr 8 * 100 * 2 -> K = floor(6 * 0.6) = 3, floor(6 * 0.4) = 2: the quotas bind;
    # rlhf has no session waiting, so its one slot is lent (to rlvr, the further under its target)
    assert adm.cap == 6 and adm.quotas == {"agentic": 3, "rlvr": 2, "rlhf": 1}
    assert per == {"agentic": 3, "rlvr": 3, "rlhf": 0} and len(adm.held) == 10
    assert [a.reason for a in adm.admitted].count("borrowed") == 1 and adm.admitted[-1].reason == "borrowed"
    assert adm.admitted[0].request_id == 10  # agentic first: the furthest under its 48.6% target
    # every class waiting: nothing to lend, each class stops at its quota
    reqs3 = reqs + [new(20 + i, "rlhf") for i in range(8)]
    adm = admit(MISATState(), reqs3, capacity_tokens=600, now_s=0.0, config=CFG)
    per = {b: sum(1 for a in adm.state.active if a.cls == b) for b in M.CLASSES}
    assert per == adm.quotas and "borrowed" not in {a.reason for a in adm.admitted}
    adm = admit(MISATState(cap_scale=0.5), reqs, capacity_tokens=600, now_s=0.0, config=CFG)
    assert adm.cap == 3 and len(adm.admitted) == 3  # the global cap binds
    # agentic's residency dwarfs rlvr's, so rlvr's quota is max(1, 0) = 1, taken; agentic has no session waiting,
    # so its idle quota is lent and the rlvr session runs (borrowed) instead of waiting beside idle KV
    slow = MISATConfig(prior_kv_tokens=K, prior_residency_s={**RES, "agentic": 1000.0})
    adm = admit(MISATState(active=active("agentic", "agentic", "rlvr")), [new(1, "rlvr")], capacity_tokens=10_000,
                now_s=0.0, config=slow)
    assert adm.cap == 100 and adm.quotas["rlvr"] == 1
    assert [(a.request_id, a.reason) for a in adm.admitted] == [(1, "borrowed")] and adm.held == ()
    # KV room: protected KV of the admitted sessions + k_b must fit C
    big = MISATConfig(prior_kv_tokens={**K, "rlvr": 450.0}, prior_residency_s=RES)
    adm = admit(MISATState(active=active("agentic", "agentic"), session_tokens=100.0), [new(1, "rlvr"), new(2, "rlhf")],
                capacity_tokens=600, now_s=0.0, config=big)
    assert [a.request_id for a in adm.admitted] == [2] and adm.held == (1,)  # 200 + 450 > 600; 200 + 100 fits


def test_the_ledger_is_rechecked_each_epoch():
    state = MISATState(active=active(*["agentic"] * 6))
    adm = admit(state, [new(1, "rlhf")], capacity_tokens=600, now_s=0.0, config=CFG)
    assert adm.held == (1,) and adm.state.ledger == (Held("s1", "rlhf", 0),)
    # still full next epoch: held again, first-held epoch kept
    adm = admit(adm.state, [new(1, "rlhf")], capacity_tokens=600, now_s=1.0, config=CFG)
    assert adm.held == (1,) and adm.state.ledger == (Held("s1", "rlhf", 0),) and adm.state.epoch == 2
    # a session ends: the held one gets its slot
    state = observe(adm.state, [SessionEnd("a0", "agentic", 100)], now_s=2.0, config=CFG)
    assert len(state.active) == 5 and state.class_stats("agentic").completed == 1
    adm = admit(state, [new(1, "rlhf")], capacity_tokens=600, now_s=2.0, config=CFG)
    assert [a.request_id for a in adm.admitted] == [1] and adm.state.ledger == ()
    # a held session the caller does not offer again leaves the ledger
    adm = admit(MISATState(active=active(*["agentic"] * 6)), [new(1)], capacity_tokens=600, now_s=0.0, config=CFG)
    assert admit(adm.state, [], capacity_tokens=600, now_s=1.0, config=CFG).state.ledger == ()


def test_completed_sessions_update_k_t_and_the_session_length():
    state = MISATState(active=(Active("x", "agentic", 10.0, 100.0),))
    state = observe(state, [SessionEnd("x", "agentic", 300)], now_s=40.0, config=CFG)  # residency 30 s, gaps incl.
    k, t = M.class_estimates(state, CFG)
    assert (k["agentic"], t["agentic"], state.session_tokens) == (300.0, 30.0, 300.0)
    state = observe(state, [SessionEnd("y", "agentic", 100, residency_s=10.0)], now_s=50.0, config=CFG)
    k, t = M.class_estimates(state, CFG)
    assert k["agentic"] == pytest.approx(0.8 * 300 + 0.2 * 100) and t["agentic"] == pytest.approx(0.8 * 30 + 0.2 * 10)
    assert M.global_cap(600, state, CFG) == 2  # floor(600 / 260)


def test_the_cap_shrinks_with_a_falling_hit_rate_and_recovers():
    state, caps = MISATState(), []
    for h in (95, 95, 60, 40, 40, 40):
        state = observe(state, now_s=0.0, hit_tokens=h, prefill_tokens=100, config=CFG)
        caps.append(M.global_cap(6000, state, CFG))
    assert caps[:2] == [60, 60]  # healthy: the base C / L
    assert caps[2] < caps[1] and caps[3] < caps[2] and caps[5] < caps[4]  # pressure grows, cap falls
    assert caps[5] >= int(60 * CFG.min_cap_scale)
    for _ in range(40):
        state = observe(state, now_s=0.0, hit_tokens=98, prefill_tokens=100, config=CFG)
    assert M.global_cap(6000, state, CFG) == 60  # back to the base
    # an epoch without prefill leaves the signal alone
    assert observe(state, now_s=0.0, config=CFG) == state
    # a workload that never reaches the configured 0.9 (new prompts every session) is not throttled for it: the
    # reference is the best rate it has shown; a fall from there is pressure
    state, caps = MISATState(), []
    for h in (60, 60, 60, 60, 30, 30):
        state = observe(state, now_s=0.0, hit_tokens=h, prefill_tokens=100, config=CFG)
        caps.append(M.global_cap(6000, state, CFG))
    assert caps[:4] == [60] * 4 and caps[4] < 60 and caps[5] < caps[4]
    assert state.best_hit_rate == pytest.approx(0.6)


def test_no_starvation_beyond_the_bound():
    """A held rlhf session (its class far over target) while agentic (under it) keeps arriving: admitted
    by e + H + n."""
    cfg = MISATConfig(prior_kv_tokens=K, prior_residency_s=RES, max_hold_epochs=3)
    # C = 6000 tokens (quotas far from binding), the cap shrunk to 6 sessions: full
    state = MISATState(active=active(*["rlhf"] * 6), cap_scale=0.1)
    held_rlhf = new(0, "rlhf", session="victim")
    pending, rid, admitted_at, order_ahead = [held_rlhf], 1, None, 0
    for e in range(20):
        # one agentic session ends per epoch (room for one), two new agentic sessions arrive
        oldest = next(a for a in state.active)
        state = observe(state, [SessionEnd(oldest.session, oldest.cls, 100)], now_s=float(e), config=cfg)
        pending += [new(rid, "agentic"), new(rid + 1, "agentic")]
        rid += 2
        adm = admit(state, pending, capacity_tokens=6000, now_s=float(e), config=cfg)
        state = adm.state
        ok = {a.request_id for a in adm.admitted}
        if 0 in ok:
            admitted_at = e
            assert dict((a.request_id, a.reason) for a in adm.admitted)[0] == "overdue"
            break
        pending = [r for r in pending if r.request_id not in ok]
    assert admitted_at is not None and admitted_at <= 0 + cfg.max_hold_epochs + order_ahead
    # without the bound the mixture preference holds it until agentic is over its own target (epoch 11)
    never = MISATConfig(prior_kv_tokens=K, prior_residency_s=RES, max_hold_epochs=10**6)
    state, pending, rid = MISATState(active=active(*["rlhf"] * 6), cap_scale=0.1), [held_rlhf], 1
    for e in range(9):
        oldest = next(a for a in state.active)
        state = observe(state, [SessionEnd(oldest.session, oldest.cls, 100)], now_s=float(e), config=never)
        pending += [new(rid, "agentic"), new(rid + 1, "agentic")]
        rid += 2
        adm = admit(state, pending, capacity_tokens=6000, now_s=float(e), config=never)
        state = adm.state
        assert 0 in adm.held
        pending = [r for r in pending if r.request_id not in {a.request_id for a in adm.admitted}]


def test_older_overdue_sessions_go_first_and_nobody_overtakes_them():
    cfg = MISATConfig(prior_kv_tokens=K, prior_residency_s=RES, max_hold_epochs=2)
    ledger = (Held("old", "rlvr", 0), Held("mid", "rlhf", 1), Held("young", "agentic", 5))
    state = MISATState(epoch=5, active=active(*["agentic"] * 5), ledger=ledger)  # room for one
    reqs = [new(3, "agentic", session="young"), new(2, "rlhf", session="mid"), new(1, "rlvr", session="old")]
    adm = admit(state, reqs, capacity_tokens=600, now_s=0.0, config=cfg)
    assert [(a.request_id, a.reason) for a in adm.admitted] == [(1, "overdue")]
    assert sorted(adm.held) == [2, 3]  # "mid" (overdue) waits for the next slot; "young" behind it


def simulate(policy, *, seed, epochs=120, p_group=0.6, group=4, batch=12):
    """GRPO groups of `group` sessions of one class arrive (classes drawn at the target mixture); each
    class runs a fixed residency; a trainer batch is every `batch` sessions completed. Returns (mean batch
    mixture deviation, longest wait in epochs). `fifo` admits in arrival order under the same global cap."""
    rng = random.Random(seed)
    state, pending, running, consumed, waits, rid = MISATState(), [], {}, [], [], 0
    for e in range(epochs):
        done = [s for s, (b, t0) in running.items() if e - t0 >= RES[b]]
        ends = [SessionEnd(s, running[s][0], 100) for s in done]
        consumed += [running.pop(s)[0] for s in done]
        if rng.random() < p_group:
            b = rng.choices(list(M.PAPER_TARGET), weights=list(M.PAPER_TARGET.values()))[0]
            pending += [(new(rid + i, b), e) for i in range(group)]
            rid += group
        state = observe(state, ends, now_s=float(e), config=CFG)
        if policy == "misa_t":
            adm = admit(state, [r for r, _ in pending], capacity_tokens=600, now_s=float(e), config=CFG)
            state, ok = adm.state, {a.request_id for a in adm.admitted}
        else:
            room = M.global_cap(600, state, CFG) - len(running)
            ok = {r.request_id for r, _ in pending[:max(0, room)]}
        for r, t in pending:
            if r.request_id in ok:
                running[r.session] = (r.cls, e)
                waits.append(e - t)
        pending = [(r, t) for r, t in pending if r.request_id not in ok]
    batches = [consumed[i:i + batch] for i in range(0, len(consumed) - batch + 1, batch)]
    devs = [M.mixture_deviation(M.PAPER_TARGET, {b: x.count(b) for b in M.CLASSES}) for x in batches]
    return sum(devs) / len(devs), max(waits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixture_deviation_is_lower_than_fifo_admission(seed):
    misa, misa_wait = simulate("misa_t", seed=seed)
    fifo, _ = simulate("fifo", seed=seed)
    assert misa < fifo
    assert misa_wait <= CFG.max_hold_epochs + 8  # bounded waits (groups of 4 ahead, at most 2 groups overdue)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="class 'chat'"):
        admit(MISATState(), [new(1, "chat")], capacity_tokens=600, now_s=0.0, config=CFG)
    with pytest.raises(ValueError, match="two new-session requests"):
        admit(MISATState(), [new(1, session="x"), new(2, session="x")], capacity_tokens=600, now_s=0.0, config=CFG)
    with pytest.raises(ValueError, match="hit_tokens"):
        observe(MISATState(), now_s=0.0, hit_tokens=5, prefill_tokens=2)
    with pytest.raises(ValueError, match="prior_kv_tokens lacks"):
        MISATConfig(prior_kv_tokens={"agentic": 1.0})
