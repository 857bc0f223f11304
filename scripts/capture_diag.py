"""Why a library backend's forward+backward fails CUDA-graph capture: the library called directly
(its own autograd Function) and routed through kernelgate, each captured and replayed as the
contract test does, with the stream and thread the adapter's backward runs on, in warm-up and in
capture. For a GPU session with little time:

    python3 scripts/capture_diag.py rms_norm fla [layer_norm liger ...]
"""

import importlib
import sys
import threading
import traceback

import torch

import kernelgate as kg
from kernelgate import backends
from kernelgate.testing import assert_cuda_graph_replays

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0] + "/bench")
from library_calls import DIRECT  # noqa: E402


def attempt(label, fn, leaves):
    cots = []

    def step():
        outs = fn()
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        if not cots:
            cots.extend(torch.randn_like(o) for o in outs)
        return outs + list(torch.autograd.grad(outs, leaves, cots))

    def refill():
        for t in leaves + cots:
            t.copy_(torch.randn_like(t))

    try:
        step()
        assert_cuda_graph_replays(step, refill)
        print(f"  {label}: captured and replayed", flush=True)
    except Exception as exc:  # noqa: BLE001 -- the diagnosis is the exception
        chain, e = [], exc
        while e is not None:
            chain.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            e = e.__cause__ or e.__context__
        print(f"  {label}: FAILED: " + " <- ".join(chain), flush=True)
        print("    " + "".join(traceback.format_tb(exc.__traceback__)[-3:]).replace("\n", "\n    "), flush=True)


def main(pairs):
    for op, name in pairs:
        print(f"== {op} / {name}", flush=True)
        make, direct = DIRECT[op, name]
        args = make()
        leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        attempt("library directly", lambda: direct(*args), leaves)

        b = next(b for b in backends.BACKENDS if (b.op, b.name) == (op, name))
        module = importlib.import_module(f"kernelgate.backends.{backends.LIBRARIES[b.library].adapter}")
        inner = getattr(module, b.backward)
        seen = []

        def spy(*a, inner=inner, seen=seen):
            seen.append((threading.current_thread().name, torch.cuda.current_stream().cuda_stream,
                         torch.cuda.is_current_stream_capturing()))
            return inner(*a)

        setattr(module, b.backward, spy)  # resolved at the first call: patch before it
        with kg.use(force={op: name}):
            kg.warmup(op, *args)
            attempt("routed", lambda: getattr(kg, op)(*args), leaves)
        setattr(module, b.backward, inner)
        print(f"    adapter backward calls (thread, stream, capturing): {sorted(set(seen))}", flush=True)
        print(f"    main thread stream: {torch.cuda.current_stream().cuda_stream}", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(list(zip(a[0::2], a[1::2])))
