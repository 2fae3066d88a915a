"""The OpenAI-compatible server with the official `openai` client, on loopback, over the shipped tiny policy.

One server for the module (a thread running the rollout service and uvicorn on one event loop). Greedy calls
make the answers checkable: the tiny policy calls the calculator tool, reads the result and answers it."""

import asyncio
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tiderl_jax.agents.tasks import SYSTEM_PROMPT, make_task  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.hf_io import load_hf_checkpoint  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.serving.openai_api.app import HTTPServer  # noqa: E402
from tiderl_jax.serving.openai_api.frontend import Frontend, ServerLimits  # noqa: E402
from tiderl_jax.serving.service import RolloutService  # noqa: E402
from conftest import ROOT  # noqa: E402

KEY = "test-key"
MODEL = "tiny"
CHECKPOINT = ROOT / "checkpoints" / "tiny_agentic_sft"
ENGINE = EngineConfig(page_size=16, num_pages=512, max_seq_len=1024, max_running=16, prefill_chunk=256,
                      decode_steps=4, bucket_growth=4)
LIMITS = ServerLimits(max_body_bytes=64 * 1024, max_tokens=256, max_inflight=64)
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "integer arithmetic: + - * ( )",
                                            "parameters": {"type": "object",
                                                           "properties": {"expr": {"type": "string"}}}}}]


class Server:
    """The service and the HTTP server on an event loop in a thread."""

    def __init__(self, frontend_kw=None):
        self.tok = Tokenizer.from_checkpoint(CHECKPOINT)
        self.engine = Engine(load_hf_checkpoint(CHECKPOINT), ENGINE)
        self.loop = asyncio.new_event_loop()
        self._stop = None
        self._ready = threading.Event()
        self._kw = frontend_kw or {}
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the server did not start in 60s")

    async def _main(self):
        self.service = RolloutService([self.engine])
        await self.service.start(on_turn_end=lambda rep, h: rep.engine.pin(h))
        self.frontend = Frontend(self.service, self.tok, model_name=MODEL, limits=LIMITS, api_key=KEY, **self._kw)
        self.http = HTTPServer(self.frontend, "127.0.0.1", 0)
        await self.http.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.http.stop()
        await self.service.stop()

    def call(self, fn):
        """Runs fn() on the server's loop (between its requests)."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def close(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http.base_url, api_key=KEY, max_retries=0, timeout=120)


def raw(server, path, body=None, *, key=KEY, method=None, data=None, headers=()):
    """(status, JSON) of one request, errors included."""
    url = server.http.base_url.removesuffix("/v1") + path
    if data is None and body is not None:
        data = json.dumps(body).encode()
    h = {"Content-Type": "application/json", **dict(headers)}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=h, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def calculator_messages(i=0):
    task = make_task("calculator", i, "heldout")
    return task, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]


def assert_serving(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


# ------------------------------------------------------------------------------------------------ the client


def test_models_tokenize_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = raw(server, "/tokenize", {"model": MODEL, "prompt": "2+3 <|im_end|>"})
    assert status == 200 and body["count"] == len(body["tokens"]) and server.tok.eos_id in body["tokens"]
    assert raw(server, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "2+3 <|im_end|>"})
    _, messages = calculator_messages()
    status, chat = raw(server, "/tokenize", {"messages": messages})
    assert chat["tokens"][-3:] == server.tok.encode("assistant\n")[-3:]
    assert raw(server, "/health", key=None)[1]["status"] == "ok"
    with urllib.request.urlopen(server.http.base_url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'tiderl_http_requests_total{endpoint="/tokenize",status="200"}' in text
    assert 'tiderl_replica_kv_free_tokens{replica="0"}' in text


def test_chat_with_tools_calls_reads_the_result_and_answers_in_one_session(server, client):
    # a task the shipped policy solves greedy (held-out calculator 3: it copies the expression and the result)
    task, messages = calculator_messages(3)
    resumed = server.service.counters["resumed"]
    headers = {"X-Session-ID": "calc-0"}
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=128,
                                           extra_headers=headers, extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "calc" and json.loads(call.function.arguments)["expr"] == task.data["expr"]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": task.answer}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=64, extra_headers=headers, extra_body={"return_token_ids": True})
    assert second.choices[0].message.content.strip() == task.answer
    assert server.service.counters["resumed"] == resumed + 1  # the tool result resumed the pinned KV
    # token-in / token-out: the second prompt is the first prompt, the sampled tokens, then the tool message
    p1, p2 = first.model_extra["prompt_token_ids"], second.model_extra["prompt_token_ids"]
    sampled = choice.model_extra["token_ids"]
    assert p2[:len(p1) + len(sampled)] == p1 + sampled
    session = server.call(lambda: server.frontend.sessions["calc-0"])
    traj = session.traj
    assert traj.tokens == p2 + second.choices[0].model_extra["token_ids"]
    model_tokens = [t for t, m in zip(traj.tokens, traj.loss_mask) if m]
    assert model_tokens == sampled + second.choices[0].model_extra["token_ids"]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m] == \
        choice.model_extra["behaviour_logprobs"] + second.choices[0].model_extra["behaviour_logprobs"]
    server.call(lambda: server.frontend.end_session("calc-0"))


def test_streaming_gives_the_same_text_and_a_final_usage_chunk(server, client):
    _, messages = calculator_messages(8)  # the shipped policy's greedy reply: a tool call, cut at 40 tokens
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    plain = list(client.completions.create(model=MODEL, prompt="12 + 30 =", max_tokens=12, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in plain) == \
        client.completions.create(model=MODEL, prompt="12 + 30 =", max_tokens=12, temperature=0).choices[0].text


def test_logprobs_and_top_logprobs(server, client):
    _, messages = calculator_messages(2)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    ids = r.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) == 8
    for entry, token in zip(content, ids):
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        top = entry.top_logprobs[0]  # greedy: the sampled token is the most likely one
        assert top.token == entry.token == server.tok.decode([token])
        assert abs(top.logprob - entry.logprob) < 1e-3
    c = client.completions.create(model=MODEL, prompt="12 + 30 =", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and "".join(lp.tokens) == c.choices[0].text


def test_n_choices_are_differently_seeded_samples(server, client):
    messages = [{"role": "user", "content": "Say something."}]  # an open prompt: the samples differ
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.5, max_tokens=12, n=3, seed=7,
                                       extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.5, max_tokens=12, n=3, seed=7,
                                           extra_body={"return_token_ids": True})
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # seeded: reproducible
    assert len({tuple(i) for i in ids}) > 1  # and each choice its own seed


def test_stop_sequences_cut_the_text_and_end_the_turn(server, client):
    _, messages = calculator_messages(4)
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60)
    text = free.choices[0].message.content
    for stop in ('"name"', "{"):  # several tokens (the engine ends the turn when it appears), one token
        assert stop in text
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60, stop=[stop])
        assert r.choices[0].message.content == text[:text.index(stop)]
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < free.usage.completion_tokens
    streamed = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60,
                                              stop='"name"', stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.index('"name"')]


# ------------------------------------------------------------------------------------------------ bad requests


def test_bad_requests_get_their_status_and_the_server_goes_on(server, client):
    _, messages = calculator_messages()
    good = {"model": MODEL, "messages": messages, "max_tokens": 2}
    cases = [  # (status, code, request)
        (400, "invalid_json", dict(data=b'{"model": "tiny", "messages": [')),
        (400, "invalid_value", dict(body=dict(good, temperature="hot"))),
        (400, "invalid_value", dict(body=dict(good, messages="hello"))),
        (400, "invalid_value", dict(body=dict(good, max_tokens=10_000))),
        (400, "context_length_exceeded",
         dict(body=dict(good, messages=[{"role": "user", "content": "x" * 1100}]))),
        (401, "invalid_api_key", dict(body=good, key=None)),
        (401, "invalid_api_key", dict(body=good, key="wrong")),
        (404, "model_not_found", dict(body=dict(good, model="gpt-9"))),
        (413, "body_too_large", dict(body=dict(good, messages=[{"role": "user", "content": "x" * 70_000}]))),
    ]
    for status, code, kw in cases:
        got, body = raw(server, "/v1/chat/completions", **kw)
        assert (got, body["error"]["code"]) == (status, code), body
        assert set(body["error"]) == {"message", "type", "param", "code"} and "Traceback" not in body["error"]["message"]
        assert_serving(client)
    assert raw(server, "/v1/chat/completions", dict(good, temperature="hot"))[1]["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=messages, max_tokens=2)
    # admission holds it: 429; an engine being swapped: 503
    limits = server.frontend.limits
    server.call(lambda: setattr(server.frontend, "limits", dataclasses.replace(limits, max_inflight=1)))
    server.call(lambda: setattr(server.frontend, "inflight", server.frontend.inflight + 1))  # one in flight
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "admission_held"
    finally:
        server.call(lambda: setattr(server.frontend, "inflight", server.frontend.inflight - 1))
        server.call(lambda: setattr(server.frontend, "limits", limits))
    assert_serving(client)
    swap = server.frontend.swapping()
    server.call(swap.__enter__)
    try:
        status, body = raw(server, "/v1/chat/completions", good)
        assert (status, body["error"]["code"]) == (503, "engine_swapping")
    finally:
        server.call(lambda: swap.__exit__(None, None, None))
    assert_serving(client)


def test_an_unexpected_error_is_a_500_with_one_line_and_the_server_goes_on(server, client, monkeypatch):
    def broken(req):
        raise RuntimeError("injected")
    monkeypatch.setattr(server.frontend, "tokenize", broken)
    status, body = raw(server, "/tokenize", {"prompt": "x"})
    assert status == 500 and body["error"]["message"] == "internal error: RuntimeError: injected"
    monkeypatch.undo()
    assert raw(server, "/tokenize", {"prompt": "x"})[0] == 200
    assert_serving(client)


def test_a_per_session_key_binds_its_requests_to_its_session(server, client):
    key = server.call(lambda: server.frontend.issue_key("agent-7"))
    agent = openai.OpenAI(base_url=server.http.base_url, api_key=key, max_retries=0, timeout=60)
    _, messages = calculator_messages(5)
    r = agent.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                      extra_headers={"X-Session-ID": "someone-else"})
    session = server.call(lambda: server.frontend.sessions.get("agent-7"))
    assert session is not None and sum(session.traj.loss_mask) == r.usage.completion_tokens
    assert server.call(lambda: server.frontend.sessions.get("someone-else")) is None
    server.call(lambda: server.frontend.revoke_key(key))
    with pytest.raises(openai.AuthenticationError):
        agent.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    server.call(lambda: server.frontend.end_session("agent-7"))


def test_a_non_loopback_bind_without_a_key_is_refused():
    import subprocess
    import sys
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "serve.py"), f"--checkpoint={CHECKPOINT}",
                          "--host=0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --host=0.0.0.0 is not a loopback address: refusing to serve without --api_key"]
    assert time.perf_counter() - t0 < 60



@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_server_the_request_in_flight_finishes_and_it_exits_0(sig):
    """SIGTERM (what Kubernetes sends before a kill) as Ctrl-C: new connections refused, the streamed request
    in flight gets every token, then the server stops with status 0."""
    import os
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "serve.py"), f"--checkpoint={CHECKPOINT}",
                             "--port=0", "--max_seq_len=1024", "--num_pages=256", "--drain_s=120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(r"at (http://\S+/v1)", line):
            break
    assert m, "".join(lines)[-3000:]
    rest = []
    reader = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)
    reader.start()
    body = dict(model="tiny_agentic_sft", prompt="2+3=", max_tokens=200, ignore_eos=True, temperature=0, stream=True)
    request = urllib.request.Request(m.group(1) + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        chunks = [r.readline()]  # the first token: the request is in flight
        os.kill(proc.pid, getattr(signal, sig))
        t0 = time.monotonic()
        while not any("draining" in line for line in rest):
            assert time.monotonic() - t0 < 30, "".join(lines + rest)[-3000:]
            time.sleep(0.05)
        while True:  # nothing new gets in (the listener closes as the line is printed)
            try:
                urllib.request.urlopen(m.group(1) + "/models", timeout=10).close()
            except urllib.error.URLError as e:
                assert isinstance(e.reason, ConnectionRefusedError), e
                break
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        chunks += r.readlines()  # the rest of the request in flight
    events = [json.loads(c[len(b"data: "):]) for c in chunks if c.startswith(b"data: {")]
    assert b"data: [DONE]\n" in chunks, chunks[-3:]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"  # all 200 tokens
    assert proc.wait(timeout=120) == 0
    reader.join(10)
    out = "".join(lines + rest)
    assert f"{sig}: draining" in out and f"stopped by {sig}" in out and "Traceback" not in out, out[-3000:]
