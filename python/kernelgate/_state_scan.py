"""The chunk-to-chunk state pass of the chunked linear-attention references (gated_delta_rule, kda).

With every chunk's WY factors known, the state entering chunk n + 1 is

    S_{n+1} = M_n S_n + c_n,    M_n = diag(decay_n) - Kend_n^T W_n,    c_n = Kend_n^T U0_n

(decay_n: the chunk's total decay, one per state row or one for all; Kend_n: its keys decayed to
the chunk's end; U0_n - W_n S_n: its corrected values). Only this recurrence is sequential: one
batched matmul per chunk forward, one per chunk backward, where autograd through the unrolled
loop would launch a dozen small kernels per chunk. Everything else the references compute from
all states at once. M is recomputed in the backward rather than saved ([chunks, ..., dk, dk]).
The backward is written in differentiable ops, so the references stay twice differentiable.
"""

import torch


def _transition(decay, kend_t, w):
    """M = diag(decay) - kend_t @ w, [N, ..., dk, dk]; decay is [N, ..., dk or 1, 1]."""
    eye = torch.eye(kend_t.shape[-2], dtype=kend_t.dtype, device=kend_t.device)
    return torch.baddbmm((decay * eye).flatten(0, -3), kend_t.flatten(0, -3), w.flatten(0, -3),
                         alpha=-1.0).view(*kend_t.shape[:-1], kend_t.shape[-2])


class _StateScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay, kend_t, w, c, s0):
        m = _transition(decay, kend_t, w)
        n = c.shape[0]
        states = torch.empty((n + 1,) + tuple(c.shape[1:]), dtype=c.dtype, device=c.device)
        states[0] = s0
        mb, cb, sb = m.flatten(1, -3), c.flatten(1, -3), states.flatten(1, -3)  # [N(+1), batch, ., .]
        for i in range(n):
            torch.baddbmm(cb[i], mb[i], sb[i], out=sb[i + 1])
        ctx.save_for_backward(decay, kend_t, w, states)
        return states

    @staticmethod
    def backward(ctx, d_states):
        decay, kend_t, w, states = ctx.saved_tensors
        n = states.shape[0] - 1
        mb = _transition(decay, kend_t, w).flatten(1, -3)
        db = d_states.contiguous().flatten(1, -3)
        # g[i]: the gradient of the state entering chunk i, all paths.
        if torch.is_grad_enabled():
            # create_graph: out-of-place, so that autograd differentiates this backward (the
            # references are twice differentiable; the saved states through this Function again).
            gs = [db[n]]
            for i in range(n - 1, -1, -1):
                gs.append(torch.baddbmm(db[i], mb[i].transpose(-1, -2), gs[-1]))
            g = torch.stack(gs[::-1]).view(states.shape)
        else:  # into one buffer: no list of per-chunk gradients beside the stacked one
            g = torch.empty_like(states)
            gb = g.flatten(1, -3)
            gb[n] = db[n]
            for i in range(n - 1, -1, -1):
                torch.baddbmm(db[i], mb[i].transpose(-1, -2), gb[i + 1], out=gb[i])
        d_m = g[1:] @ states[:n].transpose(-1, -2)  # [N, ..., dk, dk]
        d_decay = d_m.diagonal(dim1=-2, dim2=-1)[..., None].sum_to_size(decay.shape)
        d_kend_t = -(d_m @ w.transpose(-1, -2))
        d_w = -(kend_t.transpose(-1, -2) @ d_m)
        return d_decay, d_kend_t, d_w, g[1:], g[0]


def state_scan(decay, kend_t, w, c, s0):
    """Every chunk's entering state and the final one, [N + 1, ..., dk, dv], for decay [N, ...,
    dk or 1, 1], kend_t [N, ..., dk, C], w [N, ..., C, dk], c [N, ..., dk, dv], s0 [..., dk, dv]."""
    return _StateScan.apply(decay, kend_t.contiguous(), w.contiguous(), c.contiguous(), s0.contiguous())
