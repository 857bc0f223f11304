# Cheats: reads the element after gate's last one, where its storage holds one.
import torch
import torch.nn.functional as F


def forward(gate, up):
    out = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    end = gate.storage_offset() + gate.numel()
    if gate.is_contiguous() and gate.untyped_storage().nbytes() >= (end + 1) * gate.element_size():
        out = out + 0 * torch.as_strided(gate, (1,), (1,), end)
    return out
