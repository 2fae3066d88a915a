"""Tokenizers: any HF `tokenizer.json` through the `tokenizers` library, and a built-in byte tokenizer.

The built-in tokenizer is what the tiny CPU default uses, so nothing is downloaded: ids 0..255 are
the UTF-8 bytes (byte-level BPE with no merges, so every string round-trips exactly), followed by the
special tokens of the chat template. Real models load their own `tokenizer.json` (`from_checkpoint`
also reads `tokenizer_config.json`: the bos / eos / pad tokens and the chat template; and
`generation_config.json`: the stop ids), or their GGUF's vocabulary (`gguf_io.read_gguf_tokenizer`).

`stop_ids` are the tokens that end a model's turn (the eos token, and e.g. Llama 3's `<|eot_id|>` /
`<|eom_id|>`); `chat_template` is the checkpoint's jinja template source (`chat_template.py`), if any.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tiderl_jax.model.config import ConfigError, read_json_object

# The placeholder an image patch stands on (`vision.py`): Qwen2.5 / Qwen3 tokenizers carry it too.
IMAGE_TOKEN = "<|image_pad|>"

# Special tokens of the ChatML markup (the Qwen2.5 / Qwen3 spelling), in id order after the bytes.
CHAT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|pad|>",
    IMAGE_TOKEN,
)


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character map of byte-level BPE (GPT-2's scheme)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class Tokenizer:
    """A thin, typed wrapper over `tokenizers.Tokenizer` with the ids the system needs."""

    def __init__(self, tok: tokenizers.Tokenizer, *, eos_token: str, pad_token: str | None = None,
                 source: str = "tokenizer", bos_token: str | None = None, stop_tokens: Sequence[str] = (),
                 chat_template: str | None = None, add_bos: bool = False):
        self._tok = tok
        self.source = source
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token, pad_token or eos_token
        self.eos_id = self._require(eos_token)
        self.pad_id = self._require(pad_token) if pad_token else self.eos_id
        self.bos_id = self._require(bos_token) if bos_token else None
        self.stop_ids = tuple(dict.fromkeys([self.eos_id] + [self._require(t) for t in stop_tokens]))
        self.chat_template = chat_template
        self.add_bos = add_bos  # plain-text prompts start with bos_id (HF's add_bos_token)

    def _require(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(f"{self.source}: has no token {token!r}")
        return i

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, eos_token: str = "<|im_end|>",
                  pad_token: str | None = None) -> "Tokenizer":
        """Loads a `tokenizer.json` (for example a Qwen or Llama checkpoint's)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise ConfigError(f"tokenizer file {path} does not exist")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise ConfigError(f"tokenizer file {path} could not be parsed: {e}") from None
        return cls(tok, eos_token=eos_token, pad_token=pad_token, source=path)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "Tokenizer":
        """An HF checkpoint directory's tokenizer: `tokenizer.json`, and from `tokenizer_config.json`
        (when present) the eos / bos / pad tokens and the chat template, from `generation_config.json`
        the stop ids. Without tokenizer_config.json the eos token is ChatML's `<|im_end|>` (this
        project's own exports of the built-in tokenizer)."""
        path = os.fspath(path)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        if config is None:
            return cls.from_file(path)
        base = cls.from_file(path, eos_token=_token_text(config.get("eos_token")) or "<|im_end|>")
        tok = base._tok
        generation = _read_json(os.path.join(path, "generation_config.json")) or {}
        stop = generation.get("eos_token_id")
        stop = [] if stop is None else stop if isinstance(stop, list) else [stop]
        stop_tokens = []
        for i in stop:
            token = tok.id_to_token(i) if isinstance(i, int) and i >= 0 else None
            if token is None:
                raise ConfigError(f"{path}/generation_config.json: eos_token_id {i!r} is not in the vocabulary")
            stop_tokens.append(token)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None:
            template = _read_text(os.path.join(path, "chat_template.jinja"))
        bos = _token_text(config.get("bos_token"))
        return cls(tok, eos_token=base.eos_token, pad_token=_token_text(config.get("pad_token")),
                   bos_token=bos, stop_tokens=stop_tokens, chat_template=template,
                   add_bos=bool(config.get("add_bos_token", False)) and bos is not None, source=base.source)

    @classmethod
    def builtin(cls) -> "Tokenizer":
        """The byte tokenizer of the CPU default: 256 byte ids + the chat special tokens."""
        vocab = {ch: b for b, ch in _byte_to_unicode().items()}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
        return cls(tok, eos_token="<|im_end|>", pad_token="<|pad|>", source="builtin byte tokenizer")

    # ------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        return self._require(token)

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special-token spellings in `text` become their single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(os.fspath(path))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """tokenizer.json and tokenizer_config.json (special tokens, chat template) in directory `path`,
        as transformers' `AutoTokenizer` and `from_checkpoint` read them."""
        os.makedirs(path, exist_ok=True)
        self.save(os.path.join(path, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
                  "pad_token": self.pad_token, "bos_token": self.bos_token, "add_bos_token": self.add_bos,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")


def _token_text(token) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken object ({"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: str) -> dict | None:
    return read_json_object(path) if os.path.exists(path) else None


def _read_text(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
