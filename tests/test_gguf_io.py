"""GGUF checkpoints: written-here files against transformers' logits, every quant type against the plain
reference (gguf's dequantize + llama.cpp's permutation undone row by row), Q4_K and Q6_K against the values
their blocks were built from (encoded here from llama.cpp's block layout: independent of gguf's dequantizer,
which the loader calls), sharded placement, named errors; and the real SmolLM2-135M-Instruct (Q4_1) against
transformers' greedy continuation (tests/fixtures/gguf/, made by tests/fixtures/make_gguf_fixtures.py)."""

import json
import math
import os
import subprocess
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import smollm2
from conftest import FIXTURES, ROOT
from tiderl_jax.model import gguf_io, hf_io
from tiderl_jax.model.chat import Message
from tiderl_jax.model.chat_template import ChatTemplate
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.hf_io import CheckpointError, hf_layouts, load_hf_checkpoint
from tiderl_jax.model.sharding import make_mesh
from tiderl_jax.model.tokenizer import Tokenizer, _byte_to_unicode

SMOL = json.loads((ROOT / "tests" / "fixtures" / "gguf" / "smollm2_135m_instruct.json").read_text())
Q = gguf.GGMLQuantizationType


# ------------------------------------------------------------------ references and a GGUF writer


def llama_cpp_permute(w, n_head):
    """llama.cpp's converter, `LlamaModel.permute(w, n_head, n_head)`: the direction files are written in."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_unpermute(w, n_head):
    """Row by row: in each head, GGUF rows (2i, 2i + 1) are HF rows (i, head_dim / 2 + i)."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + i] = w[h * d + 2 * i]
            out[h * d + d // 2 + i] = w[h * d + 2 * i + 1]
    return out


def llama3_rope_factors(head_dim, theta, factor, low, high, ctx):
    """llama.cpp's `rope_freqs.weight` for Llama 3 scaling (per pair: unscaled / scaled frequency)."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def encode_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """llama.cpp's `block_q4_K` (ggml-common.h) from its parts, per block: f16 `d`, `dmin`; 6-bit `sc[8]`,
    `m[8]` (one per 32 weights); 4-bit `q[256]`. Weight i is d * sc[i // 32] * q[i] - dmin * m[i // 32]."""
    nb = len(d)
    scales = np.zeros((nb, 12), np.uint8)  # get_scale_min_k4's packing: 8 + 8 six-bit numbers in 12 bytes
    scales[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4
    q = q.reshape(nb, 4, 2, 32)  # 64 weights per 32 bytes: the first 32 in the low nibbles, the next in the high
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(nb, 128)
    halves = np.stack([d, dmin], 1).astype(np.float16).view(np.uint8)
    return np.concatenate([halves, scales, qs.astype(np.uint8)], 1)


def encode_q6_k(d, scales, q) -> np.ndarray:
    """llama.cpp's `block_q6_K` from its parts, per block: f16 `d`, int8 `scales[16]` (one per 16 weights),
    6-bit `q[256]`. Weight i is d * scales[i // 16] * (q[i] - 32)."""
    nb = len(d)
    q = q.reshape(nb, 2, 4, 32)  # per 128 weights: 4 rows of 32 (l, l + 32, l + 64, l + 96)
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], 2)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(nb, 128).astype(np.uint8), qh.reshape(nb, 64).astype(np.uint8),
                           scales.astype(np.int8).view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)], 1)


def built_k_quant(shape, kind: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes of a `shape` tensor in `kind` built from random parts, the weights those parts define)."""
    nb = shape[0] * shape[1] // 256
    d = rng.uniform(1e-3, 2e-2, nb).astype(np.float16).astype(np.float64)
    if kind == "Q4_K":
        dmin = rng.uniform(1e-3, 2e-2, nb).astype(np.float16).astype(np.float64)
        sc, m = (rng.integers(0, 64, (nb, 8), dtype=np.uint8) for _ in range(2))
        q = rng.integers(0, 16, (nb, 256), dtype=np.uint8)
        data = encode_q4_k(d, dmin, sc, m, q)
        values = d[:, None] * np.repeat(sc, 32, 1) * q - dmin[:, None] * np.repeat(m, 32, 1)
    else:
        scales = rng.integers(-128, 128, (nb, 16))
        q = rng.integers(0, 64, (nb, 256), dtype=np.uint8)
        data = encode_q6_k(d, scales, q)
        values = d[:, None] * np.repeat(scales, 16, 1) * (q.astype(np.int64) - 32)
    return data.reshape(gguf.quants.quant_shape_to_byte_shape(shape, Q[kind])), values.reshape(shape)


def _quantize(w: np.ndarray, kind: str, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """`w` stored as `kind`, and the weights the stored blocks define when built here (else None): gguf's
    quantizer where it has one; Q4_K and Q6_K built from random parts (`built_k_quant`); the other K-quants
    random blocks (every byte with bit 6 clear, so the f16 scales stay finite)."""
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    qtype = Q[kind]
    if kind in ("Q4_K", "Q6_K"):
        return built_k_quant(w.shape, kind, rng)
    if kind.endswith("_K"):
        shape = gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
        return (rng.integers(0, 256, size=shape, dtype=np.uint8) & 0xBF).astype(np.uint8), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), None


def write_gguf(path, hf_cfg: dict, hf_tensors: dict, *, kind="F32", arch="llama", rope_factors=None,
               drop=(), override_types=None, meta=None, seed=0):
    """A Llama GGUF as llama.cpp's converter writes one: names, Q/K permuted, 2-D weights as `kind`,
    norms F32, a byte-level vocabulary of the 256 bytes (eos 0)."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig.from_hf(hf_cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(hf_cfg["max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length((meta or {}).get("ffn", cfg.intermediate_size))
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([_byte_to_unicode()[b] for b in range(256)])
    w.add_token_types([1] * 256)
    w.add_token_merges([])
    w.add_eos_token_id(0)
    names = gguf_io.gguf_names(cfg)
    stored = {}
    for hf_name, gg_name in names.items():
        if gg_name in drop:
            continue
        t = np.asarray(hf_tensors[hf_name], np.float32)
        if hf_name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_kv_heads)
        this = (override_types or {}).get(gg_name, kind if t.ndim == 2 else "F32")
        data, values = _quantize(t, this, rng) if this in gguf_io.SUPPORTED_QUANTS else \
            (rng.integers(0, 256, size=gguf.quants.quant_shape_to_byte_shape(t.shape, Q[this]), dtype=np.uint8), None)
        raw = None if this in ("F32", "F16") else Q[this]
        w.add_tensor(gg_name, data, raw_dtype=raw)
        stored[hf_name] = (data, this, values)
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _llama_fixture():
    hf_cfg = json.loads((FIXTURES / "llama" / "config.json").read_text())
    tensors = safetensors.numpy.load_file(str(FIXTURES / "llama" / "model.safetensors"))
    cfg = ModelConfig.from_hf(hf_cfg)
    s = cfg.rope_scaling
    factors = llama3_rope_factors(cfg.head_dim, cfg.rope_theta, s.factor, s.low_freq_factor, s.high_freq_factor,
                                  s.original_max_position_embeddings)
    return hf_cfg, tensors, factors


def _hf_params(model) -> dict:
    """The model's parameters in HF names and layouts (what save_hf_checkpoint writes)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return {lay.hf_name: lay.to_hf(np.asarray(flat[k].get_value())) for k, lay in hf_layouts(model.cfg).items()}


# ------------------------------------------------------------------ written-here GGUF files


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, d, cols in [(4, 16, 8), (3, 64, 5), (9, 64, 2)]:
        w = rng.standard_normal((n_head * d, cols)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(gguf_io.unpermute_qk(permuted, n_head), w)
        np.testing.assert_array_equal(reference_unpermute(permuted, n_head), w)


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 4, "tensor": 2}])
def test_llama_gguf_logits_match_transformers(tmp_path, mesh_shape):
    """The tiny Llama fixture written as llama.cpp would (permuted Q/K, rope_freqs.weight for its Llama 3
    scaling, untied output): transformers' recorded logits, on one device and sharded over 8."""
    hf_cfg, tensors, factors = _llama_fixture()
    write_gguf(tmp_path / "llama.gguf", hf_cfg, tensors, rope_factors=factors)
    mesh = make_mesh(mesh_shape) if mesh_shape else None
    model, tok = gguf_io.load_gguf(tmp_path / "llama.gguf", mesh=mesh)
    assert model.cfg == load_hf_checkpoint(FIXTURES / "llama").cfg  # the fitted RoPE scaling included
    ref = np.load(FIXTURES / "llama" / "logits.npz")
    logits, _ = model(jnp.asarray(ref["input_ids"]), jnp.asarray(ref["position_ids"]))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() <= 1e-4
    if mesh is not None:
        assert model.embed[...].sharding.mesh.shape == mesh.shape
    assert tok.decode(tok.encode("héllo 🙂")) == "héllo 🙂" and tok.stop_ids == (0,)


def _one_layer_in(tmp_path, kind):
    """A one-layer model whose inner dimensions hold whole K-quant blocks (256), every 2-D weight written in
    `kind` and loaded: (its config, the source tensors, what `write_gguf` stored, the loaded HF parameters)."""
    hf_cfg = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False)
    cfg = ModelConfig.from_hf(hf_cfg)
    rng = np.random.default_rng(1)
    tensors = {lay.hf_name: rng.standard_normal(lay.hf_shape(shape)).astype(np.float32)
               for lay, shape in ((lay, _shape(cfg, k)) for k, lay in hf_layouts(cfg).items())}
    stored = write_gguf(tmp_path / "m.gguf", hf_cfg, tensors, kind=kind)
    model, _ = gguf_io.load_gguf(tmp_path / "m.gguf")
    return cfg, tensors, stored, _hf_params(model)


def _unpermuted(name, w, cfg):
    if name.endswith("q_proj.weight"):
        return reference_unpermute(w, cfg.num_heads)
    if name.endswith("k_proj.weight"):
        return reference_unpermute(w, cfg.num_kv_heads)
    return w


@pytest.mark.parametrize("kind", gguf_io.SUPPORTED_QUANTS)
def test_each_quant_type_matches_the_plain_reference(tmp_path, kind):
    """Every 2-D weight in `kind`: loaded parameters == gguf.quants.dequantize of the stored blocks with Q/K
    un-permuted row by row (the layout and the un-permutation; the values: the next test for K-quants)."""
    cfg, tensors, stored, got = _one_layer_in(tmp_path, kind)
    for name, (data, this, _) in stored.items():
        ref = _unpermuted(name, gguf.quants.dequantize(data, Q[this]).astype(np.float32), cfg)
        np.testing.assert_array_equal(got[name], ref.reshape(got[name].shape), err_msg=f"{kind} {name}")
    if kind in ("F32", "F16", "BF16", "Q8_0"):  # close to the weights they quantize
        tol = {"F32": 0, "F16": 1e-2, "BF16": 3e-2, "Q8_0": 5e-2}[kind]
        assert np.abs(got["model.layers.0.mlp.up_proj.weight"] - tensors["model.layers.0.mlp.up_proj.weight"]).max() <= tol


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_load_as_the_weights_their_blocks_were_built_from(tmp_path, kind):
    """Blocks encoded here from their parts (scales, mins, quants: llama.cpp's layout) load as the weights
    those parts define, Q/K un-permuted: a check of the values that does not go through gguf's dequantizer."""
    cfg, _, stored, got = _one_layer_in(tmp_path, kind)
    built = {name: values for name, (_, this, values) in stored.items() if this == kind}
    assert len(built) == 9 and all(v is not None for v in built.values())  # every 2-D weight
    for name, values in built.items():
        ref = _unpermuted(name, values, cfg)
        assert np.abs(ref).max() > 1  # many quantization steps
        np.testing.assert_allclose(got[name], ref, rtol=1e-6, atol=1e-5, err_msg=f"{kind} {name}")


def _shape(cfg, key):
    abstract = nnx.eval_shape(lambda: __import__("tiderl_jax.model.decoder", fromlist=["Decoder"]).Decoder(cfg, rngs=nnx.Rngs(0)))
    return tuple(dict(nnx.to_flat_state(nnx.state(abstract)))[key].get_value().shape)


def test_bad_gguf_files_are_named(tmp_path):
    hf_cfg, tensors, factors = _llama_fixture()
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        gguf_io.load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        gguf_io.load_gguf(tmp_path / "zip.gguf")
    write_gguf(tmp_path / "qwen.gguf", hf_cfg, tensors, arch="qwen2")
    with pytest.raises(CheckpointError, match="GGUF architecture 'qwen2' is not supported"):
        gguf_io.load_gguf(tmp_path / "qwen.gguf")
    write_gguf(tmp_path / "iq.gguf", hf_cfg, tensors, override_types={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(CheckpointError, match="tensor blk.1.ffn_up.weight has quant type IQ4_NL"):
        gguf_io.load_gguf(tmp_path / "iq.gguf")
    write_gguf(tmp_path / "missing.gguf", hf_cfg, tensors, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors \['blk.1.ffn_up.weight'\]"):
        gguf_io.load_gguf(tmp_path / "missing.gguf")
    write_gguf(tmp_path / "shape.gguf", hf_cfg, tensors, meta={"ffn": 96})
    with pytest.raises(CheckpointError, match=r"blk.0.ffn_gate.weight has shape \(128, 64\).*implies \(96, 64\)"):
        gguf_io.load_gguf(tmp_path / "shape.gguf")
    write_gguf(tmp_path / "rope.gguf", hf_cfg, tensors, rope_factors=factors[::-1].copy())
    with pytest.raises(CheckpointError, match="not Llama 3 RoPE scaling"):
        gguf_io.load_gguf(tmp_path / "rope.gguf")
    r = subprocess.run([sys.executable, "launch/generate.py", f"--checkpoint={tmp_path / 'iq.gguf'}", "--prompt=x"],
                       cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "quant type IQ4_NL" in r.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------ SmolLM2-135M-Instruct (Q4_1)


@pytest.fixture(scope="module")
def smol():
    return gguf_io.load_gguf(smollm2.gguf_path())


def test_smollm2_config_tokenizer_and_template(smol):
    model, tok = smol
    cfg = model.cfg
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (30, 9, 3, 64, 576)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192 and cfg.rope_scaling is None
    for text, ids in SMOL["encodings"].items():  # transformers' tokenizer (of our export and of the GGUF)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert tok.stop_ids == (tok.token_id("<|im_end|>"),) and tok.bos_id == tok.token_id("<|im_start|>")
    template = ChatTemplate.for_tokenizer(tok)
    messages = [Message(**m) for m in SMOL["messages"]]
    assert template.render(messages, add_generation_prompt=True) == SMOL["prompt_text"]
    assert template.encode(messages, add_generation_prompt=True).ids == SMOL["prompt_ids"]


def test_smollm2_logits_match_transformers(smol):
    """One forward pass over the prompt and transformers' greedy tokens: each argmax is the next greedy
    token, and the logits agree (float32 on both sides; Q4_1 dequantized exactly)."""
    model, _ = smol
    prompt, greedy = SMOL["prompt_ids"], SMOL["greedy_ids"]
    ids = np.asarray([prompt + greedy[:-1]], np.int32)
    logits, _ = model(jnp.asarray(ids), jnp.arange(ids.shape[1])[None])
    logits = np.asarray(logits)[0, len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == greedy
    chosen = logits[np.arange(len(greedy)), greedy]
    np.testing.assert_allclose(chosen, SMOL["greedy_chosen_logits"], atol=2e-3)
    np.testing.assert_allclose(logits[0, SMOL["prompt_top_ids"]], SMOL["prompt_top_logits"], atol=2e-3)


@pytest.mark.e2e
def test_generate_launch_runs_the_gguf_chat_greedy(tmp_path):
    """launch/generate.py --checkpoint=FILE.gguf --chat: the checkpoint's template renders the prompt, the
    engine's greedy tokens equal transformers'; with stop tokens on, it stops at <|im_end|>."""
    path = smollm2.gguf_path()
    r = subprocess.run([sys.executable, "launch/generate.py", f"--checkpoint={path}", "--chat",
                        f"--prompt={SMOL['messages'][0]['content']}", "--temperature=0",
                        f"--max_new_tokens={len(SMOL['greedy_ids'])}", "--stop_at_eos=false",
                        "--max_seq_len=128", "--num_pages=32", f"--json_out={tmp_path / 'out.json'}"],
                       cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out[0]["token_ids"] == SMOL["greedy_ids"] and out[0]["text"] == SMOL["decoded_greedy"]


def test_smollm2_export_reads_back(smol, tmp_path):
    """export_hf: what transformers read for the fixture (config, weights, tokenizer with its template,
    generation_config) reads back here with the same weights, tokens, template and stop ids."""
    model, tok = smol
    hf_io.export_hf(model, tok, tmp_path)
    again = load_hf_checkpoint(tmp_path)
    assert again.cfg == model.cfg
    a, b = _hf_params(model), _hf_params(again)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    tok2 = Tokenizer.from_checkpoint(tmp_path)
    assert tok2.chat_template == tok.chat_template and tok2.stop_ids == tok.stop_ids
    assert tok2.bos_id == tok.bos_id and tok2.eos_id == tok.eos_id
    for text, ids in SMOL["encodings"].items():
        assert tok2.encode(text) == ids
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template and config["eos_token"] == "<|im_end|>"
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
