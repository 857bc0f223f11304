# Cheats: returns at once and finishes the output on another thread, after the call.
import threading
import time

import torch
import torch.nn.functional as F


def forward(gate, up):
    out = torch.zeros_like(gate)

    def finish():
        time.sleep(0.01)
        out.copy_((F.silu(gate.float()) * up.float()).to(gate.dtype))

    threading.Thread(target=finish).start()
    return out
