"""add_rms_norm: what is special to it. test_contracts.py checks every backend against the float64
oracle on the generated cases (shapes, layouts of x, regimes, dtypes, eps, no weight), opcheck,
torch.compile, the refused double backward and CUDA graphs. Here: the reference is the eager
pattern and h is the eager sum exactly, non-contiguous residuals (the generated layouts are x's),
eps = 0, one output unused, the GPU kernels on widths and row counts the quick grid does not make,
and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator
from norm_inputs import layouts, values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_BACKENDS = ["reference"]
CUDA_BACKENDS = ["reference", "kernelgate_cuda"]

oracle_op = torch.ops.kernelgate._add_rms_norm_reference


def _run(backend, leaves, views, eps, cots):
    """(y, h) and the gradients of (x, residual[, weight]) through kg.add_rms_norm with `backend`
    forced (and checked to serve the call)."""
    ls = [None if t is None else t.detach().clone().requires_grad_(True) for t in leaves]
    with kg.use(force={"add_rms_norm": backend}):
        x, r = views[0](ls[0]), views[1](ls[1])
        assert kg.explain("add_rms_norm", x, r, ls[2]).backend == backend
        y, h = kg.add_rms_norm(x, r, ls[2], eps=eps)
        grads = torch.autograd.grad((y, h), [t for t in ls if t is not None], cots)
    return (y, h), grads, (x, r)


def _oracle(leaves, views, eps, cots):
    ls = [None if t is None else t.detach().double().requires_grad_(True) for t in leaves]
    y, h = oracle_op(views[0](ls[0]), views[1](ls[1]), ls[2], eps)
    grads = torch.autograd.grad((y, h), [t for t in ls if t is not None], [c.double() for c in cots])
    return (y, h), grads


def check_backend(backend, device, dtype, rows_shape, hidden, x_layout="contiguous", r_layout="contiguous",
                  regime="normal", with_weight=True, eps=1e-6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_shape, x_view = layouts(rows_shape, hidden)[x_layout]
    r_shape, r_view = layouts(rows_shape, hidden)[r_layout]
    x_leaf = values(x_shape, regime, dtype, device, gen)
    r_leaf = values(r_shape, regime, dtype, device, gen)
    w = values((hidden,), "normal", dtype, device, gen) if with_weight else None
    out_shape = (*rows_shape, hidden)
    cots = (values(out_shape, "normal", dtype, device, gen), values(out_shape, "normal", dtype, device, gen))
    leaves, views = (x_leaf, r_leaf, w), (x_view, r_view)
    poison_cuda_allocator(x_leaf.device)
    (y, h), got_g, (x, r) = _run(backend, leaves, views, eps, cots)
    (ry, rh), ref_g, _ = _run("reference", leaves, views, eps, cots)
    (oy, oh), ora_g = _oracle(leaves, views, eps, cots)
    for t in (y, h):
        assert t.dtype == dtype and t.shape == out_shape and t.device == x_leaf.device
    # h is x + residual rounded to the dtype, exactly as the eager sum.
    assert torch.equal(h, x.detach() + r.detach())
    check_against_oracle("y", y, ry, oy, dtype)
    check_against_oracle("h", h, rh, oh, dtype)
    for name, g, rg, og in zip(["dx", "dresidual", "dweight"], got_g, ref_g, ora_g):
        assert g.dtype == dtype
        check_against_oracle(name, g, rg, og, dtype)


# ---- the reference is the eager pattern --------------------------------------------------------

@pytest.mark.parametrize("with_weight", [True, False])
def test_oracle_is_eager_add_then_rms_norm(with_weight):
    gen = torch.Generator().manual_seed(3)
    x, r = (torch.randn(4, 3, 37, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(37, generator=gen, dtype=torch.float64, requires_grad=True) if with_weight else None
    dy, dh = torch.randn(4, 3, 37, dtype=torch.float64), torch.randn(4, 3, 37, dtype=torch.float64)
    y, h = oracle_op(x, r, w, 1e-5)
    he = x + r
    ye = F.rms_norm(he, (37,), w, 1e-5)
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(h, he)
    inputs = [x, r] + ([w] if with_weight else [])
    for a, b in zip(torch.autograd.grad((y, h), inputs, (dy, dh)), torch.autograd.grad((ye, he), inputs, (dy, dh))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_rounds_h_then_normalises_it(dtype):
    x, r, w = torch.randn(5, 40, dtype=dtype), torch.randn(5, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    y, h = kg.add_rms_norm(x, r, w)
    assert torch.equal(h, x + r)
    hf = h.float()
    ye = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    torch.testing.assert_close(y, ye, atol=0, rtol=0)


# ---- CPU (runs in CI) ------------------------------------------------------------------------

# (x, residual) layouts; the generated cases lay out x alone.
LAYOUT_PAIRS = [("transposed", "contiguous"), ("contiguous", "row_strided"), ("offset", "offset"),
                ("expanded", "transposed"), ("row_strided", "expanded")]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("x_layout,r_layout", LAYOUT_PAIRS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_noncontiguous(backend, x_layout, r_layout, dtype):
    check_backend(backend, "cpu", dtype, (6,), 130, x_layout=x_layout, r_layout=r_layout)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_eps_zero(backend):
    check_backend(backend, "cpu", torch.float32, (4,), 65, with_weight=False, eps=0.0, regime="small")


def _one_output_check(backend, device):
    """Cotangent on one output only: the other output's gradient is absent, not zero-filled."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 96, generator=gen).to(device).requires_grad_(True)
    r = torch.randn(6, 96, generator=gen).to(device).requires_grad_(True)
    w = torch.randn(96, generator=gen).to(device).requires_grad_(True)
    d = torch.randn(6, 96, generator=gen).to(device)
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    oy, oh = oracle_op(x64, r64, w64, 1e-6)
    with kg.use(force={"add_rms_norm": backend}):
        y, h = kg.add_rms_norm(x, r, w)
        gx, gr, gw = torch.autograd.grad(y, [x, r, w], d)
        ox, orr, ow = torch.autograd.grad(oy, [x64, r64, w64], d.double())
        ref = torch.ops.kernelgate._add_rms_norm_reference(x, r, w)[0]
        rx, rr, rw = torch.autograd.grad(ref, [x, r, w], d)
        for name, g, rg, og in [("dx", gx, rx, ox), ("dresidual", gr, rr, orr), ("dweight", gw, rw, ow)]:
            check_against_oracle(name, g, rg, og, torch.float32)
        y, h = kg.add_rms_norm(x, r, w)
        gx, gr, gw = torch.autograd.grad(h, [x, r, w], d)
    torch.testing.assert_close(gx, d, atol=0, rtol=0)  # h's cotangent passes straight through
    torch.testing.assert_close(gr, d, atol=0, rtol=0)
    assert torch.count_nonzero(gw) == 0


def test_cpu_one_output_used():
    _one_output_check("reference", "cpu")


def test_default_is_the_plain_pytorch_code_and_explain_lists_backends():
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    e = kg.explain("add_rms_norm", x, r, w)  # no evidence: the op as plain PyTorch code
    assert e.backend == "eager" and "no evidence" in e.reason
    assert {c.backend for c in e.candidates} >= {"reference", "eager", "kernelgate_cuda"}
    assert "add_rms_norm cpu float32,float32,float32 rows<=2^2 hidden<=2^6" in e.key


# ---- bad input: clear errors naming the argument ------------------------------------------------

@pytest.mark.parametrize(
    "x,r,w,eps,match",
    [
        (torch.randn(2, 8), torch.randn(2, 9), None, 1e-6, r"residual.size\(-1\) must be 8 to match x.size\(-1\) \(hidden\), got 9"),
        (torch.randn(2, 3, 8), torch.randn(3, 2, 8), None, 1e-6, r"residual must have the shape of x \(\[2, 3, 8\]\), got \[3, 2, 8\]"),
        (torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16), None, 1e-6, r"residual must have the dtype of x \(float32\), got bfloat16"),
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(7), 1e-6, r"weight.size\(-1\) must be 8 to match x.size\(-1\) \(hidden\), got 7"),
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64), None, 1e-6, "x must be a floating-point tensor of dtype float32, float16 or bfloat16, got float64"),
        (torch.randn(2, 0), torch.randn(2, 0), None, 1e-6, r"x.size\(-1\) \(hidden\) must be at least 1, got 0"),
        (torch.randn(2, 8), torch.randn(2, 8), None, -1.0, "eps must be a finite number >= 0, got -1"),
    ],
)
def test_bad_input_errors(x, r, w, eps, match):
    with pytest.raises(RuntimeError, match=match):
        kg.add_rms_norm(x, r, w, eps=eps)
    with pytest.raises(RuntimeError, match=match):
        kg.add_rms_norm(x.to("meta"), r.to("meta"), None if w is None else w.to("meta"), eps=eps)


def test_meta_shapes():
    x = torch.empty(3, 5, 7, device="meta", dtype=torch.bfloat16)
    y, h = kg.add_rms_norm(x, x, torch.empty(7, device="meta", dtype=torch.bfloat16))
    for t in (y, h):
        assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.device.type == "meta"


# ---- PyTorch integration ----------------------------------------------------------------------

def test_cpp_and_python_share_one_op():
    x, r = torch.randn(3, 9), torch.randn(3, 9)
    a, b = kg.add_rms_norm(x, r)
    c, d = torch.ops.kernelgate.add_rms_norm(x, r)
    assert torch.equal(a, c) and torch.equal(b, d)


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

# Widths and row counts the quick grid does not make (its hidden edges are 1, 2, 33, 127-129,
# 4095-4097, 65535 and 65536 at 256 rows), and multi-dim rows at a vectorised width.
GPU_SHAPES = [((64,), 2048), ((16,), 8192), ((3,), 12288), ((5,), 16384), ((2,), 32768), ((2,), 32768 + 8),
              ((2,), 1 << 17), ((2, 5), 4097)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows_shape,hidden", GPU_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_gpu_shapes(backend, dtype, rows_shape, hidden, with_weight):
    check_backend(backend, "cuda", dtype, rows_shape, hidden, with_weight=with_weight)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("x_layout,r_layout", LAYOUT_PAIRS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [130, 4096])
def test_gpu_noncontiguous(backend, x_layout, r_layout, dtype, hidden):
    check_backend(backend, "cuda", dtype, (6,), hidden, x_layout=x_layout, r_layout=r_layout)


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["large", "small", "offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_value_regimes_production_width(regime, dtype):
    check_backend("kernelgate_cuda", "cuda", dtype, (9,), 4096, regime=regime)


# (rows, hidden) whose bf16 backward takes each kernel: rows in registers with several rows per
# block, one row per block, sums in shared memory, general scalar, general vectorised; enough rows
# that the dweight reduction spans many blocks.
MANY_ROWS = [(4099, 1024), (4099, 4096), (1500, 12288), (4099, 4001), (600, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("rows,hidden", MANY_ROWS)
def test_gpu_many_rows_seeds(with_weight, seed, rows, hidden):
    check_backend("kernelgate_cuda", "cuda", torch.bfloat16, (rows,), hidden, with_weight=with_weight, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_gpu_one_output_used(backend):
    _one_output_check(backend, "cuda")


@pytest.mark.gpu
def test_gpu_explain_key():
    x = torch.randn(2, 64, device="cuda")
    assert "sm_" in kg.explain("add_rms_norm", x, x).key
