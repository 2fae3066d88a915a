"""The JetStream verbs (prefill / insert / generate) give the reference's greedy tokens."""

import numpy as np
import pytest

from conftest import FIXTURES
from engine_reference import greedy
from tiderl_jax.engine.jetstream import JetStreamEngine
from tiderl_jax.engine.sampling import RequestError
from tiderl_jax.model.hf_io import load_hf_checkpoint

MODEL = load_hf_checkpoint(FIXTURES / "qwen2")


def test_prefill_insert_generate_equals_reference():
    js = JetStreamEngine(MODEL, max_slots=4, max_seq_len=128, page_size=8, num_pages=64)
    params = js.load_params()
    state = js.init_decode_state()
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(0, 256, 9).tolist(), 2: rng.integers(0, 256, 21).tolist()}
    firsts = {}
    for slot, p in prompts.items():
        padded = p + [0] * 3  # true_length excludes the padding
        prefix, firsts[slot] = js.prefill(params, None, padded, len(p))
        state = js.insert(prefix, state, slot)
    outs = {s: [firsts[s]] for s in prompts}
    for _ in range(7):
        state, result = js.generate(params, state)
        assert result.valid.tolist() == [True, False, True, False]
        for s in prompts:
            outs[s].append(int(result.tokens[s]))
    for s, p in prompts.items():
        assert outs[s] == greedy(MODEL, p, 8)


def test_existing_prefix_continues_a_context():
    js = JetStreamEngine(MODEL, max_slots=2, max_seq_len=128, page_size=8, num_pages=32)
    params = js.load_params()
    a, b = [5, 6, 7, 8, 9], [10, 11, 12]
    prefix, _ = js.prefill(params, None, a, len(a))
    prefix, first = js.prefill(params, prefix, b, len(b))
    assert prefix.length == 8
    state = js.insert(prefix, js.init_decode_state(), 1)
    state, result = js.generate(params, state)
    assert [first, int(result.tokens[1])] == greedy(MODEL, a + b, 2)


def test_bad_lengths_are_refused():
    js = JetStreamEngine(MODEL, max_slots=1, max_seq_len=32, page_size=8, num_pages=8)
    with pytest.raises(RequestError, match="true_length=0"):
        js.prefill(js.load_params(), None, [1, 2], 0)
    with pytest.raises(RequestError, match="max_seq_len 32"):
        js.prefill(js.load_params(), None, list(range(40)), 40)
