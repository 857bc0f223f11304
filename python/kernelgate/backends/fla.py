"""flash-linear-attention (fla-core) as kernelgate backends: rms_norm, layer_norm, swiglu and
causal_conv1d from FLA's forward and backward functions, doing what FLA's autograd Functions
around them do (its input_guard: contiguous inputs, the inputs' device current; its conv reads x
and dy through their strides) and no more. FLA never writes over its inputs here. Our op's saved
state is its contract's (mean, rstd): FLA saves the same; the conv saves only its inputs.
"""

import torch
from fla.modules.activations.ops import swiglu_fwd as _swiglu_fwd
from fla.modules.activations.ops import swiglu_fwdbwd as _swiglu_fwdbwd
from fla.modules.causal_conv1d.ops import _has_non_standard_layout
from fla.modules.causal_conv1d.ops import causal_conv1d_bwd as _conv_bwd
from fla.modules.causal_conv1d.ops import causal_conv1d_fwd as _conv_fwd
from fla.modules.norm.layernorm import layer_norm_bwd as _norm_bwd
from fla.modules.norm.layernorm import layer_norm_fwd as _norm_fwd


def _norm_forward(x, weight, bias, eps, rms):
    with torch.cuda.device(x.device):
        x = x.contiguous()
        y, mean, rstd, _ = _norm_fwd(x.view(-1, x.shape[-1]), weight, bias, eps, is_rms_norm=rms)
    rows = x.shape[:-1]
    return y.view(x.shape), (None if mean is None else mean.view(rows)), rstd.view(rows)


def _norm_backward(dy, x, weight, bias, mean, rstd, rms):
    with torch.cuda.device(x.device):
        h = x.shape[-1]
        dx, dw, db, _ = _norm_bwd(dy.contiguous().view(-1, h), x.contiguous().view(-1, h), weight, bias,
                                  None if mean is None else mean.reshape(-1), rstd.reshape(-1),
                                  is_rms_norm=rms, x_dtype=x.dtype)
    return dx.view(x.shape), dw, db


def rms_norm_fwd(x, weight, eps):
    y, _, rstd = _norm_forward(x, weight, None, eps, True)
    return y, rstd


def rms_norm_bwd(dy, x, weight, rstd, eps):
    dx, dw, _ = _norm_backward(dy, x, weight, None, None, rstd, True)
    return dx, dw


def layer_norm_fwd(x, weight, bias, eps):
    return _norm_forward(x, weight, bias, eps, False)


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps):
    return _norm_backward(dy, x, weight, bias, mean, rstd, False)


def swiglu_fwd(gate, up):
    with torch.cuda.device(gate.device):
        return _swiglu_fwd(gate, up)


def swiglu_bwd(dc, gate, up):
    with torch.cuda.device(gate.device):
        return _swiglu_fwdbwd(gate, up, dc)


def _contiguous(t):
    return None if t is None else t.contiguous()


def causal_conv1d_fwd(x, weight, bias, activation):
    with torch.cuda.device(x.device):
        y, _ = _conv_fwd(x=x, weight=weight.contiguous(), bias=_contiguous(bias), residual=None,
                         activation=None if activation == "none" else activation,
                         layout_fallback=_has_non_standard_layout(x))
    return y


def causal_conv1d_bwd(dy, x, weight, bias, activation):
    with torch.cuda.device(x.device):
        dx, dw, db, _, _ = _conv_bwd(x=x, dy=dy, dht=None, weight=weight.contiguous(), bias=_contiguous(bias),
                                     residual=None, activation=None if activation == "none" else activation,
                                     layout_fallback=_has_non_standard_layout(x))
    return dx, dw, db
