"""Builds the cluster simulator's event core as a C extension: Cython compiles the plain-Python module
`tiderl_jax/sim/backend.py` with the types in `backend.pxd` (the same source runs uncompiled as the
reference; `tiderl_jax.sim` picks the extension only when it is at least as new as that source). The
extension is optional: without a C compiler the package installs and runs as plain Python, slower.
Set TIDERL_NO_EXTENSIONS=1 to skip it."""

import os

from setuptools import Extension, setup


def extensions():
    if os.environ.get("TIDERL_NO_EXTENSIONS") == "1":
        return []
    from Cython.Build import cythonize

    # -ffp-contract=off: no fused multiply-adds, so the compiled core rounds exactly as Python does
    core = Extension("tiderl_jax.sim.backend", ["tiderl_jax/sim/backend.py"], optional=True,
                     extra_compile_args=["-O2", "-ffp-contract=off"])
    return cythonize([core], language_level=3, quiet=True, compiler_directives=dict(infer_types=True))


setup(ext_modules=extensions())
