"""rope and qk_norm_rope: what is special to them. test_contracts.py checks every backend against
the float64 oracle on the generated cases (head_dim, seq, head counts and batch edges, every dtype,
q in several value regimes, eps), opcheck, torch.compile, double backward (refused by rope) and
CUDA graphs. The generated cases lay out nothing of these 4-dim tensors and always share cos/sin
across the batch, so here: strided q and k (transposed projections, padded rows, unaligned,
last dim strided), cos/sin per batch and expanded, real rotary tables, the reference's accuracy in
absolute terms, the formula and the rotation's transpose, gradients of only some inputs, one
output unused, the fused op against its composition, head dims and position counts the quick grid
does not make, and clear errors for bad input.

cos and sin are constants to autograd (the reference detaches them): the tests never request
their gradient except to check that none is produced."""

import pytest
import torch

import kernelgate as kg
from kernelgate.testing import assert_cuda_graph_replays, check_against_oracle, oracle_metrics, poison_cuda_allocator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = ["rope", "qk_norm_rope"]

rope_oracle = torch.ops.kernelgate._rope_reference
norm_oracle = torch.ops.kernelgate._qk_norm_rope_reference


# ---- inputs -------------------------------------------------------------------------------------

def _x_values(shape, regime, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        return x * 5e3
    if regime == "small":
        return x * 1e-4  # mean square ~1e-8, below eps: eps must be applied
    if regime == "offset":
        return x * 0.01 + 3.0
    return x


def _cos_sin(cos_batch, seq, d, kind, gen):
    if kind == "hf":
        # Real rotary tables (Llama / HF): angles pos * base^(-2i/d), both halves equal.
        inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        pos = torch.arange(seq, dtype=torch.float64)[:, None] + 1000 * torch.arange(cos_batch, dtype=torch.float64)[:, None, None]
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        return ang.cos(), ang.sin()
    # Independent values everywhere: a kernel that pairs an element with the wrong partner's
    # cos / sin cannot pass by the halves being equal.
    return (torch.randn(cos_batch, seq, d, generator=gen, dtype=torch.float64),
            torch.randn(cos_batch, seq, d, generator=gen, dtype=torch.float64))


# Layouts of q and k: (leaf shape from the logical [b, h, s, d], view of the leaf the op gets).
# Gradients are taken with respect to the leaves, so a layout bug in the backward shows up too.
def _layout(shape, layout):
    b, h, s, d = shape
    if layout == "contiguous":
        return shape, lambda t: t
    if layout == "transposed":  # a [b, s, h, d] projection viewed as [b, h, s, d]
        return (b, s, h, d), lambda t: t.transpose(1, 2)
    if layout == "padded":  # rows of d inside rows of d + 3 (odd row stride)
        return (b, h, s, d + 3), lambda t: t[..., :d]
    if layout == "offset":  # data starts one element in: unaligned pointer
        return (b * h * s * d + 1,), lambda t: t[1:].view(b, h, s, d)
    if layout == "last_strided":  # last dim not unit-stride
        return (b, h, s, d, 2), lambda t: t[..., 0]
    raise ValueError(layout)


class Case:
    def __init__(self, op, device, dtype, batch, q_heads, kv_heads, seq, head_dim, cos_batch=1,
                 layout="contiguous", regime="normal", cos_kind="random", cos_layout="contiguous",
                 eps=1e-6, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.op, self.dtype, self.eps = op, dtype, eps
        self.q_shape = (batch, q_heads, seq, head_dim)
        self.k_shape = (batch, kv_heads, seq, head_dim)
        qls, self.q_view = _layout(self.q_shape, layout)
        kls, self.k_view = _layout(self.k_shape, layout)
        # Leaves hold the values of the logical tensors, laid out as the layout wants.
        self.q_leaf = self._leaf(qls, self.q_shape, layout, regime, gen).to(device, dtype)
        self.k_leaf = self._leaf(kls, self.k_shape, layout, regime, gen).to(device, dtype)
        c, s = _cos_sin(cos_batch, seq, head_dim, cos_kind, gen)
        if cos_layout == "expanded":  # cos_batch == batch with batch stride 0
            assert cos_batch == 1
            c, s = c.expand(batch, seq, head_dim), s.expand(batch, seq, head_dim)
        self.cos, self.sin = c.to(device, dtype), s.to(device, dtype)
        self.qw = (1 + 0.5 * torch.randn(head_dim, generator=gen, dtype=torch.float64)).to(device, dtype)
        self.kw = (1 + 0.5 * torch.randn(head_dim, generator=gen, dtype=torch.float64)).to(device, dtype)
        self.gq = torch.randn(self.q_shape, generator=gen, dtype=torch.float64).to(device, dtype)
        self.gk = torch.randn(self.k_shape, generator=gen, dtype=torch.float64).to(device, dtype)

    @staticmethod
    def _leaf(leaf_shape, shape, layout, regime, gen):
        values = _x_values(shape, regime, gen)
        leaf = torch.zeros(leaf_shape, dtype=torch.float64)
        _, view = _layout(shape, layout)
        view(leaf).copy_(values)
        return leaf

    def run(self, fn, double=False):
        """(outputs, gradients w.r.t. the leaves [q, k, (q_weight, k_weight)])."""
        cast = (lambda t: t.double()) if double else (lambda t: t)
        ql = cast(self.q_leaf).detach().clone().requires_grad_(True)
        kl = cast(self.k_leaf).detach().clone().requires_grad_(True)
        q, k = self.q_view(ql), self.k_view(kl)
        c, s = cast(self.cos), cast(self.sin)
        leaves = [ql, kl]
        if self.op == "rope":
            out = fn(q, k, c, s)
        else:
            qw = cast(self.qw).detach().clone().requires_grad_(True)
            kw = cast(self.kw).detach().clone().requires_grad_(True)
            leaves += [qw, kw]
            out = fn(q, k, qw, kw, c, s, self.eps)
        grads = torch.autograd.grad(out, leaves, [cast(self.gq), cast(self.gk)])
        return out, grads

    def args_for_explain(self):
        q, k = self.q_view(self.q_leaf), self.k_view(self.k_leaf)
        if self.op == "rope":
            return q, k, self.cos, self.sin
        return q, k, self.qw, self.kw, self.cos, self.sin, self.eps


def _kg_fn(op):
    return kg.rope if op == "rope" else kg.qk_norm_rope


def _oracle_fn(op):
    return rope_oracle if op == "rope" else norm_oracle


GRAD_NAMES = ["dq", "dk", "dq_weight", "dk_weight"]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def assert_reference_accurate(name, ref, oracle, dtype):
    """The reference at `dtype` against the oracle, in absolute terms. Its error is what rounding
    the result to dtype costs: at most half a unit in the last place per element, so at most one
    unit u in relative L2 and u * max|o| / rms(o) in the max metric (float32 results get room
    for their own arithmetic). check_against_oracle scales by the reference's error, so a wrong
    reference would pass it: this is what makes the reference backend's tests able to fail."""
    o = oracle.detach().double().cpu()
    finite = o.isfinite()
    m = oracle_metrics(name, ref.cpu(), ref.cpu(), o, dtype)  # the reference's own error
    assert not m["failure"], m["failure"]  # its NaN / Inf pattern is the oracle's
    l2, mx = m["rel_l2"], m["max_over_rms"]
    if o[finite].numel() == 0 or o[finite].abs().max() == 0:
        return
    of = o[finite]
    peak = (of.abs().max() / of.square().mean().sqrt()).item()
    u = UNIT_ROUNDOFF[dtype]
    # float32 results: room for the float32 arithmetic of a gradient (a reduction over head_dim
    # and its cancellation), the harness's float32 floor.
    room = 1e-5 if dtype == torch.float32 else 1e-6
    assert l2 <= u + room, f"{name}: reference relative L2 error {l2:.3e} > {u + room:.1e} ({dtype})"
    assert mx <= u * peak + room, f"{name}: reference max error / rms {mx:.3e} > {u * peak + room:.1e} ({dtype})"


def check(op, backend, device, dtype, dims, **kw):
    case = Case(op, device, dtype, *dims, **kw)
    with kg.use(force={op: backend}):
        e = kg.explain(op, *case.args_for_explain())
        assert e.backend == backend, str(e)
        poison_cuda_allocator(torch.device(device))
        got, got_g = case.run(_kg_fn(op))
    with kg.use(force={op: "reference"}):
        ref, ref_g = case.run(_kg_fn(op))
    ora, ora_g = case.run(_oracle_fn(op), double=True)
    for name, g, r, o, shape in zip(["q_out", "k_out"], got, ref, ora, [case.q_shape, case.k_shape]):
        assert g.dtype == dtype and tuple(g.shape) == shape and g.device.type == device
        check_against_oracle(name, g, r, o, dtype)
        assert_reference_accurate(name, r, o, dtype)
    assert len(got_g) == (2 if op == "rope" else 4)
    for name, g, r, o in zip(GRAD_NAMES, got_g, ref_g, ora_g):
        assert g.dtype == dtype
        check_against_oracle(name, g, r, o, dtype)
        assert_reference_accurate(name, r, o, dtype)


# ---- CPU (runs in CI) ---------------------------------------------------------------------------

# (batch, q_heads, kv_heads, seq, head_dim, cos_batch)
SHAPES = [
    (1, 1, 1, 1, 2, 1),      # smallest: head_dim 2, seq 1
    (2, 4, 1, 7, 6, 1),      # GQA 4:1, odd seq, head_dim 6 (odd half)
    (2, 4, 2, 5, 66, 2),     # GQA 4:2, per-batch cos, head_dim 66
    (1, 3, 3, 9, 130, 1),    # MHA, head_dim 130
    (3, 4, 2, 1, 8, 3),      # seq 1, per-batch cos
    (2, 2, 1, 33, 128, 1),   # cos shared by the batch
    (1, 2, 2, 3, 128, 1),    # batch 1 with cos batch 1
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", SHAPES, ids=str)
def test_cpu_shapes(op, dtype, dims):
    b, hq, hkv, s, d, cb = dims
    check(op, "reference", "cpu", dtype, (b, hq, hkv, s, d), cos_batch=cb)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["transposed", "padded", "offset", "last_strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_noncontiguous(op, layout, dtype):
    check(op, "reference", "cpu", dtype, (2, 4, 2, 5, 10), layout=layout)


@pytest.mark.parametrize("op", OPS)
def test_cpu_cos_expanded_over_batch(op):
    check(op, "reference", "cpu", torch.float32, (3, 2, 1, 4, 12), cos_batch=1, cos_layout="expanded")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("regime,cos_kind", [("large", "hf"), ("normal", "hf"), ("small", "random"), ("offset", "random")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_value_regimes(op, regime, cos_kind, dtype):
    check(op, "reference", "cpu", dtype, (2, 4, 2, 6, 64), regime=regime, cos_kind=cos_kind)


def test_cpu_qk_norm_eps_zero():
    check("qk_norm_rope", "reference", "cpu", torch.float32, (1, 2, 1, 3, 16), regime="small", eps=0.0)


def test_reference_matches_the_formula():
    # The oracle itself, against rotate-half written out here (HF's apply_rotary_pos_emb).
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64)
    c, s = _cos_sin(2, 5, 8, "random", gen)

    def rotate_half(x):
        return torch.cat([-x[..., 4:], x[..., :4]], dim=-1)

    qo, ko = rope_oracle(q, k, c, s)
    torch.testing.assert_close(qo, q * c[:, None] + rotate_half(q) * s[:, None], rtol=0, atol=0)
    torch.testing.assert_close(ko, k * c[:, None] + rotate_half(k) * s[:, None], rtol=0, atol=0)
    w1 = torch.randn(8, generator=gen, dtype=torch.float64)
    w2 = torch.randn(8, generator=gen, dtype=torch.float64)
    qn = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6) * w1
    kn = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + 1e-6) * w2
    qo, ko = norm_oracle(q, k, w1, w2, c, s)
    torch.testing.assert_close(qo, qn * c[:, None] + rotate_half(qn) * s[:, None])
    torch.testing.assert_close(ko, kn * c[:, None] + rotate_half(kn) * s[:, None])
    # With real rotary tables, rope is a rotation: it keeps each row's norm.
    c, s = _cos_sin(1, 5, 8, "hf", gen)
    qo, _ = rope_oracle(q, k, c, s)
    torch.testing.assert_close(qo.norm(dim=-1), q.norm(dim=-1))


def test_backward_is_rotation_by_minus_sin():
    # With real tables the backward of rope is rope with -sin (its transpose).
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 6, 16, generator=gen, requires_grad=True)
    c, s = (t.float() for t in _cos_sin(1, 6, 16, "hf", gen))
    gq, gk = torch.randn(1, 2, 6, 16, generator=gen), torch.randn(1, 1, 6, 16, generator=gen)
    dq, dk = torch.autograd.grad(kg.rope(q, k, c, s), [q, k], [gq, gk])
    eq, ek = kg.rope(gq, gk, c, -s)
    torch.testing.assert_close(dq, eq)
    torch.testing.assert_close(dk, ek)


def test_cos_sin_get_no_gradient():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, requires_grad=True)
    c = torch.randn(1, 3, 8, requires_grad=True)
    s = torch.randn(1, 3, 8, requires_grad=True)
    qo, ko = kg.rope(q, k, c, s)
    dq, dk, dc, ds = torch.autograd.grad((qo.sum() + ko.sum()), [q, k, c, s], allow_unused=True)
    assert dc is None and ds is None and dq is not None and dk is not None
    qo, ko = kg.rope(q, k.detach(), c, s)
    assert qo.requires_grad and not ko.requires_grad  # as through the reference
    w = torch.ones(8, requires_grad=True)
    qo, ko = kg.qk_norm_rope(q, k, w, w, c, s)
    grads = torch.autograd.grad(qo.sum() + ko.sum(), [q, k, w, c, s], allow_unused=True)
    assert grads[3] is None and grads[4] is None and grads[2] is not None
    # Only cos requiring grad: nothing to differentiate, as for the reference (which detaches).
    qo, _ = kg.rope(q.detach(), k.detach(), c, s)
    ro, _ = rope_oracle(q.detach(), k.detach(), c, s)
    assert not qo.requires_grad and not ro.requires_grad


def test_qk_norm_rope_some_inputs_without_grad():
    # Only q and q_weight require grad: their gradients match the oracle's, and k_out, which
    # depends on neither, needs none.
    case = Case("qk_norm_rope", "cpu", torch.float32, 2, 4, 2, 3, 8)

    def run(fn, cast):
        q = cast(case.q_leaf).clone().requires_grad_(True)
        qw = cast(case.qw).clone().requires_grad_(True)
        k, kw = cast(case.k_leaf), cast(case.kw)
        qo, ko = fn(q, k, qw, kw, cast(case.cos), cast(case.sin), 1e-6)
        assert qo.requires_grad and not ko.requires_grad  # as through the reference
        return torch.autograd.grad(qo, [q, qw], cast(case.gq))

    got = run(kg.qk_norm_rope, lambda t: t)
    want = run(norm_oracle, lambda t: t.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
def test_one_output_used(op):
    # Autograd hands the backward no gradient for k_out: it counts as zero.
    case = Case(op, "cpu", torch.float32, 2, 4, 2, 3, 8)

    def run(fn, cast):
        ql = cast(case.q_leaf).clone().requires_grad_(True)
        kl = cast(case.k_leaf).clone().requires_grad_(True)
        c, s = cast(case.cos), cast(case.sin)
        if op == "rope":
            qo, _ = fn(ql, kl, c, s)
        else:
            qo, _ = fn(ql, kl, cast(case.qw), cast(case.kw), c, s, 1e-6)
        return torch.autograd.grad((qo * cast(case.gq)).sum(), [ql, kl], allow_unused=True, materialize_grads=True)

    dq, dk = run(_kg_fn(op), lambda t: t)
    oq, ok = run(_oracle_fn(op), lambda t: t.double())
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(ok, torch.zeros_like(ok))
    torch.testing.assert_close(dq.double(), oq, rtol=1e-5, atol=1e-5)


def test_fused_is_the_composition_and_no_less_accurate():
    # float32: the fused op equals rms_norm per head followed by rope.
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 7, 64, generator=gen)
    k = torch.randn(2, 2, 7, 64, generator=gen)
    w1, w2 = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    c, s = (t.float() for t in _cos_sin(1, 7, 64, "hf", gen))
    got = kg.qk_norm_rope(q, k, w1, w2, c, s)
    comp = kg.rope(kg.rms_norm(q, w1), kg.rms_norm(k, w2), c, s)
    for g, e in zip(got, comp):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # bfloat16: keeping the normalised heads in float32 (fused) is at least as accurate against
    # the float64 oracle as rounding them to bfloat16 in between (the eager composition).
    qb, kb, w1b, w2b, cb, sb = (t.bfloat16() for t in (q, k, w1, w2, c, s))
    oracle = norm_oracle(*(t.double() for t in (qb, kb, w1b, w2b, cb, sb)))
    fused = kg.qk_norm_rope(qb, kb, w1b, w2b, cb, sb)
    composed = kg.rope(kg.rms_norm(qb, w1b), kg.rms_norm(kb, w2b), cb, sb)

    def err(x, o):
        return ((x.double() - o).norm() / o.norm()).item()

    for f, cmp_, o in zip(fused, composed, oracle):
        assert err(f, o) <= err(cmp_, o)


@pytest.mark.parametrize("op", OPS)
def test_cpu_empty(op):
    case = Case(op, "cpu", torch.float32, 2, 4, 2, 0, 8)
    out, grads = case.run(_kg_fn(op))
    assert out[0].shape == (2, 4, 0, 8) and out[1].shape == (2, 2, 0, 8)
    assert grads[0].shape == (2, 4, 0, 8)
    if op == "qk_norm_rope":
        assert torch.equal(grads[2], torch.zeros(8)) and torch.equal(grads[3], torch.zeros(8))


def test_cpp_and_python_share_one_op():
    q, k, c, s = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    a = kg.rope(q, k, c, s)
    b = torch.ops.kernelgate.rope(q, k, c, s)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_explain_key_names_the_dims():
    q, k, c, s = torch.randn(4, 32, 16, 128), torch.randn(4, 8, 16, 128), torch.randn(1, 16, 128), torch.randn(1, 16, 128)
    e = kg.explain("rope", q, k, c, s)
    assert e.backend == "eager"  # no evidence: the op as plain PyTorch code
    assert "q_heads<=2^5" in e.key and "kv_heads<=2^3" in e.key and "head_dim<=2^7" in e.key
    assert {c.backend for c in e.candidates} >= {"reference", "kernelgate_cuda"}


# ---- bad input: clear errors naming the argument ----------------------------------------------

def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


BAD_ROPE = [
    ((_t(2, 4, 5, 7), _t(2, 2, 5, 7), _t(1, 5, 7), _t(1, 5, 7)), r"head_dim \(q.size\(-1\)\) must be a positive even number .*got 7"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 6), _t(1, 5, 8), _t(1, 5, 8)), r"k.size\(-1\) must be 8 to match q.size\(-1\) \(head_dim\), got 6"),
    ((_t(2, 4, 5, 8), _t(3, 2, 5, 8), _t(1, 5, 8), _t(1, 5, 8)), r"k.size\(-4\) must be 2 to match q.size\(-4\) \(batch\), got 3"),
    ((_t(2, 4, 5, 8), _t(2, 2, 6, 8), _t(1, 5, 8), _t(1, 5, 8)), r"k.size\(-2\) must be 5 to match q.size\(-2\) \(seq\), got 6"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(5, 8), _t(5, 8)), r"cos must have 3 dims, got 2 \(shape \[5, 8\]\)"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 1, 5, 8), _t(1, 1, 5, 8)), r"cos must have 3 dims, got 4"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 4, 8), _t(1, 4, 8)), r"cos.size\(-2\) must be 5 to match q.size\(-2\) \(seq\), got 4"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 5, 4), _t(1, 5, 4)), r"cos.size\(-1\) must be 8 to match q.size\(-1\) \(head_dim\), got 4"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(3, 5, 8), _t(3, 5, 8)), r"cos.size\(0\) and sin.size\(0\) must be 1 \(shared by the batch\) or batch \(q.size\(0\) = 2\), got 3"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 5, 8), _t(2, 5, 8)), r"sin.size\(-3\) must be 1 to match cos.size\(-3\) \(cos_batch\), got 2"),
    ((_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 5, 8), _t(1, 5, 9)), r"sin.size\(-1\) must be 8 to match q.size\(-1\) \(head_dim\), got 9"),
    ((_t(2, 4, 5, 8, dtype=torch.bfloat16), _t(2, 2, 5, 8, dtype=torch.bfloat16), _t(1, 5, 8), _t(1, 5, 8)),
     r"cos must have the dtype of q \(bfloat16\), got float32"),
    ((_t(2, 4, 5, 8, dtype=torch.float64), _t(2, 2, 5, 8), _t(1, 5, 8), _t(1, 5, 8)), "q must be a floating-point tensor of dtype float32, float16 or bfloat16, got float64"),
    ((_t(4, 5, 8), _t(2, 5, 8), _t(1, 5, 8), _t(1, 5, 8)), r"q must have 4 dims, got 3"),
    ((_t(2, 4, 5, 0), _t(2, 2, 5, 0), _t(1, 5, 0), _t(1, 5, 0)), r"head_dim \(q.size\(-1\)\) must be a positive even number .*got 0"),
]


@pytest.mark.parametrize("args,match", BAD_ROPE)
def test_rope_bad_input_errors(args, match):
    with pytest.raises(RuntimeError, match=match):
        kg.rope(*args)
    with pytest.raises(RuntimeError, match=match):
        kg.rope(*(a.to("meta") for a in args))


@pytest.mark.parametrize("args,match", BAD_ROPE)
def test_qk_norm_rope_bad_input_errors(args, match):
    d = args[0].shape[-1]
    w = torch.ones(d, dtype=args[0].dtype)
    with pytest.raises(RuntimeError, match=match.replace("rope", "qk_norm_rope")):
        kg.qk_norm_rope(args[0], args[1], w, w, args[2], args[3])


@pytest.mark.parametrize(
    "qw,kw,eps,match",
    [
        (_t(6), _t(8), 1e-6, r"q_weight.size\(-1\) must be 8 to match q.size\(-1\) \(head_dim\), got 6"),
        (_t(8), _t(1, 8), 1e-6, "k_weight must have 1 dim, got 2"),
        (_t(8, dtype=torch.bfloat16), _t(8), 1e-6, r"q_weight must have the dtype of q \(float32\), got bfloat16"),
        (_t(8), _t(8), -1.0, "eps must be a finite number >= 0, got -1"),
        (_t(8), _t(8), float("inf"), "eps must be a finite number >= 0, got inf"),
    ],
)
def test_qk_norm_rope_weight_and_eps_errors(qw, kw, eps, match):
    q, k, c, s = _t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(1, 5, 8), _t(1, 5, 8)
    with pytest.raises(RuntimeError, match=match):
        kg.qk_norm_rope(q, k, qw, kw, c, s, eps)
    with pytest.raises(RuntimeError, match=match):
        kg.qk_norm_rope(*(t.to("meta") for t in (q, k, qw, kw, c, s)), eps)


def test_meta_shapes():
    q = torch.empty(2, 8, 5, 64, device="meta", dtype=torch.bfloat16).transpose(1, 2).transpose(1, 2)
    k = torch.empty(2, 2, 5, 64, device="meta", dtype=torch.bfloat16)
    c = torch.empty(1, 5, 64, device="meta", dtype=torch.bfloat16)
    qo, ko = kg.rope(q, k, c, c)
    assert qo.shape == (2, 8, 5, 64) and ko.shape == (2, 2, 5, 64) and qo.dtype == torch.bfloat16
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    qo, ko = kg.qk_norm_rope(q, k, w, w, c, c)
    assert qo.shape == (2, 8, 5, 64) and ko.device.type == "meta"


# ---- PyTorch integration ----------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_opcheck_strided_q(op):
    # The generated cases lay out no 4-dim tensor: a [b, s, h, d] projection viewed as [b, h, s, d]
    # and per-batch cos / sin, with and without gradients.
    qt = torch.randn(2, 5, 4, 6).transpose(1, 2).requires_grad_(True)
    k = torch.randn(2, 2, 5, 6, requires_grad=True)
    c, s = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    w1, w2 = torch.randn(6, requires_grad=True), torch.randn(6)
    for args in [(qt, k, c, s), (qt.detach(), k.detach(), c, s)]:
        if op == "qk_norm_rope":
            args = (*args[:2], w1 if args[0].requires_grad else w1.detach(), w2, *args[2:], 0.1)
        torch.library.opcheck(getattr(torch.ops.kernelgate, op).default, args)


def assert_layouts_kept(op, backend, device, dtype):
    """q_out and k_out in q's and k's layout (as at::empty_like has it), and the gradients in the
    layout of the output gradients they stand for: attention code's views (a [b, s, h, d]
    projection viewed as [b, h, s, d]) stay such views, so SDPA after rope returns o in that
    layout and the step copies nothing; a padded q gets dense outputs in its dim order. (Their
    values in these layouts: test_*_noncontiguous.)"""
    gen = torch.Generator().manual_seed(3)
    for layout in ("transposed", "padded"):
        store_q, view_q = _layout((2, 4, 5, 8), layout)
        store_k, view_k = _layout((2, 2, 5, 8), layout)
        q = view_q(torch.randn(*store_q, generator=gen).to(device, dtype)).requires_grad_(True)
        k = view_k(torch.randn(*store_k, generator=gen).to(device, dtype)).requires_grad_(True)
        c, sn = (torch.randn(1, 5, 8, generator=gen).to(device, dtype) for _ in range(2))
        w = torch.randn(8, generator=gen).to(device, dtype)
        args = (q, k, c, sn) if op == "rope" else (q, k, w, w, c, sn)
        with kg.use(force={op: backend}):
            qo, ko = _kg_fn(op)(*args)
        assert qo.stride() == torch.empty_like(q).stride() and ko.stride() == torch.empty_like(k).stride(), layout
        gq, gk = (torch.empty_like(t).normal_() for t in (qo, ko))
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
        if backend != "eager":  # served with PyTorch's autograd: its gradients are PyTorch's
            assert dq.stride() == gq.stride() and dk.stride() == gk.stride(), layout


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_cpu_outputs_and_gradients_keep_layouts(op, backend):
    assert_layouts_kept(op, backend, "cpu", torch.float32)


# ---- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------------

CUDA_BACKENDS = ["reference", "kernelgate_cuda"]
# The CPU shapes (GQA, per-batch cos) and head dims and head counts the quick grid does not make.
GPU_SHAPES = SHAPES + [
    (4, 32, 8, 64, 128, 1),   # the production head layout (GQA 4:1, head_dim 128)
    (2, 8, 2, 33, 96, 2),     # head_dim 96: 6 vector lanes (padded to 8 in qk_norm_rope)
    (1, 4, 1, 17, 64, 1),
    (2, 2, 2, 9, 256, 1),
    (1, 2, 1, 5, 1024, 1),    # qk_norm_rope two-pass rows (more than 32 lanes)
    (1, 1, 1, 3, 4096, 1),    # qk_norm_rope largest head_dim it serves
    (1, 40, 40, 3, 2, 1),     # many rows, head_dim 2
]


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", GPU_SHAPES, ids=str)
def test_gpu_shapes(op, backend, dtype, dims):
    b, hq, hkv, s, d, cb = dims
    check(op, backend, "cuda", dtype, (b, hq, hkv, s, d), cos_batch=cb)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["transposed", "padded", "offset", "last_strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [10, 128])
def test_gpu_noncontiguous(op, layout, dtype, head_dim):
    check(op, "kernelgate_cuda", "cuda", dtype, (2, 4, 2, 5, head_dim), layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_gpu_outputs_and_gradients_keep_layouts(op, backend):
    assert_layouts_kept(op, backend, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cos_batch,cos_layout", [(1, "expanded"), (3, "contiguous"), (1, "contiguous")])
def test_gpu_cos_batch(op, cos_batch, cos_layout):
    check(op, "kernelgate_cuda", "cuda", torch.bfloat16, (3, 4, 2, 7, 128), cos_batch=cos_batch, cos_layout=cos_layout)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("regime,cos_kind", [("large", "hf"), ("normal", "hf"), ("small", "random"), ("offset", "random")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_value_regimes(op, regime, cos_kind, dtype):
    check(op, "kernelgate_cuda", "cuda", dtype, (2, 4, 2, 6, 128), regime=regime, cos_kind=cos_kind)


@pytest.mark.gpu
def test_gpu_qk_norm_eps_zero():
    check("qk_norm_rope", "kernelgate_cuda", "cuda", torch.float32, (1, 2, 1, 3, 128), regime="small", eps=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [1, 2])
def test_gpu_many_positions(seed):
    # Enough positions that the qk_norm_rope backward's weight sums span every block of its grid.
    for op in OPS:
        check(op, "kernelgate_cuda", "cuda", torch.bfloat16, (4, 8, 2, 1031, 128), seed=seed)


@pytest.mark.gpu
def test_gpu_weight_grads_deterministic():
    case = Case("qk_norm_rope", "cuda", torch.bfloat16, 2, 8, 2, 513, 128)
    with kg.use(force={"qk_norm_rope": "kernelgate_cuda"}):
        _, g1 = case.run(kg.qk_norm_rope)
        _, g2 = case.run(kg.qk_norm_rope)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_our_kernel_runs(op):
    # The routed call launches our kernel (not a fallback): one launch for q and k forward.
    case = Case(op, "cuda", torch.bfloat16, 2, 4, 2, 8, 128)
    names = {"rope": "rope_rows", "qk_norm_rope": "qk_norm_rope_fwd_rows"}
    with kg.use(force={op: "kernelgate_cuda"}):
        args = case.args_for_explain()
        _kg_fn(op)(*args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _kg_fn(op)(*args)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [n for n in kernels if names[op] in n]
    assert len(ours) == 1, kernels


@pytest.mark.gpu
def test_gpu_empty():
    for op in OPS:
        case = Case(op, "cuda", torch.float32, 2, 4, 2, 0, 8)
        with kg.use(force={op: "kernelgate_cuda"}):
            out, grads = case.run(_kg_fn(op))
        assert out[0].shape == (2, 4, 0, 8)
        if op == "qk_norm_rope":
            assert torch.equal(grads[2].cpu(), torch.zeros(8))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_cuda_graph_capture_and_replay_strided(op):
    # The generic replay (test_contracts) is on contiguous q and k; here transposed projections.
    case = Case(op, "cuda", torch.bfloat16, 2, 8, 2, 64, 128, layout="transposed")
    ql = case.q_leaf.clone().requires_grad_(True)
    kl = case.k_leaf.clone().requires_grad_(True)
    qw = case.qw.clone().requires_grad_(True)
    kw = case.kw.clone().requires_grad_(True)

    def step():
        q, k = case.q_view(ql), case.k_view(kl)
        if op == "rope":
            out, leaves = kg.rope(q, k, case.cos, case.sin), [ql, kl]
        else:
            out, leaves = kg.qk_norm_rope(q, k, qw, kw, case.cos, case.sin), [ql, kl, qw, kw]
        return (*out, *torch.autograd.grad(out, leaves, [case.gq, case.gk]))

    def refill():
        ql.copy_(torch.randn_like(ql))
        kl.copy_(torch.randn_like(kl))
        case.gq.copy_(torch.randn_like(case.gq))

    with kg.use(force={op: "kernelgate_cuda"}):
        assert_cuda_graph_replays(step, refill)
