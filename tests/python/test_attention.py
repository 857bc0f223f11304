"""attention: what is special to it. test_contracts.py checks every backend against the float64
oracle on the generated cases (grouped q shapes from one query head to 8 per kv head, odd
sequence lengths, layouts, regimes, dtypes, both masks, two scales), opcheck, torch.compile,
double backward and CUDA graphs. Here: kg.attention against attention written independently (the
softmax of scaled scores over keys repeated per group, in float64) for MHA, GQA and MQA, both masks,
a given scale, attention code's transposed q and single-query / odd sequences; the gradient rule
at non-finite inputs (NaN over the whole kv head of a non-finite query row, the same for every
backend, forward untouched); clear errors."""

import math
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernelgate as kg
from kernelgate.testing import check_against_oracle, poison_cuda_allocator

FUSED = ["aten_flash", "aten_cudnn", "aten_efficient"]


def definition(q, k, v, causal, scale):
    """softmax(scale q k^T, masked above the diagonal when causal) v, kv head h // group serving
    query head h."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def inputs(batch, heads, kv_heads, seq, head_dim, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(batch, h, seq, head_dim, generator=gen, dtype=torch.float64)
                   for h in (heads, kv_heads, kv_heads, heads))
    return [t.to(device) for t in (q, k, v, do)]


def run(backend, q, k, v, do, causal, scale, transposed=False):
    """Output and (dq, dk, dv) of the backend, forced. transposed: q as attention code holds it,
    q.view(batch, seq, heads, head_dim).transpose(1, 2) of a [batch, seq, heads, head_dim] tensor."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    qa = leaves[0]
    if transposed:
        store = q.detach().transpose(1, 2).contiguous().requires_grad_(True)
        leaves[0], qa = store, store.transpose(1, 2)
    with kg.use(force={"attention": backend}):
        poison_cuda_allocator(q.device)
        o = kg.attention(qa, leaves[1], leaves[2], causal=causal, scale=scale)
        grads = torch.autograd.grad(o, leaves, do)
    if transposed:
        grads = (grads[0].transpose(1, 2),) + grads[1:]
    return o, grads


def check(backend, device, dtype, shape, causal, scale, transposed=False, seed=0):
    q, k, v, do = inputs(*shape, seed=seed, device=device)
    leaves64 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = definition(*leaves64, causal, scale)
    want_grads = torch.autograd.grad(want, leaves64, do)
    cast = [t.to(dtype) for t in (q, k, v, do)]
    got, got_grads = run(backend, *cast, causal, scale, transposed)
    ref, ref_grads = run("reference", *cast, causal, scale)
    assert got.shape == q.shape and got.dtype == dtype
    check_against_oracle("o", got, ref, want, dtype)
    for name, g, r, o in zip(["dq", "dk", "dv"], got_grads, ref_grads, want_grads):
        check_against_oracle(name, g, r, o, dtype)


# MHA with an odd sequence, GQA of 3 query heads per kv head, MQA with one query, a group of 4
# at a length past one 128-key tile.
SHAPES = [(2, 3, 3, 37, 16), (1, 6, 2, 19, 24), (2, 4, 1, 1, 8), (1, 8, 2, 130, 64)]


@pytest.mark.parametrize("backend", ["reference", "eager"])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_against_the_definition(backend, causal):
    for shape in SHAPES:
        for scale in (None, 0.3):
            check(backend, "cpu", torch.float32, shape, causal, scale)
    check(backend, "cpu", torch.float32, SHAPES[1], causal, None, transposed=True)


def test_float64_reference_is_the_definition():
    q, k, v, _ = inputs(1, 4, 2, 11, 8)
    got = torch.ops.kernelgate._attention_reference(q.view(1, 2, 2, 11, 8), k, v, "causal", 0.0)
    torch.testing.assert_close(got.view(1, 4, 11, 8), definition(q, k, v, True, None), rtol=1e-12, atol=1e-12)


def nonfinite_case(device, dtype, value):
    """batch 2, 4 query heads over 2 kv heads, seq 150 (past one 128-key tile); `value` at query
    head 1 (kv head 0), batch 0, row 5."""
    q, k, v, do = inputs(2, 4, 2, 150, 64, seed=3, device=device)
    q[0, 1, 5, 7] = value
    return [t.to(dtype) for t in (q, k, v, do)]


def assert_rule(o, grads, ref_o, ref_grads, dtype):
    """NaN where the rule says, the rest as the reference gives it."""
    dq, dk, dv = grads
    assert torch.isnan(o[0, 1, 5]).all()
    finite_o = torch.ones_like(o, dtype=torch.bool)
    finite_o[0, 1, 5] = False
    assert torch.isfinite(o[finite_o]).all()
    # kv head 0 of batch 0: its query heads 0 and 1, its k and v, all NaN; the rest finite.
    assert torch.isnan(dq[0, :2]).all() and torch.isnan(dk[0, 0]).all() and torch.isnan(dv[0, 0]).all()
    for g, r in [(dq[0, 2:], ref_grads[0][0, 2:]), (dq[1], ref_grads[0][1]), (dk[0, 1], ref_grads[1][0, 1]),
                 (dk[1], ref_grads[1][1]), (dv[0, 1], ref_grads[2][0, 1]), (dv[1], ref_grads[2][1])]:
        assert torch.isfinite(g).all()
        tol = 1e-5 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(o[finite_o].float(), ref_o[finite_o].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_cpu_nonfinite_query_makes_its_kv_heads_gradients_nan(value):
    q, k, v, do = nonfinite_case("cpu", torch.float32, value)
    o, grads = run("reference", q, k, v, do, True, None)
    # The float64 oracle (the reference op's autograd) states the same rule.
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    o64 = torch.ops.kernelgate._attention_reference(leaves[0].view(2, 2, 2, 150, 64), leaves[1], leaves[2],
                                                    "causal", 0.0).view(2, 4, 150, 64)
    grads64 = torch.autograd.grad(o64, leaves, do.double())
    assert_rule(o, grads, o64, grads64, torch.float32)
    assert_rule(o64, grads64, o64, grads64, torch.float32)


def layouts_of_a_step(backend, device, dtype, shape=(2, 4, 2, 37, 16), qk_dense=False):
    """o, and the gradients the op hands back for its q, k and v, of a call as attention code
    makes it: q, k, v views of [batch, seq, heads, head_dim] projections (qk_dense: q and k dense
    [batch, heads, seq, head_dim], as kg.rope returns them), the output gradient a view of the
    [batch, seq, heads * head_dim] gradient of the output projection's input. backend
    "sdpa_cudnn": PyTorch's SDPA with its cuDNN kernel, not kernelgate."""
    b, h, hkv, s, d = shape
    gen = torch.Generator().manual_seed(5)
    x64 = [torch.randn(b, s, n, d, generator=gen, dtype=torch.float64) for n in (h, hkv, hkv)]
    x = [t.to(device, dtype).requires_grad_(True) for t in x64]
    q, k, v = (t.transpose(1, 2) for t in x)
    if qk_dense:
        q, k = q.contiguous(), k.contiguous()
    got = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        t.register_hook(lambda g, name=name: got.__setitem__(name, g))
    if backend == "sdpa_cudnn":
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with kg.use(force={"attention": backend}):
            o = kg.attention(q, k, v)
    w = torch.randn(b, s, h * d, generator=gen, dtype=torch.float64)
    (o.transpose(1, 2).reshape(b, s, h * d) * w.to(device, dtype)).sum().backward()
    return q, k, v, o, got, (x64, w)


def assert_layouts_kept(q, k, v, o, got, _):
    # o in q's layout, as SDPA returns it (for a q of [batch, seq, heads, head_dim] storage, attention
    # code's o.transpose(1, 2).reshape(...) is then a view); each gradient in its argument's layout.
    assert o.stride() == q.stride(), (o.stride(), q.stride())
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert got[name].stride() == t.stride(), (name, got[name].stride(), t.stride())


def assert_values_of_a_step(run, ref, dtype):
    """The backend's o and gradients of a step's layouts against the float64 definition (and the
    reference backend's error on the same call, as the sweep judges)."""
    q, k, v, o, got, (x64, w) = run
    leaves = [t.transpose(1, 2).requires_grad_(True) for t in x64]
    want = definition(*leaves, True, None)
    b, h, s, d = want.shape
    do = w.view(b, s, h, d).transpose(1, 2)
    want_grads = torch.autograd.grad(want, leaves, do)
    check_against_oracle("o", o.cpu(), ref[3].cpu(), want, dtype)
    for name, wg in zip("qkv", want_grads):
        check_against_oracle("d" + name, got[name].cpu(), ref[4][name].cpu(), wg, dtype)


@pytest.mark.parametrize("qk_dense", [False, True], ids=["views", "qk_dense"])
@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_cpu_outputs_and_gradients_keep_attention_codes_layout(backend, qk_dense):
    shape = (2, 4, 2, 37, 16)
    run = layouts_of_a_step(backend, "cpu", torch.float32, shape, qk_dense)
    assert_values_of_a_step(run, layouts_of_a_step("reference", "cpu", torch.float32, shape, qk_dense), torch.float32)
    if backend == "eager":
        assert run[3].stride() == run[0].stride()  # its training call is served with SDPA's own autograd
        return
    assert_layouts_kept(*run)


def test_bad_input_errors():
    q, k, v = (t.float() for t in inputs(1, 4, 2, 8, 16)[:3])
    with pytest.raises(ValueError, match=r"kg.attention: q must be a 4-D tensor \[batch, heads, seq, head_dim\], "
                       r"got a 3-D tensor of shape \(4, 8, 16\)"):
        kg.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"q's heads must be a multiple of k's kv_heads .* got q of shape "
                       r"\(1, 4, 8, 16\) and k of shape \(1, 3, 8, 16\)"):
        kg.attention(q, torch.randn(1, 3, 8, 16, dtype=q.dtype), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match=r"scale must be a non-zero number, or None .* got 0"):
        kg.attention(q, k, v, scale=0)
    for causal in ("none", "causal", 0, None):  # the op's mask string, a number: not a bool
        with pytest.raises(ValueError, match=rf"kg.attention: causal must be True or False, got {re.escape(repr(causal))}"):
            kg.attention(q, k, v, causal=causal)
    with pytest.raises(RuntimeError, match=r"q must be a floating-point tensor of dtype float32, float16 or "
                       r"bfloat16, got float64"):
        kg.attention(q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match=r"v must have the dtype of q \(float32\), got float16"):
        kg.attention(q, k, v.half())
    with pytest.raises(RuntimeError, match=r"seq"):
        kg.attention(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(RuntimeError, match=r"mask must be 'causal' or 'none', got 'sliding'"):
        torch.ops.kernelgate.attention(q.view(1, 2, 2, 8, 16), k, v, "sliding", 0.0)
    with pytest.raises(RuntimeError, match=r"scale must be finite .* got inf"):
        torch.ops.kernelgate.attention(q.view(1, 2, 2, 8, 16), k, v, "causal", float("inf"))


def test_mask_is_part_of_the_dispatch_key():
    q, k, v = (t.float() for t in inputs(1, 4, 2, 8, 16)[:3])
    qg = q.view(1, 2, 2, 8, 16)
    assert kg.explain("attention", qg, k, v, "causal").key != kg.explain("attention", qg, k, v, "none").key


# ---- on the GPU: ATen's fused kernels, each forced ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", FUSED + ["eager"])
def test_gpu_against_the_definition(backend, dtype):
    for shape in SHAPES + [(2, 16, 4, 1031, 128)]:
        if backend == "aten_cudnn" and shape[3] == 1:
            continue  # cuDNN refuses one query against one key: the backend says so (unsupported)
        for causal in (True, False):
            check(backend, "cuda", dtype, shape, causal, None)
    check(backend, "cuda", dtype, SHAPES[3], True, 0.3, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", FUSED + ["reference"])
def test_gpu_nonfinite_query_makes_its_kv_heads_gradients_nan(backend, value):
    q, k, v, do = nonfinite_case("cuda", torch.bfloat16, value)
    o, grads = run(backend, q, k, v, do, True, None)
    ref_o, ref_grads = run("reference", q, k, v, do, True, None)
    assert_rule(o, grads, ref_o, ref_grads, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_dense", [False, True], ids=["views", "qk_dense"])
@pytest.mark.parametrize("backend", FUSED + ["reference"])
def test_gpu_outputs_and_gradients_keep_attention_codes_layout(backend, qk_dense):
    # A step's shape (16 query heads over 4 kv heads, head_dim 128) at a shorter, odd sequence.
    # SDPA with its cuDNN kernel first, then the backend, then SDPA again, on q, k, v of the same
    # layouts, as in a program that calls SDPA elsewhere: ATen caches cuDNN's compiled backward by
    # q, k and v alone, so a backend handing cuDNN o, dout or the log-sum-exp in other strides than
    # SDPA's own backward does reads them wrongly after SDPA (or makes SDPA read its own wrongly).
    shape = (2, 16, 4, 301, 128)
    sdpa = layouts_of_a_step("sdpa_cudnn", "cuda", torch.bfloat16, shape, qk_dense)
    run = layouts_of_a_step(backend, "cuda", torch.bfloat16, shape, qk_dense)
    sdpa_after = layouts_of_a_step("sdpa_cudnn", "cuda", torch.bfloat16, shape, qk_dense)
    assert_layouts_kept(*run)
    ref = layouts_of_a_step("reference", "cuda", torch.bfloat16, shape, qk_dense)
    for r in (sdpa, run, sdpa_after):
        assert_values_of_a_step(r, ref, torch.bfloat16)
