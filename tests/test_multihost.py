"""Multi-host runs on JAX's multi-controller runtime, as several processes on this machine (launch/local_cluster.py:
the 8 faked devices split between them, gloo on 127.0.0.1): the control messages (their waits off the event
loop, in call order), process 0's decisions applied everywhere, a dead process named, the main job on 2 and 4
processes training exactly as on one (sync and tiderl), and a process killed mid-run with the same command
resuming from the checkpoint the processes wrote."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from conftest import ROOT
from ticks import ticking

from tiderl_jax import distributed
from tiderl_jax.model.config import ConfigError
from tiderl_jax.runtime.controller_config import ControllerConfig
from tiderl_jax.runtime.multihost import local_config
from tiderl_jax.sim import clock

# the main job's smallest RL run that divides over 1, 2 and 4 processes; eta = 0 makes each update's groups
# those admitted for its version (with eta >= 1 they are the first to arrive: timing, even on one process)
# (dynamic sampling off: at this size nearly every group has one reward)
RUN = ["--config.controller.filter_groups=false", "--config.trainer.warmup_steps=0", "--config.eval.tasks=2",
       "--config.eval.sampled=false", "--config.eval.every=0", "--config.controller.groups_per_step=4",
       "--config.controller.group_size=2", "--config.controller.max_concurrent=8", "--config.controller.eta=0",
       "--config.controller.device_group_size=1", "--config.controller.rollout_groups=4",
       "--config.controller.train_groups=4", "--config.rollout.max_turns=2", "--config.rollout.max_new_tokens=96",
       "--config.latency.median_s=0.01", "--config.latency.sigma=0.0",
       # every update has a gradient, whatever the rewards of its 4 groups of 2 (all equal: no GRPO signal)
       "--config.loss.entropy_coef=0.001"]
# what one update computed: equal to float tolerance whatever the process count
COMPARED = ("loss", "entropy", "grad_norm", "reward", "tokens", "sequences", "approx_kl")


def _cluster(n: int, *command, timeout: float = 120, extra=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/local_cluster.py", "-n", str(n), *extra, "--", *command],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _results(out: str) -> dict[int, dict]:
    return {int(line[1:line.index("]")]): json.loads(line.split("RESULT ", 1)[1])
            for line in out.splitlines() if "] RESULT " in line}


# ---------------------------------------------------------------------- pieces, one process


def test_a_config_is_split_into_equal_shares_and_what_does_not_divide_is_named():
    cfg = ControllerConfig(mode="tiderl", groups_per_step=8, group_size=2, max_concurrent=32, device_group_size=1,
                           rollout_groups=4, ref_groups=0, train_groups=4)
    share = local_config(cfg, 2)
    assert (share.groups_per_step, share.max_concurrent, share.rollout_groups, share.train_groups) == (4, 16, 2, 2)
    assert local_config(cfg, 1) is cfg
    with pytest.raises(ConfigError, match=r"controller.rollout_groups=4 does not split evenly over 8"):
        local_config(ControllerConfig(**{**vars(cfg), "groups_per_step": 8, "max_concurrent": 64}), 8)
    borrowing = local_config(ControllerConfig(**{**vars(cfg), "bidirl": True, "rollout_replicas": "group"}), 2)
    assert borrowing.bidirl and borrowing.rollout_groups == 2  # BiDiRL across processes: every process lends
    # sync has no device groups: only the work is split
    sync = local_config(ControllerConfig(mode="sync", groups_per_step=4, group_size=2, max_concurrent=8), 4)
    assert (sync.groups_per_step, sync.max_concurrent) == (1, 2)


def test_shares_of_a_list_merge_back_in_order():
    items = list(range(11))
    for count in (1, 2, 4):
        shards = [[items[i] for i in distributed.shard_indices(len(items), p, count)] for p in range(count)]
        assert distributed.merge_shards(shards) == items


@pytest.mark.parametrize("spec, message", [
    (dict(num_processes=2), "needs --coordinator_address"),
    (dict(coordinator_address="127.0.0.1", num_processes=2, process_id=0), "expected HOST:PORT"),
    (dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2), "must be in 0..1"),
    (dict(coordinator_address="127.0.0.1:1", process_id=0), "needs --num_processes"),
    (dict(heartbeat_timeout_s=0.0), "must be > 0"),
])
def test_bad_multihost_flags_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        distributed.check_spec(distributed.ClusterSpec(**spec))


def test_a_launch_script_with_bad_multihost_flags_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "launch/train.py", "--coordinator_address=127.0.0.1:1", "--num_processes=2",
                          "--process_id=0", "--local_device_ids=a"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "comma list of integers" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr


def test_a_single_process_script_runs_on_process_0_and_the_others_say_so():
    out = subprocess.run([sys.executable, "launch/simulate.py", "--coordinator_address=127.0.0.1:1",
                          "--num_processes=2", "--process_id=1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "launch/simulate.py runs on process 0 only" in out.stdout, out.stderr[-2000:]


def test_local_cluster_refuses_what_it_cannot_split():
    out = subprocess.run([sys.executable, "launch/local_cluster.py", "-n", "3", "--", "launch/train.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "8 devices do not split evenly over 3 processes" in out.stderr


class _Store:
    """The coordinator's key-value store in memory, shared by the `Cluster`s of one test (each a process)."""

    def __init__(self):
        self.values, self.order, self.cond = {}, [], threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            self.values[key] = value
            self.order.append(key)
            self.cond.notify_all()

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_delete(self, key):
        with self.cond:
            for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
                del self.values[k]


def _two_processes(monkeypatch, timeout_s: float = 30.0) -> tuple[_Store, distributed.Cluster, distributed.Cluster]:
    store = _Store()
    monkeypatch.setattr(distributed.Cluster, "_client", property(lambda _: store))
    spec = distributed.ClusterSpec(exchange_timeout_s=timeout_s)
    return store, distributed.Cluster(spec, 0, 2), distributed.Cluster(spec, 1, 2)


def _late(seconds: float, exchanges) -> threading.Thread:
    """Process 1: its exchanges (blocking, in order) after `seconds`."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), [e() for e in exchanges]), daemon=True)
    thread.start()
    return thread


async def _waiting_with_a_ticker(exchange, tick_s: float):
    """(`exchange`'s result, the ticks of another task during the wait, the loop's seconds it took)."""
    loop = asyncio.get_running_loop()
    async with ticking(tick_s) as ticks:
        t0 = loop.time()
        out = await exchange
        return out, ticks[0], loop.time() - t0


def test_the_event_loop_runs_on_while_a_process_waits_for_a_slower_one(monkeypatch):
    store, c0, c1 = _two_processes(monkeypatch)
    late = _late(0.5, [lambda: c1.allgather("batch", "p1"), lambda: c1.broadcast("decision"),
                       lambda: c1.allgather("counts", 1)])
    out, ticks, took = asyncio.run(_waiting_with_a_ticker(c0.allgather_async("batch", "p0"), 0.01))
    assert out == ["p0", "p1"] and took >= 0.3
    assert ticks >= 10, ticks  # a blocking wait: 0
    assert c0.exchange_s >= 0.3  # the wait counted as exchange time, as before

    async def in_call_order():  # started together: numbered and run in the order of the calls
        return await asyncio.gather(c0.broadcast_async("decision", "p0's"), c0.allgather_async("counts", 0))
    assert asyncio.run(in_call_order()) == ["p0's", [0, 1]]
    late.join(5)
    mine = [k.split("/")[1] for k in store.order if k.endswith("/n") and (k.endswith("/0/n") or "/b" in k)]
    assert mine == ["x1", "b2", "x3"]


def test_the_simulators_clock_stands_still_during_an_exchange(monkeypatch):
    # the exchange runs as an executor job of the virtual-time loop: its timers do not race the real wait
    _, c0, c1 = _two_processes(monkeypatch)
    late = _late(0.3, [lambda: c1.allgather("step", 1)])
    out, ticks, took = clock.run(_waiting_with_a_ticker(c0.allgather_async("step", 0), 1.0))
    assert out == [0, 1] and ticks == 0 and took == 0.0
    late.join(5)


def test_a_failed_exchange_names_the_process_that_did_not_answer(monkeypatch):
    _, c0, _ = _two_processes(monkeypatch, timeout_s=0.2)  # process 1 never comes
    with pytest.raises(distributed.ClusterError, match="process 1 of 2 did not reach 'batch' within 0 s"):
        asyncio.run(c0.allgather_async("batch", 0))


# ---------------------------------------------------------------------- the runtime, several processes


@pytest.mark.e2e
def test_every_process_gets_every_value_and_process_0s_decision():
    out = _cluster(2, "tests/multihost_worker.py", "exchange")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = _results(out.stdout)
    assert set(results) == {0, 1}
    for r in results.values():
        assert r["gathered"] == [{"index": 0, "square": 0}, {"index": 1, "square": 1}]
        assert r["decided"] == "process 0's choice"
        assert r["big"] == [[5 << 20, 0], [5 << 20, 1]]  # in chunks of the key-value store
        assert r["shards"] == [f"item{i}" for i in range(7)]


@pytest.mark.e2e
def test_a_process_waiting_at_an_exchange_keeps_its_event_loop_running():
    # process 1 reaches the exchange 2 s late; process 0's other task ticks (every 50 ms) while it waits
    out = _cluster(2, "tests/multihost_worker.py", "late")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = _results(out.stdout)
    assert results[0]["gathered"] == results[1]["gathered"] == [0, 1]
    assert results[0]["waited_s"] > 1.5, results[0]
    assert results[0]["ticks"] >= 10, results[0]  # a wait that blocks the loop: 0


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_process_applies_process_0s_decisions_when_its_own_signals_say_otherwise(tmp_path):
    # the real controller on the simulated backend, ERS on; process 1's own rule never moves
    out = _cluster(2, "tests/multihost_worker.py", "decisions", str(tmp_path), timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = _results(out.stdout)
    assert results[0]["moves"], "process 0's ERS moved nothing: the test would prove nothing"
    assert results[1]["moves"] == results[0]["moves"]
    assert results[0]["consumed"] == results[1]["consumed"] and results[0]["steps"] == 6
    consumed = [tuple(x) for x in results[0]["consumed"]]
    assert len(consumed) == 6 * 16 and len(set(consumed)) == len(consumed)
    assert results[0]["ledger"] == results[1]["ledger"]  # gathered from both
    assert results[0]["ledger"]["completed"] >= len(consumed)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_bidirl_borrows_are_process_0s_and_made_by_every_process(tmp_path):
    # the JAX backend, borrows forced on process 0 and refused by process 1's own rule: the rollout borrows the
    # train devices while the trainer waits, the trainer the idle rollout replicas of every process for a step
    out = _cluster(2, "tests/multihost_worker.py", "bidirl", str(tmp_path), timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = _results(out.stdout)
    assert {b[1] for b in results[0]["borrows"]} == {"rollout", "train"}, results[0]["borrows"]
    assert results[1]["borrows"] == results[0]["borrows"]
    for r in results.values():
        assert r["steps"] == 2 and r["versions"] == [r["version"]] * 3  # every replica serves the last weights
        assert r["trainer_devices"] == r["train_devices"]  # the trainer back on its own devices (of both processes)
        assert len(r["train_devices"]) == 2
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.e2e
def test_a_process_that_dies_ends_the_others_within_the_heartbeat_naming_it():
    t0 = time.monotonic()
    out = _cluster(2, "tests/multihost_worker.py", "die", "--heartbeat_timeout_s=4", timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]  # the first failure's status
    assert "[0] error: multi-host run stopped: process 1 of 2 stopped: no heartbeat" in out.stdout, out.stdout
    assert took < 60, took  # not the exchange's 600 s, nor gloo's or JAX's own timeouts


class _Watched:
    """Process 0's heartbeat watchdog against scripted processes, on a faked key-value store and clock: `beats[q]`
    is the first and last second (inclusive; None: never) at which process q beats."""

    def __init__(self, monkeypatch, beats: dict, timeout: float = 10.0, seconds: int = 60):
        self.now, self.beats, self.values, self.reports = 0.0, beats, {}, []
        self.cluster = distributed.Cluster(distributed.ClusterSpec(heartbeat_timeout_s=timeout), 0, len(beats) + 1)
        monkeypatch.setattr(distributed.Cluster, "_client", property(lambda _: self))
        monkeypatch.setattr(distributed, "time", types.SimpleNamespace(monotonic=lambda: self.now))
        self.cluster._stop = self  # its wait(1.0) is a faked second; the watch ends after `seconds` of them
        self.cluster.on_failure = lambda message: self.reports.append((self.now, message))
        self.cluster.on_interrupted = lambda message: self.reports.append((self.now, message))
        self.seconds = seconds
        self._beat()
        self.cluster._watch()

    def _beat(self):
        for q, (first, last, *then) in self.beats.items():  # then: the value it leaves after its last beat
            if first is not None and first <= self.now <= last:
                self.values[f"tiderl/hb/{q}"] = str(int(self.now))
            elif then and last is not None and self.now > last:
                self.values[f"tiderl/hb/{q}"] = then[0]

    def is_set(self):
        return self.now >= self.seconds

    def wait(self, seconds):
        self.now += seconds
        self._beat()

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found")
        return self.values[key]


def test_the_watchdog_names_a_process_that_never_beat(monkeypatch):
    w = _Watched(monkeypatch, {1: (0, 99), 2: (None, None)})  # 2 died before its first beat
    assert w.reports == [(11.0, "process 2 of 3 stopped: no heartbeat in the 11 s since the watchdog started (it "
                                "died before its first, or hangs)")]
    assert _Watched(monkeypatch, {1: (0, 99), 2: (5, 99)}).reports == []  # a late first beat, within the timeout


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_process_interrupted_by_a_signal_stops_the_others_at_once_naming_it(monkeypatch, sig):
    w = _Watched(monkeypatch, {1: (0, 99), 2: (0, 3, f"interrupted:{sig}")})  # 2 got the signal after second 3
    assert w.reports == [(4.0, f"process 2 of 3 was interrupted by {sig}; process 0 stops too")]
    assert w.values["tiderl/hb/0"] == f"interrupted:{sig}"  # seen: the coordinator waits for this before it exits


def test_the_watchdog_checks_every_process_each_second(monkeypatch):
    # 1 beats from second 6 on; 2 stops after second 1: named 10 s later, not 10 s after 1's first beat
    w = _Watched(monkeypatch, {1: (6, 99), 2: (0, 1), 3: (0, 99)})
    assert w.reports == [(12.0, "process 2 of 4 stopped: no heartbeat for 11 s (it died or hangs)")]
    w = _Watched(monkeypatch, {1: (0, 99), 2: (0, 99), 3: (0, 99)})
    assert w.reports == [] and w.now == 60  # all beating: watched to the end, nobody named


# ---------------------------------------------------------------------- the main job


def _train(n: int, logdir, *flags, timeout: float = 900) -> subprocess.CompletedProcess:
    return _cluster(n, "launch/train.py", f"--config.logdir={logdir}", *RUN, *flags, timeout=timeout)


def _updates(logdir) -> list[dict]:
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.e2e
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode, steps", [("tiderl", 2), ("sync", 2)])  # the second update runs on synced weights
def test_the_main_job_on_2_and_4_processes_trains_as_on_one(tmp_path, mode, steps):
    runs = {}
    for n in (1, 2, 4):
        out = _train(n, tmp_path / f"p{n}", f"--config.controller.mode={mode}", f"--config.controller.steps={steps}")
        assert out.returncode == 0, f"{n} processes:\n" + out.stdout[-4000:] + out.stderr[-2000:]
        assert "Traceback" not in out.stdout + out.stderr
        runs[n] = _updates(tmp_path / f"p{n}")
        if n > 1:
            assert f"{mode} on 8 cpu devices in {n} processes" in out.stdout
            assert not any(line.startswith("[1]") and "RL step" in line for line in out.stdout.splitlines())
    one = runs[1]
    assert len(one) == steps and one[-1]["grad_norm"] > 0, one  # the last update learned something
    for n in (2, 4):
        assert [u["step"] for u in runs[n]] == list(range(1, steps + 1))
        for a, b in zip(one, runs[n]):
            for key in COMPARED:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (n, a["step"], key, a[key], b[key])


def _kill_process(logdir, index: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to the local cluster's process `index` of the run in `logdir` (found by its command line)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"--config.logdir={logdir}" in cmd and f"--process_id={index}" in cmd:
            os.kill(int(pid), sig)
            return
    raise AssertionError(f"no process {index} of the run in {logdir}")


def _started_to_step_1(cmd):
    """`cmd` started, read until its first RL step's line: (the process, the lines read)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, t0 = [], time.monotonic()
    for line in proc.stdout:
        seen.append(line)
        if "RL step 1/3" in line:
            break
        assert time.monotonic() - t0 < 600, "".join(seen)[-3000:]
    return proc, seen


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_killed_process_ends_the_run_and_the_same_command_resumes_it(tmp_path):
    logdir = tmp_path / "run"
    flags = ["--config.controller.steps=3", "--config.controller.checkpoint_every=1", "--heartbeat_timeout_s=10"]
    cmd = [sys.executable, "launch/local_cluster.py", "-n", "2", "--", "launch/train.py",
           f"--config.logdir={logdir}", *RUN, *flags]
    proc, seen = _started_to_step_1(cmd)
    _kill_process(logdir, 1)
    killed = time.monotonic()
    rest, _ = proc.communicate(timeout=180)
    out = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "process 1 of 2 stopped" in out, out[-3000:]
    assert time.monotonic() - killed < 60  # the survivor did not wait for gloo's or JAX's own timeouts
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    assert "resumed from" in again.stdout and "Traceback" not in again.stdout
    meta_dir = logdir / "checkpoints" / "3" / "meta"
    meta = json.loads((meta_dir / "metadata").read_text())
    assert meta["step"] == 3 and len(meta["processes"]) == 2  # written by both, every process's part kept
    consumed = [tuple(x) for x in meta["consumed"]]
    assert len(consumed) == 3 * 8 and len(set(consumed)) == len(consumed)  # nothing trained twice


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_coordinator_alone_stops_every_process_naming_it(tmp_path, sig):
    # only process 0 gets it (a scheduler that signals one host): process 1 stops too, at once, naming it
    logdir = tmp_path / "run"
    flags = ["--config.controller.steps=3", "--config.controller.checkpoint_every=1"]
    proc, seen = _started_to_step_1([sys.executable, "launch/local_cluster.py", "-n", "2", "--", "launch/train.py",
                                     f"--config.logdir={logdir}", *RUN, *flags])
    _kill_process(logdir, 0, getattr(signal, sig))
    signalled = time.monotonic()
    rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-3000:]  # Ctrl-C's status, on both
    assert f"[0] interrupted by {sig} in RL at RL step " in out, out[-3000:]
    assert f"[1] interrupted: process 0 of 2 was interrupted by {sig}; process 1 stops too" in out, out[-3000:]
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    assert time.monotonic() - signalled < 60  # not the heartbeat's timeout, nor gloo's or JAX's
    latest = max(int(p.name) for p in (logdir / "checkpoints").iterdir() if p.name.isdigit())
    assert f"the last checkpoint (step {latest})" in out, out[-3000:]  # what the same command resumes from
    meta = json.loads((logdir / "checkpoints" / str(latest) / "meta" / "metadata").read_text())
    assert len(meta["processes"]) == 2  # written by both: a consistent checkpoint
