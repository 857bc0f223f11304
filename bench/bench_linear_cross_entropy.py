"""linear_cross_entropy on the GPU: kernelgate (float32 and input-dtype grad_weight accumulation)
vs the eager materialised F.cross_entropy(h @ W.T, t), torch.compile of it and Liger-Kernel's
fused linear cross entropy (when importable): time, fraction of the bf16 matmul rate, peak
memory.

Matmul model: forward+backward is at least 3 GEMMs of 2 * T * H * V flops (logits, grad_hidden,
grad_weight), the forward alone 1. The rate is the one plain torch.mm reaches on those three
shapes in the same run: "frac_matmul" = (time of those torch.mm calls) / (time of the variant),
against the rate at the start of the run and ("_adjacent") the rate measured right before the
variant: under this load the GPU's clock follows its power draw. Forward+backward is timed with
a random scalar cotangent and with cotangent 1 (loss.backward()).
Memory: peak allocated during the step minus what was allocated before, and "workspace" = that
minus the gradients any implementation returns (hidden, weight), against the materialised
float32 logits (T * V * 4 bytes).

    cd bench && python bench_linear_cross_entropy.py --out results/h200/linear_cross_entropy.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from common import environment, print_table, time_ms, write_json

OP = "linear_cross_entropy"


def liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, t: loss(w, h, t)
    except Exception as exc:  # not installed: recorded, not hidden
        return exc


def kernelgate_backend(backend):
    def f(h, w, t):
        return kg.linear_cross_entropy(h, w, t)

    f.backend = backend
    return f


def measure(f, h, w, t, dy, grads_bytes):
    backend = getattr(f, "backend", None)
    kg.policy.clear()
    if backend:
        kg.policy.add_rule(OP, [backend], evidence="benchmark: " + backend + " under test")
        assert kg.explain(OP, h, w, t).backend == backend
    with torch.no_grad():
        fwd = time_ms(lambda: f(h, w, t), warmup=3, samples=20)
    fb = time_ms(lambda: torch.autograd.grad(f(h, w, t), [h, w], dy), warmup=3, samples=20)
    one = torch.ones_like(dy)  # loss.backward()
    fb1 = time_ms(lambda: torch.autograd.grad(f(h, w, t), [h, w], one), warmup=2, samples=20)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = torch.autograd.grad(f(h, w, t), [h, w], dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return fwd, fb, fb1, peak, peak - grads_bytes


def matmul_rate(a, wd):
    """The matmul rate of this run: the three GEMM shapes as plain torch.mm."""
    T, H, V = a.shape[0], a.shape[1], wd.shape[0]
    logits = torch.empty(T, V, device="cuda", dtype=a.dtype)
    gh = torch.empty(T, H, device="cuda", dtype=a.dtype)
    gw = torch.empty(V, H, device="cuda", dtype=a.dtype)
    mm_logits = time_ms(lambda: torch.mm(a, wd.t(), out=logits), samples=20)["median_ms"]
    mm_gh = time_ms(lambda: torch.mm(logits, wd, out=gh), samples=20)["median_ms"]
    mm_gw = time_ms(lambda: torch.mm(logits.t(), a, out=gw), samples=20)["median_ms"]
    flop = 2.0 * T * H * V
    return {"logits_ms": mm_logits, "grad_hidden_ms": mm_gh, "grad_weight_ms": mm_gw,
            "fwd_ms": mm_logits, "fwdbwd_ms": mm_logits + mm_gh + mm_gw,
            "tflops": 3 * flop / ((mm_logits + mm_gh + mm_gw) * 1e-3) / 1e12}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--classes", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    T, H, V = args.rows, args.hidden, args.classes
    es = torch.tensor([], dtype=dtype).element_size()
    h = (torch.randn(T, H, device="cuda", dtype=dtype)).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", dtype=dtype) * H**-0.5).requires_grad_(True)
    t = torch.randint(0, V, (T,), device="cuda")
    dy = torch.randn((), device="cuda", dtype=dtype)

    mm = matmul_rate(h.detach(), w.detach())

    eager = lambda hh, ww, tt: F.cross_entropy(hh @ ww.t(), tt)  # noqa: E731
    variants = {
        "kernelgate": kernelgate_backend("kernelgate_cuda"),
        "kernelgate_narrow_accum": kernelgate_backend("kernelgate_cuda_narrow_accum"),
        "eager_materialised": eager,
        "torch_compile": torch.compile(eager),
    }
    notes = []
    lig = liger()
    if callable(lig):
        variants["liger"] = lig
    else:
        notes.append(f"liger not measured: {lig!r}")

    f32_logits = T * V * 4
    grads_bytes = (T * H + V * H) * es
    records = []
    for name, f in variants.items():
        try:
            # The GPU's clock follows its power draw (GEMMs at this size meet the software power
            # cap), so the rate is also measured right before each variant: a ratio between
            # neighbours in time.
            near = matmul_rate(h.detach(), w.detach())
            fwd, fb, fb1, peak, workspace = measure(f, h, w, t, dy, grads_bytes)
        except torch.cuda.OutOfMemoryError as exc:
            records.append({"variant": name, "error": f"out of memory: {exc}"})
            torch.cuda.empty_cache()
            continue
        records.append({
            "op": OP, "shape": {"rows": T, "hidden": H, "classes": V}, "dtype": args.dtype, "variant": name,
            "fwd_ms": fwd["median_ms"], "fwd_p10_p90_ms": [fwd["p10_ms"], fwd["p90_ms"]],
            "fwdbwd_ms": fb["median_ms"], "fwdbwd_p10_p90_ms": [fb["p10_ms"], fb["p90_ms"]],
            "fwd_frac_matmul": mm["fwd_ms"] / fwd["median_ms"],
            "fwdbwd_frac_matmul": mm["fwdbwd_ms"] / fb["median_ms"],
            "fwdbwd_unit_cotangent_ms": fb1["median_ms"],
            "fwdbwd_unit_cotangent_frac_matmul": mm["fwdbwd_ms"] / fb1["median_ms"],
            "matmul_adjacent": near,
            "fwd_frac_matmul_adjacent": near["fwd_ms"] / fwd["median_ms"],
            "fwdbwd_frac_matmul_adjacent": near["fwdbwd_ms"] / fb["median_ms"],
            "fwdbwd_unit_cotangent_frac_matmul_adjacent": near["fwdbwd_ms"] / fb1["median_ms"],
            "fwdbwd_peak_extra_mib": peak / 2**20,
            "fwdbwd_workspace_mib": workspace / 2**20,
            "workspace_frac_f32_logits": workspace / f32_logits,
        })
        torch.cuda.empty_cache()
    kg.policy.clear()
    payload = {**env, "notes": notes, "matmul": mm,
               "model": "fwd: 1 GEMM (2 T H V flop); fwd+bwd: 3 GEMMs, with a random scalar "
                        "cotangent (fwdbwd_*) and with cotangent 1 as loss.backward() gives "
                        "(fwdbwd_unit_cotangent_*); frac_matmul = torch.mm time of those GEMMs in "
                        "this run / variant time (*_adjacent: measured right before the variant); "
                        "workspace = peak extra - gradients of hidden and weight; f32 logits = T V 4 bytes",
               "f32_logits_mib": f32_logits / 2**20, "records": records}
    if args.out:
        write_json(args.out, payload)
    print(f"{env['gpu']}  bf16 mm: {mm['tflops']:.0f} TFLOP/s over the three shapes  " + "; ".join(notes))
    print_table(records, ["variant", "fwd_ms", "fwd_frac_matmul", "fwdbwd_ms", "fwdbwd_frac_matmul",
                          "fwdbwd_frac_matmul_adjacent", "fwdbwd_unit_cotangent_frac_matmul_adjacent",
                          "workspace_frac_f32_logits"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
