"""Environments, built-in tasks, trajectories and the multi-turn rollout loop (CTB vs request-level)."""

import asyncio
import dataclasses

import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import LatencyModel, StepResult, ToolEnvironment, ToolError
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.trajectory import load_trajectories, save_trajectories
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model import chat
from tiderl_jax.model.config import ModelConfig
from tiderl_jax.model.decoder import init_decoder
from tiderl_jax.model.tokenizer import Tokenizer

TOK = Tokenizer.builtin()
MODEL = init_decoder(ModelConfig(arch="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True), seed=3)


def _run_env(task, turns):
    env = T.make_env(task)

    async def go():
        await env.reset(task)
        results = []
        for text in turns:
            results.append(await env.step(text))
        return results
    return env, asyncio.run(go())


@pytest.mark.parametrize("kind", ["calculator", "lookup"])
def test_demonstrations_solve_their_tasks(kind):
    for i in range(5):
        task = T.make_task(kind, i)
        demo = T.demonstration(task)
        turns = [chat.render([m])[len(f"{chat.TURN_START}assistant\n"):] for m in demo if m.role == "assistant"]
        env, results = _run_env(task, turns)
        assert results[-1].done and results[-1].reward == 1.0
        assert all(not r.done for r in results[:-1])
        wrong = _run_env(task, turns[:-1] + ["I do not know"])[1][-1]
        assert wrong.done and wrong.reward == 0.0


def test_the_shortcut_demonstrator_skips_its_last_tool_call():
    """The imperfect demonstrator of the warm start (`sft.shortcut_rate`): lookup stops after its first search and
    answers the city it found, which scores 0 every time; calculator replies at once with the expression worked out
    left to right, which its environment sends back asking for the tool."""
    from tiderl_jax.rl import sft
    for i in range(20):
        task = T.make_task("lookup", i)
        demo, ideal = T.demonstration(task, shortcut=True), T.demonstration(task)
        assert demo[:4] == ideal[:4] and len(demo) == 5 and demo[-1].content == task.data["city"]
        turns = [chat.render([m])[len(f"{chat.TURN_START}assistant\n"):] for m in demo if m.role == "assistant"]
        result = _run_env(task, turns)[1][-1]
        assert result.done and result.reward == 0.0
        task = T.make_task("calculator", i)
        demo = T.demonstration(task, shortcut=True)
        assert len(demo) == 3 and not demo[-1].tool_calls and demo[-1].content == str(T._left_to_right(task.data["expr"]))
        result = _run_env(task, [demo[-1].content])[1][-1]
        assert not result.done and result.reward == 0.0 and "no tool call found" in result.observation
    assert T._left_to_right("3 + 4 * 5") == 35 and T._left_to_right("(3 + 4) * 5") == 35
    with pytest.raises(ValueError, match="'python' has no shortcut"):
        T.demonstration(T.make_task("python", 0), shortcut=True)
    stream = sft.train_tasks(("calculator", "lookup", "python"), 0, 900, 0)
    for rate in (0.3, 0.6):
        for kind in ("calculator", "lookup"):
            of_kind = [t for t in stream if t.kind == kind]
            assert abs(sum(sft.takes_shortcut(t, rate) for t in of_kind) / len(of_kind) - rate) < 0.07
    assert not any(sft.takes_shortcut(t, 1.0) for t in stream if t.kind == "python")
    assert not any(sft.takes_shortcut(t, 0.0) for t in stream)
    taken = {t.task_id for t in stream if sft.takes_shortcut(t, 0.3)}  # nested: a higher rate adds tasks
    assert taken <= {t.task_id for t in stream if sft.takes_shortcut(t, 0.6)}


def test_generators_are_seeded_and_splits_differ():
    assert T.make_task("calculator", 3) == T.make_task("calculator", 3)
    assert T.make_task("calculator", 3).prompt != T.make_task("calculator", 3, "heldout").prompt
    assert T.make_task("lookup", 1, seed=1).prompt != T.make_task("lookup", 1, seed=2).prompt
    assert T.make_task("lookup", 0, "heldout").is_eval
    with pytest.raises(ValueError, match="split 'test'"):
        T.make_task("calculator", 0, "test")


def test_calc_tool_is_safe():
    assert T.safe_eval("(2 + 3) * -4") == -20
    for bad in ["__import__('os')", "2 ** 100", "open('x')", "1e9", "[1]"]:
        with pytest.raises(ToolError):
            T.safe_eval(bad)


def test_a_calculator_expression_python_warns_about_is_refused_without_a_warning(recwarn):
    for bad in ["2and 3", "1if 2 else 3", "3x"]:  # Python's "invalid decimal literal" warning (or error)
        with pytest.raises(ToolError, match="cannot parse"):
            T.safe_eval(bad)
    assert not [w for w in recwarn if issubclass(w.category, SyntaxWarning)]


def test_malformed_and_failing_calls_become_observations():
    task = T.make_task("calculator", 0)
    env, results = _run_env(task, [
        "no tools here",  # nudged: the task needs its tool
        '<tool_call>{"name": "calc", "arguments": {"expr": }</tool_call>',  # malformed JSON
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calc", "arguments": {"expr": "1 +"}}</tool_call>',  # tool refuses
    ])
    assert [r.done for r in results] == [False] * 4
    assert "no tool call found" in results[0].observation
    assert results[1].info["malformed"] and "not valid JSON" in results[1].observation
    assert "unknown tool 'nope'" in results[2].observation
    assert "cannot parse" in results[3].observation
    assert env.malformed_turns == 1


def _engine(num_pages=512):
    return Engine(MODEL, EngineConfig(page_size=16, num_pages=num_pages, max_seq_len=1024, max_running=16,
                                      prefill_chunk=256, decode_steps=8))


def _rollout(mode, engine, tasks, **kw):
    runner = RolloutRunner(engine, TOK, RolloutConfig(mode=mode, max_turns=3, max_new_tokens=20,
                                                      temperature=0.0, max_context=1024, **kw))
    trajs = asyncio.run(runner.run(tasks, lambda t: T.make_env(t, latency=LatencyModel(0.02, 0.5))))
    return runner, trajs


TASKS = [(T.make_task(k, i), i) for i in range(3) for k in ("calculator", "lookup")]


def test_ctb_and_request_level_give_identical_trajectories_and_ctb_prefills_less():
    ctb_engine, req_engine = _engine(), _engine()
    r1, ctb = _rollout("ctb", ctb_engine, TASKS)
    r2, req = _rollout("request", req_engine, TASKS)
    for a, b in zip(ctb, req):
        assert a.tokens == b.tokens and a.loss_mask == b.loss_mask and a.end_reason == b.end_reason
        assert len(a.turns) == 3 and a.end_reason == "max_turns"
    assert ctb_engine.stats()["prefill_tokens_computed"] < req_engine.stats()["prefill_tokens_computed"]
    assert r1.metrics["completed"] == len(TASKS) and r1.metrics["turns"] == 3 * len(TASKS)
    t = ctb[0]
    for turn in t.turns:  # generated spans are exactly the masked tokens
        assert all(t.loss_mask[turn.start:turn.end]) and turn.end > turn.start
    assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
    assert all(v == 0 for v, m in zip(t.versions, t.loss_mask) if m)
    assert all(v == -1 for v, m in zip(t.versions, t.loss_mask) if not m)


@pytest.mark.parametrize("horizon", ["turn", "task"])
def test_tiny_kv_budget_still_completes_every_task_identically(horizon):
    _, free = _rollout("ctb", _engine(), TASKS)
    tight = _engine(num_pages=48)  # 47 pages x 16 tokens: one task's final context fits, six do not
    runner, trajs = _rollout("ctb", tight, TASKS, kv_budget_tokens=600, footprint_horizon=horizon)
    assert [t.tokens for t in trajs] == [t.tokens for t in free]
    assert runner.metrics["completed"] == len(TASKS)
    if horizon == "turn":  # admitting on the next turn's growth only over-commits: KV must be dropped
        assert tight.stats()["preemptions"] + tight.stats()["evictions"] > 0


def test_environment_failures_end_only_their_task():
    class Broken(ToolEnvironment):
        async def step(self, action):
            raise RuntimeError("sandbox crashed")

    class Slow(ToolEnvironment):
        async def step(self, action):
            await asyncio.sleep(5)

    def make_env(task):
        if task.task_id.endswith("/0") and task.kind == "calculator":
            return Broken({}, lambda t, a: 0.0)
        if task.task_id.endswith("/1") and task.kind == "lookup":
            return Slow({}, lambda t, a: 0.0)
        return T.make_env(task)

    runner = RolloutRunner(_engine(), TOK, RolloutConfig(max_turns=2, max_new_tokens=12, temperature=0.0,
                                                         env_timeout_s=0.3))
    trajs = asyncio.run(runner.run(TASKS, make_env))
    by_id = {t.task_id: t for t in trajs}
    assert by_id["calculator/train/0/0"].end_reason == "env_error"
    assert "sandbox crashed" in by_id["calculator/train/0/0"].failure
    assert by_id["lookup/train/0/1"].end_reason == "env_timeout"
    others = [t for t in trajs if t.task_id not in ("calculator/train/0/0", "lookup/train/0/1")]
    assert all(t.end_reason == "max_turns" and t.failure is None for t in others)
    assert runner.metrics["failed"] == 2 and runner.metrics["completed"] == len(TASKS) - 2


def test_turns_record_their_tool_calls_and_a_task_may_sample_at_its_own_temperature():
    class Tools(ToolEnvironment):  # two calls, one of them failing, then the answer
        async def step(self, action):
            self.tool_calls += 1
            if self.tool_calls == 1:
                return StepResult("error: no such tool", 0.0, False, {"tool_calls": 2, "tool_errors": 1})
            return StepResult(None, 1.0, True, {"answer": action})

    async def go(runner, **kw):
        await runner.start(lambda t: Tools({}, lambda t, a: 0.0))
        try:
            return await runner.submit(TASKS[0][0], 0, **kw)
        finally:
            await runner.stop()
    config = RolloutConfig(max_turns=3, max_new_tokens=12, temperature=1.0, seed=5)
    sampled = asyncio.run(go(RolloutRunner(_engine(), TOK, config)))
    assert [(t.tool_calls, t.tool_errors) for t in sampled.turns] == [(2, 1), (0, 0)]
    # the same runner config, this task greedy with another seed: as a greedy runner's
    greedy = asyncio.run(go(RolloutRunner(_engine(), TOK, config), temperature=0.0, seed=9))
    alone = asyncio.run(go(RolloutRunner(_engine(), TOK, dataclasses.replace(config, temperature=0.0))))
    assert greedy.tokens == alone.tokens != sampled.tokens


def test_trajectories_round_trip_through_disk(tmp_path):
    _, trajs = _rollout("ctb", _engine(), TASKS[:2])
    save_trajectories(trajs, tmp_path / "t.jsonl")
    assert load_trajectories(tmp_path / "t.jsonl") == trajs


def test_a_group_of_one_task_gives_distinct_reproducible_samples():
    group = [(T.make_task("calculator", 0), 7)] * 3

    def sample():
        runner = RolloutRunner(_engine(), TOK, RolloutConfig(max_turns=1, max_new_tokens=12, temperature=1.0))
        return asyncio.run(runner.run(group, T.make_env))
    first, again = sample(), sample()
    assert [t.info["sample"] for t in first] == [0, 1, 2]
    gens = [[x for x, m in zip(t.tokens, t.loss_mask) if m] for t in first]
    assert len({tuple(g) for g in gens}) == 3  # each sample has its own seed
    assert [t.tokens for t in first] == [t.tokens for t in again]  # and the seeds are reproducible


def test_context_limit_truncates_before_the_observation_that_does_not_fit():
    runner = RolloutRunner(_engine(), TOK, RolloutConfig(max_turns=8, max_new_tokens=20, temperature=0.0,
                                                         max_context=400))
    trajs = asyncio.run(runner.run(TASKS, T.make_env))
    assert all(len(t.tokens) <= 400 for t in trajs)
    limited = [t for t in trajs if t.end_reason == "context_limit"]
    assert limited and all(t.failure is None for t in limited)
    assert all(t.loss_mask[-1] for t in limited)  # each ends with the model's turn, not a cut observation
