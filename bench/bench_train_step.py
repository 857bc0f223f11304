"""One training step (forward and backward) of a Llama-style model, end to end: the number every
op-level claim ends in.

The model (default sizes): 8 layers, hidden 2048, 16 query and 4 kv heads of 128, swiglu MLP 5632,
vocab 128256, batch 4 x 2048 tokens, bfloat16, causal GQA attention through SDPA in every variant
but kernelgate_attention, the same weights and the same batch. Variants:

  eager               plain PyTorch: F.rms_norm, the Hugging Face rope, F.silu(g) * u,
                      F.cross_entropy(F.linear(h, w).float(), t)
  compile             torch.compile of the eager model
  liger               Liger-Kernel's functional ops (fused add + rms_norm, rope, swiglu, fused
                      linear cross entropy), where liger_kernel imports
  kernelgate          kg.add_rms_norm, kg.rms_norm, kg.rope, kg.swiglu, kg.linear_cross_entropy,
                      with the evidence as installed (the shipped evidence, no user store)
  kernelgate_compile  torch.compile of the kernelgate model
  kernelgate_attention  the kernelgate model with kg.attention for SDPA (not in the default list:
                      on the H200 the step is as fast as with SDPA, the same cuDNN kernels,
                      bench/results/h200/train_step_attention.json)
  compile_hook        torch.compile of the eager model with kernelgate's compile hook
                      (kernelgate.compile.options(): its subgraphs that match kernelgate ops become
                      those ops where evidence ranks a kernelgate kernel); the rewrites go into
                      the JSON

Per variant: step time (CUDA events, warm-up excluded, median), tokens/s, peak memory of the
step, and agreement with eager (loss, and the relative error of every parameter's gradient).
For the kernelgate variants, which backend serves each op at the model's shapes (`kg.explain`).

    python bench/bench_train_step.py --out bench/results/h200/train_step.json
    python bench/bench_train_step.py --tiny --device cpu --variants eager,kernelgate   # a check
"""

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate import _C
from common import environment, plain_rope, print_table, write_json

FULL = dict(layers=8, hidden=2048, heads=16, kv_heads=4, head_dim=128, mlp=5632, vocab=128256,
            batch=4, seq=2048)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=200, batch=2, seq=16)
EPS = 1e-6


class EagerOps:
    """What the model code says without any kernel library."""

    name = "eager"

    def norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    def add_norm(self, x, residual, w):
        h = x + residual
        return self.norm(h, w), h

    def rope(self, q, k, cos, sin):
        return plain_rope(q, k, cos, sin)

    def swiglu(self, g, u):
        return F.silu(g) * u

    def attention(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def loss(self, h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)


class KernelgateOps:
    name = "kernelgate"

    def norm(self, x, w):
        return kg.rms_norm(x, w, EPS)

    def add_norm(self, x, residual, w):
        return kg.add_rms_norm(x, residual, w, EPS)

    def rope(self, q, k, cos, sin):
        return kg.rope(q, k, cos, sin)

    def swiglu(self, g, u):
        return kg.swiglu(g, u)

    def attention(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def loss(self, h, w, t):
        return kg.linear_cross_entropy(h, w, t)


class KernelgateAttentionOps(KernelgateOps):
    """kernelgate's ops and kg.attention for the model's attention."""

    name = "kernelgate_attention"

    def attention(self, q, k, v):
        return kg.attention(q, k, v, causal=True)


class LigerOps(EagerOps):
    name = "liger"

    def __init__(self):
        from liger_kernel.transformers import functional as lf
        self.lf = lf

    def norm(self, x, w):
        return self.lf.liger_rms_norm(x, w, EPS, in_place=False)

    def add_norm(self, x, residual, w):
        return self.lf.liger_fused_add_rms_norm(x, residual, w, EPS, in_place=False)

    def rope(self, q, k, cos, sin):
        return self.lf.liger_rope(q, k, cos, sin)

    def swiglu(self, g, u):
        return self.lf.liger_swiglu(g, u)

    def loss(self, h, w, t):
        return self.lf.liger_fused_linear_cross_entropy(h, w, t)


class Model(torch.nn.Module):
    def __init__(self, cfg, ops):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        H, D = cfg["hidden"], cfg["head_dim"]
        self.embed = torch.nn.Embedding(cfg["vocab"], H)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg["layers"]):
            layer = torch.nn.Module()
            layer.attn_norm = torch.nn.Parameter(torch.ones(H))
            layer.q = torch.nn.Linear(H, cfg["heads"] * D, bias=False)
            layer.k = torch.nn.Linear(H, cfg["kv_heads"] * D, bias=False)
            layer.v = torch.nn.Linear(H, cfg["kv_heads"] * D, bias=False)
            layer.o = torch.nn.Linear(cfg["heads"] * D, H, bias=False)
            layer.mlp_norm = torch.nn.Parameter(torch.ones(H))
            layer.gate = torch.nn.Linear(H, cfg["mlp"], bias=False)
            layer.up = torch.nn.Linear(H, cfg["mlp"], bias=False)
            layer.down = torch.nn.Linear(cfg["mlp"], H, bias=False)
            self.layers.append(layer)
        self.final_norm = torch.nn.Parameter(torch.ones(H))
        self.lm_head = torch.nn.Linear(H, cfg["vocab"], bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.outer(torch.arange(cfg["seq"]).float(), inv)
        ang = torch.cat([ang, ang], -1)[None]  # [1, seq, head_dim]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids, targets):
        cfg, ops = self.cfg, self.ops
        B, S = ids.shape
        Hq, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        cos, sin = self.cos.to(self.embed.weight.dtype), self.sin.to(self.embed.weight.dtype)
        residual = self.embed(ids)
        x = ops.norm(residual, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            q = layer.q(x).view(B, S, Hq, D).transpose(1, 2)
            k = layer.k(x).view(B, S, Hkv, D).transpose(1, 2)
            v = layer.v(x).view(B, S, Hkv, D).transpose(1, 2)
            q, k = ops.rope(q, k, cos, sin)
            a = ops.attention(q, k, v)
            a = layer.o(a.transpose(1, 2).reshape(B, S, Hq * D))
            x, residual = ops.add_norm(a, residual, layer.mlp_norm)
            m = layer.down(ops.swiglu(layer.gate(x), layer.up(x)))
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            x, residual = ops.add_norm(m, residual, nxt)
        return ops.loss(x.reshape(B * S, -1), self.lm_head.weight, targets.reshape(-1))


def make_ops(variant):
    if variant in ("eager", "compile", "compile_hook"):
        return EagerOps()
    if variant in ("kernelgate", "kernelgate_compile"):
        return KernelgateOps()
    if variant == "kernelgate_attention":
        return KernelgateAttentionOps()
    if variant == "liger":
        return LigerOps()
    raise SystemExit(f"--variants: unknown variant '{variant}' (eager, compile, liger, kernelgate, "
                     "kernelgate_compile, kernelgate_attention, compile_hook)")


def hook_rewrites(variant):
    """For compile_hook: what kernelgate's compile hook rewrote and what it left to Inductor."""
    if variant != "compile_hook":
        return None
    import kernelgate.compile

    s = kernelgate.compile.stats()
    return {"compile hook": {"reason": f"rewritten {s['rewritten'] or 'nothing'}", **s}}


def step_calls(cfg, dev, dt):
    """The kernelgate model's calls, op by op, as arguments of its shapes and layouts (uninitialised
    tensors; meta tensors where dev is "meta")."""
    B, S, H = cfg["batch"], cfg["seq"], cfg["hidden"]
    T = B * S

    def t(*shape, grad=True):
        return torch.empty(*shape, device=dev, dtype=dt, requires_grad=grad)

    cos = torch.empty(1, S, cfg["head_dim"], device=dev, dtype=dt)
    calls = {
        "rms_norm": (t(B, S, H), t(H)),
        "add_rms_norm": (t(B, S, H), t(B, S, H), t(H)),
        "rope": (t(B, S, cfg["heads"], cfg["head_dim"]).transpose(1, 2),
                 t(B, S, cfg["kv_heads"], cfg["head_dim"]).transpose(1, 2), cos, cos),
        "swiglu": (t(T, cfg["mlp"]), t(T, cfg["mlp"])),
        # attention's q grouped by kv head: a view of attention code's transposed q
        "attention": (t(B, S, cfg["heads"], cfg["head_dim"]).transpose(1, 2).view(
                          B, cfg["kv_heads"], cfg["heads"] // cfg["kv_heads"], S, cfg["head_dim"]),
                      t(B, S, cfg["kv_heads"], cfg["head_dim"]).transpose(1, 2),
                      t(B, S, cfg["kv_heads"], cfg["head_dim"]).transpose(1, 2)),
        "linear_cross_entropy": (t(T, H), t(cfg["vocab"], H),
                                 torch.zeros(T, dtype=torch.long, device=dev)),
    }
    return calls


def served(cfg, dev, dt, attention=False):
    """Which backend serves each op of the kernelgate model at its shapes, in a training step
    (attention: where the model calls kg.attention)."""
    out = {}
    for op, args in step_calls(cfg, dev, dt).items():
        if op == "attention" and not attention:
            continue
        e = kg.explain(op, *args)
        out[op] = {"backend": e.backend, "reason": e.reason}
    return out


def profile_top(step, n=25):
    """The kernels of two steps by device time (torch.profiler), largest first: where a step's
    time goes, for a variant that misses its target. Also the device time of all kernels per
    step and their count: the step time less that busy time is where the GPU waited (on the
    host, or between kernels)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us > 0:
            rows.append({"kernel": e.key[:160], "ms_per_step": us / 2e3, "calls_per_step": e.count / 2})
    rows.sort(key=lambda r: -r["ms_per_step"])
    busy = {"busy_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "largest_gaps": device_gaps(prof)}
    return rows[:n], busy


def device_gaps(prof, n=15, min_us=5.0):
    """The longest stretches of the profiled steps in which no kernel ran, with the kernels on
    either side: where the GPU waited for the host."""
    spans = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end, e.name[:100]))
    spans.sort()
    gaps, end, before = [], None, None
    edges = (2.0, 5.0, 20.0, 100.0)  # every gap by length, in us: where the idle time is
    buckets = {f"<{edges[0]:g}": [0, 0.0], **{f"{a:g}-{b:g}": [0, 0.0] for a, b in zip(edges, edges[1:])},
               f">={edges[-1]:g}": [0, 0.0]}
    for s, e, name in spans:
        if end is not None and s > end:
            gap = s - end
            label = next((k for k, hi in zip(buckets, (*edges, float("inf"))) if gap < hi))
            buckets[label][0] += 1
            buckets[label][1] += gap
            if gap >= min_us:
                gaps.append({"us": gap, "after": before, "before": name})
        if end is None or e > end:
            end, before = e, name
    gaps.sort(key=lambda g: -g["us"])
    return {"idle_us_in_gaps_over_5us": sum(g["us"] for g in gaps), "count": len(gaps), "top": gaps[:n],
            "all_gaps_by_length_us": {k: {"count": c, "us": round(t, 1)} for k, (c, t) in buckets.items()}}


def run_variant(variant, cfg, state, ids, targets, dev, dt, warmup, steps, profile=False,
                build=None, hook_mode="evidence"):
    """One variant's steps: `build(variant)` makes its model (default: this file's Model);
    compile_hook compiles with the hook in `hook_mode` (kernelgate.compile.MODES)."""
    torch.manual_seed(0)
    model = (build or (lambda v: Model(cfg, make_ops(v))))(variant).to(dev, dt)
    model.load_state_dict(state)
    step_fn = model
    if variant == "compile_hook":
        import kernelgate.compile

        kernelgate.compile.stats(reset=True)
        step_fn = torch.compile(model, options=kernelgate.compile.options(hook_mode))
    elif variant.endswith("compile"):
        step_fn = torch.compile(model)
    cuda = dev.startswith("cuda")

    def step():
        for p in model.parameters():
            p.grad = None
        loss = step_fn(ids, targets)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    loss = step()  # the first step (compiles where it compiles)
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    result = {"variant": variant, "first_step_s": first_s, "loss": float(loss.detach())}
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    for _ in range(warmup):
        step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    result.update(step_ms=ms, step_ms_min=min(times), step_ms_max=max(times),
                  tokens_per_s=cfg["batch"] * cfg["seq"] / (ms / 1e3))
    if cuda:
        result.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      resident_before_step_gib=before / 2**30)
        if profile:
            top, busy = profile_top(step)
            result["profile_top_kernels"] = top
            result.update(profile_busy_ms_per_step=busy["busy_ms_per_step"],
                          profile_idle_ms_per_step=ms - busy["busy_ms_per_step"],
                          profile_kernels_per_step=busy["kernels_per_step"],
                          profile_gaps_two_steps=busy["largest_gaps"])
    del model, step_fn
    if cuda:
        torch.cuda.empty_cache()
    return result, grads


def agreement(grads, ref):
    """Largest relative error (Frobenius) of a parameter's gradient against eager's, and where."""
    worst, where = 0.0, None
    for n, g in ref.items():
        err = float((grads[n] - g).norm() / g.norm().clamp_min(1e-30))
        if not math.isfinite(err) or err > worst:
            worst, where = err, n
    return worst, where


def ratios(rows, peers=("compile", "liger")):
    base = {r["variant"]: r for r in rows if "step_ms" in r}
    for r in rows:
        if "step_ms" in r:
            r["x_eager"] = base["eager"]["step_ms"] / r["step_ms"]
            for peer in peers:
                if peer in base:
                    r[f"x_{peer}"] = base[peer]["step_ms"] / r["step_ms"]


def measure_variants(variants, run, served, record, peers=("compile", "liger")):
    """Each variant's result (eager first: the reference of agreement), with its loss and
    gradients against eager's and, where served(variant) says, which backend served each op; a
    variant that cannot import or fails is a result, not the end of the run. record(rows) runs
    after every variant, so a run cut short keeps what it measured."""
    rows, ref, ref_loss = [], None, 0.0
    for v in variants:
        try:
            r, grads = run(v)
        except ImportError as e:
            rows.append({"variant": v, "skipped": f"not importable: {e}"})
            record(rows)
            continue
        except Exception as e:
            if v == "eager":
                raise
            rows.append({"variant": v, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(v, "failed:", rows[-1]["error"][:300])
            record(rows)
            continue
        if v == "eager":
            ref, ref_loss = grads, r["loss"]
        r["loss_minus_eager"] = r["loss"] - ref_loss
        r["grad_rel_err_max"], r["grad_rel_err_param"] = agreement(grads, ref)
        ops = served(v)
        if ops is not None:
            r["served"] = ops
        rows.append(r)
        print(f"{v}: {r['step_ms']:.2f} ms/step, first step {r['first_step_s']:.1f} s, "
              f"peak {r.get('peak_gib', float('nan')):.2f} GiB, loss - eager {r['loss_minus_eager']:+.2e}, "
              f"grad rel err {r['grad_rel_err_max']:.2e}", flush=True)
        ratios(rows, peers)
        record(rows)
    print_table([r for r in rows if "step_ms" in r],
                ["variant", "step_ms", "tokens_per_s", "x_eager", *[f"x_{p}" for p in peers], "peak_gib",
                 "loss_minus_eager", "grad_rel_err_max"])
    for r in rows:
        if "served" in r:
            print(r["variant"], {op: s.get("backend", s.get("reason")) for op, s in r["served"].items()})
        if "skipped" in r:
            print(r["variant"], r["skipped"])
    return rows


def step_arguments(variants):
    """The options both step benchmarks take (this one and bench_hybrid_step.py)."""
    ap = argparse.ArgumentParser()
    # Compiling variants last: their first step compiles (a minute or more each on the H200).
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", default="",
                    help="comma-separated variants whose kernels are profiled over two extra steps "
                         "(CUDA only): the top kernels by device time go into the JSON")
    ap.add_argument("--out", default=None)
    return ap


def step_inputs(model, cfg, dev, dt, keep=lambda name: False):
    """The model's weights at a trained model's scales (matrices scaled to std 0.02, except those
    `keep` names; norms at 1), and a batch of token ids and targets."""
    torch.manual_seed(0)
    state = {k: v.to(dev, dt) for k, v in model(cfg).state_dict().items()}
    for k in state:
        if state[k].dim() == 2 and not keep(k):
            state[k].mul_(0.02 / state[k].std().clamp_min(1e-6))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(dev)
    targets = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(dev)
    return state, ids, targets


def variants_of(args):
    variants = [v for v in args.variants.split(",") if v]
    return variants if "eager" in variants else ["eager", *variants]  # eager: agreement's reference


def step_setup(args, full, tiny):
    """From step_arguments' parsed options: the model's sizes (`tiny` with --tiny, else `full`),
    device, dtype (bfloat16 on CUDA, float32 on the CPU, unless --dtype), the variants (eager
    first) and the run's environment for the JSON."""
    dev = args.device
    dt = getattr(torch, args.dtype or ("bfloat16" if dev.startswith("cuda") else "float32"))
    return tiny if args.tiny else full, dev, dt, variants_of(args), environment("python " + " ".join(sys.argv))


def main() -> int:
    ap = step_arguments("eager,kernelgate,liger,compile,kernelgate_compile,compile_hook")
    ap.add_argument("--evidence", action="append", default=[],
                    help="use these stores as the shipped evidence instead of the package's "
                         "(e.g. a sweep not yet shipped); default: as installed")
    args = ap.parse_args()
    cfg, dev, dt, variants, env = step_setup(args, FULL, TINY)
    if args.evidence:
        # as installed, but with these stores in the package's place: no user store
        _C.use_evidence(os.fsencode(os.path.join(tempfile.mkdtemp(), "user.sqlite")),
                        [os.fsencode(p) for p in args.evidence])
    state, ids, targets = step_inputs(lambda c: Model(c, EagerOps()), cfg, dev, dt)

    def record(rows):
        if args.out:
            write_json(args.out, {**env, "model": cfg, "dtype": str(dt).replace("torch.", ""),
                                  "warmup_steps": args.warmup, "timed_steps": args.steps,
                                  "evidence": args.evidence or "as installed", "variants": rows})

    measure_variants(
        variants,
        lambda v: run_variant(v, cfg, state, ids, targets, dev, dt, args.warmup, args.steps,
                              profile=dev.startswith("cuda") and v in args.profile.split(",")),
        lambda v: served(cfg, dev, dt, v == "kernelgate_attention") if v.startswith("kernelgate") else hook_rewrites(v), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
