"""cross_entropy: what is special to it. test_contracts.py checks every backend against the float64
oracle on the generated cases (shapes, classes 1 and rows 0 included, layouts, regimes, dtypes,
each reduction, label smoothing with the mean, int64 targets with ignored rows), opcheck,
torch.compile, double backward and CUDA graphs. Here: the oracle is F.cross_entropy; label
smoothing with every reduction; -inf logits; every row ignored; int32 targets; ignored rows'
exact zero gradient; out-of-range targets (an error on the CPU, NaN on the GPU); class counts the
quick grid does not make; and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100
oracle_op = torch.ops.kernelgate._cross_entropy_reference


# Layouts: (leaf shape, view of the leaf that the op receives). Gradients are taken with respect
# to the leaf, so a layout bug in the backward shows up too.
def _layout(rows, classes, layout):
    if layout == "contiguous":
        return (rows, classes), lambda t: t
    if layout == "row_strided":  # a slice: row stride classes + 5
        return (rows, classes + 5), lambda t: t[:, :classes]
    if layout == "offset":  # misaligned start
        return (rows * classes + 1,), lambda t: t[1:].view(rows, classes)
    if layout == "transposed":  # column stride != 1
        return (classes, rows), lambda t: t.t()
    raise ValueError(layout)


def _logits(shape, regime, dtype, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        x = x * (3e3 if dtype == torch.float16 else 1e4)
    elif regime == "neginf":  # masked vocabulary entries; every row keeps finite ones
        mask = torch.rand(shape, generator=gen) < 0.3
        mask.view(-1)[:: max(1, shape[-1] // 2 + 1)] = False
        x = x.masked_fill(mask, float("-inf"))
    return x.to(dtype)


def _target(rows, classes, gen, ignore_frac, target_dtype):
    t = torch.randint(0, classes, (rows,), generator=gen)
    if rows:
        t[torch.rand(rows, generator=gen) < ignore_frac] = IGNORE
    return t.to(target_dtype)


def _run(backend, leaf, view, target, eps, red, dloss):
    x = leaf.detach().clone().requires_grad_(True)
    with kg.use(force={"cross_entropy": backend}):
        logits = view(x)
        assert kg.explain("cross_entropy", logits, target, reduction=red).backend == backend
        y = kg.cross_entropy(logits, target, IGNORE, eps, red)
        (g,) = torch.autograd.grad(y, [x], dloss)
    return y, g


def check(backend, device, dtype, rows, classes, red="mean", eps=0.0, layout="contiguous",
          regime="normal", ignore_frac=0.2, target_dtype=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    leaf_shape, view = _layout(rows, classes, layout)
    leaf = _logits(leaf_shape, regime, dtype, gen).to(device)
    target = _target(rows, classes, gen, ignore_frac, target_dtype).to(device)
    dshape = (rows,) if red == "none" else ()
    dloss = torch.randn(dshape, generator=gen, dtype=torch.float64).to(device, dtype)
    poison_cuda_allocator(leaf.device)
    got, got_g = _run(backend, leaf, view, target, eps, red, dloss)
    ref, ref_g = _run("reference", leaf, view, target, eps, red, dloss)
    x64 = leaf.detach().double().requires_grad_(True)
    oy = oracle_op(view(x64), target, IGNORE, eps, red)
    (og,) = torch.autograd.grad(oy, [x64], dloss.double())
    assert got.dtype == dtype and got.shape == dshape and got.device == leaf.device
    assert got_g.dtype == dtype and got_g.shape == leaf.shape
    check_against_oracle("loss", got, ref, oy, dtype)
    check_against_oracle("dlogits", got_g, ref_g, og, dtype)
    # The reference backend (its routed forward and backward) against an independent baseline:
    # the reference op at this dtype, differentiated by ATen's autograd.
    xd = leaf.detach().clone().requires_grad_(True)
    ay = oracle_op(view(xd), target, IGNORE, eps, red)
    (ag,) = torch.autograd.grad(ay, [xd], dloss)
    check_against_oracle("loss (reference backend)", ref, ay, oy, dtype)
    check_against_oracle("dlogits (reference backend)", ref_g, ag, og, dtype)
    return got, got_g


# ---- CPU (runs in CI) ------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_label_smoothing(eps, red, dtype):
    check("reference", "cpu", dtype, 9, 257, red=red, eps=eps)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_negative_infinity_logits(eps, dtype):
    # Masked vocabulary entries (the generated special rows hold NaN, +inf and zeros).
    check("reference", "cpu", dtype, 12, 300, red="none", eps=eps, regime="neginf")


@pytest.mark.parametrize("red", REDUCTIONS)
def test_cpu_all_rows_ignored(red):
    loss, g = check("reference", "cpu", torch.float32, 6, 10, red=red, ignore_frac=1.1)
    expected = {"mean": float("nan"), "sum": 0.0}.get(red)
    if red == "none":
        assert torch.equal(loss, torch.zeros(6))
    else:
        torch.testing.assert_close(loss, torch.tensor(expected), equal_nan=True)
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_target_dtypes(target_dtype, dtype):
    check("reference", "cpu", dtype, 11, 77, red="sum", eps=0.1, target_dtype=target_dtype)


@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("regime", ["normal", "neginf"])
def test_oracle_is_f_cross_entropy(red, eps, regime):
    """The contract is F.cross_entropy's: the oracle (float64 reference) and its gradient match it."""
    gen = torch.Generator().manual_seed(7)
    for rows, classes, frac in [(10, 17, 0.3), (4, 5, 1.1), (0, 5, 0.0), (3, 1, 0.0)]:
        x = _logits((rows, classes), regime, torch.float64, gen).requires_grad_(True)
        t = _target(rows, classes, gen, frac, torch.int64)
        if regime == "neginf" and eps == 1.0:
            continue  # 0 * -inf: NaN in both, but the NaN pattern of F's gradient differs
        y = oracle_op(x, t, IGNORE, eps, red)
        ye = F.cross_entropy(x, t, ignore_index=IGNORE, label_smoothing=eps, reduction=red)
        torch.testing.assert_close(y, ye, equal_nan=True)
        dy = torch.randn(ye.shape, generator=gen, dtype=torch.float64)
        if ye.isfinite().all() and rows:
            (g,) = torch.autograd.grad(y, [x], dy)
            (ge,) = torch.autograd.grad(ye, [x], dy)
            torch.testing.assert_close(g, ge)


def test_default_is_the_plain_code_and_reduction_is_a_variant():
    x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))
    e = kg.explain("cross_entropy", x, t)
    assert e.backend == "eager" and "no evidence" in e.reason and "plain PyTorch" in e.reason, str(e)
    with kg.use(exclude={"cross_entropy": "eager"}):
        assert kg.explain("cross_entropy", x, t).backend == "reference"
    assert "variant" not in e.key
    assert kg.explain("cross_entropy", x, t, reduction="sum").key.endswith("variant=1")
    assert kg.explain("cross_entropy", x, t, reduction="none").key.endswith("variant=2")
    assert {c.backend for c in e.candidates} >= {"reference", "kernelgate_cuda"}


def test_cpp_and_python_share_one_op():
    x, t = torch.randn(3, 9), torch.tensor([0, 8, -100])
    assert torch.equal(kg.cross_entropy(x, t), torch.ops.kernelgate.cross_entropy(x, t))


# ---- bad input: clear errors naming the argument ------------------------------------------------

@pytest.mark.parametrize(
    "logits,target,kwargs,match",
    [
        (torch.randn(4, 5), torch.zeros(3, dtype=torch.long), {},
         r"target.size\(-1\) must be 4 to match logits.size\(-2\) \(rows\), got 3"),
        (torch.randn(4, 5), torch.zeros(4), {}, "target must be an integer tensor of dtype int64 or int32, got float32"),
        (torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long), {},
         "logits must be a floating-point tensor of dtype float32, float16 or bfloat16, got float64"),
        (torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long), {}, "logits must have 2 dims, got 3"),
        (torch.randn(4, 5), torch.zeros(4, dtype=torch.long), {"label_smoothing": 1.5},
         r"label_smoothing must be in \[0, 1\], got 1.5"),
        (torch.randn(4, 5), torch.zeros(4, dtype=torch.long), {"label_smoothing": -0.1},
         r"label_smoothing must be in \[0, 1\], got -0.1"),
        (torch.randn(4, 5), torch.zeros(4, dtype=torch.long), {"label_smoothing": float("nan")},
         r"label_smoothing must be in \[0, 1\], got nan"),
        (torch.randn(4, 5), torch.zeros(4, dtype=torch.long), {"reduction": "avg"},
         "reduction must be 'mean', 'sum' or 'none', got 'avg'"),
        (torch.randn(4, 0), torch.zeros(4, dtype=torch.long), {},
         r"logits.size\(1\) \(classes\) must be at least 1, got 0"),
    ],
)
def test_bad_input_errors(logits, target, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        kg.cross_entropy(logits, target, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        kg.cross_entropy(logits.to("meta"), target.to("meta"), **kwargs)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
def test_out_of_range_target_is_an_error_on_cpu(target_dtype):
    x = torch.randn(4, 5, requires_grad=True)
    for bad, row in [([0, 1, 7, 2], 2), ([0, -1, 2, 3], 1), ([0, 1, 2, 5], 3)]:
        t = torch.tensor(bad, dtype=target_dtype)
        with pytest.raises(RuntimeError, match=rf"target\[{row}\] = {bad[row]} is out of range: expected "
                                               r"0 <= target < 5 \(classes\) or ignore_index \(-100\)"):
            kg.cross_entropy(x, t)
        with pytest.raises(RuntimeError, match="out of range"):
            oracle_op(x.double(), t)
    # ignore_index itself may be any value, in range or not
    t = torch.tensor([0, 3, 3, 1], dtype=target_dtype)
    torch.testing.assert_close(kg.cross_entropy(x, t, ignore_index=3), F.cross_entropy(x, t.long(), ignore_index=3))


def test_device_mismatch_error():
    with pytest.raises(RuntimeError, match="target must be on the same device as logits"):
        kg.cross_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long, device="meta"))


def test_meta_shapes():
    x = torch.empty(3, 7, device="meta", dtype=torch.bfloat16)
    t = torch.empty(3, device="meta", dtype=torch.long)
    assert kg.cross_entropy(x, t).shape == () and kg.cross_entropy(x, t).dtype == torch.bfloat16
    assert kg.cross_entropy(x, t, reduction="none").shape == (3,)
    loss, lse, n = torch.ops.kernelgate._cross_entropy_fwd(x, t, IGNORE, 0.0, "mean", 1)  # needs: logits
    assert lse.shape == (3,) and lse.dtype == torch.float32 and n.shape == ()


# ---- PyTorch integration ----------------------------------------------------------------------

def test_opcheck_int32_target():
    # The generated cases' targets are int64.
    x = torch.randn(6, 33, requires_grad=True)
    t = torch.tensor([0, 5, -100, 32, 1, 7], dtype=torch.int32)
    for args in [(x, t, -100, 0.1, "sum"), (x.detach(), t.clamp(min=0), 5, 0.0, "none")]:
        torch.library.opcheck(torch.ops.kernelgate.cross_entropy.default, args)


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

GPU_BACKENDS = ["reference", "kernelgate_cuda"]
# Vocabulary sizes the quick grid does not make (its class edges stop at 65536 for 256 rows).
GPU_SHAPES = [(64, 32000), (3, 32001), (16, 128256), (2, 151936), (130, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,classes", GPU_SHAPES)
def test_gpu_shapes(backend, red, dtype, rows, classes):
    check(backend, "cuda", dtype, rows, classes, red=red)


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [257, 4099])
def test_gpu_label_smoothing(eps, red, dtype, classes):
    check("kernelgate_cuda", "cuda", dtype, 9, classes, red=red, eps=eps)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row_strided", "offset", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [131, 4096, 4101])
@pytest.mark.parametrize("red", ["mean", "none"])
def test_gpu_noncontiguous(layout, dtype, classes, red):
    check("kernelgate_cuda", "cuda", dtype, 6, classes, red=red, layout=layout, eps=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["large", "neginf"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("classes", [300, 32003])
def test_gpu_value_regimes(regime, eps, dtype, classes):
    check("kernelgate_cuda", "cuda", dtype, 12, classes, red="none", eps=eps, regime=regime)


@pytest.mark.gpu
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
def test_gpu_all_ignored_and_target_dtypes(red, target_dtype):
    check("kernelgate_cuda", "cuda", torch.bfloat16, 6, 1000, red=red, ignore_frac=1.1, target_dtype=target_dtype)
    check("kernelgate_cuda", "cuda", torch.bfloat16, 37, 1000, red=red, eps=0.1, target_dtype=target_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gpu_many_rows(seed):
    check("kernelgate_cuda", "cuda", torch.bfloat16, 4099, 8192, red="mean", eps=0.1, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS + ["eager"])
def test_gpu_out_of_range_target_gives_nan(backend):
    """No sync on CUDA, so no error: the bad row's loss and gradient row are NaN, nothing else.
    The eager backend too (F.cross_entropy itself would assert on the device)."""
    x = torch.randn(4, 50, device="cuda", requires_grad=True)
    t = torch.tensor([1, 50, -3, 2], device="cuda")
    with kg.use(force={"cross_entropy": backend}):
        loss = kg.cross_entropy(x, t, reduction="none")
        (g,) = torch.autograd.grad(kg.cross_entropy(x, t, reduction="sum"), [x])
    assert loss[1:3].isnan().all() and loss[[0, 3]].isfinite().all()
    assert g[[0, 3]].isfinite().all()
    if backend == "kernelgate_cuda":
        assert g[1:3].isnan().all()


@pytest.mark.gpu
def test_gpu_device_mismatch():
    with pytest.raises(RuntimeError, match=r"target must be on the same device as logits \(cuda:0\), got cpu"):
        kg.cross_entropy(torch.randn(2, 8, device="cuda"), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ignored_rows_get_an_exact_zero_gradient_whatever_they_hold(red, dtype):
    # The loss does not depend on ignored rows: their gradient is 0 even where they hold NaN or
    # Inf (F.cross_entropy's is NaN there: 0 * NaN), in the backend and in the float64 oracle.
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    x[3, 4] = -float("inf")
    t = torch.tensor([3, IGNORE, IGNORE, IGNORE, 1])
    # Every backend but the eager one (the plain code answers as F.cross_entropy does: below).
    with kg.use(exclude={"cross_entropy": "eager"}):
        for f, leaf in ((kg.cross_entropy, x.clone()), (oracle_op, x.double())):
            leaf.requires_grad_(True)
            loss = f(leaf, t, IGNORE, 0.0, red)
            assert loss.isfinite().all(), loss
            (g,) = torch.autograd.grad(loss.sum(), [leaf])
            assert torch.equal(g[1:4], torch.zeros_like(g[1:4])), g
            assert g[[0, 4]].isfinite().all() and g[[0, 4]].abs().sum() > 0
    # Without evidence the eager backend serves: the program's own F.cross_entropy answer.
    leaf = x.clone().requires_grad_(True)
    assert kg.explain("cross_entropy", leaf, t).backend == "eager"
    (g,) = torch.autograd.grad(kg.cross_entropy(leaf, t, IGNORE, 0.0, red).sum(), [leaf])
    ref = x.clone().float().requires_grad_(True)
    (e,) = torch.autograd.grad(F.cross_entropy(ref, t, ignore_index=IGNORE, reduction=red).sum(), [ref])
    assert torch.equal(g.isnan(), e.isnan()) and g[1].isnan().any(), (g, e)
