"""N processes of a launch script on this machine, as the hosts of a multi-host run (docs/multihost.md).

    python launch/local_cluster.py -n 2 -- launch/train.py --config=configs/tiny_agentic.py [flags]

Each process gets `--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=i` (a free loopback
port), and its share of the devices: on the CPU, `--devices` faked devices split evenly (XLA_FLAGS, gloo
collectives between the processes); with `--accelerators=K`, `--local_device_ids` of K / N GPUs each. Every
line a process prints is prefixed with `[i]` (gloo's connection notices dropped). The exit status is the first
failure's (0 when all succeed): the others are given `--grace_s` seconds to stop by themselves (a run's
heartbeat ends them within its timeout), then killed, so nothing is left running. Ctrl-C and SIGTERM are
passed on to every process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s -n N [options] -- SCRIPT [ARGS]")
    p.add_argument("-n", "--num_processes", type=int, required=True, help="processes (the hosts of the run)")
    p.add_argument("--devices", type=int, default=8, help="faked CPU devices in all, split evenly (default 8)")
    p.add_argument("--accelerators", type=int, default=0, help="GPUs in all, split evenly (0: the CPU)")
    p.add_argument("--port", type=int, default=0, help="the coordinator's loopback port (0: a free one)")
    p.add_argument("--grace_s", type=float, default=60.0,
                   help="after the first failure, seconds the others get to stop before they are killed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: a launch/ script and its flags")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the command after --, e.g. -- launch/train.py --config=configs/tiny_agentic.py")
    if a.num_processes < 1:
        p.error(f"-n {a.num_processes}: at least 1")
    total = a.accelerators or a.devices
    if total % a.num_processes:
        p.error(f"{total} {'accelerators' if a.accelerators else 'devices'} do not split evenly over "
                f"{a.num_processes} processes")
    a.command = command
    return a


def process_env(base: dict, index: int, a) -> dict:
    env = dict(base)
    if not a.accelerators:
        per = a.devices // a.num_processes
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per}".strip()
        env.pop("JAX_NUM_CPU_DEVICES", None)  # JAX's own setting would win over the flag
        env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def process_flags(index: int, port: int, a) -> list[str]:
    flags = [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={a.num_processes}",
             f"--process_id={index}"]
    if a.accelerators:
        per = a.accelerators // a.num_processes
        flags.append("--local_device_ids=" + ",".join(str(index * per + k) for k in range(per)))
    return flags


# gloo's notice at each CPU collective's first use ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of
# connected peer ranks is : 1"), written by its C++ code from several threads at once (lines cut and mixed): dropped
_GLOO_NOTICE = "connected peer ranks is : "


def _pump(index: int, stream, out) -> None:
    for line in stream:
        if _GLOO_NOTICE in line:
            continue
        out.write(f"[{index}] {line}")
        out.flush()


def run(argv) -> int:
    a = _args(argv)
    port = a.port or free_port()
    script, *rest = a.command
    procs, pumps = [], []
    for i in range(a.num_processes):
        cmd = [sys.executable, script, *rest, *process_flags(i, port, a)] if script.endswith(".py") else \
            [script, *rest, *process_flags(i, port, a)]
        p = subprocess.Popen(cmd, env=process_env(os.environ, i, a), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout),):
            t = threading.Thread(target=_pump, args=(i, stream, out), daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    first_failure, failed_at = 0, None
    while [p.poll() for p in procs].count(None):  # every process polled (its returncode set) each time
        for i, p in enumerate(procs):
            if p.returncode not in (None, 0) and first_failure == 0:
                first_failure, failed_at = p.returncode, time.monotonic()
                print(f"[local_cluster] process {i} exited with status {p.returncode}; the others get "
                      f"{a.grace_s:.0f} s to stop", file=sys.stderr, flush=True)
        if failed_at is not None and time.monotonic() - failed_at > a.grace_s:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"[local_cluster] process {i} still running {a.grace_s:.0f} s after the failure: killed",
                          file=sys.stderr, flush=True)
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    for t in pumps:
        t.join(timeout=5)
    if first_failure == 0:
        first_failure = next((p.returncode for p in procs if p.returncode != 0), 0)
    return first_failure if first_failure >= 0 else 128 - first_failure


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
