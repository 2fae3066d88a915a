"""The chat template: system / user / assistant / tool turns with explicit tool-call markup.

ChatML, spelled as Qwen2.5 / Qwen3 spell it, so a real Qwen tokenizer and the built-in byte
tokenizer read the same markup:

    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{tool output}\\n</tool_response><|im_end|>\\n

A system, user or tool message may carry images (each as its patches, `vision.patchify`): each
becomes one `<|image_pad|>` placeholder per patch followed by a newline, ahead of the text (inside
`<tool_response>` for a tool message). `encode` returns where each image sits (`vision.ImageSpan`).

`encode` also returns which tokens the model produced (an assistant turn's body and its closing
`<|im_end|>`, never the role header, prompts or tool output): RL trains on exactly those tokens.
`parse_tool_calls` reads the model's own output back; malformed markup becomes an error string for
the environment to show the model, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import numpy as np

from tiderl_jax.model.tokenizer import IMAGE_TOKEN, Tokenizer
from tiderl_jax.model.vision import ImageSpan

ROLES = ("system", "user", "assistant", "tool")
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
GENERATION_PROMPT = f"{TURN_START}assistant\n"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def render(self) -> str:
        body = json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    images: tuple[np.ndarray, ...] = ()  # each [num_patches, patch_dim] (vision.patchify)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {self.role!r}")
        if self.images and self.role == "assistant":
            raise ValueError("assistant messages carry no images (the model writes text only)")
        for im in self.images:
            if np.ndim(im) != 2 or len(im) == 0:
                raise ValueError(f"a message image must be patches [num_patches > 0, patch_dim], "
                                 f"got shape {np.shape(im)}")


def image_placeholder(num_patches: int) -> str:
    """The text an image of `num_patches` patches renders as: one placeholder token per patch."""
    return IMAGE_TOKEN * num_patches


def _header(msg: Message) -> str:
    return f"{TURN_START}{'user' if msg.role == 'tool' else msg.role}\n"


def _body(msg: Message) -> str:
    """What follows the header up to and including the end-of-turn token."""
    images = "".join(image_placeholder(len(im)) + "\n" for im in msg.images)
    if msg.role == "tool":
        return f"{RESPONSE_OPEN}\n{images}{msg.content}\n{RESPONSE_CLOSE}{TURN_END}"
    parts = [images + msg.content] if images or msg.content else []
    parts += [call.render() for call in msg.tool_calls]
    return "\n".join(parts) + TURN_END


def render(messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    text = "".join(_header(m) + _body(m) + "\n" for m in messages)
    return text + (GENERATION_PROMPT if add_generation_prompt else "")


@dataclasses.dataclass(frozen=True)
class EncodedChat:
    ids: list[int]  # [seq]
    model_mask: list[bool]  # [seq] True where the model produced the token (the RL loss mask)
    images: tuple[ImageSpan, ...] = ()  # where the messages' images sit in `ids`, in order


def encode(tokenizer: Tokenizer, messages: Sequence[Message], *,
           add_generation_prompt: bool = False) -> EncodedChat:
    """Token ids of `render(messages)`, the mask of model-produced tokens, and the image spans.

    Image placeholders are never model tokens (only system, user and tool messages carry images).
    """
    ids: list[int] = []
    mask: list[bool] = []
    images: list[ImageSpan] = []

    def add(text: str, from_model: bool):
        piece = tokenizer.encode(text)
        ids.extend(piece)
        mask.extend([from_model] * len(piece))

    for m in messages:
        add(_header(m), False)
        body = len(ids)
        add(_body(m), m.role == "assistant")
        if m.images:
            images += _locate_images(tokenizer.token_id(IMAGE_TOKEN), ids, body, m.images)
        add("\n", False)
    if add_generation_prompt:
        add(GENERATION_PROMPT, False)
    return EncodedChat(ids, mask, tuple(images))


def _locate_images(image_id: int, ids: list[int], start: int,
                   patches: Sequence[np.ndarray]) -> list[ImageSpan]:
    """Spans of one message's images: its body (ids[start:]) holds one placeholder run per image."""
    runs = []  # [offset, length] of each run of placeholders
    for i in range(start, len(ids)):
        if ids[i] != image_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    if [n for _, n in runs] != [len(p) for p in patches]:
        raise ValueError(f"message text must not contain the image placeholder {IMAGE_TOKEN}: its "
                         f"images have {[len(p) for p in patches]} patches but the message holds "
                         f"placeholder runs of {[n for _, n in runs]}")
    return [ImageSpan(offset, p) for (offset, _), p in zip(runs, patches)]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside tool-call markup, stripped
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]  # one line per malformed call, phrased for the model to read


_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Reads the tool calls out of one assistant turn (its text, without the end-of-turn token)."""
    text = text.removesuffix(TURN_END)
    calls, errors = [], []
    for match in _CALL_RE.finditer(text):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at position {e.pos}): {body[:80]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(f'tool call must be an object with a string "name": {body[:80]!r}')
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            errors.append(f'tool call "arguments" must be an object, got {type(args).__name__}')
            continue
        unknown = sorted(set(obj) - {"name", "arguments"})
        if unknown:
            errors.append(f"tool call has unknown keys {unknown}")
            continue
        calls.append(ToolCall(obj["name"], args))
    rest = _CALL_RE.sub("", text)
    if CALL_OPEN in rest:
        errors.append(f"unclosed {CALL_OPEN}: every call must end with {CALL_CLOSE}")
        rest = rest.split(CALL_OPEN, 1)[0]
    elif CALL_CLOSE in rest:
        errors.append(f"{CALL_CLOSE} without a matching {CALL_OPEN}")
        rest = rest.replace(CALL_CLOSE, "")
    return ParsedTurn(rest.strip(), tuple(calls), tuple(errors))
