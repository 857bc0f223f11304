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
block per chunk is why the chunk is short), in blocks of chunks and again in the backward rather
than kept (_DecayedProducts); U = U0 - W S_0 with U0 = (I + A)^-1 diag(b) V and
W = (I + A)^-1 diag(b) (K exp G), solved for every chunk at once. The state leaving a chunk,
exp(G_C) S_0 + (K exp(G_C - G))^T U, is carried by the pass over the chunks of
kernelgate._state_scan (three small kernels per chunk forward, three backward), which gives
o = scale ((Q exp G) S_0 + P U) for every chunk at once. A sequence not a multiple of 16 is
padded with steps of decay 0 and b = 0. Its gradients are autograd's through that code (the state
pass's, the decay products' and the q, k normalisation's written out); tests/python/test_kda.py
checks it against the step-by-step recurrence in float64.
"""

import torch

from ._define import define_op
from ._l2norm import l2_normalize
from ._state_scan import chunk_pass

# Elements of a block of the within-chunk decay products' [chunks, ..., C, C, dk] temporaries
# (two at a time: 64 MiB in float32).
_BLOCK = 1 << 23


def _masked_decay(G, transposed=False):
    """exp(G_t - G_s) per key channel for s <= t and 0 elsewhere, indexed [..., t, s, dk] (or
    [..., s, t, dk] if transposed), from G [..., C, dk], the cumulative log decay: every exponent is
    <= 0, so nothing overflows however strong the decay."""
    idx = torch.arange(G.shape[-2], device=G.device)
    first, second = G[..., :, None, :], G[..., None, :, :]
    if transposed:  # [s, t]: G_t - G_s where t >= s
        diff, outside = second - first, idx[None, :] < idx[:, None]
    else:
        diff, outside = first - second, idx[:, None] < idx[None, :]
    return torch.exp(diff.masked_fill_(outside[..., None], float("-inf")))  # diff: a temporary of its own


def _chunk_blocks(x):
    """Slices of x's leading (chunk) dim with at most about _BLOCK elements of [..., C, C, dk] each."""
    per_chunk = x[:1].numel() * x.shape[-2]
    step = max(1, _BLOCK // max(1, per_chunk))
    return [slice(i, i + step) for i in range(0, x.shape[0], step)]


def _rows_times(m, x):
    """sum_c m[..., t, s, c] x[..., t, c] -> [..., t, s] (a matmul per row t: no product temporary)."""
    return (m @ x[..., :, :, None]).squeeze(-1)


def _weighted_rows(w, m):
    """sum_s w[..., t, s] m[..., t, s, c] -> [..., t, c]."""
    return (w[..., :, None, :] @ m).squeeze(-2)


class _DecayedProducts(torch.autograd.Function):
    """kk_ts = sum_c k_tc k_sc E_tsc and qk_ts = sum_c q_tc k_sc E_tsc for q, k, G [chunks, ..., C,
    dk] (E = _masked_decay(G)), in blocks of chunks. E, [chunks, ..., C, C, dk], is recomputed in
    the backward rather than kept: as plain autograd code it and the products' operands were most
    of what the reference kept for its backward (dk times the size of everything else per chunk).
    With t_side = sum_s dkk_ts E_tsc k_sc and s_side = sum_t E_tsc (dkk_ts k_tc + dqk_ts q_tc):
    dq = sum_s dqk_ts E_tsc k_sc, dk = t_side + s_side, dG = k t_side + q dq - k s_side. The
    backward is written in differentiable ops, so the reference stays twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, G):
        ctx.save_for_backward(q, k, G)
        kk, qk = [], []
        for b in _chunk_blocks(q):
            ek = _masked_decay(G[b]).mul_(k[b][..., None, :, :])  # E_tsc k_sc
            kk.append(_rows_times(ek, k[b]))
            qk.append(_rows_times(ek, q[b]))
        return torch.cat(kk), torch.cat(qk)

    @staticmethod
    def backward(ctx, d_kk, d_qk):
        q, k, G = ctx.saved_tensors
        dq, dk, dG = [], [], []
        for b in _chunk_blocks(q):
            kb, qb, dkk, dqk = k[b], q[b], d_kk[b], d_qk[b]
            ek = _masked_decay(G[b]) * kb[..., None, :, :]
            dq_b, t_side = _weighted_rows(dqk, ek), _weighted_rows(dkk, ek)
            del ek
            et = _masked_decay(G[b], transposed=True)  # [s, t, c]
            s_side = (_weighted_rows(dkk.transpose(-1, -2), et * kb[..., None, :, :])
                      + _weighted_rows(dqk.transpose(-1, -2), et * qb[..., None, :, :]))
            dq.append(dq_b)
            dk.append(t_side + s_side)
            dG.append(kb * (t_side - s_side) + qb * dq_b)
        return torch.cat(dq), torch.cat(dk), torch.cat(dG)


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

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...] in acc, zero-padded at the end
        x = x.to(acc)
        if pad:
            x = torch.cat([x, x.new_zeros((B, pad) + x.shape[2:])], dim=1)
        x = x.reshape((B, N, C) + x.shape[2:])
        return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()

    x = g.to(acc) if dt_bias is None else g.to(acc) + dt_bias.to(acc)
    decay = -torch.exp(A_log.to(acc))[:, None] * F.softplus(x)  # [B, T, H, K]
    Q, Kc, Vc = chunks(l2_normalize(q, acc)), chunks(l2_normalize(k, acc)), chunks(v)
    G = chunks(decay).cumsum(-2)
    b = chunks(torch.sigmoid(beta.to(acc)))  # [N, B, H, C]
    kk, P = _DecayedProducts.apply(Q, Kc, G)  # [N, B, H, C, C], 0 above the diagonal
    # A's strictly lower part; the solve reads neither its diagonal (unit) nor above it, and gives
    # the diagonal no gradient
    A = b[..., None] * kk
    eG = torch.exp(G)
    # Every chunk's WY factors at once (they need no state): U = U0 - W S_0.
    UW = torch.linalg.solve_triangular(A, torch.cat([b[..., None] * Vc, b[..., None] * (Kc * eG)], -1),
                                       upper=False, unitriangular=True)
    Kend_t = (Kc * torch.exp(G[..., -1:, :] - G)).transpose(-1, -2)  # keys decayed to the chunk's end, per channel
    eGC = torch.exp(G[..., -1, :])[..., None]  # [N, B, H, K, 1]
    S0 = (torch.zeros(B, H, K, V, dtype=acc, device=q.device) if initial_state is None
          else initial_state.to(acc))
    # The pass over the chunks (a state decay per row): o = s (diag(exp G) Q S + P U)
    o, final, _ = chunk_pass(eGC, Kend_t, UW, Q * eG, P, S0)  # o: [N, B, H, C, V]
    o = (s * o).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(v.dtype), final


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
    # The reference is the fast fallback (the plain chunked layer is several times slower) and keeps
    # less than the plain layer: trained through, its graph is kept, not its forward run twice.
    record_reference=True,
)
