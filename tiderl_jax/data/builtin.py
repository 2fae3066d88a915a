"""Built-in reward functions, with veRL's signature `(data_source, solution_str, ground_truth, extra_info)`.

- `math_reward`: 1.0 when the reply's final answer equals the ground truth, else 0.0. The final
  answer is the last `\\boxed{...}` (nested braces kept, `\\fbox` too), else the last GSM8K-style
  `#### N`, else the last number in the reply. The ground truth may itself be written either way.
  Two answers are equal when both read as numbers with the same value (`1,000` = `1000` =
  `1000.0`, `3/4` = `0.75` = `\\frac{3}{4}`, `50%` = `50`; exact rational comparison, so `0.333`
  is not `1/3`), or else when their normalised strings are equal (case, spaces, `$`, `\\text{}`,
  `\\left` / `\\right`, a trailing period ignored).
- `code_reward`: the fraction of the given tests the reply's code passes (its last ``` block, else
  the whole reply), run in the `python` task's sandbox (`agents/sandbox.py`: a fresh limited
  subprocess, killed at its time limit; no network, writes only in its temporary directory). Tests
  are assert statements: a list of strings (MBPP's `test_list`), or one string whose top-level
  `assert`s are the tests and other statements (imports, helpers) their setup; a string defining
  `check(candidate)` (HumanEval) is one test, called with `extra_info["entry_point"]`. Limits:
  `extra_info["time_limit_s"]` (default 5) and `["memory_limit_mb"]` (default 512);
  `extra_info["test_setup_code"]` (MBPP's), when present, runs after the code and before the tests. A
  sandbox violation scores 0 with the violation in the info.
- `auto_reward`: by data source, veRL's `default_compute_score` idea: `reasoning_gym/*` ->
  `packaged.reasoning_gym_reward` (reasoning-gym imported only then), a source naming MBPP or HumanEval
  (`mbpp`, `openai_humaneval`, `evalplus/humanevalplus`, ...) -> `code_reward`, anything else ->
  `math_reward`. Its info says which (`reward`).
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction
from typing import Any

from tiderl_jax.agents import sandbox
from tiderl_jax.agents.tasks import extract_code

# ----------------------------------------------------------------------------------- math

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM = re.compile(r"####\s*([^\n]+)")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces balanced), or None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a reply: the last \\boxed{}, else the last `#### N`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    gsm = _GSM.findall(text)
    if gsm:
        return gsm[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\left|\\right|\\[,;!]|\\ ", "", s)
    return s.replace("\\%", "%").strip().rstrip(".").strip()


def to_number(s: str) -> Fraction | None:
    """The exact value of a numeric answer (`1,000`, `-2.50`, `3/4`, `(3)/(4)`, `50%`, `$12`), or None."""
    s = _strip_latex(s).replace(" ", "").lstrip("$")
    if s.endswith("%"):
        s = s[:-1]
    s = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s)  # thousands separators only
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        if re.fullmatch(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def normalize(s: str) -> str:
    return re.sub(r"\s+", "", _strip_latex(s)).lower()


def answers_match(answer: str, truth: str) -> bool:
    a, b = to_number(answer), to_number(truth)
    if a is not None and b is not None:
        return a == b
    return normalize(answer) == normalize(truth)


def math_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    truth = str(ground_truth)
    if "\\boxed" in truth or "####" in truth:
        truth = extract_answer(truth) or truth
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "answer": None, "ground_truth": truth}
    return {"score": 1.0 if answers_match(answer, truth) else 0.0, "answer": answer, "ground_truth": truth}


# ----------------------------------------------------------------------------------- code

_RESULTS = "__tiderl_tests__ "
_DRIVER = """
import json as _json, sys as _sys
_g = dict(globals())
_passed = []
for _src in _json.loads(_sys.stdin.read()):
    try:
        exec(compile(_src, "<test>", "exec"), _g)
        _passed.append(True)
    except BaseException as _e:
        _passed.append(type(_e).__name__)
print(%r + _json.dumps(_passed))
""" % _RESULTS


def split_tests(tests: Any, entry_point: str | None = None) -> tuple[str, list[str]]:
    """(setup source, test sources) from a list of assert strings or one source string."""
    if isinstance(tests, str) and tests.strip().startswith("["):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass
    if isinstance(tests, (list, tuple)):
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("code tests must be a non-empty list of strings")
        return "", list(tests)
    if not isinstance(tests, str):
        raise ValueError(f"code tests must be a string or a list of strings, not {type(tests).__name__}")
    if re.search(r"^def check\(", tests, re.MULTILINE):
        if not entry_point:
            raise ValueError("tests define check(candidate) but extra_info has no 'entry_point'")
        return tests, [f"check({entry_point})"]
    tree = ast.parse(tests)  # a SyntaxError names the test's line
    setup = [ast.get_source_segment(tests, n) for n in tree.body if not isinstance(n, ast.Assert)]
    asserts = [ast.get_source_segment(tests, n) for n in tree.body if isinstance(n, ast.Assert)]
    if not asserts:
        raise ValueError("code tests have no assert statement")
    return "\n".join(setup), asserts


def code_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    extra = extra_info if isinstance(extra_info, dict) else {}
    setup, tests = split_tests(ground_truth, extra.get("entry_point"))
    setup += "\n" + str(extra.get("test_setup_code") or "")
    code = extract_code(solution_str) + "\n" + setup + "\n" + _DRIVER
    result = sandbox.run_python(code, stdin=json.dumps(tests),
                                time_limit_s=float(extra.get("time_limit_s", 5.0)),
                                memory_limit_mb=int(extra.get("memory_limit_mb", 512)),
                                max_output_chars=20_000)
    info: dict[str, Any] = {"tests": len(tests), "passed": 0, "violation": result.violation}
    lines = [line for line in result.stdout.splitlines() if line.startswith(_RESULTS)]
    if result.violation or not lines:  # a violation, or the code failed before the tests ran
        info["error"] = result.stderr[-500:]
        return {"score": 0.0, **info}
    outcomes = json.loads(lines[-1].removeprefix(_RESULTS))
    info["passed"] = sum(o is True for o in outcomes)
    info["failures"] = [o for o in outcomes if o is not True]
    return {"score": info["passed"] / len(tests), **info}


# ----------------------------------------------------------------------------------- by data source

CODE_SOURCES = ("mbpp", "humaneval")  # substrings of a code data source (lower case)


def reward_for(data_source: Any) -> str:
    """The built-in `auto_reward` uses for a data source: `reasoning_gym`, `code` or `math`."""
    source = str(data_source or "")
    if source.startswith("reasoning_gym/"):
        return "reasoning_gym"
    return "code" if any(s in source.lower() for s in CODE_SOURCES) else "math"


def auto_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    which = reward_for(data_source)
    if which == "reasoning_gym":
        from tiderl_jax.data.packaged import reasoning_gym_reward  # imports reasoning-gym only for its rows
        fn = reasoning_gym_reward
    else:
        fn = code_reward if which == "code" else math_reward
    return {**fn(data_source, solution_str, ground_truth, extra_info), "reward": which}
