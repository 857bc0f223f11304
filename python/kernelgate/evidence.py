"""Where evidence lives: the user's store, the evidence shipped in the package, the worker.

The dispatcher loads the policy from these lazily, on its first decision, in C++; Python only
says where they are.
"""

import glob
import hashlib
import lzma
import os
import sys
import tempfile
import warnings
from typing import Dict, List, Optional

from . import _C

_HERE = os.path.dirname(os.path.abspath(__file__))


def db_path() -> str:
    """KERNELGATE_DB if set, else kernelgate/evidence.sqlite under the user's cache directory."""
    return os.fsdecode(_C.default_db_path())


def shipped_paths() -> List[str]:
    """Evidence measured on our own GPUs, shipped inside the package: one store per GPU and op,
    `evidence/<gpu>-<op>.sqlite.xz` (xz: a store compresses about 18x), unpacked once into the
    cache directory (beside the default store; a temporary directory where that cannot be
    written) under a name holding the packed file's hash, so an upgrade never reads a stale copy.
    A plain `evidence/*.sqlite` is used as it is."""
    found = sorted(glob.glob(os.path.join(_HERE, "evidence", "*.sqlite")))
    for packed in sorted(glob.glob(os.path.join(_HERE, "evidence", "*.sqlite.xz"))):
        path = _unpacked(packed)
        if path is not None:
            found.append(path)
    return found


def shipped_coverage(paths: Optional[List[str]] = None) -> List[dict]:
    """The GPU models the shipped evidence covers: per model (its rows' GPU name, whatever file
    they are in: a file merged from several models keeps each one's rows under its fingerprint),
    the ops and the number of results."""
    models: Dict[str, dict] = {}
    for path in shipped_paths() if paths is None else paths:
        st = _C.store_status(path)
        if not st["usable"]:
            continue
        stem = os.path.basename(path).split(".")[0].split("-")
        op = stem[1] if len(stem) >= 2 else stem[0]
        found = [(f["gpu_name"], f["results"]) for f in st["stale"]]
        if st["current_results"]:
            found.append((st["fingerprint"]["gpu_name"], st["current_results"]))
        for gpu, n in found:
            m = models.setdefault(gpu, {"gpu_name": gpu, "ops": [], "results": 0})
            if op not in m["ops"]:
                m["ops"].append(op)
            m["results"] += n
    return sorted(models.values(), key=lambda m: m["gpu_name"])


def _cache_dirs() -> List[str]:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(base, "kernelgate", "shipped"),
            os.path.join(tempfile.gettempdir(), f"kernelgate-shipped-{os.getuid()}")]


def _unpacked(packed: str) -> Optional[str]:
    with open(packed, "rb") as f:
        data = f.read()
    name = os.path.basename(packed)[: -len(".xz")]
    digest = hashlib.sha256(data).hexdigest()[:16]
    problems = []
    for d in _cache_dirs():
        path = os.path.join(d, f"{name[: -len('.sqlite')]}-{digest}.sqlite")
        if os.path.exists(path):
            return path
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".unpacking-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(lzma.decompress(data))
                os.replace(tmp, path)  # atomic: a reader sees the whole store or none
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return path
        except (OSError, lzma.LZMAError) as e:
            problems.append(f"{d}: {e}")
    warnings.warn(f"kernelgate: the shipped evidence {name} could not be unpacked ("
                  + "; ".join(problems) + "): calls it covers run the fallback", stacklevel=2)
    return None


def worker_argv(plugins: List[str], python: bool = False) -> List[str]:
    """The worker program of a sweep: kernelgate-worker, or the Python worker where Python
    backends or ops must be hosted (it starts slower: it imports torch)."""
    argv = [sys.executable, "-m", "kernelgate.worker"] if python else [os.path.join(_HERE, "kernelgate-worker")]
    for p in plugins:
        argv += ["--load", os.path.abspath(p) if os.path.exists(p) else p]
    return argv


def install() -> None:
    _C.use_evidence(os.fsencode(db_path()), [os.fsencode(p) for p in shipped_paths()])
