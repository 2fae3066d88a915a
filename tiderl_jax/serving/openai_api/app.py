"""The HTTP face (FastAPI, served by uvicorn on the caller's event loop) of `frontend.Frontend`.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events
when `stream`; the final usage chunk with `stream_options.include_usage`), `POST /tokenize`, `POST /detokenize`,
`GET /health`, `GET /metrics`. Every error is the OpenAI error JSON with its status (`protocol.APIError`);
anything unexpected is logged with its traceback here and answered 500 with one line, never a traceback; the
server keeps serving. Bodies are read up to `ServerLimits.max_body_bytes` (413 beyond). A request's prompts and
choices run concurrently through the rollout service, each counted against `max_inflight` (`Frontend.admit`);
a streamed one gives its slots back when its response ends, however it ends (`_Stream`: a client gone before
the first chunk included).

`HTTPServer(frontend, host, port)`: `await start()` binds (port 0: a free one, `port` says which) and serves
in-process, so the engine's driver and the server share one event loop; `await stop()` ends it. Uvicorn's
signal handlers are not installed: the process that embeds the server (the trainer) keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tiderl_jax.serving.openai_api import protocol as P
from tiderl_jax.serving.openai_api.frontend import Choice, Frontend, Plan, find_stop, holdback
from tiderl_jax.serving.openai_api.metrics import ServerMetrics

log = logging.getLogger(__name__)


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _body(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise P.APIError(413, f"request body of {length} bytes is over the limit of {limit}", code="body_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise P.APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise P.APIError(400, "the JSON body must be an object", code="invalid_json")
    return body


def _session_id(request: Request, bound: str | None, req) -> str | None:
    if bound is not None:
        return bound
    return request.headers.get("x-session-id") or getattr(req, "session_id", None) or getattr(req, "user", None)


class _Renderer:
    """Response objects of one request: chat or text completions, whole or as stream chunks."""

    def __init__(self, f: Frontend, chat: bool, req, rid: str):
        self.f, self.chat, self.req, self.rid = f, chat, req, rid
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, c: Choice, lo: int, hi: int) -> dict | None:
        f = self.f
        if (not self.req.logprobs) if self.chat else self.req.logprobs is None:
            return None
        toks = c.tokens[lo:hi]
        top = c.top[lo:hi] if c.top is not None else None
        if self.chat:
            entry = lambda t: {"token": f.token_text(t), "bytes": list(f.token_text(t).encode())}  # noqa: E731
            return {"content": [dict(entry(t), logprob=lp, top_logprobs=[dict(entry(i), logprob=v) for i, v in top[j]]
                                     if top is not None else [])
                                for j, (t, lp) in enumerate(zip(toks, c.logp_model[lo:hi]))]}
        texts = [f.token_text(t) for t in toks]
        offsets, at = [], 0
        for t in texts:
            offsets.append(at)
            at += len(t)
        return {"tokens": texts, "token_logprobs": c.logp_model[lo:hi], "text_offset": offsets,
                "top_logprobs": [{f.token_text(i): v for i, v in row} for row in top] if top is not None else None}

    def _extension(self, c: Choice) -> dict:
        if not self.req.return_token_ids:
            return {}
        return {"token_ids": c.tokens, "behaviour_logprobs": c.logp_sample, "policy_versions": c.versions}

    def _message(self, c: Choice, content: str | None = None) -> dict:
        m = c.message
        if m is None or not m.tool_calls:
            return {"role": "assistant", "content": c.text if content is None else content}
        return {"role": "assistant", "content": m.content or None,
                "tool_calls": P.tool_calls_out(m.tool_calls, f"{self.rid}_{c.index}")}

    def whole(self, plans: list[Plan], choices: list[list[Choice]]) -> dict:
        out, index = [], 0
        for cs in choices:
            for c in cs:
                body = ({"message": self._message(c)} if self.chat else {"text": c.text})
                out.append(dict(index=index, **body, finish_reason=c.finish_reason,
                                logprobs=self._logprobs(c, 0, len(c.tokens)), **self._extension(c)))
                index += 1
        resp = {"id": self.rid, "object": self.object, "created": self.created, "model": self.f.model_name,
                "choices": out, "usage": self.usage(plans, choices)}
        if self.req.return_token_ids:
            resp["prompt_token_ids"] = plans[0].context if len(plans) == 1 else [p.context for p in plans]
        return resp

    @staticmethod
    def usage(plans, choices) -> dict:
        prompt = sum(len(p.context) for p in plans)
        done = sum(len(c.tokens) for cs in choices for c in cs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = {"id": self.rid, "object": f"{self.object}.chunk" if self.chat else self.object,
               "created": self.created, "model": self.f.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def delta(self, index: int, text: str = "", *, role: bool = False, c: Choice | None = None,
              lo: int = 0, hi: int = 0, finish: str | None = None, tools: bool = False) -> dict:
        if self.chat:
            d = {"role": "assistant"} if role else {}
            if tools and c is not None and c.message is not None and c.message.tool_calls:
                d["content"] = c.message.content or None
                d["tool_calls"] = [dict(call, index=k) for k, call in
                                   enumerate(P.tool_calls_out(c.message.tool_calls, f"{self.rid}_{index}"))]
            elif text or not role:
                d["content"] = text
            body = {"delta": d}
        else:
            body = {"text": text}
        lp = self._logprobs(c, lo, hi) if c is not None and hi > lo else None
        extra = self._extension(c) if finish is not None and c is not None else {}
        return dict(index=index, **body, logprobs=lp, finish_reason=finish, **extra)


async def _choices(f: Frontend, plan: Plan, on_progress=None) -> list[Choice]:
    cs = await f.run(plan, on_progress)
    for c in cs:
        await f.top_logprobs(plan, c)
    return cs


class _Stream(StreamingResponse):
    """A streamed completion holding admission slots: `release` gives them back when the response ends, however
    it ends. The body generator's own `finally` is not enough: a client gone before the response starts leaves
    the generator never started (its `finally` never runs), and one gone while a chunk is sent leaves it
    suspended at its `yield`, its choices running, until the garbage collector finalizes it."""

    def __init__(self, body, release):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
            await self.body_iterator.aclose()  # cut off at a chunk: its choices are cancelled now, not at GC


async def _stream(f: Frontend, r: _Renderer, plans: list[Plan], tools: bool):
    """The SSE body: deltas of every choice as the engine steps, each choice's finish, usage, [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()
    per = [plans[0].n] * len(plans)
    base = [sum(per[:k]) for k in range(len(plans))]
    sent = {}  # global index -> [tokens sent, text sent]

    def progress(k):
        return lambda i, out: queue.put_nowait(("progress", base[k] + i, k, out))
    jobs = [asyncio.ensure_future(_choices(f, p, progress(k))) for k, p in enumerate(plans)]
    for j in jobs:
        j.add_done_callback(lambda _: queue.put_nowait(("job",)))
    try:
        if r.chat:
            yield r.chunk([r.delta(base[k] + i, role=True) for k in range(len(plans)) for i in range(plans[k].n)])
        finished = 0
        while finished < len(jobs):
            item = await queue.get()
            if item[0] == "job":
                finished += 1
                continue
            _, index, k, out = item
            if tools or plans[k].top_logprobs:
                continue  # whole at the end: tool calls parsed, top log-probs scored
            toks, text = sent.setdefault(index, [0, ""])
            visible = f.visible(out.new_tokens)
            cut = find_stop(visible, plans[k].stops)
            safe = cut if cut is not None else holdback(visible, plans[k].stops)
            piece = visible[len(text):safe] if safe > len(text) else ""
            n = len(out.new_tokens)
            if piece or (r.req.logprobs and n > toks):
                c = Choice(index, out.new_tokens, "", "", out.logp_model[-n:] if n else [], [], [])
                yield r.chunk([r.delta(index, piece, c=c, lo=toks, hi=n)])
                sent[index] = [n, text + piece]
        choices = []
        for k, job in enumerate(jobs):
            cs = job.result()
            choices.append(cs)
            for c in cs:
                index = base[k] + c.index
                toks, text = sent.get(index, [0, ""])
                rest = c.text[len(text):] if c.text.startswith(text) else ""
                yield r.chunk([r.delta(index, rest, c=c, lo=toks, hi=len(c.tokens), finish=c.finish_reason,
                                       tools=tools)])
        include = r.req.stream_options is not None and r.req.stream_options.include_usage
        if include:
            yield r.chunk([], usage=r.usage(plans, choices))
    except P.APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    except Exception as e:  # noqa: BLE001 - the stream ends with an error event, never a traceback
        log.exception("streaming request %s failed", r.rid)
        yield f"data: {json.dumps(P.APIError(500, f'internal error: {type(e).__name__}: {e}', type='internal_error').body())}\n\n"
    finally:
        for j in jobs:
            if not j.done():
                j.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
    yield "data: [DONE]\n\n"


class _Counting:
    """Counts responses by route and status (a plain ASGI middleware: it adds nothing to a streamed body's path)."""

    def __init__(self, app, metrics: ServerMetrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.routes else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.request(path, message["status"])
            await send(message)
        await self.app(scope, receive, counted)


def build_app(f: Frontend, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics()
    metrics.frontend = f
    f.metrics = metrics
    app = FastAPI(title="TideRL-JAX OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)

    routes = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
              "/metrics")

    app.add_middleware(_Counting, metrics=metrics, routes=routes)

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        return _error(e)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("request %s failed", request.url.path)
        return _error(P.APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, e):
        return _error(P.APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, e):
        return _error(P.APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                 code="method_not_allowed"))

    def parse(model, body):
        try:
            return model.model_validate(body)
        except P.ValidationError as e:
            raise P.validation_error(e) from None

    @app.get("/health")
    async def health():
        live = len(f.service.live())
        return JSONResponse({"status": "ok" if live else "unavailable", "live_replicas": live,
                             "sessions": len(f.sessions), "in_flight": f.inflight}, status_code=200 if live else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        f.authorize(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": f.model_name, "object": "model", "created": 0, "owned_by": "tiderl",
                                            "max_model_len": f.max_context}]}

    async def complete(request: Request, chat: bool):
        bound = f.authorize(request.headers.get("authorization"))
        req = parse(P.ChatCompletionRequest if chat else P.CompletionRequest,
                    await _body(request, f.limits.max_body_bytes))
        f.check_model(req.model)
        sid = _session_id(request, bound, req)
        cls = request.headers.get("x-workload-class")
        plans = [f.plan_chat(req, sid, cls)] if chat else f.plan_completion(req, sid, cls)
        r = _Renderer(f, chat, req, f.request_id("chatcmpl" if chat else "cmpl"))
        release = f.admit(sum(p.n for p in plans))
        if req.stream:
            return _Stream(_stream(f, r, plans, chat and plans[0].parse_tools), release)
        jobs = [asyncio.ensure_future(_choices(f, plan)) for plan in plans]  # every prompt at once
        try:
            choices = list(await asyncio.gather(*jobs))
        finally:
            release()
            for j in jobs:  # one failed: the others end now
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        return JSONResponse(r.whole(plans, choices))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        f.authorize(request.headers.get("authorization"))
        req = parse(P.TokenizeRequest, await _body(request, f.limits.max_body_bytes))
        f.check_model(req.model)
        ids = f.tokenize(req)
        return {"tokens": ids, "count": len(ids), "max_model_len": f.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        f.authorize(request.headers.get("authorization"))
        req = parse(P.DetokenizeRequest, await _body(request, f.limits.max_body_bytes))
        f.check_model(req.model)
        return {"prompt": f.detokenize(req.tokens)}

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the embedding process keeps its own signal handlers
        yield

    def install_signal_handlers(self) -> None:  # (older uvicorn)
        pass


class HTTPServer:
    """Uvicorn serving `build_app(frontend)` on the running event loop. `stop` drains: the listener closes
    at once (new connections are refused), requests in flight get up to `drain_s` to finish."""

    def __init__(self, frontend: Frontend, host: str = "127.0.0.1", port: int = 8000, drain_s: float = 2.0):
        self.frontend, self.host, self.port, self.drain_s = frontend, host, port, drain_s
        self.metrics = ServerMetrics()
        self.app = build_app(frontend, self.metrics)
        self._task = self._sweeper = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=self.drain_s)
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                error = self._task.exception() if not self._task.cancelled() else None
                raise OSError(f"the HTTP server could not start on {self.host}:{self.port}"
                              + (f" ({type(error).__name__}: {error})" if error else ""))
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self):
        while True:
            await asyncio.sleep(min(30.0, self.frontend.limits.session_ttl_s / 4))
            self.frontend.expire()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._task is not None:
            for listener in self._server.servers:  # now, not at uvicorn's next tick: nothing new gets in
                listener.close()
            self._server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, self.drain_s + 10)
            self._task = None
