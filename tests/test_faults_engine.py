"""Engine workers: token checkpoints and continuations, the parameter service, and failover. Worker
processes are SIGKILLed (or hung) mid-generation; generations finish on the standby (or a cold
replacement) with the tokens an unfaulted run produces."""

import os
import signal
import time

import numpy as np
import pytest

from tiderl_jax.engine.engine import Engine, EngineConfig, Request
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.faults.engine_worker import (
    EngineClient,
    ParamService,
    TokenCheckpoint,
    WorkerSpec,
    continuation,
    host_params,
)
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder

CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
MODEL = init_decoder(CFG, seed=3)
# 7 programs to compile per worker; decode_steps=2 and a step delay make a generation last ~1 s
ENGINE = EngineConfig(page_size=8, num_pages=64, max_seq_len=64, max_running=4, prefill_chunk=16,
                      max_prefill_rows=2, prefill_budget=32, decode_steps=2)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7)
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 7, 77, 12], [300, 2, 9, 44, 61]]


def _reference(prompt, sampling):
    return Engine(MODEL, ENGINE).generate([prompt], sampling)[0]


def test_continuation_keeps_the_sampling_stream():
    # a seeded sample continued elsewhere from its first 8 tokens (sample_offset=8) draws the
    # same random keys: the same tokens as the uninterrupted sample
    full = _reference(PROMPTS[0], SAMPLED)
    ckpt = TokenCheckpoint(0, PROMPTS[0], SAMPLED, tokens=full.new_tokens[:8])
    prompt, sampling, offset = continuation(ckpt)
    assert prompt == PROMPTS[0] + full.new_tokens[:8] and offset == 8
    assert sampling.max_new_tokens == 32 and sampling.seed == 7
    eng = Engine(MODEL, ENGINE)
    h = eng.submit(Request(prompt, sampling, sample_offset=offset))
    eng.run([h])
    assert eng.get(h).new_tokens == full.new_tokens[8:]
    np.testing.assert_allclose(eng.get(h).logp_model[-32:], full.logp_model[-32:], atol=1e-4)
    with pytest.raises(RequestError, match="sample_offset=-1"):
        eng.submit(Request(prompt, sampling, sample_offset=-1))


def test_continuation_refuses_finished_or_inconsistent_checkpoints():
    with pytest.raises(ValueError, match="has finished"):
        continuation(TokenCheckpoint(1, [1], GREEDY, tokens=[2], finish_reason="stop"))
    with pytest.raises(ValueError, match="inconsistent"):
        continuation(TokenCheckpoint(2, [1], SamplingParams(max_new_tokens=2), tokens=[2, 3]))


def test_param_service_holds_host_copies_and_moves_forward():
    service = ParamService(MODEL, version=2)
    version, params = service.latest()
    assert version == 2 and isinstance(params["embed"], np.ndarray)
    assert sum(x.size for x in _leaves(params)) == sum(x.size for x in _leaves(host_params(MODEL)))
    with pytest.raises(ValueError, match="version 1 is older than the published 2"):
        service.publish(MODEL, 1)
    with pytest.raises(RuntimeError, match="publish"):
        ParamService().latest()
    with pytest.raises(TypeError, match="not list"):
        host_params([1, 2])


def _leaves(tree):
    return [y for v in tree.values() for y in (_leaves(v) if isinstance(v, dict) else [v])]


def _wait_for(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@pytest.mark.e2e
def test_killed_worker_fails_over_to_the_standby_with_token_checkpoints():
    # 32 steps (about 5 s) from the 8th token to the check before the kill: a loaded machine's update and short
    # request fit in between (at 0.05 s a step the greedy request had finished there)
    spec = WorkerSpec(CFG, ENGINE, step_delay_s=0.15)
    client = EngineClient(spec, ParamService(MODEL, version=0), standby=True)
    try:
        assert client.wait_standby(300)
        assert client.standby.info["programs"] == 9  # compiled before it is needed (the whole grid: Engine.grid)
        greedy = client.submit(PROMPTS[0], GREEDY)
        sampled = client.submit(PROMPTS[1], SAMPLED)
        short_sp = SamplingParams(temperature=0.0, max_new_tokens=2)
        short = client.submit(PROMPTS[1], short_sp)
        _wait_for(lambda: len(client.checkpoint(greedy).tokens) >= 8)
        client.update_params(MODEL, 1)  # same weights, new version: sent to primary and standby
        assert client.wait(short, 60).tokens == _reference(PROMPTS[1], short_sp).new_tokens
        before = client.checkpoint(greedy)
        assert 8 <= len(before.tokens) < 40
        os.kill(client.primary.pid, signal.SIGKILL)
        g, s = client.wait(greedy, 120), client.wait(sampled, 120)
    finally:
        client.close()
    event, = client.failovers
    assert event.promoted_standby and event.resumed == 2 and "exited with code -9" in event.reason
    assert g.failovers == 1 and g.finish_reason == "length"
    ref = _reference(PROMPTS[0], GREEDY)
    assert g.tokens == ref.new_tokens
    np.testing.assert_allclose(g.logp_model, ref.logp_model[-40:], atol=1e-4)
    assert s.tokens == _reference(PROMPTS[1], SAMPLED).new_tokens  # the seeded stream continues
    # per-token versions: the tokens from before the crash keep theirs (the promoted standby,
    # on version 1, would have stamped 1 on everything it recomputed)
    assert g.versions[:len(before.tokens)] == before.versions
    assert before.versions[:8] == [0] * 8 and g.versions[-1] == 1
    assert g.versions == sorted(g.versions) and set(g.versions) == {0, 1}
    assert g.logp_sample[:len(before.tokens)] == before.logp_sample
    with pytest.raises(KeyError, match="already returned"):
        client.wait(greedy)  # delivered exactly once


@pytest.mark.e2e
def test_hung_worker_is_declared_failed_by_health_checks_and_replaced_cold():
    # also: a request the worker refuses comes back as a RequestError, the worker serving on
    spec = WorkerSpec(CFG, ENGINE, step_delay_s=0.05)
    client = EngineClient(spec, ParamService(MODEL, version=4), standby=False, health_interval_s=0.1,
                          health_threshold=3)
    try:
        bad = client.submit([1, 2, 999], GREEDY)  # a token id outside the vocabulary
        with pytest.raises(RequestError, match=r"token ids \[999\] outside \[0, 384\)"):
            client.wait(bad, 60)
        rid = client.submit(PROMPTS[0], GREEDY)
        _wait_for(lambda: len(client.checkpoint(rid).tokens) >= 4)
        hung = client.primary
        client.inject_hang(600)
        out = client.wait(rid, 300)
        assert not hung.proc.is_alive()  # the hung worker was killed, not left serving
    finally:
        client.close()
    event, = client.failovers
    assert not event.promoted_standby and "3 consecutive health checks unanswered" in event.reason
    assert out.tokens == _reference(PROMPTS[0], GREEDY).new_tokens and out.failovers == 1
    assert set(out.versions) == {4}


def test_client_rejects_bad_settings_and_reports_refused_requests():
    with pytest.raises(ValueError, match="'fork'"):
        EngineClient(WorkerSpec(CFG, ENGINE), ParamService(MODEL), start_method="fork")
    with pytest.raises(ValueError, match="health_threshold=0"):
        EngineClient(WorkerSpec(CFG, ENGINE), ParamService(MODEL), health_threshold=0)
