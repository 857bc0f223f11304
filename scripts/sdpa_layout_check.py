"""PyTorch's F.scaled_dot_product_attention on q of the layouts the attention sweep found it wrong
on (H200, bf16, with gradients: bench/results/h200/sweep_attention.json, docs/evidence.md), written
without kernelgate: q with padded rows (the row stride head_dim + 5) and q one element into its
storage, against attention in float64, with and without gradients, and with each of SDPA's
kernels enabled alone. Prints a table and writes JSON:

    python3 scripts/sdpa_layout_check.py --out $OUT/sdpa_layout_check.json
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_checks import definition, in_own_process, rel_l2

B, HKV, G, S, D = 4, 4, 4, 256, 128


def laid_out(x, layout):
    """x (dense) as a q of that layout: the same values, other strides or start."""
    if layout == "contiguous":
        return x.clone()
    if layout == "row_strided":
        store = torch.randn(*x.shape[:-1], x.shape[-1] + 5, device=x.device, dtype=x.dtype)
        store[..., : x.shape[-1]] = x
        return store[..., : x.shape[-1]]
    if layout == "offset":
        store = torch.randn(x.numel() + 1, device=x.device, dtype=x.dtype)
        store[1:] = x.reshape(-1)
        return store[1:].view(x.shape)
    raise ValueError(layout)


BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH}


def one(layout, grad, name):
    """One SDPA call on q of that layout, in this process; the row of what it gave."""
    gen = torch.Generator().manual_seed(0)
    q64, k64, v64 = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64).cuda()
                     for h in (HKV * G, HKV, HKV))
    want = definition(q64, k64, v64)
    q = laid_out(q64.bfloat16(), layout).requires_grad_(grad)
    k, v = k64.bfloat16(), v64.bfloat16()
    row = {"layout": layout, "grad": grad, "sdpa": name, "q_strides": list(q.stride()),
           "q_offset_bytes": q.data_ptr() % 16}
    backend = BACKENDS[name]
    try:
        ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
        with ctx, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
        row["kernels"] = sorted({e.name[:80] for e in prof.events() if e.device_type.name == "CUDA"
                                 and any(w in e.name.lower() for w in ("flash", "fmha", "cudnn", "attention", "sm90", "gemm"))})
        row["o_rel_l2"] = rel_l2(o, want)
    except Exception as e:  # a kernel that refuses the layout: recorded
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1] == "1", a.one[2])))
        return
    rows = []
    # Each call in its own process: a kernel that faults the device ends only its own row.
    for layout in ("contiguous", "row_strided", "offset"):
        for grad in (False, True):
            for name in BACKENDS:
                row = in_own_process([sys.executable, __file__, "--one", layout, str(int(grad)), name])
                if "error" in row:
                    row = {"layout": layout, "grad": grad, "sdpa": name, **row}
                rows.append(row)
                print(f"{layout:12s} grad={int(grad)} {name:10s} "
                      + (f"o rel L2 {row['o_rel_l2']:.3e} {row.get('kernels', [])[:2]}" if "o_rel_l2" in row
                         else row["error"]), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "shape": [B, HKV * G, HKV, S, D],
           "command": "python3 " + " ".join(sys.argv), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
