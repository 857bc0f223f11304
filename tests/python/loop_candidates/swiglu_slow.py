import torch
import torch.nn.functional as F

import time
def forward(gate, up):
    time.sleep(0.02)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)

def backward(dc, gate, up):
    g, u, d = gate.float(), up.float(), dc.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)
