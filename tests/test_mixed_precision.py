"""Mixed precision (`model.dtype=bfloat16`, `model.param_dtype=float32`): bfloat16 activations and matmuls over
float32 master weights; the optimizer state, the log-probs and the loss in float32; the engine in bfloat16 too.
Against the float32 model: log-probs within bfloat16's error, the gradient pointing the same way, the weights
staying float32 through an update, and the engine's sampled log-probs within the same error of the trainer's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from test_trainer import CFG, TRAJS, _config
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.engine.sampling import SamplingParams
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.rl.trainer import Trainer, token_logprobs

MIXED = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="float32")
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 24)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(24), TOKENS.shape)


def _logp(model):
    logp, _ = token_logprobs(model, TOKENS, POSITIONS, jnp.ones_like(TOKENS), 1.0)
    return np.asarray(logp)


def test_mixed_precision_log_probs_are_float32_and_close_to_the_float32_models():
    full, mixed = init_decoder(CFG, seed=1), init_decoder(MIXED, seed=1)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(mixed)))  # master weights
    hidden, _ = mixed(TOKENS, POSITIONS, return_hidden=True)
    assert hidden.dtype == jnp.bfloat16 and mixed.logits(hidden).dtype == jnp.float32
    a, b = _logp(full), _logp(mixed)
    assert a.dtype == b.dtype == np.float32
    delta = np.abs(a - b)[:, 1:]
    assert delta.mean() < 0.02 and delta.max() < 0.1, (delta.mean(), delta.max())
    assert delta.max() > 0  # it is bfloat16: not the float32 arithmetic


def test_a_mixed_precision_update_keeps_float32_state_and_follows_the_float32_gradient():
    grads, trainers = {}, {}
    for name, cfg in (("f32", CFG), ("mixed", MIXED)):
        trainers[name] = Trainer(init_decoder(cfg, seed=2), _config())
        g = trainers[name].gradients(TRAJS)["gradients"]
        grads[name] = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)])
    cosine = grads["f32"] @ grads["mixed"] / np.linalg.norm(grads["f32"]) / np.linalg.norm(grads["mixed"])
    assert cosine > 0.99, cosine
    trainer = trainers["mixed"]
    metrics = trainer.rl_step(TRAJS)
    assert metrics["skipped"] == 0 and np.isfinite(metrics["loss"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(trainer.opt_state))


def _engine_vs_trainer(cfg):
    """|delta log p| per sampled token between the engine's behaviour log-probs and the trainer's forward."""
    model = init_decoder(cfg, seed=3)
    engine = Engine(model, EngineConfig(page_size=8, num_pages=64, max_seq_len=96, max_running=4, prefill_chunk=16))
    assert engine.runner.k_pages[0].dtype == jnp.dtype(cfg.dtype)
    prompts = [[3, 5, 7, 9, 11], list(range(30, 52))]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=4))
    deltas = []
    for p, o in zip(prompts, out):
        tokens = jnp.asarray([p + o.new_tokens], jnp.int32)
        positions = jnp.arange(tokens.shape[1])[None]
        logp, _ = token_logprobs(model, tokens, positions, jnp.ones_like(tokens), 1.0)
        trainer_lp = np.asarray(logp[0, len(p):])
        deltas.extend(np.abs(trainer_lp - np.asarray(o.logp_sample[len(p):], np.float32)))
    return np.asarray(deltas)


def test_the_bfloat16_engines_log_probs_are_the_trainers_within_bfloat16_error():
    """The behaviour log-probs (engine, bfloat16 KV pool) against the trainer's forward (bfloat16) of the same
    tokens: the gap decoupled PPO's importance weights absorb; float32 on both sides agrees to float32 error."""
    f32, mixed = _engine_vs_trainer(CFG), _engine_vs_trainer(MIXED)
    assert f32.max() < 1e-4, f32.max()
    assert 1e-4 < mixed.mean() < 0.05 and np.quantile(mixed, 0.99) < 0.25, (mixed.mean(), np.quantile(mixed, 0.99))
