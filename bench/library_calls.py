"""Each library backend's op called the way its library's users call it (the library's own
autograd Function or public function), with example inputs on the GPU: what a routed call is
compared with (syncs in tests/python/test_library_backends.py, host time in
bench/bench_dispatch_libraries.py). Importing this imports the libraries."""

import torch

B, H, S, D, KV, V = 2, 8, 64, 128, 2, 4096


def _t(*shape, dtype=torch.bfloat16, grad=True):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _liger():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    rows = B * S
    return {
        ("rms_norm", "liger"): (lambda: (_t(rows, 2048), _t(2048), 1e-6),
                                lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "gemma", False)),
        ("layer_norm", "liger"): (lambda: (_t(rows, 2048), _t(2048), _t(2048), 1e-5),
                                  lambda x, w, b, eps: LigerLayerNormFunction.apply(x, w, b, eps)),
        ("swiglu", "liger"): (lambda: (_t(rows, 5632), _t(rows, 5632)), LigerSiLUMulFunction.apply),
        ("geglu", "liger"): (lambda: (_t(rows, 5632), _t(rows, 5632), "tanh"),
                             lambda g, u, a: LigerGELUMulFunction.apply(g, u)),
        ("cross_entropy", "liger"): (
            lambda: (_t(rows, V), torch.randint(0, V, (rows,), device="cuda")),
            lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean")[0]),
        ("linear_cross_entropy", "liger"): (
            lambda: (_t(rows, 2048), _t(V, 2048), torch.randint(0, V, (rows,), device="cuda")),
            lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0]),
        ("linear_cross_entropy", "liger_fp32_accum"): (
            lambda: (_t(rows, 2048), _t(V, 2048), torch.randint(0, V, (rows,), device="cuda")),
            lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(
                h, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, torch.float32)[0]),
    }


def _fla():
    from fla.modules.activations.ops import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.layernorm import layer_norm, rms_norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rows = B * S

    def gdr():  # the fused layer form, without gradients: FLA refuses its gated chunk backward on
        # Hopper with Triton 3.4 to 3.7.0, and the fused-recurrent backend is forward only
        x = [_t(B, S, H, 64, grad=False) for _ in range(3)] + [_t(B, S, H, grad=False) for _ in range(2)]
        return (*x, _t(H, grad=False), _t(H, grad=False), None, 0.0)

    fused = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                 output_final_state=True)

    def kda():  # the same form, with a gate per key channel ([B, S, H, 64]) and dt_bias [H, 64]
        x = [_t(B, S, H, 64, grad=False) for _ in range(4)] + [_t(B, S, H, grad=False)]
        return (*x, _t(H, grad=False), _t(H, 64, grad=False), None, 0.0)

    from fla.ops.kda import chunk_kda

    return {
        ("kda", "fla_chunk"): (kda, lambda q, k, v, g, b, A, dt, h0, s: chunk_kda(
            q, k, v, g, b, initial_state=h0, A_log=A, dt_bias=dt.reshape(-1), **fused)),
        ("gated_delta_rule", "fla_chunk"): (gdr, lambda q, k, v, g, b, A, dt, h0, s: chunk_gated_delta_rule(
            q, k, v, g, b, initial_state=h0, A_log=A, dt_bias=dt, **fused)),
        ("gated_delta_rule", "fla_fused_recurrent"): (
            gdr, lambda q, k, v, g, b, A, dt, h0, s: fused_recurrent_gated_delta_rule(
                q, k, v, g=g, beta=b, initial_state=h0, A_log=A, dt_bias=dt, **fused)),
        ("rms_norm", "fla"): (lambda: (_t(rows, 2048), _t(2048), 1e-6),
                              lambda x, w, eps: rms_norm(x, w, None, eps=eps)),
        ("layer_norm", "fla"): (lambda: (_t(rows, 2048), _t(2048), _t(2048), 1e-5),
                                lambda x, w, b, eps: layer_norm(x, w, b, eps=eps)),
        ("swiglu", "fla"): (lambda: (_t(rows, 5632), _t(rows, 5632)), swiglu),
        ("causal_conv1d", "fla"): (lambda: (_t(B, 4 * S, 2048), _t(2048, 4), None, "silu"),
                                   lambda x, w, b, a: causal_conv1d(x, w, b, activation=a)[0]),
    }


def _kernel_fun():
    from kernel_fun.cconv import causal_conv1d

    return {
        ("causal_conv1d", "kernel_fun"): (lambda: (_t(B, 4 * S, 2048), _t(2048, 4), None, "silu"),
                                          lambda x, w, b, a: causal_conv1d(x, w, activation=a)[0]),
    }


def _quack():
    from quack.rmsnorm import rmsnorm

    rows = B * S
    return {
        ("rms_norm", "quack"): (lambda: (_t(rows, 2048), _t(2048), 1e-6),
                                lambda x, w, eps: rmsnorm(x, w, eps=eps)),
        ("add_rms_norm", "quack"): (
            lambda: (_t(rows, 2048), _t(rows, 2048), _t(2048), 1e-6),
            lambda x, r, w, eps: rmsnorm(x, w, residual=r, residual_dtype=x.dtype, eps=eps, prenorm=True)),
    }


_LIBRARIES = {"liger": _liger, "fla": _fla, "kernel_fun": _kernel_fun, "quack": _quack}


class _Direct(dict):
    """(op, backend) -> (make inputs, the library's own call); a library is imported when first
    asked for."""

    def __missing__(self, key):
        self.update(_LIBRARIES[next(lib for lib in _LIBRARIES if key[1].startswith(lib))]())
        if not dict.__contains__(self, key):
            raise KeyError(f"bench/library_calls.py has no direct call of {key[0]}'s backend {key[1]}")
        return dict.__getitem__(self, key)


DIRECT = _Direct()
