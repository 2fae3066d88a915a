"""The real controller on the simulated backend: every mode finishes on a small simulated cluster in
well under a second of wall time, virtual time advances, sync takes turns, staleness stays bounded,
CTB keeps more KV than request-level rollout, runs are deterministic, and ERS moves device groups."""

import json
import sys
import time

import numpy as np
import pytest

import tiderl_jax.sim as sim_py
from tiderl_jax.runtime.controller import ControllerConfig
from tiderl_jax.sim import backend as sim_backend
from tiderl_jax.sim import costs, workloads
from tiderl_jax.sim.backend import SimConfig

DEVICES = 8


def _config(mode, **kw):
    split = dict(rollout_groups=2, ref_groups=1, train_groups=1) if mode == "tiderl" else \
        dict(rollout_groups=2, ref_groups=0, train_groups=2)
    base = dict(mode=mode, steps=3, groups_per_step=4, group_size=4, max_concurrent=32, device_group_size=2,
                tensor=1, **split)
    return ControllerConfig(**{**base, **kw})


def _run(tmp_path, mode, sim=SimConfig(), name=None, module=sim_backend, **kw):
    return module.run(sim, _config(mode, **kw), num_devices=DEVICES, logdir=str(tmp_path / (name or mode)))


@pytest.mark.parametrize("mode", ["sync", "async", "tiderl"])
def test_each_mode_finishes_fast_in_virtual_time(tmp_path, mode):
    t0 = time.perf_counter()
    summary, controller, backend = _run(tmp_path, mode)
    assert time.perf_counter() - t0 < 5.0
    assert summary["steps"] == 3 and controller.version == 3 and summary["syncs_failed"] == 0
    assert summary["wall_s"] > 10.0  # virtual seconds: a 7B model, multi-turn tasks
    assert summary["goodput_tokens_per_s"] > 0 and summary["sim"]["decode_tokens"] > 0
    assert all(r.version == 3 for r in backend.replicas.values())
    assert 0.0 < summary["kv_hit_rate"] < 1.0


def test_sync_takes_turns(tmp_path):
    _, controller, _ = _run(tmp_path, "sync")
    spans = controller.metrics.spans
    gen = [(a, b) for lane, kind, a, b in spans if kind == "generate"]
    train = [(a, b) for lane, kind, a, b in spans if kind == "train"]
    assert gen and train
    for a, b in train:
        assert not any(ga < b - 1e-9 and gb > a + 1e-9 for ga, gb in gen), "generation overlapped training"


@pytest.mark.parametrize("mode,eta", [("async", 1), ("tiderl", 2)])
def test_staleness_bound(tmp_path, mode, eta):
    summary, _, _ = _run(tmp_path, mode, eta=eta, steps=4)
    assert summary["staleness"] and max(summary["staleness"]) <= eta


def test_ctb_keeps_kv_across_tool_calls_under_a_budget(tmp_path):
    # a small KV pool per replica: request-level prefix cache gets evicted, CTB pins its tasks' KV
    sim = SimConfig(kv_pages=600)
    ctb_summary, _, ctb_backend = _run(tmp_path, "tiderl", sim, name="ctb", ers_patience=99)
    req_summary, _, req_backend = _run(tmp_path, "async", sim, name="request")
    assert ctb_summary["kv_hit_rate"] > req_summary["kv_hit_rate"]
    assert ctb_backend.kv_mode == "ctb" and req_backend.kv_mode == "request"
    assert req_summary["sim"]["cache_evictions"] > 0 and ctb_summary["sim"]["ctb_evictions"] > 0


def test_deterministic_for_a_seed(tmp_path):
    a, _, _ = _run(tmp_path, "tiderl", name="a")
    b, _, _ = _run(tmp_path, "tiderl", name="b")
    c, _, _ = _run(tmp_path, "tiderl", SimConfig(seed=1), name="c")
    keys = ("wall_s", "goodput_tokens_per_s", "kv_hit_rate", "staleness")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["wall_s"] != c["wall_s"]


def test_ers_moves_a_group(tmp_path):
    # the trainer holds two groups and waits for the rollout's one: a generation deficit
    summary, controller, backend = _run(tmp_path, "tiderl", steps=6, ers_economics=False, ers_patience=1,
                                        ers_cooldown=0, rollout_groups=1, train_groups=2)
    assert summary["moves"] >= 2 and controller.moves
    # the ref group goes first (colocated from then on), then a train group
    assert [(m["frm"], m["to"]) for m in controller.moves[:2]] == [("ref", "rollout"), ("train", "rollout")]
    groups = {"rollout": 1, "ref": 1, "train": 2}
    for m in controller.moves:
        groups[m["frm"]] -= 1
        groups[m["to"]] += 1
        assert m["seconds"] > 0
    assert {r: backend.pool.num_groups(r) for r in groups} == groups
    assert not backend.has_ref_devices
    assert len(backend.replicas) == len(backend.pool.devices_of("rollout"))  # tp = 1
    assert summary["steps"] == 6
    # the batches the rollout delivered in the last step, for the economics: what reached the ready buffer
    e = controller.ers_economics
    assert e.produced_batches > 0 and e.produced_batches * controller.cfg.batch_samples == int(
        e.produced_batches * controller.cfg.batch_samples)


def test_sample_tasks_follows_sample_task_rule():
    w = workloads.workload("tiderl-text-7b")
    shapes = sim_backend.sample_tasks(w, np.random.default_rng(0), 400)
    for s in shapes:
        assert 1 <= len(s.gen_tokens) <= w.max_turns and len(s.obs_tokens) == len(s.env_latency_s)
        assert len(s.obs_tokens) in (len(s.gen_tokens), len(s.gen_tokens) - 1)
        assert s.context_tokens <= w.max_context
    one = [workloads.sample_task(w, np.random.default_rng(i)) for i in range(400)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([len(s.gen_tokens) for s in shapes]) == pytest.approx(mean([len(s.gen_tokens) for s in one]), rel=0.2)


def test_sample_tasks_truncates_at_max_context_like_sample_task():
    # a short context: about half the tasks reach it (the per-turn rule), the rest take the whole-task check
    import dataclasses
    w = dataclasses.replace(workloads.workload("tiderl-text-7b"), max_context=3000)
    shapes = sim_backend.sample_tasks(w, np.random.default_rng(1), 400)
    cut = [s for s in shapes if s.truncated]
    assert 50 < len(cut) < 350
    for s in shapes:
        assert len(s.obs_tokens) == len(s.env_latency_s) == len(s.gen_tokens) - 1
        assert s.context_tokens <= w.max_context and min(s.gen_tokens) >= 1
        if not s.truncated:
            assert s.context_tokens < w.max_context


def test_decode_step_matches_costs():
    b = sim_backend.SimBackend(SimConfig(tp=2), mode="async", pool=None, num_devices=4)
    expect = costs.decode_step_time(b.shape, b.hw, 12, 30000, devices=2)
    assert b._decode_step(12, 30000) == pytest.approx(expect, rel=1e-12)
    b.loop.close()


def test_decode_load_reads_the_batch_against_what_a_replica_could_run(tmp_path):
    # decode throughput at the run's mean batch over the throughput at the largest batch the KV holds at the
    # mean context, both from the roofline (costs.decode_step_time)
    summary, _, b = _run(tmp_path, "async")
    load = b.decode_load()
    batch, context = b._decode_tokens / b._load_steps, b._prompt_tokens / b._admissions
    assert load["decode_batch"] == pytest.approx(batch) and 1 <= batch <= b.cfg.max_batch
    limit = min(b.cfg.max_batch, b.capacity * b.ps / context)
    assert load["decode_batch_limit"] == pytest.approx(limit)

    def rate(n):
        return n / costs.decode_step_time(b.shape, b.hw, n, n * context, devices=b.cfg.tp)
    assert load["decode_capacity_used"] == pytest.approx(rate(batch) / rate(limit), rel=1e-9)
    assert 0 < load["decode_capacity_used"] < 1 and 0 < load["prefill_share"] < 1
    assert summary["decode_load"] == load
    assert 0 < summary["admission_held_s"] <= summary["wall_s"]


def _measured(**kw):
    base = dict(decode_step_s=0.02, decode_per_seq_s=0.0001, prefill_fixed_s=0.02, prefill_per_token_s=1e-5,
                score_fixed_s=0.0, score_per_token_s=1e-4, update_fixed_s=0.0, update_per_token_s=4e-4,
                ref_per_token_s=1e-4, sync_s=0.05, switch_s=1.0)
    return costs.MeasuredCosts(**{**base, **kw})


@pytest.mark.parametrize("mode", ["sync", "async", "tiderl"])
def test_measured_costs_one_replica_per_rollout_mesh(tmp_path, mode):
    # the validation's setting: per-op times measured on a host, one engine on all rollout devices
    sim = SimConfig(tp=0, kv_pages=4096, max_batch=64, decode_chunk=8, measured=_measured())
    summary, controller, backend = _run(tmp_path, mode, sim)
    assert summary["steps"] == 3 and summary["goodput_tokens_per_s"] > 0
    assert len(backend.replicas) == 1
    assert backend._replica_devices == len(backend._devices("rollout"))
    with pytest.raises(ValueError):
        SimConfig(tp=0)  # the roofline needs a replica size


def test_shared_cores_slow_overlapping_work(tmp_path):
    # processor sharing with the rollout makes async steps longer, never shorter
    free, _, _ = _run(tmp_path, "async", SimConfig(tp=0, kv_pages=4096, measured=_measured()), name="free")
    shared, _, backend = _run(tmp_path, "async", SimConfig(
        tp=0, kv_pages=4096, measured=_measured(rollout_overlap_x=20.0, train_overlap_x=1.5)), name="shared")
    assert shared["wall_s"] > free["wall_s"]
    assert backend._host_jobs == 0
    with pytest.raises(ValueError):
        _measured(rollout_overlap_x=0.5)


BORROW = dict(bidirl=True, rollout_groups=1, ref_groups=0, train_groups=3)  # the rollout borrows train devices


CORE_CASES = [  # configurations that reach every branch of the replica event core
    ("tiderl", SimConfig(), {}), ("async", SimConfig(), {}), ("sync", SimConfig(), {}),
    ("tiderl", SimConfig(kv_pages=600), {}),  # KV-bound: blocked admissions, CTB evictions
    ("async", SimConfig(kv_pages=600, decode_chunk=4), {}),
    ("tiderl", SimConfig(tp=0, kv_pages=4096, measured=_measured(rollout_overlap_x=3.0, train_overlap_x=1.5)), {}),
    ("async", SimConfig(switch_fixed_s=0.0), dict(BORROW, steps=5)),
    # the real engine's rules (sim_validation's): 1-step calls, chunked prefill under a budget, program loads
    ("tiderl", SimConfig(tp=0, kv_pages=4096, max_batch=64, decode_chunk=8, engine_steps=True, prefill_chunk=256,
                         prefill_budget=512, max_seq_len=8192, shared_prefix_tokens=32,
                         measured=_measured(rollout_overlap_x=3.0, program_s=0.3, call_overhead_s=0.01)), {}),
    ("sync", SimConfig(workload="bidirl-math", war_speculation=True), {})]


def _core_kw(mode, kw):
    return {**(dict(steps=4, ers_patience=1, ers_cooldown=0) if mode == "tiderl" else dict(steps=4)), **kw}


@pytest.mark.parametrize("mode,sim,kw", CORE_CASES)
def test_event_spans_time_every_event_as_its_own_heap_entry(tmp_path, monkeypatch, mode, sim, kw):
    # reference: a span of one event (its own heap entry and boundary, the event core before spans);
    # spans of many events between boundaries where a batch can change must give the same run, to the bit
    # (on the uncompiled module: a compiled class cannot be patched)
    python = sim_py.python_reference()
    kw = _core_kw(mode, kw)
    fast, _, _ = _run(tmp_path, mode, sim, name="spans", module=python, **kw)
    walk = python.SimBackend._walk
    monkeypatch.setattr(python.SimBackend, "_walk", lambda self, r, until: walk(self, r, -np.inf))
    ref, _, _ = _run(tmp_path, mode, sim, name="events", module=python, **kw)
    for key in ("wall_s", "goodput_tokens_per_s", "kv_hit_rate", "staleness", "step_time_s", "sim", "moves"):
        assert fast[key] == ref[key], key
    for key in ("rollout_wait_s", "trainer_wait_s"):  # busy seconds summed per span instead of per event
        assert fast[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-9), key


def test_war_speculation_follows_the_rule_and_speeds_up_small_batches(tmp_path):
    from tiderl_jax.policies import war
    backend = sim_backend.SimBackend(SimConfig(war_speculation=True), mode="sync", pool=None, num_devices=8)
    ctx = 4096.0
    t1 = backend._decode_step(1, ctx)
    # batch 1 is memory-bound: verifying 4 drafts + 1 reads the weights and the context once, like a
    # decode step, and emits the measured acceptance's tokens (SimConfig.spec_accepted_tokens, about 2)
    flops = 2.0 * backend.shape.matmul_params * 5 + costs.attention_flops(backend.shape, 1.0) * ctx * 5
    moved = backend.shape.param_bytes + costs.kv_bytes_per_token(backend.shape) * (ctx + 5)
    t_spec = max(flops / backend._flops_rate, moved / backend._bytes_rate)
    accepted = SimConfig().spec_accepted_tokens
    assert backend._spec_step(1, ctx, t1) == pytest.approx(war.use_speculation(1, t_spec, accepted, t1).spec_s_per_token)
    assert backend._spec_step(1, ctx, t1) < 0.6 * t1
    # above WAR's batch bound the switch stays off
    t32 = backend._decode_step(32, ctx * 32)
    assert backend._spec_step(32, ctx * 32, t32) == t32
    # a long-tailed synchronous workload: its tail runs at small batches, and the run gets faster
    off, _, _ = _run(tmp_path, "sync", SimConfig(workload="bidirl-math"), name="off")
    on, _, _ = _run(tmp_path, "sync", SimConfig(workload="bidirl-math", war_speculation=True), name="on")
    assert on["goodput_tokens_per_s"] > 1.1 * off["goodput_tokens_per_s"]
    assert on["sim"]["decode_tokens"] == off["sim"]["decode_tokens"]  # the same tokens, sooner


def test_measured_speculation_is_rl_sampled_acceptance_and_names_its_run():
    # the simulated rollouts are RL's, sampled at temperature 1 (`rollout.temperature`'s default): the acceptance the
    # simulator reads is the sampled one (benchmarks/speculative.py decodes greedily by default), and the file names
    # the command that wrote it and its date
    import shlex

    from tiderl_jax.sim.config import MEASURED_SPECULATION as m
    assert m["acceptance"] == "sampled" and m["temperature"] == 1.0
    cmd = shlex.split(m["command"])
    assert cmd[:2] == ["python", "benchmarks/speculative.py"] and "--record" in cmd
    assert float(cmd[cmd.index("--temperature") + 1]) == m["temperature"]
    assert time.strptime(m["date"], "%Y-%m-%d")
    assert m["by_batch"] and all(int(b) <= 16 for b in m["by_batch"])
    assert m["accepted_tokens"] == pytest.approx(sum(m["by_batch"].values()) / len(m["by_batch"]), abs=1e-3)
    sim = SimConfig()
    assert (sim.spec_accepted_tokens, sim.spec_draft_tokens) == (m["accepted_tokens"], m["draft_tokens"])


def test_sync_counts_replicas_idle_in_a_batch_tail_as_rollout_waiting(tmp_path):
    summary, controller, _ = _run(tmp_path, "sync")
    m = controller.metrics
    assert m.idle_in_spans["rollout"] > 0  # replicas done with their share while others still generate
    spans_only = m.waiting()["rollout"] - m.idle_in_spans["rollout"]
    assert summary["rollout_wait_s"] == pytest.approx(spans_only + m.idle_in_spans["rollout"])
    # each device once: waiting never exceeds the devices held over the run
    assert summary["rollout_wait_s"] + summary["trainer_wait_s"] <= DEVICES * summary["wall_s"] + 1e-6


def test_ctb_admission_never_evicts_the_admitted_tasks_own_kv(tmp_path):
    backend = sim_backend.SimBackend(SimConfig(kv_pages=100), mode="tiderl", pool=None, num_devices=8)
    r = sim_backend._Replica(0, (0,), 100)
    shape = workloads.TaskSample(64, (16, 16), (16,), (1.0,), False)
    head, other = (sim_backend._Seq(0, i, shape, None) for i in range(2))
    for s in (head, other):  # both wait for their tool with 40 pages of KV pinned
        s.pinned, s.kv_pages = True, 40
        r.pinned[s] = None
    r.used = 80
    backend._evict_pinned(r, 60, keep=head)  # 20 free, 60 wanted: only `other` can go
    assert head.pinned and head.kv_pages == 40 and not other.pinned and other in r.cache


def test_a_broken_rollout_side_stops_the_run_with_its_error(tmp_path, monkeypatch):
    # every sample raises at once: the producer must not admit (and fail) groups forever
    async def broken(self, task, group, samples, expected_group_size):
        raise RuntimeError("no rollout replica")
    python = sim_py.python_reference()  # (a compiled class cannot be patched)
    monkeypatch.setattr(python.SimBackend, "generate_group", broken)
    with pytest.raises(RuntimeError, match="rollout producer failed") as e:
        _run(tmp_path, "async", module=python)
    assert "every sample of the last 8 groups failed (last: RuntimeError: no rollout replica)" in str(e.value.__cause__)


def test_rollout_scaling_reads_the_replicas_load(tmp_path):
    # the default load: a few tasks per replica, most of them waiting on their environment; decoding
    # is memory-bound at small batches, so a replica more barely speeds anything up
    _, _, light = _run(tmp_path, "async", name="light")
    light_scaling = light.rollout_scaling()
    assert light_scaling is not None and 0.0 <= light_scaling < 0.2
    assert light.rollout_scaling() is None  # nothing ran since: no load to read
    # one running sequence per replica: tasks queue behind the full replicas, which more would serve
    _, _, full = _run(tmp_path, "async", SimConfig(max_batch=1), name="full")
    assert full.rollout_scaling() > 0.4 > light_scaling


def test_ers_gives_the_ref_group_to_the_trainer_when_the_rollout_does_not_scale(tmp_path):
    # the text preset's default load is latency-bound: the trainer idles while the staleness bound holds
    # admission, and a rollout group more would decode about as slowly; with its economics, ERS's
    # generation deficit moves the ref group to train (not to rollout, the paper's direction)
    summary, controller, backend = _run(tmp_path, "tiderl", steps=6, ers_patience=1, ers_cooldown=0)
    assert controller.moves and (controller.moves[0]["frm"], controller.moves[0]["to"]) == ("ref", "train")
    assert controller.moves[0]["predicted_gain_s"] > controller.moves[0]["predicted_cost_s"]
    assert backend.pool.num_groups("train") >= 2
    # what it weighed: production held by the staleness bound for part of the step, a rollout that
    # barely scales; both in the step log
    e = controller.ers_economics
    assert 0.0 < e.train_coupling <= 0.5 and e.rollout_scaling is not None and e.rollout_scaling < 0.5
    rows = [json.loads(line) for line in open(tmp_path / "tiderl" / "metrics.jsonl")]
    assert all("ers_train_coupling" in r and "ers_rollout_scaling" in r for r in rows)


def test_the_compiled_event_core_is_built_and_in_use():
    # setup.py compiles the event core, sim/kv.py and sim/replicas.py (with a C compiler, as `make` installs
    # it); an extension older than its sources is not used (tiderl_jax.sim.compiled_core). sim/backend.py's
    # SimBackend, plain Python, extends the compiled ReplicaCore
    from tiderl_jax.sim import kv, replicas
    assert sim_py.compiled_core() is not None, "no current compiled simulator core: run `pip install -e .`"
    assert replicas.__file__ == sim_py.compiled_core() and not kv.__file__.endswith(".py")
    assert sim_backend.__file__.endswith("backend.py") and issubclass(sim_backend.SimBackend, replicas.ReplicaCore)
    python = sim_py.python_reference()  # the backend on the core's sources, all of it plain Python
    assert python.__file__.endswith("backend.py") and python.SimBackend is not sim_backend.SimBackend
    for cls, source in ((python.ReplicaCore, "replicas.py"), (python._Seq, "kv.py"), (python._Replica, "kv.py")):
        assert sys.modules[cls.__module__].__file__.endswith(source), cls
    assert python.ReplicaCore in python.SimBackend.__mro__
    assert all(c.__module__ not in ("tiderl_jax.sim.kv", "tiderl_jax.sim.replicas") for c in python.SimBackend.__mro__)


@pytest.mark.parametrize("mode,sim,kw", CORE_CASES)
def test_the_compiled_core_runs_exactly_as_its_python_source(tmp_path, mode, sim, kw):
    kw = _core_kw(mode, kw)
    compiled, _, _ = _run(tmp_path, mode, sim, name="compiled", **kw)
    python, _, _ = _run(tmp_path, mode, sim, name="python", module=sim_py.python_reference(), **kw)
    for key in ("wall_s", "goodput_tokens_per_s", "kv_hit_rate", "staleness", "step_time_s", "sim", "moves",
                "rollout_wait_s", "trainer_wait_s", "borrows"):
        assert compiled[key] == python[key], key


def test_a_turn_across_a_weight_update_misses_the_prefix_cache_at_its_next_turn():
    # the engine's rule: prefix blocks are keyed by version and chained from the first block, so a lookup
    # under version 1 misses blocks whose chain began under version 0 (the source module: its steps are C
    # calls when compiled)
    python = sim_py.python_reference()
    b = python.SimBackend(SimConfig(kv_pages=1000), mode="async", pool=None, num_devices=8)
    r = python._Replica(0, (0,), 1000)
    shape = workloads.TaskSample(64, (16, 16, 16, 16), (16, 16, 16), (1.0, 1.0, 1.0), False)

    def next_turn(s):  # the turn ends, the environment returns, the next turn is admitted
        b._retire(r, s)
        b._turn_end(r, s, 0.0)
        r.arrivals.clear()
        r.queue.append(s)
        before = b._prompt_tokens_cached
        b._admit(r)
        return b._prompt_tokens_cached - before

    s = python._Seq(0, 0, shape, None)
    r.queue.append(s)
    b._admit(r)  # prefilled under version 0
    assert s.kv_version == 0
    assert next_turn(s) == 64  # same version: the cached context's full pages hit
    r.version = 1  # a weight update while the turn runs
    assert next_turn(s) == 0 and s.kv_version == 1  # its chain began under version 0: prefilled again
    assert next_turn(s) == 96  # and cached under version 1 from then on


def test_ra2p_gives_its_idle_reference_group_to_the_actor_without_ers(tmp_path):
    # the ablation ladder's +RA2P rung (ERS off): a trainer-bound step on 1 train group beside 1 ref group; RA2P's
    # replay finds colocated on both groups cheaper than the reference apart, and the move pays over the steps left
    summary, c, b = _run(tmp_path, "tiderl", ers=False, steps=12, ers_patience=1)
    assert [(m["by"], m["frm"], m["to"]) for m in c.moves] == [("RA2P", "ref", "train")]
    assert c.moves[0]["predicted_gain_s"] > c.moves[0]["predicted_cost_s"] > 0
    assert c.pool.num_groups("ref") == 0 and c.pool.num_groups("train") == 2 and c.ra2p_mode == "colocated"
    assert summary["steps"] == 12
