"""gated_delta_rule: the chunked reference against the step-by-step recurrence in float64 (forward
and every gradient, on lengths below, at and across the chunk of 64), its dtypes and shapes, bad
input, and on the GPU FLA's backends against the float64 oracle. The contract suite
(test_contracts.py) checks the op like every other, on the generated cases."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.gated_delta_rule import gated_delta_rule_reference
from kernelgate.testing import check_against_oracle

OP = "gated_delta_rule"
NAMES = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]


def recurrence(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    """The op's definition step by step, in float64 (independent of the chunked reference)."""
    q, k, v = q.double(), k.double(), v.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    x = g.double() if dt_bias is None else g.double() + dt_bias.double()
    a = -torch.exp(A_log.double()) * F.softplus(x)
    b = torch.sigmoid(beta.double())
    B, T, H, K = q.shape
    s = K ** -0.5 if scale == 0 else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    out = []
    for t in range(T):
        S = S * torch.exp(a[:, t])[..., None, None]
        u = b[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(s * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1), S


def _inputs(B, T, H, K, V, dtype=torch.float64, device="cpu", seed=0, dt_bias=True, h0=True):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H), (H,), (H,), (B, H, K, V)]
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    if not dt_bias:
        xs[6] = None
    if not h0:
        xs[7] = None
    return [None if x is None else x.to(device, dtype) for x in xs]


def _grads(fn, xs, scale, w):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in xs]
    o, S = fn(*leaves, scale)
    present = [x for x in leaves if x is not None]
    gs = torch.autograd.grad((o * w[0].to(o.dtype)).sum() + (S * w[1].to(S.dtype)).sum(), present)
    return o, S, gs


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("dt_bias,h0", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_reference_is_the_recurrence_in_float64(T, dt_bias, h0, scale):
    xs = _inputs(2, T, 3, 8, 5, dt_bias=dt_bias, h0=h0, seed=T)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(2, T, 3, 5, generator=gen, dtype=torch.float64),
         torch.randn(2, 3, 8, 5, generator=gen, dtype=torch.float64))
    # The reference function itself: the routed op takes float32, float16 and bfloat16; the
    # harness calls the reference in float64 as the oracle.
    o, S, gs = _grads(gated_delta_rule_reference, xs, scale, w)
    o2, S2, gs2 = _grads(recurrence, xs, scale, w)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    torch.testing.assert_close(o, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S, S2, rtol=1e-10, atol=1e-12)
    names = [n for n, x in zip(NAMES, xs) if x is not None]
    for n, a, b in zip(names, gs, gs2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_at_16_and_32_bit_is_the_oracle_within_rounding(dtype):
    xs = _inputs(2, 100, 2, 16, 16, dtype=dtype)
    o, S = kg.gated_delta_rule(*xs)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert o.shape == (2, 100, 2, 16) and S.shape == (2, 2, 16, 16)
    o64, S64 = recurrence(*[None if x is None else x.double() for x in xs], 0.0)
    check_against_oracle("o", o, o64.to(dtype), o64, dtype)
    check_against_oracle("final_state", S, S64.float(), S64, dtype)


def test_empty_sequence_returns_the_initial_state():
    xs = _inputs(2, 0, 3, 4, 6, dtype=torch.float32)
    o, S = kg.gated_delta_rule(*xs)
    assert o.shape == (2, 0, 3, 6)
    assert torch.equal(S, xs[7])


def test_strided_inputs():
    xs = _inputs(2, 70, 3, 8, 8, dtype=torch.float32)
    want = kg.gated_delta_rule(*xs)
    # q, k, v as a fused projection's views: [B, T, 3, H, D] split on dim 2
    qkv = torch.stack(xs[:3], dim=2)
    got = kg.gated_delta_rule(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *xs[3:])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def _bad_cases():
    B, T, H, K, V = 2, 10, 3, 8, 4
    q, k, v, g, b, A, dt, h0 = _inputs(B, T, H, K, V, dtype=torch.float32)
    return [
        ((q, torch.randn(B, T, H, K + 1), v, g, b, A), {}, r"k.size\(-1\) must be 8 to match q.size\(-1\) \(dk\), got 9"),
        ((q, k, torch.randn(B, T + 1, H, V), g, b, A), {}, r"v.size\(-3\) must be 10 to match q.size\(-3\) \(seq\), got 11"),
        ((q, k, v, g, b, torch.randn(H + 1)), {}, r"A_log.size\(-1\) must be 3 to match q.size\(-2\) \(heads\), got 4"),
        ((q, k, v, g, b, A), {"initial_state": torch.randn(B, H, V, K)},
         r"initial_state.size\(-2\) must be 8 to match q.size\(-1\) \(dk\), got 4"),
        ((q.half(), k, v, g, b, A), {}, r"k must have the dtype of q \(float16\), got float32"),
        ((q[0], k, v, g, b, A), {}, r"q must have 4 dims, got 3"),
        ((q, k, v, g, b, A.long()), {}, r"A_log must have the dtype of q \(float32\), got int64"),
    ]


@pytest.mark.parametrize("args,kwargs,message", _bad_cases())
def test_bad_input_names_the_argument(args, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        kg.gated_delta_rule(*args, **kwargs)


def test_fla_backends_are_listed_with_their_requirements():
    o = next(o for o in kg.ops() if o["name"] == OP)
    assert o["defined_in_python"] and o["outputs"] == ["o", "final_state"]
    names = {b["name"] for b in o["backends"]}
    assert {"reference", "fla_chunk", "fla_fused_recurrent"} <= names
    # Each has its own adapter module: a change to FLA's other adapters leaves their evidence current.
    from kernelgate import backends

    mine = [b for b in backends.BACKENDS if b.op == OP]
    assert {b.adapter for b in mine} == {"fla_gated_delta_rule"}
    assert backends._adapter_hash("fla_gated_delta_rule") != backends._adapter_hash("fla")
    xs = _inputs(1, 4, 1, 4, 4, dtype=torch.float32)
    e = kg.explain(OP, *xs)
    assert e.backend == "reference", str(e)
    reasons = {c.backend: c.reason for c in e.candidates}
    assert reasons["fla_chunk"], str(e)  # on the CPU: not installed, or cuda tensors only


# ---- GPU -----------------------------------------------------------------------------------------

GPU_SHAPES = [(2, 1, 2, 16, 16), (2, 63, 3, 32, 16), (1, 200, 2, 64, 64), (2, 130, 4, 128, 128)]

# Read on the H200 (bench/results/h200/gpu_tests.json, session_2026_12_02_f; fla-core 0.6.0,
# Triton 3.6.0): FLA's chunked forward fails the oracle rule. In float32 it computes with TF32
# products (relative L2 error of o 1.3e-3 and of the final state 7.5e-4, where the float32
# reference has 5e-7 and 1e-6); in bfloat16 its final state, float32, is built from bf16-rounded
# factors (max error / rms 2.4e-2 to 4.9e-2 against a floor of 7.8e-3) and its o fails too at
# some shapes (without dt_bias and initial state at T 1 and 130: 3.3e-2 and 5.0e-2, over twice
# the reference's error plus the floor). The sweep ranks it out; kernelgate.fla sends calls
# without gradients to FLA verbatim unless evidence ranks a kernel of kernelgate's.
_FLA_CHUNK_FORWARD = pytest.mark.xfail(strict=True, reason="FLA's chunked forward: TF32 in float32, a "
                                       "bf16-level final state and o in bfloat16 (read on the H200)")


def _gpu_check(backend, shape, dtype, grad, dt_bias=True, h0=True):
    xs = _inputs(*shape, dtype=dtype, device="cuda", dt_bias=dt_bias, h0=h0, seed=sum(shape))
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = shape
    w = (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
         torch.randn(B, H, K, V, generator=gen, dtype=torch.float64))

    def run(fn, inputs, device, scale=0.0):
        if not grad:
            with torch.no_grad():
                o, S = fn(*inputs, scale)
            return [o, S]
        o, S, gs = _grads(fn, inputs, scale, [c.to(device) for c in w])
        return [o, S, *gs]

    with kg.use(force={OP: backend}):
        got = run(kg.gated_delta_rule, xs, "cuda")
    ref = run(kg.gated_delta_rule, xs, "cuda")  # the reference backend at this dtype: the error budget
    ora = run(recurrence, [None if x is None else x.double().cpu() for x in xs], "cpu")
    names = ["o", "final_state"] + ([f"grad of {n}" for n, x in zip(NAMES, xs) if x is not None] if grad else [])
    for n, g_, r, o in zip(names, got, ref, ora, strict=True):
        check_against_oracle(n, g_, r, o.to(g_.device), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_reference_backend(shape, dtype):
    _gpu_check("reference", shape, dtype, grad=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [pytest.param("fla_chunk", marks=_FLA_CHUNK_FORWARD), "fla_fused_recurrent"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_fla_forward(backend, shape, dtype):
    pytest.importorskip("fla")
    _gpu_check(backend, shape, dtype, grad=False)
    _gpu_check(backend, shape, dtype, grad=False, dt_bias=False, h0=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_fla_chunk_backward(shape):
    """Where FLA refuses its backward, the forced call raises the refusal (nothing wrong is served,
    and a sweep records it) before any of FLA's backward kernels runs: at (2, 63, 3, 32, 16) FLA's
    own call hit an illegal memory access in chunk_bwd_dv_local, a kernel its backward launches
    before its guard. Elsewhere its gradients meet the oracle rule."""
    pytest.importorskip("fla")
    from kernelgate.fla import _fla_refuses_gated_backward  # FLA 0.6's own guard, as the drop-in reads it

    if _fla_refuses_gated_backward(torch.device("cuda")):
        with pytest.raises(RuntimeError, match="chunk_bwd_dqkwg"):
            _gpu_check("fla_chunk", shape, torch.bfloat16, grad=True)
    else:
        _gpu_check("fla_chunk", shape, torch.bfloat16, grad=True)


@pytest.mark.parametrize("N", [3, 11], ids=["3_chunks", "11_chunks"])
@pytest.mark.parametrize("views", [False, True], ids=["contiguous", "views"])
@pytest.mark.parametrize("per_row_decay,qscaled", [(False, True), (False, False), (True, False)],
                         ids=["gdr_decay_scaled", "gdr_decay", "kda_decay"])
def test_the_chunk_pass_gradients_match_finite_differences(per_row_decay, qscaled, views, N):
    """kernelgate._state_scan's hand-written backward (every input: decay, Kend^T, [U0 | W], Qd,
    P, S_0; every output: the chunks' outputs, the final state, the states) against
    torch.autograd.gradcheck in float64, and its second derivatives (the backward differentiated by
    autograd) against gradgradcheck, for a decay per state row (kda) and one per chunk
    (gated_delta_rule), with several chunks and a batch, with the queries' and the keys' scales per
    step inside the pass (gated_delta_rule's) or none; Kend^T and [U0 | W] also as views (a transpose as the
    references pass it, a slice of the last dim), which it reads in place. 11 chunks: the scaled
    keys and the query-scaled output gradients are made in blocks of 2 chunks, the last of 1 (first
    derivatives: the in-place backward, the one with blocks)."""
    from kernelgate._state_scan import chunk_pass

    torch.manual_seed(0)
    B, dk, C, dv = 2, 4, 5, 3
    f64 = dict(dtype=torch.float64)
    decay = torch.rand(N, B, dk if per_row_decay else 1, 1, **f64).requires_grad_()
    if views:
        kend_t = (0.3 * torch.randn(N, B, C, dk, **f64)).transpose(-1, -2).detach().requires_grad_()
        uw = (0.3 * torch.randn(N, B, C, dv + dk + 2, **f64))[..., 1:dv + dk + 1].detach().requires_grad_()
        assert not kend_t.is_contiguous() and not uw.is_contiguous()
    else:
        kend_t = (0.3 * torch.randn(N, B, dk, C, **f64)).requires_grad_()
        uw = (0.3 * torch.randn(N, B, C, dv + dk, **f64)).requires_grad_()
    qd = torch.randn(N, B, C, dk, **f64).requires_grad_()
    p = torch.randn(N, B, C, C, **f64).tril().requires_grad_()
    s0 = torch.randn(B, dk, dv, **f64).requires_grad_()
    qs = torch.rand(N, B, C, 1, **f64).requires_grad_() if qscaled else None
    ks = torch.rand(N, B, C, 1, **f64).requires_grad_() if qscaled else None
    inputs = (decay, kend_t, uw, qd, p, s0) + ((qs, ks) if qscaled else ())
    assert torch.autograd.gradcheck(chunk_pass, inputs)
    if N == 3:  # second derivatives: the out-of-place backward, which has no blocks
        assert torch.autograd.gradgradcheck(chunk_pass, inputs)
    # its two ways to the first-order gradients (in place, or out of place under create_graph)
    # agree, with and without a gradient of the states output
    cot = (torch.randn(N, B, C, dv, **f64), torch.randn(B, dk, dv, **f64), torch.randn(N + 1, B, dk, dv, **f64))
    for used in (2, 3):
        outs = lambda: chunk_pass(*inputs)[:used]  # noqa: E731
        plain = torch.autograd.grad(outs(), inputs, cot[:used])
        graphed = torch.autograd.grad(outs(), inputs, cot[:used], create_graph=True)
        for a, b in zip(plain, graphed, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-13, atol=1e-13)
    o, final, states = chunk_pass(*inputs)
    u0, w = uw[..., :dv], uw[..., dv:]
    s = s0
    for n in range(N):  # the recurrence itself, step by step
        u = u0[n] - w[n] @ s
        torch.testing.assert_close(o[n], (qd[n] if qs is None else qs[n] * qd[n]) @ s + p[n] @ u)
        s = decay[n] * s + (kend_t[n] if ks is None else kend_t[n] * ks[n].transpose(-1, -2)) @ u
        torch.testing.assert_close(states[n + 1], s)
    torch.testing.assert_close(final, s)


def test_the_l2_normalisation_is_twice_differentiable_and_the_plain_formula():
    """The references' q, k normalisation (kernelgate._l2norm, a Function that keeps only its
    input): gradcheck and gradgradcheck in float64 with a zero row among random ones, and at a
    bf16 input the float32 values and gradient of the plain autograd code it replaces."""
    from kernelgate._l2norm import l2_normalize

    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    x[1, 2] = 0.0
    x.requires_grad_()
    f = lambda t: l2_normalize(t, torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x,)) and torch.autograd.gradgradcheck(f, (x,))
    xb = torch.randn(5, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(5, 7, 64)
    y = l2_normalize(xb, torch.float32)
    (gx,) = torch.autograd.grad(y, xb, dy)
    xp = xb.detach().clone().requires_grad_()
    xf = xp.float()
    yp = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
    (gp,) = torch.autograd.grad(yp, xp, dy)
    assert y.dtype == torch.float32 and gx.dtype == torch.bfloat16
    torch.testing.assert_close(y, yp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx, gp, rtol=0, atol=0)


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The shape and dtype of every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.outputs.append((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_the_chunked_references_form_no_dk_by_dk_matrix_and_keep_no_float32_copy_of_q_or_k(op):
    """What keeps the references' forward+backward within the memory of the plain code they
    replace (bench/bench_gated_delta_rule.py): the state pass applies its transition through
    [chunk, dv] products and never forms the [dk, dk] matrix of a chunk, the backward keeps no
    float32 [batch, seq, heads, dk] copy of a bf16 q or k (the normalisation keeps its input), and
    kda's keeps no [chunk, chunk, dk] decays. dk, dv and the chunks are sizes no other tensor of
    the op has."""
    import importlib

    fn = getattr(importlib.import_module(f"kernelgate.{op}"), f"{op}_reference")
    B, T, H, K, V = 2, 100, 2, 24, 40
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    gate = (B, T, H) if op == "gated_delta_rule" else (B, T, H, K)
    leaves = [t.requires_grad_() for t in (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(*gate), r(B, T, H),
                                           r(H), r(*gate[2:]))]
    saved = []
    with _Shapes() as shapes, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o, final = fn(*leaves, None, K ** -0.5)
        torch.autograd.grad((o.float().square().sum() + final.square().sum()), leaves)
    assert shapes.outputs, "the dispatch mode saw no op"
    assert not [s for s, _ in shapes.outputs if s[-2:] == (K, K)]
    copies = []
    for x in leaves[:2]:
        xf = x.detach().float()
        copies += [xf, xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)]
    assert any(t is leaves[0] for t in saved)  # q itself is what is kept
    float_copies = [t for t in saved if t.dtype == torch.float32 and t.shape == leaves[0].shape
                    and any(torch.equal(t.detach(), c) for c in copies)]
    assert not float_copies
    if op == "kda":  # nor its [chunk, chunk, dk] decays (recomputed in the backward), chunks of 16
        assert not [t for t in saved if t.dim() >= 3 and tuple(t.shape[-3:]) == (16, 16, K)]
