"""Hugging Face checkpoints in and out: `config.json` + safetensors (single file or sharded index).

Loading places each tensor directly onto its target `NamedSharding`: the safetensors files are
memory-mapped, each parameter is a lazy view in our layout (reshape / transpose of the map), and
`jax.make_array_from_callback` asks for one device's slice at a time, so only that slice is read from
disk and no full host copy of the model is ever made. (The `safetensors` library's own slicing reads
the HF layout only; our layouts split heads out and transpose, so we map the file ourselves from its
documented header and use the library for writing.)

Bad checkpoints fail before any device memory is touched, with every problem named: an unsupported
architecture, missing tensors, unexpected tensors, or a shape that differs from what config.json
implies (both shapes given).

A vision model (`image_patch_dim > 0`) has parameters no HF Llama / Qwen layout holds: they are saved
as three extra tensors, `vision.patch_embed.weight` [embed, patch_dim] (torch Linear layout),
`vision.patch_embed.bias` [embed] and `vision.position_embedding.weight` [max_image_patches, embed],
with the image fields in a `tiderl_vision` block of config.json. Loading here restores the whole
model. To transformers they are an unknown config key and unused weights, so it should load the
text decoder alone (not tested: the test environment has no transformers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding

from tiderl_jax.model.config import ConfigError, ModelConfig, read_json_object
from tiderl_jax.model.decoder import Decoder, merge_adapters
from tiderl_jax.model.sharding import ActivationSharding, DEFAULT_RULES, Rules, state_shardings
from tiderl_jax.model.tokenizer import Tokenizer


class CheckpointError(ConfigError):
    """A checkpoint's files, tensor names or shapes do not match its config."""


_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F64": np.dtype(np.float64),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}

# Tensors that HF checkpoints may carry but that hold no parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------ layout conversion


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one HF tensor maps onto one of our parameters."""

    hf_name: str
    hf_shape: Callable[[tuple], tuple]  # our shape -> the shape the HF tensor must have
    to_ours: Callable[[np.ndarray, tuple], np.ndarray]  # HF array (lazy view) -> our layout (view)
    to_hf: Callable[[np.ndarray], np.ndarray]  # our array -> HF layout


def _identity(name):
    return _Layout(name, lambda s: s, lambda a, s: a, lambda a: a)


def _transposed(name):  # torch Linear [out, in] <-> ours [in, out]
    return _Layout(name, lambda s: (s[1], s[0]), lambda a, s: a.T, lambda a: a.T)


def _heads_in(name):  # [heads*d, embed] <-> [embed, heads, d]
    return _Layout(
        name,
        lambda s: (s[1] * s[2], s[0]),
        lambda a, s: a.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
        lambda a: a.transpose(1, 2, 0).reshape(a.shape[1] * a.shape[2], a.shape[0]),
    )


def _heads_bias(name):  # [heads*d] <-> [heads, d]
    return _Layout(name, lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s),
                   lambda a: a.reshape(-1))


def _heads_out(name):  # [embed, heads*d] <-> [heads, d, embed]
    return _Layout(
        name,
        lambda s: (s[2], s[0] * s[1]),
        lambda a, s: a.reshape(s[2], s[0], s[1]).transpose(1, 2, 0),
        lambda a: a.transpose(2, 0, 1).reshape(a.shape[2], a.shape[0] * a.shape[1]),
    )


def hf_layouts(cfg: ModelConfig) -> dict[tuple, _Layout]:
    """Our parameter path -> its HF tensor, for every parameter `cfg` implies."""
    out: dict[tuple, _Layout] = {
        ("embed",): _identity("model.embed_tokens.weight"),
        ("final_norm", "scale"): _identity("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = _transposed("lm_head.weight")
    for i in range(cfg.num_layers):
        p, hp = ("layers", i), f"model.layers.{i}"
        out[p + ("input_norm", "scale")] = _identity(f"{hp}.input_layernorm.weight")
        out[p + ("post_attn_norm", "scale")] = _identity(f"{hp}.post_attention_layernorm.weight")
        for proj in ("q", "k", "v"):
            out[p + ("attn", f"{proj}_proj")] = _heads_in(f"{hp}.self_attn.{proj}_proj.weight")
            if cfg.attention_bias:
                out[p + ("attn", f"{proj}_bias")] = _heads_bias(f"{hp}.self_attn.{proj}_proj.bias")
        out[p + ("attn", "o_proj")] = _heads_out(f"{hp}.self_attn.o_proj.weight")
        if cfg.qk_norm:
            out[p + ("attn", "q_norm", "scale")] = _identity(f"{hp}.self_attn.q_norm.weight")
            out[p + ("attn", "k_norm", "scale")] = _identity(f"{hp}.self_attn.k_norm.weight")
        for proj in ("gate", "up", "down"):
            out[p + ("mlp", f"{proj}_proj")] = _transposed(f"{hp}.mlp.{proj}_proj.weight")
    if cfg.is_vision:
        out[("patch_embed", "proj")] = _transposed("vision.patch_embed.weight")
        out[("patch_embed", "bias")] = _identity("vision.patch_embed.bias")
        out[("patch_embed", "position")] = _identity("vision.position_embedding.weight")
    return out


# --------------------------------------------------------------------------------- file access


def _map_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Memory-maps every tensor of one .safetensors file (header: u64 length, JSON, then data). A truncated
    or corrupt file is a CheckpointError naming it (checked here: a memory map past the end fails later,
    obscurely, or reads zeros)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated or corrupt (its header length says at least {8 + n:,} "
                                  f"bytes, the file has {size:,})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # not JSON, or not UTF-8
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            valid = all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)) and begin <= end
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {name}: {str(info)[:80]})")
        if dtype_name not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype_name}")
        if end - begin != int(np.prod(shape)) * _ST_DTYPES[dtype_name].itemsize:
            raise CheckpointError(f"{path}: tensor {name} byte range does not match shape {shape}")
        entries[name] = (_ST_DTYPES[dtype_name], shape, begin, end)
    expected = 8 + n + max((end for *_, end in entries.values()), default=0)
    if expected > size:
        raise CheckpointError(f"{path}: truncated (header says {expected:,} bytes, file has {size:,})")
    return {name: np.zeros(shape, dtype) if end == begin else
            np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=shape)
            for name, (dtype, shape, begin, end) in entries.items()}


def _map_checkpoint(path: pathlib.Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no \"weight_map\" object")
        tensors: dict[str, np.ndarray] = {}
        for file in sorted(set(weight_map.values())):
            if not (path / file).exists():
                raise CheckpointError(f"{index}: names shard {file}, which does not exist")
            for name, arr in _map_safetensors(path / file).items():
                if weight_map.get(name) == file:
                    tensors[name] = arr
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{index}: tensors listed but absent from their shard: {missing[:8]}")
        return tensors
    if single.exists():
        return _map_safetensors(single)
    raise CheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json found")


def read_hf_config(path: str | os.PathLike, *, dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
    cfg_path = pathlib.Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json")
    hf = read_json_object(cfg_path, CheckpointError)
    try:
        return ModelConfig.from_hf(hf, dtype=dtype, param_dtype=param_dtype, source=str(cfg_path))
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: required key {e} is missing") from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a value of another type (a corrupt or hand-edited file)
        raise CheckpointError(f"{cfg_path}: a value of the wrong type ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------------------------- loading


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    dtype: str = "float32",
    param_dtype: str | None = None,
) -> Decoder:
    """Loads an HF Llama / Qwen2 / Qwen3 checkpoint into a `Decoder`.

    With a mesh, every parameter is created on its NamedSharding from `rules`, each device reading
    only its own slice from the memory-mapped files; without one, on the default device.
    """
    path = pathlib.Path(path)
    cfg = read_hf_config(path, dtype=dtype, param_dtype=param_dtype)
    tensors = _map_checkpoint(path)
    layouts = hf_layouts(cfg)

    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(abstract_state))
    if set(flat) != set(layouts):  # our model and our own table disagree: a bug, not bad input
        raise AssertionError(f"hf_layouts out of sync with Decoder: {set(flat) ^ set(layouts)}")

    expected = {lay.hf_name for lay in layouts.values()}
    ignorable = {n for n in tensors if n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        logging.warning("%s: tie_word_embeddings=true; ignoring the checkpoint's lm_head.weight", path)
        ignorable.add("lm_head.weight")
    problems = []
    missing = sorted(expected - set(tensors))
    extra = sorted(set(tensors) - expected - ignorable)
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    for key, lay in layouts.items():
        if lay.hf_name not in tensors:
            continue
        want = tuple(lay.hf_shape(tuple(flat[key].get_value().shape)))
        got = tuple(tensors[lay.hf_name].shape)
        if got != want:
            problems.append(f"tensor {lay.hf_name} has shape {got} in the checkpoint but the config "
                            f"implies {want}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match its config.json ({cfg.arch}): "
                              + "; ".join(problems))

    # lazy: each view reads nothing until a device asks for its slice
    return place_parameters(graphdef, abstract_state, layouts, tensors.__getitem__, mesh=mesh, rules=rules)


def place_parameters(graphdef, abstract_state, layouts: dict[tuple, _Layout],
                     hf_tensor: Callable[[str], np.ndarray], *, mesh: Mesh | None = None,
                     rules: Rules = DEFAULT_RULES) -> Decoder:
    """Fills an abstract `Decoder` state (`nnx.split` of `nnx.eval_shape`) from HF-layout tensors, one
    parameter at a time: `hf_tensor(name)` gives the HF array (a lazy view, or a dequantized one), and
    each device receives its slice of our layout on its NamedSharding (`rules` over `mesh`; without a
    mesh, the default device). Shapes must have been checked by the caller."""
    flat = dict(nnx.to_flat_state(abstract_state))
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(state_shardings(abstract_state, mesh, rules)))
    else:
        device = SingleDeviceSharding(jax.local_devices()[0])
        shardings = {k: device for k in flat}

    for key, var in flat.items():
        lay = layouts[key]
        shape = tuple(var.get_value().shape)
        target = np.dtype(var.get_value().dtype)
        view = lay.to_ours(hf_tensor(lay.hf_name), shape)
        array = jax.make_array_from_callback(
            shape, shardings[key], lambda idx, view=view: np.asarray(view[idx]).astype(target))
        var.set_value(array)
        del view
    model = nnx.merge(graphdef, abstract_state)
    if mesh is not None:
        model.activation_sharding = ActivationSharding(mesh, rules)
    return model


# ------------------------------------------------------------------------------------- export


def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf_checkpoint(model: Decoder, path: str | os.PathLike, *,
                       max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> list[str]:
    """Writes `model` as an HF checkpoint (config.json + safetensors, sharded past max_shard_bytes).

    Tensors are gathered one at a time and written shard by shard, so host memory peaks at about one
    shard. In a multi-process run every process gathers (a collective) and process 0 writes.
    Returns the safetensors file names.
    """
    model = merge_adapters(model)  # LoRA's adapters merged into the weights: an HF checkpoint has no adapters
    cfg = model.cfg
    path = pathlib.Path(path)
    write = jax.process_index() == 0
    if write:
        path.mkdir(parents=True, exist_ok=True)
        out_cfg = dataclasses.replace(cfg, param_dtype=dtype) if dtype else cfg
        (path / "config.json").write_text(json.dumps(out_cfg.to_hf(), indent=2) + "\n")
    layouts = hf_layouts(cfg)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    out_dtype = np.dtype(jnp.dtype(dtype)) if dtype else None

    # Plan shards from shapes alone, then fill them one at a time.
    shards: list[list[tuple]] = [[]]
    size = 0
    for key in sorted(layouts, key=lambda k: layouts[k].hf_name):
        v = flat[key].get_value()
        nbytes = v.size * (out_dtype or np.dtype(v.dtype)).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file, keys in zip(names, shards):
        tensors = {}
        for key in keys:
            lay = layouts[key]
            arr = np.ascontiguousarray(lay.to_hf(_to_host(flat[key].get_value())))
            if out_dtype is not None:
                arr = arr.astype(out_dtype)
            tensors[lay.hf_name] = arr
            weight_map[lay.hf_name] = file
            total += arr.nbytes
        if write:
            safetensors.numpy.save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
    if write and len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def export_hf(model: Decoder, tokenizer: Tokenizer, path: str | os.PathLike, *, dtype: str | None = None) -> None:
    """`model` and `tokenizer` as an HF checkpoint that transformers loads (`AutoModelForCausalLM`,
    `AutoTokenizer` with its chat template) and `launch/generate.py --checkpoint=path` too."""
    path = pathlib.Path(path)
    save_hf_checkpoint(model, path, dtype=dtype)
    if jax.process_index() != 0:
        return
    tokenizer.save_pretrained(path)
    gen = {"eos_token_id": list(tokenizer.stop_ids) if len(tokenizer.stop_ids) > 1 else tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = tokenizer.bos_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def export_policy(graphdef, params, tokenizer, path: str | os.PathLike, *, meta: dict | None = None) -> int:
    """A policy (`nnx.split` halves: the graph and its weights) as an HF checkpoint with its tokenizer:
    config.json, safetensors, tokenizer.json, tokenizer_config.json (special tokens, chat template) and
    generation_config.json (stop ids) as `export_hf` writes them (and `export.json` holding `meta`,
    when given), loadable by `load_hf_checkpoint`, `Tokenizer.from_checkpoint`, `launch/generate.py
    --checkpoint=path` and transformers. Returns the bytes of the files in `path`."""
    path = pathlib.Path(path)
    export_hf(nnx.merge(graphdef, params), tokenizer, path)
    if jax.process_index() != 0:
        return 0
    if meta is not None:
        (path / "export.json").write_text(json.dumps(meta, indent=1) + "\n")
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
