"""Agents written against the OpenAI API alone, for the external-agent tests (tests/test_external_agents.py).

`agent` solves a calculator task: it asks the policy, runs the `calc` tool itself when the policy calls it, sends
the result back, and returns when the policy answers (None: the configured reward scores the answer). It keeps
what the server said it served (`SERVED[api_key]`: prompt ids, completion ids, behaviour log-probs, versions of
every call), so a test can compare it with what was trained. Run as a script, it is the same agent as a command
(`rollout.agent_command`): the task on stdin, the endpoint in OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL, its
sampling temperature in AGENT_TEMPERATURE (1.0 when unset)."""

import asyncio
import json
import os
import sys

import openai

from tiderl_jax.agents.tasks import ToolError, safe_eval

SERVED: dict[str, list[dict]] = {}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "integer arithmetic: + - * ( )",
                                            "parameters": {"type": "object",
                                                           "properties": {"expr": {"type": "string"}}}}}]


def _calc(arguments: str) -> str:
    try:
        return str(safe_eval(json.loads(arguments)["expr"]))
    except (ToolError, KeyError, ValueError, TypeError) as e:
        return f"error: {e}"


async def agent(task, base_url, api_key, temperature=1.0):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["prompt"]}]
    served = SERVED.setdefault(api_key, [])
    for _ in range(task.get("max_turns") or 3):
        r = await client.chat.completions.create(model=task["model"], messages=messages, tools=TOOLS,
                                                 temperature=temperature, max_tokens=96,
                                                 extra_body={"return_token_ids": True})
        choice = r.choices[0]
        served.append(dict(prompt=r.model_extra["prompt_token_ids"], completion=choice.model_extra["token_ids"],
                           logprobs=choice.model_extra["behaviour_logprobs"],
                           versions=choice.model_extra["policy_versions"]))
        message = choice.message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": _calc(c.function.arguments)}
                     for c in message.tool_calls]
    return None


async def crashing(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    await client.chat.completions.create(model=task["model"], messages=[{"role": "user", "content": task["prompt"]}],
                                         max_tokens=4)
    raise RuntimeError("the agent's scaffold crashed")


async def rewarding(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    await client.chat.completions.create(model=task["model"], messages=[{"role": "user", "content": task["prompt"]}],
                                         max_tokens=4)
    return {"reward": 0.25}


async def hanging(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    await client.chat.completions.create(model=task["model"], messages=[{"role": "user", "content": task["prompt"]}],
                                         max_tokens=4)
    await asyncio.sleep(3600)


async def _main():
    task = json.load(sys.stdin)
    task["model"] = os.environ["OPENAI_MODEL"]
    await agent(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"],
                float(os.environ.get("AGENT_TEMPERATURE", "1.0")))
    print(json.dumps({"calls": len(SERVED[os.environ["OPENAI_API_KEY"]])}))  # not a reward: the scorer's applies


if __name__ == "__main__":
    asyncio.run(_main())
