"""Timing on the GPU as METHOD.md asks: CUDA events, warm-up, L2 flushed before every sample,
median of many samples with its spread, and the copy bandwidth measured in the same run."""

import datetime
import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List

import torch

_FLUSH = None


def flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > 4x the H200's L2
    _FLUSH.zero_()


def time_ms(fn: Callable[[], object], warmup: int = 5, samples: int = 60) -> Dict[str, float]:
    """Median device time of fn() in ms, each sample after an L2 flush."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s, e in zip(starts, ends):
        flush_l2()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    med = statistics.median(t)
    return {"median_ms": med, "p10_ms": t[len(t) // 10], "p90_ms": t[(9 * len(t)) // 10], "samples": len(t)}


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), warmup=3, samples=30)["median_ms"]
    del src, dst
    return 2 * nbytes / (t * 1e-3) / 1e9


def same_bytes_copy_gbps(op_bytes: int) -> float:
    """Bandwidth of a copy moving op_bytes in all (op_bytes/2 read, op_bytes/2 written)."""
    return copy_bandwidth_gbps(max(op_bytes // 2, 1 << 20))


def measure_fwd_bwd(f, inputs, dy, fwd_bytes: int, bwd_bytes: int, copy_bw: float,
                    leaves=None) -> Dict[str, object]:
    """Times f(*inputs) forward (no grad) and forward+backward (gradients of the leaves, by
    default every input, for cotangent(s) dy); returns the record fields: medians and spreads,
    bytes, GB/s, fractions of copy_bw and of copies moving the same bytes (measured here), peak
    extra memory. `inputs` may be a callable that makes the arguments afresh for each call
    (views of the leaves, so that each call's view is part of what is timed)."""
    args = inputs if callable(inputs) else (lambda: inputs)
    leaves = list(inputs if leaves is None else leaves)
    fb_bytes = fwd_bytes + bwd_bytes
    fwd_copy, fb_copy = same_bytes_copy_gbps(fwd_bytes), same_bytes_copy_gbps(fb_bytes)
    with torch.no_grad():
        fwd = time_ms(lambda: f(*args()))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb = time_ms(lambda: torch.autograd.grad(f(*args()), leaves, dy))
    peak = torch.cuda.max_memory_allocated() - base
    fwd_gbps = fwd_bytes / (fwd["median_ms"] * 1e-3) / 1e9
    fb_gbps = fb_bytes / (fb["median_ms"] * 1e-3) / 1e9
    return {
        "fwd_ms": fwd["median_ms"], "fwd_p10_p90_ms": [fwd["p10_ms"], fwd["p90_ms"]],
        "fwdbwd_ms": fb["median_ms"], "fwdbwd_p10_p90_ms": [fb["p10_ms"], fb["p90_ms"]],
        "samples": fwd["samples"], "fwd_bytes": fwd_bytes, "fwdbwd_bytes": fb_bytes,
        "fwd_GBps": fwd_gbps, "fwdbwd_GBps": fb_gbps,
        "same_bytes_copy_GBps": {"fwd": fwd_copy, "fwdbwd": fb_copy},
        "fwdbwd_peak_extra_mib": peak / 2**20,
        "fwd_frac_copy_bw": fwd_gbps / copy_bw, "fwdbwd_frac_copy_bw": fb_gbps / copy_bw,
        "fwd_frac_same_bytes_copy": fwd_gbps / fwd_copy, "fwdbwd_frac_same_bytes_copy": fb_gbps / fb_copy,
    }


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def plain_rope(q, k, cos, sin):
    """The Llama / Hugging Face rope as model code writes it: cos, sin [batch or 1, seq, dim]."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def environment(command: str) -> Dict[str, object]:
    if not torch.cuda.is_available():  # a check of a script on the CPU: no GPU to describe
        return {"gpu": None, "torch": torch.__version__, "python": sys.version.split()[0],
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": command}
    props = torch.cuda.get_device_properties(0)
    try:
        clocks = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except Exception as exc:  # nvidia-smi missing: record why
        clocks = f"unavailable ({exc})"
    import triton

    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "clocks_sm_mem_maxsm_driver": clocks,
    }


def write_json(path: str, payload: Dict[str, object]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def print_table(rows: List[Dict[str, object]], cols: List[str]) -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
