"""The main job, for now: build (or load) the model on its mesh, run a forward pass, sample.

    python launch/sample.py --config=configs/tiny.py --config.model.num_layers=2

Later issues grow this entry point into agentic RL training; the steps stay the same: read the
config once, build the mesh, the tokenizer and the model, then run.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging
from flax import nnx

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax import config as config_lib
from tiderl_jax.model import chat
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.generate import generate
from tiderl_jax.model.sharding import data_sharding

_CONFIG = config_lib.define_config_flag("configs/tiny.py")
distributed.define_flags()


def main(argv):
    del argv
    console.setup()
    cfg = _CONFIG.value
    try:
        config_lib.apply_platform_settings(cfg)
        mesh, rules, tokenizer, model = config_lib.build(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    mc = model.cfg
    logging.info("model %s: %.2fM parameters, %d layers, vocab %d; mesh %s on %d %s devices",
                 mc.arch, mc.num_params / 1e6, mc.num_layers, mc.vocab_size, dict(mesh.shape),
                 mesh.size, jax.devices()[0].platform)

    messages = [chat.Message("system", cfg.sample.system), chat.Message("user", cfg.sample.prompt)]
    prompt = chat.encode(tokenizer, messages, add_generation_prompt=True).ids
    batch = cfg.sample.batch_size

    # Forward pass: next-token log-likelihood of the prompt under the model, full-sequence mode.
    tokens = np.asarray([prompt] * batch, np.int32)
    positions = np.broadcast_to(np.arange(len(prompt), dtype=np.int32), tokens.shape)
    sharding = data_sharding(mesh, rules, tokens.shape)
    tokens_d, positions_d = jax.device_put(tokens, sharding), jax.device_put(positions, sharding)

    @nnx.jit
    def prompt_nll(model, tokens, positions):
        logits, _ = model(tokens, positions)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    t0 = time.perf_counter()
    nll = float(prompt_nll(model, tokens_d, positions_d))
    logging.info("forward: %d x %d tokens, prompt NLL %.3f nats/token (uniform would be %.3f), %.2fs",
                 batch, len(prompt), nll, np.log(mc.vocab_size), time.perf_counter() - t0)

    # Sampling: the first call compiles, the second is timed.
    kwargs = dict(max_new_tokens=cfg.sample.max_new_tokens, temperature=cfg.sample.temperature,
                  stop_ids=[tokenizer.eos_id], pad_id=tokenizer.pad_id)
    for attempt, seed in enumerate((cfg.seed, cfg.seed + 1)):
        t0 = time.perf_counter()
        out = generate(model, [prompt] * batch, seed=seed, **kwargs)
        dt = time.perf_counter() - t0
        n = sum(len(t) for t in out.tokens)
        logging.info("sample %s: %d sequences, %d new tokens in %.2fs (%.0f tokens/s)",
                     "with compile" if attempt == 0 else "warm", batch, n, dt, n / dt)
    text = tokenizer.decode(out.tokens[0])
    print(f"prompt ({len(prompt)} tokens):\n{tokenizer.decode(prompt)}")
    print(f"sample 0 ({len(out.tokens[0])} tokens, mean log-prob "
          f"{np.mean(out.logprobs[0]):.3f}): {text!r}")
    print(f"done: {mc.arch} {mc.num_params / 1e6:.2f}M params, prompt NLL {nll:.3f}, "
          f"{n / dt:.0f} tokens/s warm sampling on mesh {dict(mesh.shape)}")


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/sample.py"))
