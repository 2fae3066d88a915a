"""The rollout engine against naive references: greedy tokens, log-probs, forks, pauses, preemption,
prefix caching, weight swaps, bad requests and compile counts."""

import numpy as np
import pytest

from conftest import ARCHS, FIXTURES
from engine_reference import greedy, token_logprobs
from tiderl_jax.engine.engine import Engine, EngineConfig, Request, Status
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.model.hf_io import load_hf_checkpoint

MODEL = load_hf_checkpoint(FIXTURES / "qwen3")
SMALL = dict(page_size=8, num_pages=256, max_seq_len=256, max_running=8, prefill_chunk=16,
             prefill_budget=32, decode_steps=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _engine(model=MODEL, **overrides):
    return Engine(model, EngineConfig(**{**SMALL, **overrides}))


def _prompts(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, vocab, n))) for n in lengths]


def test_greedy_batch_of_different_lengths_equals_reference():
    prompts = _prompts([1, 5, 17, 33, 64, 90])
    out = _engine().generate(prompts, GREEDY)
    for p, o in zip(prompts, out):
        assert o.new_tokens == greedy(MODEL, p, 12)
        assert o.finish_reason == "length" and o.status == Status.FINISHED


def test_requests_arriving_at_different_steps():
    eng = _engine()
    prompts = _prompts([9, 30, 3, 50, 21], seed=1)
    handles = []
    for p in prompts:  # a new request every two steps, while earlier ones decode
        handles.append(eng.submit(Request(p, GREEDY)))
        eng.step()
        eng.step()
    eng.run()
    for p, h in zip(prompts, handles):
        assert eng.get(h).new_tokens == greedy(MODEL, p, 12)


def test_preemption_under_page_pressure_keeps_outputs_exact():
    # 12 usable pages of 8 tokens cannot hold 6 sequences of ~40 tokens at once.
    eng = _engine(num_pages=13, max_seq_len=64)
    prompts = _prompts([20, 26, 14, 30, 22, 18], seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    out = eng.generate(prompts, sp)
    assert eng.stats()["preemptions"] > 0
    for p, o in zip(prompts, out):
        assert o.new_tokens == greedy(MODEL, p, 16)


def test_pause_and_resume_keep_kv_and_prefill_only_new_tokens():
    eng = _engine()
    prompt, obs = _prompts([27, 11], seed=3)
    h = eng.submit(Request(prompt, SamplingParams(temperature=0.0, max_new_tokens=6), keep_kv=True))
    eng.run([h])
    first = eng.get(h)
    assert first.status == Status.PAUSED and first.new_tokens == greedy(MODEL, prompt, 6)
    before = eng.stats()["prefill_tokens_computed"]
    eng.resume(h, obs, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    eng.run([h])
    second = eng.get(h)
    context = prompt + first.new_tokens + obs
    assert second.new_tokens == greedy(MODEL, context, 8)
    assert second.tokens[:len(context)] == context
    assert second.model_mask[len(prompt):len(prompt) + 6] == [True] * 6
    assert second.model_mask[len(prompt) + 6:len(context)] == [False] * len(obs)
    # only the last sampled token and the observation were prefilled on resume
    assert eng.stats()["prefill_tokens_computed"] - before == 1 + len(obs)


def test_pause_mid_generation_then_resume_continues_exactly():
    eng = _engine(decode_steps=2)
    a, b = _prompts([15, 40], seed=4)
    ha = eng.submit(Request(a, SamplingParams(temperature=0.0, max_new_tokens=20)))
    hb = eng.submit(Request(b, GREEDY))
    for _ in range(4):
        eng.step()
    eng.pause(ha)
    done_before = len(eng.get(ha).new_tokens)
    assert 0 < done_before < 20
    eng.run([hb])
    eng.resume(ha, [], sampling=SamplingParams(temperature=0.0, max_new_tokens=20 - done_before))
    eng.run([ha])
    generated = [t for t, m in zip(eng.get(ha).tokens, eng.get(ha).model_mask) if m]
    assert generated == greedy(MODEL, a, 20)


def test_preempted_while_paused_recomputes_on_resume():
    eng = _engine(num_pages=12, max_seq_len=64)
    p = _prompts([30], seed=5)[0]
    h = eng.submit(Request(p, SamplingParams(temperature=0.0, max_new_tokens=4), keep_kv=True))
    eng.run([h])
    others = _prompts([40, 40], seed=6)
    out = eng.generate(others, SamplingParams(temperature=0.0, max_new_tokens=10))  # needs h's pages
    assert eng.stats()["preemptions"] >= 1
    eng.resume(h, [1, 2, 3], sampling=SamplingParams(temperature=0.0, max_new_tokens=5))
    eng.run([h])
    ctx = p + eng.get(h).tokens[len(p):len(p) + 4] + [1, 2, 3]
    assert eng.get(h).new_tokens == greedy(MODEL, ctx, 5)
    assert [o.new_tokens for o in out] == [greedy(MODEL, q, 10) for q in others]


def test_pinned_sequence_is_not_preempted():
    eng = _engine(num_pages=12, max_seq_len=64)
    p = _prompts([30], seed=5)[0]
    h = eng.submit(Request(p, SamplingParams(temperature=0.0, max_new_tokens=4), keep_kv=True))
    eng.run([h])
    eng.pin(h)
    pages = list(eng._seqs[h].pages)
    eng.generate(_prompts([30, 30], seed=6), SamplingParams(temperature=0.0, max_new_tokens=10))
    assert eng._seqs[h].pages == pages


def test_prefix_cache_hits_are_counted_and_exact():
    eng = _engine()
    shared = _prompts([40], seed=7)[0]
    first = eng.generate([shared + [1, 2]], GREEDY)[0]
    stats = eng.stats()
    assert stats["prompt_tokens_cached"] == 0
    second = eng.generate([shared + [3, 4, 5]], GREEDY)[0]
    stats = eng.stats()
    assert stats["prompt_tokens_cached"] == 40  # 5 full blocks of 8
    assert second.new_tokens == greedy(MODEL, shared + [3, 4, 5], 12)
    assert first.new_tokens == greedy(MODEL, shared + [1, 2], 12)
    assert 0 < stats["prefix_hit_rate"] < 1


def test_group_samples_share_the_prompt_prefill():
    eng = _engine()
    prompt = _prompts([45], seed=8)[0]
    handles = eng.submit_group(Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)), 4)
    eng.run(handles)
    stats = eng.stats()
    # the 5 full blocks (40 tokens) are computed once; each sibling computes its 5-token tail
    assert stats["prefill_tokens_computed"] == 45 + 3 * 5
    # the token slots the calls computed: padded rows and widths included, so never fewer than the tokens
    assert stats["prefill_slots"] >= stats["prefill_tokens_computed"] and stats["decode_slots"] >= stats["decode_tokens"] > 0
    outs = [eng.get(h) for h in handles]
    assert len({tuple(o.new_tokens) for o in outs}) > 1  # different seeds, different samples
    greedy_group = eng.submit_group(Request(prompt, GREEDY), 3)
    eng.run(greedy_group)
    want = greedy(MODEL, prompt, 12)
    assert all(eng.get(h).new_tokens == want for h in greedy_group)


def test_logprobs_equal_a_full_forward_over_the_generated_sequence():
    eng = _engine()
    prompts = _prompts([6, 23], seed=9)
    cases = [SamplingParams(temperature=0.7, max_new_tokens=14, seed=1),
             SamplingParams(temperature=1.0, max_new_tokens=14, seed=2)]
    for o, sp in zip(eng.generate(prompts, cases), cases):
        seq = o.tokens
        n = len(o.new_tokens)
        np.testing.assert_allclose(o.logp_model[-n:], token_logprobs(MODEL, seq)[-n:], atol=1e-4)
        np.testing.assert_allclose(o.logp_sample[-n:], token_logprobs(MODEL, seq, sp.temperature)[-n:],
                                   atol=1e-4)
        assert o.versions[-n:] == [0] * n and o.versions[:-n] == [-1] * (len(seq) - n)


@pytest.mark.parametrize("impl,ragged", [("xla", True), ("cpu", True), ("cpu", False)])
def test_ragged_prefill_packs_the_rows_and_equals_a_full_forward(impl, ragged):
    """Prompts of odd lengths around page boundaries (pages of 8: 1, 7, 8, 9, 17 and 23 tokens), a group sharing
    its prompt and a prompt whose first blocks are cached, prefilled together: each call packs its rows' tokens
    back to back (fewer token slots than its [rows, width] view; `ragged_prefill=False`: the padded block), and
    the log-prob of every token sampled equals a full forward of the sequence (the reference), on the `xla` path
    (itself equal to `reference`: tests/test_paged_attention.py) and the kernel."""
    if impl == "cpu":
        from tiderl_jax.engine import cpu_attention
        assert cpu_attention.available(), cpu_attention.unavailable_reason()
    eng = _engine(attention_impl=impl, max_prefill_rows=8, prefill_chunk=32, prefill_budget=128,
                  ragged_prefill=ragged)
    shared = _prompts([24], seed=21)[0]
    eng.generate([shared + [5]], GREEDY)  # its 3 full blocks are cached now
    calls, prefill = [], eng.runner.prefill

    def logged(tokens, positions, unpack, pack, last, page_table, starts, num_new, *a, **k):
        calls.append((tokens.shape[1], unpack.shape, int(num_new.sum())))
        return prefill(tokens, positions, unpack, pack, last, page_table, starts, num_new, *a, **k)
    eng.runner.prefill = logged
    prompts = _prompts([1, 7, 8, 9, 17, 23], seed=22) + [shared + [9, 9, 9]]
    sp = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i) for i in range(len(prompts))]
    handles = [eng.submit(Request(p, s)) for p, s in zip(prompts, sp)]
    handles += eng.submit_group(Request(_prompts([13], seed=23)[0], SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                                     seed=40)), 3)
    eng.run(handles)
    assert all(real <= size <= rows * width for size, (rows, width), real in calls)
    packed = [size < rows * width for size, (rows, width), _ in calls]  # fewer slots than the padded view
    assert any(packed) if ragged else not any(packed)
    for h in handles:
        o = eng.get(h)
        n = len(o.new_tokens)
        np.testing.assert_allclose(o.logp_model[-n:], token_logprobs(MODEL, o.tokens)[-n:], atol=1e-4)
    assert eng.stats()["prompt_tokens_cached"] >= 24


def test_top_k_top_p_and_seeds():
    eng = _engine()
    p = _prompts([12], seed=10)
    want = greedy(MODEL, p[0], 12)
    assert eng.generate(p, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12))[0].new_tokens == want
    assert eng.generate(p, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12))[0].new_tokens == want
    # top-k: every sampled token is among the k most likely; its sampling log-prob is renormalised
    o = eng.generate(p, SamplingParams(temperature=1.0, top_k=3, max_new_tokens=12, seed=4))[0]
    from engine_reference import full_logits
    logits = full_logits(MODEL, o.tokens)
    for i in range(len(p[0]), len(o.tokens)):
        assert o.tokens[i] in np.argsort(-logits[i - 1])[:3]
    assert all(ls >= lm for ls, lm in zip(o.logp_sample[len(p[0]):], o.logp_model[len(p[0]):]))
    # per-request seeds: the same request gives the same tokens alone or batched with others
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=11)
    alone = eng.generate(p, sp)[0].new_tokens
    batched = eng.generate(_prompts([30, 7], seed=12) + p, [GREEDY, GREEDY, sp])[2].new_tokens
    assert alone == batched


def test_stop_tokens_end_the_turn():
    eng = _engine()
    p = _prompts([10], seed=13)[0]
    full = greedy(MODEL, p, 12)
    stop = full[4]
    o = eng.generate([p], SamplingParams(temperature=0.0, max_new_tokens=12, stop_ids=(stop,)))[0]
    assert o.new_tokens == full[: full.index(stop) + 1] and o.finish_reason == "stop"


def test_bad_requests_are_refused_and_others_keep_running():
    eng = _engine()
    good = eng.submit(Request(_prompts([10])[0], GREEDY))
    bad = [
        (Request([], GREEDY), "prompt is empty"),
        (Request([1] * 250, GREEDY), "exceeds the engine's max_seq_len 256"),
        (Request([1, 2, 999], GREEDY), "outside \\[0, 256\\)"),
        (Request([1, -3], GREEDY), "outside"),
        (Request([1], SamplingParams(temperature=-1.0)), "temperature=-1.0"),
        (Request([1], SamplingParams(top_p=0.0)), "top_p=0.0"),
        (Request([1], SamplingParams(top_k=-2)), "top_k=-2"),
        (Request([1], SamplingParams(max_new_tokens=0)), "max_new_tokens=0"),
    ]
    for request, message in bad:
        with pytest.raises(RequestError, match=message):
            eng.submit(request)
    with pytest.raises(RequestError, match="unknown request handle"):
        eng.resume(12345, [1])
    with pytest.raises(RequestError, match="not paused"):
        eng.resume(good, [1])
    eng.run()
    assert eng.get(good).new_tokens == greedy(MODEL, _prompts([10])[0], 12)
    assert eng.stats()["rejected"] == len(bad)


def _perturbed(model, seed):
    from flax import nnx
    import jax
    state = nnx.state(model)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, leaves)


def test_weight_swap_continue_records_versions_and_skips_stale_cache():
    from flax import nnx
    eng = _engine(decode_steps=2)
    p = _prompts([33], seed=14)[0]
    h = eng.submit(Request(p, SamplingParams(temperature=0.0, max_new_tokens=12)))
    for _ in range(3):
        eng.step()
    n_old = len(eng.get(h).new_tokens)
    new_params = _perturbed(MODEL, 0)
    eng.update_params(new_params, version=1)
    eng.run([h])
    o = eng.get(h)
    assert o.versions[len(p):] == [0] * n_old + [1] * (12 - n_old)
    # a fresh request with the same prompt: old-version blocks are not reused
    cached_before = eng.stats()["prompt_tokens_cached"]
    new_model = nnx.merge(nnx.graphdef(MODEL), new_params)
    assert eng.generate([p], GREEDY)[0].new_tokens == greedy(new_model, p, 12)
    assert eng.stats()["prompt_tokens_cached"] == cached_before
    stale = _engine(reuse_stale_prefix_cache=True)
    stale.generate([p], GREEDY)
    stale.update_params(new_params, version=1)
    stale.generate([p], GREEDY)
    assert stale.stats()["prompt_tokens_cached"] == 32


def test_new_weights_under_the_same_version_do_not_reuse_the_prefix_cache():
    # a warm start loaded again under version 0 (launch/train.py probes its policy while it trains): blocks
    # computed with the first weights must not be served to the second
    from flax import nnx
    eng = _engine()
    p = _prompts([33], seed=17)[0]
    eng.generate([p], GREEDY)
    new_params = _perturbed(MODEL, 2)
    eng.update_params(new_params, version=0)
    cached_before = eng.stats()["prompt_tokens_cached"]
    assert eng.generate([p], GREEDY)[0].new_tokens == greedy(nnx.merge(nnx.graphdef(MODEL), new_params), p, 12)
    assert eng.stats()["prompt_tokens_cached"] == cached_before
    eng.generate([p], GREEDY)  # blocks of the new weights are reused
    assert eng.stats()["prompt_tokens_cached"] == cached_before + 32


def test_weight_swap_abort_reruns_the_turn_on_new_weights():
    from flax import nnx
    eng = _engine(decode_steps=2, on_update="abort")
    p = _prompts([20], seed=15)[0]
    h = eng.submit(Request(p, SamplingParams(temperature=0.0, max_new_tokens=10)))
    for _ in range(3):
        eng.step()
    assert len(eng.get(h).new_tokens) > 0
    new_params = _perturbed(MODEL, 1)
    eng.update_params(new_params, version=7)
    eng.run([h])
    o = eng.get(h)
    assert o.versions[len(p):] == [7] * 10
    assert o.new_tokens == greedy(nnx.merge(nnx.graphdef(MODEL), new_params), p, 10)


def test_reference_attention_gives_the_same_tokens():
    prompts = _prompts([7, 19], seed=16)
    a = _engine(attention_impl="reference").generate(prompts, GREEDY)
    b = _engine().generate(prompts, GREEDY)
    assert [o.new_tokens for o in a] == [o.new_tokens for o in b]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_transformers_generate(arch):
    ref = np.load(FIXTURES / arch / "logits.npz")
    model = load_hf_checkpoint(FIXTURES / arch)
    prompts = [ref["greedy_prompt_0"].tolist(), ref["greedy_prompt_1"].tolist()]
    n = ref["greedy_tokens"].shape[1]
    out = _engine(model).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n))
    assert [o.new_tokens for o in out] == ref["greedy_tokens"].tolist()


def test_no_recompiles_in_steady_state():
    """After warm-up, a long mixed run (ragged prompts, staggered arrivals, forks, pauses with
    resumes, greedy / sampled / top-p rows) runs no device program outside the warmed bucket grid."""
    eng = _engine(num_pages=48, max_running=4, max_seq_len=128, prefill_chunk=32, max_prefill_rows=2)
    eng.warmup()
    warm, compile_s = eng.stats()["compilations"], eng.compile_s
    # decode 1 row x 5 span buckets + prefill 3 spans x the 6 (rows, chunk width, packed tokens) of the ragged calls
    assert warm == eng.num_programs() == 23
    rng = np.random.default_rng(0)
    handles = []
    for i in range(40):
        n = int(rng.integers(1, 90))
        sp = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), top_p=float(rng.choice([1.0, 0.9])),
                            max_new_tokens=int(rng.integers(1, 30)), seed=i)
        req = Request(list(map(int, rng.integers(0, 256, n))), sp, keep_kv=bool(i % 5 == 0))
        handles += eng.submit_group(req, 2) if i % 4 == 0 else [eng.submit(req)]
        for _ in range(int(rng.integers(0, 3))):
            eng.step()
        for h in handles:
            if eng.get(h).status == Status.PAUSED and len(eng.get(h).tokens) < 90:
                eng.resume(h, list(map(int, rng.integers(0, 256, 5))),
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=3))
            elif eng.get(h).status == Status.PAUSED:
                eng.release(h)
    eng.run()
    stats = eng.stats()
    assert stats["decode_tokens"] > 500 and stats["preemptions"] > 0
    assert stats["compilations"] == warm, "traffic ran a program outside the warmed grid"
    assert eng.compile_s == compile_s, "a warmed program compiled again (called otherwise than warm-up called it)"


def test_warmup_of_the_programs_another_engine_ran():
    """A fresh engine warmed up with the programs an earlier one ran (not the whole grid) runs the same traffic
    without loading a program."""
    cfg = dict(num_pages=48, max_running=4, max_seq_len=128, prefill_chunk=32, max_prefill_rows=4)

    def traffic(eng):
        eng.generate(_prompts([5, 40, 17], seed=3), SamplingParams(temperature=0.0, max_new_tokens=12))
    first = _engine(**cfg)
    traffic(first)
    ran = first.programs()
    assert 0 < len(ran) < first.num_programs()
    second = _engine(**cfg)
    second.warmup(ran)
    assert second.programs() == ran
    compiles = second.stats()["compilations"]
    traffic(second)
    assert second.stats()["compilations"] == compiles and second.programs() == ran


def test_a_sequence_larger_than_the_pool_is_refused_not_stalled():
    eng = _engine(num_pages=5, max_seq_len=128)  # 4 usable pages of 8 tokens = 32 tokens
    with pytest.raises(RequestError, match="exceeds the KV pool's 32 tokens"):
        eng.submit(Request(list(range(30)), SamplingParams(max_new_tokens=8)))
    h = eng.submit(Request(list(range(20)), SamplingParams(temperature=0.0, max_new_tokens=8), keep_kv=True))
    eng.run([h])
    with pytest.raises(RequestError, match="exceeds the KV pool"):
        eng.resume(h, list(range(10)))
    eng.evict(h)
    assert eng.stats()["evictions"] == 1 and eng.stats()["pages_used"] == 0


def test_coarse_buckets_compile_fewer_programs_with_the_same_outputs():
    """bucket_growth=4 pads to powers of four: a quarter of the grid, outputs equal to the reference."""
    prompts = _prompts([1, 5, 17, 33, 64, 90], seed=5)
    fine, coarse = _engine(max_running=16), _engine(max_running=16, bucket_growth=4)
    assert coarse.num_programs() <= fine.num_programs() / 2
    for p, o in zip(prompts, coarse.generate(prompts, GREEDY)):
        assert o.new_tokens == greedy(MODEL, p, 12)
    with pytest.raises(ValueError, match="bucket_growth=3"):
        EngineConfig(**SMALL, bucket_growth=3)


def test_the_main_jobs_engine_warms_up_a_small_grid():
    """The main job's engine config (configs/tiny_agentic.py) compiles 27 programs at warm-up (a cold warm-up
    under a minute on 2 CPU cores: benchmarks/engine_warmup.py measures it): decode 3 rows x 3 spans, prefill
    2 rows x the 9 (chunk width, span) pairs whose span can hold the chunk (padded prefill: one packed size each);
    ragged, 38."""
    import configs.tiny_agentic as main_job
    eng = Engine(MODEL, EngineConfig(**main_job.get_config().engine.to_dict()))
    kinds = [key[0] for key in eng.grid()]
    assert eng.num_programs() == 27 and kinds.count("decode") == 9 and kinds.count("prefill") == 18
    ragged = Engine(MODEL, EngineConfig(**{**main_job.get_config().engine.to_dict(), "ragged_prefill": True}))
    assert ragged.num_programs() == 38
