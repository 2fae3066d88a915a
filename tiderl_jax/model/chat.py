"""The chat template: system / user / assistant / tool turns with explicit tool-call markup.

ChatML, spelled as Qwen2.5 / Qwen3 spell it, so a real Qwen tokenizer and the built-in byte
tokenizer read the same markup:

    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{tool output}\\n</tool_response><|im_end|>\\n

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

from tiderl_jax.model.tokenizer import Tokenizer

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

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {self.role!r}")


def _header(msg: Message) -> str:
    return f"{TURN_START}{'user' if msg.role == 'tool' else msg.role}\n"


def _body(msg: Message) -> str:
    """What follows the header up to and including the end-of-turn token."""
    if msg.role == "tool":
        return f"{RESPONSE_OPEN}\n{msg.content}\n{RESPONSE_CLOSE}{TURN_END}"
    parts = [msg.content] if msg.content else []
    parts += [call.render() for call in msg.tool_calls]
    return "\n".join(parts) + TURN_END


def render(messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    text = "".join(_header(m) + _body(m) + "\n" for m in messages)
    return text + (GENERATION_PROMPT if add_generation_prompt else "")


@dataclasses.dataclass(frozen=True)
class EncodedChat:
    ids: list[int]  # [seq]
    model_mask: list[bool]  # [seq] True where the model produced the token (the RL loss mask)


def encode(tokenizer: Tokenizer, messages: Sequence[Message], *,
           add_generation_prompt: bool = False) -> EncodedChat:
    """Token ids of `render(messages)` and the mask of model-produced tokens."""
    ids: list[int] = []
    mask: list[bool] = []

    def add(text: str, from_model: bool):
        piece = tokenizer.encode(text)
        ids.extend(piece)
        mask.extend([from_model] * len(piece))

    for m in messages:
        add(_header(m), False)
        add(_body(m), m.role == "assistant")
        add("\n", False)
    if add_generation_prompt:
        add(GENERATION_PROMPT, False)
    return EncodedChat(ids, mask)


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
