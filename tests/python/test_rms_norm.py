"""rms_norm: what is special to it. test_contracts.py checks every backend against the float64
oracle on the generated cases (shapes, layouts, regimes, dtypes, eps, no weight), opcheck,
torch.compile, double backward and CUDA graphs. Here: eps = 0 (not a contract test value), the CPU
kernel on long rows the CPU grid does not reach, the GPU kernels on hidden sizes and row counts
the quick grid does not make, the dispatcher's decisions, logging and overrides, and clear errors
for bad input."""

import pytest
import torch

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator
from norm_inputs import layouts, values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_BACKENDS = ["reference", "kernelgate_cpu"]  # aten: forward only on the CPU (test_contracts)
CUDA_BACKENDS = ["reference", "aten", "kernelgate_cuda"]

oracle_op = torch.ops.kernelgate._rms_norm_reference


def _run(backend, x_leaf, view, w, eps, dy):
    """Forward and gradients through kg.rms_norm with `backend` forced (and checked to serve)."""
    xl = x_leaf.detach().clone().requires_grad_(True)
    wl = None if w is None else w.detach().clone().requires_grad_(True)
    with kg.use(force={"rms_norm": backend}):
        x = view(xl)
        assert kg.explain("rms_norm", x, wl).backend == backend
        y = kg.rms_norm(x, wl, eps=eps)
        inputs = [xl] if wl is None else [xl, wl]
        grads = torch.autograd.grad(y, inputs, dy)
    return y, grads


def _oracle(x_leaf, view, w, eps, dy):
    xl = x_leaf.detach().double().requires_grad_(True)
    wl = None if w is None else w.detach().double().requires_grad_(True)
    y = oracle_op(view(xl), wl, eps)
    inputs = [xl] if wl is None else [xl, wl]
    grads = torch.autograd.grad(y, inputs, dy.double())
    return y, grads


def check_backend(backend, device, dtype, rows_shape, hidden, layout="contiguous", regime="normal",
                  with_weight=True, eps=1e-6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    leaf_shape, view = layouts(rows_shape, hidden)[layout]
    x_leaf = values(leaf_shape, regime, dtype, device, gen)
    w = values((hidden,), "normal", dtype, device, gen) if with_weight else None
    y_shape = view(x_leaf).shape
    dy = values(y_shape, "normal", dtype, device, gen)
    poison_cuda_allocator(x_leaf.device)
    got, got_g = _run(backend, x_leaf, view, w, eps, dy)
    ref, ref_g = _run("reference", x_leaf, view, w, eps, dy)
    ora, ora_g = _oracle(x_leaf, view, w, eps, dy)
    assert got.dtype == dtype and got.shape == y_shape and got.device == x_leaf.device
    check_against_oracle("y", got, ref, ora, dtype)
    for name, g, r, o in zip(["dx", "dweight"], got_g, ref_g, ora_g):
        assert g.dtype == dtype
        check_against_oracle(name, g, r, o, dtype)


# ---- CPU (runs in CI) ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows_shape,hidden", [((17,), 4096), ((5,), 1000), ((2, 5), 4097)])
def test_cpu_kernel_long_rows(dtype, rows_shape, hidden):
    # The CPU grid stops at 2^14 elements: rows of 1000 to 4097 elements, with vector tails.
    check_backend("kernelgate_cpu", "cpu", dtype, rows_shape, hidden)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_eps_zero(backend):
    check_backend(backend, "cpu", torch.float32, (4,), 65, with_weight=False, eps=0.0, regime="small")


def test_default_is_the_plain_pytorch_kernel_and_policy_routes():
    x, w = torch.randn(4, 64), torch.randn(64)
    e = kg.explain("rms_norm", x, w)  # no evidence: ATen's kernel, what F.rms_norm runs, serves
    assert e.backend == "aten" and "no evidence" in e.reason and "plain PyTorch" in e.reason
    # ATen has no CPU backward for it: with gradients on the CPU the reference serves.
    assert kg.explain("rms_norm", x.requires_grad_(), w).backend == "reference"
    x = x.detach()
    kg.policy.add_rule("rms_norm", ["kernelgate_cpu"], arch=-1, evidence="test rule")
    e = kg.explain("rms_norm", x, w)
    assert e.backend == "kernelgate_cpu" and "test rule" in e.reason
    torch.testing.assert_close(kg.rms_norm(x, w), torch.ops.kernelgate._rms_norm_reference(x, w))


def test_explain_reports_every_backend():
    e = kg.explain("rms_norm", torch.randn(2, 8), weight=None, eps=1e-5)
    # (Plugins loaded by other tests may add more.)
    assert {c.backend for c in e.candidates} >= {"reference", "aten", "kernelgate_cpu", "kernelgate_cuda"}
    assert sum(c.selected for c in e.candidates) == 1
    assert all(c.reason for c in e.candidates)
    assert "rms_norm cpu float32,none rows<=2^1 hidden<=2^3" in e.key
    assert "kernelgate_cuda" in str(e)


def test_use_restores_and_validates():
    x = torch.randn(3, 8)
    with kg.use(force="kernelgate_cpu"):
        assert kg.explain("rms_norm", x).backend == "kernelgate_cpu"
        with kg.use(force={"rms_norm": "aten"}):
            assert kg.explain("rms_norm", x).backend == "aten"
        assert kg.explain("rms_norm", x).backend == "kernelgate_cpu"
    assert kg.explain("rms_norm", x).backend == "aten"  # the fallback again
    with kg.use(exclude=["aten"]):
        assert kg.explain("rms_norm", x).backend == "reference"
    kg.policy.add_rule("rms_norm", ["kernelgate_cpu", "aten"])
    with kg.use(exclude=["kernelgate_cpu"]):
        assert kg.explain("rms_norm", x).backend == "aten"
    with pytest.raises(ValueError, match="no backend 'nope'"):
        with kg.use(force={"rms_norm": "nope"}):
            pass
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        with kg.use(force={"nope": "aten"}):
            pass
    with pytest.raises(ValueError, match="reference cannot be excluded"):
        with kg.use(exclude="reference"):
            pass


def test_fallback_reason_logged_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="kernelgate"):
        for n in range(1, 200):
            kg.rms_norm(torch.randn(n % 13 + 1, n % 31 + 1))
    hits = [r for r in caplog.records if "no evidence for this region" in r.getMessage()]
    assert len(hits) == 1
    assert hits[0].name == "kernelgate"


def test_forced_backend_that_cannot_serve_warns(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="kernelgate"), kg.use(force="kernelgate_cuda"):
        y = kg.rms_norm(torch.randn(2, 8))
    assert y.shape == (2, 8)
    assert any(r.levelno == logging.WARNING and "kernelgate_cuda" in r.getMessage() for r in caplog.records)


# ---- bad input: clear errors naming the argument ------------------------------------------------

@pytest.mark.parametrize(
    "x,w,eps,match",
    [
        (torch.randn(2, 4096), torch.randn(4095), 1e-6, r"weight.size\(-1\) must be 4096 to match x.size\(-1\) \(hidden\), got 4095"),
        (torch.randn(2, 8), torch.randn(2, 8), 1e-6, "weight must have 1 dim, got 2"),
        (torch.randn(2, 8, dtype=torch.float64), None, 1e-6, "x must be a floating-point tensor of dtype float32, float16 or bfloat16, got float64"),
        (torch.ones(2, 8, dtype=torch.int64), None, 1e-6, "got int64"),
        (torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6, r"weight must have the dtype of x \(float32\), got bfloat16"),
        (torch.randn(2, 0), None, 1e-6, r"x.size\(-1\) \(hidden\) must be at least 1, got 0"),
        (torch.randn(()), None, 1e-6, "x must have at least 1 dim, got 0"),
        (torch.randn(2, 8), None, -1.0, "eps must be a finite number >= 0, got -1"),
        (torch.randn(2, 8), None, float("nan"), "eps must be a finite number >= 0, got nan"),
    ],
)
def test_bad_input_errors(x, w, eps, match):
    with pytest.raises(RuntimeError, match=match):
        kg.rms_norm(x, w, eps=eps)
    with pytest.raises(RuntimeError, match=match):
        kg.rms_norm(x.to("meta"), None if w is None else w.to("meta"), eps=eps)


def test_device_mismatch_error():
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        kg.rms_norm(torch.randn(2, 8), torch.randn(8, device="meta"))


def test_meta_shapes():
    y = kg.rms_norm(torch.empty(3, 5, 7, device="meta", dtype=torch.bfloat16), torch.empty(7, device="meta", dtype=torch.bfloat16))
    assert y.shape == (3, 5, 7) and y.dtype == torch.bfloat16 and y.device.type == "meta"


# ---- PyTorch integration ----------------------------------------------------------------------

def test_cpp_and_python_share_one_op():
    x = torch.randn(3, 9)
    assert torch.equal(kg.rms_norm(x), torch.ops.kernelgate.rms_norm(x))


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

# Hidden sizes and row counts the quick grid does not make (its hidden edges are 1, 2, 33, 127-129,
# 4095-4097, 65535 and 65536 at 256 rows): production widths, past 2^16, and many rows.
GPU_SHAPES = [((64,), 2048), ((16,), 8192), ((3,), 12288), ((2,), 65536 + 8), ((4,), 1 << 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows_shape,hidden", GPU_SHAPES)
def test_gpu_shapes(backend, dtype, rows_shape, hidden):
    check_backend(backend, "cuda", dtype, rows_shape, hidden)


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
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gpu_many_rows_seeds(with_weight, seed):
    # Enough rows that the backward's dweight reduction spans many blocks.
    check_backend("kernelgate_cuda", "cuda", torch.bfloat16, (4099,), 4096, with_weight=with_weight, seed=seed)


@pytest.mark.gpu
def test_gpu_explain_key():
    assert "sm_" in kg.explain("rms_norm", torch.randn(2, 64, device="cuda")).key


@pytest.mark.gpu
def test_gpu_device_mismatch():
    with pytest.raises(RuntimeError, match=r"weight must be on the same device as x \(cuda:0\), got cpu"):
        kg.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8))
