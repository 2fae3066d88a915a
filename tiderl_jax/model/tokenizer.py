"""Tokenizers: any HF `tokenizer.json` through the `tokenizers` library, and a built-in byte tokenizer.

The built-in tokenizer is what the tiny CPU default uses, so nothing is downloaded: ids 0..255 are
the UTF-8 bytes (byte-level BPE with no merges, so every string round-trips exactly), followed by the
special tokens of the chat template. Real models load their own `tokenizer.json`.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tiderl_jax.model.config import ConfigError

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
                 source: str = "tokenizer"):
        self._tok = tok
        self.source = source
        self.eos_id = self._require(eos_token)
        self.pad_id = self._require(pad_token) if pad_token else self.eos_id

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
