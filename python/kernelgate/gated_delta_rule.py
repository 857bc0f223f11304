"""gated_delta_rule: the Gated DeltaNet recurrence (Yang, Kautz and Hatamizadeh, 2024) in the form a
Gated DeltaNet layer computes it — FLA's ``chunk_gated_delta_rule(q, k, v, g, beta, ...,
use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
use_beta_sigmoid_in_kernel=True, output_final_state=True)``:

    q_t, k_t = q_t / sqrt(|q_t|^2 + 1e-6), k_t / sqrt(|k_t|^2 + 1e-6)     (per head)
    a_t = -exp(A_log) * softplus(g_t + dt_bias)                       (the log decay, <= 0)
    b_t = sigmoid(beta_t)
    S_t = exp(a_t) S_{t-1} + b_t k_t (v_t - exp(a_t) S_{t-1}^T k_t)^T    (S: [dk, dv] per head)
    o_t = scale * S_t^T q_t

from S_0 = initial_state (zeros when absent), for q, k [batch, seq, heads, dk], v [batch, seq,
heads, dv], g and beta [batch, seq, heads], A_log and dt_bias [heads]; scale 0 means 1/sqrt(dk) (FLA's scale=None).
It returns o (v's dtype) and the final state S_seq [batch, heads, dk, dv] in float32 (float64 for
float64 inputs). Every input gets a gradient. The raw gate and beta logits are what the layer's
projections produce, so any real values are in the op's domain (a precomputed log decay must be
<= 0 and a post-sigmoid beta in (0, 1), which random test values are not).

The reference computes in chunks of 64 steps in float32 (float64: the oracle), with the WY
form of the delta rule: within a chunk, with G_t the cumulative log decay and S_0 the chunk's
initial state, the corrected values U solve (I + A) U = diag(b) (V - diag(exp G) K S_0) with
A_ts = b_t exp(G_t - G_s) k_t.k_s for s < t (unit lower triangular: torch's triangular solve),
o = scale (diag(exp G) Q S_0 + (exp(G_t - G_s) q_t.k_s)_{s<=t} U), and the chunk's final state
is exp(G_C) S_0 + K^T diag(exp(G_C - G)) U. The triangular systems of every chunk are solved at
once, before the pass over the chunks (U = U0 - W S_0 with U0 = (I + A)^-1 diag(b) V and
W = (I + A)^-1 diag(b exp G) K, which need no state). The pass over the chunks
(kernelgate._state_scan) then carries the state, S' = exp(G_C) S + Kend^T U (Kend: the keys
decayed to the chunk's end), three small kernels per chunk forward and three backward, and gives
every chunk's output from the states at once. Every exponent is <= 0 (the decays are masked before
exp), so nothing overflows; a sequence not a multiple of 64 is padded with steps of decay 0 and
b = 0, which leave the state as it is. Its gradients are autograd's through that code (the pass's
and the q, k normalisation's written out, so that the backward keeps no float32 copy of q or k,
no [dk, dk] matrix per chunk and no tensor of the states' size beside the states and their
gradients); tests/python/test_gated_delta_rule.py checks it against
the step-by-step recurrence in float64.
"""

import torch

from ._define import define_op
from ._l2norm import l2_normalize
from ._state_scan import chunk_pass

SCHEMA = ("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor A_log, "
          "Tensor? dt_bias=None, Tensor? initial_state=None, float scale=0.0) -> (Tensor, Tensor)")
DIMS = ("q: [batch, seq, heads, dk]; k: [batch, seq, heads, dk]; v: [batch, seq, heads, dv]; "
        "g: [batch, seq, heads]; beta: [batch, seq, heads]; A_log: [heads]; dt_bias?: [heads]; "
        "initial_state?: [batch, heads, dk, dv]")


def gated_delta_rule_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    decay, b = gates(q.dtype, g, beta, A_log, dt_bias)
    return chunked(q, k, v, decay, b, initial_state, scale)


def gates(dtype, g, beta, A_log=None, dt_bias=None, beta_logits=True):
    """The log decay and b per step and head ([B, T, H]) in the accumulation dtype of `dtype`: the
    decay -exp(A_log) softplus(g + dt_bias) from the raw gate, or g itself where A_log is None (a
    precomputed log decay); b = sigmoid(beta) from logits, or beta itself (beta_logits False)."""
    import torch.nn.functional as F

    acc = torch.promote_types(dtype, torch.float32)
    if A_log is None:
        decay = g.to(acc)
    else:
        x = g.to(acc) if dt_bias is None else g.to(acc) + dt_bias.to(acc)
        decay = -torch.exp(A_log.to(acc)) * F.softplus(x)
    return decay, torch.sigmoid(beta.to(acc)) if beta_logits else beta.to(acc)


def chunked(q, k, v, decay, b, initial_state, scale, normalize=True):
    """The chunked computation itself, from the log decay (<= 0) and b in [0, 1] per step and head
    ([B, T, H], either dtype), q and k l2-normalised first unless normalize is False: the
    reference's part after its gates (and what kernelgate.fla trains FLA's other forms through
    where FLA refuses its own backward)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K ** -0.5 if scale == 0 and K > 0 else scale  # dk 0: o is 0 whatever the scale
    C = 64
    N = max(1, -(-T // C))
    pad = N * C - T

    def chunks(x, fill=0.0):  # [B, T, H, ...] -> [N, B, H, C, ...] in acc, padded at the end
        x = x.to(acc)
        if pad:
            x = torch.cat([x, x.new_full((B, pad) + x.shape[2:], fill)], dim=1)
        x = x.reshape((B, N, C) + x.shape[2:])
        return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()

    if normalize:
        q, k = l2_normalize(q, acc), l2_normalize(k, acc)
    Q, Kc, Vc = chunks(q), chunks(k), chunks(v)
    a, b = chunks(decay), chunks(b)  # [N, B, H, C]
    G = a.cumsum(-1)
    t_idx = torch.arange(C, device=q.device)
    lower_eq = t_idx[:, None] >= t_idx[None, :]
    # exp(G_t - G_s) for s <= t, 0 above the diagonal; masked_fill with a Python scalar: no
    # host-to-device copy (a CUDA graph captures it)
    D = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower_eq, float("-inf")))
    # A's strictly lower part; the solve reads neither its diagonal (unit) nor above it, and
    # gives the diagonal no gradient
    A = b[..., :, None] * (D * (Kc @ Kc.transpose(-1, -2)))  # [N, B, H, C, C]
    eG = torch.exp(G)[..., None]
    # Every chunk's WY factors at once (they need no state): U = U0 - W S_0.
    UW = torch.linalg.solve_triangular(A, torch.cat([b[..., None] * Vc, (b[..., None] * eG) * Kc], -1),
                                       upper=False, unitriangular=True)
    eGend = torch.exp(G[..., -1:] - G)[..., None]  # the keys' decay to the chunk's end (applied in the pass)
    eGC = torch.exp(G[..., -1])[..., None, None]  # [N, B, H, 1, 1]
    qk = (Q @ Kc.transpose(-1, -2)) * D
    S0 = (torch.zeros(B, H, K, V, dtype=acc, device=q.device) if initial_state is None
          else initial_state.to(acc))
    # The pass over the chunks: o = s (diag(exp G) Q S + qk U) with U = U0 - W S, S the state
    # entering the chunk
    o, final, _ = chunk_pass(eGC, Kc.transpose(-1, -2), UW, Q, qk, S0, eG, eGend)  # o: [N, B, H, C, V]
    o = (s * o).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(v.dtype), final


gated_delta_rule = define_op(
    SCHEMA,
    dims=DIMS,
    reference=gated_delta_rule_reference,
    test_values={"scale": [0.0, 0.125]},
    # seq: below one chunk, one chunk and a step, many chunks; dk up to 256 (FLA's kernels' limit).
    dim_ranges={"batch": (1, 64), "seq": (1, 65536), "heads": (1, 64), "dk": (1, 256), "dv": (1, 512)},
    production_shapes=[{"batch": 4, "seq": 4096, "heads": 16, "dk": 128, "dv": 128},
                       {"batch": 8, "seq": 2048, "heads": 16, "dk": 128, "dv": 256},
                       {"batch": 1, "seq": 8192, "heads": 32, "dk": 128, "dv": 128}],
    outputs=("o", "final_state"),
    # The reference is the fast fallback (the plain chunked layer is several times slower) and keeps
    # less than the plain layer: trained through, its graph is kept, not its forward run twice.
    record_reference=True,
)
