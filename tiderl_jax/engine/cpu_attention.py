"""The `cpu` paged-attention implementation: `paged_attention.cc` as an XLA FFI custom call.

On XLA:CPU the `xla` implementation's gather of every row's pages into a dense span (and the dots over
that copy) costs as much as the weight matmuls of a SmolLM2 decode step at batch 4 with 1K-token contexts,
and grows with the padded span. The kernel reads each row's own pages in place with an online softmax.

It is compiled at first use with the system's C++ compiler (`$CXX`, else `g++`) against the FFI headers
that jaxlib ships, for this machine's CPU, into `$TIDERL_KERNEL_CACHE` (default
`~/.cache/tiderl_jax/kernels`), keyed by the source, the flags, the compiler, the CPU and jaxlib (its
version and its FFI headers: an upgrade builds anew); a missing compiler or a failed build leaves
`available()` False with the reason in `unavailable_reason()`, and the engine's `auto` choice falls
back to `xla`. It takes every call, decode, speculative verification and prefill chunks alike: a prefill chunk's
queries go through the row's pages in tiles of 16 tokens (each page transposed once for all of a tile's queries,
pages past a query's position never read), and a row's padding queries (at or past its `num_new`) are skipped and
written as zeros. Float32 only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "tiderl_paged_attention"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC", "-w")
_reason: list[str] = []
_lock = threading.Lock()  # one build and one registration per process, whichever thread asks first


def _cpu_key() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _key(cxx: str) -> str:
    """The built kernel's name in the cache: a hash of what the library depends on (the source, the flags, the
    compiler, the CPU, and jaxlib: its version and the FFI headers compiled against), so that a jaxlib
    upgrade builds a new one instead of loading a library built against other headers."""
    include = Path(jax.ffi.include_dir())
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_key().encode(), cxx.encode(),
                 jaxlib.__version__.encode(), str(include).encode()):
        digest.update(part + b"\0")
    for header in sorted(include.rglob("*.h")):
        digest.update(str(header.relative_to(include)).encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:16]


def _build() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        raise RuntimeError(f"no C++ compiler{f' {cxx!r}' if cxx else ''} found (set CXX or install g++)")
    key = _key(cxx)
    cache = Path(os.environ.get("TIDERL_KERNEL_CACHE", Path.home() / ".cache" / "tiderl_jax" / "kernels"))
    lib = cache / f"paged_attention_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)  # built aside, then renamed: concurrent builders are safe
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        raise RuntimeError(f"{' '.join(cmd)} failed: {'; '.join(errors[:3]) or done.stderr.strip()[-500:]}")
    os.replace(tmp, lib)
    return lib


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on the first call)."""
    with _lock:
        return _load()


@functools.cache
def _load() -> bool:
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.TiderlPagedAttention), platform="cpu")
        return True
    except Exception as e:  # a missing compiler, a failed build: the engine uses the `xla` implementation
        _reason.append(f"{type(e).__name__}: {e}")
        logging.warning("CPU paged-attention kernel unavailable, using the XLA implementation: %s", _reason[-1])
        return False


def unavailable_reason() -> str | None:
    return _reason[-1] if _reason else None


def handles(q, k_pool, v_pool) -> bool:
    """Whether the kernel takes this call: float32 (the `cpu` entry of `paged_attention.PAGED_ATTENTION` sends
    others to the `xla` implementation)."""
    return all(x.dtype == jnp.float32 for x in (q, k_pool, v_pool))


def paged_attention_cpu(q, k_pool, v_pool, page_table, starts, num_new=None):
    """Same contract as `paged_attention_reference`, for the calls it `handles`; `num_new` [b] (default: every
    query): the row's real queries, the later ones padding, whose outputs are zeros."""
    if not handles(q, k_pool, v_pool):
        raise ValueError(f"the CPU paged-attention kernel takes float32 calls, not {q.dtype}")
    if not available():
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {unavailable_reason()}")
    if num_new is None:
        num_new = jnp.full(q.shape[:1], q.shape[1], jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pool, v_pool, page_table.astype(np.int32), starts.astype(np.int32), num_new.astype(np.int32))
