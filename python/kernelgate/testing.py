"""Checking a backend against the float64 oracle, with the harness's own rule.

The oracle is the op's reference evaluated in float64 on upcast inputs (for rms_norm the op
`kernelgate::_rms_norm_reference`, whose autograd through ATen is the gradient contract).

Tolerance rule (derived, not hand-set; stated once, in C++: harness::check_against_oracle, which
the sweeps use too). For each output and each gradient, with `o` the oracle, `r` the reference
backend's result at the tested dtype and `g` the backend's:
  * NaN and Inf must sit at the same places as in `o` (with the same sign for Inf; an Inf where
    `o` is past the range of the output's dtype, as any result of that dtype holds it);
  * on the finite elements, both metrics
        rel_l2(g)  = ||g - o||_2 / ||o||_2
        max_rms(g) = max|g - o| / rms(o)
    must satisfy  metric(g) <= 2 * metric(r) + floor[dtype].
The reference's own error at that dtype is what rounding inputs and outputs to the dtype costs;
a correct kernel may differ from it only by accumulation order, hence a small factor. The floor
keeps the rule meaningful where the reference happens to be nearly exact: two unit roundoffs for
the 16-bit types, and for float32 room for a different reduction order over ~10^5 terms (1e-5).
The max metric catches a single bad row or element that the L2 metric would average away.
"""

import re
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch

from . import _C


def case_fields(encoded: str) -> Dict[str, str]:
    """A harness case's fields (its key=value;... encoding, values %XX-escaped)."""
    out = {}
    for item in encoded.split(";"):
        k, _, v = item.partition("=")
        out[k] = re.sub("%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), v)
    return out


def encode_case(fields: Mapping[str, str]) -> str:
    """The inverse of case_fields: what _C.case_arguments and _C.run_case take."""
    return ";".join(k + "=" + "".join(f"%{ord(c):02X}" if c in "%;=" else c for c in v) for k, v in fields.items())


def oracle_metrics(name: str, got: torch.Tensor, ref: torch.Tensor, oracle: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> Dict[str, object]:
    """The rule's verdict and metrics for one output: {"failure": "" or why, "rel_l2",
    "max_over_rms", "ref_rel_l2", "ref_max_over_rms"}."""
    return _C.check_against_oracle(name, got.detach(), ref.detach(), oracle.detach(), dtype or got.dtype)


def check_against_oracle(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    oracle: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
) -> Dict[str, float]:
    """Asserts the rule above for one output; returns the measured metrics."""
    m = oracle_metrics(name, got, ref, oracle, dtype)
    assert not m["failure"], m["failure"]
    return {k: v for k, v in m.items() if k != "failure"}


def device_syncs(fn: Callable[[], object]) -> int:
    """How many device-to-host syncs fn() makes (PyTorch's sync debug mode, as warnings)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the warnings of a sync: PyTorch also warns, once per process, that the mode is a
    # prototype ("... does not yet detect all synchronizing operations").
    return sum("called a synchronizing" in str(w.message) for w in seen)


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
                              rounds: int = 3, stream: Optional[torch.cuda.Stream] = None) -> None:
    """Captures step() (forward and backward, returning its tensors) in a CUDA graph, after two
    warm-up calls on a side stream as capture requires; then `rounds` times refills the inputs in
    place (refill(), under no_grad), replays the graph and asserts that every tensor it returned
    equals what a fresh eager step() returns.

    `stream`: the side stream, where the caller made its inputs on one. A view of a leaf made
    before capture (a strided argument) holds the leaf's AccumulateGrad node, which keeps the
    stream it was made on; made on the legacy default stream, the backward's gradient for it
    syncs with that stream mid-capture (cudaErrorStreamCaptureImplicit), as plain PyTorch
    does."""
    side = torch.cuda.Stream() if stream is None else stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Captured on the warm-up stream: autograd nodes made during warm-up (a leaf's AccumulateGrad)
    # keep the stream they were made on, and one on another stream would sync with it mid-capture.
    with torch.cuda.graph(graph, stream=side):
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
