"""Sharded over an fsdp x tensor mesh of 8 faked CPU devices, the model computes what it computes on one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import FIXTURES
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import Decoder, KVCache, init_decoder
from tiderl_jax.model.hf_io import load_hf_checkpoint
from tiderl_jax.model.sharding import (DEFAULT_RULES, data_sharding, init_sharded, make_mesh,
                                       shard_model, spec_for)

CFG = ModelConfig(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def test_eight_devices_are_faked():
    assert jax.device_count() == 8


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 1, "fsdp": 4, "tensor": 2})


@nnx.jit
def _forward(model, tokens, positions):
    return model(tokens, positions)[0]


def _inputs(mesh, vocab, shape=(4, 16)):
    tokens = np.random.default_rng(0).integers(0, vocab, shape).astype(np.int32)
    positions = np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape)
    sh = data_sharding(mesh, DEFAULT_RULES, shape)
    return tokens, positions, jax.device_put(tokens, sh), jax.device_put(positions, sh)


def test_sharded_init_equals_single_device_logits(mesh):
    single = init_decoder(CFG, seed=3)
    sharded = init_sharded(lambda: Decoder(CFG, rngs=nnx.Rngs(3)), mesh, DEFAULT_RULES)
    q = sharded.layers[0].attn.q_proj[...]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (64 // 4, 4 // 2, 16)
    tokens, positions, tokens_d, positions_d = _inputs(mesh, CFG.vocab_size)
    want = np.asarray(_forward(single, jnp.asarray(tokens), jnp.asarray(positions)))
    got = _forward(sharded, tokens_d, positions_d)
    assert got.sharding.spec[0] is not None  # the batch stayed sharded through the model
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_checkpoint_loaded_onto_mesh_equals_single_device(mesh):
    single = load_hf_checkpoint(FIXTURES / "qwen2")
    sharded = load_hf_checkpoint(FIXTURES / "qwen2", mesh=mesh, rules=DEFAULT_RULES)
    emb = sharded.embed[...]
    assert isinstance(emb.sharding, NamedSharding) and emb.sharding.spec == P("tensor", "fsdp")
    assert {s.data.shape for s in emb.addressable_shards} == {(128, 16)}  # each device holds 1/8
    bias = sharded.layers[0].attn.k_bias[...]  # 2 KV heads over tensor=2
    assert bias.sharding.spec == P("tensor", None)
    tokens, positions, tokens_d, positions_d = _inputs(mesh, 256)
    want = np.asarray(_forward(single, jnp.asarray(tokens), jnp.asarray(positions)))
    np.testing.assert_allclose(np.asarray(_forward(sharded, tokens_d, positions_d)), want,
                               atol=1e-5, rtol=0)


def test_cached_decode_on_mesh_equals_single_device(mesh):
    single = init_decoder(CFG, seed=4)
    sharded = shard_model(init_decoder(CFG, seed=4), mesh, DEFAULT_RULES)
    assert sharded.layers[1].mlp.down_proj[...].sharding.spec == P("tensor", "fsdp")
    tokens = np.random.default_rng(5).integers(0, 128, (4, 9)).astype(np.int32)

    @nnx.jit
    def run(model, tokens):
        cache = KVCache.init(CFG, 4, 16)
        pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
        _, cache = model(tokens[:, :8], pos, cache=cache)
        logits, _ = model(tokens[:, 8:9], cache.lengths[:, None], cache=cache)
        return logits

    np.testing.assert_allclose(np.asarray(run(sharded, jnp.asarray(tokens))),
                               np.asarray(run(single, jnp.asarray(tokens))), atol=1e-5, rtol=0)


def test_spec_for_drops_axes_that_do_not_divide(mesh):
    assert spec_for((64, 4, 16), ("embed", "q_heads", "head_dim"), DEFAULT_RULES, mesh) == P("fsdp", "tensor", None)
    assert spec_for((64, 3, 16), ("embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh) == P("fsdp", None, None)
    assert spec_for((6, 8), ("batch", "seq"), DEFAULT_RULES, mesh) == P(None, None)
    # a mesh axis is used once per array, by the first dimension that asks for it
    rules = (("a", "tensor"), ("b", "tensor"))
    assert spec_for((4, 4), ("a", "b"), rules, mesh) == P("tensor", None)
    both = (("batch", ("fsdp", "tensor")),)
    assert spec_for((16, 3), ("batch", None), both, mesh) == P(("fsdp", "tensor"), None)


def test_mesh_errors_are_clear():
    with pytest.raises(ConfigError, match="needs 6 devices, 8 given"):
        make_mesh({"data": 1, "fsdp": 3, "tensor": 2})
    with pytest.raises(ConfigError, match="cannot fill 8 devices"):
        make_mesh({"fsdp": -1, "tensor": 3})
    with pytest.raises(ConfigError, match="unknown axis name"):
        make_mesh({"fsdp": -1, "pipeline": 2})
    assert dict(make_mesh({"fsdp": -1, "tensor": 2}).shape) == {"data": 1, "fsdp": 4, "tensor": 2, "context": 1}
