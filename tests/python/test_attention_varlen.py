"""kg.attention's varlen form (cu_seqlens) and its op, attention_varlen: against each sequence's
attention computed alone in float64 (forward and every gradient: empty sequences, one token, one
sequence, grouped kv heads, both masks, a scale), the op's reading of any offsets, the fixed-length
form as a special case, bad input, the plain code as the fallback, and on the GPU PyTorch's varlen
kernels against the oracle. The
contract suite (test_contracts.py) checks the op like every other, on the generated cases."""

import sys

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate.attention_varlen import _varlen_attn_refuses, attention_varlen_reference
from kernelgate.testing import check_against_oracle, device_syncs


def per_sequence(q, k, v, cu, causal, scale=None):
    """Each sequence's attention alone (SDPA on its slice), concatenated: the definition."""
    c = cu.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                           scale=scale, enable_gqa=True).transpose(0, 1)
            for a, b in zip(c, c[1:]) if b > a]
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


def inputs(tokens, heads, kv_heads, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, h, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


OFFSETS = [[0, 5, 5, 17, 23], [0, 23], [0, 1, 2, 23], [0, 22, 23], [0, 0, 23, 23]]


@pytest.mark.parametrize("offsets", OFFSETS, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_each_sequence_attends_only_within_itself(offsets, causal, heads, kv_heads, scale):
    q, k, v = inputs(23, heads, kv_heads, 16)
    cu = torch.tensor(offsets)
    o = kg.attention(q, k, v, causal, scale, cu_seqlens=cu)
    assert o.shape == (23, heads, 16) and o.dtype == torch.float32
    want = per_sequence(*(t.double() for t in (q, k, v)), cu, causal, scale)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((o * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for n, a, b in zip("qkv", got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_meet_the_oracle_rule(dtype):
    q, k, v = inputs(40, 4, 2, 32, dtype=dtype)
    cu = torch.tensor([0, 7, 30, 40])
    o = kg.attention(q, k, v, True, cu_seqlens=cu)
    oracle = per_sequence(*(t.double() for t in (q, k, v)), cu, True)
    # The reference accumulates in float32 and rounds once to the dtype: within one rounding.
    assert o.dtype == dtype
    err = float((o.double() - oracle).abs().max())
    assert err <= torch.finfo(dtype).eps * float(oracle.abs().max()), err


def test_the_op_reads_any_offsets_as_a_set_of_boundaries():
    """The op itself (what the harness feeds random index tensors): cu_seqlens sorted, clamped to
    [0, tokens], with 0 and tokens added."""
    q, k, v = inputs(11, 2, 1, 8)
    qg = q.detach().view(11, 1, 2, 8)
    got = kg.attention_varlen(qg, k.detach(), v.detach(), torch.tensor([9, 3, 40, 3, -2]))
    want = kg.attention_varlen(qg, k.detach(), v.detach(), torch.tensor([0, 3, 3, 9, 11, 11]))
    assert torch.equal(got, want)
    want = per_sequence(q.detach().double(), k.detach().double(), v.detach().double(), torch.tensor([0, 3, 9, 11]), True)
    torch.testing.assert_close(got.view(11, 2, 8).double(), want, rtol=1e-5, atol=1e-5)


def test_equal_lengths_are_the_fixed_length_form():
    b, s, heads, kv_heads, d = 3, 9, 4, 2, 16
    q, k, v = inputs(b * s, heads, kv_heads, d)
    cu = torch.arange(0, b * s + 1, s)
    o = kg.attention(q, k, v, True, cu_seqlens=cu, max_seqlen=s)
    fixed = kg.attention(*(t.view(b, s, t.shape[1], d).transpose(1, 2) for t in (q, k, v)), True)
    torch.testing.assert_close(o, fixed.transpose(1, 2).reshape(b * s, heads, d), rtol=1e-5, atol=1e-5)


def test_reference_is_the_op_definition_in_float64():
    q, k, v = inputs(17, 2, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4, 17])
    got = attention_varlen_reference(q.view(17, 2, 1, 8), k, v, cu, "none", 0.0, 0)
    torch.testing.assert_close(got.view(17, 2, 8), per_sequence(q, k, v, cu, False), rtol=1e-12, atol=1e-12)


def _bad_calls():
    q, k, v = (t.detach() for t in inputs(10, 4, 2, 8))
    cu = torch.tensor([0, 4, 10])
    return [
        ((q, k, v), {"cu_seqlens": torch.tensor([1, 4, 10])}, ValueError, r"cu_seqlens must start at 0, never decrease and end at q's tokens \(10\), got \[1, 4, 10\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0, 6, 4, 10])}, ValueError, r"never decrease .* got \[0, 6, 4, 10\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0, 4, 9])}, ValueError, r"end at q's tokens \(10\), got \[0, 4, 9\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0, 4, 12])}, ValueError, r"end at q's tokens \(10\), got \[0, 4, 12\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0.0, 10.0])}, ValueError,
         r"cu_seqlens must be a 1-D int32 or int64 tensor of at least 2 offsets, got torch.float32 of shape \[2\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([[0, 10]])}, ValueError,
         r"cu_seqlens must be a 1-D int32 or int64 tensor of at least 2 offsets, got torch.int64 of shape \[1, 2\]"),
        ((q, k, v), {"cu_seqlens": torch.tensor([0])}, ValueError,
         r"cu_seqlens must be a 1-D int32 or int64 tensor of at least 2 offsets, got torch.int64 of shape \[1\]"),
        ((q, k, v), {"cu_seqlens": [0, 10]}, TypeError, r"cu_seqlens must be a tensor of sequence offsets, got list"),
        ((q.view(1, 10, 4, 8), k, v), {"cu_seqlens": cu}, ValueError, r"with cu_seqlens, q must be a 3-D tensor \[tokens, heads, head_dim\], got a 4-D"),
        ((q, k[:, :1].expand(10, 3, 8), v), {"cu_seqlens": cu}, ValueError, r"q's heads must be a multiple of k's kv_heads"),
        ((q, k, v), {"cu_seqlens": cu, "max_seqlen": 5}, ValueError, r"max_seqlen must be an int at least the longest sequence of cu_seqlens \(6\), got 5"),
        ((q, k, v), {"cu_seqlens": cu, "max_seqlen": 6.0}, ValueError, r"max_seqlen must be an int .* got 6.0"),
        ((q.view(1, 10, 4, 8).transpose(1, 2), k.view(1, 10, 2, 8).transpose(1, 2),
          v.view(1, 10, 2, 8).transpose(1, 2)), {"max_seqlen": 10}, ValueError, r"max_seqlen is for the varlen form: give cu_seqlens with it"),
        ((q, k, v, "causal"), {"cu_seqlens": cu}, ValueError, r"causal must be True or False, got 'causal'"),
    ]


def test_a_cu_seqlens_is_read_on_the_host_once_while_unchanged(monkeypatch):
    """Every layer of a model gets the same cu_seqlens: only its first call reads it (a device
    sync on the GPU); an in-place change is checked again; the record does not keep the tensor."""
    import gc
    import weakref

    from kernelgate import _ops

    reads = []
    real = _ops.check_offsets_values
    monkeypatch.setattr(_ops, "check_offsets_values", lambda *a: reads.append(1) or real(*a))
    q, k, v = (t.detach() for t in inputs(10, 4, 2, 8))
    cu = torch.tensor([0, 4, 10])
    first = kg.attention(q, k, v, True, cu_seqlens=cu)
    for _ in range(3):
        assert torch.equal(kg.attention(q, k, v, True, cu_seqlens=cu), first)
    assert len(reads) == 1
    with pytest.raises(ValueError, match=r"max_seqlen must be an int at least the longest sequence of cu_seqlens \(6\)"):
        kg.attention(q, k, v, True, cu_seqlens=cu, max_seqlen=5)  # the recorded longest still checks
    cu[1] = 11  # in place: checked again
    with pytest.raises(ValueError, match=r"never decrease .* got \[0, 11, 10\]"):
        kg.attention(q, k, v, True, cu_seqlens=cu)
    assert len(reads) == 2
    cu[1] = 7
    torch.testing.assert_close(kg.attention(q, k, v, True, cu_seqlens=cu),
                               per_sequence(q, k, v, torch.tensor([0, 7, 10]), True), rtol=1e-5, atol=1e-5)
    gone = weakref.ref(cu)
    del cu
    gc.collect()
    assert gone() is None


def test_the_eager_code_makes_a_cu_seqlens_boundaries_once_while_unchanged():
    """PyTorch's varlen attention takes the boundaries in int32: the eager code makes them once
    per cu_seqlens (six small kernels a call otherwise: 1.036x the plain code's forward on an
    H100), again after an in-place change or for another token count, and its record does not
    keep the tensor. A cu_seqlens kg.attention checked is its own boundaries, without the two
    empty sequences that 0 and tokens added make (the kernels size buffers per sequence)."""
    import gc
    import weakref

    from kernelgate.attention_varlen import _int32_boundaries

    cu = torch.tensor([0, 4, 10])
    first = _int32_boundaries(cu, 10)
    assert first.dtype == torch.int32 and first.tolist() == [0, 0, 4, 10, 10]
    assert _int32_boundaries(cu, 10) is first
    assert _int32_boundaries(cu, 12).tolist() == [0, 0, 4, 10, 12]
    cu[1] = 6  # in place
    assert _int32_boundaries(cu, 10).tolist() == [0, 0, 6, 10, 10]
    q, k, v = (t.detach() for t in inputs(10, 4, 2, 8))
    kg.attention(q, k, v, True, cu_seqlens=cu)  # checked: int64, made int32 once
    assert _int32_boundaries(cu, 10).tolist() == [0, 6, 10]
    assert _int32_boundaries(cu, 10) is _int32_boundaries(cu, 10)
    assert _int32_boundaries(cu, 9).tolist() == [0, 0, 6, 9, 9]  # not what was checked
    cu32 = torch.tensor([0, 3, 10], dtype=torch.int32)
    kg.attention(q, k, v, False, cu_seqlens=cu32)
    assert _int32_boundaries(cu32, 10) is cu32
    cu32[1] = 2  # in place: no longer the checked tensor
    assert _int32_boundaries(cu32, 10).tolist() == [0, 0, 2, 10, 10]
    gone = weakref.ref(cu)
    del cu
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("args,kwargs,error,message", _bad_calls())
def test_bad_input_names_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        kg.attention(*args, **kwargs)


def test_the_plain_code_serves_where_no_evidence_ranks_a_backend():
    """The eager backend, the code a user would write: PyTorch's varlen attention on CUDA in 16
    bits, the reference elsewhere; it serves calls no evidence covers (never the quadratic
    reference of every token against every other)."""
    o = next(o for o in kg.ops() if o["name"] == "attention_varlen")
    assert o["defined_in_python"] and [(b["name"], b["kind"]) for b in o["backends"]] == [
        ("reference", "reference"), ("eager", "eager")]
    q, k, v = (t.detach() for t in inputs(10, 4, 2, 8))
    e = kg.explain("attention_varlen", q.view(10, 2, 2, 8), k, v, torch.tensor([0, 4, 10]))
    assert e.backend == "eager" and "no evidence for this region" in e.reason, str(e)
    assert _varlen_attn_refuses(q) == "PyTorch's varlen attention takes CUDA float16 and bfloat16 tensors"


def test_the_reference_reads_the_boundaries_without_the_host_where_it_must():
    """On meta tensors (the op's shapes under torch.compile) and traced ones the reference cannot
    read the boundaries' values: it masks the packed tokens instead, with the same result."""
    q, k, v = (t.detach() for t in inputs(23, 4, 2, 8, dtype=torch.float64))
    qg, cu = q.view(23, 2, 2, 8), torch.tensor([0, 5, 5, 17, 23])
    meta = attention_varlen_reference(*(t.to("meta") for t in (qg, k, v, cu)), "causal", 0.0, 0)
    assert meta.shape == (23, 2, 2, 8) and meta.dtype == torch.float64

    class Traced(torch.Tensor):  # a tensor subclass, as FakeTensor and FunctionalTensor are
        pass

    masked = attention_varlen_reference(qg.as_subclass(Traced), k, v, cu, "causal", 0.0, 0)
    per_seq = attention_varlen_reference(qg, k, v, cu, "causal", 0.0, 0)
    torch.testing.assert_close(torch.Tensor(masked), per_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_seq.view(23, 4, 8), per_sequence(q, k, v, cu, True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_in_blocks_of_queries_is_sdpa_per_sequence_to_the_second_derivative(monkeypatch, causal):
    """The reference computes a sequence in blocks of queries (its score memory bounded for the
    oracle of long sequences): in blocks of 1, 3 and 7 queries (a ragged last block) and in one,
    its output, gradients and second derivatives in float64 are those of SDPA per sequence."""
    av = sys.modules["kernelgate.attention_varlen"]  # (kg.attention_varlen is the op)

    q, k, v = inputs(23, 4, 2, 8, dtype=torch.float64)
    qg, cu, mask = q.view(23, 2, 2, 8), torch.tensor([0, 5, 17, 23]), "causal" if causal else "none"
    gen = torch.Generator().manual_seed(1)
    cot = torch.randn(23, 2, 2, 8, generator=gen, dtype=torch.float64)
    vs = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (q, k, v)]

    def run(fn):
        o = fn()
        first = torch.autograd.grad(o, (q, k, v), cot.view(o.shape), create_graph=True)
        second = torch.autograd.grad(sum((g * w).sum() for g, w in zip(first, vs)), (q, k, v))
        return [o.detach().view(23, 2, 2, 8), *(g.detach() for g in first), *second]

    # SDPA per sequence (its math path on the CPU, differentiated twice by autograd): the definition
    want = run(lambda: per_sequence(q, k, v, cu, causal))
    for block_queries in (1, 3, 7, 10 ** 6):
        # a block holds block_queries x kv_heads x group x keys scores; the longest sequence has 12 keys
        monkeypatch.setattr(av, "_BLOCK_SCORES", block_queries * 4 * 12)
        got = run(lambda: attention_varlen_reference(qg, k, v, cu, mask, 0.0, 0))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"block {block_queries}, result {i}: {m}")


def test_training_through_the_op_compiles():
    q, k, v = inputs(23, 4, 2, 8)
    cu = torch.tensor([0, 5, 17, 23])
    f = torch.compile(lambda q, k, v: kg.attention(q, k, v, True, cu_seqlens=cu, max_seqlen=12), backend="aot_eager",
                      fullgraph=True)
    o = f(q, k, v)
    want = per_sequence(*(t.detach().double() for t in (q, k, v)), cu, True)
    torch.testing.assert_close(o.detach().double(), want, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(o.sum(), (q, k, v))
    ref = torch.autograd.grad(kg.attention(q, k, v, True, cu_seqlens=cu).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- GPU -----------------------------------------------------------------------------------------

# PyTorch's varlen backward beyond the rule (read on an H100, 2026-12-07): in bfloat16, one
# sequence of 130 tokens without the causal mask, grad of k 3.8e-2 max / rms where the budget is
# 3.6e-2. The plain code a user would write computes this; the sweeps rank it out where it fails.
_PLAIN_CODE_BEYOND_THE_RULE = {("torch.bfloat16", False, "[0, 130]")}
_GPU_CASES = [
    pytest.param(offsets, causal, dtype, marks=[pytest.mark.xfail(
        strict=True, reason="PyTorch's varlen backward: grad of k beyond the rule")]
        if (str(dtype), causal, str(offsets)) in _PLAIN_CODE_BEYOND_THE_RULE else [],
        id=f"{dtype}-{causal}-{offsets}")
    for offsets in [[0, 5, 5, 70, 130], [0, 130], [0, 1, 129, 130]] for causal in [True, False]
    for dtype in [torch.float16, torch.bfloat16]]


@pytest.mark.gpu
@pytest.mark.parametrize("offsets,causal,dtype", _GPU_CASES)
def test_gpu_pytorchs_varlen_kernels_against_the_oracle(offsets, causal, dtype):
    """The eager backend on the GPU (PyTorch's varlen kernels), forced, forward and every
    gradient against each sequence's attention in float64, within the oracle rule of the
    reference at the dtype; and it is PyTorch's kernel that ran, not the reference."""
    assert not _varlen_attn_refuses(torch.empty(1, 1, 1, 64, device="cuda", dtype=dtype))
    q, k, v = inputs(130, 8, 2, 64, dtype=dtype, device="cuda")
    cu = torch.tensor(offsets, device="cuda")
    w = torch.randn(130, 8, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(force):
        with kg.use(force={"attention_varlen": force}):
            o = kg.attention(q, k, v, causal, cu_seqlens=cu)
        return [o, *torch.autograd.grad((o * w.to(o.device, o.dtype)).sum(), (q, k, v))]

    got, ref = run("eager"), run("reference")
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o64 = per_sequence(q64, k64, v64, cu.cpu(), causal)
    ora = [o64, *torch.autograd.grad((o64 * w).sum(), (q64, k64, v64))]
    for n, g_, r, o in zip(["o", "grad of q", "grad of k", "grad of v"], got, ref, ora, strict=True):
        check_against_oracle(n, g_, r, o.to(g_.device), dtype)


@pytest.mark.gpu
def test_gpu_a_model_step_reads_cu_seqlens_on_the_host_once():
    """Every layer's attention gets the step's cu_seqlens: the first call checks it (one device
    sync), the others, forward and backward, sync no more than PyTorch's varlen attention called
    directly (the fallback bench measured 1.51x the plain code while every call synced)."""
    q, k, v = inputs(4096, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 1000, 1000, 3000, 4096], device="cuda", dtype=torch.int32)

    def layer(attend):
        o = attend()
        torch.autograd.grad(o.float().square().sum(), (q, k, v))

    def plain():  # the code a user writes without kernelgate
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu, cu, 2000, 2000, window_size=(-1, 0))

    routed = lambda: kg.attention(q, k, v, True, cu_seqlens=cu, max_seqlen=2000)  # noqa: E731
    layer(plain)  # warm
    own = device_syncs(lambda: [layer(plain) for _ in range(3)])
    assert device_syncs(lambda: layer(routed)) >= 1 + own // 3  # the first call reads cu_seqlens
    assert device_syncs(lambda: [layer(routed) for _ in range(3)]) == own
