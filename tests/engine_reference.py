"""The naive references the engine is tested against: full recompute of the whole sequence, no cache."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiderl_jax.model.vision import dense_inputs

_WIDTH = 256


@nnx.jit
def _logits(model, tokens, positions, patches=None, patch_index=None):
    return model(tokens, positions, patches=patches, patch_index=patch_index)[0]


def full_logits(model, seq, images=()):
    """Logits [len(seq), vocab] of one sequence by one full forward (padded: causal, so harmless).

    `images`: the sequence's `ImageSpan`s (a vision model gets its image inputs, even with none).
    """
    width = _WIDTH if len(seq) <= _WIDTH else len(seq)
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(seq)] = seq
    image_inputs = ()
    if model.cfg.is_vision:
        patches, index = dense_inputs(images, 0, width, model.cfg.image_patch_dim)
        image_inputs = (jnp.asarray(patches[None]), jnp.asarray(index[None]))
    positions = jnp.arange(width, dtype=jnp.int32)[None]
    return np.asarray(_logits(model, jnp.asarray(padded), positions, *image_inputs))[0, :len(seq)]


def greedy(model, prompt, n, stop_ids=(), images=()):
    """Greedy continuation by recomputing the full forward at every step."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(full_logits(model, seq, images)[-1]))
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


def token_logprobs(model, seq, temperature=1.0, images=()):
    """log p(seq[i] | seq[:i]) for every i >= 1 under the model (and at `temperature`)."""
    logits = full_logits(model, seq, images)[:-1]
    lp = jax.nn.log_softmax(jnp.asarray(logits) / temperature, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(seq[1:])[:, None], axis=-1)[:, 0])
