"""The op API. Each function is a direct call of the registered torch op: nothing is decided here."""

from typing import Optional

import torch

_rms_norm = torch.ops.kernelgate.rms_norm.default
_swiglu = torch.ops.kernelgate.swiglu.default
_geglu = torch.ops.kernelgate.geglu.default


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
