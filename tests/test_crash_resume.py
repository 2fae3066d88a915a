"""SIGKILL the training process mid-run; rerunning resumes from the last checkpoint (ready buffer and
in-flight tasks restored) and the run completes with no sample trained twice."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigkill_then_resume_completes(tmp_path):
    logdir, steps = str(tmp_path / "run"), 4
    cmd = [sys.executable, os.path.join(ROOT, "tests", "crash_run.py"), logdir, str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seen = []
    deadline = time.time() + 600
    for line in proc.stdout:  # kill it once step 2 has been logged: mid-run, saves in flight
        seen.append(line)
        if "step 2/4" in line or time.time() > deadline:
            break
    assert any("step 2/4" in x for x in seen), "".join(seen[-20:])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines[0]["resumed_at"] >= 1  # the checkpoint of step 1 or 2 (a save can be cut by the kill)
    final = lines[-1]
    assert final["done"] == steps
    consumed = [tuple(x) for x in final["consumed"]]
    assert len(consumed) == steps * 4 and len(set(consumed)) == len(consumed)  # none trained twice
    ledger = final["ledger"]
    dropped = sum(v for k, v in ledger.items() if k.startswith("dropped:") and k != "dropped:stale")
    assert ledger["admitted"] == ledger["completed"] + dropped + final["running"]
