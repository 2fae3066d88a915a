"""Test set-up: 8 faked CPU devices and a persistent compile cache, before anything imports JAX."""

import os
import pathlib
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled for a short compile, not for speed: a test's programs run for microseconds, and compiling them is
# most of the suite's time (XLA:CPU's backend compile was 56 of 79 s of a trainer test). LLVM at -O0, the
# classic (not the MLIR) fusion emitters and one LLVM module per program (the split compiles in parallel,
# which two busy cores cannot use) halved such a test. The semantics are XLA's either way (no fast-math at
# any level); `make run` and the benchmarks compile with XLA's defaults. A flag already in XLA_FLAGS wins.
_TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0",
                   "xla_cpu_use_fusion_emitters": "false", "xla_cpu_parallel_codegen_split_count": "1"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in _TEST_XLA_FLAGS.items()
                                                if k not in _flags]).strip()
# 8 faked CPU devices, as JAX's own setting rather than an XLA flag: a main job run as a subprocess applies its
# config's count over it (`cpu_devices`, tiderl_jax/config.py), as `make run` does; other programs keep 8. It wins
# over an XLA_FLAGS device count, so a child given its own count (launch/local_cluster.py, engine workers) drops it.
# A count already in XLA_FLAGS here stays the tests' count.
if "xla_force_host_platform_device_count" not in _flags:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
ARCHS = ("llama", "qwen2", "qwen3")
_ENVIRONMENT = dict(os.environ)  # the tests' environment, as set above
# Ctrl-C's and SIGTERM's default handlers, whatever this process inherited: a shell without job control starts a
# background command (`cmd &`) with SIGINT ignored, which the processes a test starts would inherit
_SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


@pytest.fixture(autouse=True)
def _the_tests_environment():
    """Each test starts in the environment set above and with the default SIGINT / SIGTERM handlers, which
    the processes it starts inherit (an ignored SIGINT is inherited): a benchmark module a test imports sets
    XLA_FLAGS' device count at its import (benchmarks/_env.py), which would otherwise reach a main job started
    later in the same worker and win over its config's device count; a handler left by one test would make a
    later test's Ctrl-C do something else."""
    if os.environ != _ENVIRONMENT:
        os.environ.clear()
        os.environ.update(_ENVIRONMENT)
    for s, handler in _SIGNALS.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)
    yield


@pytest.fixture(scope="session")
def fixture_dir():
    return lambda arch: FIXTURES / arch


# ---------------------------------------------------------------------- one long process, bounded
# XLA:CPU maps each loaded program's machine code into memory mappings of its own (text, read-only data,
# data: three per object file) and unmaps them only when the program is freed. A test process that keeps every
# program it ever compiled (jit caches, engines held by module fixtures) grows by thousands of mappings per test
# module and reaches the kernel's per-process limit (vm.max_map_count, 65,530 by default) about 90% into the
# suite: LLVM's next mmap fails ("LLVM compilation error: Cannot allocate memory") and XLA crashes with SIGSEGV
# inside a compile or a cache write (reproduced by filling the mappings with mmap before one jit call).
# Programs are freed at the end of each test module (its fixtures are gone by then), and the peak is reported.
_MAPS = {"peak": 0, "module": ""}


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _free_programs_after_each_module(request):
    yield
    count = _mappings()
    if count > _MAPS["peak"]:
        _MAPS.update(peak=count, module=request.module.__name__)
    if "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its peak goes to the controller
        workeroutput["maps_peak"], workeroutput["maps_module"] = _MAPS["peak"], _MAPS["module"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller: a worker finished
    out = getattr(node, "workeroutput", {})
    if out.get("maps_peak", 0) > _MAPS["peak"]:
        _MAPS.update(peak=out["maps_peak"], module=out["maps_module"])


def pytest_terminal_summary(terminalreporter):
    if _MAPS["peak"]:
        try:
            limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
        except OSError:
            limit = 0
        terminalreporter.write_line(
            f"memory mappings: peak {_MAPS['peak']:,} in one test process (after {_MAPS['module']}), "
            f"limit vm.max_map_count {limit:,}")
