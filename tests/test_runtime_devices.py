"""Device pool, role meshes, weight sync (with rollback) and moving an engine between meshes."""

import jax
import numpy as np
import pytest
from flax import nnx

from tiderl_jax.engine.engine import Engine, EngineConfig, Request
from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, shard_model
from tiderl_jax.runtime.devices import DevicePool, WeightSync, model_on

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, dtype="float32")


def test_split_meshes_and_moves():
    pool = DevicePool.split(jax.devices(), group_size=2, rollout=2, train=2, tensor=2)
    assert pool.num_groups("rollout") == 2 and pool.num_groups("ref") == 0
    roll, train = pool.mesh("rollout"), pool.mesh("train")
    assert set(roll.devices.flat).isdisjoint(train.devices.flat)
    assert dict(roll.shape) == {"data": 1, "fsdp": 2, "tensor": 2, "context": 1}
    assert pool.mesh("ref") is None
    moved = pool.moved("train", "rollout")
    assert moved.num_groups("rollout") == 3 and moved.num_groups("train") == 1
    assert len(moved.devices_of("rollout")) == 6
    assert dict(moved.mesh("rollout").shape) == {"data": 1, "fsdp": 3, "tensor": 2, "context": 1}
    back = moved.moved("rollout", "train")
    assert sorted(back.devices_of("train"), key=id) == sorted(pool.devices_of("train"), key=id)
    with pytest.raises(ConfigError, match="has no group"):
        pool.moved("ref", "train")
    with pytest.raises(ConfigError, match="= 6, but there are 8"):
        DevicePool.split(jax.devices(), group_size=2, rollout=1, train=2)


def test_weight_sync_publishes_and_rolls_back():
    pool = DevicePool.split(jax.devices(), group_size=4, rollout=1, train=1, tensor=2)
    train_model = shard_model(init_decoder(CFG, seed=1), pool.mesh("train"), DEFAULT_RULES)
    roll_model = shard_model(init_decoder(CFG, seed=2), pool.mesh("rollout"), DEFAULT_RULES)
    engine = Engine(roll_model, EngineConfig(page_size=8, num_pages=64, max_seq_len=128, max_running=8))
    params = nnx.split(train_model)[1]
    sync = WeightSync()
    rec = sync.publish(params, 1, target_shardings=engine.runner.param_shardings, drain=lambda: None,
                       swap=engine.update_params)
    assert rec.ok and engine.version == 1
    for a, b in zip(jax.tree.leaves(engine.runner.params), jax.tree.leaves(params)):
        assert a.sharding.device_set == set(pool.devices_of("rollout"))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def broken(p, v):
        raise RuntimeError("link down")
    before = jax.tree.leaves(engine.runner.params)
    rec = sync.publish(params, 2, target_shardings=engine.runner.param_shardings, drain=lambda: None,
                       swap=broken)
    assert not rec.ok and rec.stage == "publish" and "link down" in rec.error
    assert engine.version == 1 and all(a is b for a, b in zip(before, jax.tree.leaves(engine.runner.params)))


def test_engine_moved_to_a_bigger_mesh_continues_identically():
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46]]
    cfg = EngineConfig(page_size=8, num_pages=64, max_seq_len=128, max_running=8, decode_steps=4)
    still = Engine(init_decoder(CFG, seed=3), cfg)
    expected = [o.new_tokens for o in still.generate(prompts, greedy)]

    small = DevicePool.split(jax.devices(), group_size=2, rollout=1, train=3, tensor=2)
    engine = Engine(shard_model(init_decoder(CFG, seed=3), small.mesh("rollout"), DEFAULT_RULES), cfg)
    handles = [engine.submit(Request(p, greedy)) for p in prompts]
    for _ in range(3):
        engine.step()
    big = small.moved("train", "rollout").moved("train", "rollout")
    engine.move_to(model_on(engine.runner.graphdef, engine.runner.params, big.mesh("rollout"), DEFAULT_RULES))
    engine.run(handles)
    assert [engine.get(h).new_tokens for h in handles] == expected
    assert engine.stats()["moves"] == 1
    leaf = jax.tree.leaves(engine.runner.params)[0]
    assert len(leaf.sharding.device_set) == 6


def test_an_engine_on_a_one_device_mesh_and_a_sharded_one_take_the_cpu_kernel():
    from tiderl_jax.engine.cpu_attention import available
    assert available(), "the C++ paged-attention kernel did not build here"
    pool = DevicePool.split(jax.devices()[:4], group_size=1, rollout=2, train=2, tensor=1)
    model = init_decoder(CFG, seed=0)
    graphdef, params = nnx.graphdef(model), nnx.state(model)
    rollout = pool.mesh("rollout")
    one_device = jax.sharding.Mesh(rollout.devices.reshape(-1)[:1].reshape((1,) * rollout.devices.ndim),
                                   rollout.axis_names)
    config = EngineConfig(page_size=4, num_pages=32, max_seq_len=32, max_running=2, prefill_chunk=8)
    one = Engine(model_on(graphdef, params, one_device, DEFAULT_RULES), config)
    two = Engine(model_on(graphdef, params, rollout, DEFAULT_RULES), config)
    assert one.runner.impl == "cpu" and two.runner.impl == "cpu"  # the sharded one per kv-head shard
    prompt = [5, 7, 11, 13, 17]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert one.generate([prompt], greedy)[0].tokens == two.generate([prompt], greedy)[0].tokens
