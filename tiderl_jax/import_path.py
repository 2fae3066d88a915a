"""Objects named by import path: `"module:name"` (importable: `my_pkg.rewards:compute_score`) or
`"path/to/file.py:name"` (loaded from that file, as veRL's `custom_reward_function.path` is). Reward functions,
environments (`data/`) and external agents (`agents/external.py`) are all named so. A path that cannot be used
is one `ImportPathError` naming the path and what is wrong. (Standard library only.)"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any


class ImportPathError(ValueError):
    """An import path that cannot be used (the message names the path and the problem)."""



def _split(spec: str, what: str) -> tuple[str, str]:
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ImportPathError(f"{what} {spec!r} is not 'module:name' or 'path/to/file.py:name'")
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise ImportPathError(f"{what} {spec!r} is not 'module:name' or 'path/to/file.py:name' "
                              f"(name {name!r} is not an identifier)")
    return target, name


def _module_from_file(path: str, spec: str, what: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ImportPathError(f"{what} {spec!r}: file {full} not found")
    name = "tiderl_user_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it runs
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ImportPathError(f"{what} {spec!r}: importing {full} raised {type(e).__name__}: {e}") from e
    return module


def load_object(spec: str, what: str = "import path") -> Any:
    """The object `spec` names: `"module:name"` or `"path/to/file.py:name"`; ImportPathError otherwise."""
    target, name = _split(spec, what)
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _module_from_file(target, spec, what)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ImportPathError(f"{what} {spec!r}: module {target!r} not found ({e})") from e
        except Exception as e:
            raise ImportPathError(f"{what} {spec!r}: importing {target!r} raised {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise ImportPathError(f"{what} {spec!r}: {target!r} has no {name!r} (it defines {public})")
    return getattr(module, name)
