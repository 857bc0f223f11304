"""PyTorch's SDPA with its cuDNN kernel (forced), twice in one process on q, k, v of the same
sizes and strides, the output gradient laid out differently the second time: the gradients of
each call against attention in float64. ATen caches cuDNN's compiled backward by the sizes and
strides of q, k and v alone; if the output gradient's strides are built into it, the second call
reads its gradient with the first call's strides. Both orders, each in its own process. Writes JSON:

    python3 scripts/cudnn_graph_cache_check.py --out $OUT/cudnn_graph_cache_check.json
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_checks import definition, in_own_process, rel_l2

B, H, HKV, S, D = 2, 8, 2, 512, 128


def call(dout_layout, seed):
    """One SDPA call as a model with kernelgate's rope makes it (q, k dense [batch, heads, seq,
    head_dim], v a view of [batch, seq, heads, head_dim]); the output gradient dense or a view of
    [batch, seq, heads, head_dim]. Relative L2 errors of dq, dk, dv."""
    gen = torch.Generator().manual_seed(seed)
    q64, k64, v64, do64 = (torch.randn(B, n, S, D, generator=gen, dtype=torch.float64).cuda()
                           for n in (H, HKV, HKV, H))
    leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
    want = torch.autograd.grad(definition(*leaves), leaves, do64)
    q, k = (t.bfloat16().requires_grad_(True) for t in (q64, k64))
    v = v64.bfloat16().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    do = do64.bfloat16()
    if dout_layout == "bshd":
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = torch.autograd.grad(o, (q, k, v), do)
    return {"dout": dout_layout, "dout_strides": list(do.stride()), "o_strides": list(o.stride()),
            **{n: rel_l2(g, w) for n, g, w in zip(("dq", "dk", "dv"), got, want)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--order", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.order:
        print(json.dumps([call(layout, seed) for seed, layout in enumerate(a.order)]))
        return
    runs = []
    for order in (("dense", "bshd"), ("bshd", "dense")):
        got = in_own_process([sys.executable, __file__, "--order", *order])
        rows = got if isinstance(got, list) else [got]
        runs.append({"order": list(order), "calls": rows})
        for i, r in enumerate(rows):
            print(f"order {order}: call {i + 1} " + (f"dout {r['dout']:5s} dq {r['dq']:.2e} dk {r['dk']:.2e} dv {r['dv']:.2e}"
                                                      if "dq" in r else r["error"]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "shape": [B, H, HKV, S, D],
                       "command": "python3 " + " ".join(sys.argv), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
