"""The simulator's model of the real engine on a host (`SimConfig.engine_steps`, used with measured costs by
benchmarks/sim_validation.py): its decode-steps rule, when a turn's output reaches the rollout loop, and the
prefix cache's rule for first turns; and the validation script's helpers."""

import asyncio
import importlib.util
import pathlib
import sys

import pytest

from tiderl_jax.agents import tasks as task_lib
from tiderl_jax.runtime.pool import split_devices
from tiderl_jax.sim import backend as sim_backend
from tiderl_jax.sim import costs, workloads
from tiderl_jax.sim.backend import SimConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
M = costs.MeasuredCosts(decode_step_s=0.01, decode_per_seq_s=0.0, prefill_fixed_s=0.1, prefill_per_token_s=0.0,
                        score_fixed_s=0.0, score_per_token_s=1e-4, update_fixed_s=0.0, update_per_token_s=1e-4)


def _rollout(shapes, **kw):
    """Groups of sample shapes ((prompt, gen per turn, obs per gap) each, no latency) on one measured
    replica, each group placed `gap` seconds after the previous; (virtual seconds, backend)."""
    gap, programs, module = kw.pop("gap", 0.0), kw.pop("programs", None), kw.pop("module", sim_backend)
    sim = module.SimConfig(tp=0, kv_pages=4096, max_batch=64, decode_chunk=8, **{"measured": M, **kw})
    pool = split_devices(range(8), mode="async", group_size=2, rollout=2, ref=0, train=2, tensor=2)
    b = module.SimBackend(sim, mode="async", pool=pool, num_devices=8)
    b.programs = programs
    b.shape_sampler = lambda g, rng, n: [workloads.TaskSample(p, gen, obs, (0.0,) * len(obs), False)
                                         for p, gen, obs in shapes[g][:n]]

    async def main():
        await b.start(None, None, None)

        async def group(g):
            await asyncio.sleep(g * gap)
            await b.generate_group(task_lib.make_task("calculator", g), g, list(range(len(shapes[g]))),
                                   len(shapes[g]))
        await asyncio.gather(*(group(g) for g in range(len(shapes))))
        return b.loop.time()
    asyncio.set_event_loop(b.loop)
    try:
        return b.loop.run_until_complete(main()), b
    finally:
        asyncio.set_event_loop(None)
        b.loop.close()


def test_engine_steps_needs_measured_costs():
    with pytest.raises(ValueError):
        SimConfig(engine_steps=True)


def test_an_event_that_prefills_decodes_one_step_the_others_a_whole_chunk():
    # 20 tokens: the engine's calls are prefill + 1 step, then 8-step calls (24 steps, the last rows ride
    # along); the chunk rule decodes 8 + 8 + 4 steps, the prefill in the first event
    t_engine, _ = _rollout([[(40, (20,), ())]], engine_steps=True)
    t_chunk, _ = _rollout([[(40, (20,), ())]])
    assert t_engine == pytest.approx(0.1 + 0.01 + 3 * 8 * 0.01)
    assert t_chunk == pytest.approx(0.1 + 20 * 0.01)


def test_a_turn_reaches_the_rollout_loop_when_the_engine_call_returns():
    # turn 0 (3 tokens) ends inside the second call (8 steps): its next turn starts when that call ends
    t, _ = _rollout([[(40, (3, 2), (5,))]], engine_steps=True)
    assert t == pytest.approx((0.1 + 0.01 + 8 * 0.01) * 2)


def test_a_group_prompt_is_shared_only_once_computed():
    shape = (100, (1,), ())
    # four samples admitted in one engine call all compute the prompt; the chunk rule shares it
    _, b = _rollout([[shape] * 4], engine_steps=True)
    assert b.kv_hit_rate() == 0.0
    _, b = _rollout([[shape] * 4])
    assert b.kv_hit_rate() == pytest.approx(3 * 96 / 400)
    # a second group placed later hits the shared system prompt's full pages (40 tokens: 32), not before
    _, b = _rollout([[shape], [shape]], engine_steps=True, shared_prefix_tokens=40, gap=1.0)
    assert b.kv_hit_rate() == pytest.approx(32 / 200)
    _, b = _rollout([[shape], [shape]], engine_steps=True, shared_prefix_tokens=40)
    assert b.kv_hit_rate() == 0.0


def _validation():
    spec = importlib.util.spec_from_file_location("sim_validation", ROOT / "benchmarks" / "sim_validation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sim_validation", mod)
    spec.loader.exec_module(mod)
    return mod


def test_shared_prefix_is_what_every_task_prompt_starts_with():
    sv = _validation()
    shapes = sv.demo_shapes(4)
    n = sv.shared_prefix(shapes)
    prompts = [r[3] for rows in shapes.values() for r in rows]
    assert n > 0 and all(p[:n] == prompts[0][:n] for p in prompts)
    assert len({p[n] for p in prompts if len(p) > n}) > 1


def test_an_event_makes_one_prefill_call_per_chunk_length_bucket():
    # a 40-token prompt (bucket 64) and a 200-token one (bucket 256) admitted together: two prefill calls
    two = [[(40, (1,), ())], [(200, (1,), ())]]
    t_calls, _ = _rollout(two, engine_steps=True, prefill_chunk=512)
    t_one, _ = _rollout(two, engine_steps=True)
    assert t_calls == pytest.approx(2 * 0.1 + 0.01)
    assert t_one == pytest.approx(0.1 + 0.01)
    # the same bucket: one call
    t_same, _ = _rollout([[(40, (1,), ())], [(50, (1,), ())]], engine_steps=True, prefill_chunk=512)
    assert t_same == pytest.approx(0.1 + 0.01)


def test_prefill_goes_on_over_events_in_the_engines_chunks_under_its_budget(monkeypatch):
    # the real Engine (`_plan_prefill`: at most prefill_chunk tokens of a sequence per step, prefill_budget in all;
    # a sequence decodes once its last chunk is in) against the simulated one: the same prefill calls, by shape
    # bucket, step by step. Prompts of 40, 10 and 10 tokens, chunk 16, budget 32: 16 + 10 + 6, then 16 + 4, then 8
    import numpy as np

    import tiderl_jax.sim as sim_py
    from tiderl_jax.engine.engine import Engine, EngineConfig, Request
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.model.config import ModelConfig
    from tiderl_jax.model.decoder import init_decoder

    lengths, engine = (40, 10, 10), dict(page_size=8, prefill_chunk=16, prefill_budget=32, max_seq_len=256)
    model = init_decoder(ModelConfig(arch="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                                     num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=256,
                                     dtype="float32"), seed=0)
    eng = Engine(model, EngineConfig(num_pages=128, max_running=64, max_prefill_rows=16, decode_steps=8, **engine))
    real, prefill = [], eng.runner.prefill

    def logged(tokens, positions, unpack, pack, last, page_table, *a, **k):  # the [rows, width] attention view
        real.append((eng.stats()["steps"], unpack.shape[0], unpack.shape[1], page_table.shape[1]))
        return prefill(tokens, positions, unpack, pack, last, page_table, *a, **k)
    monkeypatch.setattr(eng.runner, "prefill", logged)
    rng = np.random.default_rng(0)
    for n in lengths:
        eng.submit(Request([int(t) for t in rng.integers(0, 64, n)], SamplingParams(max_new_tokens=4)))
    eng.run()

    python = sim_py.python_reference()  # (a compiled class cannot be patched)
    simulated, program = [], python.SimBackend._program

    def log_program(self, r, key):
        if key[0] == "prefill":
            simulated.append((r.events,) + key[1:])
        return program(self, r, key)
    monkeypatch.setattr(python.SimBackend, "_program", log_program)
    m = costs.MeasuredCosts(**{**M.__dict__, "program_s": 1e-3})
    _rollout([[(n, (4,), ())] for n in lengths], module=python, measured=m, engine_steps=True, **engine)
    first = simulated[0][0]
    assert [(e - first + 1, *k) for e, *k in simulated] == real
    assert [(step, rows, width) for step, rows, width, _ in real] == [(1, 4, 16), (2, 2, 16), (3, 1, 16)]


def test_an_engine_pays_for_each_program_once_and_a_process_once_per_devices():
    # one sample of 20 tokens: a prefill program and a decode program (its 1-step and 8-step calls share
    # the shape bucket) are new: two loads
    m = costs.MeasuredCosts(**{**M.__dict__, "program_s": 1.0})
    kw = dict(measured=m, engine_steps=True, prefill_chunk=512, max_seq_len=2048)
    t, b = _rollout([[(40, (20,), ())]], **kw)
    assert t == pytest.approx(0.1 + 0.01 + 3 * 8 * 0.01 + 2 * 1.0)
    assert len(next(iter(b.replicas.values())).programs) == 2
    # a second engine of the same process on the same devices finds them in memory; a longer context
    # needs a new decode program (pages bucket)
    shared = set()
    t1, _ = _rollout([[(40, (20,), ())]], programs=shared, **kw)
    t2, _ = _rollout([[(40, (20,), ())]], programs=shared, **kw)
    t3, _ = _rollout([[(200, (20,), ())]], programs=shared, **kw)
    assert t1 == pytest.approx(t) and t2 == pytest.approx(t - 2.0)
    assert t3 == pytest.approx(0.1 + 0.01 + 3 * 8 * 0.01 + 2 * 1.0)  # prefill: 256 tokens, decode: 15 pages
    with pytest.raises(ValueError):  # the prefill programs' buckets come from the chunk
        _rollout([[(40, (20,), ())]], measured=m, engine_steps=True, max_seq_len=2048)


def test_measured_attention_terms_charge_context_and_pairs():
    # 40-token prompt, 8 tokens in one chunk: prefill 0.1 + 1e-5 per pair (40 * 41 / 2); decode 8 steps over a
    # context of 40 + 7 / 2 tokens on average (the chunk rule's mean context), 1e-4 s per context token
    m = costs.MeasuredCosts(**{**M.__dict__, "decode_per_kv_token_s": 1e-4, "prefill_per_pair_s": 1e-5})
    t, _ = _rollout([[(40, (8,), ())]], measured=m)
    assert t == pytest.approx(0.1 + 1e-5 * 820 + 8 * (0.01 + 1e-4 * 43.5))
    t0, _ = _rollout([[(40, (8,), ())]])
    assert t0 == pytest.approx(0.1 + 8 * 0.01)


def test_packed_micro_batches_follows_the_trainers_packing():
    import numpy as np

    from tiderl_jax.trajectory import Trajectory
    from tiderl_jax.rl import batch

    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = [int(x) for x in rng.integers(50, 1000, size=int(rng.integers(1, 40)))]
        trajs = []
        for n in lengths:
            t = Trajectory("t", "calculator", 0)
            t.extend([1] * (n - 1), generated=False)
            t.extend([2], generated=True, logprobs=[0.0], model_logprobs=[0.0], versions=[0])
            trajs.append(t)
        packed = batch.pack(trajs, row_len=1024, micro_rows=4)
        assert costs.packed_micro_batches(lengths, 1024, 4) == packed.arrays["tokens"].shape[0]


def test_train_time_follows_micro_batches_not_tokens(tmp_path):
    from tiderl_jax.runtime.controller import ControllerConfig

    m = costs.MeasuredCosts(**{**M.__dict__, "score_per_token_s": 0.0, "update_per_token_s": 0.0,
                               "score_per_micro_s": 0.5, "update_per_micro_s": 2.0})
    sim = SimConfig(tp=0, kv_pages=4096, measured=m, train_row_len=1024, train_micro_rows=4)
    cfg = ControllerConfig(mode="async", steps=2, groups_per_step=2, group_size=4, max_concurrent=16,
                           device_group_size=2, rollout_groups=2, ref_groups=0, train_groups=2, tensor=1)
    _, controller, _ = sim_backend.run(sim, cfg, num_devices=8, logdir=str(tmp_path / "micro"))
    spans = [b - a for lane, kind, a, b in controller.metrics.spans if kind == "train"]
    # 8 trajectories of the 7B preset's workload (up to 1024-token contexts): 1 or 2 micro-batches of
    # (proximal + colocated ref + update) = 3 s each
    assert spans and all(round(s / 3.0) in (1, 2) and abs(s / 3.0 - round(s / 3.0)) < 1e-9 for s in spans)


def test_replayed_samples_wait_the_latencies_their_environment_draws():
    import random
    import zlib

    from tiderl_jax.agents.env import LatencyModel

    sv = _validation()
    groups = [[(100, (60, 8), (30,), (1,)), (100, (60, 8, 5), (30, 20), (0, 1))]]
    out = sv.replay_sampler(groups, (0.3, 1.0, 5.0))(0, None, 2)
    task = task_lib.make_task("calculator", 0, "train", 0)
    rng = random.Random(zlib.crc32(task.task_id.encode()))
    first = LatencyModel(0.3, 1.0, 5.0).sample(rng)
    assert out[0].env_latency_s == (first,)  # every sample of the group: the same environment seed
    assert out[1].env_latency_s == (0.0, first)  # a turn without a tool call waits none
    assert sv.replay_sampler(groups, None)(0, None, 2)[1].env_latency_s == (0.0, 0.0)


def _trainer_backend(**measured):
    """A measured backend in goodput.py's tiderl layout (rollout 4, ref 2, train 2 devices) with the trainer's
    packing (rows of 1024 tokens, 4 per micro-batch), overlap-free; and a coroutine runner on its loop."""
    m = costs.MeasuredCosts(**{**M.__dict__, "score_per_token_s": 0.0, "update_per_token_s": 0.0,
                               "score_per_micro_s": 0.5, "update_per_micro_s": 2.0, "ref_per_micro_s": 0.25,
                               **measured})
    sim = SimConfig(tp=0, kv_pages=4096, measured=m, train_row_len=1024, train_micro_rows=4)
    pool = split_devices(range(8), mode="tiderl", group_size=2, rollout=2, ref=1, train=1, tensor=2)
    b = sim_backend.SimBackend(sim, mode="tiderl", pool=pool, num_devices=8)

    def run(coro):
        asyncio.set_event_loop(b.loop)
        try:
            return b.loop.run_until_complete(coro)
        finally:
            asyncio.set_event_loop(None)
    run(b.start(None, None, None))
    return b, run


def _batch(n: int, tokens: int = 600) -> list:
    """n trajectories of `tokens` context tokens: one per packed row (600 + 600 > 1024), so n rows."""
    return [sim_backend.SimTrajectory("t", "calculator", 0, model_tokens=100, context_tokens=tokens)
            for _ in range(n)]


def test_a_trainer_loads_the_programs_of_each_micro_batch_count_once():
    b, run = _trainer_backend(score_program_s=1.0, update_program_s=3.0)

    def step(batch):
        t0 = b.loop.time()
        out = run(b.train(batch))
        return b.loop.time() - t0, out
    # 8 rows = 2 micro-batches: proximal + colocated ref 2 x 0.5, update 2 x 2.0; the first call of the score and
    # update programs adds their loads (the colocated ref pass finds the score program loaded)
    t, out = step(_batch(8))
    assert t == pytest.approx(1.0 + 1.0 + 1.0 + 4.0 + 3.0)
    assert (out["time_proximal_s"], out["time_ref_s"], out["time_update_s"]) == pytest.approx((2.0, 1.0, 7.0))
    assert step(_batch(8))[0] == pytest.approx(6.0)
    # 9 rows = 3 micro-batches: a new shape, loaded once
    assert step(_batch(9))[0] == pytest.approx(1.5 + 1.5 + 6.0 + 4.0)
    assert step(_batch(9))[0] == pytest.approx(9.0)
    assert step(_batch(4))[0] == pytest.approx(0.5 + 0.5 + 2.0 + 4.0)  # 1 micro-batch: new again
    # the ref scorer on its own devices has programs of its own
    b2, run2 = _trainer_backend(ref_program_s=0.75)
    for expected in (2 * 0.25 + 0.75, 2 * 0.25):
        t0 = b2.loop.time()
        run2(b2.score_ref(_batch(8)))
        assert b2.loop.time() - t0 == pytest.approx(expected)
    # without program costs nothing is added
    b3, run3 = _trainer_backend()
    t0 = b3.loop.time()
    run3(b3.train(_batch(8)))
    assert b3.loop.time() - t0 == pytest.approx(6.0)


def test_a_moved_trainer_loads_its_programs_again():
    b, run = _trainer_backend(score_program_s=1.0, update_program_s=3.0, ref_program_s=0.75, switch_s=0.0)
    run(b.train(_batch(8)))
    run(b.score_ref(_batch(8)))
    run(b.move("rollout", "ref"))  # the ref devices change (a new scorer), the trainer's do not
    t0 = b.loop.time()
    run(b.train(_batch(8)))
    assert b.loop.time() - t0 == pytest.approx(6.0)  # the trainer did not move
    t0 = b.loop.time()
    run(b.score_ref(_batch(8)))
    assert b.loop.time() - t0 == pytest.approx(0.5 + 0.75)
    run(b.move("ref", "train"))
    t0 = b.loop.time()
    run(b.train(_batch(8)))
    assert b.loop.time() - t0 == pytest.approx(6.0 + 4.0)


def test_with_program_loads_the_move_cost_estimate_is_the_compile_seconds_so_far():
    # the real controller's estimate before any move (its backend gives none): the compile seconds so far, which
    # count a program's whole first call, load and run
    b, run = _trainer_backend(score_program_s=1.0, update_program_s=3.0, switch_s=10.0)
    assert b.compile_s() == 0.0
    run(b.train(_batch(8)))
    assert b.compile_s() == pytest.approx((1.0 + 1.0) + (4.0 + 3.0))
    assert b.move_cost_estimate() == pytest.approx(b.compile_s())
    run(b.train(_batch(8)))
    assert b.compile_s() == pytest.approx(9.0)
    # without program loads: the measured switch time, as before
    b2, run2 = _trainer_backend(switch_s=10.0)
    run2(b2.train(_batch(8)))
    assert b2.compile_s() == 0.0 and b2.move_cost_estimate() == 10.0
