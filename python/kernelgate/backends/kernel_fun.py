"""kernel-fun as kernelgate backends: causal_conv1d from kernel-fun's strip kernels (its
forward and backward functions), doing what its autograd Function around them does (a
contiguous weight, the inputs' device current) and no more. Its kernels implement silu, no
bias, width <= 4 and bfloat16 / float16, which the backend's requirements say; they read x and
dy through their strides and never write over their inputs.
"""

import torch
from kernel_fun.cconv._kernels import strip as _strip


def causal_conv1d_fwd(x, weight, bias, activation):
    with torch.cuda.device(x.device):
        return _strip.cconv_fwd(x, weight.contiguous())


def causal_conv1d_bwd(dy, x, weight, bias, activation):
    with torch.cuda.device(x.device):
        dx, dw = _strip.cconv_bwd(x, weight.contiguous(), dy)
    return dx, dw, None
