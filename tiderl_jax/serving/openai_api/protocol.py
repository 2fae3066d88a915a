"""The OpenAI wire format: request schemas (pydantic), the error JSON, messages and tools to the chat layer.

Requests are validated field by field: a known field of the wrong type or out of range is a 400 naming the
field (`param`); unknown fields are ignored (agents send many options this server has no use for), except
the ones whose meaning it cannot honour, which are refused by name (`unsupported`). The RL extensions are
plain fields: `return_token_ids` (prompt and completion token ids, behaviour log-probs and policy versions in
the response), `session_id` (also the `X-Session-ID` header, or `user`) and `workload_class` (also the
`X-Workload-Class` header: the class MISA-T's quotas count the request in; the front checks it).

Tool calls: the request's `tools` (OpenAI function schemas) go into the prompt (the checkpoint's template
renders them; the built-in ChatML lists them in the system message, as Qwen2.5's template does); the model's
output is parsed back by the family's parser (`ChatTemplate.parse_tool_calls`, `chat.parse_tool_calls`) into
`tool_calls`. An assistant message sent back with `tool_calls` and the `tool` messages after it become
`chat.Message`s (arguments: a JSON object string, as OpenAI sends them).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: F401 (ValidationError re-exported)

from tiderl_jax.model import chat


class APIError(Exception):
    """A request that cannot be served: its status and the OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field."""
    first = e.errors()[0]
    param = ".".join(str(x) for x in first.get("loc", ())) or None
    extra = f" ({len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}{extra}", param=param,
                    code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions: vLLM's ignore_eos (generate max_tokens; benchmarks), and RL's
    ignore_eos: bool = False
    return_token_ids: bool = False
    session_id: str | None = None
    workload_class: str | None = None

    def unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name}={getattr(self, name)} is not supported (only 0): RL trains on the "
                               "policy's own distribution", param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: at most 4 non-empty strings", param="stop", code="invalid_value")
        return stops


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format type {self.response_format.get('type')!r} is not supported "
                           "(no constrained decoding; only 'text')", param="response_format",
                           code="unsupported_parameter")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
            raise APIError(400, "tool_choice 'required' or a named function is not supported (no constrained "
                           "decoding); use 'auto' or 'none'", param="tool_choice", code="unsupported_parameter")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_parameter")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of",
                           code="unsupported_parameter")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------------------ messages and tools

def _text(m: ChatMessageIn) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.type != "text":
            raise APIError(400, f"message content part of type {p.type!r} is not supported (text only)",
                           param="messages", code="unsupported_parameter")
        parts.append(p.text or "")
    return "".join(parts)


def _arguments(raw: str, where: str) -> dict:
    try:
        args = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}: arguments are not valid JSON ({e.msg})", param="messages",
                       code="invalid_value") from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}: arguments must be a JSON object", param="messages", code="invalid_value")
    return args


def to_messages(messages: list[ChatMessageIn]) -> list[chat.Message]:
    """OpenAI messages as the chat layer's (`developer` is a system message)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        calls = tuple(chat.ToolCall(c.function.name, _arguments(c.function.arguments, f"messages.{i}.tool_calls"))
                      for c in m.tool_calls or ())
        if calls and role != "assistant":
            raise APIError(400, f"messages.{i}: only assistant messages carry tool_calls", param="messages")
        out.append(chat.Message(role, _text(m), calls))
    return out


def message_key(m: chat.Message) -> tuple:
    """What must match for a session's served conversation to continue: role, text, tool calls."""
    return (m.role, m.content.strip() if m.role == "assistant" else m.content,
            tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls))


def tool_schemas(tools: list[ToolDef] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def chatml_tools_system(messages: list[chat.Message], tools: list[dict]) -> list[chat.Message]:
    """The built-in ChatML has no tool section of its own: the tools are listed in the system message (a new
    one when the conversation has none), worded as Qwen2.5's template words them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    section = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
               f"{listing}\n</tools>\n\nFor each function call, return a json object with function name and "
               "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if messages and messages[0].role == "system":
        first = messages[0]
        return [chat.Message("system", f"{first.content}\n\n{section}" if first.content else section)] + messages[1:]
    return [chat.Message("system", section)] + list(messages)


def tool_calls_out(calls, prefix: str) -> list[dict]:
    return [{"id": f"call_{prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]
