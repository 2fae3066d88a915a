"""benchmarks/accelerator_check.py: on a CPU it says there is no accelerator and exits 0; run on the CPU anyway
(`--on_cpu`, small sizes) every check runs and writes its row: the script a GPU's few minutes will run works."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_accelerator_check_exits_cleanly_on_a_cpu_and_runs_every_check_when_asked(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/accelerator_check.py"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "no accelerator" in r.stdout and not r.stderr.strip(), r.stderr[-2000:]
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, "benchmarks/accelerator_check.py", "--on_cpu", f"--json={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"limits", "kernels", "parity", "decode", "train"}
    assert rows["limits"]["matmul_flops"] > 0 and rows["limits"]["bandwidth_bytes_per_s"] > 0
    assert rows["kernels"]["engine_attention_auto_bfloat16"] == "xla"
    assert rows["parity"]["identical"] == 1.0  # the engine and the reference generator, both on the CPU
    assert rows["decode"]["tokens_per_s"] > 0 and rows["decode"]["roofline_tokens_per_s"] > 0
    assert 0 < rows["train"]["mfu"] < 1
