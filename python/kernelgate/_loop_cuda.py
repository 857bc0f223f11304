"""CUDA-source candidates of the loop: a .cu file with C entry points on plain pointers, sizes,
strides and a stream (no torch headers, so it builds in seconds), built with nvcc at each try and
wrapped as a Python backend. The entry points and their struct are HEADER's; ``kernelgate loop``
writes it beside the build as ``kernelgate_loop.h``.

kg_forward gets the op's tensor arguments in schema order (an absent optional has data NULL), its
float / int / bool arguments as doubles and its str arguments as the index of their value among
the op's variants (``kg.ops()``: ``variant_args``), and fills `outputs`: the op's outputs, then its
extras when `needs` is nonzero (bit i: tensor argument i needs a gradient), allocated contiguous
by kernelgate in the shapes its Meta functions give. kg_backward, optional, gets the backward's
tensor arguments (the output gradients, then what the forward saved) and fills one gradient per
differentiable tensor argument. Both return 0, or nonzero with a message in `err`.
"""

import ctypes
import os
import shutil
import subprocess
from typing import List, Optional, Tuple

import torch

HEADER = r"""#pragma once
#include <stdint.h>

enum { KG_FLOAT32 = 0, KG_FLOAT16 = 1, KG_BFLOAT16 = 2, KG_FLOAT64 = 3, KG_INT64 = 4, KG_INT32 = 5, KG_BOOL = 6 };

typedef struct {
  void* data;          /* NULL: an absent optional tensor */
  int32_t dtype;       /* KG_* */
  int32_t ndim;        /* at most 8 */
  int64_t sizes[8];
  int64_t strides[8];  /* in elements */
} kg_tensor;

#ifdef __cplusplus
extern "C" {
#endif
int kg_forward(const kg_tensor* tensors, int n_tensors, const double* scalars, int n_scalars,
               const int* strings, int n_strings, kg_tensor* outputs, int n_outputs, int needs,
               void* stream, char* err, int err_len);
int kg_backward(const kg_tensor* tensors, int n_tensors, const double* scalars, int n_scalars,
                const int* strings, int n_strings, kg_tensor* grads, int n_grads, int needs,
                void* stream, char* err, int err_len);
#ifdef __cplusplus
}
#endif
"""

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int64: 4,
           torch.int32: 5, torch.bool: 6}


class KgTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("sizes", ctypes.c_int64 * 8), ("strides", ctypes.c_int64 * 8)]


# kg_forward's and kg_backward's parameters (HEADER).
_ENTRY = [ctypes.POINTER(KgTensor), ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_int,
          ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.POINTER(KgTensor), ctypes.c_int, ctypes.c_int,
          ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]


def arch() -> str:
    """The architecture to build for: KERNELGATE_LOOP_CUDA_ARCH, else the visible GPU's, else sm_90a."""
    if os.environ.get("KERNELGATE_LOOP_CUDA_ARCH"):
        return os.environ["KERNELGATE_LOOP_CUDA_ARCH"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return "sm_90a"


_built = {}  # source path -> library, in this process (the A/A twin reuses it)


def build(source: str, out_dir: str) -> str:
    """nvcc: the shared library's path, or RuntimeError with the compiler's output."""
    if source in _built:
        return _built[source]
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH (nor in /usr/local/cuda/bin): a .cu candidate needs the CUDA toolkit")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernelgate_loop.h"), "w") as f:
        f.write(HEADER)
    lib = os.path.join(out_dir, "candidate.so")
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch()}", "-I", out_dir,
           "-o", lib, source]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("nvcc failed:\n" + (p.stderr or p.stdout).strip()[-4000:])
    _built[source] = lib
    return lib


def _as_kg(t: Optional[torch.Tensor]) -> KgTensor:
    k = KgTensor()
    if t is None:
        return k
    if t.dtype not in _DTYPES or t.dim() > 8:
        raise TypeError(f"a .cu candidate takes tensors of {', '.join(map(str, _DTYPES))} of at most 8 dims, "
                        f"got {t.dtype} with {t.dim()}")
    k.data, k.dtype, k.ndim = t.data_ptr(), _DTYPES[t.dtype], t.dim()
    for i, (s, st) in enumerate(zip(t.shape, t.stride())):
        k.sizes[i], k.strides[i] = s, st
    return k


def _is_tensor(t) -> bool:
    """A Tensor or a Tensor? argument (whose type prints as Optional[Tensor])."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _split(schema: str, values: tuple, variants: dict) -> Tuple[List, List[float], List[int]]:
    """A call's arguments by kind, as the entry points take them."""
    args = torch._C.parse_schema(schema).arguments[:-1]  # the trailing needs is not the callables'
    tensors, scalars, strings = [], [], []
    for a, v in zip(args, values):
        kind = str(a.type)
        if _is_tensor(a.type):
            tensors.append(v)
        elif kind == "str":
            strings.append(variants[a.name].index(v))
        else:
            scalars.append(float(v))
    return tensors, scalars, strings


def _meta(v):
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v


def wrap(info: dict, lib_path: str):
    """(forward, backward or None) of the built library, in the Python backend protocol; forward
    takes needs_grad= (register it with grad_request=True)."""
    lib = ctypes.CDLL(lib_path)
    variants = dict(info["variant_args"])
    op = info["name"]
    fwd_meta = getattr(torch.ops.kernelgate, f"_{op}_fwd")
    bwd_meta = getattr(torch.ops.kernelgate, f"_{op}_bwd")
    n_out = len(info["outputs"])
    entries = {}
    for name in ("kg_forward", "kg_backward"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = _ENTRY, ctypes.c_int
            entries[name] = fn

    def call(fn, split, results, needs, device):
        tensors, scalars, strings = split
        kt = (KgTensor * max(1, len(tensors)))(*[_as_kg(t) for t in tensors])
        ko = (KgTensor * max(1, len(results)))(*[_as_kg(t) for t in results])
        sc = (ctypes.c_double * max(1, len(scalars)))(*scalars)
        st = (ctypes.c_int * max(1, len(strings)))(*strings)
        err = ctypes.create_string_buffer(1024)
        stream = torch.cuda.current_stream(device).cuda_stream
        rc = fn(kt, len(tensors), sc, len(scalars), st, len(strings), ko, len(results), needs,
                ctypes.c_void_p(stream), err, len(err))
        if rc != 0:
            raise RuntimeError(f"{fn.__name__} returned {rc}: {err.value.decode(errors='replace') or '(no message)'}")

    def empty_like_meta(m, device):
        return None if m is None else torch.empty(m.shape, dtype=m.dtype, device=device)

    if "kg_forward" not in entries:
        raise AttributeError("the library defines no kg_forward")

    def forward(*args, needs_grad=()):
        split = _split(info["forward_schema"], args, variants)
        device = next(t for t in split[0] if t is not None).device
        needs = sum(1 << i for i, name in enumerate(info["tensor_args"]) if name in needs_grad)
        metas = fwd_meta(*[_meta(a) for a in args], needs)
        metas = list(metas) if isinstance(metas, (tuple, list)) else [metas]
        results = [empty_like_meta(m, device) for m in (metas if needs else metas[:n_out])]
        call(entries["kg_forward"], split, results, needs, device)
        return results[0] if len(results) == 1 else tuple(results)

    backward = None
    if "kg_backward" in entries:
        n_grad = len(info["gradients"])

        def backward(*args):
            device = next(a for a in args if isinstance(a, torch.Tensor)).device
            needs = (1 << len(info["tensor_args"])) - 1
            metas = bwd_meta(*[_meta(a) for a in args], needs)
            metas = list(metas) if isinstance(metas, (tuple, list)) else [metas]
            grads = [empty_like_meta(m, device) for m in metas[:n_grad]]
            call(entries["kg_backward"], _split(info["backward_schema"], args, variants), grads, needs, device)
            return grads[0] if len(grads) == 1 else tuple(grads)

    return forward, backward
