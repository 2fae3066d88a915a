"""What every benchmark sets before JAX loads, in one place: the CPU platform unless told otherwise, 8 faked
devices for the ones that lay out device groups (`devices=8`), the persistent compile cache the Makefile
uses (reruns skip most compiles), and the repository on the import path.

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _env import setup  # noqa: E402
    ROOT = setup(devices=8)
"""

import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def setup(devices: int = 0) -> pathlib.Path:
    """Sets the environment (values already set win) and returns the repository root."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return ROOT


def best_of(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (its compile / warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
