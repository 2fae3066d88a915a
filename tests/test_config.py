"""Configs: typed model configs, HF config layouts, presets, and clear errors for bad keys and values."""

import importlib.util
import os

import pytest
from ml_collections import ConfigDict

from conftest import ROOT
from tiderl_jax import config as config_lib
from tiderl_jax.model.config import ConfigError, ModelConfig, RopeScaling, UnsupportedArchitectureError


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("name, arch, params", [
    ("tiny", "qwen3", 3.25e6),
    ("qwen2_5_0_5b", "qwen2", 0.494e9),  # published: 0.49B
    ("qwen3_1_7b", "qwen3", 1.72e9),  # published: 1.7B
    ("llama3_1_8b", "llama", 8.03e9),  # published: 8.03B
])
def test_presets_build_the_published_models(name, arch, params):
    c = _load(name)
    m = config_lib.model_config(c)
    assert m.arch == arch
    assert abs(m.num_params - params) / params < 0.01
    config_lib.sharding_rules(c)  # rules parse


def test_unknown_and_invalid_model_keys_are_errors():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['num_layer'\]"):
        ModelConfig.from_dict({"num_layer": 2})
    with pytest.raises(ConfigError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="dtype='float16'"):
        ModelConfig(dtype="float16")
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        ModelConfig.from_dict({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


LLAMA_HF = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def test_hf_config_v4_and_v5_layouts_agree():
    v4 = {**LLAMA_HF, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **SCALING}}
    v4_old_key = {**LLAMA_HF, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **SCALING}}
    v5 = {**LLAMA_HF, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}}
    a, b, c = (ModelConfig.from_hf(x) for x in (v4, v4_old_key, v5))
    assert a == b == c
    assert a.rope_scaling == RopeScaling(**SCALING) and a.rope_theta == 500000.0 and a.head_dim == 8
    assert ModelConfig.from_hf(a.to_hf()) == a


def test_hf_config_rejects_what_we_do_not_implement():
    with pytest.raises(UnsupportedArchitectureError, match="model_type='gpt2'"):
        ModelConfig.from_hf({**LLAMA_HF, "model_type": "gpt2"})
    with pytest.raises(UnsupportedArchitectureError, match="sliding"):
        ModelConfig.from_hf({**LLAMA_HF, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act='gelu'"):
        ModelConfig.from_hf({**LLAMA_HF, "hidden_act": "gelu"})


def test_override_check_names_the_bad_key():
    tiny = str(ROOT / "configs" / "tiny.py")
    config_lib.check_overrides(["x", f"--config={tiny}", "--config.model.num_layers=2"], tiny)
    with pytest.raises(ConfigError, match="config.model has no key 'num_layer'"):
        config_lib.check_overrides(["x", "--config.model.num_layer=2"], tiny)
    with pytest.raises(ConfigError, match="config has no key 'modle'"):
        config_lib.check_overrides(["x", "--config.modle.num_layers", "2"], tiny)


def test_the_checkpoints_tokenizer_carries_its_chat_template_and_stop_ids(tmp_path):
    import json
    import shutil

    shutil.copy(ROOT / "checkpoints" / "tiny_agentic_sft" / "tokenizer.json", tmp_path / "tokenizer.json")
    c = config_lib.base_config()
    with c.unlocked():
        c.checkpoint = str(tmp_path)
        c.tokenizer.eos_token = "<|endoftext|>"
    bare = config_lib.build_tokenizer(c)  # a bare tokenizer.json: the config's eos token
    assert bare.eos_id == bare.token_id("<|endoftext|>") and bare.chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|pad|>", "chat_template": "{{ messages }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    tok = config_lib.build_tokenizer(c)
    assert tok.chat_template == "{{ messages }}" and tok.eos_id == tok.token_id("<|im_end|>") == 258
    assert tok.stop_ids == (258, 256) and tok.pad_id == tok.token_id("<|pad|>")
    with c.unlocked():
        c.checkpoint = ""
    assert config_lib.build_tokenizer(c).source == "builtin byte tokenizer"


def _leaves(node, prefix=""):
    """(key, value, type) of every key of a ConfigDict; a placeholder's type is its declared one, not None's."""
    for key in node.keys():
        value = node[key]
        if isinstance(value, ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value, node.get_type(key)


def _changed(value, kind):
    """A value of type `kind` other than `value` (a placeholder's None included), and its command-line text."""
    if kind is bool:
        return not value, str(not value)
    if kind is int:
        return (value or 0) + 1, str((value or 0) + 1)
    if kind is float:
        return (value or 0.0) + 1.5, repr((value or 0.0) + 1.5)
    if kind is str:
        return value + "x", value + "x"
    if kind is tuple:
        new = value[::-1] if len(value) > 1 else (value * 2 if value else (1,))
        flat = all(isinstance(v, (int, float, str)) for v in new)
        return new, ",".join(map(str, new)) if flat else repr(new)  # a comma list, or a literal when nested
    if kind is ConfigDict and value is None:  # an unset block (model.rope_scaling): a dict literal
        return {"factor": 2.0}, "{'factor': 2.0}"
    if kind is type(None):
        raise AssertionError("a bare None: the flag machinery refuses to override it; make it a typed "
                             "placeholder (tiderl_jax.config.placeholder)")
    raise AssertionError(f"no command-line value for a {kind.__name__} key")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
def test_every_key_of_every_config_is_settable_from_the_command_line(name, monkeypatch):
    # keys whose default is None (loss.dual_clip, controller.eta, ...) are typed placeholders: the flag
    # machinery refuses to override a NoneType key, so such a key could not be set at all
    from absl import flags

    monkeypatch.chdir(ROOT)  # the sim configs import `configs.sim_tiderl_text`
    if name == "smollm2_135m_gsm":
        import smollm2
        smollm2.gguf_path()  # the preset finds the packaged GGUF (the Makefile's install step)
    path = f"configs/{name}.py"
    expected, argv = {}, ["launch/train.py", f"--config={path}"]
    for key, value, kind in _leaves(config_lib.load_config_file(path)):
        try:
            expected[key], text = _changed(value, kind)
        except AssertionError as e:
            raise AssertionError(f"{path}: {key}: {e}") from None
        argv.append(f"--config.{key}={text}")
    assert len(expected) > 20  # the walk reached the sections
    values = flags.FlagValues()  # as a launch script reads its command line
    holder = config_lib.define_config_flag(path, flag_values=values, argv=argv)
    values(argv)
    for key, want in expected.items():
        got = holder.value
        for part in key.split("."):
            got = got[part]
        assert (got.to_dict() if isinstance(got, ConfigDict) else got) == want, (key, got, want)


def test_keys_off_by_default_reach_the_typed_configs_set_or_unset(monkeypatch):
    from absl import flags

    monkeypatch.chdir(ROOT)

    def parsed(*args, path="configs/tiny_agentic.py"):
        values, argv = flags.FlagValues(), ["launch/train.py", f"--config={path}", *args]
        holder = config_lib.define_config_flag(path, flag_values=values, argv=argv)
        values(argv)
        return holder.value

    _, trainer, *_ = config_lib.rl_configs(parsed())
    assert trainer.loss.dual_clip is None and trainer.loss.norm_len is None  # unset: off, as before
    model = config_lib.model_config(parsed())
    assert model.rope_scaling is None and model.image_token_id is None
    controller, trainer, *_ = config_lib.rl_configs(parsed(
        "--config.loss.dual_clip=3", "--config.loss.norm_len=512", "--config.controller.eta=2"))
    assert trainer.loss.dual_clip == 3.0 and isinstance(trainer.loss.dual_clip, float)
    assert trainer.loss.norm_len == 512 and controller.eta == 2 and controller.staleness.eta == 2
    model = config_lib.model_config(parsed(
        "--config.model.rope_scaling={'factor': 4.0}", "--config.model.image_patch_dim=48",
        "--config.model.max_image_patches=4", "--config.model.image_token_id=3"))
    assert model.rope_scaling == RopeScaling(factor=4.0) and model.image_token_id == 3
    llama = "configs/llama3_1_8b.py"  # a block a config sets: each of its keys, or off as a whole
    assert config_lib.model_config(parsed("--config.model.rope_scaling.factor=2.0", path=llama)).rope_scaling \
        == RopeScaling(factor=2.0)
    assert config_lib.model_config(parsed("--config.model.rope_scaling={'rope_type': 'default'}",
                                          path=llama)).rope_scaling is None
    with pytest.raises(ConfigError, match="loss.dual_clip=abc: float expected"):  # named before parsing
        config_lib.check_overrides(["x", "--config.loss.dual_clip=abc"], "configs/tiny_agentic.py")
    with pytest.raises(ConfigError, match="config.model.rope_scaling is unset"):
        config_lib.check_overrides(["x", "--config.model.rope_scaling.factor=2"], "configs/tiny_agentic.py")


def test_remat_on_the_cpu_takes_xla_s_memory_minimising_scheduler(monkeypatch):
    """With trainer.remat on, the platform settings ask XLA:CPU for the scheduler that keeps remat's saving (its
    default runs every layer's recomputation up front: benchmarks/remat.py); without it, nothing is added."""
    c = config_lib.load_config_file(str(ROOT / "configs" / "tiny_agentic.py"))
    c.cpu_devices = 0  # this process's backend has started: its device count stays
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert config_lib.apply_platform_settings(c) == "cpu"
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    c.trainer.remat = "full"
    config_lib.apply_platform_settings(c)
    config_lib.apply_platform_settings(c)  # added once
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0 " + config_lib.CPU_MEMORY_SCHEDULER
