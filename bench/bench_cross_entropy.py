"""cross_entropy on the GPU: kernelgate's CUDA kernels vs eager F.cross_entropy, torch.compile of
it and Liger-Kernel's cross entropy (when importable), forward and forward+backward, as a
fraction of the copy bandwidth measured in the same run (2 GiB copy and a copy of the same bytes).

Byte model (the lower bound of any implementation that keeps no logits-sized intermediate):
  forward:           logits read once + target read (+ a few bytes per row)
  forward+backward:  logits read twice (forward, backward) + grad written once + target twice

    cd bench && python bench_cross_entropy.py --out results/h200/cross_entropy.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import copy_bandwidth_gbps, environment, measure_fwd_bwd, print_table, write_json


def liger():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        return LigerCrossEntropyLoss()
    except Exception as exc:  # not installed: recorded, not hidden
        return exc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--classes", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of rows with target = ignore_index")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    rows, classes = args.rows, args.classes
    es = torch.tensor([], dtype=dtype).element_size()
    logits_bytes = rows * classes * es
    fwd_bytes = logits_bytes + rows * 8
    bwd_bytes = 2 * logits_bytes + rows * 8
    kg.policy.add_rule("cross_entropy", ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
    x = torch.randn(rows, classes, device="cuda", dtype=dtype, requires_grad=True)
    t = torch.randint(0, classes, (rows,), device="cuda")
    t[torch.rand(rows, device="cuda") < args.ignore_frac] = -100
    dy = torch.randn((), device="cuda", dtype=dtype)
    assert kg.explain("cross_entropy", x, t).backend == "kernelgate_cuda"
    eager = lambda logits: F.cross_entropy(logits, t)  # noqa: E731
    variants = {
        "kernelgate": lambda logits: kg.cross_entropy(logits, t),
        "eager": eager,
        "torch_compile": torch.compile(eager),
    }
    notes = []
    lig = liger()
    if callable(lig):
        # Liger writes the gradient into the logits during the forward: give it its own copy.
        xl = x.detach().clone().requires_grad_(True)
        variants["liger"] = (lambda logits: lig(logits, t), xl)
    else:
        notes.append(f"liger not measured: {lig!r}")
    records = []
    for name, v in variants.items():
        f, inp = (v if isinstance(v, tuple) else (v, x))
        rec = measure_fwd_bwd(f, (inp,), dy, fwd_bytes, bwd_bytes, copy_bw)
        records.append({"op": "cross_entropy", "shape": [rows, classes], "dtype": args.dtype,
                        "ignore_frac": args.ignore_frac, "variant": name, **rec})
    # Correctness in the benchmark run: kernelgate against eager on the benchmark shape.
    with torch.no_grad():
        diff = (kg.cross_entropy(x, t).float() - F.cross_entropy(x, t).float()).abs().item()
    notes.append(f"|loss(kernelgate) - loss(eager)| = {diff:.3e}")
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "fwd: logits read + target read; fwd+bwd: logits read twice + grad written "
                             "+ target read twice (lse, losses: a few bytes per row, not counted)",
               "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["variant", "fwd_ms", "fwd_frac_copy_bw", "fwdbwd_ms", "fwdbwd_frac_copy_bw",
                          "fwdbwd_peak_extra_mib"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
