"""The OpenAI server's logic over engine workers, without processes or a model: a fake `EngineClient` under the
real `WorkerEngine`, `RolloutService`, `Frontend` and FastAPI app (called as ASGI, no socket). Generations are
held in flight or released by the test, so admission, concurrency, cancellation and listener errors are checked
by what happened, not by timing."""

import asyncio
import json
import threading
import types

import pytest

pytest.importorskip("fastapi")

from tiderl_jax.engine.engine import EngineConfig, Request  # noqa: E402
from tiderl_jax.engine.sampling import SamplingParams  # noqa: E402
from tiderl_jax.faults.engine_worker import GenerationResult  # noqa: E402
from tiderl_jax.faults.worker_engine import WorkerEngine  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.policies import routing  # noqa: E402
from tiderl_jax.serving.openai_api import protocol as P  # noqa: E402
from tiderl_jax.serving.openai_api.app import build_app  # noqa: E402
from tiderl_jax.serving.openai_api.frontend import Frontend, ServerLimits  # noqa: E402
from tiderl_jax.serving.service import RolloutService, ServiceConfig  # noqa: E402

TOK = Tokenizer.builtin()
REPLY = TOK.encode("hello STOP world")


class FakeClient:
    """An `EngineClient` without worker processes: every generation's tokens are `reply` (up to max_new_tokens);
    it is done once `finished()` says so."""

    def __init__(self, reply=REPLY, finished=lambda client: True):
        self.params = types.SimpleNamespace(version=0)
        self.failovers = []
        self.reply, self.finished = reply, finished
        self.prompts: dict[int, list[int]] = {}
        self.returned: set[int] = set()
        self.polls = 0
        self.peak = 0  # most generations in flight at once
        self.submitted = asyncio.Event()

    def submit(self, prompt, sampling) -> int:
        rid = len(self.prompts)
        self.prompts[rid] = (list(prompt), sampling)
        self.peak = max(self.peak, len(self.prompts) - len(self.returned))
        self.submitted.set()
        return rid

    def done(self, rid) -> bool:
        self.polls += 1
        return self.finished(self)

    def wait(self, rid) -> GenerationResult:
        self.returned.add(rid)
        tokens = self.reply[:self.prompts[rid][1].max_new_tokens]
        n = len(tokens)
        return GenerationResult(rid, tokens, [-0.5] * n, [-0.25] * n, [0] * n, "length", 0)


def serve(client: FakeClient, limits: ServerLimits = ServerLimits()) -> tuple[RolloutService, Frontend]:
    engine = WorkerEngine(client, types.SimpleNamespace(vocab_size=TOK.vocab_size),
                          EngineConfig(num_pages=64, max_seq_len=256), poll_s=0.001)
    service = RolloutService([engine])
    return service, Frontend(service, TOK, model_name="fake", limits=limits, kv_mode="request")


async def running(service: RolloutService, body):
    await service.start()
    try:
        return await body()
    finally:
        await service.stop()


async def asgi(app, path: str, body: dict, *, block_on: str | None = None, disconnect=None,
               headers: dict | None = None) -> list[dict]:
    """One POST through the ASGI app as uvicorn makes it (ASGI spec 2.3): the messages the app sent. The client
    disconnects at once when `disconnect` is None, else once `disconnect()` returns; `block_on`: the client stops
    reading at the first message of this type (that send never returns)."""
    data, sent, first = json.dumps({"model": "fake", **body}).encode(), [], [True]

    async def receive():
        if first:
            first.pop()
            return {"type": "http.request", "body": data, "more_body": False}
        if disconnect is not None:
            await disconnect()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == block_on:
            await asyncio.Event().wait()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")]
             + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def response(sent: list[dict]) -> tuple[int, dict]:
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def never(client):
    return False


def completion(**kw) -> P.CompletionRequest:
    return P.CompletionRequest(model="fake", **kw)


def chat(**kw) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(model="fake", **kw)


# ------------------------------------------------------------------ engine workers behind the front


def test_a_step_listener_that_raises_does_not_fail_the_replica():
    service, _ = serve(FakeClient())
    service.step_listeners.append(lambda rep: 1 / 0)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)

    async def body():
        rep, out = await service.turn("s", tokens=[1, 2, 3],
                                      submit=lambda eng: eng.submit(Request([1, 2, 3], sampling)))
        return rep, out
    rep, out = asyncio.run(running(service, body))
    assert out.new_tokens == REPLY[:5] and rep.alive
    assert service.counters["replica_failures"] == 0 and service.live() == [rep]


def test_a_stop_string_through_engine_workers_cuts_the_text_and_the_replica_lives():
    """The front's stop-string check calls `end_turn` on the engine after each step: a worker engine answers
    it (its generation is seen only when finished) and the text is cut at the stop string."""
    service, f = serve(FakeClient())
    plan, = f.plan_completion(completion(prompt="hi", stop=["STOP"], max_tokens=32), None)

    async def body():
        return await f.run(plan)
    choice, = asyncio.run(running(service, body))
    assert (choice.text, choice.finish_reason) == ("hello ", "stop") and choice.tokens == REPLY
    assert service.counters["replica_failures"] == 0 and service.replicas[0].alive


def test_top_logprobs_through_engine_workers_are_refused_by_name():
    _, f = serve(FakeClient())
    requests = [(completion(prompt="hi", logprobs=2, max_tokens=4), f.plan_completion, "logprobs"),
                (chat(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
                                         max_tokens=4), f.plan_chat, "top_logprobs")]
    for req, plan, param in requests:
        with pytest.raises(P.APIError) as e:
            plan(req, None)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "unsupported_parameter")
        assert "engine workers" in e.value.message
    f.plan_completion(completion(prompt="hi", logprobs=0, max_tokens=4), None)  # no top: served


class SteppingEngine(WorkerEngine):
    """A `WorkerEngine` whose step waits in its worker thread until `gate` opens, recording every read of its state
    made while a step runs (`raced`)."""

    def __init__(self, client: FakeClient):
        super().__init__(client, types.SimpleNamespace(vocab_size=TOK.vocab_size),
                         EngineConfig(num_pages=64, max_seq_len=256), poll_s=0.001)
        self.gate, self.in_step, self.raced = threading.Event(), threading.Event(), []
        for name in ("stats", "load", "free_kv_tokens", "num_kv_tokens", "cached_prefix_tokens"):
            setattr(self, name, self._checked(name, getattr(self, name)))

    def _checked(self, name, read):
        def checked(*args):
            if self.in_step.is_set():
                self.raced.append(name)
            return read(*args)
        return checked

    def step(self):
        self.in_step.set()
        try:
            assert self.gate.wait(30)
            return super().step()
        finally:
            self.in_step.clear()


@pytest.mark.parametrize("policy", ["least_loaded", "cache_aware"])
def test_the_router_and_the_stats_never_read_an_engine_while_it_steps(policy):
    """A turn arrives and the stats are read while one replica's step runs in its worker thread: what is read of
    that replica is what it recorded right before the step, and a policy that needs no prefix lookups places the
    turn at once (a prefix-reading one waits for the step: its lookups are made between steps)."""
    engines = [SteppingEngine(FakeClient()) for _ in range(2)]
    service = RolloutService(engines, ServiceConfig(policy=policy))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)

    def turn(session):
        return asyncio.ensure_future(service.turn(session, tokens=[1, 2, 3],
                                                  submit=lambda eng: eng.submit(Request([1, 2, 3], sampling))))

    async def body():
        first = turn("a")
        while not any(e.in_step.is_set() for e in engines):
            await asyncio.sleep(0.001)
        busy = next(i for i, e in enumerate(engines) if e.in_step.is_set())
        second = turn("b")
        await asyncio.sleep(0.05)  # the service's ticks route meanwhile
        stats = service.stats()
        placed_beside = bool(engines[1 - busy].client.prompts)
        for e in engines:
            e.gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        return busy, stats, placed_beside
    busy, stats, placed_beside = asyncio.run(running(service, body))
    assert [e.raced for e in engines] == [[], []]
    assert stats[busy]["running"] == 1  # as recorded right before its step
    assert placed_beside == (policy == "least_loaded")


def test_a_policy_that_reads_the_prefix_cache_gets_the_lookups_whatever_its_name(monkeypatch):
    views = []

    def spy(requests, replicas, state, config, **kw):
        views.append([dict(w.cached_tokens) for w in replicas])
        return routing.least_loaded(requests, replicas, state, config, **kw)
    monkeypatch.setitem(routing.POLICIES, "spy", routing.RouterPolicy(spy, reads_prefix_cache=True))
    engine = WorkerEngine(FakeClient(), types.SimpleNamespace(vocab_size=TOK.vocab_size),
                          EngineConfig(num_pages=64, max_seq_len=256), poll_s=0.001)
    engine.cached_prefix_tokens = lambda tokens: len(tokens) - 1
    service = RolloutService([engine], ServiceConfig(policy="spy"))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)

    async def body():
        await service.turn("s", tokens=[1, 2, 3], submit=lambda eng: eng.submit(Request([1, 2, 3], sampling)))
    asyncio.run(running(service, body))
    assert views[0] == [{"s": 2}]


def test_a_request_names_its_workload_class_by_header_or_field_checked_and_kept_by_its_session():
    service, f = serve(FakeClient())
    app = build_app(f)
    turns, ended = [], []
    turn, end = service.turn, service.end_session

    async def recording(session, **kw):
        turns.append((session, kw["cls"]))
        return await turn(session, **kw)
    service.turn = recording
    service.end_session = lambda session, cls, kv: (ended.append((session, cls)), end(session, cls, kv))

    async def body():
        def call(headers=None, **fields):
            return asgi(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields}, headers=headers)
        out = [response(await call())[0],  # stateless: rlvr
               response(await call(session_id="s"))[0],  # a session: agentic
               response(await call({"X-Workload-Class": "rlhf"}))[0],
               response(await call(session_id="t", workload_class="rlhf"))[0],
               response(await call({"X-Workload-Class": "rlhf"}, session_id="t", workload_class="rlvr"))[0]]
        refused = [response(await call({"X-Workload-Class": "chat"})),
                   response(await call({"X-Workload-Class": "rlvr"}, session_id="t"))]
        f.end_session("s")
        f.end_session("t")
        return out, refused
    out, refused = asyncio.run(running(service, body))
    assert out == [200] * 5
    assert [cls for _, cls in turns] == ["rlvr", "agentic", "rlhf", "rlhf", "rlhf"]  # the header before the field
    (status, err), (status2, err2) = refused
    assert status == 400 and err["error"]["param"] == "workload_class" and "'chat'" in err["error"]["message"]
    assert status2 == 400 and err2["error"]["code"] == "session_class"
    assert [(s, cls) for s, cls in ended if s in ("s", "t")] == [("s", "agentic"), ("t", "rlhf")]
    assert sorted(cls for s, cls in ended if s not in ("s", "t")) == ["rlhf", "rlvr"]  # the stateless calls


# ------------------------------------------------------------------ sessions ended mid-call


def test_a_session_ended_while_its_turn_waits_answers_409_and_leaves_a_clean_session():
    """An agent's episode ends (timeout) while its call's turn is still queued in the router: the call gets
    409, not an escaped CancelledError, and the session is gone with its lock free."""
    service, f = serve(FakeClient())  # not started: the turn stays queued in the router

    async def main():
        plan, = f.plan_completion(completion(prompt="hi", max_tokens=4), "agent-1")
        s = plan.session
        call = asyncio.ensure_future(f.run(plan))
        for _ in range(100):
            if service._pending:
                break
            await asyncio.sleep(0)
        assert service._pending and s.lock.locked()  # the call's turn is queued
        f.end_session("agent-1")
        with pytest.raises(P.APIError) as e:
            await call
        assert (e.value.status, e.value.code) == (409, "session_ended")
        assert "agent-1" not in f.sessions and not s.lock.locked() and not service._pending
        again, = f.plan_completion(completion(prompt="hi", max_tokens=4), "agent-1")
        assert again.session is not s and again.session.traj.tokens == [] and again.delta is None
    asyncio.run(main())


def test_a_new_session_does_not_evict_one_serving_a_call():
    service, f = serve(FakeClient(), ServerLimits(max_sessions=1))

    async def main():
        plan, = f.plan_completion(completion(prompt="hi", max_tokens=4), "a")
        call = asyncio.ensure_future(f.run(plan))
        for _ in range(100):
            if service._pending:
                break
            await asyncio.sleep(0)
        assert plan.session.lock.locked()
        with pytest.raises(P.APIError) as e:  # "a" is the least recently used, but busy
            f.plan_completion(completion(prompt="hi", max_tokens=4), "b")
        assert (e.value.status, e.value.code) == (429, "admission_held") and f.sessions["a"] is plan.session
        f.end_session("a")
        with pytest.raises(P.APIError):
            await call
        f.plan_completion(completion(prompt="hi", max_tokens=4), "b")  # "a" gone: room for "b"
        assert list(f.sessions) == ["b"]
    asyncio.run(main())


# ------------------------------------------------------------------ admission over HTTP


def test_a_streamed_request_whose_body_never_starts_gives_its_slot_back():
    """The client is gone before the response starts: the SSE generator is never iterated."""
    client = FakeClient(finished=never)
    service, f = serve(client)
    app = build_app(f)

    async def body():
        sent = await asyncio.wait_for(asgi(app, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True},
                                           block_on="http.response.start"), 30)
        return sent, f.inflight  # as the response ends (not once a garbage collection finalizes something)
    sent, inflight = asyncio.run(running(service, body))
    assert [m["type"] for m in sent] == ["http.response.start"] and client.prompts == {}  # the body never ran
    assert inflight == 0


@pytest.mark.parametrize("cut", ["before the first chunk", "at a chunk"])
def test_a_streamed_request_cut_off_while_it_runs_gives_its_slot_back_and_drops_its_turn(cut):
    """The client disconnects while the generation runs: while the body waits for its first chunk, or while a
    chunk is being sent to a client that stopped reading (the body left at its `yield`)."""
    client = FakeClient(finished=never)
    service, f = serve(client)
    app = build_app(f)
    path, req, block_on = (("/v1/completions", {"prompt": "hi"}, None) if cut == "before the first chunk" else
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                            "http.response.body"))  # the chat stream's first chunk: the assistant's role

    async def body():
        sent = await asyncio.wait_for(asgi(app, path, dict(req, max_tokens=4, stream=True), block_on=block_on,
                                           disconnect=client.submitted.wait), 30)
        inflight = f.inflight  # as the response ends
        for _ in range(1000):  # the cancelled turn's release reaches the engine between its steps
            if not service.engines[0].has_work():
                break
            await asyncio.sleep(0.001)
        return sent, inflight
    sent, inflight = asyncio.run(running(service, body))
    assert len(client.prompts) == 1 and len([m for m in sent if m.get("body")]) == (block_on is not None)
    assert inflight == 0 and f.inflight == 0 and not service.engines[0].has_work()


def test_the_prompts_of_one_request_run_concurrently_and_count_against_max_inflight():
    # the generations finish only once all three are in flight (or after 300 polls: a sequential server fails
    # below instead of hanging)
    client = FakeClient(finished=lambda c: len(c.prompts) >= 3 or c.polls > 300)
    service, f = serve(client, ServerLimits(max_inflight=4))
    app = build_app(f)
    prompts = ["a", "b", "c"]

    async def body():
        ok = response(await asgi(app, "/v1/completions", {"prompt": prompts, "max_tokens": 3}))
        peak, inflight = client.peak, f.inflight
        too_big = response(await asgi(app, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 3}))
        f.inflight = 2  # two completions of other requests in flight: three more pass the limit
        held = response(await asgi(app, "/v1/completions", {"prompt": prompts, "max_tokens": 3}))
        f.inflight = 0
        return ok, peak, inflight, too_big, held
    ok, peak, inflight, too_big, held = asyncio.run(running(service, body))
    status, out = ok
    assert status == 200 and [c["text"] for c in out["choices"]] == [TOK.decode(REPLY[:3])] * 3
    assert peak == 3 and inflight == 0  # all three at once
    status, err = too_big
    assert status == 400 and err["error"]["code"] == "too_many_completions"
    assert "6 completions" in err["error"]["message"] and "max_inflight" in err["error"]["message"]
    status, err = held
    assert status == 429 and err["error"]["code"] == "admission_held" and len(client.prompts) == 3
