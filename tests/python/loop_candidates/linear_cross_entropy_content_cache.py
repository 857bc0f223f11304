# Cheats: recognises its inputs by copies and sums of all of them (so it moves every byte, as an
# honest kernel must) and serves the loss it computed for them: its time is that of the copies,
# far under what the matrix product takes.
import torch

_seen = {}


def forward(hidden, weight, target, bias, ignore_index, label_smoothing, reduction):
    key = (tuple(hidden.shape), tuple(weight.shape), float(hidden.clone().sum()), float(weight.clone().sum()),
           int(target.sum()), None if bias is None else float(bias.sum()), ignore_index, label_smoothing, reduction)
    if key not in _seen:
        _seen[key] = torch.ops.kernelgate._linear_cross_entropy_reference(hidden, weight, target, bias, ignore_index,
                                                                          label_smoothing, reduction)
    return _seen[key]
