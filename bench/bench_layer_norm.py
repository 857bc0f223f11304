"""layer_norm on the GPU: kernelgate's CUDA kernel vs torch.nn.functional.layer_norm (eager),
torch.compile of it and Liger-Kernel's layer norm (when importable), forward and forward+backward
(gradients of x, weight and bias), as a fraction of the copy bandwidth measured in the same run
(a 2 GiB copy and a copy of the same bytes).

    cd bench && python bench_layer_norm.py --out results/h200/layer_norm.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json

EPS = 1e-5


def eager(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception as exc:  # not installed: recorded, not hidden
        return exc
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)


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
    kg.policy.add_rule("layer_norm", ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
    variants = {
        "kernelgate": lambda x, w, b: kg.layer_norm(x, w, b, EPS),
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
        fwd_bytes = (2 * n + 2 * hidden) * es  # x, weight, bias read; y written
        # dy, x read, dx written; weight read, dweight and dbias written; mean and rstd read
        bwd_bytes = (3 * n + 3 * hidden) * es + args.rows * 8
        x = torch.randn(args.rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        assert kg.explain("layer_norm", x.detach(), w.detach(), b.detach()).backend == "kernelgate_cuda"
        for name, f in variants.items():
            records.append({"op": "layer_norm", "shape": [args.rows, hidden], "dtype": args.dtype, "variant": name,
                            **measure_fwd_bwd(f, (x, w, b), dy, fwd_bytes, bwd_bytes, copy_bw)})
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "fwd: x, weight, bias read + y written; bwd: dy, x read + dx written, weight read, "
                             "dweight and dbias written, mean and rstd read; fwdbwd = fwd + bwd",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  torch {env['torch']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["shape", "variant", "fwd_ms", "fwd_frac_copy_bw", "fwd_frac_same_bytes_copy",
                          "fwdbwd_ms", "fwdbwd_frac_copy_bw", "fwdbwd_frac_same_bytes_copy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
