"""Builds the cluster simulator's event core as C extensions: Cython compiles the plain-Python modules
`tiderl_jax/sim/kv.py` and `tiderl_jax/sim/replicas.py` with the types in `kv.pxd` and `replicas.pxd`
(`replicas` cimports `kv`; the same sources run uncompiled as the reference; `tiderl_jax.sim` picks the
extensions only when each is at least as new as its sources). `sim/backend.py` (`SimBackend`, a subclass of
`replicas.ReplicaCore`) stays plain Python. The extensions are optional: without a C compiler the package
installs and runs as plain Python, slower. Set TIDERL_NO_EXTENSIONS=1 to skip them."""

import os

from setuptools import Extension, setup

# the compiled modules of tiderl_jax/sim, in import order (tiderl_jax.sim.COMPILED)
CORE = ("kv", "replicas")


def extensions():
    if os.environ.get("TIDERL_NO_EXTENSIONS") == "1":
        return []
    from Cython.Build import cythonize

    # -ffp-contract=off: no fused multiply-adds, so the compiled core rounds exactly as Python does
    core = [Extension(f"tiderl_jax.sim.{name}", [f"tiderl_jax/sim/{name}.py"], optional=True,
                      extra_compile_args=["-O2", "-ffp-contract=off"]) for name in CORE]
    # the generated C goes under build/ (ignored), not beside the sources
    return cythonize(core, language_level=3, quiet=True, build_dir="build/cython",
                     compiler_directives=dict(infer_types=True))


setup(ext_modules=extensions())
