"""kda: Kimi Delta Attention (Kimi Linear, 2025), the gated delta rule with a decay per key
channel, in the form a KDA layer computes it — FLA's ``chunk_kda(q, k, v, g, beta, ...,
use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
use_beta_sigmoid_in_kernel=True, output_final_state=True)`` without GVA (as many value heads as
query heads):

    q_t, k_t = q_t / sqrt(|q_t|^2 + 1e-6), k_t / sqrt(|k_t|^2 + 1e-6)       (per head)
    a_t = -exp(A_log) * softplus(g_t + dt_bias)       (per head and key channel: [dk], <= 0)
    b_t = sigmoid(beta_t)
    S_t = diag(exp(a_t)) S_{t-1} + b_t k_t (v_t - (diag(exp(a_t)) S_{t-1})^T k_t)^T   (S: [dk, dv])
    o_t = scale * S_t^T q_t

from S_0 = initial_state (zeros when absent), for q, k and g [batch, seq, heads, dk], v [batch,
seq, heads, dv], beta [batch, seq, heads], A_log [heads], dt_bias [heads, dk] (FLA's flat
[heads * dk], reshaped); scale 0 means 1/sqrt(dk). It returns o (v's dtype) and the final state
[batch, heads, dk, dv] in float32 (float64 for float64 inputs). Every input gets a gradient.

The reference computes in chunks of 16 steps in float32 (float64: the oracle), in the WY form of
the gated_delta_rule op's reference with the decay per channel: with G the cumulative log decay
of the chunk per channel, A_ts = b_t sum_c k_tc k_sc exp(G_tc - G_sc) (s < t) and the output's
P_ts = sum_c q_tc k_sc exp(G_tc - G_sc) (s <= t) are formed from the masked exponentials
themselves (every exponent <= 0: nothing overflows however strong the decay; the [16, 16, dk]
block per chunk is why the chunk is short); U = U0 - W S_0 with U0 = (I + A)^-1 diag(b) V and
W = (I + A)^-1 diag(b) (K exp G), solved for every chunk at once; then per chunk
o = scale ((Q exp G) S_0 + P U) and the state leaving it exp(G_C) S_0 + (K exp(G_C - G))^T U.
A sequence not a multiple of 16 is padded with steps of decay 0 and b = 0. Its gradients are
autograd's through that code; tests/python/test_kda.py checks it against the step-by-step
recurrence in float64.
"""

import torch

from ._define import define_op

SCHEMA = ("kda(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, "
          "Tensor? dt_bias=None, Tensor? initial_state=None, float scale=0.0) -> (Tensor, Tensor)")
DIMS = ("q: [batch, seq, heads, dk]; k: [batch, seq, heads, dk]; v: [batch, seq, heads, dv]; "
        "g: [batch, seq, heads, dk]; beta: [batch, seq, heads]; A_log: [heads]; dt_bias?: [heads, dk]; "
        "initial_state?: [batch, heads, dk, dv]")


def kda_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    import torch.nn.functional as F

    acc = torch.promote_types(q.dtype, torch.float32)
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K ** -0.5 if scale == 0 and K > 0 else scale
    C = 16
    N = max(1, -(-T // C))
    pad = N * C - T

    def heads_first(x):  # [B, T, H, ...] -> [B, H, N, C, ...] in acc, zero-padded at the end
        x = x.to(acc).movedim(2, 1)
        if pad:
            x = torch.cat([x, x.new_zeros((B, H, pad) + x.shape[3:])], dim=2)
        return x.reshape((B, H, N, C) + x.shape[3:])

    qf, kf = q.to(acc), k.to(acc)
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    x = g.to(acc) if dt_bias is None else g.to(acc) + dt_bias.to(acc)
    decay = -torch.exp(A_log.to(acc))[:, None] * F.softplus(x)  # [B, T, H, K]
    Q, Kc, Vc, G = heads_first(qf), heads_first(kf), heads_first(v), heads_first(decay).cumsum(-2)
    b = heads_first(torch.sigmoid(beta.to(acc)))  # [B, H, N, C]
    t_idx = torch.arange(C, device=q.device)
    lower_eq = t_idx[:, None] >= t_idx[None, :]
    # exp(G_t - G_s) per key channel for s <= t, every exponent <= 0: [B, H, N, C, C, dk]
    E = torch.exp((G[..., :, None, :] - G[..., None, :, :]).masked_fill(~lower_eq[..., None], float("-inf")))
    A = (b[..., None] * torch.einsum("...tk,...sk,...tsk->...ts", Kc, Kc, E)).tril(-1)
    P = torch.einsum("...tk,...sk,...tsk->...ts", Q, Kc, E)
    eye = torch.eye(C, dtype=acc, device=q.device)
    eG = torch.exp(G)
    # Every chunk's WY factors at once (they need no state): U = U0 - W S_0.
    UW = torch.linalg.solve_triangular(eye + A, torch.cat([b[..., None] * Vc, b[..., None] * (Kc * eG)], -1),
                                       upper=False, unitriangular=True)
    U0, W = UW[..., :V], UW[..., V:]
    Kend = Kc * torch.exp(G[..., -1:, :] - G)  # keys decayed to the chunk's end, per channel
    eGC = torch.exp(G[..., -1, :])[..., None]  # [B, H, N, K, 1]
    Qd = Q * eG
    S = (torch.zeros(B, H, K, V, dtype=acc, device=q.device) if initial_state is None
         else initial_state.to(acc))
    BH = B * H

    # The pass over the chunks is gated_delta_rule's with a state decay per row: written out here,
    # not shared, since an op's evidence goes stale with its reference's own code only.
    def bmm_add(x, m1, m2, alpha=1.0):  # x + alpha * m1 @ m2, batched over [B, H]: one kernel
        return torch.baddbmm(x.reshape(BH, *x.shape[2:]), m1.reshape(BH, *m1.shape[2:]),
                             m2.reshape(BH, *m2.shape[2:]), alpha=alpha).view(*x.shape)

    # Per-chunk views by one unbind each (gated_delta_rule's reason: no N^2 work in backward).
    U0n, Wn, Qdn, Pn, eGCn, Kendn = (x.unbind(2) for x in (U0, W, Qd, P, eGC, Kend))
    outs = []
    for n in range(N):
        U = bmm_add(U0n[n], Wn[n], S, alpha=-1.0)
        outs.append(bmm_add(Qdn[n] @ S, Pn[n], U))
        S = bmm_add(eGCn[n] * S, Kendn[n].transpose(-1, -2), U)
    o = s * torch.stack(outs, dim=2)
    o = o.reshape(B, H, N * C, V)[:, :, :T].movedim(1, 2)
    return o.to(v.dtype), S


kda = define_op(
    SCHEMA,
    dims=DIMS,
    reference=kda_reference,
    test_values={"scale": [0.0, 0.125]},
    # seq: below one chunk, one chunk and a step, many chunks; dk up to 256 (FLA's kernels' limit).
    dim_ranges={"batch": (1, 64), "seq": (1, 65536), "heads": (1, 64), "dk": (1, 256), "dv": (1, 512)},
    production_shapes=[{"batch": 4, "seq": 4096, "heads": 16, "dk": 128, "dv": 128},
                       {"batch": 1, "seq": 8192, "heads": 32, "dk": 128, "dv": 128}],
    outputs=("o", "final_state"),
)
