"""One training step of a hybrid LM: Gated DeltaNet blocks (with their short convs) alternating
with attention blocks, swiglu MLPs, rms_norm, rope and a fused linear cross-entropy head. The
step issue 16 ends in: kernelgate as installed against the calls a researcher hand-picks today.

The model (default sizes): 8 layers alternating Gated DeltaNet and attention (GDN first), hidden
2048; GDN: 16 heads of 128 (q, k, v), short convs of width 4 on q, k and v (silu), gates
g = -exp(A_log) * softplus(a(x) + dt_bias) and beta = sigmoid(b(x)), the gated delta rule with q
and k l2-normalised, a per-head rms_norm gated by silu(gate(x)); attention: 16 query and 4 kv
heads of 128 through SDPA (causal, GQA) with rope; swiglu MLP 5632; vocab 128256; batch 4 x 2048
tokens, bfloat16. Variants:

  eager       plain PyTorch: the eager ops of bench_train_step.py, the short conv as PyTorch's
              depthwise conv1d, the gated delta rule chunked in plain PyTorch (chunked_gdr below)
  compile     torch.compile of the eager model
  fla_liger   what a researcher hand-picks today: Liger-Kernel's norms, rope, swiglu and fused
              linear cross entropy, FLA's causal_conv1d and chunk_gated_delta_rule (its fused
              layer form: the gate, beta's sigmoid and the l2 norms in its kernels)
  kernelgate  kernelgate's ops as installed (kg.rms_norm, kg.add_rms_norm, kg.rope, kg.swiglu,
              kg.linear_cross_entropy) and the drop-ins kernelgate.fla.causal_conv1d and
              kernelgate.fla.chunk_gated_delta_rule (the same fused form), which go to FLA or to
              kernelgate's ops as the drop-ins decide (recorded in "served")

Per variant: step time (CUDA events, median after warm-up), tokens/s, peak memory, agreement
with eager (loss, every parameter's gradient), and for kernelgate which backend serves each op.

    python bench/bench_hybrid_step.py --out bench/results/h200/hybrid_step.json
    python bench/bench_hybrid_step.py --tiny --device cpu --variants eager     # a check
"""

import sys

import torch
import torch.nn.functional as F

import kernelgate as kg
from bench_train_step import (EagerOps, KernelgateOps, LigerOps, measure_variants, run_variant,
                              step_arguments, step_inputs, step_setup)
from common import write_json

FULL = dict(layers=8, hidden=2048, heads=16, kv_heads=4, head_dim=128, gdn_heads=16, gdn_dim=128,
            conv=4, mlp=5632, vocab=128256, batch=4, seq=2048)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, gdn_heads=4, gdn_dim=16,
            conv=4, mlp=96, vocab=200, batch=2, seq=40)
CHUNK = 64


def chunked_gdr(q, k, v, g, beta, scale, chunk=CHUNK):
    """The gated delta rule in plain PyTorch, chunk by chunk, on [batch, seq, heads, dim] (q, k
    already l2-normalised; g <= 0 in log space, beta in [0, 1]); float32 math (float64 for
    float64 inputs). Per head, with
    state S [dk, dv]: S_t = exp(g_t) S_{t-1} + k_t u_t^T, u_t = beta_t (v_t - exp(g_t) S_{t-1}^T
    k_t), o_t = scale * S_t^T q_t. Within a chunk, with G the running sum of g and S0 the state
    entering it: U = T^-1 diag(beta) (V - diag(exp G) K S0), T = I + diag(beta) (strictly lower
    exp(G_i - G_j) K K^T); O = scale (diag(exp G) Q S0 + (lower-inclusive exp(G_i - G_j) Q K^T) U);
    the state leaving it exp(G_C) S0 + K^T diag(exp(G_C - G)) U."""
    dt, acc = v.dtype, torch.promote_types(v.dtype, torch.float32)  # float64 stays float64
    q, k, v = (t.transpose(1, 2).to(acc) for t in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2).to(acc), beta.transpose(1, 2).to(acc)  # [B, H, T]
    B, H, T, dk = k.shape
    state = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk]
        G = g[:, :, s:s + chunk].cumsum(-1)
        bc = beta[:, :, s:s + chunk]
        n = G.shape[-1]
        diff = G[..., :, None] - G[..., None, :]  # G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(torch.where(lower, diff, float("-inf")))  # 0 above the diagonal
        strict = decay * (~torch.eye(n, dtype=torch.bool, device=q.device))
        tmat = torch.eye(n, device=q.device, dtype=acc) + bc[..., None] * (strict * (kc @ kc.transpose(-1, -2)))
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(tmat, rhs, upper=False, unitriangular=True)
        o = G.exp()[..., None] * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ u
        outs.append(scale * o)
        last = G[..., -1:]
        state = last.exp()[..., None] * state + kc.transpose(-1, -2) @ (torch.exp(last - G)[..., None] * u)
    return torch.cat(outs, 2).transpose(1, 2).to(dt)


def recurrent_gdr(q, k, v, g, beta, scale):
    """The same recurrence one step at a time (float64 where given): the check of chunked_gdr."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    B, H, T, dk = k.shape
    state = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for t in range(T):
        state = g[:, :, t, None, None].exp() * state
        u = beta[:, :, t, None] * (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2))
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append(scale * (state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, 2).transpose(1, 2)


def eager_conv(x, w):
    """silu of the causal depthwise conv over time of x [batch, seq, dim] with w [dim, width]."""
    y = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), None, padding=w.shape[1] - 1, groups=x.shape[2])
    return F.silu(y[..., : x.shape[1]]).transpose(1, 2)


def eager_gdr(q, k, v, g, beta, scale):
    """The gated delta rule as plain PyTorch code: q and k l2-normalised, then chunked_gdr."""
    return chunked_gdr(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta, scale)


def eager_layer_gdr(q, k, v, a, b, A_log, dt_bias, scale):
    """The Gated DeltaNet layer's gates as plain PyTorch code, g = -exp(A_log) * softplus(a +
    dt_bias) in float32 and beta = sigmoid(b), then eager_gdr."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return eager_gdr(q, k, v, g, torch.sigmoid(b), scale)


# FLA's chunk_gated_delta_rule in the layer's fused form (a and b raw; A_log, dt_bias given).
FUSED = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)


class EagerHybrid(EagerOps):
    def conv(self, x, w):
        return eager_conv(x, w)

    def gdr(self, q, k, v, a, b, A_log, dt_bias, scale):
        return eager_layer_gdr(q, k, v, a, b, A_log, dt_bias, scale)


class FlaGdr:
    """FLA's chunked gated delta rule in the fused form; with --gdr chunked the eager variant's
    instead (FLA 0.5 / 0.6 refuse its backward on Hopper with triton < 3.7.1: the rest of the
    step can still be compared)."""

    plain_gdr = False

    def gdr(self, q, k, v, a, b, A_log, dt_bias, scale):
        if self.plain_gdr:
            return eager_layer_gdr(q, k, v, a, b, A_log, dt_bias, scale)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, a, b, scale=scale, A_log=A_log, dt_bias=dt_bias, **FUSED)[0]


class FlaLigerHybrid(FlaGdr, LigerOps):
    name = "fla_liger"

    def conv(self, x, w):
        from fla.modules.convolution import causal_conv1d
        return causal_conv1d(x, w, activation="silu")[0]


class KernelgateHybrid(KernelgateOps):
    plain_gdr = False  # the drop-in decides where its calls go, --gdr or not

    def conv(self, x, w):
        from kernelgate.fla import causal_conv1d
        return causal_conv1d(x, w, activation="silu")[0]

    def gdr(self, q, k, v, a, b, A_log, dt_bias, scale):
        from kernelgate.fla import chunk_gated_delta_rule
        return chunk_gated_delta_rule(q, k, v, a, b, scale=scale, A_log=A_log, dt_bias=dt_bias, **FUSED)[0]


class HybridModel(torch.nn.Module):
    def __init__(self, cfg, ops):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        H, D, Hg, Dg = cfg["hidden"], cfg["head_dim"], cfg["gdn_heads"], cfg["gdn_dim"]
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.embed = torch.nn.Embedding(cfg["vocab"], H)
        self.layers = torch.nn.ModuleList()
        for i in range(cfg["layers"]):
            layer = torch.nn.Module()
            layer.kind = "gdn" if i % 2 == 0 else "attn"
            layer.mix_norm = torch.nn.Parameter(torch.ones(H))
            if layer.kind == "gdn":
                layer.q, layer.k, layer.v = lin(H, Hg * Dg), lin(H, Hg * Dg), lin(H, Hg * Dg)
                for name in ("q_conv", "k_conv", "v_conv"):
                    setattr(layer, name, torch.nn.Parameter(torch.randn(Hg * Dg, cfg["conv"]) * 0.3))
                layer.a, layer.b, layer.gate = lin(H, Hg), lin(H, Hg), lin(H, Hg * Dg)
                layer.A_log = torch.nn.Parameter(torch.log(torch.empty(Hg).uniform_(1, 16)))
                layer.dt_bias = torch.nn.Parameter(torch.zeros(Hg))
                layer.o_norm = torch.nn.Parameter(torch.ones(Dg))
                layer.o = lin(Hg * Dg, H)
            else:
                layer.q, layer.k = lin(H, cfg["heads"] * D), lin(H, cfg["kv_heads"] * D)
                layer.v, layer.o = lin(H, cfg["kv_heads"] * D), lin(cfg["heads"] * D, H)
            layer.mlp_norm = torch.nn.Parameter(torch.ones(H))
            layer.up, layer.gate_mlp = lin(H, cfg["mlp"]), lin(H, cfg["mlp"])
            layer.down = lin(cfg["mlp"], H)
            self.layers.append(layer)
        self.final_norm = torch.nn.Parameter(torch.ones(H))
        self.lm_head = lin(H, cfg["vocab"])
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.outer(torch.arange(cfg["seq"]).float(), inv)
        ang = torch.cat([ang, ang], -1)[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def gdn(self, layer, x):
        cfg, ops = self.cfg, self.ops
        B, S, _ = x.shape
        Hg, Dg = cfg["gdn_heads"], cfg["gdn_dim"]
        q = ops.conv(layer.q(x), layer.q_conv.to(x.dtype)).view(B, S, Hg, Dg)
        k = ops.conv(layer.k(x), layer.k_conv.to(x.dtype)).view(B, S, Hg, Dg)
        v = ops.conv(layer.v(x), layer.v_conv.to(x.dtype)).view(B, S, Hg, Dg)
        o = ops.gdr(q, k, v, layer.a(x), layer.b(x), layer.A_log, layer.dt_bias, Dg ** -0.5)
        o = ops.norm(o, layer.o_norm) * F.silu(layer.gate(x).view(B, S, Hg, Dg))
        return layer.o(o.reshape(B, S, Hg * Dg))

    def attention(self, layer, x, cos, sin):
        cfg, ops = self.cfg, self.ops
        B, S, _ = x.shape
        Hq, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        q = layer.q(x).view(B, S, Hq, D).transpose(1, 2)
        k = layer.k(x).view(B, S, Hkv, D).transpose(1, 2)
        v = layer.v(x).view(B, S, Hkv, D).transpose(1, 2)
        q, k = ops.rope(q, k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return layer.o(a.transpose(1, 2).reshape(B, S, Hq * D))

    def forward(self, ids, targets):
        ops = self.ops
        B, S = ids.shape
        cos, sin = self.cos.to(self.embed.weight.dtype), self.sin.to(self.embed.weight.dtype)
        residual = self.embed(ids)
        x = ops.norm(residual, self.layers[0].mix_norm)
        for i, layer in enumerate(self.layers):
            mixed = self.gdn(layer, x) if layer.kind == "gdn" else self.attention(layer, x, cos, sin)
            x, residual = ops.add_norm(mixed, residual, layer.mlp_norm)
            m = layer.down(ops.swiglu(layer.gate_mlp(x), layer.up(x)))
            nxt = self.layers[i + 1].mix_norm if i + 1 < len(self.layers) else self.final_norm
            x, residual = ops.add_norm(m, residual, nxt)
        return ops.loss(x.reshape(B * S, -1), self.lm_head.weight, targets.reshape(-1))


def make_ops(variant, gdr="fla"):
    table = {"eager": EagerHybrid, "compile": EagerHybrid, "fla_liger": FlaLigerHybrid,
             "kernelgate": KernelgateHybrid}
    if variant not in table:
        raise SystemExit(f"--variants: unknown variant '{variant}' ({', '.join(table)})")
    ops = table[variant]()
    ops.plain_gdr = gdr == "chunked"
    return ops


def served(cfg, dev, dt):
    """Which backend serves each kernelgate call of the model at its shapes, in a training step."""
    B, S, H = cfg["batch"], cfg["seq"], cfg["hidden"]
    Dg = cfg["gdn_heads"] * cfg["gdn_dim"]

    def t(*shape):
        return torch.empty(*shape, device=dev, dtype=dt, requires_grad=True)

    cos = torch.empty(1, S, cfg["head_dim"], device=dev, dtype=dt)
    calls = {
        "rms_norm": (t(B, S, H), t(H)),
        "rms_norm (gdn output, per head)": (t(B, S, cfg["gdn_heads"], cfg["gdn_dim"]), t(cfg["gdn_dim"])),
        "add_rms_norm": (t(B, S, H), t(B, S, H), t(H)),
        "rope": (t(B, S, cfg["heads"], cfg["head_dim"]).transpose(1, 2),
                 t(B, S, cfg["kv_heads"], cfg["head_dim"]).transpose(1, 2), cos, cos),
        "swiglu": (t(B * S, cfg["mlp"]), t(B * S, cfg["mlp"])),
        "linear_cross_entropy": (t(B * S, H), t(cfg["vocab"], H), torch.zeros(B * S, dtype=torch.long, device=dev)),
    }
    out = {}
    for name, args in calls.items():
        e = kg.explain(name.split(" ")[0], *args)
        out[name] = {"backend": e.backend, "reason": e.reason}
    from kernelgate.fla import explain_causal_conv1d
    out["causal_conv1d (kernelgate.fla)"] = {"reason": explain_causal_conv1d(t(B, S, Dg), t(Dg, cfg["conv"]),
                                                                             activation="silu")}
    from kernelgate.fla import explain_chunk_gated_delta_rule
    Hg, Dh = cfg["gdn_heads"], cfg["gdn_dim"]
    gdr = (t(B, S, Hg, Dh), t(B, S, Hg, Dh), t(B, S, Hg, Dh), t(B, S, Hg), t(B, S, Hg))
    out["gated_delta_rule (kernelgate.fla)"] = {"reason": explain_chunk_gated_delta_rule(
        *gdr, A_log=t(Hg), dt_bias=t(Hg), scale=Dh ** -0.5, **FUSED)}
    if out["gated_delta_rule (kernelgate.fla)"]["reason"] == "kernelgate":  # then the op's own choice
        e = kg.explain("gated_delta_rule", *gdr, t(Hg), t(Hg))
        out["gated_delta_rule (kernelgate.fla)"].update(backend=e.backend, op_reason=e.reason)
    return out


def main() -> int:
    ap = step_arguments("eager,fla_liger,kernelgate,compile")
    ap.add_argument("--gdr", default="fla", choices=["fla", "chunked"],
                    help="the gated delta rule of fla_liger: FLA's, or the eager variant's chunked "
                         "one (where FLA refuses its backward); kernelgate's drop-in decides for itself")
    args = ap.parse_args()
    cfg, dev, dt, variants, env = step_setup(args, FULL, TINY)
    # the short convs' weights keep their init's scale
    state, ids, targets = step_inputs(lambda c: HybridModel(c, EagerHybrid()), cfg, dev, dt,
                                      keep=lambda name: name.endswith("_conv"))

    def record(rows):
        if args.out:
            write_json(args.out, {**env, "model": cfg, "gdr": args.gdr,
                                  "dtype": str(dt).replace("torch.", ""), "warmup_steps": args.warmup,
                                  "timed_steps": args.steps, "variants": rows})

    measure_variants(
        variants,
        lambda v: run_variant(v, cfg, state, ids, targets, dev, dt, args.warmup, args.steps,
                              profile=dev.startswith("cuda") and v in args.profile.split(","),
                              build=lambda v: HybridModel(cfg, make_ops(v, args.gdr))),
        lambda v: served(cfg, dev, dt) if v == "kernelgate" else None, record,
        peers=("compile", "fla_liger"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
