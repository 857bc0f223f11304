"""The pass over the chunks of the chunked linear-attention references (gated_delta_rule, kda):
every chunk's output and the final state.

With every chunk's WY factors known, chunk n, entered with state S_n, has the corrected values
U_n = U0_n - W_n S_n, the output O_n = Qd_n S_n + P_n U_n and hands on

    S_{n+1} = diag(decay_n) S_n + Kend_n^T U_n

(decay_n: the chunk's total decay, one per state row or one for all; Kend_n: its keys decayed to
the chunk's end; Qd_n: its queries decayed from its start; P_n: the decayed query-key products
within it, zero above the diagonal; a decay per step, as gated_delta_rule's, can scale the
queries and keys inside the pass: qscale, kscale). Only the states are sequential: three small
kernels per chunk forward and three backward, with the scales or without (the keys' scale is
applied to a block of chunks' keys at a time); the outputs and every gradient other than the
states' are products of all chunks at once. The transition is never
formed as a [dk, dk] matrix, and no tensor of the states' size is held beside the states
themselves: the states are the one such tensor forward, and their gradients the one more
backward (each state's own part of its gradient, Qd^T dO from the outputs, is written for all
chunks at once into the gradients' buffer, which the pass back over the chunks then completes;
no other tensor of the states' size is made). The backward is written in differentiable ops and
the states are an output, so the references stay twice differentiable.
"""

import torch


def _rows(x):
    """[N, ..., a, b] -> [N, batch, a, b] (a view where the leading dims allow it)."""
    return x.flatten(1, -3)


def _flat(x):
    """[N, ..., a, b] -> [N * batch, a, b] (a view where the leading dims allow it)."""
    return x.flatten(0, -3)


def _t(x):
    return x.transpose(-1, -2)


class _ChunkPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, decay, kend_t, uw, qd, p, s0, qscale, kscale):
        ctx.set_materialize_grads(False)
        u0, w = _split(uw, kend_t)
        n = u0.shape[0]
        states = torch.empty((n + 1,) + tuple(s0.shape), dtype=u0.dtype, device=u0.device)
        states[0] = s0
        u = torch.empty(u0.shape, dtype=u0.dtype, device=u0.device)  # every chunk's U_n
        eb, kb, wb, u0b, ub, sb = (_rows(x) for x in (decay, kend_t, w, u0, u, states))
        keys = _Keys(kb, kscale)
        for i in range(n):
            torch.baddbmm(u0b[i], wb[i], sb[i], alpha=-1.0, out=ub[i])
            torch.mul(eb[i], sb[i], out=sb[i + 1])
            sb[i + 1].baddbmm_(keys[i], ub[i])
        del keys
        o = torch.bmm(_flat(qd), _flat(states[:n]))
        if qscale is not None:
            o.mul_(_flat(qscale))
        o = o.baddbmm_(_flat(p), _flat(u)).view(u.shape)
        ctx.save_for_backward(decay, kend_t, uw, qd, p, states, qscale, kscale)
        return o, states[n].clone(), states

    @staticmethod
    def backward(ctx, d_o, d_final, d_states):
        decay, kend_t, uw, qd, p, states, qscale, kscale = ctx.saved_tensors
        u0, w = _split(uw, kend_t)
        n = states.shape[0] - 1
        s = states[:n]
        # recomputed: one tensor of the outputs' size while the backward runs
        u = torch.baddbmm(_flat(u0), _flat(w), _flat(s), alpha=-1.0).view(u0.shape)
        if d_o is None:
            d_o = torch.zeros_like(u)
        d_o = d_o.contiguous()
        d_last = torch.zeros_like(states[n]) if d_final is None else d_final
        if d_states is not None:
            d_last = d_last + d_states[n]
        d_last = d_last.flatten(0, -3)
        # g_i: the gradient of S_i, all paths; du_i: that of U_i. Going back over the chunks:
        #   du_i = P_i^T dO_i + Kend_i g_{i+1}
        #   g_i  = decay_i g_{i+1} + Qd_i^T dO_i - W_i^T du_i (+ d_states_i)
        eb, kb, wb = (_rows(x) for x in (decay, kend_t, w))
        if torch.is_grad_enabled():
            # create_graph: out of place, so that autograd differentiates this backward (the
            # states through this Function again, as one of its outputs)
            qb, db, pb = _rows(qd), _rows(d_o), _rows(_t(p) @ d_o)
            qsb, ksb, dsb = (None if x is None else _rows(x) for x in (qscale, kscale, d_states))
            gs, dus = [d_last], []
            for i in range(n - 1, -1, -1):
                kg_i = _t(kb[i]) @ gs[-1]
                dus.append(pb[i] + (kg_i if ksb is None else ksb[i] * kg_i))
                do_i = db[i] if qsb is None else qsb[i] * db[i]
                gi = torch.baddbmm(torch.baddbmm(eb[i] * gs[-1], _t(qb[i]), do_i), _t(wb[i]), dus[-1], alpha=-1.0)
                gs.append(gi if dsb is None else gi + dsb[i])
            bufs = {"g": torch.stack(gs[::-1]).view(states.shape), "du": torch.stack(dus[::-1]).view(u.shape), "u": u}
            del gs, dus, u
            return _grads_from(decay, kend_t, s, d_o, bufs, None, qd, qscale, kscale)
        # into two buffers, in place: g, and U_i's gradients inside [U0 | W]'s (no second tensor of
        # [U0 | W]'s size to put them together)
        d_uw = torch.empty(uw.shape, dtype=uw.dtype, device=uw.device)
        du, d_w = _split(d_uw, kend_t)
        du.copy_(_t(p) @ d_o)
        g = torch.empty_like(states)
        _own_parts(g[:n], qd, d_o, qscale, None if d_states is None else d_states[:n])
        gb, dub = _rows(g), _rows(du)
        gb[n] = d_last
        keys = _Keys(kb, kscale)
        for i in range(n - 1, -1, -1):
            dub[i].baddbmm_(_t(keys[i]), gb[i + 1])
            gb[i].addcmul_(eb[i], gb[i + 1])
            gb[i].baddbmm_(_t(wb[i]), dub[i], alpha=-1.0)
        bufs = {"g": g, "du": du, "u": u}
        del g, gb, du, dub, d_w, u, keys
        return _grads_from(decay, kend_t, s, d_o, bufs, d_uw, qd, qscale, kscale)


class _Keys:
    """Chunk i's keys for the pass, Kend_i^T [batch, dk, C]: kb[i] itself, or with the key scale
    kb[i] diag(kscale_i), made for a block of chunks at a time (_block_size; one buffer), so the
    pass neither keeps a scaled copy of every key nor scales per chunk."""

    def __init__(self, kb, kscale):
        self.kb, self.ksb = kb, None if kscale is None else _rows(kscale)
        self.step = _block_size(kb.shape[0])
        self.block, self.buf = -1, None

    def __getitem__(self, i):
        if self.ksb is None:
            return self.kb[i]
        j = i // self.step
        if j != self.block:
            b = slice(j * self.step, (j + 1) * self.step)
            keys = self.kb[b]
            if self.buf is None:  # a whole block's size (the pass back meets the last, shorter one first)
                self.buf = torch.empty((self.step,) + tuple(keys.shape[1:]), dtype=keys.dtype, device=keys.device)
            self.block = j
            torch.mul(keys, _t(self.ksb[b]), out=self.buf[:keys.shape[0]])
        return self.buf[i - j * self.step]


def _block_size(n, blocks=8):
    """Chunks per block where the pass makes a scaled copy for a block of chunks at a time: about
    1/blocks of the n chunks."""
    return max(1, -(-n // blocks))


def _own_parts(g, qd, d_o, qscale, d_states):
    """g[i] = Qd_i^T (qscale_i dO_i) (+ d_states_i) for every chunk i, into g [N, ..., dk, dv]:
    the part of each state's gradient that does not come through the next state, for all chunks
    at once rather than one product per chunk in the sequential loop. With the query scale, the
    scaled dO is made for a block of chunks at a time (_block_size)."""
    gf = _flat(g)
    if qscale is None:
        torch.bmm(_t(_flat(qd)), _flat(d_o), out=gf)
    else:
        n = g.shape[0]
        step = _block_size(n)
        for b in range(0, n, step):
            rows = _flat(g[b:b + step])
            torch.bmm(_t(_flat(qd[b:b + step])), _flat(qscale[b:b + step] * d_o[b:b + step]), out=rows)
    if d_states is not None:
        g += d_states


def _grads_from(decay, kend_t, s, d_o, bufs, d_uw, qd, qscale, kscale):
    """The inputs' gradients from bufs, the only holder of the states' gradients (g), the
    corrected values' (du) and the corrected values (u), each dropped once read (the states'
    gradients first: the largest). d_uw: [U0 | W]'s gradient with du in place, or None (out of
    place: made here). qd and qscale: the queries and their row scale (or None); kend_t and kscale:
    the keys and their column scale (or None)."""
    g, u = bufs.pop("g"), bufs.pop("u")
    g_next = g[1:]
    # d decay_i = sum over dv (and over dk for one decay per chunk) of g_{i+1} * S_i
    d_decay = torch.einsum("...kv,...kv->...k", g_next, s)[..., None].sum_to_size(decay.shape)
    d_kend_t = g_next @ _t(u)  # the scaled keys' gradient
    d_kscale = None
    if kscale is not None:
        d_kscale = _t((d_kend_t * kend_t).sum(-2, keepdim=True))
        d_kend_t = d_kend_t.mul_(_t(kscale)) if not torch.is_grad_enabled() else d_kend_t * _t(kscale)
    d_s0 = g[0].clone()
    del g, g_next
    d_p = d_o @ _t(u)
    del u
    du = bufs.pop("du")
    d_w = (du @ _t(s)).neg_()
    if d_uw is None:  # U0's and W's gradients as one tensor, as [U0 | W] came
        d_uw = torch.cat([du, d_w], -1)
    else:
        _split(d_uw, kend_t)[1].copy_(d_w)
    del d_w
    d_qd = d_o @ _t(s)  # the scaled queries' gradient
    d_qscale = None
    if qscale is not None:
        d_qscale = (d_qd * qd).sum(-1, keepdim=True)
        d_qd = d_qd.mul_(qscale) if not torch.is_grad_enabled() else d_qd * qscale
    return d_decay, d_kend_t, d_uw, d_qd, d_p, d_s0, d_qscale, d_kscale


def _split(uw, kend_t):
    """[U0 | W] -> U0, W (views): W has dk columns, kend_t's rows."""
    dv = uw.shape[-1] - kend_t.shape[-2]
    return uw[..., :dv], uw[..., dv:]


def chunk_pass(decay, kend_t, uw, qd, p, s0, qscale=None, kscale=None):
    """Every chunk's output O_n = Qd_n S_n + P_n (U0_n - W_n S_n), [N, ..., C, dv], the final state,
    [..., dk, dv], and the states entering every chunk and the final one, [N + 1, ..., dk, dv] (kept
    for the backward; the final state is a copy of its last), for decay [N, ..., dk or 1, 1], kend_t
    [N, ..., dk, C], uw = [U0 | W] [N, ..., C, dv + dk] (the triangular solve's one result), qd
    [N, ..., C, dk], p [N, ..., C, C], s0 [..., dk, dv]. With qscale [N, ..., C, 1] the queries are
    qscale * qd, scaled inside the pass (gated_delta_rule's decay from the chunk's start is one per
    step): then no tensor of the scaled queries is kept for the backward, only qd (which the
    caller's own products keep) and the scale. Likewise with kscale [N, ..., C, 1] the keys are
    kend_t * kscale^T (a scale per step: gated_delta_rule's decay to the chunk's end)."""
    # kend_t and uw as given (a transposed view is read in place: a contiguous copy would be one
    # more saved tensor of the chunks' size)
    return _ChunkPass.apply(decay, kend_t, uw, qd, p, s0.contiguous(), qscale, kscale)
