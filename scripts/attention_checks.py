"""What the attention diagnostics in scripts/ share (they run without kernelgate): causal
attention by its definition, the relative L2 error against it, and one call run in a process of
its own (a kernel that faults the device ends only that call)."""

import json
import math
import subprocess

import torch


def definition(q, k, v):
    """softmax(q k^T / sqrt(head_dim), masked above the diagonal) v, kv head h // group serving
    query head h. In the inputs' dtype (the scripts give it float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def rel_l2(got, want):
    return float((got.detach().double() - want).norm() / want.norm())


def in_own_process(cmd, timeout=120):
    """The JSON the command printed last on a line of its own, or {"error": why there is none}."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out ({timeout} s)"}
    lines = [l for l in p.stdout.splitlines() if l.startswith(("{", "["))]
    if lines:
        return json.loads(lines[-1])
    return {"error": f"process exit {p.returncode}: " + (p.stderr.strip().splitlines() or [""])[-1][:160]}
