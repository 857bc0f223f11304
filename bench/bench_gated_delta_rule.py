"""gated_delta_rule on the GPU, in the Gated DeltaNet layer's fused form (raw gate and beta logits,
A_log, dt_bias; q and k l2-normalised in the op): forward and forward+backward (every input's
gradient) of

  eager            the layer as plain PyTorch code (bench_hybrid_step.eager_layer_gdr: the gates,
                   F.normalize, the chunked delta rule with autograd keeping its graph)
  kg_reference     kg.gated_delta_rule served by its reference (the chunked form in float32; its
                   backward recomputes the forward, as every reference backward does)
  kg_dropin        kernelgate.fla.chunk_gated_delta_rule as installed (FLA, or kernelgate's op
                   where FLA refuses the call's backward)
  fla_chunk        FLA's chunk_gated_delta_rule (forward+backward: refused on Hopper with Triton
                   3.4 to 3.7.0, recorded as such)
  fla_fused_recurrent  FLA's fused_recurrent_gated_delta_rule, forward only

Default shapes: the hybrid step's layer (B4 T2048 H16 K=V=128) and issue 16's (B4 T4096), bf16.
Times are CUDA-event medians over whole calls, host launch gaps included (the chunked PyTorch
forms launch a few kernels per 64-step chunk); peak memory is the forward+backward's above its
inputs.

    python bench/bench_gated_delta_rule.py --out bench/results/h200/gated_delta_rule.json
"""

import argparse
import sys

import torch

import kernelgate as kg
from bench_hybrid_step import FUSED, eager_layer_gdr
from common import environment, print_table, time_ms, write_json


def variants():
    out = {
        "eager": lambda q, k, v, a, b, A, dt, s: eager_layer_gdr(q, k, v, a, b, A, dt, s),
        "kg_reference": lambda q, k, v, a, b, A, dt, s: kg.gated_delta_rule(q, k, v, a, b, A, dt, None, s)[0],
    }
    notes = []
    try:
        from kernelgate.fla import chunk_gated_delta_rule as dropin

        out["kg_dropin"] = lambda q, k, v, a, b, A, dt, s: dropin(q, k, v, a, b, scale=s, A_log=A, dt_bias=dt,
                                                                  **FUSED)[0]
    except Exception as exc:  # kernelgate.fla needs FLA installed
        notes.append(f"kg_dropin not measured: {type(exc).__name__}: {exc}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        out["fla_chunk"] = lambda q, k, v, a, b, A, dt, s: chunk_gated_delta_rule(
            q, k, v, a, b, scale=s, A_log=A, dt_bias=dt, **FUSED)[0]
        out["fla_fused_recurrent"] = lambda q, k, v, a, b, A, dt, s: fused_recurrent_gated_delta_rule(
            q, k, v, g=a, beta=b, scale=s, A_log=A, dt_bias=dt, **FUSED)[0]
    except Exception as exc:
        notes.append(f"FLA not measured: {type(exc).__name__}: {exc}")
    return out, notes


def measure(name, f, shape, dtype):
    B, T, H, K = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", dtype=dtype, generator=g)

    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    a, b = r(B, T, H), r(B, T, H)
    A_log, dt_bias = r(H), r(H)  # in the model's dtype, as the hybrid step's parameters are
    leaves = [t.requires_grad_() for t in (q, k, v, a, b, A_log, dt_bias)]
    scale = K ** -0.5
    rec = {"variant": name, "shape": [B, T, H, K, K], "dtype": str(dtype).replace("torch.", "")}
    force = kg.use(force={"gated_delta_rule": "reference"}) if name == "kg_reference" else None
    if force is not None:
        force.__enter__()
    try:
        with torch.no_grad():
            rec["fwd_ms"] = time_ms(lambda: f(*leaves, scale), warmup=3, samples=20)["median_ms"]
        if name == "fla_fused_recurrent":
            return rec
        dy = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            rec["fwdbwd_ms"] = time_ms(lambda: torch.autograd.grad(f(*leaves, scale), leaves, dy),
                                       warmup=3, samples=20)["median_ms"]
            rec["fwdbwd_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as exc:  # FLA's refusal of its backward is a result
            rec["fwdbwd_refused"] = f"{type(exc).__name__}: {str(exc)[:240]}"
        return rec
    finally:
        if force is not None:
            force.__exit__(None, None, None)


def with_ratios(records):
    """Each record's times as multiples of the eager variant's at the same shape."""
    for r in records:
        eager = next((e for e in records if e["variant"] == "eager" and e["shape"] == r["shape"]), None)
        for key in ("fwd_ms", "fwdbwd_ms"):
            if eager and key in r and key in eager:
                r[f"x_eager_{key[:-3]}"] = eager[key] / r[key]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4,2048,16,128;4,4096,16,128", help="B,T,H,K;... (dv = dk)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    fns, notes = variants()
    records = []
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        for name, f in fns.items():
            try:
                records.append(measure(name, f, shape, dtype))
            except Exception as exc:  # a variant that fails here is a result
                records.append({"variant": name, "shape": list(shape), "failed": f"{type(exc).__name__}: {str(exc)[:240]}"})
            print(records[-1], flush=True)
            with_ratios(records)
            if args.out:  # after every record: a run cut short keeps what it measured
                write_json(args.out, {**env, "notes": notes, "records": records})
    print("; ".join(notes))
    print_table(records, ["variant", "shape", "fwd_ms", "x_eager_fwd", "fwdbwd_ms", "x_eager_fwdbwd",
                          "fwdbwd_peak_extra_mib", "fwdbwd_refused"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
