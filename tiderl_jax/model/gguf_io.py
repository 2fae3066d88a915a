"""GGUF checkpoints (llama.cpp's format) in, Hugging Face format out, through the `gguf` library.

`load_gguf(path)` reads a Llama-family GGUF: its metadata becomes a `ModelConfig` (tied embeddings
when the file has no `output.weight`; Llama 3 RoPE scaling fitted from `rope_freqs.weight`), its
vocabulary and merges a byte-level BPE `Tokenizer` (built with `tokenizers`, carrying the chat
template and the bos / eos / eot / eom ids of the metadata), and its tensors a `Decoder`.

Tensors are dequantized one at a time (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K..Q6_K, all by `gguf.quants.dequantize` over the memory-mapped file), turned into the HF
layout, then into ours, and placed straight onto their `NamedSharding`s with
`jax.make_array_from_callback` (each device receives its slice): host memory peaks at one tensor in
float32, never the whole model.

llama.cpp's converter permutes the rows of q_proj / k_proj (`LlamaModel.permute`: each head's rows
reshaped [2, head_dim / 2] and swapped, so rotary pairs sit interleaved as GGML's RoPE wants them);
`unpermute_qk` is its inverse and gives back the HF (rotate-half) layout.

`hf_io.export_hf(model, tokenizer, path)` writes what transformers reads from the loaded model (config.json,
safetensors, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json with the
stop ids). Every bad input (no such file, not a GGUF, another architecture, an unsupported quant type, a
missing or misshapen tensor) is a `CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
import tokenizers

from tiderl_jax.model.config import ModelConfig, RopeScaling
from tiderl_jax.model.decoder import Decoder, rope_inv_freq
from tiderl_jax.model.hf_io import CheckpointError, hf_layouts, place_parameters
from tiderl_jax.model.sharding import DEFAULT_RULES, Rules
from tiderl_jax.model.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama",)
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# Pre-tokenizer splits by `tokenizer.ggml.pre` (llama.cpp's names for the HF tokenizers' regexes).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":  # SmolLM / SmolLM2: each digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        return None
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")


# ------------------------------------------------------------------------------------ metadata


def _import_gguf():
    try:
        import gguf
    except ImportError:  # a dependency of the package: only a broken install lacks it
        raise CheckpointError("reading GGUF files needs the `gguf` package (pip install gguf)") from None
    return gguf


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped), or a CheckpointError naming the problem."""
    gguf = _import_gguf()
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader fails as it may on a truncated or corrupt file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({path.stat().st_size:,} bytes; "
                              f"{type(e).__name__}: {e})") from None
    reader.path = path  # for error messages
    return reader


_MISSING = object()


def _meta(reader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"{reader.path}: GGUF metadata key {key!r} is missing")
        return default
    try:
        return field.contents()
    except (ValueError, IndexError) as e:  # a corrupt value (e.g. a string that is not UTF-8)
        raise CheckpointError(f"{reader.path}: corrupt GGUF metadata {key!r} ({type(e).__name__}: {e})") from None


def _tensor_map(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(f"{float(x):.7g}")


def read_gguf_config(reader, *, dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` the GGUF's `llama.*` metadata (and tensors) describe."""
    src = reader.path
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{src}: GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}")
    if int(_meta(reader, f"{arch}.expert_count", 0) or 0) > 0:
        raise CheckpointError(f"{src}: a mixture-of-experts GGUF (llama.expert_count > 0) is not supported")
    scaling_type = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear") or (
            scaling_type == "linear" and float(_meta(reader, f"{arch}.rope.scaling.factor", 1.0)) != 1.0):
        raise CheckpointError(f"{src}: RoPE scaling type {scaling_type!r} is not supported "
                              "(none, or Llama 3's rope_freqs.weight)")
    tensors = _tensor_map(reader)
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_meta(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_meta(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"{src}: partial RoPE (rope.dimension_count={rope_dim} < head_dim={head_dim}) "
                              "is not supported")
    vocab = _meta(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields \
            else int(tensors["token_embd.weight"].shape[-1])
    cfg = ModelConfig(
        arch="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_meta(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_f32(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        dtype=dtype,
        param_dtype=param_dtype or dtype,
    )
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"], src).reshape(-1)
        cfg = _with_llama3_scaling(cfg, factors, src)
    return cfg


def _with_llama3_scaling(cfg: ModelConfig, factors: np.ndarray, src) -> ModelConfig:
    """Llama 3 RoPE scaling from llama.cpp's `rope_freqs.weight` (per pair: unscaled / scaled frequency).

    The factors are 1 (short wavelengths), `factor` (long ones) and, in between, 1 / ((1 - s) / factor
    + s) with s = (original_ctx / wavelength - low) / (high - low), linear in the frequency; fitting that
    line with low = 1 gives `high` and `original_ctx` (any (low, high, ctx) on the line gives the same
    factors). Without points in the band, Llama 3.1's published values are tried. The fit must then
    reproduce every factor.
    """
    if factors.shape != (cfg.head_dim // 2,):
        raise CheckpointError(f"{src}: rope_freqs.weight has shape {factors.shape}, expected ({cfg.head_dim // 2},)")
    if np.allclose(factors, 1.0):
        return cfg
    base = rope_inv_freq(cfg)
    factor = float(factors.max())
    band = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    if band.sum() >= 2 and factor > 1:
        smooth = (factor / factors[band] - 1) / (factor - 1)
        slope, intercept = np.polyfit(base[band].astype(np.float64), smooth.astype(np.float64), 1)
        high = 1 - 1 / intercept if intercept < 0 else float("nan")
        if math.isfinite(high) and high > 1:
            ctx = round(slope * 2 * math.pi * (high - 1))
            scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=round(high, 4),
                                  original_max_position_embeddings=int(ctx))
    fitted = dataclasses.replace(cfg, rope_scaling=scaling)
    got = base / rope_inv_freq(fitted)
    if not np.allclose(got, factors, rtol=1e-3, atol=1e-4):
        raise CheckpointError(f"{src}: rope_freqs.weight is not Llama 3 RoPE scaling (the closest fit, "
                              f"{scaling}, differs by up to {np.abs(got - factors).max():.3g})")
    return fitted


# ------------------------------------------------------------------------------------- tensors


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute(w, n_head, n_head)`: GGML's interleaved rotary
    rows [heads * head_dim, in] back to HF's rotate-half layout. (K uses n_head = the KV heads.)"""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every tensor `cfg` implies."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
                 "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
                 "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
                 "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
                 "mlp.down_proj.weight": "ffn_down"}
    for i in range(cfg.num_layers):
        for hf, gg in per_layer.items():
            out[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}.weight"
    return out


def _dequantize(tensor, src) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (= HF / torch) dimension order."""
    gguf = _import_gguf()
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_QUANTS:
        raise CheckpointError(f"{src}: tensor {tensor.name} has quant type {kind}, which is not supported; "
                              f"supported: {SUPPORTED_QUANTS}")
    if kind == "BF16" and tensor.data.dtype != np.uint8:  # some readers give BF16 as 16-bit words
        data = tensor.data.view(np.uint8)
    else:
        data = tensor.data
    out = np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return out.reshape(shape)


def _hf_tensor(tensor, hf_name: str, cfg: ModelConfig, src) -> np.ndarray:
    w = _dequantize(tensor, src)
    if hf_name.endswith("self_attn.q_proj.weight"):
        w = unpermute_qk(w, cfg.num_heads)
    elif hf_name.endswith("self_attn.k_proj.weight"):
        w = unpermute_qk(w, cfg.num_kv_heads)
    return w


def load_gguf_model(reader, cfg: ModelConfig, *, mesh: Mesh | None = None,
                    rules: Rules = DEFAULT_RULES) -> Decoder:
    """The GGUF's weights as a `Decoder` of `cfg`, each tensor dequantized and placed on its sharding."""
    src = reader.path
    tensors = _tensor_map(reader)
    names = gguf_names(cfg)
    layouts = hf_layouts(cfg)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(abstract_state))

    problems = []
    expected = set(names.values())
    missing = sorted(expected - set(tensors))
    extra = sorted(set(tensors) - expected - {"rope_freqs.weight"})
    if missing:
        problems.append(f"missing tensors {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if extra:
        problems.append(f"unexpected tensors {extra[:8]}" + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))
    for key, lay in layouts.items():
        t = tensors.get(names[lay.hf_name])
        if t is None:
            continue
        want = tuple(lay.hf_shape(tuple(flat[key].get_value().shape)))
        got = tuple(int(d) for d in reversed(t.shape))
        if got != want:
            problems.append(f"tensor {t.name} has shape {got} (HF order) in the file but the metadata implies {want}")
        if t.tensor_type.name not in SUPPORTED_QUANTS:
            problems.append(f"tensor {t.name} has quant type {t.tensor_type.name}, which is not supported "
                            f"(supported: {', '.join(SUPPORTED_QUANTS)})")
    if problems:
        raise CheckpointError(f"{src}: GGUF does not match its metadata: " + "; ".join(problems))

    # each tensor dequantized when its parameter is placed, dropped after
    return place_parameters(graphdef, abstract_state, layouts,
                            lambda name: _hf_tensor(tensors[names[name]], name, cfg, src), mesh=mesh, rules=rules)


# ----------------------------------------------------------------------------------- tokenizer


def read_gguf_tokenizer(reader) -> Tokenizer:
    """Byte-level BPE from `tokenizer.ggml.tokens` / `merges`, with the metadata's special tokens
    (control and user-defined tokens are added tokens: their spellings encode to their single ids),
    the bos / eos / eot / eom ids as stop tokens and `tokenizer.chat_template`."""
    src = reader.path
    model = _meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{src}: GGUF tokenizer model {model!r} is not supported (byte-level BPE, "
                              "'gpt2', only)")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    pre_tok = _pre_tokenizer(pre)
    if pre_tok is None:
        raise CheckpointError(f"{src}: GGUF pre-tokenizer {pre!r} is not supported; supported: {PRE_TOKENIZERS}")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges", [])]
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad merges
        raise CheckpointError(f"{src}: corrupt GGUF tokenizer ({e})") from None
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    # 3 = CONTROL (special), 4 = USER_DEFINED (added, not special) in llama.cpp's token types
    added = [AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_tokens(added)

    def name(key):
        i = _meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise CheckpointError(f"{src}: tokenizer.ggml.{key}_token_id={i} is outside the vocabulary")
        return tokens[int(i)]

    bos, eos = name("bos"), name("eos")
    if eos is None:
        raise CheckpointError(f"{src}: GGUF metadata has no tokenizer.ggml.eos_token_id")
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    stops = [t for t in (name("eot"), name("eom")) if t is not None]
    return Tokenizer(tok, eos_token=eos, pad_token=name("padding") or eos, bos_token=bos, stop_tokens=stops,
                     chat_template=_meta(reader, "tokenizer.chat_template", None), add_bos=add_bos,
                     source=str(src))


# --------------------------------------------------------------------------------- entry points


def load_gguf(path: str | os.PathLike, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
              dtype: str = "float32", param_dtype: str | None = None) -> tuple[Decoder, Tokenizer]:
    """A Llama-family GGUF as (model, tokenizer): the tokenizer carries the chat template and stop ids."""
    reader = open_gguf(path)
    cfg = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    tokenizer = read_gguf_tokenizer(reader)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocabulary is {cfg.vocab_size}")
    return load_gguf_model(reader, cfg, mesh=mesh, rules=rules), tokenizer
