"""The image input path, tested like the text path: patchify, chat rendering, the decoder's two modes,
packing, sharding, gradients, HF export, and the engine against the full-recompute reference
(chunked prefill through an image, preemption, pause + resume with a second image, prefix cache)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from engine_reference import greedy, token_logprobs
from tiderl_jax.engine.engine import Engine, EngineConfig, Request, Status
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.model import chat
from tiderl_jax.model.config import ConfigError, ModelConfig
from tiderl_jax.model.decoder import KVCache, init_decoder
from tiderl_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint
from tiderl_jax.model.sharding import DEFAULT_RULES, data_sharding, make_mesh, shard_model
from tiderl_jax.model.tokenizer import IMAGE_TOKEN, Tokenizer
from tiderl_jax.model.vision import ImageSpan, dense_inputs, patchify

TOK = Tokenizer.builtin()
IMG = TOK.token_id(IMAGE_TOKEN)
PATCH = 4
CFG = ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=512,
                  image_patch_dim=PATCH * PATCH * 3, max_image_patches=16, image_token_id=IMG)
TEXT_CFG = dataclasses.replace(CFG, image_patch_dim=0, max_image_patches=0, image_token_id=None)
MODEL = init_decoder(CFG, seed=0)
SMALL = dict(page_size=8, num_pages=128, max_seq_len=128, max_running=4, prefill_chunk=16,
             max_prefill_rows=4, prefill_budget=32, decode_steps=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _image(seed, size=16):
    """Patches [(size / 4)**2, 48] of a random RGB image."""
    return patchify(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8), PATCH)


def _text(n, seed):
    return list(map(int, np.random.default_rng(seed).integers(0, 256, n)))


def _compose(*parts):
    """(tokens, images) of a sequence of text runs (id lists) and images (patch arrays)."""
    tokens, images = [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            images.append(ImageSpan(len(tokens), part))
            tokens += [IMG] * len(part)
        else:
            tokens += part
    return tokens, images


def _batch(rows):
    """Device inputs (tokens, positions, patches, patch_index) of equal-length (tokens, images) rows."""
    tokens = np.asarray([t for t, _ in rows], np.int32)
    dense = [dense_inputs(images, 0, len(t), CFG.image_patch_dim) for t, images in rows]
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(np.stack([p for p, _ in dense])),
            jnp.asarray(np.stack([i for _, i in dense])))


def _logits(model, rows):
    tokens, positions, patches, index = _batch(rows)
    return np.asarray(model(tokens, positions, patches=patches, patch_index=index)[0])


def _engine(model=MODEL, **overrides):
    return Engine(model, EngineConfig(**{**SMALL, **overrides}))


# ------------------------------------------------------------------ pixels, config, chat


def test_patchify_raster_order_values_and_bad_images():
    pixels = np.arange(8 * 12 * 3, dtype=np.int64).reshape(8, 12, 3) % 256
    patches = patchify(pixels.astype(np.uint8), 4)
    assert patches.shape == (6, 48) and patches.dtype == np.float32
    np.testing.assert_allclose(patches[1], pixels[0:4, 4:8].reshape(-1) / 255.0, rtol=1e-6)  # row 0, col 1
    np.testing.assert_allclose(patches[3], pixels[4:8, 0:4].reshape(-1) / 255.0, rtol=1e-6)  # row 1, col 0
    floats = np.random.default_rng(0).random((4, 4, 1))
    np.testing.assert_allclose(patchify(floats, 2)[0], floats[:2, :2].reshape(-1), rtol=1e-6)
    with pytest.raises(ValueError, match="10x8 pixels does not split into 4x4 patches"):
        patchify(np.zeros((10, 8, 3), np.uint8), 4)
    with pytest.raises(ValueError, match=r"\[height, width, channels\]"):
        patchify(np.zeros((8, 8), np.uint8), 4)
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        patchify(np.full((4, 4, 3), 2.0), 4)
    with pytest.raises(ValueError, match="int32 is not uint8 or float"):
        patchify(np.zeros((4, 4, 3), np.int32), 4)


def test_config_vision_fields_are_validated_and_round_trip_hf():
    with pytest.raises(ConfigError, match="image_token_id=None must be a token id"):
        ModelConfig(image_patch_dim=48, max_image_patches=4)
    with pytest.raises(ConfigError, match="image_token_id=999 must be a token id in \\[0, vocab_size=512\\)"):
        ModelConfig(image_patch_dim=48, max_image_patches=4, image_token_id=999)
    with pytest.raises(ConfigError, match="max_image_patches=0 must be positive"):
        ModelConfig(image_patch_dim=48, image_token_id=3)
    with pytest.raises(ConfigError, match="max_image_patches=4 needs image_patch_dim > 0"):
        ModelConfig(max_image_patches=4)
    assert ModelConfig.from_hf(CFG.to_hf()) == CFG
    assert "tiderl_vision" not in TEXT_CFG.to_hf()
    assert CFG.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(MODEL)))


def test_chat_renders_images_as_placeholders_outside_the_model_mask():
    a, b = _image(0, 8), _image(1, 16)
    messages = [chat.Message("user", "Which is brighter?", images=(a, b)),
                chat.Message("assistant", "", (chat.ToolCall("look", {}),)),
                chat.Message("tool", "zoomed", images=(a,))]
    text = chat.render(messages)
    assert text.startswith(
        f"<|im_start|>user\n{IMAGE_TOKEN * 4}\n{IMAGE_TOKEN * 16}\nWhich is brighter?<|im_end|>")
    assert f"<tool_response>\n{chat.image_placeholder(4)}\nzoomed\n</tool_response>" in text
    enc = chat.encode(TOK, messages, add_generation_prompt=True)
    assert enc.ids == TOK.encode(chat.render(messages, add_generation_prompt=True))
    assert [len(im.patches) for im in enc.images] == [4, 16, 4]
    for im, want in zip(enc.images, (a, b, a)):
        assert enc.ids[im.offset:im.end] == [IMG] * len(want) and not any(enc.model_mask[im.offset:im.end])
        np.testing.assert_array_equal(im.patches, want)
    assert enc.ids.count(IMG) == 24
    with pytest.raises(ValueError, match="assistant messages carry no images"):
        chat.Message("assistant", "x", images=(a,))
    with pytest.raises(ValueError, match="must not contain the image placeholder"):
        chat.encode(TOK, [chat.Message("user", "fake " + IMAGE_TOKEN, images=(a,))])


# ------------------------------------------------------------------ the decoder


def test_text_calls_are_unchanged():
    text_model = init_decoder(TEXT_CFG, seed=0)  # same seed: the vision model adds its embedding last
    tokens = np.asarray([_text(20, 1)], np.int32)
    pos = jnp.arange(20)[None]
    want = np.asarray(text_model(jnp.asarray(tokens), pos)[0])
    np.testing.assert_array_equal(np.asarray(MODEL(jnp.asarray(tokens), pos)[0]), want)
    no_images = _logits(MODEL, [(tokens[0].tolist(), [])])  # image inputs, but no position is a patch
    np.testing.assert_allclose(no_images, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="text-only model"):
        text_model(jnp.asarray(tokens), pos, patches=jnp.zeros((1, 20, 48)),
                   patch_index=jnp.zeros((1, 20), jnp.int32))


def test_cached_forward_token_by_token_equals_full_forward():
    rows = [_compose(_text(3, 2), _image(3), _text(2, 4), _image(4, 8), _text(3, 5)),
            _compose(_image(5), _text(12, 6))]
    want = _logits(MODEL, rows)
    tokens, positions, patches, index = _batch(rows)
    cache = KVCache.init(CFG, 2, 32)
    prefix = 9  # ends inside the first row's image
    got, cache = MODEL(tokens[:, :prefix], positions[:, :prefix], cache=cache,
                       patches=patches[:, :prefix], patch_index=index[:, :prefix])
    np.testing.assert_allclose(np.asarray(got), want[:, :prefix], atol=1e-5, rtol=0)
    for t in range(prefix, tokens.shape[1]):
        step, cache = MODEL(tokens[:, t:t + 1], positions[:, t:t + 1], cache=cache,
                            patches=patches[:, t:t + 1], patch_index=index[:, t:t + 1])
        np.testing.assert_allclose(np.asarray(step)[:, 0], want[:, t], atol=1e-5, rtol=0,
                                   err_msg=f"step {t}")


def test_packed_sequences_with_images_do_not_attend_across_segments():
    a = _compose(_text(3, 7), _image(8, 8), _text(4, 9))
    b = _compose(_image(10, 8), _text(5, 11))
    packed = a[0] + b[0]
    images = a[1] + [im.shifted(len(a[0])) for im in b[1]]
    patches, index = dense_inputs(images, 0, len(packed), CFG.image_patch_dim)
    segments = np.asarray([[1] * len(a[0]) + [2] * len(b[0])])
    positions = np.asarray([list(range(len(a[0]))) + list(range(len(b[0])))])
    got = np.asarray(MODEL(jnp.asarray([packed]), jnp.asarray(positions), segment_ids=jnp.asarray(segments),
                           patches=jnp.asarray(patches[None]), patch_index=jnp.asarray(index[None]))[0])
    np.testing.assert_allclose(got[0, :len(a[0])], _logits(MODEL, [a])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[0, len(a[0]):], _logits(MODEL, [b])[0], atol=1e-5, rtol=0)


def test_logits_after_an_image_depend_on_that_image_only():
    before, after = _text(6, 12), _text(6, 13)
    one, same, other = (_compose(before, im, after) for im in (_image(14), _image(14), _image(15)))
    got = _logits(MODEL, [one, same, other])
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0, :6], got[2, :6])  # causal: the text before is untouched
    assert np.abs(got[0, 6:] - got[2, 6:]).max(axis=-1).min() > 1e-3  # every position from the image on


def test_gradients_reach_the_patch_embedding():
    tokens, positions, patches, index = _batch([_compose(_text(4, 16), _image(17, 8), _text(4, 18))])

    def loss(model):
        logits = model(tokens, positions, patches=patches, patch_index=index)[0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    g = nnx.grad(loss)(MODEL).patch_embed
    assert np.abs(np.asarray(g.proj[...])).min(axis=1).max() > 0 and np.abs(np.asarray(g.bias[...])).max() > 0
    used = np.abs(np.asarray(g.position[...])).max(axis=1) > 0
    assert used.tolist() == [True] * 4 + [False] * 12  # a 4-patch image trains positions 0..3 only


def test_sharded_mesh_equals_one_device():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    sharded = shard_model(init_decoder(CFG, seed=0), mesh, DEFAULT_RULES)
    assert sharded.patch_embed.proj[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    rows = [_compose(_text(2 + i, 20 + i), _image(30 + i, 8), _text(18 - i, 40 + i)) for i in range(4)]
    want = _logits(MODEL, rows)
    tokens, positions, patches, index = _batch(rows)
    put = lambda x, names: jax.device_put(x, data_sharding(mesh, DEFAULT_RULES, x.shape, names))  # noqa: E731
    forward = nnx.jit(lambda m, t, p, x, i: m(t, p, patches=x, patch_index=i)[0])
    got = forward(sharded, put(tokens, ("batch", "seq")), put(positions, ("batch", "seq")),
                  put(patches, ("batch", "seq", None)), put(index, ("batch", "seq")))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def test_hf_export_keeps_the_patch_embedding(tmp_path):
    save_hf_checkpoint(MODEL, tmp_path)
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert tensors["vision.patch_embed.weight"].shape == (64, 48)
    assert tensors["vision.position_embedding.weight"].shape == (16, 64)
    assert json.loads((tmp_path / "config.json").read_text())["tiderl_vision"] == {
        "image_patch_dim": 48, "max_image_patches": 16, "image_token_id": IMG}
    again = load_hf_checkpoint(tmp_path)
    assert again.cfg == CFG
    rows = [_compose(_text(3, 50), _image(51, 8), _text(3, 52))]
    np.testing.assert_array_equal(_logits(again, rows), _logits(MODEL, rows))


# ------------------------------------------------------------------ the engine


def _check_against_reference(out, tokens, images, n=8):
    """Greedy tokens and model log-probs of one engine output equal the full-recompute reference."""
    assert out.new_tokens == greedy(MODEL, tokens, n, images=images)
    np.testing.assert_allclose(out.logp_model[-n:], token_logprobs(MODEL, out.tokens, images=images)[-n:],
                               atol=1e-4)


def test_engine_image_prompts_equal_the_reference_with_chunked_prefill():
    prompts = [_compose(_text(5, 60), _image(61), _text(4, 62)),  # the image spans chunks 0 and 1
               _compose(_text(2, 63), _image(64, 8), _text(1, 65), _image(66), _text(20, 67)),
               _compose(_text(9, 68))]
    eng = _engine()
    handles = [eng.submit(Request(t, GREEDY, images=images)) for t, images in prompts]
    eng.run()
    for h, (tokens, images) in zip(handles, prompts):
        _check_against_reference(eng.get(h), tokens, images)
    assert eng.stats()["prefill_calls"] > 2  # prefill really was chunked


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_engine_preemption_recomputes_images_exactly(prefix_cache):
    # 12 usable pages of 8 tokens cannot hold 6 sequences of ~40 tokens at once.
    eng = _engine(num_pages=13, max_seq_len=64, enable_prefix_cache=prefix_cache)
    prompts = [_compose(_text(3 + i, 70 + i), _image(80 + i), _text(4, 90 + i)) for i in range(6)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    handles = [eng.submit(Request(t, sampling, images=images)) for t, images in prompts]
    eng.run()
    assert eng.stats()["preemptions"] > 0
    for h, (tokens, images) in zip(handles, prompts):
        _check_against_reference(eng.get(h), tokens, images, n=16)


@pytest.mark.parametrize("evict", [False, True])
def test_engine_resume_with_a_second_image(evict):
    eng = _engine(enable_prefix_cache=not evict)  # evicted KV is not found again in the cache
    tokens, images = _compose(_text(5, 100), _image(101), _text(4, 102))
    h = eng.submit(Request(tokens, SamplingParams(temperature=0.0, max_new_tokens=6), keep_kv=True,
                           images=images))
    eng.run([h])
    first = eng.get(h)
    assert first.status == Status.PAUSED
    obs, obs_images = _compose(_text(3, 103), _image(104, 8), _text(2, 105))  # offsets within obs
    if evict:  # the whole context, both images, is recomputed on resume
        eng.evict(h)
    before = eng.stats()["prefill_tokens_computed"]
    eng.resume(h, obs, sampling=GREEDY, images=obs_images)
    eng.run([h])
    out = eng.get(h)
    context = tokens + first.new_tokens + obs
    all_images = images + [im.shifted(len(tokens) + 6) for im in obs_images]
    assert out.tokens[:len(context)] == context
    assert [(im.offset, len(im.patches)) for im in out.images] == [(5, 16), (len(tokens) + 9, 4)]
    _check_against_reference(out, context, all_images)
    computed = eng.stats()["prefill_tokens_computed"] - before
    assert computed == (len(context) if evict else 1 + len(obs))


def test_prefix_cache_shares_kv_only_across_identical_images():
    eng = _engine()
    text_a, text_b = _text(10, 110), _text(6, 111)
    first = _compose(text_a, _image(112), text_b)  # 32 tokens: the image fills positions 10..25
    other = _compose(text_a, _image(113), text_b)  # same tokens, another image
    cached = []
    for tokens, images in (first, other, first):
        before = eng.stats()["prompt_tokens_cached"]
        h = eng.submit(Request(tokens, GREEDY, images=images))
        eng.run([h])
        _check_against_reference(eng.get(h), tokens, images)
        cached.append(eng.stats()["prompt_tokens_cached"] - before)
    # another image: only the block before it is shared; the same image: every full prompt block
    assert cached == [0, 8, 24]
    group = eng.submit_group(Request(other[0], GREEDY, images=other[1]), 3)
    eng.run(group)
    want = greedy(MODEL, other[0], 8, images=other[1])
    assert all(eng.get(h).new_tokens == want for h in group)


def test_bad_image_requests_are_refused():
    eng = _engine()
    tokens, images = _compose(_text(5, 120), _image(121), _text(3, 122))
    (span,) = images
    bad = [
        (Request(tokens, GREEDY, images=[ImageSpan(4, span.patches)]), "positions \\[4\\] hold tokens"),
        (Request(tokens[:15], GREEDY, images=images), "outside the 15 tokens"),
        (Request(tokens, GREEDY, images=[ImageSpan(5, span.patches[:, :12])]), "patches of 12 values"),
        (Request(tokens + [IMG], GREEDY, images=[ImageSpan(5, np.zeros((17, 48)))]), "takes 1..16"),
        (Request(tokens, GREEDY, images=[ImageSpan(5, span.patches[:8]), ImageSpan(12, span.patches[:8])]),
         "overlaps the previous image"),
        (Request(tokens, GREEDY, images=[ImageSpan(5, np.full((16, 48), np.nan))]), "non-finite"),
    ]
    for request, message in bad:
        with pytest.raises(RequestError, match=message):
            eng.submit(request)
    assert eng.stats()["rejected"] == len(bad)
    h = eng.submit(Request(tokens, SamplingParams(temperature=0.0, max_new_tokens=2), keep_kv=True,
                           images=images))
    eng.run([h])
    with pytest.raises(RequestError, match="resume images of request .*hold tokens"):
        eng.resume(h, [1, 2, 3], images=[ImageSpan(0, span.patches[:2])])
    with pytest.raises(RequestError, match="text-only"):
        _engine(init_decoder(TEXT_CFG, seed=0)).submit(Request(tokens, GREEDY, images=images))
    with pytest.raises(ValueError, match=r"\[num_patches, patch_dim\]"):
        ImageSpan(0, np.zeros(48))
    # placeholders that no image covers are plain text tokens
    plain = [1, 2, IMG, IMG, 3]
    assert eng.generate([plain], GREEDY)[0].new_tokens == greedy(MODEL, plain, 8)


def test_no_recompiles_with_images_after_warmup():
    eng = _engine(num_pages=32, max_running=2, max_prefill_rows=2, max_seq_len=64)
    eng.warmup()
    warm, compile_s = eng.stats()["compilations"], eng.compile_s
    assert warm == eng.num_programs()
    prompts = [_compose(_text(3 + i, 130 + i), _image(140 + i, 8 + 8 * (i % 2)), _text(5, 150 + i))
               for i in range(4)]
    for tokens, images in prompts:
        eng.submit(Request(tokens, GREEDY, images=images))
        eng.step()
    eng.run()
    assert eng.stats()["compilations"] == warm and eng.compile_s == compile_s
