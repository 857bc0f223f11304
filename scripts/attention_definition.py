"""Causal attention by its definition, for the attention diagnostics in scripts/ (run without
kernelgate): softmax(q k^T / sqrt(head_dim), masked above the diagonal) v, kv head h // group
serving query head h. In the inputs' dtype (the scripts give it float64)."""

import math

import torch


def definition(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v
