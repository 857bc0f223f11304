"""swiglu and geglu on the GPU: kernelgate's CUDA kernel vs eager PyTorch, torch.compile of the
reference and Liger-Kernel (when importable), forward and forward+backward, as a fraction of the
copy bandwidth measured in the same run (2 GiB copy and a copy of the same bytes).

    python bench/bench_gated.py --out bench/results/h200/gated.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json


def eager(op):
    if op == "swiglu":
        return lambda g, u: F.silu(g) * u
    return lambda g, u: F.gelu(g, approximate="tanh") * u


def liger(op):
    try:
        if op == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    except Exception as exc:  # not installed: recorded, not hidden
        return exc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    n = args.rows * args.hidden
    es = torch.tensor([], dtype=dtype).element_size()
    fwd_bytes, bwd_bytes = 3 * n * es, 5 * n * es  # fwd: g, u read, out written; bwd: dy, g, u read, dg, du written
    records, notes = [], []
    for op in ["swiglu", "geglu"]:
        kg.policy.add_rule(op, ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
        variants = {"kernelgate": getattr(kg, op), "eager": eager(op), "torch_compile": torch.compile(eager(op))}
        lig = liger(op)
        if callable(lig):
            variants["liger"] = lig
        else:
            notes.append(f"liger not measured for {op}: {lig!r}")
        g = torch.randn(args.rows, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
        u = torch.randn_like(g, requires_grad=True)
        dy = torch.randn_like(g)
        assert kg.explain(op, g.detach(), u.detach()).backend == "kernelgate_cuda"
        for name, f in variants.items():
            records.append({"op": op, "shape": [args.rows, args.hidden], "dtype": args.dtype, "variant": name,
                            **measure_fwd_bwd(f, (g, u), dy, fwd_bytes, bwd_bytes, copy_bw)})
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "fwd: gate, up read + out written; bwd: dy, gate, up read + dgate, dup written",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["op", "variant", "fwd_ms", "fwd_frac_copy_bw", "fwdbwd_ms", "fwdbwd_frac_copy_bw"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
