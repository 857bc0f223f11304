"""causal_conv1d: what is special to it. test_contracts.py checks every backend against the
float64 oracle on the generated cases (shapes with widths 1, 2, 7 and 8, layouts, regimes, dtypes,
with and without bias, both activations), opcheck, torch.compile, double backward and CUDA graphs.
Here: the definition against PyTorch's depthwise conv1d written independently, every width up to
the CUDA kernel's 8 with sequences shorter than the filter and not a multiple of anything,
channels that do not fill a vector, misaligned inputs (the kernel's scalar path), infinite
weights (NaN where the zero padding meets them, as in the reference), and clear errors."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def conv_definition(x, w, b, activation):
    """y[b, t, d] = act(bias[d] + sum_j w[d, j] x[b, t - (width - 1) + j, d]), by PyTorch's conv1d."""
    width, seq = w.shape[1], x.shape[1]
    y = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), b, padding=width - 1, groups=x.shape[2])[..., :seq]
    return (F.silu(y) if activation == "silu" else y).transpose(1, 2)


def inputs(batch, seq, dim, width, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, width, generator=gen, dtype=torch.float64) / width ** 0.5
    b = torch.randn(dim, generator=gen, dtype=torch.float64) if bias else None
    dy = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    return x, w, b, dy


def run(backend, x, w, b, dy, activation, offset=0):
    """Forward and gradients of the backend, forced; offset > 0 passes x as a view that starts
    `offset` elements into its storage (not 16-byte aligned for offset 1)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    xa = leaves[0]
    if offset:
        store = torch.zeros(x.numel() + offset, dtype=x.dtype, device=x.device)
        xa = store[offset:].view(x.shape)
        xa.copy_(x)
        xa.requires_grad_(True)
        leaves[0] = xa
    with kg.use(force={"causal_conv1d": backend}):
        assert kg.explain("causal_conv1d", xa, leaves[1], leaves[2], activation).backend == backend
        poison_cuda_allocator(x.device)
        y = kg.causal_conv1d(xa, leaves[1], leaves[2], activation)
        want = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(y, want, dy)
    return y, grads


def check(backend, device, dtype, shape, bias, activation, offset=0, seed=0):
    x, w, b, dy = inputs(*shape, bias, seed)
    x64, w64 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b64 = b.clone().requires_grad_(True) if b is not None else None
    oracle = conv_definition(x64, w64, b64, activation)
    o_grads = torch.autograd.grad(oracle, [t for t in (x64, w64, b64) if t is not None], dy)
    cast = [t.to(device, dtype) if t is not None else None for t in (x, w, b, dy)]
    got, got_grads = run(backend, *cast, activation, offset)
    ref, ref_grads = run("reference", *cast, activation)
    assert got.dtype == dtype and got.shape == x.shape
    check_against_oracle("y", got, ref, oracle, dtype)
    for name, g, r, o in zip(["dx", "dweight", "dbias"], got_grads, ref_grads, o_grads):
        check_against_oracle(name, g, r, o, dtype)


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_cpu_against_pytorchs_conv1d(backend, bias, activation):
    for shape in [(2, 37, 19, 4), (1, 2, 5, 4), (3, 1, 8, 1), (2, 9, 16, 8)]:
        check(backend, "cpu", torch.float32, shape, bias, activation)


def test_bad_input_errors():
    x, w = torch.randn(2, 8, 16), torch.randn(16, 4)
    with pytest.raises(RuntimeError, match="activation must be 'none' or 'silu', got 'relu'"):
        kg.causal_conv1d(x, w, None, "relu")
    with pytest.raises(RuntimeError, match=r"weight must have at least one tap \(weight.size\(1\) >= 1\), got "
                       r"weight of shape \[16, 0\]"):
        kg.causal_conv1d(x, torch.randn(16, 0))
    with pytest.raises(RuntimeError, match=r"weight.size\(-2\) must be 16 to match x.size\(-1\) \(dim\), got 15"):
        kg.causal_conv1d(x, torch.randn(15, 4))
    with pytest.raises(RuntimeError, match=r"bias.size\(-1\) must be 16 to match x.size\(-1\) \(dim\), got 15"):
        kg.causal_conv1d(x, w, torch.randn(15))
    with pytest.raises(RuntimeError, match=r"x must have 3 dims, got 2 \(shape \[8, 16\]\)"):
        kg.causal_conv1d(torch.randn(8, 16), w)
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of x \(float32\), got float16"):
        kg.causal_conv1d(x, w.half())


def test_activation_is_part_of_the_dispatch_key():
    x, w = torch.randn(2, 8, 16), torch.randn(16, 4)
    assert kg.explain("causal_conv1d", x, w, None, "none").key != kg.explain("causal_conv1d", x, w, None, "silu").key


# ---- the CUDA kernel -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", range(1, 9))
def test_gpu_every_width_short_and_odd_sequences(width, dtype):
    # seq below the width, not a multiple of the kernel's 2 / 4-row groups nor of its tiles;
    # dim not a multiple of a vector (the scalar path) and a multiple of it (the vector path).
    for shape in [(2, 1, 24, width), (1, width - 1 or 1, 8, width), (3, 45, 40, width), (2, 301, 37, width),
                  (1, 1031, 64, width)]:
        for bias in (True, False):
            for activation in ("none", "silu"):
                check("kernelgate_cuda", "cuda", dtype, shape, bias, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_misaligned_x_takes_the_scalar_path(dtype):
    check("kernelgate_cuda", "cuda", dtype, (2, 100, 64, 4), True, "silu", offset=1)


@pytest.mark.gpu
def test_gpu_production_shape_against_the_definition():
    check("kernelgate_cuda", "cuda", torch.bfloat16, (4, 4096, 2048, 4), False, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kernelgate_cuda", "reference"])
def test_gpu_infinite_weight_meets_the_padding_as_the_reference_does(backend):
    x, w, b, dy = inputs(1, 6, 8, 4, True)
    w[0, 0] = float("inf")
    cast = [t.to("cuda", torch.float32) for t in (x, w, b, dy)]
    got, got_grads = run(backend, *cast, "none")
    ref = torch.ops.kernelgate._causal_conv1d_reference(*[t.double() for t in cast[:3]], "none")
    # y[t] for t < 3 reads the padding through weight[0, 0]: inf * 0 = NaN there, as in the reference
    assert torch.equal(torch.isnan(got[0, :, 0]).cpu(), torch.isnan(ref[0, :, 0]).cpu())
    assert torch.isnan(got[0, :3, 0]).all() and torch.isinf(got[0, 3:, 0]).all()
    assert torch.isfinite(got[0, :, 1:]).all() and torch.isfinite(got_grads[0][0, :, 1:]).all()
