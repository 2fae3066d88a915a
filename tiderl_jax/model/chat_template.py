"""A checkpoint's own chat template (jinja), rendered as transformers renders it, token-in / token-out.

`ChatTemplate.for_tokenizer(tok)` wraps the template a checkpoint ships (HF `tokenizer_config.json`
`chat_template`, or a GGUF's `tokenizer.chat_template`; `Tokenizer.chat_template`). It renders with
transformers' `apply_chat_template` environment: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now`, the `tojson` filter
(json.dumps, non-ASCII kept) and a pass-through `{% generation %}` tag; `bos_token` / `eos_token` /
`pad_token` are in scope. A checkpoint without a template uses the built-in ChatML of `chat.py`.

Trajectories stay token-in / token-out, nothing is ever re-tokenized:
- `encode(messages)` renders the conversation one message at a time, each step's text the extension
  of the previous (checked), and tokenizes the pieces: an assistant turn's body up to its end-of-turn
  token is the model's (the loss mask), the role headers and separators are not.
- `observation_ids(history, new)` is what follows the model's sampled tokens: render the conversation
  without and with the new messages (and the generation prompt), check that one is a prefix of the
  other, and take the token difference after the model's end-of-turn token (including that token when
  the model did not emit it, e.g. cut at max_new_tokens). The model's own tokens stay as sampled.

Tool calls: templates with tool support get OpenAI-style `tool_calls` / `tool` messages; templates
without it (SmolLM2's) see the built-in markup instead: the calls inline as `<tool_call>` JSON in the
assistant's content, a tool result as a user turn in `<tool_response>`, as `chat.render` writes them.
The model's output is parsed by the family's format into `chat.ToolCall`s: `hermes` (ChatML / Qwen2.5:
`<tool_call>{"name", "arguments"}</tool_call>`, `chat.parse_tool_calls`) or `llama3_json` (Llama 3.1:
the turn is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated
by `;`). Stop tokens come from the checkpoint (`Tokenizer.stop_ids`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tiderl_jax.model import chat
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.model.vision import ImageSpan

TOOL_FORMATS = ("hermes", "llama3_json")
PYTHON_TAG = "<|python_tag|>"


class TemplateError(ConfigError):
    """A chat template that does not compile, raises, or rewrites earlier turns."""


# ----------------------------------------------------------------------------------- rendering


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str, *, origin: str = "chat template") -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{origin}: does not compile (line {e.lineno}: {e.message})") from None


def tool_format_of(source: str) -> str:
    """The tool-call format a template's family uses: `<tool_call>` markup or Llama 3.1's JSON."""
    if "<tool_call>" in source:
        return "hermes"
    if "<|start_header_id|>" in source or PYTHON_TAG in source:
        return "llama3_json"
    return "hermes"  # no tool markup of its own: the built-in ChatML markup


# ------------------------------------------------------------------------------ the template


@dataclasses.dataclass
class ChatTemplate:
    tokenizer: Tokenizer
    source: str
    tool_format: str = ""
    extra_context: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. date_string

    def __post_init__(self):
        self.tool_format = self.tool_format or tool_format_of(self.source)
        if self.tool_format not in TOOL_FORMATS:
            raise TemplateError(f"tool_format={self.tool_format!r} is not one of {TOOL_FORMATS}")
        self.origin = f"chat template of {self.tokenizer.source}"
        self._template = compile_template(self.source, origin=self.origin)
        self.supports_tools = "tool_calls" in self.source
        self._ends = tuple(self.tokenizer.decode([i]) for i in self.tokenizer.stop_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, **kwargs) -> "ChatTemplate | None":
        """The checkpoint's template, or None when it ships none (then `chat.py`'s ChatML applies)."""
        return cls(tokenizer, tokenizer.chat_template, **kwargs) if tokenizer.chat_template else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_ids

    # ------------------------------------------------------------------ messages -> text

    def _as_dict(self, m: chat.Message) -> dict[str, Any]:
        if m.images:
            raise ValueError("images in a message need the built-in ChatML (chat.py), not a checkpoint's template")
        if m.role == "assistant" and m.tool_calls:
            if self.supports_tools:
                calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for c in m.tool_calls]
                return {"role": "assistant", "content": m.content, "tool_calls": calls}
            parts = ([m.content] if m.content else []) + [c.render() for c in m.tool_calls]
            return {"role": "assistant", "content": "\n".join(parts)}
        if m.role == "tool" and not self.supports_tools:
            return {"role": "user", "content": f"{chat.RESPONSE_OPEN}\n{m.content}\n{chat.RESPONSE_CLOSE}"}
        return {"role": m.role, "content": m.content}

    def render(self, messages: Sequence[chat.Message], *, add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None) -> str:
        tok = self.tokenizer
        context = dict(self.extra_context, messages=[self._as_dict(m) for m in messages], tools=tools,
                       add_generation_prompt=add_generation_prompt, bos_token=tok.bos_token or "",
                       eos_token=tok.eos_token, pad_token=tok.pad_token)
        if tools is None:
            context.pop("tools")  # templates test `tools is defined` as well as `is not none`
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise TemplateError(f"{self.origin}: {type(e).__name__}: {e}") from None

    def _try_render(self, messages, **kw) -> str | None:
        try:
            return self.render(messages, **kw)
        except TemplateError:
            return None

    def _extends(self, prev: str, text: str, what: str) -> str:
        if not text.startswith(prev):
            at = next((i for i, (a, b) in enumerate(zip(prev, text)) if a != b), min(len(prev), len(text)))
            raise TemplateError(f"{self.origin}: {what} rewrites the earlier rendering at character {at} "
                                f"({prev[at:at + 40]!r} became {text[at:at + 40]!r}); token-in / token-out "
                                "needs each rendering to extend the previous one")
        return text[len(prev):]

    def _end_of_turn(self, text: str) -> tuple[int, int]:
        """(start, end) of the last end-of-turn token text in `text`, or (-1, -1)."""
        best = (-1, -1)
        for end_text in self._ends:
            i = text.rfind(end_text)
            if i > best[0]:
                best = (i, i + len(end_text))
        return best

    # ------------------------------------------------------------------ text -> tokens

    def encode(self, messages: Sequence[chat.Message], *, add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None) -> chat.EncodedChat:
        """Ids of the rendered conversation and the model-token mask (assistant bodies and their
        end-of-turn tokens), from per-message pieces of the template's own rendering."""
        pieces: list[tuple[str, bool]] = []
        prev = ""
        for i, m in enumerate(messages):
            if m.role != "assistant":
                full = self._try_render(messages[:i + 1], tools=tools)
                if full is None and i + 1 < len(messages) and messages[i + 1].role != "assistant":
                    continue  # (e.g. Llama 3.1's tools need the first user turn): one piece with the next
                full = full if full is not None else self.render(messages[:i + 1], tools=tools)
                pieces.append((self._extends(prev, full, f"message {i} ({m.role})"), False))
                prev = full
                continue
            if i == 0:
                raise TemplateError(f"{self.origin}: a conversation cannot open with an assistant message")
            gen = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            full = self.render(messages[:i + 1], tools=tools)
            header = self._extends(prev, gen, f"the generation prompt before message {i}")
            body = self._extends(gen, full, f"message {i} (assistant)")
            _, end = self._end_of_turn(body)
            if end < 0:
                raise TemplateError(f"{self.origin}: the assistant turn {body[:60]!r} holds none of the stop "
                                    f"tokens {self._ends}")
            pieces += [(header, False), (body[:end], True), (body[end:], False)]
            prev = full
        if add_generation_prompt:
            gen = self.render(messages, add_generation_prompt=True, tools=tools)
            pieces.append((self._extends(prev, gen, "the generation prompt"), False))
        ids: list[int] = []
        mask: list[bool] = []
        for text, from_model in pieces:
            piece = self.tokenizer.encode(text) if text else []
            ids += piece
            mask += [from_model] * len(piece)
        return chat.EncodedChat(ids, mask)

    def observation_ids(self, history: Sequence[chat.Message], new: Sequence[chat.Message], *,
                        model_stopped: bool = True, tools: Sequence[dict] | None = None) -> list[int]:
        """The tokens that follow the model's sampled turn (the last message of `history`): the rest of
        its end of turn, the `new` messages and the generation prompt, as the template's token delta.

        `model_stopped`: the sampled tokens end with a stop token (else that token is part of the delta).
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("history must end with the model's (assistant) turn")
        prev = self.render(history, tools=tools)
        full = self.render(list(history) + list(new), add_generation_prompt=True, tools=tools)
        self._extends(prev, full, "adding the observation")
        start, end = self._end_of_turn(prev)
        if start < 0:
            raise TemplateError(f"{self.origin}: the rendered assistant turn holds none of the stop tokens {self._ends}")
        kept = self.tokenizer.encode(prev[:end if model_stopped else start])
        ids = self.tokenizer.encode(full)
        if ids[:len(kept)] != kept:
            raise TemplateError(f"{self.origin}: the tokens of the conversation with the observation do not "
                                "extend those without it (a token merges across the turn boundary)")
        return ids[len(kept):]

    # ------------------------------------------------------------------ the model's output

    def parse_tool_calls(self, text: str) -> chat.ParsedTurn:
        """The model's turn (its decoded text; a trailing stop token is ignored) as content + tool calls."""
        for end_text in self._ends:
            text = text.removesuffix(end_text)
        if self.tool_format == "llama3_json":
            return parse_llama3_json(text)
        return chat.parse_tool_calls(text)


def parse_llama3_json(text: str) -> chat.ParsedTurn:
    """Llama 3.1 JSON tool calls: the turn (after an optional `<|python_tag|>`) is one or more objects
    `{"name": ..., "parameters": {...}}` ("arguments" accepted too) separated by `;`. A turn not
    starting with `{` is plain content. Malformed calls become error strings, never exceptions."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body.removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        if tagged:
            return chat.ParsedTurn(body, (), (f"{PYTHON_TAG} must be followed by a JSON tool call",))
        return chat.ParsedTurn(body, (), ())
    decoder = json.JSONDecoder()
    calls, errors, pos = [], [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at position {e.pos}): {body[:80]!r}")
            break
        error = _llama3_call_error(obj)
        if error:
            errors.append(error)
        else:
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(chat.ToolCall(obj["name"], args))
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            errors.append(f"text after a tool call: {body[pos:pos + 80]!r}")
            break
    return chat.ParsedTurn("", tuple(calls), tuple(errors))


def _llama3_call_error(obj) -> str | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'tool call must be an object with a string "name": {json.dumps(obj)[:80]!r}'
    unknown = sorted(set(obj) - {"name", "parameters", "arguments", "type"})
    if unknown:
        return f"tool call has unknown keys {unknown}"
    if "parameters" in obj and "arguments" in obj:
        return 'tool call has both "parameters" and "arguments"'
    args = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(args, dict):
        return f'tool call "parameters" must be an object, got {type(args).__name__}'
    return None


def continuation_ids(tokenizer: Tokenizer, template: ChatTemplate | None, history: Sequence[chat.Message],
                     new: Sequence[chat.Message], *, stopped: bool, tools: Sequence[dict] | None = None
                     ) -> tuple[list[int], list[ImageSpan]]:
    """The tokens that follow the model's sampled turn (the last message of `history`) when `new` messages
    (tool results, a user turn) come next: the rest of its end of turn (its end-of-turn token when it did not
    stop on one: `stopped`), the new messages and the generation prompt; and their image spans (offsets into
    those tokens). The model's sampled tokens stay as they are (token-in / token-out): in the checkpoint's
    template (`ChatTemplate.observation_ids`), else the built-in ChatML. The rollout loop's observations
    (`agents/rollout.py`) and the HTTP server's session continuations (`serving/openai_api`) both come from here."""
    if template is not None:
        return template.observation_ids(history, new, model_stopped=stopped, tools=tools), []
    prefix = tokenizer.encode(("" if stopped else chat.TURN_END) + "\n")
    encoded = chat.encode(tokenizer, new, add_generation_prompt=True)
    return prefix + encoded.ids, [im.shifted(len(prefix)) for im in encoded.images]
