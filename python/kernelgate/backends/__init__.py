"""The field's kernel libraries as kernelgate backends, each an optional extra of the package
(``pip install kernelgate[liger]``, ``kernelgate[fla]``, ``kernelgate[kernel-fun]``,
``kernelgate[quack]``).

Every backend below is registered at ``import kernelgate`` without importing its library (that
takes seconds; it happens at the backend's first call, or in ``kg.warmup``). It is available
when its distribution is installed at a version in the range we test, and otherwise listed by
``kernelgate ops`` as unavailable with the reason. Its evidence's fingerprint carries the
library's version and a hash of its adapter's code, so evidence of another version or another
adapter never serves. A backend whose adapter is a module of its own (``LibraryBackend.adapter``,
e.g. FLA's gated delta rule) carries that module's hash: a change to it leaves the evidence of the
library's other backends current. Like every backend it serves a call only where the shipped or the user's
evidence shows it correct for the call's region, or where the user forces it.
"""

import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Library:
    extra: str          # pip install kernelgate[extra]
    dist: str           # its distribution's pip name
    tested: Tuple[str, str]  # [first, last) versions we test
    adapter: str        # our adapter module, kernelgate.backends.<adapter>


@dataclasses.dataclass(frozen=True)
class LibraryBackend:
    library: str
    op: str
    name: str
    forward: str        # functions of the adapter module
    backward: Optional[str]
    dtypes: Sequence[torch.dtype] = _FLOATS
    variants: Optional[Dict[str, List[str]]] = None
    present: Sequence[str] = ()
    capturable: bool = True  # False: it syncs with the host, so never under CUDA-graph capture
    max_row_bytes: Optional[int] = None  # the first tensor's last dim, in bytes
    row_bytes_multiple: Optional[int] = None  # ... a multiple of this many bytes
    absent: Sequence[str] = ()  # optional tensor arguments it needs not given
    max_dims: Optional[Dict[str, int]] = None  # named dims' largest sizes it implements
    grad_request: bool = False  # forward gets needs_grad= (kg.register_backend's grad_request)
    adapter: Optional[str] = None  # its own adapter module instead of the library's


LIBRARIES: Dict[str, Library] = {
    "liger": Library("liger", "liger-kernel", ("0.8.5", "0.9"), "liger"),
    "fla": Library("fla", "fla-core", ("0.6.0", "0.7"), "fla"),
    "kernel_fun": Library("kernel-fun", "kernel-fun", ("0.2.0", "0.3"), "kernel_fun"),
    "quack": Library("quack", "quack-kernels", ("0.6.5", "0.7"), "quack"),
}

BACKENDS: List[LibraryBackend] = [
    LibraryBackend("liger", "rms_norm", "liger", "rms_norm_fwd", "rms_norm_bwd"),
    LibraryBackend("liger", "layer_norm", "liger", "layer_norm_fwd", "layer_norm_bwd",
                   present=("weight", "bias")),
    LibraryBackend("liger", "swiglu", "liger", "swiglu_fwd", "swiglu_bwd"),
    LibraryBackend("liger", "geglu", "liger", "geglu_fwd", "geglu_bwd", variants={"approximate": ["tanh"]}),
    # Not Liger's rope: its kernel reads only the first half of cos and sin (it assumes the
    # cat(freqs, freqs) layout, halves equal), where our rope takes any cos and sin; which a
    # call has cannot be known without reading them (a sync), so it could serve wrong answers.
    # Liger's cross-entropy counts the valid rows on the host (.item()): not capturable.
    LibraryBackend("liger", "cross_entropy", "liger", "cross_entropy_fwd", "cross_entropy_bwd", capturable=False,
                   grad_request=True),
    # mean and sum: Liger computes the gradients in its forward; float16 and "none" would need
    # the recomputing backward our op uses there.
    LibraryBackend("liger", "linear_cross_entropy", "liger", "linear_cross_entropy_fwd",
                   "linear_cross_entropy_bwd", dtypes=(torch.float32, torch.bfloat16),
                   variants={"reduction": ["mean", "sum"]}, capturable=False, grad_request=True),
    LibraryBackend("liger", "linear_cross_entropy", "liger_fp32_accum", "linear_cross_entropy_fp32_accum_fwd",
                   "linear_cross_entropy_bwd", dtypes=(torch.float32, torch.bfloat16),
                   variants={"reduction": ["mean", "sum"]}, capturable=False, grad_request=True),
    # FLA's norms refuse rows of more than 64 KiB.
    LibraryBackend("fla", "rms_norm", "fla", "rms_norm_fwd", "rms_norm_bwd", max_row_bytes=65536),
    LibraryBackend("fla", "layer_norm", "fla", "layer_norm_fwd", "layer_norm_bwd", max_row_bytes=65536),
    LibraryBackend("fla", "swiglu", "fla", "swiglu_fwd", "swiglu_bwd"),
    LibraryBackend("fla", "causal_conv1d", "fla", "causal_conv1d_fwd", "causal_conv1d_bwd"),
    # kernel-fun's short conv: the KDA layer's contract (silu, no bias, width <= 4, 16-bit).
    LibraryBackend("kernel_fun", "causal_conv1d", "kernel_fun", "causal_conv1d_fwd", "causal_conv1d_bwd",
                   dtypes=(torch.float16, torch.bfloat16), variants={"activation": ["silu"]},
                   absent=("bias",), max_dims={"width": 4}),
    # FLA's gated delta rule (an adapter module of its own: its code's hash is in these backends'
    # fingerprints only). FLA's kernels take dk <= 256. The fused-recurrent kernel has no backward
    # of ours: it serves calls without gradients.
    LibraryBackend("fla", "gated_delta_rule", "fla_chunk", "chunk_fwd", "chunk_bwd", max_dims={"dk": 256},
                   adapter="fla_gated_delta_rule"),
    LibraryBackend("fla", "gated_delta_rule", "fla_fused_recurrent", "fused_recurrent_fwd", None,
                   max_dims={"dk": 256}, adapter="fla_gated_delta_rule"),
    # FLA's KDA, chunked (the same adapter module: the delta-rule family's calls and backward).
    LibraryBackend("fla", "kda", "fla_chunk", "kda_chunk_fwd", "kda_chunk_bwd", max_dims={"dk": 256},
                   adapter="fla_gated_delta_rule"),
    # quack's CuTe DSL norms (JIT-compiled per dtype and hidden size at the first call: kg.warmup).
    # Its copies move at least 4 bytes: a 16-bit row of odd length fails to compile. add_rms_norm's
    # launch fails for rows over 128 KiB (float32 hidden 65535). Not its other kernels for our ops:
    # cross-entropy and linear cross-entropy (no label smoothing, a scalar the requirements cannot
    # name; the latter also no bias and rows a multiple of 8), layer norm (a float32 weight only),
    # rotary (cos and sin of half the head dim: Liger's rope's assumption, see above).
    LibraryBackend("quack", "rms_norm", "quack", "rms_norm_fwd", "rms_norm_bwd", row_bytes_multiple=4),
    LibraryBackend("quack", "add_rms_norm", "quack", "add_rms_norm_fwd", "add_rms_norm_bwd",
                   row_bytes_multiple=4, max_row_bytes=131072),
]


def release(version: str) -> Tuple[int, ...]:
    """The release numbers of a version string ("0.8.5.post1" -> (0, 8, 5)); a pre-release
    ("0.9.0rc1") counts as its release."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def _within(version: str, tested: Tuple[str, str]) -> bool:
    v = release(version)
    return release(tested[0]) <= v < release(tested[1])


def status(lib: Library) -> Tuple[bool, str, str]:
    """(available, reason, version): the library's distribution installed at a tested version?"""
    try:
        version = importlib.metadata.version(lib.dist)
    except importlib.metadata.PackageNotFoundError:
        return False, f"{lib.dist} is not installed (pip install kernelgate[{lib.extra}])", ""
    if not _within(version, lib.tested):
        return False, (f"{lib.dist} {version} is installed; kernelgate tests {lib.dist} >= {lib.tested[0]}, "
                       f"< {lib.tested[1]} (pip install kernelgate[{lib.extra}])"), version
    return True, "", version


@functools.lru_cache(maxsize=None)
def _adapter_hash(adapter: str) -> str:
    """A hash of the adapter module's code, read without importing it (which would import the
    library): comments and blank lines left out."""
    from .._define import source_hash

    spec = importlib.util.find_spec(f"{__name__}.{adapter}")
    with open(spec.origin, encoding="utf-8") as f:
        return source_hash(f.read())


def install() -> None:
    """Registers every library backend (once per process)."""
    from .. import _C
    from .._define import register_library_backend, requirements

    ops = {o["name"]: o for o in _C.ops()}
    found = {name: status(lib) for name, lib in LIBRARIES.items()}
    for b in BACKENDS:
        available, reason, installed = found[b.library]
        lib = LIBRARIES[b.library]
        adapter = b.adapter or lib.adapter
        module = f"{__name__}.{adapter}"
        version = f"{lib.dist}=={installed};code={_adapter_hash(adapter)}" if available else ""
        register_library_backend(
            b.op, b.name,
            forward=f"{module}:{b.forward}",
            backward=None if b.backward is None else f"{module}:{b.backward}",
            # Several of the libraries' kernels fail on tensors without elements (a grid of 0).
            needs=requirements(ops[b.op], "cuda", b.dtypes, b.variants, b.present, b.capturable,
                               nonempty=True, max_row_bytes=b.max_row_bytes, absent=b.absent,
                               max_dims=b.max_dims, row_bytes_multiple=b.row_bytes_multiple),
            available=available, reason=reason, version=version,
            grad_request=b.grad_request)


def import_check(lib: Library, timeout: float = 300.0) -> Tuple[bool, str]:
    """(imports, error): whether the library's adapter modules import, in a fresh process (an
    import can take seconds, crash or hang: none of that reaches the caller). What a first call
    would find; kernelgate doctor --import-libraries."""
    import subprocess
    import sys

    modules = sorted({f"{__name__}.{b.adapter or lib.adapter}" for b in BACKENDS
                      if LIBRARIES.get(b.library) == lib} or {f"{__name__}.{lib.adapter}"})
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    try:
        done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"importing {', '.join(modules)} did not finish in {timeout:g} s"
    if done.returncode == 0:
        return True, ""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return False, lines[-1] if lines else f"the import exited with code {done.returncode}"


def libraries() -> List[dict]:
    """Each library: its extra, distribution, tested range, installed version and availability."""
    out = []
    for name, lib in LIBRARIES.items():
        available, reason, version = status(lib)
        out.append({"library": name, "extra": lib.extra, "dist": lib.dist, "tested": list(lib.tested),
                    "installed": version, "available": available, "reason": reason,
                    "backends": [f"{b.op}/{b.name}" for b in BACKENDS if b.library == name]})
    return out
