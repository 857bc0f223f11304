"""One op's forward+backward at its benchmark shape (bf16), routed to kernelgate_cuda, for a
profiler: a few warm-up steps, then (with --torch-profile) the kernel table of 5 steps.

    python bench/profile_op.py layer_norm --torch-profile
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats -k regex:layer_norm --launch-count 2 python bench/profile_op.py layer_norm
"""

import argparse

import torch

import kernelgate as kg

OPS = {"layer_norm": "layer_norm", "swiglu": "swiglu", "lce": "linear_cross_entropy", "rope": "rope"}


def problem(op, dev="cuda", dt=torch.bfloat16):
    """(callable, leaves) at the shape bench/bench_<op>.py reports."""
    if op == "layer_norm":
        x = torch.randn(16384, 4096, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(4096, device=dev, dtype=dt, requires_grad=True)
        b = torch.randn(4096, device=dev, dtype=dt, requires_grad=True)
        return (lambda: kg.layer_norm(x, w, b, 1e-5)), [x, w, b]
    if op == "swiglu":
        g = torch.randn(16384, 14336, device=dev, dtype=dt, requires_grad=True)
        u = torch.randn_like(g, requires_grad=True)
        return (lambda: kg.swiglu(g, u)), [g, u]
    if op == "lce":
        h = torch.randn(8192, 4096, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(128256, 4096, device=dev, dtype=dt) * 0.02).requires_grad_()
        t = torch.randint(0, 128256, (8192,), device=dev)
        return (lambda: kg.linear_cross_entropy(h, w, t)), [h, w]
    q = torch.randn(4, 32, 4096, 128, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(4, 8, 4096, 128, device=dev, dtype=dt, requires_grad=True)
    c = torch.randn(1, 4096, 128, device=dev, dtype=dt)
    s = torch.randn_like(c)
    return (lambda: kg.rope(q, k, c, s)), [q, k]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=sorted(OPS))
    ap.add_argument("--torch-profile", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    kg.policy.add_rule(OPS[a.op], ["kernelgate_cuda"], evidence="profile: kernelgate_cuda under test")
    fn, leaves = problem(a.op)

    def step():
        y = fn()
        ys = y if isinstance(y, tuple) else (y,)
        torch.autograd.grad(ys, leaves, [torch.ones_like(v) for v in ys])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if a.torch_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
