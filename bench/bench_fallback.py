"""What a call without evidence costs: every op through kernelgate with an empty store and no
shipped evidence, against the plain PyTorch code it replaces, at a production shape, forward (no
grad) and forward+backward: time ratio and peak extra memory. The rule (docs/evidence.md): at most
1.05x the time and no more peak memory.

    python bench/bench_fallback.py --out bench/results/h200/fallback.json
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate import _C
from bench_causal_conv1d import eager as plain_conv
from common import environment, plain_rope, print_table, time_ms, write_json


def cases(dev, dt):
    """(op, plain PyTorch function, make inputs -> (args, leaves))."""
    rows, hidden = 8192, 4096

    def norm_inputs(with_bias=False):
        x = torch.randn(rows, hidden, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(hidden, device=dev, dtype=dt, requires_grad=True)
        if not with_bias:
            return (x, w), [x, w]
        b = torch.randn(hidden, device=dev, dtype=dt, requires_grad=True)
        return (x, w, b), [x, w, b]

    def gated_inputs():
        g = torch.randn(rows, 11008, device=dev, dtype=dt, requires_grad=True)
        u = torch.randn_like(g, requires_grad=True)
        return (g, u), [g, u]

    def add_inputs():
        x = torch.randn(rows, hidden, device=dev, dtype=dt, requires_grad=True)
        r = torch.randn_like(x, requires_grad=True)
        w = torch.randn(hidden, device=dev, dtype=dt, requires_grad=True)
        return (x, r, w), [x, r, w]

    def rope_inputs(norm=False):
        q = torch.randn(4, 32, 2048, 128, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(4, 8, 2048, 128, device=dev, dtype=dt, requires_grad=True)
        ang = torch.rand(1, 2048, 128, device=dev)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        if not norm:
            return (q, k, cos, sin), [q, k]
        qw = torch.randn(128, device=dev, dtype=dt, requires_grad=True)
        kw = torch.randn(128, device=dev, dtype=dt, requires_grad=True)
        return (q, k, qw, kw, cos, sin), [q, k, qw, kw]

    def ce_inputs():
        logits = torch.randn(8192, 32000, device=dev, dtype=dt, requires_grad=True)
        t = torch.randint(0, 32000, (8192,), device=dev)
        return (logits, t), [logits]

    def lce_inputs():
        h = torch.randn(8192, 2048, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(32000, 2048, device=dev, dtype=dt) * 0.02).requires_grad_()
        t = torch.randint(0, 32000, (8192,), device=dev)
        return (h, w, t), [h, w]

    def attention_inputs():  # the training step's attention: B4 S2048, 16 query and 4 kv heads of 128
        q = torch.randn(4, 16, 2048, 128, device=dev, dtype=dt, requires_grad=True)
        k, v = (torch.randn(4, 4, 2048, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
        return (q, k, v, True), [q, k, v]

    def varlen_inputs():  # 16,384 packed tokens in 8 sequences of 2,048; 32 query and 8 kv heads of 128
        q = torch.randn(16384, 32, 128, device=dev, dtype=dt, requires_grad=True)
        k, v = (torch.randn(16384, 8, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
        cu = torch.arange(0, 16385, 2048, device=dev, dtype=torch.int32)
        return (q, k, v, cu, 2048), [q, k, v]

    def plain_varlen(q, k, v, cu, longest):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))  # causal, grouped kv heads

    def conv_inputs():  # bench_causal_conv1d.py's shape: B4 T4096 D8192 W4, silu
        x = torch.randn(4, 4096, 8192, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(8192, 4, device=dev, dtype=dt, requires_grad=True)
        return (x, w, None, "silu"), [x, w]

    return [
        ("rms_norm", lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), norm_inputs),
        ("layer_norm", lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
         lambda: norm_inputs(True)),
        ("add_rms_norm", lambda x, r, w: (lambda h: (F.rms_norm(h, (h.shape[-1],), w, 1e-6), h))(x + r),
         add_inputs),
        ("swiglu", lambda g, u: F.silu(g) * u, gated_inputs),
        ("geglu", lambda g, u: F.gelu(g, approximate="tanh") * u, gated_inputs),
        ("rope", plain_rope, rope_inputs),
        ("qk_norm_rope", lambda q, k, qw, kw, c, s: plain_rope(F.rms_norm(q, (128,), qw, 1e-6),
                                                             F.rms_norm(k, (128,), kw, 1e-6), c, s),
         lambda: rope_inputs(True)),
        # The op's loss: F.cross_entropy on the float32 logits, in the logits' dtype (its eager
        # code, docs/evidence.md), as Hugging Face's models upcast before it.
        ("cross_entropy", lambda x, t: F.cross_entropy(x.float(), t).to(x.dtype), ce_inputs),
        ("linear_cross_entropy", lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), lce_inputs),
        ("attention", lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True),
         attention_inputs),
        ("attention_varlen", plain_varlen, varlen_inputs),
        # Dense [B, T, D], as the op returns it: conv1d's [B, D, T] transposed back is a strided
        # view whose copy the model's next reshape (and the backward) pays instead.
        ("causal_conv1d", lambda x, w, b, act: plain_conv(act)(x, w).contiguous(), conv_inputs),
    ]


# Ops called through another function than kg.<op> (kg.attention's varlen form), and the
# arguments explain takes for them.
ROUTED = {"attention_varlen": lambda q, k, v, cu, longest: kg.attention(q, k, v, True, cu_seqlens=cu,
                                                                        max_seqlen=longest)}
EXPLAIN_ARGS = {
    "attention": lambda q, k, v, causal: (q.view(q.shape[0], k.shape[1], -1, *q.shape[2:]), k, v,
                                          "causal" if causal else "none"),
    "attention_varlen": lambda q, k, v, cu, longest: (
        q.view(q.shape[0], k.shape[1], -1, q.shape[-1]), k, v, cu, "causal", 0.0, longest)}


def measure(f, args, leaves):
    outs = f(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cots = [torch.randn_like(o) for o in outs]
    with torch.no_grad():
        fwd = time_ms(lambda: f(*args), samples=30)
    torch.cuda.synchronize()
    del outs
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb = time_ms(lambda: torch.autograd.grad(f(*args), leaves, cots), samples=30)
    peak = torch.cuda.max_memory_allocated() - base
    return fwd["median_ms"], fb["median_ms"], peak / 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ops", default="", help="comma-separated; default every op")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    empty = os.path.join(tempfile.mkdtemp(), "none.sqlite")
    _C.use_evidence(os.fsencode(empty), [])  # no evidence at all: what every fresh install meets
    rows = []
    for op, plain, make in cases("cuda", dt):
        if args.ops and op not in args.ops.split(","):
            continue
        a, leaves = make()
        served = kg.explain(op, *EXPLAIN_ARGS.get(op, lambda *x: x)(*a))
        try:
            p_fwd, p_fb, p_mem = measure(plain, a, leaves)
            k_fwd, k_fb, k_mem = measure(ROUTED.get(op, getattr(kg, op)), a, leaves)
        except Exception as exc:  # recorded, not hidden
            rows.append({"op": op, "served_by": served.backend, "error": repr(exc)[:300]})
            continue
        rows.append({
            "op": op, "served_by": served.backend, "reason": served.reason,
            "plain_fwd_ms": p_fwd, "kg_fwd_ms": k_fwd, "fwd_ratio": k_fwd / p_fwd,
            "plain_fwdbwd_ms": p_fb, "kg_fwdbwd_ms": k_fb, "fwdbwd_ratio": k_fb / p_fb,
            "plain_peak_mib": p_mem, "kg_peak_mib": k_mem, "peak_extra_mib": k_mem - p_mem,
            "meets_rule": k_fwd / p_fwd <= 1.05 and k_fb / p_fb <= 1.05 and k_mem <= p_mem * 1.001 + 1,
        })
        del a, leaves
        torch.cuda.empty_cache()
    print_table(rows, ["op", "served_by", "fwd_ratio", "fwdbwd_ratio", "plain_peak_mib", "kg_peak_mib",
                       "meets_rule"])
    if args.out:
        write_json(args.out, {**env, "dtype": args.dtype, "rule": "<= 1.05x time, <= peak memory",
                              "method": "median of 30 CUDA-timed calls each (common.time_ms); peak = "
                                        "max_memory_allocated over the fwd+bwd loop minus what was "
                                        "allocated before it; empty store, no shipped evidence",
                              "records": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
