"""Built-in agentic tasks: generators (seeded train / held-out splits), tools, rewards, demonstrations.

- `calculator`: multi-step integer arithmetic; the `calc` tool evaluates an expression
  (+, -, *, parentheses) safely; reward 1 when the final reply's last integer is the value.
- `lookup`: two-hop questions over a generated knowledge base ("In which country was X born?");
  the `search` tool returns one entity's facts; reward 1 when the reply names the country.
- `python`: write a small function `f` (a few seeded templates: sums, words, counting, ...). The
  `run` tool executes code in the sandbox (`sandbox.py`) and shows its output, so the model tests
  by printing; the final reply's code (its last ``` block, else the whole reply) is run against
  hidden test cases and the reward is the fraction it passes. Sandbox violations are error
  observations (and reward 0 for the answer), counted by kind in `PythonEnvironment.violations`.
- `visual`: questions about a rendered grid of coloured squares (count them in a quadrant, or
  locate one); the observations are images: a blurred overview first, then the `zoom` tool's sharp
  quadrant (`visual.py`). Reward 1 for the right count, or row and column.

Each task kind also gives a demonstration (the ideal turns: tool calls, then the answer) for the
supervised warm start, and builds its environment with a configurable latency.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import operator
import random
import re
import warnings
import zlib
from typing import Any, Callable, Mapping, Sequence

from tiderl_jax.agents import sandbox, visual
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
        with warnings.catch_warnings():  # "2and 3" warns (invalid decimal literal) on stderr: refused here instead
            warnings.simplefilter("error", SyntaxWarning)
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


# ----------------------------------------------------------------------------------- python

_Args = Callable[[random.Random], list]  # draws one argument list for f


def _int_list(rng: random.Random) -> list:
    return [[rng.randint(-9, 20) for _ in range(rng.randint(0, 7))]]


def _words(rng: random.Random) -> list:
    return [" ".join(_name(rng, rng.randint(1, 2)).lower() for _ in range(rng.randint(1, 4)))]


# Each template draws its parameters and returns (what f does, a correct f as source, its arguments).
def _divisible_sum(rng: random.Random) -> tuple[str, str, _Args]:
    k = rng.randint(2, 5)
    return (f"f(xs) that returns the sum of the numbers in xs divisible by {k}",
            f"def f(xs):\n    return sum(x for x in xs if x % {k} == 0)\n", _int_list)


def _reverse_words(rng: random.Random) -> tuple[str, str, _Args]:
    sep = rng.choice(["-", ",", "+", "_"])
    return (f"f(s) that returns the words of s in reverse order, joined by {sep!r}",
            f"def f(s):\n    return {sep!r}.join(reversed(s.split()))\n", _words)


def _count_chars(rng: random.Random) -> tuple[str, str, _Args]:
    chars = "".join(sorted(rng.sample("aeiklmnor", 3)))  # letters the words are made of
    return (f"f(s) that returns how many characters of s are in {chars!r}",
            f"def f(s):\n    return sum(c in {chars!r} for c in s)\n", _words)


def _running(rng: random.Random) -> tuple[str, str, _Args]:
    which = rng.choice(["max", "min"])
    return (f"f(xs) that returns the running {which}imum of xs as a list",
            f"def f(xs):\n    out = []\n    for x in xs:\n"
            f"        out.append(x if not out else {which}(out[-1], x))\n    return out\n", _int_list)


def _largest(rng: random.Random) -> tuple[str, str, _Args]:
    k = rng.randint(2, 3)
    return (f"f(xs) that returns the {k} largest numbers of xs (all if fewer), largest first",
            f"def f(xs):\n    return sorted(xs, reverse=True)[:{k}]\n", _int_list)


def _shift_letters(rng: random.Random) -> tuple[str, str, _Args]:
    k = rng.randint(1, 5)
    return (f"f(s) that returns s with each letter moved {k} places on in the alphabet (z wraps to a)",
            f"def f(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if c.isalpha() else c\n"
            f"                   for c in s)\n", _words)


_TEMPLATES = [_divisible_sum, _reverse_words, _count_chars, _running, _largest, _shift_letters]
_NUM_TESTS = 5  # hidden tests per task, besides the example in the prompt
_TOOL_OUTPUT_CHARS = 500  # what a `run` may print (it goes into the model's context)
_SCORE_OUTPUT_CHARS = 20_000  # scoring runs may print more before the results line
_RESULTS = "__results__ "

# Appended to the answer's code for scoring: calls f on each test's arguments (read from stdin) and
# prints the results as one JSON line; a test whose call raises gets an error string.
_DRIVER = f"""
import json as _json, sys as _sys
_results = []
for _args in _json.loads(_sys.stdin.read()):
    try:
        _results.append(f(*_args))
    except Exception as _e:
        _results.append("error: " + type(_e).__name__)
print({_RESULTS!r} + _json.dumps(_results, default=repr))
"""
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _call(args: list) -> str:
    return f"f({', '.join(map(repr, args))})"


def python_task(index: int, split: str = "train", seed: int = 0) -> Task:
    rng = _rng("python", split, seed, index)
    does, solution, draw_args = rng.choice(_TEMPLATES)(rng)
    namespace: dict[str, Any] = {}
    exec(solution, namespace)  # our own template's f (not model code), for the expected outputs
    tests = [[args, namespace["f"](*args)] for args in (draw_args(rng) for _ in range(_NUM_TESTS + 1))]
    tests.sort(key=lambda test: len(repr(test[0])), reverse=True)  # the longest is the best example
    (example_args, example_out), hidden = tests[0], tests[1:]
    return Task(f"python/{split}/{seed}/{index}", "python",
                f"Write a Python function {does}. Example: {_call(example_args)} returns {example_out!r}. "
                f"Test it with the run tool, then reply with the code.",
                solution, {"tests": hidden, "example": tests[0]}, is_eval=split == "heldout")


def extract_code(reply: str) -> str:
    """The code of a final reply: its last ``` block, else the whole reply."""
    blocks = _CODE_BLOCK.findall(reply)
    return blocks[-1] if blocks else reply


class PythonEnvironment(ToolEnvironment):
    """The `python` task's environment: a sandboxed `run` tool, and the answer scored by hidden tests.

    Both run in `sandbox.run_python_async` (a worker thread), so other environments go on meanwhile.
    """

    def __init__(self, *, latency: LatencyModel = LatencyModel(), seed: int = 0):
        super().__init__({"run": self._run}, self._score, latency=latency, seed=seed)
        self.violations: collections.Counter[str] = collections.Counter()  # by kind, runs and scoring

    async def _run(self, args: Mapping[str, Any]) -> str:
        code = args.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError('run needs {"code": "<python source>"}')
        result = await sandbox.run_python_async(code, max_output_chars=_TOOL_OUTPUT_CHARS)
        if result.violation:
            self.violations[result.violation] += 1
            raise ToolError(f"sandbox violation: {result.violation}")
        output = result.stdout.rstrip("\n") or "(no output)"
        return f"{output}\nstderr:\n{result.stderr}" if result.stderr else output

    async def _score(self, task: Task, reply: str) -> float:
        tests = task.data["tests"]
        result = await sandbox.run_python_async(extract_code(reply) + _DRIVER,
                                                stdin=json.dumps([args for args, _ in tests]),
                                                max_output_chars=_SCORE_OUTPUT_CHARS)
        if result.violation:
            self.violations[result.violation] += 1
            return 0.0
        lines = [line for line in result.stdout.splitlines() if line.startswith(_RESULTS)]
        if not lines:  # the code failed before the driver printed (no f, a syntax error, ...)
            return 0.0
        try:
            outputs = json.loads(lines[-1].removeprefix(_RESULTS))
        except json.JSONDecodeError:
            return 0.0
        return sum(out == expected for out, (_, expected) in zip(outputs, tests)) / len(tests)


# ----------------------------------------------------------------------------------- visual


def visual_task(index: int, split: str = "train", seed: int = 0) -> Task:
    return visual.draw_task(_rng("visual", split, seed, index), f"visual/{split}/{seed}/{index}",
                            is_eval=split == "heldout")


# ----------------------------------------------------------------------------------- registry

GENERATORS = {"calculator": calculator_task, "lookup": lookup_task, "python": python_task,
              "visual": visual_task}


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
    if task.kind == "python":
        return PythonEnvironment(latency=latency, seed=seed)
    if task.kind == "visual":
        return visual.VisualEnvironment(latency=latency, seed=seed)
    raise ValueError(f"task kind {task.kind!r} has no environment")


IMAGE_KINDS = ("visual",)  # the kinds whose observations (and demonstrations) carry images


def image_patch_size(kinds: Sequence[str], image_patch_dim: int) -> int:
    """The patch size the images of tasks of `kinds` are cut with for a model with `image_patch_dim`
    (`demonstration(patch_size=)`): 0 when no kind has images; ConfigError naming the problem when
    one has and the model cannot read them (a text-only model, another patch size)."""
    if not any(k in IMAGE_KINDS for k in kinds):
        return 0
    return visual.patch_size_of(image_patch_dim)


SHORTCUT_KINDS = ("calculator", "lookup")  # the kinds whose demonstrator can take a shortcut


def _left_to_right(expr: str) -> int:
    """`expr` worked out in the head: its numbers and operators left to right, parentheses and precedence
    ignored (right when they change nothing, as in "(3 + 4) * 5"; wrong in "3 + 4 * 5")."""
    items = re.findall(r"\d+|[-+*]", expr)
    value = int(items[0])
    for op, term in zip(items[1::2], items[2::2]):
        value = {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](value, int(term))
    return value


def demonstration(task: Task, *, patch_size: int = 4, shortcut: bool = False) -> list[chat.Message]:
    """The ideal conversation for `task` (system, user, tool-calling turns, answer).

    A `visual` task's messages carry its images as patches of `patch_size` (the model's: image
    tokens are (height / patch_size) * (width / patch_size); ConfigError for a size that does not
    cut them, 0 among those: a text-only model); other kinds have no images.

    `shortcut`: the conversation of a demonstrator that skips its last tool call, as weaker models do
    (`SHORTCUT_KINDS`; ValueError for another kind): `lookup` answers with the city the first search
    found, the intermediate entity (always wrong: the question asks for its country); `calculator`
    replies at once with the expression worked out in the head, left to right (`_left_to_right`). The
    calculator's environment does not score a reply before any tool call: it sends it back, asking for
    the tool, and a policy that learned the shortcut must then recover in its remaining turns. A warm
    start on a share of these (`sft.shortcut_rate`) gives RL a choice to learn: the tool call that
    earns the reward.
    """
    if shortcut and task.kind not in SHORTCUT_KINDS:
        raise ValueError(f"task kind {task.kind!r} has no shortcut demonstration (only {SHORTCUT_KINDS})")
    msgs = [chat.Message("system", SYSTEM_PROMPT), chat.Message("user", task.prompt)]
    if task.kind == "calculator" and shortcut:
        msgs.append(chat.Message("assistant", str(_left_to_right(task.data["expr"]))))
    elif task.kind == "lookup" and shortcut:
        person, city = task.data["person"], task.data["city"]
        msgs += [chat.Message("assistant", "", (chat.ToolCall("search", {"query": person}),)),
                 chat.Message("tool", task.data["kb"][person]), chat.Message("assistant", city)]
    elif task.kind == "calculator":
        msgs += [chat.Message("assistant", "", (chat.ToolCall("calc", {"expr": task.data["expr"]}),)),
                 chat.Message("tool", task.answer), chat.Message("assistant", task.answer)]
    elif task.kind == "lookup":
        kb, person, city = task.data["kb"], task.data["person"], task.data["city"]
        msgs += [chat.Message("assistant", "", (chat.ToolCall("search", {"query": person}),)),
                 chat.Message("tool", kb[person]),
                 chat.Message("assistant", "", (chat.ToolCall("search", {"query": city}),)),
                 chat.Message("tool", kb[city]), chat.Message("assistant", task.answer)]
    elif task.kind == "python":  # test the solution on the example, read its output, answer with it
        args, out = task.data["example"]
        test = task.answer + f"print({_call(args)})\n"
        msgs += [chat.Message("assistant", "", (chat.ToolCall("run", {"code": test}),)),
                 chat.Message("tool", str(out)), chat.Message("assistant", f"```python\n{task.answer}```")]
    elif task.kind == "visual":  # the user's message carries the overview image
        msgs = msgs[:1] + visual.demonstration(task, patch_size)
    return msgs


@dataclasses.dataclass(frozen=True)
class TaskEnvFactory:
    """The built-in task environments with a latency model, seeded by task id. Picklable, and defined
    here because environment subprocesses (faults/env_worker.py) preload this module: unpickling it
    in a child costs no imports."""
    latency: LatencyModel = LatencyModel()

    def __call__(self, task: Task):
        return make_env(task, latency=self.latency, seed=zlib.crc32(task.task_id.encode()))
