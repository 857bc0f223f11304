"""add_rms_norm on the GPU: kernelgate's fused CUDA kernel vs the eager pattern
`h = x + r; y = F.rms_norm(h, ...)`, torch.compile of that pattern and Liger-Kernel's RMSNorm after
a separate add (when importable), forward and forward+backward (cotangents on both y and h), as a
fraction of the copy bandwidth measured in the same run (a 2 GiB copy and a copy of the same bytes).

    cd bench && python bench_add_rms_norm.py --out results/h200/add_rms_norm.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json

EPS = 1e-6


def eager(x, r, w):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def liger():
    """Liger's RMSNorm after a separate add, or the reason it cannot be measured."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # not installed: recorded, not hidden
        return exc

    def f(x, r, w):
        h = x + r
        # offset 0, llama casting, not in place (in place would overwrite the reused cotangent)
        return LigerRMSNormFunction.apply(h, w, EPS, 0.0, "llama", False), h

    return f


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 2048, 8192])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    kg.policy.add_rule("add_rms_norm", ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
    variants = {
        "kernelgate": lambda x, r, w: kg.add_rms_norm(x, r, w, EPS),
        "eager": eager,
        "torch_compile": torch.compile(eager),
    }
    notes = []
    lig = liger()
    if callable(lig):
        variants["liger"] = lig
    else:
        notes.append(f"liger not measured: {lig!r}")
    records = []
    for hidden in args.hidden:
        n = args.rows * hidden
        es = torch.tensor([], dtype=dtype).element_size()
        fwd_bytes = (4 * n + hidden) * es  # x, residual, weight read; y, h written
        # dy, dh, h read; one dx written (it is the gradient of x and of residual); weight read,
        # dweight written; rstd read
        bwd_bytes = (4 * n + 2 * hidden) * es + args.rows * 4
        x = torch.randn(args.rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
        r = torch.randn(args.rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        cots = (torch.randn_like(x), torch.randn_like(x))
        assert kg.explain("add_rms_norm", x.detach(), r.detach(), w.detach()).backend == "kernelgate_cuda"
        for name, f in variants.items():
            records.append({"op": "add_rms_norm", "shape": [args.rows, hidden], "dtype": args.dtype, "variant": name,
                            **measure_fwd_bwd(f, (x, r, w), cots, fwd_bytes, bwd_bytes, copy_bw)})
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "fwd: x, residual, weight read + y, h written; bwd: dy, dh, h read + dx written "
                             "once (shared by x and residual), weight read, dweight written, rstd read; "
                             "fwdbwd = fwd + bwd",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  torch {env['torch']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["shape", "variant", "fwd_ms", "fwd_frac_copy_bw", "fwd_frac_same_bytes_copy",
                          "fwdbwd_ms", "fwdbwd_frac_copy_bw", "fwdbwd_frac_same_bytes_copy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
