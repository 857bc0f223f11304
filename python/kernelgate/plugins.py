"""Loading what registers extra backends and ops: a shared library with a
`kernelgate_register_backends` function, a Python module (by name) or a Python file."""

import importlib
import importlib.util
import os
import sys
from typing import Dict

from . import _C

_loaded: Dict[str, object] = {}


def is_library(item: str) -> bool:
    return item.endswith(".so") or ".so." in os.path.basename(item)


def needs_python_worker(item: str) -> bool:
    """A module or a .py file can only be hosted by the Python worker."""
    return not is_library(item)


def load(item: str) -> None:
    """Loads `item` once per process. Raises what loading raised (ImportError, RuntimeError)."""
    key = os.path.abspath(item) if os.path.exists(item) else item
    if key in _loaded:
        return
    if is_library(item):
        _C.load_plugin(key)
        _loaded[key] = None
    elif item.endswith(".py"):
        name = "kernelgate_plugin_" + os.path.splitext(os.path.basename(item))[0]
        spec = importlib.util.spec_from_file_location(name, key)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {item}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded[key] = module
    else:
        _loaded[key] = importlib.import_module(item)
