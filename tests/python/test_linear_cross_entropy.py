"""linear_cross_entropy: what is special to it. test_contracts.py checks every backend against the
float64 oracle on the generated cases (shapes, strided hidden, regimes, dtypes, each reduction,
label smoothing with the mean, no bias), opcheck, torch.compile, the refused double backward and
CUDA graphs, all with the automatic chunk size. Here: forced chunk counts (1 row to all rows, on
odd shapes too), label smoothing with every reduction, ignored rows, int32 targets, a strided
weight, partial gradient masks, the precision of the chunked grad_weight accumulation, float16
subnormal gradients, the inference path, the recomputing backward, the cotangent's scaling, vocab
sizes the quick grid does not make, and clear errors for bad input."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.testing import check_against_oracle, oracle_metrics, poison_cuda_allocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100
# The internal ops' gradient mask: a bit per tensor argument (hidden, weight, target, bias).
NEEDS_HIDDEN, NEEDS_WEIGHT, NEEDS_BIAS = 1, 2, 8
NEEDS_ALL = NEEDS_HIDDEN | NEEDS_WEIGHT | NEEDS_BIAS
OP = "linear_cross_entropy"
oracle_op = torch.ops.kernelgate._linear_cross_entropy_reference
set_chunk_rows = torch.ops.kernelgate._linear_cross_entropy_set_chunk_rows


@contextlib.contextmanager
def chunk_rows(n):
    """Rows per chunk of the chunked backends (0: automatic)."""
    prev = set_chunk_rows(n)
    try:
        yield
    finally:
        set_chunk_rows(prev)


def _inputs(rows, hidden, classes, dtype, device, gen, regime, ignore_frac, target_dtype):
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(classes, hidden, generator=gen, dtype=torch.float64) * (2.0 / math.sqrt(max(hidden, 1)))
    b = torch.randn(classes, generator=gen, dtype=torch.float64)
    if regime == "large":  # logits spread ~1e3
        h = h * (300.0 if dtype == torch.float16 else 1000.0)
    t = torch.randint(0, classes, (rows,), generator=gen)
    if rows:
        t[torch.rand(rows, generator=gen) < ignore_frac] = IGNORE
    return [v.to(device, dtype) for v in (h, w, b)], t.to(device=device, dtype=target_dtype)


def _layouts(layout):
    """Views (hidden, weight) the op receives of leaves of the same shape."""
    if layout == "contiguous":
        return lambda t: t, lambda t: t
    # hidden through a transpose (column stride != 1), weight as a slice (row stride != hidden)
    return (lambda t: t.t().contiguous().t(),
            lambda t: torch.cat([t, t[:, :3]], dim=1)[:, : t.shape[1]])


def _grads(y, leaves, need, dloss):
    wanted = [l for l, n in zip(leaves, need) if n]
    got = iter(torch.autograd.grad(y, wanted, dloss)) if wanted else iter(())
    return [next(got) if n else None for n in need]


def _call(leaves, with_bias, target, eps, red, views):
    h, w, b = leaves
    return kg.linear_cross_entropy(views[0](h), views[1](w), target, b if with_bias else None, IGNORE, eps, red)


def _run(backend, base, with_bias, target, eps, red, dloss, need, views):
    leaves = [x.detach().clone().requires_grad_(n) for x, n in zip(base, need)]
    with kg.use(force={OP: backend}):
        h, w, b = leaves
        assert kg.explain(OP, views[0](h), views[1](w), target, b if with_bias else None, reduction=red).backend == backend
        y = _call(leaves, with_bias, target, eps, red, views)
        return y, _grads(y, leaves, need, dloss)


def check(backend, device, dtype, rows, hidden, classes, red="mean", eps=0.0, with_bias=True,
          chunk=0, need=(True, True, True), regime="normal", ignore_frac=0.2,
          target_dtype=torch.int64, layout="contiguous", seed=0, dloss_value=None):
    gen = torch.Generator().manual_seed(seed)
    base, target = _inputs(rows, hidden, classes, dtype, device, gen, regime, ignore_frac, target_dtype)
    need = (need[0], need[1], need[2] and with_bias)
    views = _layouts(layout)
    dshape = (rows,) if red == "none" else ()
    # The loss is float32 whatever the input dtype, and so is its cotangent.
    dloss = torch.randn(dshape, generator=gen, dtype=torch.float64).to(device, torch.float32)
    if dloss_value is not None:  # a given cotangent (loss.backward() gives exactly 1)
        dloss = torch.full(dshape, dloss_value, device=device, dtype=torch.float32)
    poison_cuda_allocator(base[0].device)
    with chunk_rows(chunk):
        got, got_g = _run(backend, base, with_bias, target, eps, red, dloss, need, views)
    ref, ref_g = _run("reference", base, with_bias, target, eps, red, dloss, need, views)
    l64 = [x.detach().double().requires_grad_(n) for x, n in zip(base, need)]
    oy = oracle_op(views[0](l64[0]), views[1](l64[1]), target, l64[2] if with_bias else None, IGNORE, eps, red)
    og = _grads(oy, l64, need, dloss.double())
    # Independent baseline for the reference backend: the reference op at this dtype, through
    # ATen's autograd (materialised logits in the input dtype, like eager PyTorch).
    ld = [x.detach().clone().requires_grad_(n) for x, n in zip(base, need)]
    ay = oracle_op(views[0](ld[0]), views[1](ld[1]), target, ld[2] if with_bias else None, IGNORE, eps, red)
    ag = _grads(ay, ld, need, dloss)
    assert got.dtype == torch.float32 and got.shape == dshape and got.device == base[0].device
    metrics = {"loss": check_against_oracle("loss", got, ref, oy, dtype)}
    check_against_oracle("loss (reference backend)", ref, ay, oy, dtype)
    for name, g, r, o, a, x in zip(["grad_hidden", "grad_weight", "grad_bias"], got_g, ref_g, og, ag, base):
        if o is None:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == x.shape
        metrics[name] = check_against_oracle(name, g, r, o, dtype)
        check_against_oracle(name + " (reference backend)", r, a, o, dtype)
    return metrics


# ---- CPU (runs in CI) ------------------------------------------------------------------------

CPU_BACKENDS = ["reference", "kernelgate_cpu"]
SHAPES = [(1, 1, 1), (0, 4, 3), (5, 7, 3), (17, 16, 1001), (33, 8, 50), (64, 32, 130)]


@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("rows,hidden,classes", SHAPES)
def test_cpu_odd_shapes_in_chunks_of_4(red, rows, hidden, classes):
    # The generated cases take the automatic chunk size: one chunk at their sizes.
    check("kernelgate_cpu", "cpu", torch.float32, rows, hidden, classes, red=red, chunk=4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_cpu_float16_subnormal_grad_weight(backend, red):
    # A mean over many rows and classes puts float16 grad_weight in the subnormal range: rounded
    # there before the cotangent was applied, then again after, it was 2.7 times less accurate
    # than eager ATen (max error / rms 5.8e-2 vs 2.1e-2), found by the H200 GPU tests.
    check(backend, "cpu", torch.float16, 300, 128, 32003, red=red, chunk=128)


@pytest.mark.parametrize("chunk", [0, 1, 3, 16, 64, 1000])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("red", REDUCTIONS)
def test_cpu_chunk_counts(chunk, with_bias, red):
    check("kernelgate_cpu", "cpu", torch.float32, 64, 24, 130, red=red, eps=0.1, with_bias=with_bias, chunk=chunk)


@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_label_smoothing(eps, red, dtype):
    check("kernelgate_cpu", "cpu", dtype, 21, 16, 257, red=red, eps=eps, chunk=5)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True), (True, True, False)])
@pytest.mark.parametrize("red", REDUCTIONS)
def test_cpu_partial_gradients(need, red):
    check("kernelgate_cpu", "cpu", torch.float32, 19, 12, 77, red=red, chunk=6, need=need)


@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_all_rows_ignored(red, dtype):
    check("kernelgate_cpu", "cpu", dtype, 10, 8, 33, red=red, chunk=3, ignore_frac=1.1)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_targets_and_layouts(target_dtype, layout, dtype):
    check("kernelgate_cpu", "cpu", dtype, 23, 20, 101, red="mean", eps=0.1, chunk=7,
          target_dtype=target_dtype, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_large_logits(dtype):
    check("kernelgate_cpu", "cpu", dtype, 16, 32, 300, red="none", chunk=5, regime="large")
    check("kernelgate_cpu", "cpu", dtype, 16, 32, 300, red="sum", eps=0.1, chunk=5, regime="large")


def _zipf_case(rows, hidden, classes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    (h, w, b), _ = _inputs(rows, hidden, classes, dtype, device, gen, "normal", 0.0, torch.int64)
    p = 1.0 / torch.arange(1, classes + 1, dtype=torch.float64)  # LM-like target frequencies
    t = torch.multinomial(p / p.sum(), rows, replacement=True, generator=gen).to(device)
    return h, w, t


def grad_weight_errors(backend, dtype, device, rows, hidden, classes, chunks):
    """The oracle rule's verdict and metrics (kernelgate.testing.oracle_metrics) of backend's
    grad_weight, whose budget is the materialised reference's error, and the three tensors."""
    h, w, t = _zipf_case(rows, hidden, classes, dtype, device)

    def gw(fn, hh, ww):
        ww = ww.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(hh, ww), [ww])
        return g

    with kg.use(force={OP: backend}), chunk_rows(rows // chunks):
        got = gw(lambda a, b: kg.linear_cross_entropy(a, b, t), h, w)
    with kg.use(force={OP: "reference"}):
        ref = gw(lambda a, b: kg.linear_cross_entropy(a, b, t), h, w)
    ora = gw(lambda a, b: oracle_op(a, b, t), h.double(), w.double())
    return oracle_metrics(f"grad_weight ({backend})", got, ref, ora, dtype), (got, ref, ora)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunks", [8, 32])
def test_cpu_grad_weight_precision_of_chunk_accumulation(dtype, chunks):
    """float32 accumulation (kernelgate_cpu) meets the oracle rule; accumulation in the input
    dtype (kernelgate_cpu_narrow_accum) rounds once per chunk: its error is measured, printed
    (pytest -s) and bounded by a random walk of `chunks` roundings, and with LM-like (Zipf)
    targets it exceeds the oracle rule, which is why it is not the default."""
    rows, hidden, classes = 2048, 64, 1024
    wide, _ = grad_weight_errors("kernelgate_cpu", dtype, "cpu", rows, hidden, classes, chunks)
    assert not wide["failure"], wide["failure"]
    narrow, _ = grad_weight_errors("kernelgate_cpu_narrow_accum", dtype, "cpu", rows, hidden, classes, chunks)
    l2, mx, rl2, rmx = wide["rel_l2"], wide["max_over_rms"], wide["ref_rel_l2"], wide["ref_max_over_rms"]
    nl2, nmx = narrow["rel_l2"], narrow["max_over_rms"]
    print(f"\n{dtype}, {chunks} chunks, grad_weight error vs oracle (rel_l2 / max_over_rms): "
          f"materialised {rl2:.2e} / {rmx:.2e}; float32 accumulation {l2:.2e} / {mx:.2e}; "
          f"{dtype} accumulation {nl2:.2e} / {nmx:.2e}")
    assert nl2 <= 2 * math.sqrt(chunks) * rl2 and nmx <= 2 * math.sqrt(chunks) * rmx
    assert nl2 > l2  # the measurement resolves the difference
    if dtype == torch.bfloat16:
        assert narrow["failure"], narrow  # outside the oracle rule: not a default backend


@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_narrow_accum_other_outputs(red, dtype):
    """The narrow variant differs only in grad_weight's accumulation; one chunk is exact."""
    check("kernelgate_cpu_narrow_accum", "cpu", dtype, 40, 16, 130, red=red, eps=0.1, chunk=40)
    check("kernelgate_cpu_narrow_accum", "cpu", dtype, 40, 16, 130, red=red, eps=0.1, chunk=7,
          need=(True, False, True))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("red", REDUCTIONS)
def test_cpu_inference_matches_training_loss(backend, red):
    gen = torch.Generator().manual_seed(3)
    (h, w, b), t = _inputs(40, 16, 90, torch.float32, "cpu", gen, "normal", 0.2, torch.int64)
    with kg.use(force={OP: backend}), chunk_rows(7):
        with torch.no_grad():
            y0 = kg.linear_cross_entropy(h, w, t, b, reduction=red)
        y1 = kg.linear_cross_entropy(h.requires_grad_(), w, t, b, reduction=red)
    assert y1.requires_grad and not y0.requires_grad
    torch.testing.assert_close(y0, y1.detach())
    torch.testing.assert_close(y0, F.cross_entropy(h @ w.T + b, t, reduction=red), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_cpu_recomputing_backward_matches_precomputed(backend, red):
    """_linear_cross_entropy_bwd (the path of reduction "none") also serves mean and sum."""
    gen = torch.Generator().manual_seed(4)
    (h, w, b), t = _inputs(30, 12, 70, torch.float32, "cpu", gen, "normal", 0.2, torch.int64)
    dloss = torch.tensor(0.7)
    with kg.use(force={OP: backend}), chunk_rows(8):
        loss, lse, gh, gw, gb = torch.ops.kernelgate._linear_cross_entropy_fwd(h, w, t, b, IGNORE, 0.1, red, NEEDS_ALL)
        rh, rw, rb = torch.ops.kernelgate._linear_cross_entropy_bwd(dloss, h, w, t, b, lse, IGNORE, 0.1, red, NEEDS_ALL)
    for p, r in [(gh, rh), (gw, rw), (gb, rb)]:
        torch.testing.assert_close(p * dloss, r)


@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("backend", ["reference", "kernelgate_cpu"])
def test_second_backward_through_same_graph_is_refused(red, backend):
    # kernelgate's backends compute the gradients in the forward (the eager backend is PyTorch's
    # own graph, which allows it).
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    with kg.use(force={OP: backend}):
        y = kg.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3, 4, 0]), reduction=red)
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same graph twice is not supported"):
        y.backward()
    # reduction "none" recomputes, so it allows it
    y = kg.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3, 4, 0]), reduction="none").sum()
    (g1,) = torch.autograd.grad(y, [h], retain_graph=True)
    (g2,) = torch.autograd.grad(y, [h])
    torch.testing.assert_close(g1, g2)


def test_loss_used_twice_gets_one_summed_cotangent():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(5, 4)
    t = torch.tensor([0, 1, 2, 3, 4, 0])
    y = kg.linear_cross_entropy(h, w, t)
    (g,) = torch.autograd.grad(y + 2 * y, [h])
    (e,) = torch.autograd.grad(3 * F.cross_entropy(h @ w.T, t), [h])
    torch.testing.assert_close(g, e)


def test_default_is_the_plain_code_and_policy_routes():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    e = kg.explain(OP, h, w, t)
    assert e.backend == "eager" and "no evidence" in e.reason and "plain PyTorch" in e.reason, str(e)
    assert {c.backend for c in e.candidates} >= {"reference", "kernelgate_cpu", "kernelgate_cpu_narrow_accum",
                                                 "kernelgate_cuda", "kernelgate_cuda_narrow_accum", "eager"}
    # The plain code, recorded by PyTorch's autograd: F.cross_entropy on the float32 logits.
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    y = kg.linear_cross_entropy(hl, wl, t)
    assert type(y.grad_fn).__name__ != "CppFunction", y.grad_fn
    torch.testing.assert_close(y, F.cross_entropy(F.linear(h, w).float(), t), rtol=0, atol=0)
    assert kg.explain(OP, h, w, t, reduction="none").key.endswith("variant=2")
    kg.policy.add_rule(OP, ["kernelgate_cpu"], arch=-1, evidence="test rule")
    assert kg.explain(OP, h, w, t).backend == "kernelgate_cpu"


def _cotangent_is_applied_in_float32(device, backend):
    gen = torch.Generator().manual_seed(3)
    (h, w, _), t = _inputs(37, 24, 301, torch.bfloat16, device, gen, "normal", 0.2, torch.int64)
    grads = []
    for scale in (1.0, 1.0 / 3.0):  # 1/3: a gradient-accumulation step's loss / 3
        hl = h.clone().requires_grad_()
        with kg.use(force={OP: backend}):
            y = kg.linear_cross_entropy(hl, w, t)
        assert y.dtype == torch.float32
        (g,) = torch.autograd.grad(y * scale, [hl])
        grads.append(g)
    # One rounding, of the float32 product: the cotangent itself is not rounded to bfloat16
    # first (1/3 in bfloat16 is 0.333984375, a bias of 0.2% on every gradient).
    want = (grads[0].float() * torch.tensor(1.0 / 3.0, dtype=torch.float32)).bfloat16()
    assert torch.equal(grads[1], want), (grads[1] - want).abs().max()


@pytest.mark.parametrize("backend", ["reference", "kernelgate_cpu"])
def test_cpu_loss_and_cotangent_are_float32(backend):
    _cotangent_is_applied_in_float32("cpu", backend)


def test_bfloat16_loss_is_float32_as_the_plain_code_gives_it():
    # Hugging Face's models compute the loss from logits.float(): a bfloat16 loss would move in
    # steps of 1/16 near 12. Every backend, the plain-code fallback included, returns float32.
    gen = torch.Generator().manual_seed(5)
    (h, w, _), t = _inputs(64, 32, 500, torch.bfloat16, "cpu", gen, "normal", 0.1, torch.int64)
    plain = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE)
    for backend in ["eager", "reference", "kernelgate_cpu", "kernelgate_cpu_narrow_accum"]:
        with kg.use(force={OP: backend}):
            y = kg.linear_cross_entropy(h, w, t, ignore_index=IGNORE)
        assert y.dtype == torch.float32, backend
        if backend == "eager":
            assert torch.equal(y, plain)
        # the same bfloat16 logits, summed in another order: float32 rounding, not bfloat16's
        torch.testing.assert_close(y, plain, rtol=1e-5, atol=0)


def test_chunk_rows_setter_checks():
    with pytest.raises(RuntimeError, match="chunk rows must be >= 0"):
        set_chunk_rows(-1)
    prev = set_chunk_rows(5)
    assert set_chunk_rows(prev) == 5


# ---- bad input: clear errors naming the argument ------------------------------------------------

def _bad_cases():
    f = torch.randn
    long = lambda *s: torch.zeros(*s, dtype=torch.long)  # noqa: E731
    return [
        ((f(4, 8), f(10, 7), long(4)), {}, r"weight.size\(-1\) must be 8 to match hidden.size\(-1\) \(hidden\), got 7"),
        ((f(4, 8), f(10, 8), long(3)), {}, r"target.size\(-1\) must be 4 to match hidden.size\(-2\) \(rows\), got 3"),
        ((f(4, 8), f(10, 8, dtype=torch.bfloat16), long(4)), {}, r"weight must have the dtype of hidden \(float32\), got bfloat16"),
        ((f(4, 8), f(10, 8), f(4)), {}, "target must be an integer tensor of dtype int64 or int32, got float32"),
        ((f(4, 8, dtype=torch.float64), f(10, 8, dtype=torch.float64), long(4)), {},
         "hidden must be a floating-point tensor of dtype float32, float16 or bfloat16, got float64"),
        ((f(4, 8), f(10, 8), long(4), f(9)), {}, r"bias.size\(-1\) must be 10 to match weight.size\(-2\) \(classes\), got 9"),
        ((f(2, 4, 8), f(10, 8), long(2, 4)), {}, "hidden must have 2 dims, got 3"),
        ((f(4, 8), f(10, 8), long(4)), {"label_smoothing": 2.0}, r"label_smoothing must be in \[0, 1\], got 2"),
        ((f(4, 8), f(10, 8), long(4)), {"reduction": "max"}, "reduction must be 'mean', 'sum' or 'none', got 'max'"),
        ((f(4, 8), f(0, 8), long(4)), {}, r"weight.size\(0\) \(classes\) must be at least 1, got 0"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_cases())
def test_bad_input_errors(args, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        kg.linear_cross_entropy(*args, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        kg.linear_cross_entropy(*[a.to("meta") for a in args], **kwargs)


def test_out_of_range_target_is_an_error_on_cpu():
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(6, 4)
    for backend in CPU_BACKENDS:
        with kg.use(force={OP: backend}), pytest.raises(
                RuntimeError, match=r"target\[1\] = 6 is out of range: expected 0 <= target < 6 \(classes\)"):
            kg.linear_cross_entropy(h, w, torch.tensor([0, 6, 1]))


def test_meta_shapes():
    m = dict(device="meta", dtype=torch.bfloat16)
    h, w, b = torch.empty(5, 8, **m), torch.empty(11, 8, **m), torch.empty(11, **m)
    t = torch.empty(5, device="meta", dtype=torch.long)
    assert kg.linear_cross_entropy(h, w, t).shape == ()
    assert kg.linear_cross_entropy(h, w, t, b, reduction="none").shape == (5,)
    loss, lse, gh, gw, gb = torch.ops.kernelgate._linear_cross_entropy_fwd(h, w, t, b, IGNORE, 0.0, "sum", NEEDS_HIDDEN | NEEDS_BIAS)
    assert lse.shape == (5,) and gh.shape == (5, 8) and gw.shape == (0,) and gb.shape == (11,)


# ---- PyTorch integration ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck_chunked_and_int32_target(backend):
    # The generated cases' targets are int64 and take one chunk.
    h = torch.randn(9, 6, requires_grad=True)
    w = torch.randn(13, 6, requires_grad=True)
    b = torch.randn(13, requires_grad=True)
    t = torch.tensor([0, 5, -100, 12, 1, 7, 3, 3, 2], dtype=torch.int32)
    with kg.use(force={OP: backend}), chunk_rows(4):
        for args in [(h, w, t, b, -100, 0.1, "sum"), (h, w.detach(), t, b, -100, 0.2, "none")]:
            torch.library.opcheck(torch.ops.kernelgate.linear_cross_entropy.default, args)


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

GPU_BACKENDS = ["reference", "kernelgate_cuda"]
# Vocab sizes the quick grid does not make, and its own odd shapes in chunks of 4.
GPU_SHAPES = SHAPES + [(300, 128, 32003), (64, 64, 128256), (257, 96, 4099)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden,classes", GPU_SHAPES)
def test_gpu_shapes(backend, red, dtype, rows, hidden, classes):
    check(backend, "cuda", dtype, rows, hidden, classes, red=red, chunk=0 if rows > 100 else 4)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 1, 3, 64])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_chunk_counts(chunk, with_bias, red, dtype):
    check("kernelgate_cuda", "cuda", dtype, 130, 40, 1001, red=red, eps=0.1, with_bias=with_bias, chunk=chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("red", REDUCTIONS)
def test_gpu_smoothing_and_masks(eps, need, red):
    check("kernelgate_cuda", "cuda", torch.bfloat16, 77, 64, 5003, red=red, eps=eps, need=need, chunk=16)


@pytest.mark.gpu
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("ignore_frac", [0.2, 1.1])
def test_gpu_targets_layouts_ignored(target_dtype, layout, ignore_frac):
    check("kernelgate_cuda", "cuda", torch.bfloat16, 65, 48, 2049, red="mean", eps=0.1, chunk=16,
          target_dtype=target_dtype, layout=layout, ignore_frac=ignore_frac)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_large_logits_and_precision(dtype):
    check("kernelgate_cuda", "cuda", dtype, 64, 64, 3000, red="none", chunk=16, regime="large")
    m = check("kernelgate_cuda", "cuda", dtype, 2048, 128, 4096, red="mean", chunk=256)  # 8 chunks
    print(f"\n{dtype} 8 chunks on CUDA: grad_weight {m['grad_weight']}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_loss_and_cotangent_are_float32(backend):
    _cotangent_is_applied_in_float32("cuda", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dloss_value", [1.0, -1.0, 0.0, 0.375, 3.0])
def test_gpu_cotangent_values(backend, red, dtype, dloss_value):
    # The forward's gradients are scaled by the cotangent in the backward; on CUDA that pass is
    # skipped when the cotangent is exactly 1, and must apply every other value (-1, 0 too).
    check(backend, "cuda", dtype, 67, 40, 1001, red=red, chunk=16, dloss_value=dloss_value)
