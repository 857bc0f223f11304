"""kda: the chunked reference against the step-by-step recurrence in float64 (forward and every
gradient, on lengths below, at and across the chunk of 16, with strong decays), its dtypes and
shapes, bad input, and on the GPU FLA's chunked backend against the float64 oracle. The contract
suite (test_contracts.py) checks the op like every other, on the generated cases."""

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.kda import kda_reference
from kernelgate.testing import check_against_oracle
from test_gated_delta_rule import _grads  # the same weighted sum of o and the final state, differentiated

OP = "kda"
NAMES = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]


def recurrence(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    """The op's definition step by step, in float64 (independent of the chunked reference)."""
    q, k, v = q.double(), k.double(), v.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    x = g.double() if dt_bias is None else g.double() + dt_bias.double()
    a = -torch.exp(A_log.double())[:, None] * F.softplus(x)  # [B, T, H, dk]
    b = torch.sigmoid(beta.double())
    B, T, H, K = q.shape
    s = (K ** -0.5 if K else 1.0) if scale == 0 else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    return steps(q, k, v, a, b, s, S)


def steps(q, k, v, a, b, s, S):
    """The recurrence itself from state S, on q, k normalised, the log decay a per key channel and
    b in [0, 1]: (o, the final state)."""
    out = []
    for t in range(q.shape[1]):
        S = S * torch.exp(a[:, t])[..., None]
        u = b[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(s * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1), S


def _inputs(B, T, H, K, V, dtype=torch.float64, device="cpu", seed=0, dt_bias=True, h0=True, decay=1.0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H), (H,), (H, K), (B, H, K, V)]
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    xs[5] = xs[5] * decay  # A_log: the decays' scale
    if not dt_bias:
        xs[6] = None
    if not h0:
        xs[7] = None
    return [None if x is None else x.to(device, dtype) for x in xs]


@pytest.mark.parametrize("T", [1, 5, 15, 16, 17, 70])
@pytest.mark.parametrize("dt_bias,h0", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_reference_is_the_recurrence_in_float64(T, dt_bias, h0, scale):
    xs = _inputs(2, T, 3, 8, 5, dt_bias=dt_bias, h0=h0, seed=T, decay=2.0)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(2, T, 3, 5, generator=gen, dtype=torch.float64),
         torch.randn(2, 3, 8, 5, generator=gen, dtype=torch.float64))
    o, S, gs = _grads(kda_reference, xs, scale, w)
    o2, S2, gs2 = _grads(recurrence, xs, scale, w)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    torch.testing.assert_close(o, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S, S2, rtol=1e-10, atol=1e-12)
    names = [n for n, x in zip(NAMES, xs) if x is not None]
    for n, a, b in zip(names, gs, gs2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"grad of {n}: {m}")


def test_strong_decays_stay_finite_in_float32():
    """Every exponent the reference takes is <= 0: decays of e^-100 per step and channel do not
    overflow where exp(-G) would."""
    xs = _inputs(1, 40, 2, 16, 8, decay=1.0)
    xs[5] = torch.full((2,), 4.0, dtype=torch.float64)  # exp(A_log) = 55
    xs[3] = xs[3].abs() * 2
    o, S = kg.kda(*[x.float() for x in xs])
    o64, S64 = recurrence(*xs, 0.0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    check_against_oracle("o", o, o64.float(), o64, torch.float32)
    check_against_oracle("final_state", S, S64.float(), S64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_at_16_and_32_bit_is_the_oracle_within_rounding(dtype):
    xs = _inputs(2, 50, 2, 16, 16, dtype=dtype)
    o, S = kg.kda(*xs)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert o.shape == (2, 50, 2, 16) and S.shape == (2, 2, 16, 16)
    o64, S64 = recurrence(*[None if x is None else x.double() for x in xs], 0.0)
    check_against_oracle("o", o, o64.to(dtype), o64, dtype)
    check_against_oracle("final_state", S, S64.float(), S64, dtype)


def test_empty_sequence_returns_the_initial_state():
    xs = _inputs(2, 0, 3, 4, 6, dtype=torch.float32)
    o, S = kg.kda(*xs)
    assert o.shape == (2, 0, 3, 6)
    assert torch.equal(S, xs[7])


def test_strided_inputs():
    xs = _inputs(2, 40, 3, 8, 8, dtype=torch.float32)
    want = kg.kda(*xs)
    qkv = torch.stack(xs[:3], dim=2)  # q, k, v as a fused projection's views
    got = kg.kda(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *xs[3:])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def _bad_cases():
    B, T, H, K, V = 2, 10, 3, 8, 4
    q, k, v, g, b, A, dt, h0 = _inputs(B, T, H, K, V, dtype=torch.float32)
    return [
        ((q, k, v, torch.randn(B, T, H), b, A), {}, r"g must have 4 dims, got 3"),
        ((q, k, v, torch.randn(B, T, H, K + 1), b, A), {}, r"g.size\(-1\) must be 8 to match q.size\(-1\) \(dk\), got 9"),
        ((q, k, v, g, b, A), {"dt_bias": torch.randn(H * K)}, r"dt_bias must have 2 dims, got 1"),
        ((q, k, torch.randn(B, T + 1, H, V), g, b, A), {}, r"v.size\(-3\) must be 10 to match q.size\(-3\) \(seq\), got 11"),
        ((q, k, v, g, b, A), {"initial_state": torch.randn(B, H, V, K)},
         r"initial_state.size\(-2\) must be 8 to match q.size\(-1\) \(dk\), got 4"),
        ((q.half(), k, v, g, b, A), {}, r"k must have the dtype of q \(float16\), got float32"),
    ]


@pytest.mark.parametrize("block", [1 << 23, 3 * (2 * 4 * 5) * 4], ids=["one_block", "blocks_of_3_chunks"])
def test_the_decay_products_recompute_their_decays_exactly(block, monkeypatch):
    """kernelgate.kda's within-chunk products (kk, qk: their [chunk, chunk, dk] decays recomputed
    in the backward, in blocks of chunks) against the plain einsum of the masked exponentials, and
    their first and second derivatives against gradcheck and gradgradcheck, in one block and in
    blocks of 3 of 7 chunks (the last block shorter)."""
    import sys

    kda_module = sys.modules["kernelgate.kda"]
    monkeypatch.setattr(kda_module, "_BLOCK", block)
    torch.manual_seed(0)
    N, B, C, dk = 7, 2, 4, 5
    f64 = dict(dtype=torch.float64)
    q, k = torch.randn(N, B, C, dk, **f64), torch.randn(N, B, C, dk, **f64)
    G = (-torch.rand(N, B, C, dk, **f64)).cumsum(-2)  # a cumulative log decay
    q, k, G = (x.requires_grad_() for x in (q, k, G))
    kk, qk = kda_module._DecayedProducts.apply(q, k, G)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    E = torch.exp((G[..., :, None, :] - G[..., None, :, :]).masked_fill(~lower[..., None], float("-inf")))
    torch.testing.assert_close(kk, torch.einsum("...tc,...sc,...tsc->...ts", k, k, E), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(qk, torch.einsum("...tc,...sc,...tsc->...ts", q, k, E), rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(kda_module._DecayedProducts.apply, (q, k, G))
    assert torch.autograd.gradgradcheck(kda_module._DecayedProducts.apply, (q, k, G))


@pytest.mark.parametrize("args,kwargs,message", _bad_cases())
def test_bad_input_names_the_argument(args, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        kg.kda(*args, **kwargs)


def test_fla_backend_is_listed():
    o = next(o for o in kg.ops() if o["name"] == OP)
    assert o["defined_in_python"] and o["outputs"] == ["o", "final_state"]
    names = {b["name"] for b in o["backends"]}
    assert {"reference", "fla_chunk"} <= names
    from kernelgate import backends

    assert {b.adapter for b in backends.BACKENDS if b.op == OP} == {"fla_gated_delta_rule"}
    xs = _inputs(1, 4, 1, 4, 4, dtype=torch.float32)
    e = kg.explain(OP, *xs)
    assert e.backend == "reference", str(e)
    assert {c.backend: c.reason for c in e.candidates}["fla_chunk"], str(e)


# ---- GPU -----------------------------------------------------------------------------------------

GPU_SHAPES = [(2, 1, 2, 16, 16), (2, 63, 3, 32, 16), (1, 200, 2, 64, 64), (2, 130, 4, 128, 128)]


def _gpu_check(backend, shape, dtype, grad):
    xs = _inputs(*shape, dtype=dtype, device="cuda", seed=sum(shape))
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = shape
    w = (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
         torch.randn(B, H, K, V, generator=gen, dtype=torch.float64))

    def run(fn, inputs, device):
        if not grad:
            with torch.no_grad():
                return list(fn(*inputs, 0.0))
        o, S, gs = _grads(fn, inputs, 0.0, [c.to(device) for c in w])
        return [o, S, *gs]

    with kg.use(force={OP: backend}):
        got = run(kg.kda, xs, "cuda")
    ref = run(kg.kda, xs, "cuda")  # the reference backend at this dtype: the error budget
    ora = run(recurrence, [x.double().cpu() for x in xs], "cpu")
    names = ["o", "final_state"] + ([f"grad of {n}" for n in NAMES] if grad else [])
    for n, g_, r, o in zip(names, got, ref, ora, strict=True):
        check_against_oracle(n, g_, r, o.to(g_.device), dtype)


# Read on the H200 (2026-12-03, fla-core 0.6.0, triton 3.6): FLA's chunk_kda forward is outside
# the oracle rule at every tested shape, as its gated delta rule is: in float32 o has a relative L2
# error of 8.5e-4 to 1.1e-3 (TF32 products; the float32 reference 1.3e-7 to 1.9e-7), in bfloat16
# its final state a max error / rms of 1.3e-2 to 7.4e-2 (floor 7.8e-3; the reference 4e-7 to
# 2.3e-6). The sweep ranks it out; kernelgate.fla sends chunk_kda calls to FLA verbatim unless
# evidence ranks a kernel of kernelgate's.
_FLA_CHUNK_FORWARD = pytest.mark.xfail(strict=True, reason="FLA's chunk_kda forward: TF32 in float32, a "
                                       "bf16-level final state in bfloat16 (read on the H200)")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "fla_chunk"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwdbwd"])
def test_gpu_backend_against_the_oracle(backend, shape, dtype, grad, request):
    if backend != "reference":
        pytest.importorskip("fla")
    if backend == "fla_chunk":
        if grad and dtype == torch.float32:
            # Its forward fails (the fwd case), and its float32 backward's first calls autotuned
            # past the 240 s test limit at every shape (2026-12-03, fla-core 0.6.0, triton 3.6).
            pytest.xfail("not run: FLA's chunk_kda forward fails the oracle in float32 (the fwd case) "
                         "and its float32 backward autotunes for minutes")
        request.applymarker(_FLA_CHUNK_FORWARD)
    _gpu_check(backend, shape, dtype, grad)
