"""The per-head l2 normalisation of q and k in the chunked linear-attention references
(gated_delta_rule, kda): y = x / sqrt(|x|^2 + eps) over the last dim, computed in `acc`.

As plain autograd code it would keep two float32 copies of the input for the backward (the
upcast and the normalised values): at bf16 inputs that is 4x the input's bytes, per input.
This Function keeps the input itself (which the caller holds anyway) and recomputes the norm in
its backward, dx = r (dy - y (y . dy)) with r = 1 / sqrt(|x|^2 + eps) and y = x r; the backward is
written in differentiable ops on the saved input, so the references stay twice differentiable.
"""

import torch


def _normalised(x, acc, eps):
    xf = x.to(acc)
    r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)
    return xf * r, r


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, acc, eps):
        y, _ = _normalised(x, acc, eps)
        ctx.save_for_backward(x)
        ctx.acc, ctx.eps = acc, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        y, r = _normalised(x, ctx.acc, ctx.eps)
        dx = r * (dy - y * (y * dy).sum(-1, keepdim=True))
        return dx.to(x.dtype), None, None


def l2_normalize(x, acc, eps=1e-6):
    """x / sqrt(|x|^2 + eps) over the last dim, in dtype `acc` (x's gradient in x's dtype)."""
    return _L2Normalize.apply(x, acc, eps)
