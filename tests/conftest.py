"""Test set-up: 8 faked CPU devices and a persistent compile cache, before anything imports JAX."""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# The test process reads the persistent compile cache but does not write to it: in a cold-cache run of the whole
# suite (CI's), jaxlib segfaulted twice at the same point, in `executable.serialize()` while writing a cache entry
# from the engine's worker thread (tests/test_visual.py, 97% into the suite; the tests pass alone and in smaller
# groups). Subprocesses the tests start (launch/train.py, ...) keep writing, so later ones load what earlier ones
# compiled.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def fixture_dir():
    return lambda arch: FIXTURES / arch
