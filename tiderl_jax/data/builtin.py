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
  `extra_info["test_setup_code"]` (MBPP's), when present, runs before the tests. A sandbox violation
  scores 0 with the violation in the info, and so does code that fails before the tests run or ends
  during them (`os._exit`, `sys.exit`).
  The graded code cannot write or sway its own result: it runs in a sandboxed program of its own, and
  the tests, their setup and the result line in another (`sandbox.run_python_pair`), which deletes
  its source before the graded code starts and reaches the graded code's functions and objects only
  through references: calls, attribute reads and writes, iteration. What comes back is a plain value
  (None, bool, int, float, str, bytes, complex, list, tuple, set, frozenset, dict, rebuilt by the
  judge: an `__eq__` of the graded code's never runs) or another reference, which has no truth
  value or equality of its own. Costs of that: arguments go pickled, so a test's own objects (a
  lambda, a class of the setup) cannot be passed, and an argument changed in place by the graded
  code is not seen by the test; a name of a built-in (`sum`) is the graded code's only when the
  tests use no other name it defines, so `set(f(x)) == set(y)` keeps the built-in `set`.
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
from tiderl_jax.data.answers import GSM_ANSWER, last_boxed
from tiderl_jax.data.packaged import reasoning_gym_reward  # reasoning-gym itself is imported only for its rows

# ----------------------------------------------------------------------------------- math

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a reply: the last \\boxed{}, else the last `#### N`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    gsm = GSM_ANSWER.findall(text)
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

# The graded code runs in a program of its own (the server), the tests in another (the judge), joined by a
# socket (`sandbox.run_python_pair`). The judge reaches the server's objects through references (`_Ref`):
# calls, attribute reads and writes, iteration. Requests go pickled (a reference as its number); answers come
# back as JSON of plain values, or a reference for anything else (`_to_wire`), which the judge rebuilds as
# plain Python values, so every comparison, truth test and the result line are the judge's own. A message: its
# length (8 bytes), then its bytes.
_WIRE = r"""
import json as _json, os as _os, pickle as _pickle, sys as _sys

_sys.set_int_max_str_digits(0)
_PEER = int(_os.environ["SANDBOX_PEER_FD"])


class _Ended(Exception):
    "The other program is gone."


def _send(data):
    view = memoryview(len(data).to_bytes(8, "big") + data)
    try:
        while view:
            view = view[_os.write(_PEER, view):]
    except OSError:
        raise _Ended from None


def _read(n):
    data = bytearray()
    while len(data) < n:
        try:
            chunk = _os.read(_PEER, min(n - len(data), 1 << 20))
        except OSError:
            chunk = b""
        if not chunk:
            raise _Ended
        data += chunk
    return bytes(data)


def _recv():
    return _read(int.from_bytes(_read(8), "big"))
"""

# The graded program: waits for the judge's go-ahead (the tests are off the disk by then); runs the code as
# `__main__`; sends its names, then answers requests until the judge is gone. It never sees the tests or their
# setup (HumanEval's `check` holds the expected values).
_SERVER = _WIRE + r"""
import io as _io, linecache as _linecache, types as _types

_objects = []  # what the judge holds references to, by number


def _to_wire(v):
    "A plain value as JSON (tagged where JSON has no type of its own); anything else as a reference."
    if v is None or isinstance(v, bool):
        return v
    for t in (int, float, str):
        if isinstance(v, t):
            return t(v)
    if isinstance(v, list):
        return [_to_wire(x) for x in v]
    if isinstance(v, (tuple, set, frozenset)):
        tag = "tuple" if isinstance(v, tuple) else "set" if isinstance(v, set) else "frozenset"
        return {tag: [_to_wire(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_to_wire(k), _to_wire(x)] for k, x in v.items()]}
    if isinstance(v, bytes):
        return {"bytes": bytes(v).hex()}
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    _objects.append(v)
    return {"ref": len(_objects) - 1}


class _Unpickler(_pickle.Unpickler):
    def persistent_load(self, ref):
        return _objects[ref]


_OPS = {"call": lambda f, args, kwargs: f(*args, **kwargs), "getattr": getattr, "setattr": setattr,
        "iter": list}
_recv()
_main = _types.ModuleType("__main__")
_sys.modules["__main__"] = _main
_linecache.cache["solution.py"] = (len(_CODE), None, _CODE.splitlines(True), "solution.py")
exec(compile(_CODE, "solution.py", "exec"), vars(_main))
_names = {"modules": {}, "values": {}}
for _k, _v in list(vars(_main).items()):
    if _k.startswith("__"):
        continue
    if isinstance(_v, _types.ModuleType):
        _names["modules"][_k] = _v.__name__
    else:
        try:
            _names["values"][_k] = _to_wire(_v)
        except Exception:
            pass
_send(_json.dumps(_names).encode())
while True:
    try:
        _request = _recv()
    except _Ended:
        break
    try:
        _op, _ref, *_args = _Unpickler(_io.BytesIO(_request)).load()
        _data = _json.dumps(["value", _to_wire(_OPS[_op](_objects[_ref], *_args))]).encode()
    except BaseException as _e:  # the request's failure is the test's
        _data = _json.dumps(["raise", type(_e).__name__, str(_e)[:200]]).encode()
    _send(_data)
"""

# The judge: removes its source (the tests) before it lets the graded program start; installs the server's
# names (standard modules by their own name; a name of a built-in only when the tests use no other name the
# server defines: MBPP's task 116 asks for a `sum`, but `set(f(x)) == set(y)` keeps the built-in `set`); runs
# the setup and the tests; prints the outcomes, unless the graded program ended meanwhile.
_JUDGE = _WIRE + r"""
import ast as _ast, builtins as _builtins, importlib as _importlib, io as _io, types as _types

_os.remove("main.py")
_ended = []
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}
_NOT_RAISED = (StopIteration, StopAsyncIteration)  # they would end a test's loop early instead of failing it


class _Ref:
    "An object of the graded program: calls, attributes and iteration reach it; its truth and equality do not."
    __slots__ = ("_ref",)

    def __init__(self, ref):
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        return _ask("call", self._ref, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _ask("getattr", self._ref, name)

    def __setattr__(self, name, value):
        _ask("setattr", self._ref, name, value)

    def __iter__(self):
        return iter(_ask("iter", self._ref))

    def __bool__(self):
        raise TypeError("an object of the graded program has no truth value in the tests")


class _Pickler(_pickle.Pickler):
    def persistent_id(self, obj):
        return obj._ref if type(obj) is _Ref else None


def _from_wire(v):
    if isinstance(v, list):
        return [_from_wire(x) for x in v]
    if isinstance(v, dict):
        (tag, x), = v.items()
        if tag in _TAGS:
            return _TAGS[tag](_from_wire(y) for y in x)
        if tag == "dict":
            return {_from_wire(k): _from_wire(y) for k, y in x}
        if tag == "bytes":
            return bytes.fromhex(x)
        if tag == "complex":
            return complex(*x)
        if tag == "ref":
            return _Ref(x)
        raise ValueError(f"unknown value tag {tag!r}")
    return v  # None, bool, int, float or str: json's own


def _raised(name, message):
    "The graded program's exception: the built-in class of that name when there is one (a test may expect it)."
    cls = getattr(_builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NOT_RAISED):
        try:
            return cls(str(message))
        except Exception:
            pass
    return RuntimeError(f"{name}: {message}")


def _ask(*request):
    buffer = _io.BytesIO()
    _Pickler(buffer).dump(request)
    try:
        _send(buffer.getvalue())
        reply = _json.loads(_recv())
    except _Ended:
        _ended.append(request[0])
        raise
    if reply[0] == "value":
        return _from_wire(reply[1])
    raise _raised(*reply[1:])


_main = _types.ModuleType("__main__")
_sys.modules["__main__"] = _main
_ns = vars(_main)
_send(b"go")
try:
    _names = _json.loads(_recv())
except _Ended:
    _sys.exit("the graded program ended before the tests ran")
for _k, _m in _names["modules"].items():
    if _k == _m and _m.partition(".")[0] in _sys.stdlib_module_names:
        try:
            _ns[_k] = _importlib.import_module(_m)
        except Exception:
            pass
_used = {n.id for t in _TESTS for n in _ast.walk(_ast.parse(t)) if isinstance(n, _ast.Name)}
_builtin = set(dir(_builtins))
_shadow = not (_used & set(_names["values"]) - _builtin)
for _k, _v in _names["values"].items():
    if _k.isidentifier() and not _k.startswith("__") and (_k not in _builtin or _shadow and _k in _used):
        try:
            _ns[_k] = _from_wire(_v)
        except Exception:
            pass
exec(compile(_SETUP, "<setup>", "exec"), _ns)
_outcomes = []
for _src in _TESTS:
    try:
        exec(compile(_src, "<test>", "exec"), _ns)
        _outcomes.append(True)
    except BaseException as _e:
        _outcomes.append(type(_e).__name__)
if _ended:
    _sys.exit("the graded program ended during the tests")
print(%r + _json.dumps(_outcomes))
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
    code = extract_code(solution_str)
    judged, graded = sandbox.run_python_pair(f"_TESTS, _SETUP = {tests!r}, {setup!r}\n" + _JUDGE,
                                             f"_CODE = {code!r}\n" + _SERVER,
                                             time_limit_s=float(extra.get("time_limit_s", 5.0)),
                                             memory_limit_mb=int(extra.get("memory_limit_mb", 512)),
                                             max_output_chars=20_000)
    violation = graded.violation or judged.violation
    info: dict[str, Any] = {"tests": len(tests), "passed": 0, "violation": violation}
    lines = judged.stdout.splitlines()
    if violation or not judged.ok or not lines or not lines[-1].startswith(_RESULTS):
        # a violation, the code failed before the tests ran, or it ended during them
        info["error"] = "\n".join(e for e in (graded.stderr, judged.stderr) if e)[-500:]
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
        fn = reasoning_gym_reward
    else:
        fn = code_reward if which == "code" else math_reward
    return {**fn(data_source, solution_str, ground_truth, extra_info), "reward": which}
