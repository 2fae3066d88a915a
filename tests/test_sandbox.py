"""The Python sandbox (limits, refused operations) and the built-in `python` task that runs in it."""

import asyncio
import os
import socket

import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.sandbox import run_python, run_python_async, run_python_pair
from tiderl_jax.model import chat


def test_runs_a_program_with_stdin_and_reports_errors():
    r = run_python("import sys\nprint(sys.stdin.read().upper())", stdin="abc")
    assert r.ok and r.stdout == "ABC\n" and r.stderr == "" and r.violation is None
    r = run_python("def g():\n    return 1 / 0\ng()")
    assert r.exit_code == 1 and r.violation is None
    assert 'File "main.py", line 2, in g' in r.stderr and r.stderr.endswith("ZeroDivisionError: division by zero")
    assert "SyntaxError" in run_python("def (:").stderr
    assert asyncio.run(run_python_async("print(6 * 7)")).stdout == "42\n"


def test_wall_clock_timeout_kills_the_program():
    r = run_python("while True:\n    pass", time_limit_s=0.5)
    assert r.violation == "timeout" and r.exit_code < 0 and r.wall_s < 2.0
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", time_limit_s=0.5)
    assert r.violation == "timeout" and r.wall_s < 2.0  # closing its output does not end the wait


def test_memory_and_output_limits():
    for bomb in ["x = bytearray(10 ** 9)", "x = [0] * 10 ** 9"]:
        r = run_python(bomb, memory_limit_mb=128)
        assert r.violation == "memory_limit" and "sandbox violation: memory_limit" in r.stderr
    r = run_python("while True:\n    print('x' * 100)", max_output_chars=300)
    assert r.violation == "output_limit" and r.stdout == "x" * 100 + "\n" + "x" * 100 + "\n" + "x" * 98


def test_network_is_refused():
    with socket.socket() as server:  # a listener the program could otherwise reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))\nprint('connected')")
    assert r.violation == "network" and r.stdout == ""
    # asyncio's loop makes a local socket pair, which is allowed
    assert run_python("import asyncio\nasync def m():\n    return 3\nprint(asyncio.run(m()))").stdout == "3\n"


def test_writes_outside_the_sandbox_are_refused(tmp_path):
    target = tmp_path / "escape.txt"
    for code in [f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
                 f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w')",
                 f"try:\n    open({str(target)!r}, 'w')\nexcept BaseException:\n    print('caught')"]:
        r = run_python(code)
        assert r.violation == "filesystem" and r.stdout == "", code
        assert not target.exists()
    (tmp_path / "keep.txt").write_text("x")
    r = run_python(f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})")
    assert r.violation == "filesystem" and (tmp_path / "keep.txt").exists()


def test_writes_inside_the_sandbox_work_and_vanish():
    r = run_python("import os, pathlib, tempfile\n"
                   "pathlib.Path('a.txt').write_text('hi')\nos.mkdir('d')\nos.rename('a.txt', 'd/a.txt')\n"
                   "with tempfile.TemporaryDirectory() as t:\n    open(os.path.join(t, 'b'), 'w').write('x')\n"
                   "print(open('d/a.txt').read(), os.getcwd())")
    assert r.ok, r.stderr
    text, cwd = r.stdout.split()
    assert text == "hi" and not os.path.exists(cwd)


@pytest.mark.parametrize("code,kind", [
    ("import subprocess\nsubprocess.run(['true'])", "process"),
    ("import os\nos.system('true')", "process"),
    ("import multiprocessing as mp\nmp.get_context('spawn').Process(target=print).start()", "process"),
    ("import os\nos.fork()", "process"),
    ("import os\nos.kill(os.getppid(), 0)", "process"),
    ("import os\nopen(f'/proc/{os.getppid()}/environ').read()", "process"),  # another process's entries
    ("import os\nopen(f'../../proc/{os.getppid()}/mem', 'rb')", "process"),
    ("import ctypes", "native"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "limits"),
])
def test_processes_native_code_and_limits_are_refused(code, kind):
    assert run_python(code).violation == kind


def test_own_proc_entries_stay_readable():
    r = run_python("import os\nprint(open('/proc/self/status').read().split()[0], os.readlink('/proc/self/fd/1')[:4])")
    assert r.ok and r.stdout == "Name: pipe\n", r.stderr


PEER = "import os\nfd = int(os.environ['SANDBOX_PEER_FD'])\n"


def test_a_pair_of_programs_talks_over_its_socket_alone():
    code = PEER + "os.write(fd, b'ping')\nprint(os.read(fd, 100).decode())"
    peer = PEER + ("import sys\nprint('peer output', flush=True)\nprint('peer error', file=sys.stderr, flush=True)\n"
                   "os.write(fd, os.read(fd, 100).upper())\nos.read(fd, 1)")  # serves until the first ends
    first, second = run_python_pair(code, peer)
    assert first.ok and first.stdout == "PING\n" and first.violation is None
    assert second.stdout == "peer output\n" and second.stderr == "peer error" and second.violation is None
    # the peer cannot write in the first's directory: it tries once the first has written its file
    code = PEER + "open('out.txt', 'w').write('mine')\nos.write(fd, b'.')\nos.read(fd, 1)\n" \
                  "print(open('out.txt').read())"
    spy = PEER + "import glob\nos.read(fd, 1)\nfor p in glob.glob('../tiderl_sandbox_*/out.txt'):\n    open(p, 'w')\n"
    first, second = run_python_pair(code, spy)
    assert first.stdout == "mine\n" and second.violation == "filesystem"
    # a peer that ends is seen by the first at once (end of file); one that hangs ends the run at the time limit
    first, _ = run_python_pair(PEER + "print(os.read(fd, 1))", "raise SystemExit(3)")
    assert first.ok and first.stdout == "b''\n"
    first, second = run_python_pair(PEER + "os.read(fd, 1)", "while True:\n    pass", time_limit_s=0.5)
    assert first.violation == "timeout" and second.violation == "timeout"
    _, second = run_python_pair(PEER + "os.read(fd, 1)", "while True:\n    print('x' * 100)", max_output_chars=300)
    assert second.violation == "output_limit"


def _turns(task):
    """The assistant turns of the task's demonstration, as the model would write them."""
    header = len(chat.GENERATION_PROMPT)
    return [chat.render([m])[header:] for m in T.demonstration(task) if m.role == "assistant"]


def _run_env(task, turns):
    env = T.make_env(task)

    async def go():
        await env.reset(task)
        return [await env.step(text) for text in turns]
    return env, asyncio.run(go())


@pytest.mark.parametrize("split", T.SPLITS)
def test_python_demonstrations_earn_reward_one(split):
    for i in range(4):
        task = T.make_task("python", i, split)
        demo = T.demonstration(task)
        env, results = _run_env(task, _turns(task))
        assert [r.done for r in results] == [False, True] and results[-1].reward == 1.0
        assert results[0].observation == demo[3].content  # the demonstration shows the real tool output
        assert len(task.prompt) < 300 and not env.violations


def test_wrong_solutions_earn_less_than_one():
    task = T.make_task("python", 0)
    turns = _turns(task)
    for answer in ["```python\ndef f(*args):\n    return None\n```", "I do not know", "def f(xs):\n    while True: pass"]:
        env, results = _run_env(task, turns[:-1] + [answer])
        assert results[-1].done and results[-1].reward < 1.0
    assert env.violations == {"timeout": 1}
    # partial credit: the fraction of hidden tests passed
    tests = task.data["tests"]
    right = {repr(args): out for args, out in tests[:2]}
    partial = f"```python\ndef f(*args):\n    return {right!r}.get(repr(list(args)))\n```"
    assert _run_env(task, turns[:-1] + [partial])[1][-1].reward == pytest.approx(2 / len(tests))


def test_malformed_calls_and_violations_are_observations():
    task = T.make_task("python", 1)
    call = '<tool_call>{"name": "run", "arguments": {"code": %s}}</tool_call>'
    env, results = _run_env(task, [
        '<tool_call>{"name": "run", "arguments": {"code": }</tool_call>',  # malformed JSON
        call % '""',  # missing code
        call % '"import socket; socket.socket()"',
        call % '"open(\'/tmp/x\', \'w\')"',
        call % '"print(1 / 0)"',
        *_turns(task),  # the episode goes on and still succeeds
    ])
    assert [r.done for r in results] == [False] * 6 + [True] and results[-1].reward == 1.0
    assert results[0].info["malformed"] and "not valid JSON" in results[0].observation
    assert results[1].observation == 'error: run needs {"code": "<python source>"}'
    assert results[2].observation == "error: sandbox violation: network"
    assert results[3].observation == "error: sandbox violation: filesystem"
    assert "ZeroDivisionError" in results[4].observation
    assert env.malformed_turns == 1 and env.violations == {"network": 1, "filesystem": 1}


def test_python_generator_is_seeded_and_splits_differ():
    assert T.make_task("python", 3) == T.make_task("python", 3)
    assert T.make_task("python", 3, "heldout", seed=2) == T.make_task("python", 3, "heldout", seed=2)
    train = [T.make_task("python", i).prompt for i in range(8)]
    heldout = [T.make_task("python", i, "heldout").prompt for i in range(8)]
    other_seed = [T.make_task("python", i, seed=1).prompt for i in range(8)]
    assert train != heldout and train != other_seed and len(set(train)) > 4
    assert T.make_task("python", 0, "heldout").is_eval and not T.make_task("python", 0).is_eval
