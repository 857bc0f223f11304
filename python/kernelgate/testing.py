"""Checking a backend against the float64 oracle.

The oracle is the op's reference evaluated in float64 on upcast inputs (for rms_norm the op
`kernelgate::_rms_norm_reference`, whose autograd through ATen is the gradient contract).

Tolerance rule (derived, not hand-set). For each output and each gradient, with `o` the oracle,
`r` the reference backend's result at the tested dtype and `g` the backend's:
  * NaN and Inf must sit at the same places as in `o` (with the same sign for Inf);
  * on the finite elements, both metrics
        rel_l2(g)  = ||g - o||_2 / ||o||_2
        max_rms(g) = max|g - o| / rms(o)
    must satisfy  metric(g) <= FACTOR * metric(r) + FLOOR[dtype].
The reference's own error at that dtype is what rounding inputs and outputs to the dtype costs;
a correct kernel may differ from it only by accumulation order, hence a small FACTOR. The floor
keeps the rule meaningful where the reference happens to be nearly exact: two unit roundoffs for
the 16-bit types, and for float32 room for a different reduction order over ~10^5 terms. The
max metric catches a single bad row or element that the L2 metric would average away.
"""

import math
from typing import Callable, Dict, Optional, Sequence

import torch

FACTOR = 2.0
FLOOR: Dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2 * 2.0**-11,
    torch.bfloat16: 2 * 2.0**-8,
}


def _metrics(got: torch.Tensor, oracle: torch.Tensor, finite: torch.Tensor):
    g = got.double()[finite]
    o = oracle[finite]
    if o.numel() == 0:
        return 0.0, 0.0
    diff = (g - o).abs()
    norm = o.norm().item()
    rms = norm / math.sqrt(o.numel())
    scale_l2 = norm if norm > 0 else 1.0
    scale_rms = rms if rms > 0 else 1.0
    return diff.norm().item() / scale_l2, diff.max().item() / scale_rms


def check_against_oracle(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    oracle: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
) -> Dict[str, float]:
    """Asserts the rule above for one output; returns the measured metrics."""
    dtype = dtype or got.dtype
    assert got.shape == oracle.shape, f"{name}: shape {tuple(got.shape)} != oracle {tuple(oracle.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != reference {ref.dtype}"
    oracle = oracle.detach().double().cpu()
    got = got.detach().cpu()
    ref = ref.detach().cpu()
    gd = got.double()
    o_nan, g_nan = oracle.isnan(), gd.isnan()
    assert torch.equal(o_nan, g_nan), (
        f"{name}: NaN pattern differs from the oracle "
        f"({int(g_nan.sum())} NaN in result, {int(o_nan.sum())} in oracle)"
    )
    o_inf, g_inf = oracle.isinf(), gd.isinf()
    assert torch.equal(o_inf, g_inf) and torch.equal(oracle[o_inf].sign(), gd[g_inf].sign()), (
        f"{name}: Inf pattern differs from the oracle"
    )
    finite = oracle.isfinite()
    ref_l2, ref_max = _metrics(ref, oracle, finite & ref.double().isfinite())
    l2, mx = _metrics(got, oracle, finite)
    floor = FLOOR[dtype]
    assert l2 <= FACTOR * ref_l2 + floor, (
        f"{name}: relative L2 error {l2:.3e} > {FACTOR} x reference {ref_l2:.3e} + floor {floor:.1e}"
    )
    assert mx <= FACTOR * ref_max + floor, (
        f"{name}: max error / rms {mx:.3e} > {FACTOR} x reference {ref_max:.3e} + floor {floor:.1e}"
    )
    return {"rel_l2": l2, "max_over_rms": mx, "ref_rel_l2": ref_l2, "ref_max_over_rms": ref_max}


def poison_cuda_allocator(device: torch.device, nbytes: int = 1 << 26) -> None:
    """Fills free blocks of the caching allocator with NaN, so that an output element a kernel
    never writes reads as NaN (and fails the NaN-pattern check) instead of a lucky zero."""
    if device.type != "cuda":
        return
    # One large block (the allocator's large pool) and several under 1 MiB (its small pool).
    blocks = [torch.empty(nbytes // 4, dtype=torch.float32, device=device)]
    blocks += [torch.empty((1 << 18) - 64 * i, dtype=torch.float32, device=device) for i in range(16)]
    for b in blocks:
        b.fill_(float("nan"))
    del blocks


def assert_cuda_graph_replays(step: Callable[[], Sequence[torch.Tensor]], refill: Callable[[], None],
                              rounds: int = 3) -> None:
    """Captures step() (forward and backward, returning its tensors) in a CUDA graph, after two
    warm-up calls on a side stream as capture requires; then `rounds` times refills the inputs in
    place (refill(), under no_grad), replays the graph and asserts that every tensor it returned
    equals what a fresh eager step() returns."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(rounds):
        with torch.no_grad():
            refill()
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert len(eager) == len(out)
        for a, e in zip(out, eager):
            torch.testing.assert_close(a, e)
