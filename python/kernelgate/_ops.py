"""The op API. Each function is a direct call of the registered torch op: nothing is decided here."""

from typing import Optional

import torch

_rms_norm = torch.ops.kernelgate.rms_norm.default
_swiglu = torch.ops.kernelgate.swiglu.default
_geglu = torch.ops.kernelgate.geglu.default
_cross_entropy = torch.ops.kernelgate.cross_entropy.default
_linear_cross_entropy = torch.ops.kernelgate.linear_cross_entropy.default


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """Normalise `x` over its last dim by its root mean square and scale by `weight`.

    Accumulates in float32 and returns x's dtype. Supports float32, float16 and bfloat16, any
    leading shape, autograd (x and weight), torch.compile and CUDA graphs.
    """
    return _rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, float32 math, in gate's dtype; gate and up of one shape."""
    return _swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up (approximate: "tanh" or "none"), float32 math."""
    return _geglu(gate, up, approximate)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """torch.nn.functional.cross_entropy of 2-D logits [rows, classes] against target [rows]
    (int64 or int32), float32 math, loss in logits' dtype.

    reduction "mean" averages over the rows whose target is not ignore_index (NaN when every row
    is ignored, as F.cross_entropy), "sum" sums, "none" gives per-row losses (0 for ignored rows).
    label_smoothing in [0, 1]. A target outside [0, classes) is an error on the CPU; on CUDA its
    row's loss (and gradient) is NaN, since checking would need a device sync.
    """
    return _cross_entropy(logits, target, ignore_index, label_smoothing, reduction)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) computed in chunks of rows, never
    holding the float32 logits: hidden [rows, hidden], weight [classes, hidden], bias [classes].

    With gradients on and reduction "mean" or "sum", the forward also computes the gradients
    (hidden, weight, bias) and the backward scales them; backward through the same graph a
    second time (retain_graph=True) is refused for these reductions.
    """
    return _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
