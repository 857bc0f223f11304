"""bench/bench_hybrid_step.py on the CPU: its plain-PyTorch chunked gated delta rule (the eager
variant's) equals the recurrence step by step in float64, across chunk boundaries and a ragged
last chunk, and the script runs on a small model, recording a variant that cannot run here. (Its timings on the CPU mean
nothing; the step is measured on the H200.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
from bench_hybrid_step import chunked_gdr, recurrent_gdr  # noqa: E402


@pytest.mark.parametrize("seq,chunk", [(70, 16), (5, 64), (64, 64), (1, 8)])
def test_chunked_gated_delta_rule_equals_the_recurrence(seq, chunk):
    gen = torch.Generator().manual_seed(seq)
    B, H, dk, dv = 2, 3, 8, 5
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, seq, H, dk), dim=-1), F.normalize(r(B, seq, H, dk), dim=-1)
    v, g, beta = r(B, seq, H, dv), -F.softplus(r(B, seq, H)) * 3, torch.sigmoid(r(B, seq, H))
    got = chunked_gdr(q, k, v, g, beta, dk ** -0.5, chunk=chunk)
    want = recurrent_gdr(q, k, v, g, beta, dk ** -0.5)
    assert got.shape == (B, seq, H, dv) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and its gradients are the recurrence's
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    cot = r(B, seq, H, dv)
    a = torch.autograd.grad(chunked_gdr(*leaves, dk ** -0.5, chunk=chunk), leaves, cot)
    b = torch.autograd.grad(recurrent_gdr(*leaves, dk ** -0.5), leaves, cot)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def test_hybrid_step_script_runs_and_records_a_failing_variant(tmp_path):
    """The eager variant runs; kernelgate's, whose short conv goes to FLA (no evidence on the CPU
    ranks a kernelgate kernel first) and FLA's kernels need a GPU, is recorded with its error,
    not lost."""
    out = tmp_path / "hybrid.json"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_hybrid_step.py"), "--tiny",
                    "--device", "cpu", "--variants", "eager,kernelgate", "--gdr", "chunked",
                    "--warmup", "0", "--steps", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["variants"]}
    assert doc["gdr"] == "chunked" and set(rows) == {"eager", "kernelgate"}, rows
    assert rows["eager"]["grad_rel_err_max"] == 0 and rows["eager"]["step_ms"] > 0
    assert torch.isfinite(torch.tensor(rows["eager"]["loss"]))
    kg_row = rows["kernelgate"]
    if "step_ms" in kg_row:  # where the drop-in serves kernelgate's kernel: it agrees with eager
        assert kg_row["grad_rel_err_max"] < 1e-4, kg_row
    else:  # the reason is recorded
        assert kg_row.get("error") or kg_row.get("skipped"), kg_row
