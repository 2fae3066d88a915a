"""LoRA (`trainer.lora_rank`): adapters that start at zero compute the base model; the trainer trains only the
adapters (the base stays bit-identical, Adam's state is the adapters'), and their gradients equal the gradients of
a reference computed without LoRA (a model whose weights are W + B A written out, differentiated by the chain
rule); on a mesh too; the engine samples from the adapted policy; an export merges them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_trainer import CFG, TRAJS, _config
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.decoder import add_adapters, init_decoder
from tiderl_jax.model.sharding import DEFAULT_RULES, make_mesh, shard_model
from tiderl_jax.rl.trainer import Trainer, token_logprobs

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(12), TOKENS.shape)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_zero_initialised_adapters_compute_the_base_model():
    base = init_decoder(CFG, seed=2)
    adapted = add_adapters(init_decoder(CFG, seed=2), rank=4, alpha=8.0, targets=CFG.lora_targets)
    np.testing.assert_array_equal(base(TOKENS, POSITIONS)[0], adapted(TOKENS, POSITIONS)[0])
    built = init_decoder(dataclasses.replace(CFG, lora_rank=4), seed=2)  # the config's adapters: the same base
    np.testing.assert_array_equal(base(TOKENS, POSITIONS)[0], built(TOKENS, POSITIONS)[0])
    lora = nnx.state(adapted, nnx.LoRAParam)
    assert len(jax.tree.leaves(lora)) == 2 * 7 * CFG.num_layers  # A and B on every projection of every layer


def _merged_params(model):
    """W + scale * A @ B for every adapted projection, as plain arrays keyed like the base weights."""
    out = {}
    for i, layer in enumerate(model.layers):
        for owner in (layer.attn, layer.mlp):
            for name in model.cfg.lora_targets:
                adapter = getattr(owner, name + "_lora", None)
                if adapter is not None:
                    w = getattr(owner, name)[...]
                    out[(i, name)] = (w, adapter.lora_a[...], adapter.lora_b[...], adapter.scale)
    return out


def test_lora_gradients_equal_a_reference_computed_without_lora():
    """d loss / dA and dB from the trainer equal the chain rule through a plain model whose weights are
    W + s A B: dL/dA = s dL/dW B^T, dL/dB = s A^T dL/dW, with dL/dW from the plain (unadapted) model."""
    rng = np.random.default_rng(3)
    model = add_adapters(init_decoder(CFG, seed=4), rank=3, alpha=6.0, targets=("q_proj", "o_proj", "down_proj"))
    for layer in model.layers:  # nonzero adapters, so both factors get gradients
        for owner in (layer.attn, layer.mlp):
            for name in ("q_proj", "o_proj", "down_proj"):
                adapter = getattr(owner, name + "_lora", None)
                if adapter is not None:
                    adapter.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(adapter.lora_b.shape), jnp.float32)
    config = _config(lora_rank=3, lora_alpha=6.0, lora_targets=("q_proj", "o_proj", "down_proj"))
    trainer = Trainer(model, config)
    grads = trainer.gradients(TRAJS)["gradients"]
    assert {type(v) for v in jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, nnx.Variable))} == {nnx.LoRAParam}

    # the reference: a plain model (no adapters) with the merged weights, its full-parameter gradient
    merged = _merged_params(trainer.model())
    plain = init_decoder(CFG, seed=4)
    for (i, name), (w, a, b, s) in merged.items():
        owner = plain.layers[i].attn if name in ("q_proj", "o_proj") else plain.layers[i].mlp
        getattr(owner, name)[...] = w + s * (a @ b).reshape(w.shape)
    reference = Trainer(plain, _config()).gradients(TRAJS)["gradients"]
    for (i, name), (w, a, b, s) in merged.items():
        owner = "attn" if name in ("q_proj", "o_proj") else "mlp"
        d_w = np.asarray(reference["layers"][i][owner][name][...]).reshape(a.shape[0], b.shape[1])
        got = grads["layers"][i][owner][name + "_lora"]
        np.testing.assert_allclose(np.asarray(got["lora_a"][...]), s * d_w @ np.asarray(b).T, rtol=2e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(got["lora_b"][...]), s * np.asarray(a).T @ d_w, rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("mesh_shape", [None, {"data": 1, "fsdp": 2, "tensor": 2}])
def test_the_trainer_trains_only_the_adapters(mesh_shape):
    mesh = mesh_shape and make_mesh(mesh_shape, jax.devices()[:4])
    model = init_decoder(CFG, seed=5)
    if mesh is not None:
        model = shard_model(model, mesh, DEFAULT_RULES)
    trainer = Trainer(model, _config(lora_rank=2, learning_rate=1e-2), mesh=mesh)  # adapters added here
    base_before = _leaves(nnx.split_state(trainer.params, nnx.LoRAParam, ...)[1])
    lora_before = _leaves(nnx.split_state(trainer.params, nnx.LoRAParam, ...)[0])
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in lora_before)  # Adam's two moments: adapters only
    for _ in range(2):
        metrics = trainer.rl_step(TRAJS)
    assert metrics["skipped"] == 0
    for a, b in zip(base_before, _leaves(nnx.split_state(trainer.params, nnx.LoRAParam, ...)[1])):
        np.testing.assert_array_equal(a, b)  # the base never moves
    assert any(np.abs(a - b).max() > 0 for a, b in zip(lora_before, _leaves(nnx.split_state(trainer.params, nnx.LoRAParam, ...)[0])))
    logp, _ = token_logprobs(trainer.model(), TOKENS, POSITIONS, jnp.ones_like(TOKENS), 1.0)
    base_logp, _ = token_logprobs(init_decoder(CFG, seed=5), TOKENS, POSITIONS, jnp.ones_like(TOKENS), 1.0)
    assert np.abs(np.asarray(logp) - np.asarray(base_logp)).max() > 1e-4  # the policy changed through them


def test_lora_config_is_checked():
    with pytest.raises(ConfigError, match="lora_targets=.* must be a non-empty subset"):
        _config(lora_rank=2, lora_targets=("q_proj", "lm_head"))
    with pytest.raises(ConfigError, match="with LoRA .* set shared_prompt='off'"):
        _config(lora_rank=2, shared_prompt="exact")
    with pytest.raises(ConfigError, match="the model's LoRA rank is 4 and trainer.lora_rank 2"):
        Trainer(init_decoder(dataclasses.replace(CFG, lora_rank=4), seed=0), _config(lora_rank=2))


def _trained_lora_model(seed=6):
    """A model with nonzero adapters (two updates of a LoRA trainer)."""
    trainer = Trainer(init_decoder(CFG, seed=seed), _config(lora_rank=2, learning_rate=3e-2))
    trainer.rl_step(TRAJS)
    trainer.rl_step(TRAJS)
    return trainer


def test_the_hf_export_merges_the_adapters(tmp_path):
    from tiderl_jax.model.hf_io import export_policy, load_hf_checkpoint
    from tiderl_jax.model.tokenizer import Tokenizer
    trainer = _trained_lora_model()
    export_policy(trainer.graphdef, trainer.params, Tokenizer.builtin(), tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.cfg.lora_rank == 0 and not nnx.state(loaded, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(loaded(TOKENS, POSITIONS)[0]),
                               np.asarray(trainer.model()(TOKENS, POSITIONS)[0]), rtol=1e-4, atol=1e-4)


def test_the_engine_samples_from_the_adapted_policy_and_a_sync_moves_only_the_adapters():
    from engine_reference import greedy
    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.model.decoder import split_adapters
    from tiderl_jax.engine.sampling import SamplingParams
    from tiderl_jax.runtime.devices import WeightSync
    trainer = _trained_lora_model()
    engine = Engine(init_decoder(dataclasses.replace(CFG, lora_rank=2), seed=6),  # adapters at zero
                    EngineConfig(page_size=8, num_pages=64, max_seq_len=96, max_running=4, prefill_chunk=16))
    moved = split_adapters(trainer.params)[0]
    record = WeightSync().publish(moved, 1, target_shardings=split_adapters(engine.runner.param_shardings or
                                                                      jax.tree.map(lambda x: x.sharding, engine.runner.params))[0],
                                  drain=lambda: None, swap=engine.update_params)
    assert record.ok, record.error
    total = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    assert record.bytes == sum(x.nbytes for x in jax.tree.leaves(moved)) < total / 5  # the adapters alone
    prompts = [[5, 9, 2, 7], list(range(20, 45))]
    policy = trainer.model()
    for p, o in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))):
        assert o.new_tokens == greedy(policy, p, 8)
    assert any(o.new_tokens != greedy(init_decoder(CFG, seed=6), p, 8)
               for p, o in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))))


def test_the_main_jobs_model_gets_the_trainers_adapters_on_its_mesh():
    """`config.build` adds `trainer.lora_rank`'s adapters before the engines, the trainer and the reference copy
    the model (so all three share them), placed on the model's mesh."""
    from configs import tiny_agentic
    from tiderl_jax import config as config_lib
    cfg = tiny_agentic.get_config()
    cfg.trainer.lora_rank, cfg.trainer.lora_targets = 3, ("q_proj", "v_proj")
    mesh, _, _, model = config_lib.build(cfg)
    assert model.cfg.lora_rank == 3 and model.cfg.lora_targets == ("q_proj", "v_proj")
    lora = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert len(lora) == 2 * 2 * model.cfg.num_layers
    assert all(x.sharding.mesh.shape == mesh.shape and x.sharding.is_fully_replicated for x in lora)
