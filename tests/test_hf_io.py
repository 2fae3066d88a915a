"""HF checkpoints: logits parity with transformers, export round trip, and named errors for bad input."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from conftest import ARCHS, FIXTURES
from tiderl_jax.model.config import UnsupportedArchitectureError
from tiderl_jax.model.hf_io import CheckpointError, load_hf_checkpoint, save_hf_checkpoint


def _all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(str(f)))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    """Recorded transformers logits (fp32, eager attention) vs ours: max abs diff <= 1e-4."""
    ref = np.load(FIXTURES / arch / "logits.npz")
    model = load_hf_checkpoint(FIXTURES / arch)
    assert model.cfg.arch == arch
    logits, _ = model(jnp.asarray(ref["input_ids"]), jnp.asarray(ref["position_ids"]))
    diff = np.abs(np.asarray(logits) - ref["logits"]).max()
    assert diff <= 1e-4, f"{arch}: max abs logit diff {diff}"


def test_fixtures_cover_each_family():
    cfgs = {a: load_hf_checkpoint(FIXTURES / a).cfg for a in ARCHS}
    assert cfgs["llama"].rope_scaling is not None and not cfgs["llama"].tie_word_embeddings
    assert cfgs["llama"].num_kv_heads < cfgs["llama"].num_heads
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim * cfgs["qwen3"].num_heads != cfgs["qwen3"].hidden_size
    assert (FIXTURES / "qwen3" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_export_round_trip(arch, tmp_path):
    model = load_hf_checkpoint(FIXTURES / arch)
    files = save_hf_checkpoint(model, tmp_path, max_shard_bytes=100_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    original, exported = _all_tensors(FIXTURES / arch), _all_tensors(tmp_path)
    assert set(original) == set(exported)
    for name in original:
        np.testing.assert_array_equal(original[name], exported[name], err_msg=name)
    again = load_hf_checkpoint(tmp_path)
    assert again.cfg == model.cfg
    a, b = nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))
    for (pa, va), (pb, vb) in zip(a, b):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))


def test_single_file_export_and_bf16(tmp_path):
    model = load_hf_checkpoint(FIXTURES / "qwen2")
    assert save_hf_checkpoint(model, tmp_path, dtype="bfloat16") == ["model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m16 = load_hf_checkpoint(tmp_path, dtype="bfloat16")
    assert m16.embed[...].dtype == jnp.bfloat16
    ref = np.load(FIXTURES / "qwen2" / "logits.npz")
    logits, _ = m16(jnp.asarray(ref["input_ids"]), jnp.asarray(ref["position_ids"]))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() < 0.1 * np.abs(ref["logits"]).max()


# ------------------------------------------------------------------ bad checkpoints


def _copy(arch, tmp_path):
    dst = tmp_path / arch
    shutil.copytree(FIXTURES / arch, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(tmp_path):
    path = _copy("llama", tmp_path)
    _edit_config(path, model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="model_type='mistral'"):
        load_hf_checkpoint(path)
    _edit_config(path, model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="'yarn'"):
        load_hf_checkpoint(path)


def test_missing_and_extra_tensors_are_named(tmp_path):
    path = _copy("llama", tmp_path)
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(path)
    msg = str(err.value)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors ['model.layers.9.mlp.up_proj.weight']" in msg


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = _copy("qwen2", tmp_path)
    _edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(path)
    msg = str(err.value)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape (128, 64) in the checkpoint" in msg
    assert "implies (96, 64)" in msg


def test_broken_files_are_named(tmp_path):
    path = _copy("qwen3", tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names shard {shard.name}, which does not exist"):
        load_hf_checkpoint(path)
    path = _copy("qwen2", tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_hf_checkpoint(path)
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf_checkpoint(path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(tmp_path / "nowhere")
