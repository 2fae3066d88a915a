"""Cluster-scale simulator (issue 8): the same controller and policies on cost-modelled devices.

Parts: `backend` (`SimBackend`: the runtime controller's `Backend` on the parts below; `run`), and
- `hardware`: accelerator presets from vendor specs (H100, H200, TPU v5e, TPU v5p);
- `costs`: roofline cost models (prefill, decode, KV capacity, train, ref scoring, weight sync,
  device moves) and model shapes (Qwen2.5-7B / 14B);
- `clock`: a virtual-time asyncio event loop (sleeps and timeouts take no wall time);
- `workloads`: workload presets after the papers, with the sampling distributions.

The simulator never imports JAX model code (ARCHITECTURE.md): only `policies/` and the runtime's
controller interfaces.

`backend` runs compiled when it can: `setup.py` builds it with Cython (typed by `backend.pxd`) into a C
extension next to `backend.py`. The same `backend.py` is the reference: it runs uncompiled when no
extension was built, when the extension is older than `backend.py` or `backend.pxd` (edited since the
build: rebuild with `pip install -e .`, or `make`), or with TIDERL_SIM_PYTHON=1. `python_reference()`
loads it uncompiled beside the compiled one, for tests that compare them.
"""

import glob
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = (os.path.join(_HERE, "backend.py"), os.path.join(_HERE, "backend.pxd"))


def _built() -> list[str]:
    """The extension files built from `backend` (any age)."""
    return sorted(glob.glob(os.path.join(_HERE, "backend.*.so")) + glob.glob(os.path.join(_HERE, "backend.*.pyd")))


def compiled_core() -> str | None:
    """The path of the built extension of `backend`, if there is one at least as new as its sources."""
    built = _built()
    if not built:
        return None
    source = max(os.path.getmtime(p) for p in _SOURCES if os.path.exists(p))
    if os.path.getmtime(built[-1]) < source:
        warnings.warn(f"{built[-1]} is older than tiderl_jax/sim/backend.py or backend.pxd: the simulator runs "
                      "uncompiled (slower); rebuild it with `pip install -e .` (or `make`)", stacklevel=2)
        return None
    return built[-1]


def _load_source(name: str):
    spec = importlib.util.spec_from_file_location(name, _SOURCES[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def python_reference():
    """`backend` run from its source (the reference the compiled core is tested against), as the module
    `tiderl_jax.sim.backend_python`; the compiled `backend` stays what `tiderl_jax.sim.backend` imports."""
    return sys.modules.get("tiderl_jax.sim.backend_python") or _load_source("tiderl_jax.sim.backend_python")


if "tiderl_jax.sim.backend" not in sys.modules and (os.environ.get("TIDERL_SIM_PYTHON") == "1"
                                                    or compiled_core() is None):
    # the import system would take an extension before backend.py: load the source as `backend` itself
    if _built():
        _load_source("tiderl_jax.sim.backend")
