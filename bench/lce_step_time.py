"""linear_cross_entropy (input-dtype accumulation) at T 8192, H 4096, V 128256, bf16: one
fwd+bwd step timed by CUDA events (L2 flushed before each sample), by events around back-to-back
steps and by the wall clock, against the kernels' busy time in a torch.profiler trace of
back-to-back steps; a plain torch.mm of the logits' shape for comparison.

    cd bench && python lce_step_time.py
"""

import sys
import time

import torch

import kernelgate as kg
from common import time_ms

OP = "linear_cross_entropy"


def timings(f):
    """Per-call ms: time_ms (L2 flushed per sample), events around 5 calls, wall clock of 5."""
    r = {"time_ms": time_ms(f, warmup=2, samples=10)["median_ms"]}
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        f()
    e.record()
    torch.cuda.synchronize()
    r["events_5_back_to_back"] = s.elapsed_time(e) / 5
    t0 = time.perf_counter()
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    r["wall_5"] = (time.perf_counter() - t0) * 1e3 / 5
    return {k: round(v, 3) for k, v in r.items()}


def main() -> int:
    dt = torch.bfloat16
    T, H, V = 8192, 4096, 128256
    h = torch.randn(T, H, device="cuda", dtype=dt).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", dtype=dt) * H**-0.5).requires_grad_(True)
    t = torch.randint(0, V, (T,), device="cuda")
    dy = torch.randn((), device="cuda", dtype=dt)
    kg.policy.add_rule(OP, ["kernelgate_cuda_narrow_accum"], evidence="step time diagnosis")

    def step():
        return torch.autograd.grad(kg.linear_cross_entropy(h, w, t), [h, w], dy)

    a, logits = h.detach(), torch.empty(T, V, device="cuda", dtype=dt)
    print("lce step", timings(step), flush=True)
    print("mm logits", timings(lambda: torch.mm(a, w.detach().t(), out=logits)), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    span, busy = ks[-1][1] - ks[0][0], sum(b - a for a, b, _ in ks)
    print(f"profile 3 back-to-back steps: span {span / 3e3:.3f} ms/step, kernels busy {busy / 3e3:.3f} ms/step")
    per = {}
    for a0, b0, name in ks:
        per[name[:40]] = per.get(name[:40], 0) + (b0 - a0)
    for name, v in sorted(per.items(), key=lambda x: -x[1])[:6]:
        print(f"  {name} {v / 3e3:.3f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
