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

import pytest  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def fixture_dir():
    return lambda arch: FIXTURES / arch
