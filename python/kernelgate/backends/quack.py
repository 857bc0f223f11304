"""quack (quack-kernels, CuTe DSL kernels) as kernelgate backends: rms_norm and add_rms_norm from
quack's own forward and backward functions (quack.rmsnorm's rmsnorm_fwd / rmsnorm_bwd), doing
what its autograd Function around them does (contiguous rows) and no more. quack's kernels take
a matrix of rows: the adapter flattens the leading dims and restores them. They refuse tensors
whose data is not 16-byte aligned (a view at an offset): those go to quack as aligned copies.

- add_rms_norm: quack's residual path returns h = x + residual (its residual_out, in x's dtype
  here) and normalizes the sum; its backward adds the gradient of h to the gradient of x, which
  is our op's: the residual's gradient is x's.
- The weight's gradient: quack sums per-SM float32 partials and rounds once to the weight's
  dtype, as our contract asks.
"""

import torch
from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd


def _aligned(t):
    """t, contiguous and 16-byte aligned (a copy where it is not); None stays None."""
    if t is None:
        return None
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as the aligned, contiguous [rows, hidden] matrix quack's kernels take."""
    return _aligned(t).view(-1, t.shape[-1])


# ---- rms_norm: (y, rstd) / (dx, dweight)

def rms_norm_fwd(x, weight, eps):
    y, _, rstd = rmsnorm_fwd(_rows(x), _aligned(weight), eps=eps, store_rstd=True)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_bwd(dy, x, weight, rstd, eps):
    dx, dw, _, _ = rmsnorm_bwd(_rows(x), _aligned(weight), _rows(dy), rstd.reshape(-1))
    return dx.view(x.shape), dw


# ---- add_rms_norm: (y, h, rstd) / (dx, dweight); either output gradient may be absent

def add_rms_norm_fwd(x, residual, weight, eps):
    y, h, rstd = rmsnorm_fwd(_rows(x), _aligned(weight), residual=_rows(residual), residual_dtype=x.dtype,
                             eps=eps, store_rstd=True)
    return y.view(x.shape), h.view(x.shape), rstd.view(x.shape[:-1])


def add_rms_norm_bwd(dy, dh, h, weight, rstd, eps):
    if dy is None:  # only h's gradient: it is x's; the weight's is zero
        return dh.contiguous(), None if weight is None else torch.zeros_like(weight)
    dx, dw, _, _ = rmsnorm_bwd(_rows(h), _aligned(weight), _rows(dy), rstd.reshape(-1),
                               dresidual_out=None if dh is None else _rows(dh), has_residual=True)
    return dx.view(h.shape), dw
