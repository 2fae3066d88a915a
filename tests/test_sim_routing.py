"""The simulator's replicas behind the router policies (SimConfig.router, sim/router.py): every policy runs a
mixed workload to completion with every task accounted for; the default router gives today's results; the
compiled core and its Python source agree with a policy on; held requests are placed later; continuations
stay on their KV replica under least_loaded at light load; the mixed workload's classes; the study's rows."""

import dataclasses

import numpy as np
import pytest

import tiderl_jax.sim as sim_py
from tiderl_jax.policies import routing
from tiderl_jax.runtime.controller import ControllerConfig
from tiderl_jax.sim import backend as sim_backend
from tiderl_jax.sim import routing_study, workloads
from tiderl_jax.sim.backend import SimConfig


def _controller(mode, **kw):
    split = dict(rollout_groups=2, ref_groups=1, train_groups=1) if mode == "tiderl" else \
        dict(rollout_groups=2, ref_groups=0, train_groups=2)
    return ControllerConfig(**{**dict(mode=mode, steps=3, groups_per_step=4, group_size=4, max_concurrent=32,
                                      device_group_size=2, tensor=1, **split), **kw})


def _accounted(row):
    assert row["sessions_done"] == row["sessions_offered"] and row["left_offered"] == 0, row
    r = row["router"]
    assert r["placed"] == r["offered"] and r["ended"] == row["sessions_offered"], r


@pytest.mark.parametrize("policy", sorted(routing.POLICIES))
def test_every_policy_runs_a_mixed_workload_to_completion(policy):
    row = routing_study.simulate(policy, load=16, sessions=24)
    _accounted(row)
    assert set(row["classes"]) == {"agentic", "rlvr", "rlhf"} and all(row["classes"].values()), row["classes"]
    assert row["router"]["placed"] > row["sessions_offered"]  # continuations went through the router too
    assert row["samples_per_s"] > 0 and 0 < row["kv_hit_rate"] <= 1 and row["p95_latency_s"] > 0


# today's numbers (the commit before SimConfig.router), for the default "sticky" router: unchanged
_TODAY = {
    ("tiderl", "tiderl-text-7b"): (82.39590271830205, 944.6586229670714, dict(
        prompt_tokens=841203, prompt_tokens_cached=726531, prefill_tokens=114672, decode_tokens=91868, events=1382,
        ctb_evictions=0, cache_evictions=0, moved_tasks=0, replicas=4, kv_pages_per_replica=61873)),
    ("async", "webshop-7b"): (105.27903493169741, 286.86623143528726, dict(
        prompt_tokens=1465551, prompt_tokens_cached=1165952, prefill_tokens=299599, decode_tokens=39971, events=1078,
        ctb_evictions=0, cache_evictions=0, moved_tasks=0, replicas=4, kv_pages_per_replica=61873)),
}


@pytest.mark.parametrize("mode,workload", sorted(_TODAY))
def test_the_default_router_gives_todays_results(tmp_path, mode, workload):
    assert SimConfig().router == "sticky"
    summary, _, backend = sim_backend.run(SimConfig(workload=workload), _controller(mode), num_devices=8,
                                          logdir=str(tmp_path))
    wall, goodput, sim = _TODAY[(mode, workload)]
    assert backend.router is None and "router" not in summary["sim"]
    assert (summary["wall_s"], summary["goodput_tokens_per_s"]) == (wall, goodput)
    assert {k: v for k, v in summary["sim"].items() if k != "kv_hit_rate"} == sim


def test_the_compiled_core_and_its_python_source_agree_with_a_router():
    assert sim_py.compiled_core() is not None, "no current compiled simulator core: run `make .venv/.sim_core`"
    for policy in ("misa_t", "cache_aware"):
        config = dataclasses.replace(routing_study.study_router_config(), concurrency_limit=3)
        compiled = routing_study.simulate(policy, load=16, sessions=16, router_config=config)
        python = routing_study.simulate(policy, load=16, sessions=16, router_config=config,
                                        backend_module=sim_py.python_reference())
        assert compiled == python, policy
        _accounted(compiled)


def test_the_controller_runs_through_a_router_with_moves_compiled_as_python(tmp_path):
    # the real controller (CTB, ERS moves) on the simulator with every placement through WAR's router
    sim = SimConfig(workload="webshop-7b", router="war")
    kw = dict(steps=4, ers_patience=1, ers_cooldown=0)
    (a, _, ba), (b, _, _) = [module.run(sim, _controller("tiderl", **kw), num_devices=8, logdir=str(tmp_path / name))
                             for name, module in (("compiled", sim_backend), ("python", sim_py.python_reference()))]
    for key in ("wall_s", "goodput_tokens_per_s", "kv_hit_rate", "sim", "moves"):
        assert a[key] == b[key], key
    r = a["sim"]["router"]
    assert a["moves"] >= 1 and r["moved"] >= 0
    assert r["placed"] + len(ba.router.offered) == r["offered"] and r["ended"] >= 4 * 4 * 4


def test_held_requests_are_placed_later_never_dropped():
    # one request per replica at most (cache_aware's FIXED limit): with 16 sessions offered on 4 replicas the
    # router holds most of them at every call, and each is placed once a turn ends somewhere
    config = dataclasses.replace(routing_study.study_router_config(), concurrency_limit=1)
    row = routing_study.simulate("cache_aware", load=16, sessions=20, router_config=config)
    assert row["router"]["held"] > row["sessions_offered"]
    _accounted(row)


def test_a_continuation_stays_on_its_kv_replica_under_least_loaded_at_light_load():
    row = routing_study.simulate("least_loaded", load=4, sessions=8)
    _accounted(row)
    assert row["router"]["placed"] > 2 * row["sessions_offered"]  # many continuations
    assert row["router"]["moved"] == 0 and row["router"]["held"] == 0
    assert row["kv_hit_rate"] > 0.9  # each resumed turn finds its context cached where it ran


def test_a_mixed_workload_draws_one_class_per_group_at_the_target_mixture():
    mix = workloads.MISA_T_MIX
    assert [(c, s) for c, s, _ in mix.parts] == [("agentic", 48.6), ("rlvr", 33.1), ("rlhf", 18.2)]
    rng = np.random.default_rng(0)
    groups = [sim_backend.sample_tasks(mix, rng, 4) for _ in range(600)]
    assert all(len({t.cls for t in g}) == 1 for g in groups)
    share = {c: sum(g[0].cls == c for g in groups) / len(groups) for c in ("agentic", "rlvr", "rlhf")}
    assert share == pytest.approx({"agentic": 0.486, "rlvr": 0.331, "rlhf": 0.182}, abs=0.05)
    assert all(len(t.gen_tokens) == 1 for g in groups for t in g if t.cls != "agentic")
    assert workloads.workload("bidirl-math").task_class == "rlvr"
    with pytest.raises(ValueError, match="router"):
        SimConfig(router="nearest")


def test_the_study_returns_a_row_per_policy_and_load_with_the_best_cache_aware_limit():
    rows = routing_study.compare(("cache_aware", "least_loaded"), (4, 8), sessions=8, cache_aware_limits=(1, None))
    assert [(r["policy"], r["load"]) for r in rows] == [("cache_aware", 4), ("least_loaded", 4),
                                                        ("cache_aware", 8), ("least_loaded", 8)]
    for r in rows:
        assert {"policy", "load", "samples_per_s", "kv_hit_rate", "mixture_deviation", "p95_latency_s"} <= set(r)
        assert 0 <= r["mixture_deviation"] <= 1
    assert all(r["cache_aware_limit"] in (1, None) for r in rows if r["policy"] == "cache_aware")
    head = routing_study.headline(rows)
    assert head["load"] == 8 and "misa_t_over_cache_aware" not in head
