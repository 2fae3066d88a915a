"""Reward functions and environments by import path (veRL's signature, timeouts, failures), and the
built-in math and code rewards."""

import asyncio
import pickle
import threading
import time

import pytest
from ticks import ticking

from tiderl_jax.agents.env import Task
from tiderl_jax.data import answers, builtin, rewards
from tiderl_jax.agents.env import RewardFailed
from tiderl_jax.data.rewards import RewardFn
from tiderl_jax.import_path import ImportPathError


def _call(fn: RewardFn, solution="x", truth="1", source="src", extra=None):
    return asyncio.run(fn(source, solution, truth, extra))


VERL_FILE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A veRL-style GSM8K reward: strict '#### N' format."""
    m = re.search(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    if m is None:
        return 0.0
    return 1.0 if m.group(1).replace(",", "") == ground_truth else 0.1

def detailed(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": True, "source": data_source, "split": extra_info["split"]}

NOT_CALLABLE = 3
'''


def test_verl_reward_file_loads_by_path_and_dict_results_keep_their_info(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_FILE)
    fn = rewards.load_reward_fn(f"{path}:compute_score")
    assert _call(fn, "so 4 + 5 = 9\n#### 9", "9").score == 1.0
    assert _call(fn, "#### 1,000", "1000").score == 1.0
    assert _call(fn, "#### 8", "9").score == 0.1
    assert _call(fn, "nine", "9").score == 0.0
    detailed = _call(rewards.load_reward_fn(f"{path}:detailed"), source="gsm8k", extra={"split": "train"})
    assert detailed.score == 0.5 and detailed.info == {"acc": True, "source": "gsm8k", "split": "train"}


def test_reward_by_module_path_and_builtin_names():
    fn = rewards.load_reward_fn("tiderl_jax.data.builtin:math_reward")
    assert _call(fn, "the answer is \\boxed{42}", "42").score == 1.0
    assert _call(rewards.load_reward_fn("math"), "#### 7", "8").score == 0.0


def test_bad_import_paths_name_the_path_and_the_problem(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(VERL_FILE)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_xyz\n")
    cases = {
        "no_such_module_xyz:f": "module 'no_such_module_xyz' not found",
        f"{path}:missing": "has no 'missing'",
        f"{path}:NOT_CALLABLE": "not a callable",
        f"{tmp_path}/absent.py:f": "not found",
        f"{broken}:f": "raised ModuleNotFoundError",
        "no_colon_here": "is not 'module:name'",
    }
    for spec, problem in cases.items():
        with pytest.raises(ImportPathError) as e:
            rewards.load_reward_fn(spec)
        assert spec in str(e.value) and problem in str(e.value), str(e.value)


def test_async_reward_functions_are_awaited_and_time_out():
    async def good(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0.01)
        return {"score": 1.0 if solution_str == ground_truth else 0.0}

    async def hangs(*args):
        await asyncio.sleep(60)

    assert _call(RewardFn(good), "1", "1").score == 1.0
    t0 = time.monotonic()
    with pytest.raises(RewardFailed) as e:
        _call(RewardFn(hangs, name="hangs", timeout_s=0.2))
    assert e.value.reason == "reward_timeout" and "hangs" in str(e.value) and "0.2s" in str(e.value)
    assert time.monotonic() - t0 < 2


def test_a_hung_sync_function_does_not_block_the_event_loop_and_is_abandoned():
    def hangs(*args):
        time.sleep(3)
        return 1.0

    fn = RewardFn(hangs, name="sleepy", timeout_s=0.2, max_abandoned=2)

    async def go():
        async with ticking(0.01) as ticks:
            results = await asyncio.gather(*(fn("s", "x", "1", None) for _ in range(2)), return_exceptions=True)
        return ticks[0], results

    t0 = time.monotonic()
    ticks, results = asyncio.run(go())
    assert time.monotonic() - t0 < 2 and ticks >= 5  # the loop ran while both calls hung
    assert all(isinstance(r, RewardFailed) and r.reason == "reward_timeout" for r in results)
    assert fn.abandoned == 2
    with pytest.raises(RewardFailed, match="not called until they end"):  # max_abandoned running: fails at once
        _call(fn)


def test_only_abandoned_calls_still_running_count_against_the_function():
    gate = {}  # the event the next call waits on

    def slow(*args):
        gate["next"].wait()
        return 1.0

    def finish(event):  # lets the waiting calls end, and waits until their threads have
        event.set()
        for thread in threading.enumerate():
            if thread.name == "reward:slow":
                thread.join()

    fn = RewardFn(slow, name="slow", timeout_s=0.05, max_abandoned=2)
    for _ in range(10):  # slow calls over a run, each finishing after its timeout: 10 abandoned, none left running
        gate["next"] = threading.Event()
        with pytest.raises(RewardFailed, match="took longer"):
            _call(fn)
        assert fn.abandoned == 1
        finish(gate["next"])
        assert fn.abandoned == 0
    hung = gate["next"] = threading.Event()
    for _ in range(2):  # calls that truly hang: at max_abandoned running, the function is not called
        with pytest.raises(RewardFailed, match="took longer"):
            _call(fn)
    assert fn.abandoned == 2
    with pytest.raises(RewardFailed, match="not called until they end"):
        _call(fn)
    finish(hung)
    assert fn.abandoned == 0
    gate["next"] = threading.Event()
    with pytest.raises(RewardFailed, match="took longer"):  # once they ended, it is called again
        _call(fn)
    finish(gate["next"])


def test_raising_and_bad_results_fail_the_sample_with_a_reason():
    def boom(*args):
        raise KeyError("ground_truth")

    with pytest.raises(RewardFailed) as e:
        _call(RewardFn(boom, name="boom"))
    assert e.value.reason == "reward_error" and "boom raised KeyError" in str(e.value)
    for value, problem in [("high", "not a number"), ({"acc": 1}, "without a 'score'"), (float("nan"), "nan"),
                           (None, "not a number")]:
        with pytest.raises(RewardFailed, match=problem):
            _call(RewardFn(lambda *a, v=value: v, name="bad"))
    assert _call(RewardFn(lambda *a: True)).score == 1.0
    again = pickle.loads(pickle.dumps(e.value))  # as it comes back from an environment subprocess
    assert isinstance(again, RewardFailed) and again.reason == "reward_error" and str(again) == str(e.value)


ENV_FILE = '''
from tiderl_jax.agents.env import StepResult

class Guess:
    def __init__(self, reward_fn=None):
        self.reward_fn, self.turns = reward_fn, 0
    async def reset(self, task):
        self.task = task
        return "guess"
    async def step(self, action):
        self.turns += 1
        return StepResult(None if self.turns > 1 else "again", float(self.turns), self.turns > 1)

class SyncStep:
    async def reset(self, task):
        return ""
    def step(self, action):
        return None

class NoStep:
    async def reset(self, task):
        return ""

def not_a_class():
    pass
'''


def test_environment_classes_are_checked_at_load(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENV_FILE)
    cls = rewards.load_environment_class(f"{path}:Guess")
    env = cls()
    task = Task("t", "k", "p", "a")

    async def go():
        first = await env.reset(task)
        return first, await env.step("1"), await env.step("2")

    first, r1, r2 = asyncio.run(go())
    assert first == "guess" and not r1.done and r2.done and r2.reward == 2.0
    for name, problem in [("SyncStep", "step is not an async def"), ("NoStep", r"has no step\(\) method"),
                          ("not_a_class", "not a class"), ("Missing", "has no 'Missing'")]:
        with pytest.raises(ImportPathError, match=problem) as e:
            rewards.load_environment_class(f"{path}:{name}")
        assert str(path) in str(e.value)


@pytest.mark.parametrize("solution,truth,expected", [
    ("so the total is \\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000.0}", "1,000", 1.0),
    ("the answer: \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("first \\boxed{2} then \\boxed{\\frac{1}{2}}", "1/2", 1.0),  # the last box
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{x^{2}+\\sqrt{y_{1}}}", "x^{2} + \\sqrt{y_{1}}", 1.0),  # nested braces, spaces normalised
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),
    ("#### $1,234.50", "1234.5", 1.0),
    ("#### 72", "Natalia ... so 72 clips.\n#### 72", 1.0),  # a GSM8K-style ground truth
    ("I think 71, no, 72", "72", 1.0),  # the last number
    ("\\boxed{0.333}", "1/3", 0.0),  # exact comparison
    ("\\boxed{72}", "27", 0.0),
    ("\\boxed{\\text{Paris}}", "paris", 1.0),
    ("\\boxed{Paris.}", "Lyon", 0.0),
    ("no answer here", "5", 0.0),
    ("\\boxed{12", "12", 1.0),  # an unclosed box is not an answer; 12 is still the last number
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{-3}", "3", 0.0),
])
def test_math_reward_on_tricky_answers(solution, truth, expected):
    assert builtin.math_reward("gsm8k", solution, truth, None)["score"] == expected


def test_last_boxed_balances_nested_braces():
    assert answers.last_boxed("a \\boxed{\\frac{a}{b}} b \\fbox{ {x} }") == "{x}"
    assert answers.last_boxed("\\boxed{1} and \\boxed{") == "1"
    assert answers.last_boxed("none") is None


ADD = "def add(a, b):\n    return a + b\n"


def test_code_reward_passing_and_failing_solutions():
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
    good = builtin.code_reward("mbpp", f"Here:\n```python\n{ADD}```", tests, None)
    assert good["score"] == 1.0 and good["passed"] == 3 and good["violation"] is None
    only_strings = "```python\ndef add(a, b):\n    return a + b if isinstance(a, str) else a * b\n```"
    wrong = builtin.code_reward("mbpp", only_strings, tests, None)
    assert wrong["score"] == pytest.approx(1 / 3) and wrong["failures"] == ["AssertionError"] * 2
    broken = builtin.code_reward("mbpp", "```python\ndef add(a, b) return\n```", tests, None)
    assert broken["score"] == 0.0 and "SyntaxError" in broken["error"]


def test_code_reward_string_tests_humaneval_check_and_sandbox_limits():
    src = "import math\nassert add(2, 2) == 4\nassert add(math.floor(1.5), 1) == 2\n"
    assert builtin.code_reward("x", ADD, src, None)["score"] == 1.0  # the import is setup, two asserts
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
    assert builtin.code_reward("humaneval", ADD, check, {"entry_point": "add"})["score"] == 1.0
    with pytest.raises(ValueError, match="entry_point"):
        builtin.code_reward("humaneval", ADD, check, {})
    loop = builtin.code_reward("x", "def add(a, b):\n    while True: pass\n", ["assert add(1, 1) == 2"],
                               {"time_limit_s": 0.5})
    assert loop["score"] == 0.0 and loop["violation"] == "timeout"
    net = builtin.code_reward("x", "import socket\nsocket.socket()\n" + ADD, ["assert add(1, 1) == 2"], None)
    assert net["score"] == 0.0 and net["violation"] == "network"


# Graded code that tries to write or sway its own result, not solve the task: each must score 0. The
# tests below never pass for `add` returning 0; FORGED is the results line of three passed tests.
FORGED = "__tiderl_tests__ [true, true, true]"
FORGING = {
    "atexit": f"import atexit\natexit.register(print, {FORGED!r})\ndef add(a, b):\n    return 0\n",
    "os._exit": f"import os\nprint({FORGED!r}, flush=True)\nos._exit(0)\n",
    "sys.exit": f"import sys\nprint({FORGED!r})\nsys.exit(0)\n",
    "printed": f"def add(a, b):\n    print({FORGED!r})\n    return 0\n",
    "json.dumps": "import json\njson.dumps = lambda *a, **k: '[true, true, true]'\ndef add(a, b):\n    return 0\n",
    "__eq__": "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
              "def add(a, b):\n    return Anything()\n",
    "int __eq__": "class Three(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
                  "def add(a, b):\n    return Three(0)\n",
}
SUMS = ["assert add(1, 2) == 3", "assert add(-1, 3) == 2", "assert add(2, 5) == 7"]


@pytest.mark.parametrize("attack", sorted(FORGING))
def test_code_reward_cannot_be_forged_by_the_graded_code(attack):
    assert builtin.code_reward("mbpp", FORGING[attack], SUMS, None)["score"] == 0.0
    assert builtin.code_reward("mbpp", f"```python\n{FORGING[attack]}```", SUMS, None)["score"] == 0.0
    assert builtin.code_reward("mbpp", ADD, SUMS, None)["score"] == 1.0  # honest code, same tests
    partial = builtin.code_reward("mbpp", "def add(a, b):\n    return a + b if a > 0 else 0\n", SUMS, None)
    assert partial["score"] == pytest.approx(2 / 3) and partial["failures"] == ["AssertionError"]


def test_code_reward_graded_code_cannot_read_the_tests():
    reads = ("import glob, os, re\nfound = ''\n"  # every file in its directory and in the sandboxes beside it
             "for path in glob.glob('*') + glob.glob(os.path.join('..', 'tiderl_sandbox_*', '*')):\n"
             "    found += open(path).read()\n"
             "SUMS = re.findall(r'add\\((\\d+), (\\d+)\\) == (\\d+)', found)\n"
             "ANSWERS = {(int(a), int(b)): int(c) for a, b, c in SUMS}\n"
             "def add(a, b):\n    return ANSWERS.get((a, b), 0)\n")
    tests = ["assert add(1234, 4321) == 5555", "assert add(2024, 6) == 2030"]  # numbers no other test uses
    assert builtin.code_reward("mbpp", reads, tests, None)["score"] == 0.0


def test_code_reward_cannot_redefine_the_builtins_the_tests_use_around_the_graded_call():
    tests = ["assert set(pair(1)) == set([1, 2])", "assert abs(half(3) - 1.5) < 1e-9"]
    honest = "def pair(x):\n    return [x + 1, x]\ndef half(x):\n    return x / 2\n"
    assert builtin.code_reward("mbpp", honest, tests, None)["score"] == 1.0
    forged = ("def pair(x):\n    return []\ndef half(x):\n    return 0\n"
              "def set(x):\n    return 1\ndef abs(x):\n    return 0\n")
    assert builtin.code_reward("mbpp", forged, tests, None)["score"] == 0.0
    # a function under test named like a built-in is the program's (MBPP 116 asks for a `sum`)
    own_sum = "def sum(a, b):\n    return a * b\n"
    sums = ["assert sum(2, 3) == 6", "assert sum(1, 1) == 1"]
    assert builtin.code_reward("mbpp", own_sum, sums, None)["score"] == 1.0


def test_code_reward_reaches_the_programs_objects_by_reference():
    code = ("import math\nclass Node:\n    def __init__(self, data):\n        self.data, self.left = data, None\n"
            "def depth(n):\n    return 0 if n is None else 1 + depth(n.left)\n"
            "def chain(n):\n    root = Node(0)\n    for i in range(1, n):\n        root = Node(i)\n"
            "        root.left = Node(i - 1)\n    return root\n"
            "def evens(n):\n    return (i for i in range(0, n, 2))\nLIMIT = (3, 4)\n")
    setup = "root = Node(1)\nroot.left = Node(2)\nroot.left.left = Node(3)\n"  # MBPP 357's kind: the code's class
    tests = ["assert depth(root) == 3", "assert root.left.data == 2", "assert list(evens(5)) == [0, 2, 4]",
             "assert chain(3).data == 2", "assert LIMIT == (3, 4) and math.floor(2.5) == 2", "assert chain(2)",
             "assert depth(Node(5)) == 1"]
    r = builtin.code_reward("mbpp", code, tests, {"test_setup_code": setup})
    assert r["passed"] == 6 and r["failures"] == ["TypeError"]  # an object's truth is not the program's to give


def test_code_reward_under_reward_fn_fails_bad_tests_with_a_reason():
    fn = rewards.load_reward_fn("code")
    assert _call(fn, ADD, ["assert add(1, 2) == 3"]).score == 1.0
    with pytest.raises(RewardFailed, match="non-empty list of strings"):
        _call(fn, ADD, [])
