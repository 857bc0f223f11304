"""rms_norm on the GPU: kernelgate's CUDA kernel vs torch.nn.functional.rms_norm (ATen) and
torch.compile of the reference, forward and forward+backward, as a fraction of the copy bandwidth
measured in the same run. Two copy references are recorded: a large (2 GiB) copy, the card's
sustained rate, and a copy that moves the same number of bytes as the op (same launch and tail
effects), which is the roofline for moving that much data in one pass.

    python bench/bench_rms_norm.py --out bench/results/h200/rms_norm.json
"""

import argparse
import sys

import torch

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json


def reference(x, w, eps: float = 1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    compiled_ref = torch.compile(reference)
    kg.policy.add_rule("rms_norm", ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
    variants = {
        "kernelgate": lambda x, w: kg.rms_norm(x, w, 1e-6),
        "aten": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "torch_compile": compiled_ref,
    }
    records = []
    for hidden in args.hidden:
        n = args.rows * hidden
        es = torch.tensor([], dtype=dtype).element_size()
        fwd_bytes = (2 * n + hidden) * es + 0  # x read, y written, weight read
        bwd_bytes = (3 * n + 2 * hidden) * es + args.rows * 4  # dy, x read; dx written; w, dw; rstd
        x = torch.randn(args.rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(args.rows, hidden, device="cuda", dtype=dtype)
        for name, f in variants.items():
            assert name != "kernelgate" or kg.explain("rms_norm", x.detach(), w.detach()).backend == "kernelgate_cuda"
            records.append({"op": "rms_norm", "shape": [args.rows, hidden], "dtype": args.dtype, "variant": name,
                            **measure_fwd_bwd(f, (x, w), dy, fwd_bytes, bwd_bytes, copy_bw)})
    payload = {**env, "copy_bw_GBps": copy_bw,
               "byte_model": "fwd: x read + y written + weight read; bwd: dy and x read, dx written, "
                             "weight read, dweight written, rstd read; fwdbwd = fwd + bwd",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  torch {env['torch']}  copy bandwidth {copy_bw:.0f} GB/s")
    print_table(records, ["shape", "variant", "fwd_ms", "fwd_frac_copy_bw", "fwd_frac_same_bytes_copy",
                          "fwdbwd_ms", "fwdbwd_frac_copy_bw", "fwdbwd_frac_same_bytes_copy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
