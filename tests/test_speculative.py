"""WAR's speculative decoding: the drafter, the exact verification (against a plain per-row reference and by
frequencies), the engine's speculative steps (greedy tokens identical to plain decoding, sampled log-probs those
of the model) and the per-step switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from engine_reference import greedy, token_logprobs
from tiderl_jax.engine.drafter import Drafter, SuffixIndex
from tiderl_jax.engine.engine import Engine, EngineConfig, Request, Status
from tiderl_jax.engine.sampling import SamplingParams, _sampling_logits, row_keys, verify_drafts, verify_uniforms
from tiderl_jax.engine.speculation import SpecSwitch
from tiderl_jax.model.hf_io import load_hf_checkpoint
from tiderl_jax.policies import war

MODEL = load_hf_checkpoint(FIXTURES / "qwen3")
SMALL = dict(page_size=8, num_pages=256, max_seq_len=256, max_running=8, prefill_chunk=16,
             prefill_budget=32, decode_steps=4)


# ---------------------------------------------------------------------------------------------- the drafter

def test_the_suffix_index_drafts_what_followed_the_longest_matching_suffix():
    idx = SuffixIndex(max_match=4)
    idx.extend((), [1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert idx.draft([0, 1, 2, 3], 3) == [4, 5, 9]  # "1 2 3" continues with 4 (not "2 3" -> 7, shorter)
    assert idx.draft([6, 2, 3], 2) == [7, 8]  # "6 2 3" unseen: "2 3" -> most recent of {4, 7} at count 1: 7
    assert idx.draft([42], 3) == []
    idx.extend([7, 8], [2, 3, 4])  # "2 3" -> 4 now seen twice: the most frequent wins
    assert idx.draft([5, 2, 3], 1) == [4]


def test_the_drafter_indexes_a_context_incrementally_and_bounds_its_keys():
    d = Drafter(max_match=3, max_keys=2)
    d.extend("a", [], [1, 2, 3])
    d.extend("a", [1, 2, 3], [1, 2])  # across the boundary: "3 1" and "2 3 1"
    assert d.draft("a", [2, 3], 2) == [1, 2]
    d.add("b", [5, 6])
    d.add("c", [7, 8])
    assert len(d) == 2 and d.draft("a", [2, 3], 2) == []  # "a" was the least recently used


def test_the_drafter_bounds_the_tokens_indexed_over_all_keys_dropping_the_least_recently_used():
    d = Drafter(max_match=2, max_tokens=10)
    d.add("a", [1, 2, 3, 4])
    d.add("b", [5, 6, 7, 8])
    assert d.draft("a", [1], 2) == [2, 3]  # "a" is now more recent than "b"
    d.extend("c", [], [9, 10, 11])  # 11 tokens: the least recently used key, "b", goes
    assert d.num_tokens == 7 and d.draft("b", [5], 1) == [] and d.draft("a", [1], 1) == [2]
    d.extend("c", [9, 10, 11], [12, 13, 14, 15])  # 11 again: "a" goes, "c" (the one indexing) stays
    assert d.num_tokens == 7 and len(d) == 1 and d.draft("c", [11], 2) == [12, 13]
    d.extend("c", [], list(range(20, 40)))  # one key alone: indexed up to the bound, the rest not
    assert d.num_tokens == 10 == d.index("c").num_tokens and d.draft("c", [21], 1) == [22]
    assert d.draft("c", [22], 1) == []
    for i in range(100):  # many keys: the total never passes the bound
        d.add(i, [i, i + 1, i + 2])
        assert d.num_tokens == sum(x.num_tokens for x in d._indexes.values()) <= 10
    assert len(d) == 3


# ------------------------------------------------------------------------------------------ the verification

def _verify_reference(logits, drafts, num_drafts, temperature, top_k, top_p, u_acc, u_draw):
    """Speculative sampling row by row, position by position, in numpy (the textbook algorithm)."""
    b, k1, v = logits.shape
    scaled, _ = _sampling_logits(jnp.asarray(logits.reshape(b * k1, v)), jnp.repeat(temperature, k1),
                                 jnp.repeat(top_k, k1), jnp.repeat(top_p, k1), True)
    p = np.asarray(jax.nn.softmax(scaled, axis=-1)).reshape(b, k1, v)
    out = []
    for r in range(b):
        toks = []
        for j in range(k1):
            if j < num_drafts[r]:
                d = drafts[r, j]
                ok = (np.argmax(logits[r, j]) == d) if temperature[r] <= 0 else (u_acc[r, j] < p[r, j, d])
                if ok:
                    toks.append(int(d))
                    continue
                residual = p[r, j].copy()
                residual[d] = 0.0
            else:
                residual = p[r, j]
            if temperature[r] <= 0:
                toks.append(int(np.argmax(logits[r, j])))
            else:
                cdf = np.cumsum(residual / residual.sum())
                toks.append(int(min(np.sum(cdf < u_draw[r, j] * cdf[-1]), v - 1)))
            break
        out.append(toks)
    return out


def test_verification_equals_the_per_row_reference():
    rng = np.random.default_rng(0)
    b, k, v = 24, 4, 11
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32) * 2
    drafts = np.where(rng.random((b, k)) < 0.6, np.argmax(logits[:, :k], -1), rng.integers(0, v, (b, k)))
    num_drafts = rng.integers(0, k + 1, b).astype(np.int32)
    temperature = rng.choice([0.0, 0.7, 1.0], b).astype(np.float32)
    top_k = rng.choice([0, 3], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.8], b).astype(np.float32)
    keys = row_keys(jnp.repeat(jnp.arange(b), k + 1), jnp.tile(jnp.arange(k + 1), b)).reshape(b, k + 1)
    tok, lps, lpm, n = verify_drafts(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts),
                                     jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), keys,
                                     filtered=True)
    u_acc, u_draw = (np.asarray(u) for u in verify_uniforms(keys))
    ref = _verify_reference(logits, drafts, num_drafts, temperature, top_k, top_p, u_acc, u_draw)
    tok, lps, lpm, n = (np.asarray(x) for x in (tok, lps, lpm, n))
    assert [tok[r, :n[r]].tolist() for r in range(b)] == ref
    assert (n > 1).any() and (n == 1).any()  # some drafts accepted, some rejected at once
    model_lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    for r in range(b):
        for j in range(n[r]):
            assert lpm[r, j] == pytest.approx(model_lp[r, j, tok[r, j]], abs=1e-5)
        if temperature[r] <= 0:
            assert (lps[r, :n[r]] == 0).all()


def test_sampled_tokens_have_the_sampling_distribution_by_frequencies():
    """Position 0's token has p_0's distribution whatever the draft; given the draft was accepted, position
    1's token has p_1's (the verification's logits at position 1 are conditioned on the draft)."""
    n, v = 40000, 6
    p0 = np.asarray([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    p1 = np.asarray([0.05, 0.15, 0.5, 0.1, 0.1, 0.1])
    logits = np.log(np.stack([p0, p1, p0]))[None].repeat(n, 0).astype(np.float32)  # [n, 3, v]
    drafts = np.tile(np.asarray([[1, 4]], np.int32), (n, 1))  # draft 1 (p 0.25), then 4 (p 0.1)
    keys = row_keys(jnp.repeat(jnp.arange(n), 3), jnp.tile(jnp.arange(3), n)).reshape(n, 3)
    tok, lps, _, emitted = jax.jit(lambda lg, d, k: verify_drafts(
        lg, d, jnp.full(n, 2, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n), k,
        filtered=False))(jnp.asarray(logits), jnp.asarray(drafts), keys)
    tok, lps, emitted = np.asarray(tok), np.asarray(lps), np.asarray(emitted)
    np.testing.assert_allclose(np.bincount(tok[:, 0], minlength=v) / n, p0, atol=0.008)
    second = tok[tok[:, 0] == 1, 1]
    np.testing.assert_allclose(np.bincount(second, minlength=v) / len(second), p1, atol=0.015)
    assert emitted.mean() == pytest.approx(1 + 0.25 + 0.25 * 0.1, abs=0.02)  # expected emitted tokens
    np.testing.assert_allclose(np.exp(lps[:, 0]), p0[tok[:, 0]], rtol=1e-4)


# ----------------------------------------------------------------------------------------------- the engine

def _engine(**overrides):
    return Engine(MODEL, EngineConfig(**{**SMALL, **overrides}))


def _repetitive_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = list(map(int, rng.integers(0, 256, 5)))
        out.append(motif * 4 + list(map(int, rng.integers(0, 256, 3))))
    return out


def test_greedy_speculative_decoding_emits_plain_decodings_tokens():
    prompts = _repetitive_prompts(5)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    eng = _engine(speculation="on", spec_tokens=4)
    out = eng.generate(prompts, sp)
    for p, o in zip(prompts, out):
        assert o.new_tokens == greedy(MODEL, p, 24)
        assert o.finish_reason == "length"
    stats = eng.stats()
    assert stats["spec_steps"] > 0 and stats["spec_acceptance_length"] > 1.5, stats


def test_sampled_speculative_decoding_reports_the_models_log_probs():
    prompts = _repetitive_prompts(3, seed=1)
    sp = SamplingParams(temperature=0.25, max_new_tokens=20, seed=7)
    eng = _engine(speculation="on", spec_tokens=3)
    out = eng.generate(prompts, sp)
    for o in out:
        seq = o.tokens
        gen = [i for i, m in enumerate(o.model_mask) if m]
        np.testing.assert_allclose(np.asarray(o.logp_model)[gen], token_logprobs(MODEL, seq)[np.asarray(gen) - 1],
                                   atol=2e-4)
        np.testing.assert_allclose(np.asarray(o.logp_sample)[gen],
                                   token_logprobs(MODEL, seq, temperature=0.25)[np.asarray(gen) - 1], atol=2e-4)
    assert eng.stats()["spec_emitted"] > eng.stats()["spec_rows"]  # some drafts accepted


def test_speculation_with_stops_resumes_forks_and_preemption_stays_exact():
    """Stop ids inside accepted drafts end the turn there; paused sequences resume with observations; a group
    shares its draft index; page pressure preempts and recomputes."""
    eng = _engine(speculation="on", num_pages=14, max_seq_len=128)
    prompts = _repetitive_prompts(4, seed=2)
    stop = greedy(MODEL, prompts[0], 10)[6]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, stop_ids=(stop,))
    hs = [eng.submit(Request(p, sp, keep_kv=True)) for p in prompts[:2]]
    hs += eng.submit_group(Request(prompts[2], sp, keep_kv=True), 2)
    eng.run()
    for h, p in zip(hs, prompts[:3] + [prompts[2]]):
        assert eng.get(h).new_tokens == greedy(MODEL, p, 10, stop_ids=(stop,))
    obs = [3, 1, 4, 1, 5]
    for h in hs:
        eng.resume(h, obs, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    eng.run()
    for h in hs:
        o = eng.get(h)
        assert o.status == Status.PAUSED
        assert o.new_tokens == greedy(MODEL, o.tokens[:o.turn_start + len(obs)], 8)
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["spec_emitted"] > stats["spec_rows"], stats


def test_warmup_compiles_the_verify_programs_and_steady_state_compiles_nothing():
    eng = _engine(speculation="auto", max_running=4, max_seq_len=128, num_pages=48, prefill_chunk=32,
                  max_prefill_rows=4, bucket_growth=4, spec_max_batch=4)
    eng.warmup()
    warm, compile_s = eng.stats()["compilations"], eng.compile_s
    verify = {key for key in eng.programs() if key[0] == "verify"}
    assert warm == eng.num_programs() and len(verify) == 2 * 2  # verify: rows 1, 4 x spans 4, 16 pages
    out = eng.generate(_repetitive_prompts(6, seed=3), SamplingParams(temperature=1.0, max_new_tokens=30))
    assert all(len(o.new_tokens) == 30 for o in out)
    assert eng.stats()["compilations"] == warm and eng.compile_s == compile_s


# ----------------------------------------------------------------------------------------------- the switch

def test_the_switch_measures_both_kinds_then_follows_wars_rule():
    sw = SpecSwitch("auto", (1, 4, 16), war.SpecSwitchConfig(probe_every=1000))
    assert sw.decide(2) is False  # no plain measurement yet: plain first
    sw.record_decode(2, True, 0.010)
    assert sw.decide(2, multi_step=False) is False  # a one-step plain call is another regime: measured first
    assert sw.decide(2) is True  # then speculation once
    sw.record_spec(2, 0.014, emitted_per_seq=2.5)  # 0.0056 s per token < 0.010
    assert sw.decide(3) is True and sw.last.use
    sw.record_spec(2, 0.060, emitted_per_seq=1.0)  # averaged: 0.0232 s per step, 2.2 tokens: 0.0105 > 0.010
    assert sw.decide(3) is False
    assert sw.decide(17) is False  # above WAR's batch
    assert SpecSwitch("off", (1, 4, 16)).decide(1) is False
    assert SpecSwitch("on", (1, 4, 16)).decide(16) is True and SpecSwitch("on", (1, 4, 16)).decide(17) is False


def test_the_switch_needs_a_margin_to_turn_on_and_measures_acceptance_per_batch_class():
    sw = SpecSwitch("auto", (1, 4, 16), war.SpecSwitchConfig(probe_every=1000, margin=0.1))
    for batch in (1, 4):
        sw.record_decode(batch, True, 0.010)
    sw.record_spec(4, 0.019, emitted_per_seq=2.0)  # 0.0095 s per token: 5% faster, inside the margin
    assert sw.decide(4) is False and "10% under" in sw.last.reason
    sw.record_spec(1, 0.012, emitted_per_seq=3.0)  # batch 1 accepts more: batch 4's acceptance is its own
    assert sw.accepted == {1: 3.0, 4: 2.0}
    assert sw.decide(1) is True and sw.decide(4) is False
    sw.t_spec[4] = 0.016  # 0.008 s per token: 20% faster, it turns on
    assert sw.decide(4) is True
    sw.t_spec[4] = 0.019  # back to 5% faster: once on, it stays on while speculation saves anything
    assert sw.decide(4) is True
    sw.t_spec[4] = 0.021  # 0.0105 s per token: slower, off
    assert sw.decide(4) is False


def test_the_switch_probes_the_kind_it_did_not_choose():
    sw = SpecSwitch("auto", (1, 4, 16), war.SpecSwitchConfig(probe_every=4))
    sw.record_decode(1, True, 0.01)
    sw.record_spec(1, 0.05, 1.2)
    choices = [sw.decide(1) for _ in range(12)]
    assert choices.count(True) == 3 and choices.count(False) == 9


def test_each_batch_class_counts_its_own_decisions_to_its_probes():
    """Decisions alternating between two classes: one global count would land every probe on the same class."""
    sw = SpecSwitch("auto", (1, 4, 16), war.SpecSwitchConfig(probe_every=2))
    for batch in (1, 4):  # speculation loses in both classes
        sw.record_decode(batch, True, 0.01)
        sw.record_spec(batch, 0.05, 1.2)
    choices = {1: [], 4: []}
    for _ in range(6):
        for batch in (1, 4):
            choices[batch].append(sw.decide(batch))
    assert choices == {1: [False, True] * 3, 4: [False, True] * 3}  # each class re-measures speculation
    assert sw.history[1].decisions == sw.history[4].decisions == 6


def test_acceptance_counts_the_tokens_up_to_the_stop_not_the_drafts_verified_past_it():
    """Drafts that are the greedy continuation are all accepted, past the stop token the turn ends on: the switch
    measures the tokens the step emitted (the stop included), not the verified ones."""
    prompt = _repetitive_prompts(1, seed=4)[0]
    out = greedy(MODEL, prompt, 12)
    at = next(i for i in range(1, 4) if out[i] not in out[:i])  # the turn ends on out[at], drafted in one step
    stop = out[at]
    eng = _engine(speculation="on", spec_tokens=4)
    recorded = []
    record = eng.spec_switch.record_spec
    eng.spec_switch.record_spec = lambda batch, seconds, emitted: (recorded.append(emitted),
                                                                   record(batch, seconds, emitted))
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_ids=(stop,))
    for key in ("compile", "measured"):  # the first run compiles its programs (not measured)
        eng.add_draft(key, prompt + out)
        h = eng.submit(Request(prompt, sp, draft_key=key))
        eng.run([h])
        assert eng.get(h).new_tokens == out[:at + 1]
    # prefill gives the first token; one speculative step accepts all 4 drafts and emits those up to the stop
    assert recorded == [float(at)] and eng.stats()["spec_emitted"] == 2 * at
