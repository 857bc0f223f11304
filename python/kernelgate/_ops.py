"""The op API. Each function is a direct call of the registered torch op: nothing is decided here."""

from typing import Optional
from typing import Tuple

import torch

_rms_norm = torch.ops.kernelgate.rms_norm.default
_swiglu = torch.ops.kernelgate.swiglu.default
_geglu = torch.ops.kernelgate.geglu.default
_add_rms_norm = torch.ops.kernelgate.add_rms_norm.default
_layer_norm = torch.ops.kernelgate.layer_norm.default


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


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6
) -> Tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype, as `h = x + residual` is); returns
    (rms_norm(h) * weight, h) with float32 statistics. Gradients flow into both outputs."""
    return _add_rms_norm(x, residual, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm over the last dim with float32 statistics, as
    torch.nn.functional.layer_norm(x, (x.size(-1),), weight, bias, eps)."""
    return _layer_norm(x, weight, bias, eps)
