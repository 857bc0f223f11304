"""Where evidence lives: the user's store, the evidence shipped in the package, the worker.

The dispatcher loads the policy from these lazily, on its first decision, in C++; Python only
says where they are.
"""

import glob
import os
import sys
from typing import List

from . import _C

_HERE = os.path.dirname(os.path.abspath(__file__))


def db_path() -> str:
    """KERNELGATE_DB if set, else kernelgate/evidence.sqlite under the user's cache directory."""
    return os.fsdecode(_C.default_db_path())


def shipped_paths() -> List[str]:
    """Evidence measured on our own GPUs, shipped inside the package."""
    return sorted(glob.glob(os.path.join(_HERE, "evidence", "*.sqlite")))


def worker_argv(plugins: List[str], python: bool = False) -> List[str]:
    """The worker program of a sweep: kernelgate-worker, or the Python worker where Python
    backends or ops must be hosted (it starts slower: it imports torch)."""
    argv = [sys.executable, "-m", "kernelgate.worker"] if python else [os.path.join(_HERE, "kernelgate-worker")]
    for p in plugins:
        argv += ["--load", os.path.abspath(p) if os.path.exists(p) else p]
    return argv


def install() -> None:
    _C.use_evidence(os.fsencode(db_path()), [os.fsencode(p) for p in shipped_paths()])
