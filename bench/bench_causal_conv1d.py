"""causal_conv1d on the GPU: kernelgate's CUDA kernel vs PyTorch's depthwise conv1d (eager and
torch.compile), FLA's causal_conv1d and kernel-fun's (when importable), forward and
forward+backward (gradients of x and weight), as a fraction of the copy bandwidth measured in the
same run. Default shape: Gated DeltaNet's short conv at B4 T4096 D8192 W4, silu, no bias, bf16.

    python bench/bench_causal_conv1d.py --out bench/results/h200/causal_conv1d.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json


def eager(activation):
    def f(x, w):
        y = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), None, padding=w.shape[1] - 1, groups=x.shape[2])
        y = y[..., : x.shape[1]]
        return (F.silu(y) if activation == "silu" else y).transpose(1, 2)
    return f


def library(module, activation):
    """The library's causal_conv1d (FLA's signature: returns (y, final_state)), or why not."""
    try:
        fn = __import__(module, fromlist=["causal_conv1d"]).causal_conv1d
    except Exception as exc:  # not installed: recorded, not hidden
        return exc
    act = None if activation == "none" else activation
    return lambda x, w: fn(x, w, activation=act)[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--activation", default="silu", choices=["none", "silu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    n = args.batch * args.seq * args.dim
    es = torch.tensor([], dtype=dtype).element_size()
    fwd_bytes, bwd_bytes = 2 * n * es, 3 * n * es  # fwd: x read, y written; bwd: dy, x read, dx written
    kg.policy.add_rule("causal_conv1d", ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
    act = args.activation
    variants = {"kernelgate": lambda x, w: kg.causal_conv1d(x, w, None, act), "eager": eager(act),
                "torch_compile": torch.compile(eager(act))}
    notes = []
    for name, module in [("fla", "fla.modules.convolution"), ("kernel_fun", "kernel_fun.cconv")]:
        f = library(module, act)
        if callable(f):
            variants[name] = f
        else:
            notes.append(f"{name} not measured: {f!r}")
    x = torch.randn(args.batch, args.seq, args.dim, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(args.dim, args.width, device="cuda", dtype=dtype) / args.width ** 0.5).requires_grad_()
    dy = torch.randn_like(x)
    assert kg.explain("causal_conv1d", x.detach(), w.detach(), None, act).backend == "kernelgate_cuda"
    records = []
    for name, f in variants.items():
        shape = [args.batch, args.seq, args.dim, args.width]
        try:
            r = measure_fwd_bwd(f, (x, w), dy, fwd_bytes, bwd_bytes, copy_bw)
            # The backward alone, as forward+backward less forward (the target is on it).
            bwd_ms = r["fwdbwd_ms"] - r["fwd_ms"]
            r["bwd_frac_copy_bw_derived"] = bwd_bytes / (bwd_ms * 1e-3) / 1e9 / copy_bw if bwd_ms > 0 else None
            records.append({"variant": name, "shape": shape, "dtype": args.dtype, "activation": act, **r})
        except Exception as exc:  # a library that fails here is a result
            notes.append(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}")
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "fwd: x read + y written; bwd: dy, x read + dx written (weight and its "
                             "gradient are dim x width: not counted)",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["variant", "fwd_ms", "fwd_frac_copy_bw", "fwdbwd_ms", "fwdbwd_frac_copy_bw",
                          "bwd_frac_copy_bw_derived"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
