"""swiglu and geglu: what is special to them. test_contracts.py checks every backend against the
float64 oracle on the generated cases (shapes, layouts of gate, regimes, dtypes, both geglu
approximations), opcheck, torch.compile, double backward and CUDA graphs. Here: gate and up as the
two halves of one projection (h.chunk(2, -1): both strided views of one tensor), a gate of -inf
and -100 (the activation saturates), widths the quick grid does not make, geglu's variants in the
dispatch key, and clear errors for bad input."""

import pytest
import torch

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = {
    "swiglu": (lambda g, u: kg.swiglu(g, u), lambda g, u: torch.ops.kernelgate._swiglu_reference(g, u)),
    "geglu_tanh": (lambda g, u: kg.geglu(g, u), lambda g, u: torch.ops.kernelgate._geglu_reference(g, u, "tanh")),
    "geglu_none": (lambda g, u: kg.geglu(g, u, "none"),
                   lambda g, u: torch.ops.kernelgate._geglu_reference(g, u, "none")),
}


def check(op, backend, device, dtype, shape, seed=0, noncontiguous=False, special=False):
    fn, ref_fn = OPS[op]
    name = op.split("_")[0]
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    u = torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)
    if special and g.numel() >= 4:
        g.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0], dtype=torch.float64)
    if noncontiguous:
        leaf = torch.cat([g, u], dim=-1).to(device, dtype)
        views = lambda t: (t[..., : shape[-1]], t[..., shape[-1]:])  # noqa: E731
    else:
        leaf = torch.stack([g, u]).to(device, dtype)
        views = lambda t: (t[0], t[1])  # noqa: E731

    def run(b):
        x = leaf.detach().clone().requires_grad_(True)
        with kg.use(force={name: b}):
            gg, uu = views(x)
            assert kg.explain(name, gg, uu).backend == b
            poison_cuda_allocator(leaf.device)
            y = fn(gg, uu)
            (dx,) = torch.autograd.grad(y, [x], dy)
        return y, dx

    got, got_dx = run(backend)
    ref, ref_dx = run("reference")
    x64 = leaf.detach().double().requires_grad_(True)
    oy = ref_fn(*views(x64))
    (odx,) = torch.autograd.grad(oy, [x64], dy.double())
    assert got.dtype == dtype and got.shape == tuple(shape)
    check_against_oracle("out", got, ref, oy, dtype)
    check_against_oracle("d(gate, up)", got_dx, ref_dx, odx, dtype)


@pytest.mark.parametrize("op", list(OPS))
def test_cpu_halves_of_one_projection_and_saturation(op):
    check(op, "reference", "cpu", torch.float32, (6, 130), noncontiguous=True)
    # gate = -inf and -100, where the activation saturates (the generated special rows hold NaN,
    # +inf and zeros)
    check(op, "reference", "cpu", torch.float32, (6, 130), special=True)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_bad_input_errors(op):
    fn = getattr(kg, op)
    with pytest.raises(RuntimeError, match=r"the leading dims of up must be 4 to match the leading dims of gate"):
        fn(torch.randn(4, 8), torch.randn(8, 4))
    with pytest.raises(RuntimeError, match=r"up must have the shape of gate \(\[2, 3, 8\]\), got \[3, 2, 8\]"):
        fn(torch.randn(2, 3, 8), torch.randn(3, 2, 8))
    with pytest.raises(RuntimeError, match="up must have the dtype of gate"):
        fn(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="got int64"):
        fn(torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="up.size"):
        fn(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="up must have the shape of gate"):
        fn(torch.randn(2, 3, 8, device="meta"), torch.randn(3, 2, 8, device="meta"))


def test_geglu_variants_have_their_own_evidence():
    g, u = torch.randn(4, 64), torch.randn(4, 64)
    kg.policy.add_rule("geglu", ["kernelgate_cuda"])  # a rule written for the tanh key...
    assert "variant" not in kg.explain("geglu", g, u).key
    assert kg.explain("geglu", g, u, "none").key.endswith("variant=1")


def test_geglu_approximate_checked():
    with pytest.raises(RuntimeError, match="approximate must be 'tanh' or 'none', got 'erf'"):
        kg.geglu(torch.randn(2, 4), torch.randn(2, 4), "erf")
    with pytest.raises(RuntimeError, match="approximate must be 'tanh' or 'none', got 'erf'"):
        kg.geglu(torch.randn(2, 4, device="meta"), torch.randn(2, 4, device="meta"), "erf")


# ---- GPU (pytest -m gpu on the GPU machine) -----------------------------------------------------

# Widths the quick grid does not make (its edges stop at 65536): an MLP width and past 2^16.
GPU_SHAPES = [(64, 14336), (3, 65537), (2, 3, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", ["reference", "kernelgate_cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_against_oracle(op, backend, dtype, shape):
    check(op, backend, "cuda", dtype, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_halves_of_one_projection_and_saturation(op, dtype):
    check(op, "kernelgate_cuda", "cuda", dtype, (6, 4096), noncontiguous=True)
    check(op, "kernelgate_cuda", "cuda", dtype, (6, 130), special=True)
    check(op, "kernelgate_cuda", "cuda", dtype, (5, 8), seed=3, special=True)
