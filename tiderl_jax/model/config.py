"""Model configuration: one typed description of every decoder in the Llama / Qwen2 / Qwen3 family.

A `ModelConfig` is built once at the entry point, either from an ml_collections config (`configs/`)
or from a Hugging Face `config.json`, and passed down as a frozen value. The three families differ
only in a few switches:

| family | q/k/v bias | q/k RMSNorm | RoPE scaling | typical embeddings |
|--------|-----------|-------------|--------------|--------------------|
| llama  | no        | no          | llama3       | untied (8B) / tied (1B, 3B) |
| qwen2  | yes       | no          | none         | tied (0.5B..3B) |
| qwen3  | no        | yes         | none         | tied (<= 4B) |

Any of them can also read images (`image_patch_dim > 0`, off by default so every HF config and every
text config is unchanged): image patches are embedded into the token stream at the positions of an
image placeholder token (`decoder.PatchEmbed`, `vision.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_DTYPES = ("float32", "bfloat16")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every linear map
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# config.json key of a vision model's image fields (not an HF key): an exported vision model reads
# back here with its image path (hf_io.py saves the patch embedding as extra tensors).
HF_VISION_KEY = "tiderl_vision"
VISION_FIELDS = ("image_patch_dim", "max_image_patches", "image_token_id")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def read_json_object(path, error: type[ConfigError] = ConfigError) -> dict:
    """The JSON object in file `path`; `error` naming the file when it holds none (truncated, corrupt bytes that
    are not UTF-8, garbage, another JSON value): a damaged input is a named error, never a traceback."""
    import json

    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: not valid JSON (a {type(value).__name__}, not an object)")
    return value


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (the `rope_type: llama3` block of an HF config)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters
    init_std: float = 0.02
    # Image input path (0 = text-only). A patch is patch_size x patch_size x channels pixels,
    # flattened (`vision.patchify`), so image_patch_dim = patch_size**2 * channels.
    image_patch_dim: int = 0
    max_image_patches: int = 0  # patches per image (size of the learned patch position embedding)
    image_token_id: int | None = None  # the placeholder token each patch of an image stands on
    # LoRA (the trainer's `lora_rank`, `lora_alpha`, `lora_targets`; `decoder.add_adapters`): low-rank adapters
    # B(A(x)) * alpha / rank added to the `lora_targets` projections of every layer; 0: none. Not an HF key: an
    # export merges them into the weights (`model/lora.py`).
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        problems = []
        if self.arch not in SUPPORTED_ARCHS:
            problems.append(f"arch={self.arch!r} is not one of {SUPPORTED_ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {SUPPORTED_DTYPES}")
        problems += self._vision_problems()
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))  # a config's list too
        if self.lora_rank < 0:
            problems.append(f"lora_rank={self.lora_rank} must be >= 0 (0: no adapters)")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or (self.lora_rank and not self.lora_targets):
            problems.append(f"lora_targets={tuple(self.lora_targets)} must be a non-empty subset of {LORA_TARGETS}")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    def _vision_problems(self) -> list[str]:
        problems = []
        if self.image_patch_dim < 0:
            return [f"image_patch_dim={self.image_patch_dim} must be >= 0 (0: text-only)"]
        if self.image_patch_dim == 0:  # text-only: the other image fields must stay off
            if self.max_image_patches != 0:
                problems.append(f"max_image_patches={self.max_image_patches} needs image_patch_dim > 0")
            if self.image_token_id is not None:
                problems.append(f"image_token_id={self.image_token_id} needs image_patch_dim > 0")
            return problems
        if self.max_image_patches <= 0:
            problems.append(f"max_image_patches={self.max_image_patches} must be positive when "
                            f"image_patch_dim={self.image_patch_dim}")
        if self.image_token_id is None or not 0 <= self.image_token_id < self.vocab_size:
            problems.append(f"image_token_id={self.image_token_id} must be a token id in "
                            f"[0, vocab_size={self.vocab_size}) when image_patch_dim={self.image_patch_dim}")
        return problems

    @property
    def is_vision(self) -> bool:
        return self.image_patch_dim > 0

    @property
    def num_params(self) -> int:
        e, m, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = e * q + 2 * e * kv + q * e + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * e * m + 2 * e
        head = 0 if self.tie_word_embeddings else e * v
        vision = (self.image_patch_dim + 1 + self.max_image_patches) * e if self.is_vision else 0
        return v * e + self.num_layers * layer + e + head + vision

    @property
    def matmul_params(self) -> int:
        """Weights a token multiplies through (the layers' projections and the LM head; not the embedding gather):
        a forward pass costs `2 * matmul_params` FLOPs per token, plus attention."""
        e, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (e * q + 2 * e * kv + q * e + 3 * e * self.intermediate_size) + self.vocab_size * e

    @property
    def attention_flops_per_pair(self) -> int:
        """A forward pass's attention FLOPs per (query, key) pair, every layer: scores and values, 2 x 2 x q width."""
        return 4 * self.num_heads * self.head_dim * self.num_layers

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "model config") -> "ModelConfig":
        """Builds a config from plain values (an ml_collections `config.model`); unknown keys are an error."""
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        scaling = values.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, RopeScaling):
            scaling = dict(scaling)
            rope_type = scaling.pop("rope_type", "llama3")
            if rope_type is None or rope_type == "default":
                values["rope_scaling"] = None
            elif rope_type != "llama3":
                raise ConfigError(
                    f"{source}: rope_scaling rope_type={rope_type!r} is not supported; "
                    f"supported: {SUPPORTED_ROPE_TYPES}")
            else:
                scaling_known = {f.name for f in dataclasses.fields(RopeScaling)}
                bad = sorted(set(scaling) - scaling_known)
                if bad:
                    raise ConfigError(f"{source}: unknown rope_scaling key(s) {bad}")
                values["rope_scaling"] = RopeScaling(**scaling)
        return cls(**values)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, dtype: str = "float32",
                param_dtype: str | None = None, source: str = "config.json") -> "ModelConfig":
        """Reads a Hugging Face `config.json` (transformers 4.x or 5.x layout).

        transformers 5 keeps `rope_theta` and the scaling block in `rope_parameters`; 4.x keeps
        `rope_theta` at top level and the scaling in `rope_scaling`. Both are accepted.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHS:
            archs = hf.get("architectures")
            raise UnsupportedArchitectureError(
                f"{source}: model_type={model_type!r} (architectures={archs}) is not supported; "
                f"supported model types: {SUPPORTED_ARCHS}")
        if hf.get("use_sliding_window"):
            raise UnsupportedArchitectureError(
                f"{source}: use_sliding_window=true is not supported (full attention only)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{source}: hidden_act={act!r} is not supported (silu only)")
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError(f"{source}: mlp_bias=true is not supported")
        vision = dict(hf.get(HF_VISION_KEY) or {})
        unknown = sorted(set(vision) - set(VISION_FIELDS))
        if unknown:
            raise ConfigError(f"{source}: unknown {HF_VISION_KEY} key(s) {unknown}; known: {VISION_FIELDS}")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        block = {**legacy, **rope}
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"{source}: RoPE type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(block["factor"]),
                low_freq_factor=float(block["low_freq_factor"]),
                high_freq_factor=float(block["high_freq_factor"]),
                original_max_position_embeddings=int(block["original_max_position_embeddings"]),
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            arch=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            dtype=dtype,
            param_dtype=param_dtype or dtype,
            **vision,
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` that transformers (4.x and 5.x) reads back as this architecture."""
        names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [names[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if self.arch != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.is_vision:
            out[HF_VISION_KEY] = {name: getattr(self, name) for name in VISION_FIELDS}
        return out


class UnsupportedArchitectureError(ConfigError):
    """A checkpoint's architecture is outside the Llama / Qwen2 / Qwen3 family."""
