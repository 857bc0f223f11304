"""bench/bench_gated_delta_rule.py on the CPU: its plain-PyTorch KDA layer (the eager variant of
--op kda, the plain code of the fallback rule for kda) is the op's recurrence in float64, forward
and every gradient, across chunk boundaries, a ragged last chunk and strong decays. (The script
itself times on a GPU only.)"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
from bench_gated_delta_rule import chunked_kda, eager_layer_kda  # noqa: E402

from test_kda import recurrence, steps  # noqa: E402  (the op's definition step by step)


@pytest.mark.parametrize("seq,chunk", [(40, 16), (5, 16), (16, 16), (1, 4), (23, 5)])
def test_the_plain_chunked_kda_is_the_recurrence(seq, chunk):
    gen = torch.Generator().manual_seed(seq)
    B, H, dk, dv = 2, 3, 8, 5
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, seq, H, dk), dim=-1), F.normalize(r(B, seq, H, dk), dim=-1)
    v, g, beta = r(B, seq, H, dv), -F.softplus(r(B, seq, H, dk)) * 3, torch.sigmoid(r(B, seq, H))
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    got = chunked_kda(*leaves, dk ** -0.5, chunk=chunk)
    want = steps(*leaves, dk ** -0.5, q.new_zeros(B, H, dk, dv))[0]
    assert got.shape == (B, seq, H, dv) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    cot = r(B, seq, H, dv)
    for x, y in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def test_the_plain_kda_layer_is_the_op():
    """The layer's gates and normalisation around it give the op's recurrence (test_kda's), up to
    F.normalize's eps against the op's sqrt(|x|^2 + 1e-6)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, dk, dv = 2, 37, 3, 8, 5
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    args = [r(B, T, H, dk), r(B, T, H, dk), r(B, T, H, dv), 3 * r(B, T, H, dk), r(B, T, H), r(H), r(H, dk)]
    got = eager_layer_kda(*args, dk ** -0.5)
    want, _ = recurrence(*args, None, dk ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_plain_kda_stays_finite_under_strong_decays():
    """Every exponent is masked before exp: decays of -60 per step leave no inf or nan, forward or
    backward, in float32."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, dk, dv = 1, 40, 2, 8, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen)
    g = torch.full((B, T, H, dk), -60.0)
    beta = torch.rand(B, T, H, generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    o = chunked_kda(*leaves, dk ** -0.5)
    grads = torch.autograd.grad(o.square().sum(), leaves)
    assert torch.isfinite(o).all() and all(torch.isfinite(x).all() for x in grads)


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_the_profile_option_records_the_references_aten_ops(op):
    """--profile's record on the CPU: the reference's forward+backward ran under the profiler (no
    device there, so no kernels and no device time), at the shape asked for."""
    from bench_gated_delta_rule import profile_reference, variants

    fns, _ = variants(op)
    rec = profile_reference(fns["kg_reference"], (1, 70, 2, 8), torch.float32, op, device="cpu")
    assert rec["variant"] == "kg_reference" and rec["shape"] == [1, 70, 2, 8]
    assert rec["kernels"] == 0 and rec["device_ms"] == 0 and rec["top_ops"] == []
