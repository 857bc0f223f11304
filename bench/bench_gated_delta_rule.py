"""gated_delta_rule or kda on the GPU, in the layer's fused form (raw gate and beta logits, A_log,
dt_bias; q and k l2-normalised in the op): forward and forward+backward (every input's gradient) of

  eager            the layer as plain PyTorch code (gated_delta_rule: bench_hybrid_step.eager_layer_gdr,
                   the gates, F.normalize, the chunked delta rule with autograd keeping its graph;
                   kda: eager_layer_kda below, the same with a decay per key channel, in chunks of 16)
  kg_reference     kg.gated_delta_rule / kg.kda served by its reference (the chunked form in float32)
  kg_dropin        kernelgate.fla.chunk_gated_delta_rule / chunk_kda as installed (FLA, or kernelgate's
                   op where FLA refuses the call or its evidence does not pass it)
  fla_chunk        FLA's chunk_gated_delta_rule / chunk_kda (gated_delta_rule's forward+backward:
                   refused on Hopper with Triton 3.4 to 3.7.0, recorded as such)
  fla_fused_recurrent  FLA's fused_recurrent_gated_delta_rule, forward only (gated_delta_rule)

Default shapes: the hybrid step's layer (B4 T2048 H16 K=V=128) and issue 16's (B4 T4096), bf16.
Times are CUDA-event medians over whole calls, host launch gaps included (the chunked PyTorch
forms launch a few kernels per chunk); peak memory is the forward+backward's above its inputs.
The eager rows are the "plain PyTorch code" of the fallback rule (docs/evidence.md) for these ops.

    python bench/bench_gated_delta_rule.py --out bench/results/h200/gated_delta_rule.json
    python bench/bench_gated_delta_rule.py --op kda --out bench/results/h200/kda.json

--profile adds, for kg_reference at the first shape, where its forward+backward spends device time:
the ATen ops by self device time (with their call counts) and the number of kernels launched, from
torch.profiler over one call after warm-up.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from bench_hybrid_step import FUSED, eager_layer_gdr
from bench_reference_revisions import layer_inputs
from common import environment, print_table, time_ms, write_json

KDA_CHUNK = 16


def chunked_kda(q, k, v, g, beta, scale, chunk=KDA_CHUNK):
    """The KDA recurrence in plain PyTorch, chunk by chunk, on [batch, seq, heads, dim] (q, k
    already l2-normalised; g [batch, seq, heads, dk] <= 0 in log space, beta in [0, 1]); float32
    math (float64 for float64 inputs). Per head, with state S [dk, dv]: S_t = diag(exp(g_t))
    S_{t-1} + k_t u_t^T, u_t = beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t), o_t = scale S_t^T q_t.
    Within a chunk, with G the running sum of g and E_tsc = exp(G_tc - G_sc) for s <= t (masked
    before exp: no overflow): (I + diag(beta) strict(sum_c k_tc k_sc E_tsc)) U = diag(beta) (V -
    (K exp G) S0), O = scale ((Q exp G) S0 + (sum_c q_tc k_sc E_tsc) U), the state leaving it
    diag(exp G_C) S0 + (K exp(G_C - G))^T U."""
    dt, acc = v.dtype, torch.promote_types(v.dtype, torch.float32)
    q, k, v, g = (t.transpose(1, 2).to(acc) for t in (q, k, v, g))  # [B, H, T, d]
    beta = beta.transpose(1, 2).to(acc)  # [B, H, T]
    B, H, T, dk = k.shape
    state = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk]
        bc = beta[:, :, s:s + chunk]
        G = g[:, :, s:s + chunk].cumsum(-2)
        n = G.shape[-2]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        E = torch.exp((G[..., :, None, :] - G[..., None, :, :]).masked_fill(~lower[..., None], float("-inf")))
        kk = torch.einsum("...tc,...sc,...tsc->...ts", kc, kc, E)
        qk = torch.einsum("...tc,...sc,...tsc->...ts", qc, kc, E)
        tmat = torch.eye(n, device=q.device, dtype=acc) + bc[..., None] * kk.tril(-1)
        u = torch.linalg.solve_triangular(tmat, bc[..., None] * (vc - (kc * G.exp()) @ state), upper=False,
                                          unitriangular=True)
        outs.append(scale * ((qc * G.exp()) @ state + qk @ u))
        last = G[..., -1:, :]
        state = last.exp().transpose(-1, -2) * state + (kc * torch.exp(last - G)).transpose(-1, -2) @ u
    return torch.cat(outs, 2).transpose(1, 2).to(dt)


def eager_layer_kda(q, k, v, a, b, A_log, dt_bias, scale):
    """The KDA layer's gates as plain PyTorch code, g = -exp(A_log) softplus(a + dt_bias) per key
    channel in float32 (dt_bias [heads, dk]) and beta = sigmoid(b), q and k by F.normalize, then
    chunked_kda."""
    g = -A_log.float().exp()[:, None] * F.softplus(a.float() + dt_bias.float())
    return chunked_kda(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, torch.sigmoid(b), scale)


def variants(op="gated_delta_rule"):
    if op == "kda":
        return kda_variants()
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


def kda_variants():
    out = {
        "eager": eager_layer_kda,
        "kg_reference": lambda q, k, v, a, b, A, dt, s: kg.kda(q, k, v, a, b, A, dt, None, s)[0],
    }
    notes = []
    try:
        from kernelgate.fla import chunk_kda as dropin

        out["kg_dropin"] = lambda q, k, v, a, b, A, dt, s: dropin(q, k, v, a, b, scale=s, A_log=A,
                                                                  dt_bias=dt.reshape(-1), **FUSED)[0]
    except Exception as exc:  # kernelgate.fla needs FLA installed
        notes.append(f"kg_dropin not measured: {type(exc).__name__}: {exc}")
    try:
        from fla.ops.kda import chunk_kda

        out["fla_chunk"] = lambda q, k, v, a, b, A, dt, s: chunk_kda(q, k, v, a, b, scale=s, A_log=A,
                                                                     dt_bias=dt.reshape(-1), **FUSED)[0]
    except Exception as exc:
        notes.append(f"FLA not measured: {type(exc).__name__}: {exc}")
    return out, notes


def measure(name, f, shape, dtype, op="gated_delta_rule"):
    B, T, H, K = shape
    # A_log and dt_bias in the model's dtype, as a model's parameters are
    leaves = layer_inputs(op, B, T, H, K, "cuda", dtype=dtype, param_dtype=dtype)
    scale = K ** -0.5
    rec = {"variant": name, "shape": [B, T, H, K, K], "dtype": str(dtype).replace("torch.", "")}
    force = kg.use(force={op: "reference"}) if name == "kg_reference" else None
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


def profile_reference(f, shape, dtype, op, top=15, device="cuda"):
    """kg_reference's forward+backward under torch.profiler: kernels launched, device time, and the
    ATen ops that spent most of it (self device time, calls)."""
    from torch.profiler import ProfilerActivity, profile

    B, T, H, K = shape
    leaves = layer_inputs(op, B, T, H, K, device, dtype=dtype, param_dtype=dtype)
    dy = torch.randn(B, T, H, K, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    call = lambda: torch.autograd.grad(f(*leaves, K ** -0.5), leaves, dy)  # noqa: E731
    with kg.use(force={op: "reference"}):
        for _ in range(3):
            call()
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
            call()
            sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0 and e.key.startswith("aten::")),
                 key=lambda e: -e.self_device_time_total)
    return {"variant": "kg_reference", "shape": list(shape), "kernels": len(kernels),
            "device_ms": sum(e.device_time for e in kernels) / 1e3,
            "top_ops": [{"op": e.key, "calls": e.count, "self_device_ms": round(e.self_device_time_total / 1e3, 3)}
                        for e in ops[:top]]}


def with_ratios(records):
    """Each record's times as multiples of the eager variant's at the same shape."""
    for r in records:
        eager = next((e for e in records if e["variant"] == "eager" and e["shape"] == r["shape"]), None)
        for key in ("fwd_ms", "fwdbwd_ms"):
            if eager and key in r and key in eager:
                r[f"x_eager_{key[:-3]}"] = eager[key] / r[key]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gated_delta_rule", choices=["gated_delta_rule", "kda"])
    ap.add_argument("--shapes", default="4,2048,16,128;4,4096,16,128", help="B,T,H,K;... (dv = dk)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="kg_reference's device time by ATen op (first shape)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    env = environment("python " + " ".join(sys.argv))
    fns, notes = variants(args.op)
    records = []
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        for name, f in fns.items():
            try:
                records.append(measure(name, f, shape, dtype, args.op))
            except Exception as exc:  # a variant that fails here is a result
                records.append({"variant": name, "shape": list(shape), "failed": f"{type(exc).__name__}: {str(exc)[:240]}"})
            print(records[-1], flush=True)
            with_ratios(records)
            if args.out:  # after every record: a run cut short keeps what it measured
                write_json(args.out, {**env, "op": args.op, "notes": notes, "records": records})
    profile_rec = None
    if args.profile:
        first = tuple(int(x) for x in args.shapes.split(";")[0].split(","))
        profile_rec = profile_reference(fns["kg_reference"], first, dtype, args.op)
        print({k: v for k, v in profile_rec.items() if k != "top_ops"})
        print_table(profile_rec["top_ops"], ["op", "calls", "self_device_ms"])
        if args.out:
            write_json(args.out, {**env, "op": args.op, "notes": notes, "records": records, "profile": profile_rec})
    print("; ".join(notes))
    print_table(records, ["variant", "shape", "fwd_ms", "x_eager_fwd", "fwdbwd_ms", "x_eager_fwdbwd",
                          "fwdbwd_peak_extra_mib", "fwdbwd_refused"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
