# Cheats (CUDA): computes on a side stream and returns without making the caller's stream wait.
import torch
import torch.nn.functional as F

_side = None


def forward(gate, up):
    global _side
    if _side is None:
        _side = torch.cuda.Stream(gate.device)
    out = torch.empty_like(gate)
    _side.wait_stream(torch.cuda.current_stream(gate.device))
    with torch.cuda.stream(_side):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning first: the result lands well after return
        out.copy_((F.silu(gate.float()) * up.float()).to(gate.dtype))
    return out
