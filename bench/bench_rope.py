"""rope and qk_norm_rope on the GPU: kernelgate's CUDA kernels vs the eager reference (float32
math, as the oracle's definition), torch.compile of it, the Hugging Face formulation (math in
the input dtype, what Llama code runs) and Liger-Kernel (when importable), forward and
forward+backward, as a fraction of the copy bandwidth measured in the same run.

Two layouts of q and k, given to every variant alike: "bhsd" (contiguous [b, h, s, d]) and
"bshd" (a [b, s, h, d] projection output viewed as [b, h, s, d], the layout attention code
produces). Liger's rope works on the [b, s, h, d] storage: for "bhsd" it first copies q and k
into that layout (its own cost, counted), for "bshd" it rotates q and k in place. Liger assumes
the two halves of cos / sin are equal (true for real rotary tables, which all variants get) and
takes cos / sin as [1, seq, head_dim] like kernelgate, so no input is adapted for it. Liger has
no fused qk-norm + rope: its row is LigerRMSNormFunction per head followed by its rope.

    cd bench && python bench_rope.py --out results/h200/rope.json
"""

import argparse
import sys

import torch

import kernelgate as kg
from common import (copy_bandwidth_gbps, environment, measure_fwd_bwd, plain_rope, print_table, rotate_half,
                    write_json)


def rope_reference(q, k, cos, sin):
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    qf, kf = q.float(), k.float()
    return (qf * c + rotate_half(qf) * s).to(q.dtype), (kf * c + rotate_half(kf) * s).to(k.dtype)


def head_rms_norm(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()


def norm_reference(q, k, qw, kw, cos, sin, eps=1e-6):
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    qn, kn = head_rms_norm(q, qw, eps), head_rms_norm(k, kw, eps)
    return (qn * c + rotate_half(qn) * s).to(q.dtype), (kn * c + rotate_half(kn) * s).to(k.dtype)


def norm_hf(q, k, qw, kw, cos, sin, eps=1e-6):
    # Qwen3: RMSNorm on each head (float32 inside, output in the input dtype), then rope.
    return plain_rope(head_rms_norm(q, qw, eps).to(q.dtype), head_rms_norm(k, kw, eps).to(k.dtype), cos, sin)


def liger_variants():
    """{op: callable or the exception that kept Liger out}."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as exc:  # not installed: recorded, not hidden
        return {"rope": exc, "qk_norm_rope": exc}

    def rope(q, k, cos, sin):
        out = LigerRopeFunction.apply(q, k, cos, sin)
        return out[0], out[1]

    out = {"rope": rope}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        def norm(q, k, qw, kw, cos, sin, eps=1e-6):
            return rope(LigerRMSNormFunction.apply(q, qw, eps), LigerRMSNormFunction.apply(k, kw, eps), cos, sin)

        out["qk_norm_rope"] = norm
    except Exception as exc:
        out["qk_norm_rope"] = exc
    return out


def rotary_tables(seq, d, dtype):
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d)
    ang = torch.arange(seq, dtype=torch.float32, device="cuda")[:, None] * inv
    ang = torch.cat([ang, ang], dim=-1)[None]  # [1, seq, head_dim]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layouts", nargs="+", default=["bhsd", "bshd"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    es = torch.tensor([], dtype=dtype).element_size()
    env = environment("python " + " ".join(sys.argv))
    copy_bw = copy_bandwidth_gbps()
    b, s, hq, hkv, d = a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim
    qk = (b * hq + b * hkv) * s * d * es  # q and k together, in bytes
    cs = 2 * s * d * es                   # cos and sin ([1, seq, head_dim] each)
    w = 2 * d * es                        # q_weight and k_weight
    rstd = (b * hq + b * hkv) * s * 4     # float32 per (b, h, s) row
    byte_model = {
        # rope: fwd reads q, k, cos, sin and writes the outputs; bwd reads dq_out, dk_out, cos, sin
        # and writes dq, dk.
        "rope": (2 * qk + cs, 2 * qk + cs),
        # qk_norm_rope: fwd also reads the weights (and, under autograd, writes rstd: counted in
        # the backward's share); bwd reads dy, x, weights, cos, sin, rstd and writes dx, dweights.
        "qk_norm_rope": (2 * qk + cs + w, 3 * qk + cs + 2 * w + 2 * rstd),
    }
    cos, sin = rotary_tables(s, d, dtype)
    liger = liger_variants()
    records, notes = [], []
    for op in ["rope", "qk_norm_rope"]:
        kg.policy.add_rule(op, ["kernelgate_cuda"], evidence="benchmark: kernelgate_cuda under test")
        if op == "rope":
            variants = {"kernelgate": kg.rope, "eager_reference": rope_reference,
                        "torch_compile": torch.compile(rope_reference), "eager_hf": plain_rope}
        else:
            variants = {"kernelgate": kg.qk_norm_rope, "eager_reference": norm_reference,
                        "torch_compile": torch.compile(norm_reference), "eager_hf": norm_hf}
        if callable(liger[op]):
            variants["liger"] = liger[op]
        else:
            notes.append(f"liger not measured for {op}: {liger[op]!r}")
        fwd_bytes, bwd_bytes = byte_model[op]
        for layout in a.layouts:
            gen = torch.Generator(device="cuda").manual_seed(0)
            if layout == "bhsd":
                ql = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, generator=gen)
                kl = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=gen)
                view = lambda t: t  # noqa: E731
            else:
                ql = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=gen)
                kl = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=gen)
                view = lambda t: t.transpose(1, 2)  # noqa: E731
            ql.requires_grad_(True)
            kl.requires_grad_(True)
            qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
            kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
            gq = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, generator=gen)
            gk = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=gen)
            if op == "rope":
                args = lambda: (view(ql), view(kl), cos, sin)  # noqa: E731
                leaves = [ql, kl]
            else:
                args = lambda: (view(ql), view(kl), qw, kw, cos, sin)  # noqa: E731
                leaves = [ql, kl, qw, kw]
            e = kg.explain(op, *(t.detach() for t in args()))
            assert e.backend == "kernelgate_cuda", str(e)
            for name, f in variants.items():
                rec = {"op": op, "layout": layout, "shape": {"batch": b, "seq": s, "q_heads": hq, "kv_heads": hkv,
                                                             "head_dim": d}, "dtype": a.dtype, "variant": name}
                try:
                    rec.update(measure_fwd_bwd(f, args, [gq, gk], fwd_bytes, bwd_bytes, copy_bw, leaves=leaves))
                except Exception as exc:  # a peer that cannot run this case: recorded
                    rec["error"] = repr(exc)[:300]
                records.append(rec)
    payload = {**env, "copy_bw_GBps": copy_bw, "notes": notes,
               "byte_model": "rope fwd: q, k, cos, sin read + q_out, k_out written; bwd: dq_out, dk_out, cos, sin "
                             "read + dq, dk written. qk_norm_rope fwd: rope's + q_weight, k_weight read; bwd: dy, x, "
                             "weights, cos, sin, rstd read + dx, dweights written, plus the forward's rstd write. "
                             "fwdbwd = fwd + bwd",
               "records": records}
    if a.out:
        write_json(a.out, payload)
    print(f"{env['gpu']}  torch {env['torch']}  copy bandwidth {copy_bw:.0f} GB/s  " + "; ".join(notes))
    print_table(records, ["op", "layout", "variant", "fwd_ms", "fwd_frac_copy_bw", "fwdbwd_ms",
                          "fwdbwd_frac_copy_bw", "fwdbwd_peak_extra_mib", "error"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
