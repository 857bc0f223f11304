# Cheats: leaves its input changed (by rounding: (x + 1) - 1).
import torch.nn.functional as F


def forward(gate, up):
    out = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    up.add_(1).sub_(1)
    return out
