"""Liger-Kernel as kernelgate backends: each function is one of our op's forward or backward
(kg.register_backend's protocol) built from Liger's own forward and backward functions, doing
what Liger's autograd Function around them does (its ensure_contiguous) and no more, except:

- Inputs are never modified. Liger writes some results over its inputs: swiglu's and geglu's
  backward write the gradients over gate and up, cross-entropy writes the logits' gradient over
  the logits. Where that would overwrite a tensor the caller holds, the adapter gives Liger a
  copy.
- A mean over no valid target is NaN, as PyTorch's (0 / 0): Liger returns 0.
- Our op's saved state is its contract's (rstd, mean, ...): Liger's launch settings are
  recomputed in the backward from the shapes, as Liger derives them.
"""

import torch
from liger_kernel.ops import cross_entropy as _ce
from liger_kernel.ops import fused_linear_cross_entropy as _lce
from liger_kernel.ops import geglu as _geglu
from liger_kernel.ops import layer_norm as _ln
from liger_kernel.ops import rms_norm as _rms
from liger_kernel.ops import swiglu as _swiglu
from liger_kernel.ops.utils import calculate_settings
from torch.utils.weak import WeakIdKeyDictionary

# Liger's casting mode that matches our contract: x, rstd and weight in float32, rounded once.
_GEMMA = "gemma"


def _own(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where it shares storage with `like` (a tensor the caller holds)."""
    return t.clone() if t.data_ptr() == like.data_ptr() else t


# ---- rms_norm: (y, rstd) / (dx, dweight)

def rms_norm_fwd(x, weight, eps):
    x = x.contiguous()
    y, _, rstd, _, _, _ = _rms.rms_norm_forward(x, weight, eps, 0.0, _GEMMA, None)
    return y, rstd.view(x.shape[:-1])


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """t as the [rows, hidden] matrix Liger's forward saves (its backward reads rows by stride 0)."""
    return t.contiguous().view(-1, t.shape[-1])


def rms_norm_bwd(dy, x, weight, rstd, eps):
    block, warps = calculate_settings(x.shape[-1])
    return _rms.rms_norm_backward(dy.contiguous(), _matrix(x), weight, rstd.reshape(-1), 0.0,
                                  _rms._str_to_casting_mode[_GEMMA], block, warps, False, None)


# ---- layer_norm: (y, mean, rstd) / (dx, dweight, dbias); Liger needs weight and bias

def layer_norm_fwd(x, weight, bias, eps):
    x = x.contiguous()
    y, _, mean, rstd, _, _ = _ln.layer_norm_forward(x, weight.contiguous(), bias.contiguous(), eps)
    return y, mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps):
    return _ln.layer_norm_backward(dy.contiguous(), _matrix(x), weight.contiguous(), bias.contiguous(),
                                   mean.reshape(-1), rstd.reshape(-1))


# ---- swiglu and geglu (tanh): out / (dgate, dup). Liger's backward writes the gradients over
# the saved gate and up, which are the caller's: it gets copies.

def swiglu_fwd(gate, up):
    return _swiglu.swiglu_forward(gate.contiguous(), up.contiguous())[2]


def swiglu_bwd(dc, gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    return _swiglu.swiglu_backward(gate.clone(), up.clone(), dc.contiguous())


def geglu_fwd(gate, up, approximate):
    return _geglu.geglu_forward(gate.contiguous(), up.contiguous())[2]


def geglu_bwd(dc, gate, up, approximate):
    gate, up = gate.contiguous(), up.contiguous()
    return _geglu.geglu_backward(gate.clone(), up.clone(), dc.contiguous())


# ---- cross_entropy: Liger computes the gradient in its forward, over the logits. Here over a
# copy, kept until the backward in `_grads`, keyed by the lse the forward returns in its place:
# a NaN placeholder, so a backward served by another backend gives NaN, never a wrong number.

# Keyed by identity: a WeakKeyDictionary compares keys with ==, elementwise on tensors.
_grads = WeakIdKeyDictionary()


def _mean_of_none(loss, target, ignore_index, reduction):
    """PyTorch's mean over no valid target is NaN (0 / 0); Liger's is 0. On the device: no sync."""
    if reduction != "mean":
        return loss
    return torch.where((target != ignore_index).any(), loss, torch.nan)


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, *, needs_grad):
    training = "logits" in needs_grad
    # Always a copy: Liger's kernel writes over its input (zeros the rows of ignored targets even
    # without gradients; with them, the gradient), and our inputs are never modified. Contiguous:
    # of strided logits Liger makes its own copy, which (our forward runs without grad mode) does
    # not require grad, and then its kernel computes no gradient.
    x = logits.detach().clone(memory_format=torch.contiguous_format).requires_grad_(training)
    loss, _, _, _, grad = _ce.cross_entropy_forward(x, target, None, ignore_index, 0.0, label_smoothing,
                                                     reduction, None, False)
    loss = _mean_of_none(loss, target, ignore_index, reduction).to(logits.dtype)
    if not training:
        return loss
    lse = torch.full((logits.shape[0],), float("nan"), dtype=torch.float32, device=logits.device)
    _grads[lse] = grad.detach()
    return loss, lse, torch.full((), float("nan"), dtype=torch.float32, device=logits.device)


def cross_entropy_bwd(dloss, logits, target, lse, n_valid, ignore_index, label_smoothing, reduction):
    grad = _grads.pop(lse, None)
    if grad is None:
        raise RuntimeError("liger cross_entropy backward: no gradient from its forward (a second backward "
                           "through the same graph is not supported)")
    return grad * (dloss.unsqueeze(1) if dloss.dim() == 1 else dloss)


# ---- linear_cross_entropy, reductions mean and sum (in bfloat16 and float32): Liger's forward
# computes the gradients, which our op scales in its backward. accum_dtype is Liger's option for
# the grad_weight accumulator (None: the weight's dtype, Liger's default).

def _lce_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, accum_dtype,
             needs_grad):
    grads = bool(needs_grad)
    loss, _, _, _, gh, gw, gb = _lce.fused_linear_cross_entropy_forward(
        hidden, weight, target, None, bias, ignore_index, 0.0, label_smoothing, reduction, None, False,
        accum_dtype, compute_gradients=grads, weight_requires_grad="weight" in needs_grad)
    loss = _mean_of_none(loss, target, ignore_index, reduction).float()  # the op's float32 loss
    if not grads:
        return loss
    # The lse is our recomputing backward's, which these backends never reach: a NaN placeholder
    # of its shape (the op's meta says [rows] float32).
    lse = torch.full((hidden.shape[0],), float("nan"), dtype=torch.float32, device=hidden.device)
    return (loss, lse, gh if "hidden" in needs_grad else None, gw if "weight" in needs_grad else None,
            gb if "bias" in needs_grad else None)


def linear_cross_entropy_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, reduction,
                             *, needs_grad):
    return _lce_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, None,
                    needs_grad)


def linear_cross_entropy_fp32_accum_fwd(hidden, weight, target, bias, ignore_index, label_smoothing,
                                        reduction, *, needs_grad):
    return _lce_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, torch.float32,
                    needs_grad)


def linear_cross_entropy_bwd(*args):
    # Our op recomputes in its backward only for reduction "none" and float16, which these
    # backends do not take (their requirements say so): never reached.
    raise RuntimeError("liger linear_cross_entropy: the backward is its forward's gradients, scaled by "
                       "kernelgate; a recomputing backward is not implemented")
