"""LongStraw: the gradient of G responses to one long prompt, with the prompt run once.

docs/mechanisms.md (LongStraw, long-context GRPO). A GRPO group is one prompt of P tokens and G
responses of up to R tokens. The standard gradient (`standard_grad`) runs G full sequences
[prompt + response_g]: its activations hold G copies of the prompt's, including G attention maps
of (P + R)^2 per layer. LongStraw (`longstraw_grad`) runs the prompt once and replays each response
against the prompt's captured keys and values.

Loss (the same in both functions):

    total = sum_g loss_fn(logp[g] [R], mask[g] [R], per_response[g])
    logp[g, j] = log p(responses[g, j] | prompt, responses[g, :j])   (positions P + j)

`mask` marks the tokens the loss counts; every token of `responses` (padding included) is context
for the tokens after it, in both functions, so padding at the end of a ragged response changes
nothing. `per_response` is any pytree of arrays with leading axis G (advantages, old and reference
log-probs, ...); `loss_fn` sees one response's slice.

The algorithm (one jitted program):

1. **Prompt forward, once** (positions 0..P-1) in the decoder's cached mode with an empty
   `PromptKV`: it returns the per-layer keys and values [1, kv_heads, P, head_dim] (after k-norm and
   RoPE, as attention reads them) and the final hidden state of the last prompt position [embed],
   which predicts every response's first token. Together these are the prompt state.
   Exact mode runs it under `jax.vjp`; approximate mode runs it as a plain forward.
2. **Replay, one response at a time** (`lax.scan` over G): the response runs in cached mode on top
   of the prompt state (positions P..P+R-1; its queries attend to the prompt's K/V and causally to
   its own). Its first token's log-prob comes from the prompt's last hidden state, the others from
   the response's own hidden states. `value_and_grad` gives its loss and gradients w.r.t. the
   parameters, and in exact mode w.r.t. the prompt state (K/V and last hidden state) too.
   Parameter gradients and prompt-state cotangents are summed over the group.
3. **Exact mode**: the summed prompt-state cotangent is pulled back through the prompt's vjp once
   and added to the parameter gradients. The result equals `standard_grad` up to float rounding.
   **Approximate mode** (the paper's): no step 3; the prompt state is a constant, so gradient flows
   only through the responses' own computations (their tokens' layers, and the LM head applied to
   the prompt's last hidden state).

What is live in memory, and when:

- throughout: the parameters, the gradient accumulator (one parameter-sized tree) and the prompt
  state (2 x layers x P x kv_heads x head_dim, plus one hidden vector);
- exact mode, from step 1 to step 3: the prompt forward's residuals (one P-token forward's
  activations, including each layer's attention map [heads, P, P]) and the prompt-state cotangent
  accumulator (the size of the prompt state);
- during step 2: one response's forward and backward (its attention maps [heads, R, P + R] and a
  concatenated copy of each layer's K/V [kv_heads, P + R, head_dim]). The scan body holds one
  response at a time, so this term does not grow with G.

So approximate mode's peak is nearly independent of G (it never keeps the prompt's activations),
exact mode's is one prompt's activations plus one response's, and the standard gradient's is G
times (prompt + response). The benchmark `benchmarks/long_context.py` measures all three.

In the train step: `group_gradient` and `group_logprobs` are the traced cores that `rl/shared_prompt.py`
calls for every GRPO group sharing a prompt (`trainer.shared_prompt`); they take the prompt right-padded
to a length bucket with its real `length`. A model placed on a mesh whose `context` axis is larger than 1
runs the prompt context-parallel (`context_mesh`): its tokens, activations and K/V sharded over that axis,
attention by `rl/context_parallel.py`'s ring, and each replay reading the sharded K/V with log-sum-exp
merging (`ContextParallelKV` in place of `PromptKV`).

The prompt state is held by `PromptKV`, a small implementation of the decoder's `Cache` protocol
that concatenates its keys and values with the new tokens' instead of writing into a preallocated
dense `KVCache`: the same class captures the prompt (starting empty) and replays a response
(starting from the prompt), the replay needs no buffer of size P + R filled with zeros, and the
cotangent w.r.t. the prompt K/V is plain slicing of the concatenation's cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import NamedSharding, PartitionSpec

from tiderl_jax.model.decoder import attend
from tiderl_jax.rl.context_parallel import ContextParallelKV

MODES = ("exact", "approximate")

# loss_fn(logp [R] float32, mask [R] bool, per_response slice) -> scalar loss of one response.
ResponseLoss = Callable[[jax.Array, jax.Array, Any], jax.Array]


@flax.struct.dataclass
class PromptKV:
    """A growing KV prefix for the decoder's cached mode (the `Cache` protocol of decoder.py).

    k, v: one array per layer, each [batch, kv_heads, S, head_dim]. A call with T new tokens
    attends them to all S cached positions and causally among themselves, and `advance` returns the
    prefix extended by all T tokens (`num_new` is not used: padding sits at the end of a response,
    where causality hides it from the real tokens). `valid` [S] bool (None: all) marks the real keys
    of a prompt padded at its end to a length bucket; the padding keys are never attended to.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array | None = None

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int, dtype) -> "PromptKV":
        zero = jnp.zeros((1, kv_heads, 0, head_dim), dtype)
        return cls(k=(zero,) * num_layers, v=(zero,) * num_layers)

    def attend_layer(self, i, q, k, v, constrain):
        """q [b, t, h, d], k/v [b, t, kv, d] -> (out [b, t, h, d], (k_i, v_i) [b, kv, S + t, d])."""
        k = jnp.concatenate([self.k[i], k.transpose(0, 2, 1, 3).astype(self.k[i].dtype)], axis=2)
        v = jnp.concatenate([self.v[i], v.transpose(0, 2, 1, 3).astype(self.v[i].dtype)], axis=2)
        if constrain is not None:
            k = constrain(k, ("batch", "kv_heads", "cache_seq", "head_dim"))
            v = constrain(v, ("batch", "kv_heads", "cache_seq", "head_dim"))
        b, t = q.shape[:2]
        prefix = self.k[i].shape[2]
        q_abs = prefix + jnp.arange(t)  # index of each query among the keys
        mask = jnp.arange(prefix + t)[None, :] <= q_abs[:, None]
        if self.valid is not None:
            mask = mask & jnp.concatenate([self.valid, jnp.ones((t,), bool)])[None, :]
        out = attend(q, k.astype(q.dtype), v.astype(q.dtype), jnp.broadcast_to(mask, (b, t, prefix + t)))
        return out, (k, v)

    def advance(self, layer_states, num_new):
        k = tuple(s[0] for s in layer_states)
        valid = self.valid
        if valid is not None:
            valid = jnp.concatenate([valid, jnp.ones((k[0].shape[2] - valid.shape[0],), bool)])
        return PromptKV(k=k, v=tuple(s[1] for s in layer_states), valid=valid)


@flax.struct.dataclass
class PromptState:
    """What the responses need from the prompt: its K/V and its last position's final hidden state."""

    kv: PromptKV
    last_hidden: jax.Array  # [embed], after the final norm: predicts each response's first token


def _token_outputs(model, hidden: jax.Array, tokens: jax.Array, temperature: float = 1.0):
    """hidden [b, R, embed] (the state before each token) and tokens [b, R] -> (log-probs, entropies)
    [b, R] float32 of the sampling distribution `log_softmax(logits / temperature)`, as the trainer's."""
    logp_all = jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _prompt_state(graphdef, params, prompt: jax.Array, length: jax.Array) -> PromptState:
    """Prompt forward (positions 0..P-1, batch 1) -> its K/V and the hidden state at `length` - 1.

    Tokens at `length` and after are padding (a prompt length bucket): causality keeps them out of
    the real positions, and the replay masks their keys (`_replay`)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    mesh = context_mesh(model)
    tokens, positions = prompt[None], jnp.arange(prompt.shape[0], dtype=jnp.int32)[None]
    if mesh is None:
        empty = PromptKV.empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    else:  # the prompt's tokens, activations and K/V sharded over the context axis, ring attention
        empty = ContextParallelKV.empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
                                        mesh=mesh, axis="context")
        seq = NamedSharding(mesh, PartitionSpec(None, "context"))
        tokens, positions = (jax.lax.with_sharding_constraint(x, seq) for x in (tokens, positions))
    hidden, kv = model(tokens, positions, cache=empty, return_hidden=True)
    return PromptState(kv=kv, last_hidden=jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=False))


def context_mesh(model):
    """The mesh of a model placed with a context axis of size > 1 (its prompts run context-parallel), else None."""
    sharding = getattr(model, "activation_sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return mesh if mesh is not None and mesh.shape.get("context", 1) > 1 else None


def _replay(model, state: PromptState, length, tokens, temperature):
    """One response [R] on the prompt state -> (log-probs, entropies) [R] of its tokens."""
    size = state.kv.k[0].shape[2]
    kv = state.kv.replace(valid=jnp.arange(size) < length) if size else state.kv
    positions = length + jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    hidden, _ = model(tokens[None], positions, cache=kv, return_hidden=True)
    # Token j is predicted by the state before it: the prompt's last position for j = 0, else
    # response position j - 1 (the last response position predicts nothing here).
    before = jnp.concatenate([state.last_hidden[None, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
    logp, entropy = _token_outputs(model, before, tokens[None], temperature)
    return logp[0], entropy[0]


def _response_loss(graphdef, params, state: PromptState, length, tokens, mask, extra, loss_fn, temperature):
    """One response replayed on the prompt state -> loss_fn's (loss, aux)."""
    logp, entropy = _replay(nnx.merge(graphdef, params), state, length, tokens, temperature)
    return loss_fn(logp, entropy, mask, extra)


@dataclasses.dataclass(frozen=True)
class _NoAux:
    """A public `ResponseLoss` (logp, mask, extra) -> loss, as the internal (logp, entropy, mask, extra) ->
    (loss, aux); hashable by the function, so the compiled program is reused across calls."""

    fn: Callable

    def __call__(self, logp, entropy, mask, extra):
        return self.fn(logp, mask, extra), ()


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def group_gradient(graphdef, params, prompt, length, responses, mask, per_response, *, loss_fn, mode,
                   temperature=1.0):
    """The traced core (call it inside a jit): sum over the group of `loss_fn`'s losses and their gradient.

    prompt [P] (real tokens up to `length`, padding after), responses [G, R], mask [G, R],
    per_response: pytree of [G, ...]. loss_fn(logp [R], entropy [R], mask [R], extra) -> (loss, aux).
    Returns (total loss, gradients like `params`, aux stacked over G)."""
    if mode == "exact":
        state, pullback = jax.vjp(lambda p: _prompt_state(graphdef, p, prompt, length), params)
    else:
        state = jax.lax.stop_gradient(_prompt_state(graphdef, params, prompt, length))

    def one(p, s, tokens, m, extra):
        return _response_loss(graphdef, p, s, length, tokens, m, extra, loss_fn, temperature)

    def body(carry, xs):
        loss, grads, state_ct = carry
        if mode == "exact":
            (value, aux), (g, ct) = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(params, state, *xs)
            state_ct = _tree_add(state_ct, ct)
        else:
            (value, aux), g = jax.value_and_grad(one, has_aux=True)(params, state, *xs)
        return (loss + value, _tree_add(grads, g), state_ct), aux

    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    start = (jnp.zeros((), jnp.float32), zeros(params), zeros(state) if mode == "exact" else None)
    (loss, grads, state_ct), aux = jax.lax.scan(body, start, (responses, mask, per_response))
    if mode == "exact":
        (prompt_grads,) = pullback(state_ct)
        grads = _tree_add(grads, prompt_grads)
    return loss, grads, aux


def group_logprobs(graphdef, params, prompt, length, responses, temperature=1.0) -> jax.Array:
    """The traced core of scoring without a graph: per-token log-probs [G, R] of each response given the
    prompt (run once) and its own earlier tokens, one response at a time (`lax.map`)."""
    state = _prompt_state(graphdef, params, prompt, length)
    model = nnx.merge(graphdef, params)
    return jax.lax.map(lambda tokens: _replay(model, state, length, tokens, temperature)[0], responses)


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn", "mode"))
def _longstraw(graphdef, params, prompt, responses, mask, per_response, *, loss_fn, mode):
    loss, grads, _ = group_gradient(graphdef, params, prompt, jnp.int32(prompt.shape[0]), responses, mask,
                                    per_response, loss_fn=_NoAux(loss_fn), mode=mode)
    return loss, grads


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn"))
def _standard(graphdef, params, prompt, responses, mask, per_response, *, loss_fn):
    def total(p):
        model = nnx.merge(graphdef, p)
        g, r = responses.shape
        n = prompt.shape[0]
        tokens = jnp.concatenate([jnp.broadcast_to(prompt, (g, n)), responses], axis=1)
        positions = jnp.broadcast_to(jnp.arange(n + r, dtype=jnp.int32), tokens.shape)
        hidden, _ = model(tokens, positions, return_hidden=True)
        logp, _ = _token_outputs(model, hidden[:, n - 1:n + r - 1], responses)  # the state before each token
        return jax.vmap(loss_fn)(logp, mask, per_response).sum()

    return jax.value_and_grad(total)(params)


def _split(model):
    """An nnx module or a (graphdef, state) pair -> (graphdef, state); gradients are w.r.t. the state."""
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    graphdef, params = model
    return graphdef, params


def _check_group(prompt, responses, mask) -> tuple[jax.Array, jax.Array, jax.Array]:
    prompt, responses, mask = jnp.asarray(prompt), jnp.asarray(responses), jnp.asarray(mask)
    if prompt.ndim != 1 or prompt.shape[0] == 0:
        raise ValueError(f"prompt must be a non-empty 1-D token array [P], got shape {prompt.shape}")
    if responses.ndim != 2 or 0 in responses.shape:
        raise ValueError(f"responses must be [G, R] with G >= 1 and R >= 1 (padded), got shape "
                         f"{responses.shape}; an empty group has no gradient: skip it")
    if mask.shape != responses.shape:
        raise ValueError(f"response_mask shape {mask.shape} must equal responses shape {responses.shape}")
    return prompt.astype(jnp.int32), responses.astype(jnp.int32), mask.astype(bool)


def longstraw_grad(model, prompt, responses, response_mask, loss_fn: ResponseLoss,
                   per_response: Any = None, *, mode: str = "exact") -> tuple[jax.Array, Any]:
    """LongStraw gradient of sum_g loss_fn(logp_g, mask_g, per_response_g) for one prompt's group.

    model: a Decoder, or its (graphdef, state) from `nnx.split`; prompt [P] int; responses [G, R]
    int, right-padded; response_mask [G, R] bool; per_response: pytree of [G, ...] arrays or None.
    mode: "exact" (equals `standard_grad`) or "approximate" (prompt state constant, as the paper).
    Returns (total loss, gradients shaped like the model state). `loss_fn` is a static argument of
    the compiled program: pass the same function object each step to reuse it.
    Works inside an outer `jax.jit` too (with the (graphdef, state) form of `model`).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    graphdef, params = _split(model)
    prompt, responses, mask = _check_group(prompt, responses, response_mask)
    return _longstraw(graphdef, params, prompt, responses, mask, per_response, loss_fn=loss_fn, mode=mode)


def standard_grad(model, prompt, responses, response_mask, loss_fn: ResponseLoss,
                  per_response: Any = None) -> tuple[jax.Array, Any]:
    """The reference: the same loss and gradient from G full sequences [prompt + response_g] [G, P + R].

    Arguments and result as `longstraw_grad`.
    """
    graphdef, params = _split(model)
    prompt, responses, mask = _check_group(prompt, responses, response_mask)
    return _standard(graphdef, params, prompt, responses, mask, per_response, loss_fn=loss_fn)


def tree_cosine(a, b) -> jax.Array:
    """Cosine similarity of two gradient trees, each flattened into one vector."""
    dot = sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    norm = lambda t: jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(t)))  # noqa: E731
    return dot / (norm(a) * norm(b))
