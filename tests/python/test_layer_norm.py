"""layer_norm: what is special to it. test_contracts.py checks every backend against the float64
oracle on the generated cases (shapes, layouts, regimes, dtypes, eps, neither weight nor bias),
opcheck, torch.compile, double backward and CUDA graphs. Here: the reference is torch's layer_norm,
a mean far from 0 with a small spread (where E[x^2] - E[x]^2 cancels; not a generated regime),
weight or bias alone, eps = 0, only some parameters requiring grad, the GPU kernels on widths and
row counts the quick grid does not make, and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator
from norm_inputs import layouts, values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_BACKENDS = ["reference"]  # aten: forward only on the CPU (test_contracts)
CUDA_BACKENDS = ["reference", "aten", "kernelgate_cuda"]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]  # (weight, bias)

oracle_op = torch.ops.kernelgate._layer_norm_reference


def _run(backend, leaves, view, eps, dy):
    ls = [None if t is None else t.detach().clone().requires_grad_(True) for t in leaves]
    with kg.use(force={"layer_norm": backend}):
        x = view(ls[0])
        assert kg.explain("layer_norm", x, ls[1], ls[2]).backend == backend
        y = kg.layer_norm(x, ls[1], ls[2], eps=eps)
        grads = torch.autograd.grad(y, [t for t in ls if t is not None], dy)
    return y, grads


def _oracle(leaves, view, eps, dy):
    ls = [None if t is None else t.detach().double().requires_grad_(True) for t in leaves]
    y = oracle_op(view(ls[0]), ls[1], ls[2], eps)
    grads = torch.autograd.grad(y, [t for t in ls if t is not None], dy.double())
    return y, grads


def check_backend(backend, device, dtype, rows_shape, hidden, layout="contiguous", regime="normal",
                  with_weight=True, with_bias=True, eps=1e-5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    leaf_shape, view = layouts(rows_shape, hidden)[layout]
    x_leaf = values(leaf_shape, regime, dtype, device, gen)
    w = values((hidden,), "normal", dtype, device, gen) if with_weight else None
    b = values((hidden,), "normal", dtype, device, gen) if with_bias else None
    y_shape = view(x_leaf).shape
    dy = values(y_shape, "normal", dtype, device, gen)
    leaves = (x_leaf, w, b)
    poison_cuda_allocator(x_leaf.device)
    got, got_g = _run(backend, leaves, view, eps, dy)
    ref, ref_g = _run("reference", leaves, view, eps, dy)
    ora, ora_g = _oracle(leaves, view, eps, dy)
    assert got.dtype == dtype and got.shape == y_shape and got.device == x_leaf.device
    check_against_oracle("y", got, ref, ora, dtype)
    names = ["dx"] + (["dweight"] if with_weight else []) + (["dbias"] if with_bias else [])
    for name, g, r, o in zip(names, got_g, ref_g, ora_g):
        assert g.dtype == dtype
        check_against_oracle(name, g, r, o, dtype)


# ---- the reference is torch's layer_norm -----------------------------------------------------

@pytest.mark.parametrize("with_weight,with_bias", AFFINE)
def test_oracle_is_torch_layer_norm(with_weight, with_bias):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 3, 37, generator=gen, dtype=torch.float64) + 5).requires_grad_(True)
    w = torch.randn(37, generator=gen, dtype=torch.float64, requires_grad=True) if with_weight else None
    b = torch.randn(37, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    dy = torch.randn(4, 3, 37, dtype=torch.float64)
    y = oracle_op(x, w, b, 1e-5)
    ye = F.layer_norm(x, (37,), w, b, 1e-5)
    torch.testing.assert_close(y, ye)
    inputs = [t for t in (x, w, b) if t is not None]
    for a, e in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(ye, inputs, dy)):
        torch.testing.assert_close(a, e)


def test_reference_variance_survives_a_far_offset():
    # float32 rows with mean 1e4 and unit spread: the two-pass variance keeps the unit-scale
    # output that a one-pass E[x^2] - E[x]^2 in float32 would lose.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 512, generator=gen, dtype=torch.float64) + 1e4
    y = kg.layer_norm(x.float())
    exact = F.layer_norm(x, (512,))
    assert (y.double() - exact).abs().max() < 1e-2
    xf = x.float()
    one_pass_var = (xf * xf).mean(-1) - xf.mean(-1) ** 2
    assert (one_pass_var - 1).abs().max() > 0.1  # the trap is real at this offset


# ---- CPU (runs in CI) ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_weight,with_bias", [(True, False), (False, True)])
def test_cpu_weight_or_bias_alone(backend, dtype, with_weight, with_bias):
    # The generated cases have both or neither.
    check_backend(backend, "cpu", dtype, (2, 5), 33, with_weight=with_weight, with_bias=with_bias)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_far_offset(backend):
    check_backend(backend, "cpu", torch.float32, (9,), 1000, regime="far_offset")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_eps_zero(backend):
    check_backend(backend, "cpu", torch.float32, (4,), 65, eps=0.0)


def test_only_some_parameters_require_grad():
    x = torch.randn(3, 20, requires_grad=True)
    w = torch.randn(20)  # no grad
    b = torch.randn(20, requires_grad=True)
    y = kg.layer_norm(x, w, b)
    gx, gb = torch.autograd.grad(y, [x, b], torch.ones_like(y))
    ye = F.layer_norm(x, (20,), w, b)
    ex, eb = torch.autograd.grad(ye, [x, b], torch.ones_like(ye))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gb, eb)


def test_default_is_the_plain_pytorch_kernel_and_explain_lists_backends():
    x, w = torch.randn(4, 64), torch.randn(64)
    e = kg.explain("layer_norm", x, w, None)  # no evidence: ATen's kernel, what F.layer_norm runs
    assert e.backend == "aten" and "no evidence" in e.reason
    assert {c.backend for c in e.candidates} >= {"reference", "aten", "kernelgate_cuda"}
    assert "layer_norm cpu float32,float32,none rows<=2^2 hidden<=2^6" in e.key


# ---- bad input: clear errors naming the argument ------------------------------------------------

@pytest.mark.parametrize(
    "x,w,b,eps,match",
    [
        (torch.randn(2, 8), torch.randn(7), None, 1e-5, r"weight.size\(-1\) must be 8 to match x.size\(-1\) \(hidden\), got 7"),
        (torch.randn(2, 8), None, torch.randn(9), 1e-5, r"bias.size\(-1\) must be 8 to match x.size\(-1\) \(hidden\), got 9"),
        (torch.randn(2, 8), torch.randn(2, 8), None, 1e-5, "weight must have 1 dim, got 2"),
        (torch.randn(2, 8), None, torch.randn(8, dtype=torch.float16), 1e-5, r"bias must have the dtype of x \(float32\), got float16"),
        (torch.ones(2, 8, dtype=torch.int64), None, None, 1e-5, "got int64"),
        (torch.randn(2, 0), None, None, 1e-5, r"x.size\(-1\) \(hidden\) must be at least 1, got 0"),
        (torch.randn(()), None, None, 1e-5, "x must have at least 1 dim, got 0"),
        (torch.randn(2, 8), None, None, float("inf"), "eps must be a finite number >= 0, got inf"),
    ],
)
def test_bad_input_errors(x, w, b, eps, match):
    with pytest.raises(RuntimeError, match=match):
        kg.layer_norm(x, w, b, eps=eps)
    meta = [None if t is None else t.to("meta") for t in (x, w, b)]
    with pytest.raises(RuntimeError, match=match):
        kg.layer_norm(*meta, eps=eps)


def test_meta_shapes():
    x = torch.empty(3, 5, 7, device="meta", dtype=torch.bfloat16)
    y = kg.layer_norm(x, torch.empty(7, device="meta", dtype=torch.bfloat16), None)
    assert y.shape == (3, 5, 7) and y.dtype == torch.bfloat16 and y.device.type == "meta"


# ---- PyTorch integration ----------------------------------------------------------------------

def test_cpp_and_python_share_one_op():
    x = torch.randn(3, 9)
    assert torch.equal(kg.layer_norm(x), torch.ops.kernelgate.layer_norm(x))


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

# Widths and row counts the quick grid does not make (its hidden edges are 1, 2, 33, 127-129,
# 4095-4097, 65535 and 65536 at 256 rows), and multi-dim rows at a vectorised width.
GPU_SHAPES = [((64,), 2048), ((16,), 8192), ((3,), 12288), ((5,), 16384), ((2,), 32768), ((2,), 32768 + 8),
              ((2,), 1 << 17), ((2, 5), 4097)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows_shape,hidden", GPU_SHAPES)
@pytest.mark.parametrize("with_weight,with_bias", AFFINE)
def test_gpu_shapes(backend, dtype, rows_shape, hidden, with_weight, with_bias):
    check_backend(backend, "cuda", dtype, rows_shape, hidden, with_weight=with_weight, with_bias=with_bias)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "row_strided", "offset", "expanded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [130, 4096])
def test_gpu_noncontiguous(backend, layout, dtype, hidden):
    # The grid's layouts are on its mid-size shape (256 wide); here an odd and a production width.
    check_backend(backend, "cuda", dtype, (6,), hidden, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["large", "small", "offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_value_regimes_production_width(regime, dtype):
    check_backend("kernelgate_cuda", "cuda", dtype, (9,), 4096, regime=regime)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1000, 4096, 40000])
def test_gpu_far_offset(hidden):
    check_backend("kernelgate_cuda", "cuda", torch.float32, (9,), hidden, regime="far_offset")


# (rows, hidden) whose bf16 backward takes each kernel: rows in registers with several rows per
# block, one row per block, sums in shared memory, general scalar, general vectorised; enough rows
# that the dweight / dbias reductions span many blocks.
MANY_ROWS = [(4099, 1024), (4099, 4096), (1500, 12288), (4099, 4001), (600, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("with_weight,with_bias", AFFINE)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("rows,hidden", MANY_ROWS)
def test_gpu_many_rows_seeds(with_weight, with_bias, seed, rows, hidden):
    check_backend("kernelgate_cuda", "cuda", torch.bfloat16, (rows,), hidden, with_weight=with_weight,
                  with_bias=with_bias, seed=seed)


@pytest.mark.gpu
def test_gpu_explain_key():
    assert "sm_" in kg.explain("layer_norm", torch.randn(2, 64, device="cuda")).key
