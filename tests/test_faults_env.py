"""Environments in subprocesses: snapshots, crash and timeout detection, and recovery by restore and
rewind. Subprocesses are SIGKILLed at random turns of real built-in tasks; every episode must end
with the same observations and reward as an unfaulted run."""

import asyncio
import functools
import os
import random
import signal
import threading

import fault_envs
import pytest

from tiderl_jax.agents import tasks as T
from tiderl_jax.agents.env import LatencyModel, Task
from tiderl_jax.agents.env import EnvRewound
from tiderl_jax.faults.env_recovery import CheckpointConfig, CheckpointingEnv
from tiderl_jax.faults.env_worker import EnvError, EnvWorker, restore_env, snapshot_env
from tiderl_jax.faults.errors import (
    SnapshotError,
    TaskDropped,
    WorkerCrashed,
    WorkerTimeout,
)
from tiderl_jax.model import chat
from tiderl_jax.policies import belayer


def _script(task):
    """A scripted 'model': a malformed call, an answer before any tool (sent back), an unknown tool,
    then the demonstration's turns (5 turns for calculator, 6 for lookup)."""
    demo = [chat.render([m])[len(f"{chat.TURN_START}assistant\n"):]
            for m in T.demonstration(task) if m.role == "assistant"]
    return (["<tool_call>{not json</tool_call>", "It is 7.",
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'] + demo)


async def _episode(env, task, turns, kill=None, before_step=None):
    """Runs the scripted turns, following rewinds. Returns (observations, reward, rewinds)."""
    history = [await env.reset(task)]
    rewinds = []
    turn = 0
    while True:
        if before_step is not None:
            await before_step(turn)
        try:
            result = await env.step(turns[turn])
        except EnvRewound as rw:
            rewinds.append(rw.turn)
            assert rw.turn <= turn and rw.observation == history[rw.turn]
            history, turn = history[:rw.turn + 1], rw.turn
            continue
        turn += 1
        history.append(result.observation)
        if result.done:
            return history, result.reward, rewinds


def _unfaulted(task, make_env=T.make_env, turns=None):
    env = make_env(task)
    return asyncio.run(_episode(env, task, turns or _script(task)))[:2]


# ----------------------------------------------------------------------------------- snapshots in process


@pytest.mark.parametrize("kind", ["calculator", "lookup", "python", "visual"])
def test_snapshot_restore_of_built_in_environments(kind):
    task = T.make_task(kind, 2)

    async def go():
        env = T.make_env(task, latency=LatencyModel(0.0), seed=5)
        await env.reset(task)
        await env.step("<tool_call>{bad</tool_call>")
        await env.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
        state = snapshot_env(env)
        fresh = T.make_env(task, seed=99)
        restore_env(fresh, state)
        assert (fresh.task, fresh.tool_calls, fresh.malformed_turns) == (task, 1, 1)
        assert fresh.rng.getstate() == env.rng.getstate()
        assert set(fresh.tools) == set(env.tools)  # code rebuilt by make_env, not pickled
        answer = "I give up"
        a, b = await env.step(answer), await fresh.step(answer)
        assert (a.done, a.reward, a.observation) == (b.done, b.reward, b.observation)
    asyncio.run(go())


def test_unpicklable_state_is_named():
    env = fault_envs.make_locked(Task("t", "count", "p", "", {}))
    with pytest.raises(SnapshotError, match="'guard'.*lock.*snapshot_state"):
        snapshot_env(env)


# ----------------------------------------------------------------------------------- EnvWorker


def test_worker_matches_in_process_env_and_reports_env_errors():
    task = Task("count/1", "count", "p", "", {"steps": 3})
    want = _unfaulted(task, fault_envs.make_counting, ["a", "b", "c"])

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=10)
        try:
            got = (await _episode(w, task, ["a", "b", "c"]))[:2]
            assert got == want
            await w.reset(task)
            with pytest.raises(EnvError, match="(?s)KeyError: .no such thing.*in the subprocess"):
                await w.step("raise")
            assert w.alive()  # an environment error is not a crash
        finally:
            w.close()
    asyncio.run(go())


def test_worker_rejects_bad_arguments():
    with pytest.raises(ValueError, match="picklable"):
        EnvWorker(lambda task: None)
    with pytest.raises(ValueError, match="'fork' is not one of"):
        EnvWorker(start_method="fork")
    with pytest.raises(ValueError, match="CheckpointConfig.mode='sometimes'"):
        CheckpointConfig(mode="sometimes")


def test_worker_crash_and_timeout_are_typed_infrastructure_failures(tmp_path):
    task = Task("count/2", "count", "p", "", {"steps": 5, "hang_marker": str(tmp_path / "hang"), "hang_at": 2})

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=1.0)
        try:
            await w.reset(task)
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(WorkerCrashed, match="exit code -9 during step") as e:
                await w.step("a")
            assert e.value.kind == belayer.SANDBOX_CRASH
            w.restart()
            await w.reset(task)
            await w.step("a")
            with pytest.raises(WorkerTimeout, match="longer than 1.0s") as e:
                await w.step("b")  # step 2 hangs
            assert e.value.kind == belayer.TIMEOUT and not w.alive()
        finally:
            w.close()
    asyncio.run(go())


# ----------------------------------------------------------------------------------- CheckpointingEnv


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # the episode ended first
        pass


def _faulted(task, make_env, config, seed, turns=None, during=False):
    """One episode with SIGKILLs at random turns (before the step, or while it runs)."""
    turns = turns or _script(task)
    rng = random.Random(seed)
    kill_at = sorted(rng.sample(range(len(turns)), 2))
    env = CheckpointingEnv(make_env, config)
    fired = set()

    async def before_step(turn):
        if turn in kill_at and turn not in fired:
            fired.add(turn)
            if during:  # lands in the step (its tool latency), or in the snapshot after it
                threading.Timer(rng.uniform(0.0, 0.04), _kill, (env.worker.pid,)).start()
            else:  # the first kill may catch a snapshot in flight; the second lets it finish
                if turn == kill_at[1]:
                    await env.settle()
                os.kill(env.worker.pid, signal.SIGKILL)
    try:
        history, reward, rewinds = asyncio.run(_episode(env, task, turns, before_step=before_step))
        return history, reward, rewinds, env.stats
    finally:
        env.close()


@pytest.mark.parametrize("kind", ["calculator", "lookup"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_at_random_turns_restores_and_matches_unfaulted(kind, seed):
    task = T.make_task(kind, seed)
    want = _unfaulted(task)
    history, reward, rewinds, stats = _faulted(task, T.make_env, CheckpointConfig(mode="always"), seed)
    assert (history, reward) == want and reward == 1.0
    assert stats["failures"] == 2 == len(rewinds) == stats["restores"] + stats["redos"]
    assert stats["restores"] >= 1 and stats["checkpoints"] >= 1  # the second kill (turn >= 1) restores


@pytest.mark.parametrize("kind", ["calculator", "lookup"])
def test_killed_during_steps_with_latency(kind):
    make = functools.partial(T.make_env, latency=LatencyModel(median_s=0.02, sigma=0.5), seed=3)
    task = T.make_task(kind, 7)
    want = _unfaulted(task, make)
    for seed in range(3):
        history, reward, rewinds, stats = _faulted(task, make, CheckpointConfig(mode="always"), seed,
                                                   during=True)
        assert (history, reward) == want
        assert stats["failures"] == len(rewinds) <= 2


def test_state_is_restored_not_replayed():
    # CountingEnv's observations show its step count and RNG draws: a restore that lost either
    # (or a redo that skipped turns) would change them.
    task = Task("count/3", "count", "p", "", {"steps": 6})
    turns = ["a", "b", "c", "d", "e", "f"]
    want = _unfaulted(task, fault_envs.make_counting, turns)
    history, reward, _, stats = _faulted(task, fault_envs.make_counting,
                                         CheckpointConfig(mode="always"), 4, turns)
    assert (history, reward) == want and reward == 6.0
    assert stats["restores"] >= 1


def test_without_checkpoints_episodes_redo_from_turn_zero():
    task = T.make_task("lookup", 4)
    want = _unfaulted(task)
    history, reward, rewinds, stats = _faulted(task, T.make_env, CheckpointConfig(mode="never"), 5)
    assert (history, reward) == want
    assert rewinds == [0, 0] and stats["redos"] == 2 and stats["checkpoints"] == 0


def test_timeout_is_recovered(tmp_path):
    task = Task("count/4", "count", "p", "", {"steps": 4, "hang_marker": str(tmp_path / "hang"), "hang_at": 3})
    turns = ["a", "b", "c", "d"]
    plain = Task("count/4", "count", "p", "", {"steps": 4})
    want = _unfaulted(plain, fault_envs.make_counting, turns)
    env = CheckpointingEnv(fault_envs.make_counting, CheckpointConfig(mode="always", step_timeout_s=1.0))
    try:
        history, reward, rewinds = asyncio.run(_episode(env, task, turns))
    finally:
        env.close()
    assert (history, reward) == want and rewinds == [2]
    assert env.failures[0][1] == belayer.TIMEOUT


def test_retry_budget_drops_the_task_with_a_reason():
    task = T.make_task("calculator", 1)
    env = CheckpointingEnv(T.make_env, CheckpointConfig(mode="always", max_retries=1))

    async def kill_every_time(turn):
        if turn >= 1:
            os.kill(env.worker.pid, signal.SIGKILL)
    try:
        with pytest.raises(TaskDropped, match="retry budget of 1 exhausted after 1 retries") as e:
            asyncio.run(_episode(env, task, _script(task), before_step=kill_every_time))
    finally:
        env.close()
    assert e.value.kind == belayer.SANDBOX_CRASH and env.stats["failures"] == 2


def test_belayer_rule_decides_the_checkpoints():
    task = Task("count/5", "count", "p", "", {"steps": 5})
    turns = list("abcde")

    def run(config, generate_s):
        env = CheckpointingEnv(fault_envs.make_counting, config)

        async def generating(turn):  # the model's generation, which a snapshot overlaps
            await asyncio.sleep(generate_s)
        try:
            asyncio.run(_episode(env, task, turns, before_step=generating))
        finally:
            env.close()
        return env.stats
    # no failure expected and a visible cost: never checkpoint
    never = run(CheckpointConfig(p_fail=0.0, checkpoint_s_guess=10.0), 0.0)
    assert never["checkpoints"] == 0
    # a sure failure and a snapshot far shorter than the generation it overlaps: checkpoint at every
    # boundary (4 boundaries before the last step, which ends the episode), none of it waited for
    always = run(CheckpointConfig(p_fail=1.0, checkpoint_s_guess=0.0), 0.3)
    assert always["checkpoints"] == 4 and always["checkpoint_wait_s"] < always["checkpoint_s"] + 0.3


def test_env_pool_reuses_live_processes_and_drops_dead_ones():
    from tiderl_jax.faults.env_recovery import EnvPool
    pool = EnvPool(T.TaskEnvFactory(LatencyModel(0.0, 0.0)))
    task_a, task_b = T.make_task("calculator", 0), T.make_task("lookup", 1)

    async def episode(env, task):
        await env.reset(task)
        return await env.step("I do not know")

    first = pool(task_a)
    result = asyncio.run(episode(first, task_a))
    pid = first.worker.pid
    first.close()
    first.close()  # a second close gives nothing back twice
    second = pool(task_b)  # the same process, a fresh environment for the new task
    assert second.worker.pid == pid and pool.created == 1
    again = asyncio.run(episode(second, task_b))
    assert "no tool call" in result.observation and "no tool call" in again.observation
    os.kill(pid, signal.SIGKILL)
    second.worker._proc.join(5)
    second.close()  # dead: closed, not returned
    third = pool(task_a)
    assert pool.created == 2 and third.worker.pid != pid
    third.close()
    pool.close()


def test_env_pool_prestart_and_pushed_snapshots():
    from tiderl_jax.faults.env_recovery import EnvPool
    pool = EnvPool(T.TaskEnvFactory(LatencyModel(0.0, 0.0)), CheckpointConfig(mode="always"))
    pool.prestart(2)
    assert pool.created == 2 and len(pool._free) == 2
    env = pool(T.make_task("calculator", 0))
    assert pool.created == 2  # a started process, no new one
    task = T.make_task("calculator", 0)

    async def go():
        await env.reset(task)
        await env.step("<tool_call>{not json</tool_call>")
        assert env.env.snapshot is None  # asked for; the child pushes it after its reply
        await env.env.settle()  # a ping drains what the child pushed before it
        assert env.env.snapshot is not None and env.env.snapshot.turn == 1
        await env.step("It is 7.")
        await env.env.settle()
        assert env.env.snapshot.turn == 2 and env.env.stats["checkpoints"] == 2
    asyncio.run(go())
    env.close()
    pool.close()


# ----------------------------------------------------------------------------------- the worker's transport


def test_frame_reader_joins_frames_split_across_reads():
    import pickle

    from tiderl_jax.faults.env_worker import _frame, _FrameReader
    messages = [("ok", 1, "short"), ("snapshot", 2, (b"x" * 100_000, 0.1, 5.0)), ("ok", 3, None), ("error", 4, "e")]
    stream = b"".join(_frame(m) for m in messages)
    for cut in (1, 3, 7, 8, 9, 50, 4096, 65536, len(stream)):  # every read size, headers split too
        reader, got = _FrameReader(), []
        for i in range(0, len(stream), cut):
            got += [pickle.loads(f) for f in reader.feed(stream[i:i + cut])]
        assert got == messages, cut
    reader = _FrameReader()  # several frames and a partial one in a read
    first = reader.feed(stream[:len(_frame(messages[0])) + 10])
    assert [pickle.loads(f) for f in first] == messages[:1]
    assert [pickle.loads(f) for f in reader.feed(stream[len(_frame(messages[0])) + 10:])] == messages[1:]


def test_worker_carries_payloads_larger_than_the_socket_buffer():
    # a restore and a snapshot of 8 MiB each way: the request is finished by the loop's writer, the
    # reply joined from many reads
    import pickle
    task = Task("count/6", "count", "p", "", {"steps": 3})
    blob = os.urandom(8 << 20)

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=30)
        try:
            await w.reset(task)
            state = pickle.loads(await w.snapshot_bytes())[1]
            state["blob"] = pickle.dumps(blob)
            await w.restore(task, pickle.dumps(("attrs", state)))
            back = pickle.loads(await w.snapshot_bytes())[1]
            assert pickle.loads(back["blob"]) == blob and back["count"] == state["count"]
            assert (await w.step("a")).observation.startswith("step 1 after 'a'")
        finally:
            w.close()
    asyncio.run(go())


def test_worker_ignores_replies_to_other_calls():
    import pickle
    task = Task("count/7", "count", "p", "", {"steps": 3})
    seen = []

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=10)
        w.on_snapshot = lambda *a: seen.append(a)
        try:
            await w.reset(task)
            call = asyncio.ensure_future(w.step("a"))
            await asyncio.sleep(0)  # the step is sent and waits for its reply
            stale = w.last_seq - 1  # e.g. the answer to a call abandoned at its timeout
            w._dispatch([memoryview(pickle.dumps(("ok", stale, "stale"))),
                         memoryview(pickle.dumps(("error", stale + 2, ("KeyError", False, "x", "tb"))))])
            assert (await call).observation.startswith("step 1 after 'a'")
            # a snapshot pushed while no call waits is handed over when the next call starts
            await w.step("b", snapshot=True)
            await asyncio.sleep(0.5)
            assert seen == []
            await w.ping()
            assert len(seen) == 1 and seen[0][:2] == (w.last_seq - 1, True)
        finally:
            w.close()
    asyncio.run(go())


def test_worker_across_event_loops_and_crash_between_calls():
    task = Task("count/8", "count", "p", "", {"steps": 5})
    w = EnvWorker(fault_envs.make_counting, timeout_s=10)
    try:
        seen = []
        w.on_snapshot = lambda *a: seen.append(a)
        asyncio.run(w.reset(task))
        asyncio.run(w.step("a", snapshot=True))  # its snapshot is pushed after this loop closed
        assert asyncio.run(w.step("b")).observation.startswith("step 2 after 'b'")  # a new loop
        assert len(seen) == 1 and seen[0][1]
        os.kill(w.pid, signal.SIGKILL)
        w._proc.join(5)
        with pytest.raises(WorkerCrashed, match="exit code -9 during step"):
            asyncio.run(w.step("c"))
        with pytest.raises(WorkerCrashed):  # and every call after it, until a restart
            asyncio.run(w.ping())
        w.restart()
        asyncio.run(w.reset(task))
        assert asyncio.run(w.step("a")).observation.startswith("step 1 after 'a'")
    finally:
        w.close()


def test_cancelled_call_kills_the_worker(tmp_path):
    task = Task("count/9", "count", "p", "", {"steps": 5, "hang_marker": str(tmp_path / "hang"), "hang_at": 1})

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=30)
        try:
            await w.reset(task)
            call = asyncio.ensure_future(w.step("a"))  # hangs
            await asyncio.sleep(0.3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert not w.alive()
            with pytest.raises(WorkerCrashed):
                await w.step("b")
        finally:
            w.close()
    asyncio.run(go())


def test_an_error_in_on_snapshot_reaches_the_call_and_the_worker_goes_on():
    task = Task("count/10", "count", "p", "", {"steps": 5})

    def broken(*args):
        raise ValueError("on_snapshot failed")

    async def go():
        w = EnvWorker(fault_envs.make_counting, timeout_s=10)
        try:
            await w.reset(task)
            w.on_snapshot = broken
            await w.step("a", snapshot=True)
            with pytest.raises(ValueError, match="on_snapshot failed"):
                await w.ping()  # handed over during it, or as it starts
            w.on_snapshot = None
            assert (await w.step("b")).observation.startswith("step 2 after 'b'")
        finally:
            w.close()
    asyncio.run(go())
