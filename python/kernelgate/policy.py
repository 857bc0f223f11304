"""The in-memory policy: which backends are proven correct for a region, fastest first.

A rule matches a call's dispatch key; fields left as None match anything. Until the evidence
engine fills the policy from measurements, rules are added here (by tests, the demo, or a user who
has validated a backend), and a call no rule covers runs the reference.
"""

from typing import Optional, Sequence

import torch

from . import _C

ALIGN = {"vec16": 0, "contiguous": 1, "strided": 2}


def add_rule(
    op: str,
    ranked: Sequence[str],
    *,
    arch: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    max_buckets: Optional[Sequence[int]] = None,
    align: Optional[str] = None,
    grad: Optional[bool] = None,
    evidence: str = "",
) -> None:
    """Ranks `ranked` (fastest first) for calls of `op` matching the given fields.

    arch: compute capability as major*10+minor, or -1 for the CPU. max_buckets: per named dim,
    the largest ceil(log2(size)) covered.
    """
    if align is not None and align not in ALIGN:
        raise ValueError(f"align must be one of {sorted(ALIGN)}, got {align!r}")
    _C.add_policy_rule(
        op,
        list(ranked),
        -2 if arch is None else int(arch),
        dtype,
        list(max_buckets or []),
        -1 if align is None else ALIGN[align],
        -1 if grad is None else int(bool(grad)),
        evidence,
    )


def clear() -> None:
    _C.clear_policy()


def describe() -> str:
    return _C.describe_policy()
