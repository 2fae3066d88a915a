"""Plain text on the terminal (`tiderl_jax/console.py`): a record is its bare message, third-party chatter stays in
the log file, absl's prefixed lines come back with --verbosity=1; the main job's own output read as a newcomer
sees it."""

import io
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
from conftest import ROOT

from tiderl_jax import console

PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


@pytest.fixture
def root_logging():
    """The root logger and Python's warning display as they were before the test."""
    from absl import logging as absl_logging

    root, absl_handler = logging.getLogger(), absl_logging.get_absl_handler()
    level, had_absl, showwarning = root.level, absl_handler in root.handlers, warnings.showwarning
    yield
    for h in console._HANDLERS:
        root.removeHandler(h)
        h.close()
    console._HANDLERS.clear()
    if had_absl:
        root.addHandler(absl_handler)
    root.setLevel(level)
    warnings.showwarning = showwarning


def test_a_record_is_its_bare_message_and_the_log_file_has_the_prefix(tmp_path, root_logging):
    out = io.StringIO()
    path = console.setup(str(tmp_path / "run"), verbosity=0, stream=out)
    assert path == str(tmp_path / "run" / "log.txt") and not os.path.exists(path)  # nothing logged yet
    logging.getLogger("tiderl_jax.runtime.metrics").info("RL step %d/%d  reward %.3f", 1, 3, 0.5)
    probe = logging.getLogger("jax._src.xla_bridge")
    probe.info("Unable to initialize backend 'tpu': libtpu.so: cannot open shared object file")
    probe.warning("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed")
    logging.getLogger("tiderl_jax.runtime.health").warning("not learning: 3 updates in a row")
    console._show_warning(UserWarning("a library's notice"), UserWarning, "/usr/lib/python3/dist-packages/lib.py", 7)
    console._show_warning(UserWarning("rebuild the core"), UserWarning, str(ROOT / "tiderl_jax" / "sim" / "x.py"), 1)
    assert out.getvalue().splitlines() == [
        "RL step 1/3  reward 0.500",
        "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed",
        "not learning: 3 updates in a row",
        "rebuild the core"]
    lines = open(path).read().splitlines()
    assert len(lines) == 6 and all(PREFIX.match(line) for line in lines), lines
    assert re.match(r"^I\d{4} [\d:.]+ +\d+ test_console_output\.py:\d+\] RL step 1/3  reward 0\.500$", lines[0])
    assert "Unable to initialize backend 'tpu'" in lines[1] and "a library's notice" in lines[4]


def test_verbosity_1_prefixes_every_record_on_the_terminal(root_logging):
    out = io.StringIO()
    assert console.setup(verbosity=1, stream=out) is None
    logging.getLogger("tiderl_jax.runtime.controller").info("ERS: no move (%s)", "cooldown")
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(PREFIX.match(line) for line in lines), lines
    assert lines[0].endswith("] ERS: no move (cooldown)")


def test_local_cluster_drops_gloo_connection_notices():
    import importlib.util

    spec = importlib.util.spec_from_file_location("local_cluster", ROOT / "launch" / "local_cluster.py")
    local_cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local_cluster)
    notice = "Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    out = io.StringIO()
    local_cluster._pump(1, io.StringIO(f"[Gloo] {notice}[Gloo] Rank [Gloo] {notice}1 is connected to 1 peer ranks. "
                                       f"Expected number of connected peer ranks is : 1\nRL step 1/1  3.0s\n"), out)
    assert out.getvalue() == "[1] RL step 1/1  3.0s\n"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_main_job_prints_plain_text(tmp_path):
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)  # as `make run`: JAX probes for accelerators, and says so at INFO
    # the config's own CPU device count (`cpu_devices`), as `make run`; the tests' quick-compile flags kept
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    r = subprocess.run(
        [sys.executable, "launch/train.py", f"--config.logdir={tmp_path}", "--config.controller.steps=1",
         "--config.controller.filter_groups=false", "--config.eval.tasks=2", "--config.eval.every=0",
         "--config.controller.groups_per_step=2", "--config.controller.group_size=2",
         "--config.controller.max_concurrent=8", "--config.rollout.max_turns=2", "--config.rollout.max_new_tokens=16",
         "--config.latency.median_s=0.01", "--config.latency.sigma=0.0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert not [line for line in lines if PREFIX.match(line)], text[-3000:]
    assert not [line for line in lines if "Warning" in line or "WARNING" in line], text[-3000:]
    assert "Unable to initialize backend" not in text
    assert any(re.match(r"^RL step 1/1 .* reward .* goodput", line) for line in r.stderr.splitlines()), text[-3000:]
    log = (tmp_path / "log.txt").read_text().splitlines()
    assert any(PREFIX.match(line) and "] RL step 1/1 " in line for line in log), log[-20:]
