"""The rollout loop with a checkpoint's own chat template (token-in / token-out): a ChatML template on the
shipped warm-start policy must give exactly the trajectories of the built-in ChatML path, tool calls,
observations and all; and each observation's tokens are the template's delta."""

import asyncio

from conftest import ROOT
from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import LatencyModel
from tiderl_jax.agents.rollout import RolloutConfig, RolloutRunner
from tiderl_jax.engine.engine import Engine, EngineConfig
from tiderl_jax.model import chat
from tiderl_jax.model.chat_template import ChatTemplate
from tiderl_jax.model.hf_io import load_hf_checkpoint
from tiderl_jax.model.tokenizer import Tokenizer

POLICY = load_hf_checkpoint(ROOT / "checkpoints" / "tiny_agentic_sft")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TASKS = [(T.make_task(k, i, split="heldout"), i) for i in range(3) for k in ("calculator", "lookup")]


def _run(tokenizer, mode):
    engine = Engine(POLICY, EngineConfig(page_size=16, num_pages=512, max_seq_len=1024, max_running=16,
                                         prefill_chunk=256, decode_steps=8))
    runner = RolloutRunner(engine, tokenizer, RolloutConfig(mode=mode, max_turns=3, max_new_tokens=96,
                                                            temperature=0.0, max_context=1024))
    return runner, asyncio.run(runner.run(TASKS, lambda t: T.make_env(t, latency=LatencyModel(0.0, 0.0))))


def test_template_path_equals_the_builtin_chatml_path():
    templated = Tokenizer.builtin()
    templated.chat_template = CHATML
    for mode in ("ctb", "request"):
        runner, with_template = _run(templated, mode)
        assert runner.template is not None and runner.template.tool_format == "hermes"
        _, builtin = _run(Tokenizer.builtin(), mode)
        assert sum(len(t.turns) for t in builtin) > len(TASKS)  # observations happened
        assert any(t.reward > 0 for t in builtin) and any(t.turns[0].tool_calls for t in builtin)
        for a, b in zip(with_template, builtin):
            assert (a.tokens, a.loss_mask, a.reward, a.end_reason) == (b.tokens, b.loss_mask, b.reward, b.end_reason)


def test_observation_tokens_are_the_template_delta():
    """Rebuild one trajectory from its messages: prompt, each sampled turn as the engine gave it, and each
    observation as `observation_ids` of the conversation so far."""
    tok = Tokenizer.builtin()
    tok.chat_template = CHATML
    template = ChatTemplate.for_tokenizer(tok)
    _, trajs = _run(tok, "ctb")
    traj = max(trajs, key=lambda t: len(t.turns))
    assert len(traj.turns) >= 2
    task = next(t for t, _ in TASKS if t.task_id == traj.task_id)
    messages = [chat.Message("system", T.SYSTEM_PROMPT), chat.Message("user", task.prompt)]
    rebuilt = template.encode(messages, add_generation_prompt=True).ids
    env = T.make_env(task, latency=LatencyModel(0.0, 0.0))
    asyncio.run(env.reset(task))
    for turn in traj.turns:
        sampled = traj.tokens[turn.start:turn.end]
        assert all(traj.loss_mask[turn.start:turn.end])
        rebuilt += sampled
        if turn.end == len(traj.tokens):  # the answer, or the last turn without an observation
            break
        text = tok.decode(sampled)
        result = asyncio.run(env.step(text))
        parsed = template.parse_tool_calls(text)
        said = chat.Message("assistant", parsed.content, parsed.tool_calls)
        tool = chat.Message("tool", result.observation)
        rebuilt += template.observation_ids(messages + [said], [tool], model_stopped=sampled[-1] == tok.eos_id)
        messages += [said, tool]
    assert rebuilt == traj.tokens
