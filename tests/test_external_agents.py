"""External agents as a rollout source: agents written with the `openai` client make the train samples.

A training run on the CPU default whose samples come from `tests/openai_agent.py` trains on exactly the tokens
the server served it (ids, the model-token mask, behaviour log-probs, versions); an agent that crashes or hangs
fails its sample with the reason and leaves no KV behind; an agent run as a command works the same way."""

import asyncio
import sys

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import openai_agent  # noqa: E402
from conftest import ROOT  # noqa: E402
from tiderl_jax.agents import tasks as T  # noqa: E402
from tiderl_jax.agents.rollout import RolloutConfig  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from tiderl_jax.model.hf_io import load_hf_checkpoint  # noqa: E402
from tiderl_jax.model.tokenizer import Tokenizer  # noqa: E402
from tiderl_jax.agents.external import ExternalAgents  # noqa: E402
from tiderl_jax.serving.service import RolloutService  # noqa: E402

CHECKPOINT = ROOT / "checkpoints" / "tiny_agentic_sft"
ENGINE = EngineConfig(page_size=16, num_pages=512, max_seq_len=1024, max_running=16, prefill_chunk=256,
                      decode_steps=4, bucket_growth=4)


@pytest.mark.e2e
def test_a_training_run_trains_on_exactly_the_tokens_served_to_the_agent(tmp_path, monkeypatch):
    from tiderl_jax.rl.losses import LossConfig
    from tiderl_jax.rl.trainer_config import TrainerConfig
    from tiderl_jax.runtime.controller import Controller, ControllerConfig

    cfg = ControllerConfig(mode="async", steps=2, groups_per_step=2, group_size=2, max_concurrent=4,
                           task_kinds=("calculator",), device_group_size=2, rollout_groups=2, ref_groups=0,
                           train_groups=2, ers=False)
    rollout = RolloutConfig(max_turns=3, max_new_tokens=96, max_context=1024, agent="openai_agent:agent",
                            agent_timeout_s=120)
    c = Controller(load_hf_checkpoint(CHECKPOINT), Tokenizer.from_checkpoint(CHECKPOINT), config=cfg,
                   engine_config=ENGINE, rollout_config=rollout,
                   trainer_config=TrainerConfig(loss=LossConfig(kl_coef=0.0), learning_rate=1e-4, warmup_steps=0,
                                                total_steps=10, row_len=1024, micro_rows=4),
                   logdir=str(tmp_path), checkpoints=False)
    keys, trained = {}, []
    issue = None

    def spy_start(original):
        async def start(*a, **kw):
            await original(*a, **kw)
            nonlocal issue
            frontend = c.backend.agents.frontend
            issue = frontend.issue_key
            monkeypatch.setattr(frontend, "issue_key", lambda sid: keys.setdefault(sid, issue(sid)))
        return start
    monkeypatch.setattr(c.backend, "start", spy_start(c.backend.start))
    train = c.backend.train

    async def spy_train(trajectories):
        trained.extend(trajectories)
        return await train(trajectories)
    monkeypatch.setattr(c.backend, "train", spy_train)
    summary = asyncio.run(asyncio.wait_for(c.run(), 600))
    assert summary["steps"] == 2 and len(trained) == 2 * 2 * 2
    assert c.backend.agents.counts["failed"] == 0
    for traj in trained:
        served = openai_agent.SERVED[keys[traj.info["session"]]]
        last = served[-1]
        assert traj.tokens == last["prompt"] + last["completion"]  # every token, in order
        mask, logprobs, versions = [False] * len(traj.tokens), [0.0] * len(traj.tokens), [-1] * len(traj.tokens)
        for call in served:  # the model's tokens of each call, nothing else
            start = len(call["prompt"])
            assert traj.tokens[start:start + len(call["completion"])] == call["completion"]
            for i, (lp, v) in enumerate(zip(call["logprobs"], call["versions"])):
                mask[start + i], logprobs[start + i], versions[start + i] = True, lp, v
        assert traj.loss_mask == mask and traj.logprobs == logprobs and traj.versions == versions
        assert traj.end_reason == "answered" and len(traj.turns) == len(served)
    tasks = {t.task_id: t for t in (T.make_task("calculator", i, "train", cfg.data_seed) for i in range(16))}
    frontend = c.backend.agents.frontend
    for traj in trained:  # the configured reward (the calculator's scorer) on the agent's last reply
        task, last = tasks[traj.task_id], traj.turns[-1]
        reply = frontend.parse_reply(frontend.visible(traj.tokens[last.start:last.end]))
        assert traj.reward == T.make_env(task).score(task, reply.content)
    assert {v for t in trained for v in t.versions} - {-1} <= {0, 1}  # versions as served (staleness bound 1)
    ledger = summary["ledger"]
    assert ledger["completed"] >= len(trained) and not any(k.startswith("dropped:agent") for k in ledger)


def _episodes(agents: ExternalAgents, tasks):
    """Runs the agents over a one-engine service on the tiny policy; (trajectories, engine load after)."""
    tok = Tokenizer.from_checkpoint(CHECKPOINT)
    engine = Engine(load_hf_checkpoint(CHECKPOINT), ENGINE)

    async def main():
        service = RolloutService([engine])
        await service.start(on_turn_end=lambda rep, h: rep.engine.pin(h))
        await agents.start(service, tok, T.make_env, "ctb")
        try:
            trajs = await asyncio.gather(*(agents.run(t, g, 0) for g, t in enumerate(tasks)))
            await asyncio.sleep(0.1)  # the releases land between engine steps
            return trajs, engine.load(), dict(service.counters), agents.frontend.sessions
        finally:
            await agents.stop()
            await service.stop()
    return asyncio.run(asyncio.wait_for(main(), 300))


def test_crashing_and_hanging_agents_fail_their_samples_and_release_their_kv():
    task = T.make_task("calculator", 0, "heldout")
    crash, load, _, sessions = _episodes(ExternalAgents("openai_agent:crashing", timeout_s=60), [task])
    assert crash[0].end_reason == "agent_error" and "RuntimeError: the agent's scaffold crashed" in crash[0].failure
    assert crash[0].num_generated == 4 and crash[0].reward == 0.0  # what it was served is kept, for the record
    assert load["pinned_kv_tokens"] == 0 and load["running"] == 0 and not sessions
    hang, load, _, sessions = _episodes(ExternalAgents("openai_agent:hanging", timeout_s=3), [task])
    assert hang[0].end_reason == "agent_timeout" and "within 3" in hang[0].failure
    assert load["pinned_kv_tokens"] == 0 and not sessions


def test_an_agent_s_own_reward_is_the_sample_s():
    trajs, *_ = _episodes(ExternalAgents("openai_agent:rewarding", timeout_s=60),
                          [T.make_task("calculator", 0, "heldout")])
    # one request of at most 4 tokens (fewer when the policy's reply ends sooner)
    assert trajs[0].end_reason == "answered" and trajs[0].reward == 0.25 and 1 <= trajs[0].num_generated <= 4


def test_an_agent_command_gets_the_endpoint_in_its_environment(tmp_path, monkeypatch):
    # greedy: the shipped policy calls the tool on task 0 (on task 1, and sampled on many others, it answers at once:
    # the warm start's demonstrator took that shortcut, checkpoints/README.md)
    monkeypatch.setenv("AGENT_TEMPERATURE", "0")
    tasks = [T.make_task("calculator", i, "heldout") for i in range(2)]
    agents = ExternalAgents(command=f"{sys.executable} {ROOT / 'tests' / 'openai_agent.py'}", timeout_s=120)
    trajs, load, counters, _ = _episodes(agents, tasks)
    for traj, task in zip(trajs, tasks):
        assert traj.end_reason == "answered", traj.failure
        assert traj.task_id == task.task_id and traj.num_generated > 0 and len(traj.turns) >= 1
    assert counters["resumed"] >= 1  # a tool result continued its session's pinned KV
    assert load["pinned_kv_tokens"] == 0


def test_bad_agent_settings_are_named():
    from tiderl_jax.model.config import ConfigError
    with pytest.raises(ConfigError, match="exactly one of rollout.agent"):
        ExternalAgents()
    with pytest.raises(ConfigError, match="has no 'nope'"):
        ExternalAgents("openai_agent:nope")
    with pytest.raises(ConfigError, match="must be an async function"):
        ExternalAgents("openai_agent:_calc")
    from tiderl_jax import config as config_lib
    c = config_lib.load_config_file(str(ROOT / "configs" / "tiny_agentic.py"))
    with c.unlocked():  # the options are the main job's rollout section's
        c.rollout.agent, c.rollout.agent_timeout_s = "openai_agent:agent", 30.0
    rollout = config_lib.rl_configs(c)[3]
    assert (rollout.agent, rollout.agent_command, rollout.agent_timeout_s) == ("openai_agent:agent", "", 30.0)
