"""The server's core, apart from HTTP: prompts, sessions, generation through the rollout service, keys, limits.

```
request ─► plan (prompt tokens; a session's continuation: only the new tokens) ─► service.turn(session, ...)
             │ chat: the checkpoint's template / built-in ChatML, tools in the prompt     │ polled each engine step
             │ a session: its served tokens + continuation_ids(new messages)              ▼ (streaming, stop strings)
             └ stateless: the whole prompt, KV dropped at the end               choices, session record updated
```

**Sessions** (`X-Session-ID`, the `user` field, `session_id`, or the session a per-session key is bound to): a
conversation the server keeps token-in / token-out. Its record holds the exact tokens it served (a
`Trajectory`: prompt and tool / user tokens masked, the model's tokens with their behaviour log-probs and
policy versions) and the messages as served. A request whose messages extend the served ones (the
assistant's replies echoed back, then new tool / user messages) continues it: the new messages become
`model.chat_template.continuation_ids` after the model's own sampled tokens, nothing is re-tokenized, and with
`kv_mode="ctb"` the turn resumes on the replica that holds the session's KV (kept and pinned between calls;
only the new tokens are prefilled). A request that rewrites the history starts the session's context over
(`rewrites` counts it; the trajectory is the last consistent conversation). Sessions idle past
`session_ttl_s` are ended and their KV released; past `max_sessions` the least recently used idle one is
ended (a new session while every one is serving a call: 429). A session serves one request at a time (others
queue); one ended while its call waits or runs (its agent's episode over) answers that call 409.
`/v1/completions` sessions continue when the new prompt's token ids extend the served ones.

Requests with `n > 1` or without a session are stateless: their KV is dropped when they end.

**Workload class** (`X-Workload-Class`, or the `workload_class` extension): the class the router's class quotas
(MISA-T) count the request in, one of `routing.classes` (400 naming it otherwise). A session keeps the class of
its first request (another one later: 400); unnamed, a session is `agentic` and a stateless request `rlvr`.

**Limits and errors** (`protocol.APIError`): a prompt plus `max_tokens` beyond the engine's context, or
`max_tokens` above `ServerLimits.max_tokens`: 400; more than `max_inflight` completions at once (each request
counts its prompts x n): 429 (admission holds it), a request larger than `max_inflight` alone: 400; while
`swapping()` (an engine being replaced): 503; an engine that failed: 503.

**Log-probs**: `logprob` is the untempered model's (`SequenceOutput.logp_model`, vLLM's default);
`top_logprobs` come from one full forward of the context on the serving engine's weights (the engine samples
one token and keeps its two log-probs, not a top-k). The behaviour log-probs RL needs (under the sampling
distribution) are in the `return_token_ids` extension. Engine workers (`faults/worker_engine.py`) run no
forward here: with them a request for top log-probs is refused (400, naming them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import secrets
import time
from typing import Callable, Sequence

from tiderl_jax.trajectory import Trajectory, Turn
from tiderl_jax.engine.engine import Engine, Request, SequenceOutput
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.model import chat
from tiderl_jax.model.chat_template import ChatTemplate, continuation_ids
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.policies import routing
from tiderl_jax.serving.openai_api import protocol as P
from tiderl_jax.serving.service import EngineFailed, RolloutService

log = logging.getLogger(__name__)

# a request's workload class when it names none: a session is a multi-turn conversation, a stateless request one shot
SESSION_CLASS, STATELESS_CLASS = "agentic", "rlvr"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20  # request body
    max_tokens: int = 4096  # per request (max_tokens / max_completion_tokens above: 400)
    max_inflight: int = 256  # completions served at once (a request's prompts x n); more: 429
    session_ttl_s: float = 600.0  # an idle session is ended and its KV released
    max_sessions: int = 4096  # more live sessions: the least recently used idle one is ended

    def __post_init__(self):
        if min(self.max_body_bytes, self.max_tokens, self.max_inflight, self.max_sessions) < 1 or \
                not self.session_ttl_s > 0:
            raise ValueError(f"ServerLimits: every limit must be positive, got {self}")


@dataclasses.dataclass
class Session:
    id: str
    kind: str  # "chat" | "completion"
    traj: Trajectory
    cls: str = SESSION_CLASS  # its workload class (the router's class quotas)
    messages: list = dataclasses.field(default_factory=list)  # chat.Message, as served
    keys: list = dataclasses.field(default_factory=list)  # protocol.message_key of each (what an echo must match)
    tools: str = "null"
    stopped: bool = True  # the last turn's tokens end with a stop token
    last_used: float = 0.0
    requests: int = 0
    rewrites: int = 0
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


@dataclasses.dataclass
class Plan:
    """One request's work: the context each choice starts from and how it samples."""

    context: list[int]
    sampling: SamplingParams
    n: int = 1
    stops: tuple[str, ...] = ()
    session: Session | None = None
    delta: list[int] | None = None  # a session's continuation: the tokens after what it served
    messages: list | None = None  # chat: the whole conversation (the session's record)
    keys: list | None = None
    tools: list | None = None
    parse_tools: bool = False
    top_logprobs: int = 0
    cls: str = STATELESS_CLASS  # its workload class (a session's request: the session's)


@dataclasses.dataclass
class Choice:
    index: int
    tokens: list[int]  # generated
    text: str  # as returned (the trailing stop token and anything from a stop string on removed)
    finish_reason: str
    logp_model: list[float]
    logp_sample: list[float]
    versions: list[int]
    top: list | None = None  # per token [(id, logprob)], when asked
    message: chat.Message | None = None  # chat: content and parsed tool calls
    ttft_s: float | None = None
    seconds: float = 0.0  # from the request to the turn's end


class Frontend:
    """The OpenAI server's logic over a running `RolloutService` (module docstring)."""

    def __init__(self, service: RolloutService, tokenizer: Tokenizer, *, model_name: str,
                 limits: ServerLimits = ServerLimits(), kv_mode: str = "ctb", api_key: str | None = None,
                 metrics=None, chatml_tools: bool = False, max_context: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if kv_mode not in ("ctb", "request"):
            raise ValueError(f"kv_mode {kv_mode!r} is not 'ctb' or 'request'")
        self.service, self.tok, self.model_name = service, tokenizer, model_name
        self.template = ChatTemplate.for_tokenizer(tokenizer)
        self.limits, self.kv_mode, self.api_key, self.clock = limits, kv_mode, api_key, clock
        self.metrics = metrics
        self.chatml_tools = chatml_tools  # the built-in ChatML lists the tools in the system message
        self._context = max_context  # a lower context limit than the engines' (a trainer's row length)
        self.sessions: dict[str, Session] = {}
        self._keys: dict[str, str] = {}  # per-session key -> its session
        self._anon = itertools.count()
        self._ids = itertools.count()
        self.inflight = 0
        self._swapping = 0
        self._scorer = None
        self._watched: dict[tuple[int, int], Callable[[SequenceOutput], None]] = {}  # (replica, handle) -> reader
        service.step_listeners.append(self._after_step)

    # ------------------------------------------------------------------ access

    def issue_key(self, session_id: str) -> str:
        """A key whose every request is served in `session_id` (an external agent's own key)."""
        key = "sk-tiderl-" + secrets.token_urlsafe(24)
        self._keys[key] = session_id
        return key

    def revoke_key(self, key: str) -> None:
        self._keys.pop(key, None)

    def authorize(self, header: str | None) -> str | None:
        """The session a per-session key binds the request to (None: any). 401 without a valid key when the
        server has a key or has issued any."""
        if self.api_key is None and not self._keys:
            return None
        scheme, _, key = (header or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        if self.api_key is not None and secrets.compare_digest(key.encode(), self.api_key.encode()):
            return None
        if key in self._keys:
            return self._keys[key]
        raise P.APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", type="authentication_error",
                         code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise P.APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    @contextlib.contextmanager
    def swapping(self):
        """While an engine is replaced: new requests get 503."""
        self._swapping += 1
        try:
            yield
        finally:
            self._swapping -= 1

    def admit(self, completions: int = 1) -> Callable[[], None]:
        """Takes `completions` of the `max_inflight` slots (a request's prompts x n: each one engine sequence);
        returns the function that gives them back (once, however often it is called). 400 for a request larger
        than the limit alone, 429 above it, 503 while swapping or with no live engine."""
        if self._swapping:
            raise P.APIError(503, "the engine is being swapped; retry shortly", type="service_unavailable",
                             code="engine_swapping", headers={"Retry-After": "1"})
        if not self.service.live():
            raise P.APIError(503, "no live engine replica", type="service_unavailable", code="engine_failed")
        limit = self.limits.max_inflight
        if completions > limit:
            raise P.APIError(400, f"this request asks for {completions} completions (prompts x n); this server "
                             f"serves at most {limit} at once (max_inflight)", code="too_many_completions")
        if self.inflight + completions > limit:
            raise P.APIError(429, f"admission holds the request: {self.inflight} completions in flight, "
                             f"{completions} more would pass the limit {limit}", type="rate_limit_error",
                             code="admission_held", headers={"Retry-After": "1"})
        self.inflight += completions

        def release():
            nonlocal completions
            self.inflight -= completions
            completions = 0
        return release

    @property
    def max_context(self) -> int:
        engines = min(r.engine.config.max_seq_len for r in self.service.replicas)
        return min(engines, self._context) if self._context else engines

    # ------------------------------------------------------------------ sessions

    def _session(self, sid: str | None, kind: str, cls: str | None = None) -> Session | None:
        if sid is None:
            return None
        self.expire()
        s = self.sessions.get(sid)
        if s is not None and s.kind != kind:
            raise P.APIError(400, f"session {sid!r} is a {s.kind} session; it cannot continue as {kind}",
                             param="session_id", code="session_kind")
        if s is not None and cls is not None and s.cls != cls:  # the router counts a session in one class
            raise P.APIError(400, f"session {sid!r} is of workload class {s.cls!r}; it cannot continue as {cls!r}",
                             param="workload_class", code="session_class")
        if s is None:
            if len(self.sessions) >= self.limits.max_sessions:  # the least recently used idle one ends
                idle = [x for x in self.sessions.values() if not x.lock.locked()]
                if not idle:
                    raise P.APIError(429, f"all {len(self.sessions)} sessions are serving a call (max_sessions "
                                     f"{self.limits.max_sessions})", type="rate_limit_error",
                                     code="admission_held", headers={"Retry-After": "1"})
                self.end_session(min(idle, key=lambda x: x.last_used).id)
            s = self.sessions[sid] = Session(sid, kind, Trajectory(sid, "http", 0), cls=cls or SESSION_CLASS,
                                             last_used=self.clock())
        return s

    def _workload_class(self, header: str | None, req: P._Sampling) -> str | None:
        """The class the request names (the header, else the body), checked; None when it names none."""
        name = header or req.workload_class
        known = routing.classes(self.service.config.router)
        if name is not None and name not in known:
            raise P.APIError(400, f"workload class {name!r} is not one of {list(known)}", param="workload_class",
                             code="invalid_value")
        return name

    def end_session(self, sid: str) -> Session | None:
        """Ends a session: its KV released, the router told; returns its record."""
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.service.end_session(sid, s.cls, len(s.traj.tokens))
        return s

    def expire(self) -> None:
        now = self.clock()
        for s in [s for s in self.sessions.values() if now - s.last_used > self.limits.session_ttl_s
                  and not s.lock.locked()]:
            log.info("session %s idle for %.0fs: ended", s.id, now - s.last_used)
            self.end_session(s.id)

    def _restart(self, s: Session) -> None:
        if s.traj.tokens:
            s.rewrites += 1
            self.service.release(s.id)
        s.traj = Trajectory(s.id, "http", 0, info=s.traj.info)
        s.messages, s.keys, s.stopped = [], [], True

    # ------------------------------------------------------------------ planning

    def _sampling(self, req: P._Sampling, stop_strings: Sequence[str]) -> tuple[SamplingParams, tuple[str, ...]]:
        stop_ids, strings = ([] if req.ignore_eos else list(self.tok.stop_ids)), []
        for text in stop_strings:
            ids = self.tok.encode(text)
            if len(ids) == 1 and ids[0] not in stop_ids and len(stop_ids) < self.service.replicas[0].engine.config.max_stop_ids:
                stop_ids.append(ids[0])  # one token: the engine stops on it
            strings.append(text)  # (also cut by text: the stop string is not returned)
        seed = req.seed % 2**31 if req.seed is not None else secrets.randbelow(2**31 - 16)
        sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p,
                                  top_k=max(0, req.top_k or 0), seed=seed, stop_ids=tuple(stop_ids))
        return sampling, tuple(strings)

    def _budget(self, req, context_len: int, sampling: SamplingParams) -> SamplingParams:
        limit, ctx = req.token_limit, self.max_context
        if limit is not None and limit > self.limits.max_tokens:
            raise P.APIError(400, f"max_tokens={limit} is above this server's limit {self.limits.max_tokens}",
                             param="max_tokens", code="invalid_value")
        room = ctx - context_len
        if room < 1 or (limit is not None and limit > room):
            raise P.APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt is "
                             f"{context_len} tokens and max_tokens is {limit or 1}", param="messages",
                             code="context_length_exceeded")
        return dataclasses.replace(sampling, max_new_tokens=limit or min(room, self.limits.max_tokens))

    def _top_logprobs(self, k: int, param: str) -> int:
        """`k`, when the serving engines can score it: a full forward of the context (engine workers cannot)."""
        if k and any(getattr(r.engine, "runner", None) is None for r in self.service.live()):
            raise P.APIError(400, f"{param}: top log-probs need a full forward of the context on the serving "
                             "weights, which this server's engine workers (controller.engine_workers) do not run",
                             param=param, code="unsupported_parameter")
        return k

    def plan_chat(self, req: P.ChatCompletionRequest, sid: str | None, workload_class: str | None = None) -> Plan:
        """`workload_class`: the `X-Workload-Class` header (module docstring)."""
        req.unsupported()
        cls = self._workload_class(workload_class, req)
        msgs = P.to_messages(req.messages)
        tools = P.tool_schemas(req.tools) if req.tool_choice != "none" else None
        keys = [P.message_key(m) for m in msgs]
        sampling, stops = self._sampling(req, req.stops())
        top = self._top_logprobs(req.num_top_logprobs, "top_logprobs")
        session = self._session(sid, "chat", cls) if req.n == 1 else None
        plan = Plan([], sampling, req.n, stops, session, messages=msgs, keys=keys, tools=tools,
                    parse_tools=bool(tools), top_logprobs=top,
                    cls=session.cls if session is not None else cls or STATELESS_CLASS)
        tools_key = json.dumps(tools, sort_keys=True)
        s = session
        if s is not None and s.keys and s.tools == tools_key and keys[:len(s.keys)] == s.keys and \
                len(keys) > len(s.keys) and all(m.role != "assistant" for m in msgs[len(s.keys):]):
            try:
                plan.delta, _ = continuation_ids(self.tok, self.template, s.messages, msgs[len(s.keys):],
                                                 stopped=s.stopped, tools=tools)
            except ValueError as e:
                raise P.APIError(400, f"messages: {e}", param="messages") from None
            plan.context = list(s.traj.tokens) + plan.delta
        else:
            plan.context = self._encode(msgs, tools)
        plan.sampling = self._budget(req, len(plan.context), sampling)
        return plan

    def _encode(self, msgs: list[chat.Message], tools: list | None) -> list[int]:
        if msgs[-1].role == "assistant":
            raise P.APIError(400, "the last message is the assistant's: nothing to reply to", param="messages")
        try:
            if self.template is not None:
                return self.template.encode(msgs, add_generation_prompt=True, tools=tools).ids
            return chat.encode(self.tok, self._with_tools(msgs, tools), add_generation_prompt=True).ids
        except ValueError as e:  # TemplateError included: a conversation the template refuses
            raise P.APIError(400, f"messages: {e}", param="messages") from None

    def _with_tools(self, msgs: list[chat.Message], tools: list | None) -> list[chat.Message]:
        """The built-in ChatML has no tool section: the project's tasks describe their tools in the system
        message, so the `tools` only turn on the parsing, unless `chatml_tools` lists them there."""
        return P.chatml_tools_system(msgs, tools) if tools and self.chatml_tools else msgs

    def plan_completion(self, req: P.CompletionRequest, sid: str | None,
                        workload_class: str | None = None) -> list[Plan]:
        """`workload_class`: the `X-Workload-Class` header (module docstring)."""
        req.unsupported()
        cls = self._workload_class(workload_class, req)
        prompts = req.prompts()
        sampling, stops = self._sampling(req, req.stops())
        top = self._top_logprobs(req.num_top_logprobs, "logprobs")
        session = self._session(sid, "completion", cls) if req.n == 1 and len(prompts) == 1 else None
        cls = session.cls if session is not None else cls or STATELESS_CLASS
        plans = []
        vocab = self.service.replicas[0].engine.model_cfg.vocab_size
        for p in prompts:
            if isinstance(p, str):
                ids = ([self.tok.bos_id] if self.tok.add_bos else []) + self.tok.encode(p)
            elif isinstance(p, list) and all(isinstance(t, int) and 0 <= t < vocab for t in p) and p:
                ids = list(p)
            else:
                raise P.APIError(400, f"prompt: token ids must be a non-empty list of ints in [0, {vocab})",
                                 param="prompt", code="invalid_value")
            plan = Plan(ids, sampling, req.n, stops, session, top_logprobs=top, cls=cls)
            served = session.traj.tokens if session is not None else []
            if served and len(ids) > len(served) and ids[:len(served)] == served:
                plan.delta = ids[len(served):]
            plan.sampling = self._budget(req, len(ids), sampling)
            plans.append(plan)
        return plans

    # ------------------------------------------------------------------ generation

    async def run(self, plan: Plan, on_progress: Callable[[int, SequenceOutput], None] | None = None) -> list[Choice]:
        """Every choice of one plan; a session's turn updates its record. `on_progress(choice, output)` gets
        the engine's output of each running choice once per engine step (streaming)."""
        s = plan.session
        if s is None:
            return list(await asyncio.gather(*(self._choice(plan, i, on_progress) for i in range(plan.n))))
        async with s.lock:
            if self.sessions.get(s.id) is not s:  # ended while this request waited for it
                raise self._ended(s)
            if plan.delta is None or s.traj.tokens != plan.context[:len(s.traj.tokens)]:
                if plan.delta is not None:  # another request of the session ran first: its context moved on
                    raise P.APIError(409, f"session {s.id!r} changed while this request waited; resend it",
                                     param="session_id", code="session_conflict")
                self._restart(s)
            s.requests += 1
            choice = await self._choice(plan, 0, on_progress)
            if self.sessions.get(s.id) is not s:  # ended while its turn ran: nothing would release its KV
                if s.id not in self.sessions:
                    self.service.release(s.id)
                raise self._ended(s)
            self._record(s, plan, choice)
            return [choice]

    @staticmethod
    def _ended(s: Session) -> P.APIError:
        return P.APIError(409, f"session {s.id!r} ended while this request ran", param="session_id",
                          code="session_ended")

    async def _choice(self, plan: Plan, index: int, on_progress) -> Choice:
        s = plan.session
        key = s.id if s is not None else ("http", next(self._anon))
        sampling = dataclasses.replace(plan.sampling, seed=(plan.sampling.seed + index) % 2**31)
        keep = s is not None and self.kv_mode == "ctb"
        where: dict = {}
        context, delta = plan.context, plan.delta

        def submit(eng: Engine) -> int:
            handle = eng.submit(Request(context, sampling, keep_kv=keep))
            self._watch(where, eng, handle)
            return handle

        def resume(eng: Engine, handle: int) -> int:
            eng.unpin(handle)
            eng.resume(handle, delta, sampling=sampling)
            self._watch(where, eng, handle)
            return handle
        t0 = time.perf_counter()
        turn = asyncio.ensure_future(self.service.turn(
            key, tokens=context, submit=submit, resume=resume if keep and delta is not None else None,
            cls=plan.cls, turn=s.requests if s is not None else 0))
        try:
            out = await self._follow(turn, where, plan, index, on_progress)
        except (RequestError, ValueError) as e:
            if s is not None and self.sessions.get(s.id) is not s:  # ended (its agent's episode) meanwhile
                raise self._ended(s) from None
            raise P.APIError(400, str(e)) from None
        except EngineFailed as e:
            raise P.APIError(503, str(e), type="service_unavailable", code="engine_failed") from None
        finally:
            if not turn.done():
                turn.cancel()
            if s is None:
                self.service.end_session(key, plan.cls, len(context))
            elif not turn.done() or turn.cancelled() or turn.exception() is not None:
                self.service.release(key)  # a turn that did not end cleanly keeps no KV
        return self._to_choice(plan, index, out, time.perf_counter() - t0)

    async def _follow(self, turn: asyncio.Future, where: dict, plan: Plan, index: int, on_progress) -> SequenceOutput:
        """Awaits the turn; while it runs, reads its output after each engine step (`_after_step`) when someone
        streams it or a stop string may end it early (`Engine.end_turn`)."""
        if on_progress is None and not plan.stops:
            return (await turn)[1]
        seen = [0]

        def read(out: SequenceOutput, eng: Engine, h: int) -> None:
            if len(out.tokens) == seen[0]:
                return
            seen[0] = len(out.tokens)
            if on_progress is not None:
                on_progress(index, out)
            if plan.stops and find_stop(self.visible(out.new_tokens), plan.stops) is not None:
                eng.end_turn(h)  # between engine steps: reported by the next one
        where["read"] = read
        try:
            out = (await turn)[1]
        finally:
            if "rid" in where:
                self._watched.pop((where["rid"], where["h"]), None)
        if on_progress is not None:
            on_progress(index, out)
        return out

    def _watch(self, where: dict, eng: Engine, handle: int) -> None:
        """Called as a turn starts on `eng` (between steps): its reader, if any, sees every step from now."""
        rid = next((r.id for r in self.service.replicas if r.engine is eng), None)
        if "rid" in where:  # it moved (a failed replica's turn re-routed)
            self._watched.pop((where.pop("rid"), where["h"]), None)
        where["eng"], where["h"] = eng, handle
        if rid is not None and "read" in where:
            where["rid"] = rid
            read = where["read"]
            self._watched[(rid, handle)] = lambda out: read(out, eng, handle)

    def _after_step(self, rep) -> None:
        for (rid, h), read in list(self._watched.items()):
            out = _peek(rep.engine, h) if rid == rep.id else None
            if out is None:
                continue
            try:
                read(out)
            except Exception:  # noqa: BLE001 - that request goes on unwatched (its text is cut at the turn's end)
                log.exception("reading engine sequence %d of replica %d failed; its request is no longer followed "
                              "step by step", h, rid)
                self._watched.pop((rid, h), None)

    def parse_reply(self, text: str) -> chat.ParsedTurn:
        """The model's reply as content and tool calls, in its family's format."""
        return self.template.parse_tool_calls(text) if self.template is not None else chat.parse_tool_calls(text)

    def visible(self, tokens: Sequence[int]) -> str:
        """The text of generated tokens, without the stop token that ended them."""
        if tokens and tokens[-1] in self.tok.stop_ids:
            tokens = tokens[:-1]
        return self.tok.decode([t for t in tokens if t < self.tok.vocab_size])

    def _to_choice(self, plan: Plan, index: int, out: SequenceOutput, seconds: float) -> Choice:
        new = out.new_tokens
        n = len(new)
        text = self.visible(new)
        reason = "stop" if out.finish_reason == "stop" else "length"
        cut = find_stop(text, plan.stops)
        if cut is not None:
            text, reason = text[:cut], "stop"
        choice = Choice(index, new, text, reason, out.logp_model[-n:] if n else [], out.logp_sample[-n:] if n else [],
                        out.versions[-n:] if n else [], ttft_s=out.ttft_s, seconds=seconds)
        if plan.messages is not None:
            said = chat.Message("assistant", text)
            if plan.parse_tools:
                parsed = self.parse_reply(text)
                if not parsed.errors and parsed.tool_calls:
                    said = chat.Message("assistant", parsed.content, parsed.tool_calls)
                    choice.finish_reason = "tool_calls"
            choice.message = said
        if self.metrics is not None:
            self.metrics.choice(len(plan.context), n, out.ttft_s, seconds)
        return choice

    def _record(self, s: Session, plan: Plan, choice: Choice) -> None:
        """The session's trajectory and messages after its turn: exactly the tokens served."""
        now = self.clock()
        traj = s.traj
        added = plan.delta if plan.delta is not None and traj.tokens else plan.context
        waited = now - s.last_used if traj.turns else 0.0
        traj.extend(added, generated=False)
        start = len(traj.tokens)
        traj.extend(choice.tokens, generated=True, logprobs=choice.logp_sample, model_logprobs=choice.logp_model,
                    versions=choice.versions)
        traj.turns.append(Turn(start, len(traj.tokens), choice.seconds, waited,
                               tool_calls=len(choice.message.tool_calls) if choice.message else 0))
        s.stopped = bool(choice.tokens) and choice.tokens[-1] in self.tok.stop_ids
        if plan.messages is not None:
            s.messages = list(plan.messages) + [choice.message]
            s.keys = list(plan.keys) + [P.message_key(choice.message)]
            s.tools = json.dumps(plan.tools, sort_keys=True)
        s.last_used = now

    # ------------------------------------------------------------------ log-probs

    async def top_logprobs(self, plan: Plan, choice: Choice) -> None:
        """`choice.top`: the `plan.top_logprobs` most likely tokens at each generated position, from one full
        forward of the context on the first live engine's weights."""
        k = plan.top_logprobs
        if not k or not choice.tokens:
            return
        if self._scorer is None:
            from tiderl_jax.serving.openai_api.scoring import TopLogprobs
            self._scorer = TopLogprobs()
        engine = self.service.live()[0].engine
        tokens = list(plan.context) + choice.tokens
        ids, lps = await asyncio.to_thread(self._scorer, engine, tokens[:-1], len(plan.context) - 1, k)
        choice.top = [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, lps)]

    def token_text(self, token: int) -> str:
        return self.tok.decode([token]) if token < self.tok.vocab_size else ""

    # ------------------------------------------------------------------ tokenize

    def tokenize(self, req: P.TokenizeRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise P.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            return ([self.tok.bos_id] if self.tok.add_bos else []) + self.tok.encode(req.prompt)
        msgs = P.to_messages(req.messages)
        tools = P.tool_schemas(req.tools)
        if not req.add_generation_prompt:
            return (self.template.encode(msgs, tools=tools).ids if self.template is not None
                    else chat.encode(self.tok, self._with_tools(msgs, tools)).ids)
        return self._encode(msgs, tools)

    def detokenize(self, tokens: list[int]) -> str:
        bad = [t for t in tokens if not 0 <= t < self.tok.vocab_size]
        if bad:
            raise P.APIError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {self.tok.vocab_size})",
                             param="tokens", code="invalid_value")
        return self.tok.decode(tokens)

    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{secrets.token_hex(4)}"


def _peek(engine: Engine, handle: int) -> SequenceOutput | None:
    try:
        return engine.get(handle)
    except RequestError:  # already forgotten: the turn ended
        return None


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def holdback(text: str, stops: Sequence[str]) -> int:
    """How much of `text` is safe to stream: not a possible start of a stop string, not a cut UTF-8 character."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end = min(end, len(text[:end]) - k)
                break
    return max(0, end)


