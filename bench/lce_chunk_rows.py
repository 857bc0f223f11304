"""linear_cross_entropy's chunk size on the GPU: forward+backward time, fraction of the same-run
bf16 matmul rate, workspace, and where the time goes (the step's kernels by kind, from a
torch.profiler trace), for chunk sizes from small to the whole batch (= materialised logits),
at the training step's lm_head (T 8192, H 2048, V 128256) and issue 11's (H 4096).

What it answers: how much of the gap to the one-GEMM rate is the chunking itself (per-chunk
GEMMs: grad_weight accumulated over chunks of K = chunk rows, grad_hidden as a split-K GEMM of a
small output), and what each chunk size costs in memory. The backend is forced; the chunk size
set through _linear_cross_entropy_set_chunk_rows (0: the op's own choice).

    cd bench && python lce_chunk_rows.py --out results/h200/lce_chunk_rows.json
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from bench_linear_cross_entropy import OP, kernelgate_backend, matmul_rate, measure
from common import environment, print_table, write_json

set_chunk_rows = torch.ops.kernelgate._linear_cross_entropy_set_chunk_rows


def kernel_kind(name):
    if name.startswith("nvjet") or "gemm" in name.lower() or "cutlass" in name.lower():
        return "gemm:" + name[:60]
    if "ce_rows" in name:
        return "ce_rows"
    if "scale_unless_one" in name:
        return "scale"
    return "other"


def breakdown(step, steps=3):
    """ms per step of each kernel kind (GEMMs by kernel name) over `steps` back-to-back steps."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per, calls = {}, {}
    for e in p.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = kernel_kind(e.name)
        per[k] = per.get(k, 0.0) + (e.time_range.end - e.time_range.start) / 1e3 / steps
        calls[k] = calls.get(k, 0) + 1 / steps
    return {k: {"ms": round(v, 3), "calls": round(calls[k], 1)} for k, v in sorted(per.items(), key=lambda x: -x[1])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hiddens", default="2048,4096")
    ap.add_argument("--classes", type=int, default=128256)
    ap.add_argument("--chunks", default="0,512,1024,1408,2048,4096,8192",
                    help="chunk rows to measure (0: the op's own choice)")
    ap.add_argument("--backend", default="kernelgate_cuda_narrow_accum")
    ap.add_argument("--compile", action="store_true", help="also torch.compile of the materialised loss")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment("python " + " ".join(sys.argv))
    dtype = torch.bfloat16
    T, V = args.rows, args.classes
    records = []
    for H in (int(x) for x in args.hiddens.split(",")):
        h = torch.randn(T, H, device="cuda", dtype=dtype).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda", dtype=dtype) * H**-0.5).requires_grad_(True)
        t = torch.randint(0, V, (T,), device="cuda")
        dy = torch.randn((), device="cuda", dtype=dtype)
        grads_bytes = (T * H + V * H) * 2
        f32_logits = T * V * 4
        variants = [(f"chunk {c}", kernelgate_backend(args.backend), c) for c in map(int, args.chunks.split(","))]
        if args.compile:
            variants.append(("torch_compile", torch.compile(lambda a, b, c: F.cross_entropy((a @ b.t()).float(), c)), None))
        for name, f, chunk in variants:
            prev = set_chunk_rows(chunk) if chunk is not None else None
            try:
                near = matmul_rate(h.detach(), w.detach())
                fwd, fb, fb1, peak, workspace = measure(f, h, w, t, dy, grads_bytes)
                parts = breakdown(lambda: torch.autograd.grad(f(h, w, t), [h, w]))
            except torch.cuda.OutOfMemoryError as exc:
                records.append({"hidden": H, "variant": name, "error": f"out of memory: {exc}"})
                torch.cuda.empty_cache()
                continue
            finally:
                if prev is not None:
                    set_chunk_rows(prev)
                kg.policy.clear()
            gemm = sum(v["ms"] for k, v in parts.items() if k.startswith("gemm:"))
            records.append({
                "shape": {"rows": T, "hidden": H, "classes": V}, "variant": name, "chunk_rows": chunk,
                "fwd_ms": round(fwd["median_ms"], 3), "fwdbwd_unit_cotangent_ms": round(fb1["median_ms"], 3),
                "fwdbwd_ms": round(fb["median_ms"], 3),
                "fwdbwd_unit_cotangent_frac_matmul_adjacent": round(near["fwdbwd_ms"] / fb1["median_ms"], 4),
                "matmul_adjacent_ms": round(near["fwdbwd_ms"], 3),
                "gemm_ms_per_step": round(gemm, 3),
                "gemm_frac_matmul_adjacent": round(near["fwdbwd_ms"] / gemm, 4) if gemm else None,
                "workspace_frac_f32_logits": round(workspace / f32_logits, 4),
                "peak_mib": round(peak / 2**20, 1),
                "kernels": parts,
            })
            r = records[-1]
            print(f"H{H} {name:14s} fwd+bwd(1) {r['fwdbwd_unit_cotangent_ms']:7.3f} ms  "
                  f"{100 * r['fwdbwd_unit_cotangent_frac_matmul_adjacent']:5.1f}% of mm  gemm {gemm:7.3f} ms  "
                  f"ws {100 * r['workspace_frac_f32_logits']:5.1f}%", flush=True)
        del h, w, t
        torch.cuda.empty_cache()
    print_table([{k: r.get(k) for k in ("variant", "fwdbwd_unit_cotangent_ms", "fwdbwd_unit_cotangent_frac_matmul_adjacent",
                                         "gemm_ms_per_step", "workspace_frac_f32_logits")} | {"H": r.get("hidden", r.get("shape", {}).get("hidden"))}
                 for r in records],
                ["H", "variant", "fwdbwd_unit_cotangent_ms", "fwdbwd_unit_cotangent_frac_matmul_adjacent",
                 "gemm_ms_per_step", "workspace_frac_f32_logits"])
    if args.out:
        write_json(args.out, {**env, "backend": args.backend, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
