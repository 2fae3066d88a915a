"""Built-in agentic tasks: generators (seeded train / held-out splits), tools, rewards, demonstrations.

- `calculator`: multi-step integer arithmetic; the `calc` tool evaluates an expression
  (+, -, *, parentheses) safely; reward 1 when the final reply's last integer is the value.
- `lookup`: two-hop questions over a generated knowledge base ("In which country was X born?");
  the `search` tool returns one entity's facts; reward 1 when the reply names the country.

Each task kind also gives a demonstration (the ideal turns: tool calls, then the answer) for the
supervised warm start, and builds its environment with a configurable latency.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Mapping

from tiderl_jax.agents.env import LatencyModel, Task, ToolEnvironment, ToolError
from tiderl_jax.model import chat

SPLITS = ("train", "heldout")
SYSTEM_PROMPT = "You are a careful assistant. Use the tools through <tool_call> markup, then answer."


def _rng(kind: str, split: str, seed: int, index: int) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    return random.Random(f"{kind}/{split}/{seed}/{index}")


def _last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


# ----------------------------------------------------------------------------------- calculator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expr: str) -> int:
    """Integer arithmetic with + - * and parentheses; anything else is a ToolError."""
    if len(expr) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expr!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(value) > 10**12:
                raise ToolError("result too large")
            return value
        raise ToolError(f"unsupported element {type(node).__name__} in {expr!r}")

    return ev(tree)


def calculator_task(index: int, split: str = "train", seed: int = 0) -> Task:
    rng = _rng("calculator", split, seed, index)
    expr = str(rng.randint(1, 50))
    for _ in range(rng.randint(2, 3)):
        op = rng.choice(["+", "-", "*"])
        term = str(rng.randint(1, 20 if op == "*" else 50))
        expr = f"({expr} {op} {term})" if rng.random() < 0.5 else f"{expr} {op} {term}"
    answer = safe_eval(expr)
    return Task(f"calculator/{split}/{seed}/{index}", "calculator",
                f"Compute {expr}. Use the calc tool, then reply with the number.", str(answer),
                {"expr": expr}, is_eval=split == "heldout")


def _calc_tool(args: Mapping[str, Any]) -> str:
    expr = args.get("expr")
    if not isinstance(expr, str):
        raise ToolError('calc needs {"expr": "<expression>"}')
    return str(safe_eval(expr))


def _score_int(task: Task, reply: str) -> float:
    return 1.0 if _last_int(reply) == int(task.answer) else 0.0


# ----------------------------------------------------------------------------------- lookup

_SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "tor", "li", "sa", "dor", "el", "na", "qu", "bre", "zo"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def lookup_task(index: int, split: str = "train", seed: int = 0) -> Task:
    rng = _rng("lookup", split, seed, index)
    countries = sorted({_name(rng, 3) for _ in range(4)})
    cities = {_name(rng, 2): rng.choice(countries) for _ in range(6)}
    people = {f"{_name(rng, 2)} {_name(rng, 3)}": rng.choice(sorted(cities)) for _ in range(5)}
    person = rng.choice(sorted(people))
    kb = {**{p: f"{p} was born in the city of {c}." for p, c in people.items()},
          **{c: f"{c} is a city in {k}." for c, k in cities.items()}}
    return Task(f"lookup/{split}/{seed}/{index}", "lookup",
                f"In which country was {person} born? Use the search tool.",
                cities[people[person]], {"kb": kb, "person": person, "city": people[person]},
                is_eval=split == "heldout")


def _search_tool(kb: Mapping[str, str]):
    def search(args: Mapping[str, Any]) -> str:
        query = args.get("query")
        if not isinstance(query, str):
            raise ToolError('search needs {"query": "<name>"}')
        key = next((k for k in kb if k.lower() == query.strip().lower()), None)
        return kb[key] if key else f"no results for {query!r}"
    return search


def _score_name(task: Task, reply: str) -> float:
    return 1.0 if task.answer.lower() in reply.lower() else 0.0


# ----------------------------------------------------------------------------------- registry

GENERATORS = {"calculator": calculator_task, "lookup": lookup_task}


def make_task(kind: str, index: int, split: str = "train", seed: int = 0) -> Task:
    if kind not in GENERATORS:
        raise ValueError(f"task kind {kind!r} is not one of {sorted(GENERATORS)}")
    return GENERATORS[kind](index, split, seed)


def make_env(task: Task, *, latency: LatencyModel = LatencyModel(), seed: int = 0) -> ToolEnvironment:
    if task.kind == "calculator":
        return ToolEnvironment({"calc": _calc_tool}, _score_int, latency=latency, seed=seed)
    if task.kind == "lookup":
        return ToolEnvironment({"search": _search_tool(task.data["kb"])}, _score_name,
                               latency=latency, seed=seed)
    raise ValueError(f"task kind {task.kind!r} has no environment")


def demonstration(task: Task) -> list[chat.Message]:
    """The ideal conversation for `task` (system, user, tool-calling turns, answer)."""
    msgs = [chat.Message("system", SYSTEM_PROMPT), chat.Message("user", task.prompt)]
    if task.kind == "calculator":
        msgs += [chat.Message("assistant", "", (chat.ToolCall("calc", {"expr": task.data["expr"]}),)),
                 chat.Message("tool", task.answer), chat.Message("assistant", task.answer)]
    elif task.kind == "lookup":
        kb, person, city = task.data["kb"], task.data["person"], task.data["city"]
        msgs += [chat.Message("assistant", "", (chat.ToolCall("search", {"query": person}),)),
                 chat.Message("tool", kb[person]),
                 chat.Message("assistant", "", (chat.ToolCall("search", {"query": city}),)),
                 chat.Message("tool", kb[city]), chat.Message("assistant", task.answer)]
    return msgs
