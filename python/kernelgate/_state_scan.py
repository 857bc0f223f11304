"""The chunk-to-chunk state pass of the chunked linear-attention references (gated_delta_rule, kda).

With every chunk's WY factors known, the state entering chunk n + 1 is

    S_{n+1} = M_n S_n + c_n,    M_n = diag(decay_n) - Kend_n^T W_n,    c_n = Kend_n^T U0_n

(decay_n: the chunk's total decay, one per state row or one for all; Kend_n: its keys decayed to
the chunk's end; U0_n - W_n S_n: its corrected values). Only this recurrence is sequential: three
small kernels per chunk forward and three backward, where autograd through the unrolled loop would
launch a dozen per chunk. Everything else the references compute from all states at once.
M is never formed: each step applies it as decay_n S_n - Kend_n^T (W_n S_n), through a
[chunk, dv] product, so no [dk, dk] matrix per chunk is held forward or backward (for a chunk
shorter than dk it is also fewer flops). The backward is written in differentiable ops, so the
references stay twice differentiable.
"""

import torch


def _rows(x):
    """[N, ..., a, b] -> [N, batch, a, b] (a view where the leading dims allow it)."""
    return x.flatten(1, -3)


class _StateScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay, kend_t, w, c, s0):
        n = c.shape[0]
        states = torch.empty((n + 1,) + tuple(c.shape[1:]), dtype=c.dtype, device=c.device)
        states[0] = s0
        eb, kb, wb, cb, sb = (_rows(x) for x in (decay, kend_t, w, c, states))
        ws = states.new_empty(wb.shape[1:-1] + sb.shape[-1:])  # W_n S_n, [batch, chunk, dv]
        for i in range(n):
            torch.bmm(wb[i], sb[i], out=ws)
            torch.addcmul(cb[i], eb[i], sb[i], out=sb[i + 1])
            sb[i + 1].baddbmm_(kb[i], ws, alpha=-1.0)
        ctx.save_for_backward(decay, kend_t, w, states)
        return states

    @staticmethod
    def backward(ctx, d_states):
        decay, kend_t, w, states = ctx.saved_tensors
        n = states.shape[0] - 1
        eb, kb, wb = (_rows(x) for x in (decay, kend_t, w))
        db = _rows(d_states.contiguous())
        # g[i]: the gradient of the state entering chunk i, all paths: g_i = d_i + M_i^T g_{i+1},
        # M_i^T g = decay_i g - W_i^T (Kend_i g).
        if torch.is_grad_enabled():
            # create_graph: out-of-place, so that autograd differentiates this backward (the
            # references are twice differentiable; the saved states through this Function again).
            gs = [db[n]]
            for i in range(n - 1, -1, -1):
                gs.append(torch.baddbmm(torch.addcmul(db[i], eb[i], gs[-1]), wb[i].transpose(-1, -2),
                                        kb[i].transpose(-1, -2) @ gs[-1], alpha=-1.0))
            g = torch.stack(gs[::-1]).view(states.shape)
        else:  # into one buffer: no list of per-chunk gradients beside the stacked one
            g = torch.empty_like(states)
            gb = _rows(g)
            gb[n] = db[n]
            kg = states.new_empty(wb.shape[1:-1] + gb.shape[-1:])  # Kend_i g_{i+1}, [batch, chunk, dv]
            for i in range(n - 1, -1, -1):
                torch.bmm(kb[i].transpose(-1, -2), gb[i + 1], out=kg)
                torch.addcmul(db[i], eb[i], gb[i + 1], out=gb[i])
                gb[i].baddbmm_(wb[i].transpose(-1, -2), kg, alpha=-1.0)
        g_next, s = g[1:], states[:n]
        # d decay_i = sum over dv (and over dk for one decay per chunk) of g_{i+1} * S_i
        d_decay = torch.einsum("...kv,...kv->...k", g_next, s)[..., None].sum_to_size(decay.shape)
        ws = w @ s  # [N, ..., chunk, dv]
        d_kend_t = torch.matmul(g_next, ws.transpose(-1, -2)).neg_()  # -g_{i+1} (W_i S_i)^T
        del ws
        kg = kend_t.transpose(-1, -2) @ g_next  # [N, ..., chunk, dv]
        d_w = torch.matmul(kg, s.transpose(-1, -2)).neg_()  # -(Kend_i g_{i+1}) S_i^T
        return d_decay, d_kend_t, d_w, g_next, g[0]


def state_scan(decay, kend_t, w, c, s0):
    """Every chunk's entering state and the final one, [N + 1, ..., dk, dv], for decay [N, ...,
    dk or 1, 1], kend_t [N, ..., dk, C], w [N, ..., C, dk], c [N, ..., dk, dv], s0 [..., dk, dv]."""
    # kend_t and w as given (a transposed or sliced view is read in place: a contiguous copy would
    # be one more saved tensor of the chunks' size)
    return _StateScan.apply(decay, kend_t, w, c.contiguous(), s0.contiguous())
