"""FLA's gated delta rule kernels (fla-core) as backends of kernelgate's gated_delta_rule, and its
chunked KDA kernels as a backend of kernelgate's kda.

All are FLA's functions called in the fused layer form the op defines (l2-normalised q and k,
the gate -exp(A_log) * softplus(g + dt_bias) and sigmoid(beta) computed in FLA's kernels), with
the final state always returned. chunk: FLA's chunked kernels, whose backward this adapter runs
by recomputing the forward through FLA's autograd function (FLA refuses that backward on Hopper
with Triton 3.4 to 3.7.0, naming a wrong result of its gated chunk_bwd_dqkwg kernel there: a
refusal the sweep records, raised here before FLA's backward kernels run; KDA's backward is
FLA's own, recomputed the same way). fused_recurrent: FLA's step-by-step kernel, forward only.
"""

import torch


def _kwargs(A_log, dt_bias, initial_state, scale):
    return dict(scale=None if scale == 0 else scale, initial_state=initial_state, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True)


def _chunk(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, state = chunk_gated_delta_rule(q, k, v, g, beta, **_kwargs(A_log, dt_bias, initial_state, scale))
    return o, state.float()  # the op's final state is float32


def chunk_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    return _chunk(q, k, v, g, beta, A_log, dt_bias, initial_state, scale)


def chunk_bwd(grad_o, grad_state, q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    from ..fla import _fla_refuses_gated_backward

    # FLA's guard is in chunk_bwd_dqkwg, after kernels of its backward that hit an illegal memory
    # access at some shapes on the H200 (chunk_bwd_dv_local at B2 T63 H3 K32 V16): a process-wide
    # CUDA error. The same refusal, raised before any of them runs:
    if _fla_refuses_gated_backward(q.device):
        raise RuntimeError("FLA (fla-core 0.6) refuses its gated chunk backward on Hopper with Triton >= 3.4 "
                           "and < 3.7.1 (a wrong result of its chunk_bwd_dqkwg kernel there, it says); "
                           "Triton >= 3.7.1 or FLA's tilelang backend lifts it")
    return _recomputed_grads(_chunk, grad_o, grad_state, [q, k, v, g, beta, A_log, dt_bias, initial_state], scale)


def _recomputed_grads(fn, grad_o, grad_state, inputs, scale):
    """The gradients of fn(*inputs, scale) -> (o, state) for the given cotangents, by running the
    forward again through FLA's autograd function (None for absent inputs)."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        o, state = fn(*leaves, scale)
        outs, cots = [o], [grad_o]
        if grad_state is not None:
            outs.append(state)
            cots.append(grad_state)
        present = [t for t in leaves if t is not None]
        got = iter(torch.autograd.grad(outs, present, cots, allow_unused=True))
    grads = []
    for t in leaves:
        if t is None:
            grads.append(None)
            continue
        d = next(got)
        grads.append(torch.zeros_like(t) if d is None else d.to(t.dtype))
    return tuple(grads)


def _kda(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    from fla.ops.kda import chunk_kda

    # FLA takes dt_bias flat ([heads * dk]) and the initial state in float32 only.
    o, state = chunk_kda(q, k, v, g, beta, scale=None if scale == 0 else scale,
                         initial_state=None if initial_state is None else initial_state.float(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, A_log=A_log,
                         dt_bias=None if dt_bias is None else dt_bias.reshape(-1))
    return o, state.float()


def kda_chunk_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    return _kda(q, k, v, g, beta, A_log, dt_bias, initial_state, scale)


def kda_chunk_bwd(grad_o, grad_state, q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    return _recomputed_grads(_kda, grad_o, grad_state, [q, k, v, g, beta, A_log, dt_bias, initial_state], scale)


def fused_recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, state = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta,
                                                **_kwargs(A_log, dt_bias, initial_state, scale))
    return o, state.float()
