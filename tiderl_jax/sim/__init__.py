"""Cluster-scale simulator (issue 8): the same controller and policies on cost-modelled devices.

Parts: `backend` (`SimBackend`: the runtime controller's `Backend` on the parts below; `run`), built from
`config` (`SimConfig`, `SimTrajectory`), `kv` (the KV / prefix-cache model), `replicas` (the replica event
core), `router` (`SimConfig.router`: placement through the router policies), `trainer_costs` (train and ref
jobs) and `switches` (moves, BiDiRL borrowing), and
- `hardware`: accelerator presets from vendor specs (H100, H200, TPU v5e, TPU v5p);
- `costs`: roofline cost models (prefill, decode, KV capacity, train, ref scoring, weight sync,
  device moves) and model shapes (Qwen2.5-7B / 14B);
- `clock`: a virtual-time asyncio event loop (sleeps and timeouts take no wall time);
- `workloads`: workload presets after the papers, with the sampling distributions, task classes and mixes;
- `routing_study`: the router policies compared on a mixed trace at the MISA-T paper's scale.

The simulator never imports JAX model code (docs/architecture.md, Layers): only `policies/` and the runtime's
controller interfaces.

The event core (`kv` and `replicas`, `COMPILED`) runs compiled when it can: `setup.py` builds each with
Cython (typed by `kv.pxd`, `replicas.pxd`; `replicas` cimports `kv`) into a C extension next to its source;
`backend` and the other parts stay plain Python. The same sources are the reference: they run uncompiled,
all together, when an extension is missing, when one is older than its sources (edited since the build:
rebuild with `pip install -e .`, or `make`), or with TIDERL_SIM_PYTHON=1. `python_reference()` loads them,
and `backend` on them, uncompiled beside the compiled ones, for tests that compare them.
"""

import glob
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
COMPILED = ("kv", "replicas")  # the compiled modules, in import order (setup.py builds them)
# each one's sources: its own and the declarations it cimports
_SOURCES = {"kv": ("kv.py", "kv.pxd"), "replicas": ("replicas.py", "replicas.pxd", "kv.pxd")}
# what `python_reference` loads from source, in import order: the compiled modules and the backend on them
_REFERENCE = COMPILED + ("backend",)


def _built(part: str) -> list[str]:
    """The extension files built from `part` (any age)."""
    return sorted(glob.glob(os.path.join(_HERE, f"{part}.*.so")) + glob.glob(os.path.join(_HERE, f"{part}.*.pyd")))


def compiled_core() -> str | None:
    """The path of the built extension of `replicas`, if every module of `COMPILED` has one at least as new as
    its sources."""
    for part in COMPILED:
        built = _built(part)
        if not built:
            return None
        source = max(os.path.getmtime(p) for p in (os.path.join(_HERE, s) for s in _SOURCES[part])
                     if os.path.exists(p))
        if os.path.getmtime(built[-1]) < source:
            warnings.warn(f"{built[-1]} is older than tiderl_jax/sim/{' or '.join(_SOURCES[part])}: the simulator "
                          "runs uncompiled (slower); rebuild it with `pip install -e .` (or `make`)", stacklevel=2)
            return None
    return _built(COMPILED[-1])[-1]


def _load_source(name: str, part: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{part}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def python_reference():
    """`backend` on the event core run from its sources (the reference the compiled core is tested against), as
    the module `tiderl_jax.sim.backend_python` (its core as `tiderl_jax.sim.kv_python` and `replicas_python`);
    the compiled modules stay what `tiderl_jax.sim.backend` imports."""
    reference = sys.modules.get("tiderl_jax.sim.backend_python")
    if reference is not None:
        return reference
    names = [f"tiderl_jax.sim.{part}" for part in _REFERENCE]
    saved = {name: sys.modules.get(name) for name in names}
    try:  # while they load, each stands in for its module: the next ones import it
        for part, name in zip(_REFERENCE, names):
            sys.modules[name] = _load_source(f"{name}_python", part)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return sys.modules["tiderl_jax.sim.backend_python"]


if os.environ.get("TIDERL_SIM_PYTHON") == "1" or compiled_core() is None:
    # the import system would take an extension before its source: load the sources as the modules themselves
    # (all of them: a compiled `replicas` needs the compiled `kv`)
    for _part in COMPILED:
        if f"tiderl_jax.sim.{_part}" not in sys.modules and _built(_part):
            _load_source(f"tiderl_jax.sim.{_part}", _part)
if "tiderl_jax.sim.backend" not in sys.modules and _built("backend"):
    # an extension of `backend` left by a build from before the event core moved out of it would shadow it
    _load_source("tiderl_jax.sim.backend", "backend")
