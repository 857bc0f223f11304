"""ATen's cuDNN attention called directly (as kernelgate's aten_cudnn backend calls it), without
kernelgate: q, k, v and the output gradient dense [batch, heads, seq, head_dim] or as attention
code holds them (views of [batch, seq, heads, head_dim]), kv heads grouped (GQA) or repeated per
query head, and the log-sum-exp handed to the backward as the forward returned it or re-laid
dense; o, dq, dk, dv against attention in float64. Prints a table and writes JSON:

    python3 scripts/cudnn_attention_check.py --out $OUT/cudnn_attention_check.json
"""

import argparse
import json
import sys

import torch

from attention_checks import definition, rel_l2

aten = torch.ops.aten


def laid(x, layout):
    if layout == "dense":
        return x.contiguous()
    return x.transpose(1, 2).contiguous().transpose(1, 2)  # a view of [batch, seq, heads, head_dim]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for shape in [(2, 8, 2, 512, 128), (4, 16, 4, 2048, 128)]:
        b, h, hkv, s, d = shape
        group = h // hkv
        gen = torch.Generator().manual_seed(0)
        q64, k64, v64, do64 = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64).cuda()
                               for n in (h, hkv, hkv, h))
        leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
        want = definition(*leaves)
        want_g = torch.autograd.grad(want, leaves, do64)
        for layout in ("dense", "bshd"):
            for kv in ("gqa", "repeated"):
                q, k, v, do = (laid(t.bfloat16(), layout) for t in (q64, k64, v64, do64))
                if kv == "repeated":
                    k, v = (laid(t.repeat_interleave(group, dim=1), layout) for t in (k, v))
                o, lse, *_rest = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
                seed, offset = _rest[4], _rest[5]
                base = {"shape": shape, "layout": layout, "kv": kv, "o_strides": list(o.stride()),
                        "lse_shape": list(lse.shape), "lse_strides": list(lse.stride()),
                        "o_rel_l2": rel_l2(o, want)}
                g = do if do.stride() == o.stride() else torch.empty_like(o).copy_(do)  # dout in o's layout
                for lse_mode in ("as_returned", "dense"):
                    l = lse if lse_mode == "as_returned" else lse.clone(memory_format=torch.contiguous_format)
                    row = dict(base, lse_mode=lse_mode, lse_given_strides=list(l.stride()))
                    try:
                        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                            g, q, k, v, o, l, seed, offset, None, None, None, s, s, 0.0, True)
                        if kv == "repeated":
                            dk = dk.unflatten(1, (hkv, group)).sum(2)
                            dv = dv.unflatten(1, (hkv, group)).sum(2)
                        row.update(dq=rel_l2(dq, want_g[0]), dk=rel_l2(dk, want_g[1]), dv=rel_l2(dv, want_g[2]),
                                   dq_strides=list(dq.stride()))
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    rows.append(row)
                    print(f"{str(shape):22s} {layout:5s} {kv:8s} lse {lse_mode:11s} {str(list(lse.stride())):18s} "
                          f"o {row['o_rel_l2']:.2e} " + (f"dq {row['dq']:.2e} dk {row['dk']:.2e} dv {row['dv']:.2e}"
                                                         if "dq" in row else row["error"]), flush=True)
        del q64, k64, v64, do64, leaves, want, want_g
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "command": "python3 " + " ".join(sys.argv),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
