"""Tests from the contracts: every op (the built-in ones and a Python-defined one) x every backend
available on the device x the cases the harness generates from the op's contract
(kernelgate._C.make_cases: bucket edges, odd and tiny shapes, every dtype, non-contiguous layouts,
value regimes, scalar test values, absent optionals, variants, grad and no-grad).

For each (op, backend):
  * forward and every gradient against the float64 oracle (_C.run_case: a decoy call first, GPU
    outputs poisoned): every case passes, or is unsupported with a reason, and at least one passes;
    the reference backend also against the reference op differentiated by autograd;
  * torch.library.opcheck, with and without gradients, on the cases' arguments;
  * torch.compile(fullgraph=True), forward and backward, equal to eager;
  * double backward equal to differentiating the reference twice, or the op's clear refusal;
  * no input (nor cotangent) is modified, forward or backward;
  * leading dims given as several dims ([*rows] as (2, 4, n)) against the oracle;
  * on the GPU (pytest -m gpu): the oracle on the quick grid for the CUDA backends, and the above
    with CUDA tensors, CUDA-graph capture and replay included.
And end to end on the CPU for a Python backend and a Python-defined op: validate, bench run,
policy show, the dispatcher, explain.

What is special to one op (its errors, its semantics, shapes the grid does not make) stays in
that op's own test file. pyops_example.py holds the Python-defined op and Python backends.
"""

import json
import os
import math
import re

import pytest
import torch

import kernelgate as kg
import pyops_example
from kernelgate import _C, cli
from kernelgate.testing import assert_cuda_graph_replays, check_against_oracle, oracle_metrics
from kernelgate.testing import case_fields as fields

INFO = {o["name"]: o for o in kg.ops()}  # at collection: before any test loads a plugin
OPS = sorted(INFO)
assert "softcap" in OPS and INFO["softcap"]["defined_in_python"]

# _C.run_case computes on CUDA device 0 where there is one, else on the CPU: test_oracle checks the
# backends of that device (on a GPU machine, on the small grid, beside test_gpu_oracle).
RUN_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small: every case kind of the quick grid at small sizes (the CI budget). GPU: the quick grid up
# to 2^24 elements (its hidden edges reach 65536).
GRID = {"small": ("quick", 1 << 14), "gpu": ("quick", 1 << 24)}

# Generated cases a backend is known to fail: what the sweeps find and the policy acts on (the
# backend is ranked in no region holding such a case), listed with why. Keyed by (op, backend), a
# test of the case's fields, and the reason. Such a test ends as xfailed, naming the cases, once
# every other case has passed; a listed case that passes fails the test if no listed case fails
# any more, so an entry goes when the backend is fixed.
ON_GPU = RUN_DEVICE == "cuda"


def _hidden_1(f):
    return "hidden=1," in f["dims"] + ","


def _dim(f, name):
    return int(dict(kv.split("=") for kv in f["dims"].split(",") if kv)[name])


# float16 linear_cross_entropy on 'large' values (x300) with hidden >= 4095: the float16 logits
# overflow (65504), in every backend, the reference included; the float64 oracle stays finite.
# The GPU grids hold such cases since a case's size is its largest tensor's (2026-12-01); the
# H200 sweep of that day found them (bench/results/h200/README.md). The fix is the harness's:
# a 'large' scale that keeps a float16 reduction of that length finite.
_LCE_F16_OVERFLOW = (
    lambda f: ON_GPU and f["dtype"] == "float16" and f["regime"] == "large" and _dim(f, "hidden") >= 4095,
    "float16 logits of 'large' inputs overflow at hidden >= 4095 in every backend, the reference "
    "included (the harness's float16 'large' scale is to be made finite for such reductions)")

# oneDNN's bfloat16 matmul on a CPU with AMX tiles (Sapphire Rapids and later) propagates the
# special regime's NaN and Inf of hidden into other logits than the same matmul without AMX
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 passes these cases): a row whose target is ignored gets NaN
# gradients where the oracle has none. Every CPU backend of linear_cross_entropy multiplies
# through ATen's matmul.
_CPU_AMX = (not ON_GPU and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
            and "AMX" in os.environ.get("ONEDNN_MAX_CPU_ISA", "AMX").upper())
_LCE_CPU_AMX = (
    lambda f: _CPU_AMX and f["regime"] == "special" and f["dtype"] == "bfloat16" and f["grad"] == "1",
    "on a CPU with AMX, oneDNN's bfloat16 matmul spreads a non-finite hidden value to other rows' "
    "gradients than the oracle has (not so with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)")


def _either(*entries):
    return (lambda f: any(e[0](f) for e in entries), "; or ".join(e[1] for e in entries))


# Attention's fused kernels (ATen's flash, cuDNN and memory-efficient), read on the H200: at
# 'large' values of a sequence of 1 or 2 the softmax is one-hot, so the gradients of q and k are
# exactly 0 (float64) up to rounding; the kernels' backward takes D = rowsum(dO o) from the
# 16-bit-rounded o, and dP - D is that rounding (bfloat16 grad of q 2.4e30 relative to a 1e-30
# oracle, grad of k 4.3e-2 where the budget is 7.8e-3; float16 4.3e-3 against 9.8e-4).
_ATTENTION_ONE_HOT = (
    lambda f: ON_GPU and f["regime"] == "large" and f["grad"] == "1" and _dim(f, "seq") <= 2
    and f["dtype"] != "float32",
    "at 'large' values of a sequence of 1 or 2 the softmax is one-hot and the gradients of q and k "
    "are 0 up to rounding: the fused backward's D = rowsum(dO o), from the 16-bit-rounded o, "
    "leaves that rounding in dP - D (up to 5e-2 relative where the budget is 7.8e-3)")

KNOWN_INCORRECT = {
    ("attention", "aten_flash"): _ATTENTION_ONE_HOT,
    ("attention", "aten_cudnn"): _ATTENTION_ONE_HOT,
    ("attention", "aten_efficient"): _either(_ATTENTION_ONE_HOT, (
        lambda f: ON_GPU and f["dtype"] == "float32" and (f["grad"] == "1" or f["regime"] == "special"),
        "the memory-efficient kernel in float32: a query row whose visible scores are all -inf "
        "(an Inf in q) gives NaN where the oracle's safe softmax gives 0, and its gradients land at "
        "up to 10x the reference's error (grad of v 3.5e-4 where the budget is 7.4e-5 at 'large' "
        "values; grad of q 3.2e-5 at one key, where the budget is 1e-5)")),
    ("linear_cross_entropy", "reference"): _either(_LCE_F16_OVERFLOW, _LCE_CPU_AMX),
    ("linear_cross_entropy", "kernelgate_cpu"): _LCE_CPU_AMX,
    ("linear_cross_entropy", "kernelgate_cpu_narrow_accum"): _LCE_CPU_AMX,
    ("linear_cross_entropy", "kernelgate_cuda"): _LCE_F16_OVERFLOW,
    ("linear_cross_entropy", "kernelgate_cuda_narrow_accum"): _LCE_F16_OVERFLOW,
    ("layer_norm", "aten"): (
        lambda f: (not ON_GPU and _hidden_1(f) and f["regime"] == "large" and f["dtype"] != "float32")
        or (ON_GPU and f["dtype"] == "float32" and f["regime"] == "offset" and f["grad"] == "1"),
        "ATen's layer_norm: on the CPU in float16 / bfloat16 over one element of ~5e3 it returns the "
        "bias off by up to 2^-5 (its mean in the input dtype); on CUDA its float32 backward on "
        "offset inputs (mean 1e3, spread 1) loses ~2e-5 of the gradient where the budget is ~1.5e-5"),
    ("rms_norm", "aten"): (
        lambda f: ON_GPU and (f["regime"] == "special" or (_hidden_1(f) and f["dtype"] == "float32")),
        "ATen's CUDA rms_norm spreads a NaN or Inf of one element to more of its row than the oracle "
        "has, and its float32 backward at hidden 1 is off by up to 4x the reference's error"),
    # Read on the H200 (tests/python/test_gated_delta_rule.py says how far off, per output).
    ("gated_delta_rule", "fla_chunk"): (
        lambda f: ON_GPU and f["grad"] == "0",
        "FLA's chunked forward computes with TF32 products in float32 and builds its final state "
        "from 16-bit-rounded factors in float16 / bfloat16 (its o too, at some shapes): outside the rule "
        "(its backward is refused "
        "on Hopper with Triton 3.4 to 3.7.0: KNOWN_REFUSALS)"),
    ("layer_norm", "kernelgate_cuda"): (
        lambda f: ON_GPU and _hidden_1(f) and f["dtype"] == "float32" and f["grad"] == "1",
        "at hidden 1 the gradient of x is exactly 0 (the output does not depend on x) and the reference "
        "returns exactly 0; our kernel returns float32 rounding of 1e-4 relative: to be fixed in the kernel"),
    ("rms_norm", "kernelgate_cuda"): (
        lambda f: ON_GPU and _hidden_1(f) and f["dtype"] == "float32" and f["regime"] == "large"
        and f["grad"] == "1",
        "at hidden 1 the gradient of x is w * eps / |x|^3, which for |x| ~ 1e2 is float32 rounding of "
        "the terms that cancel; the reference rounds it to 0 (error 1), ours keeps the rounding "
        "(error ~2e3 relative to a value of ~1e-12): to be fixed in the kernel"),
}

# The field's libraries, as the H200 run of 2026-12-01 found them (bench/results/h200/gpu_tests.json).
# Their forward and backward are theirs: what our rule finds beyond its budget is recorded here,
# and the sweeps rank them out of those regions.
def _grad(f, *dtypes):
    return f["grad"] == "1" and f["dtype"] in dtypes


_LCE_LIGER = (
    lambda f: f["regime"] == "special" or _grad(f, "bfloat16") or (_hidden_1(f) and _grad(f, "float32")),
    "Liger's fused linear cross-entropy: on non-finite inputs its chunked loss and gradients put NaN "
    "where the oracle has finite values (and misses some); in bfloat16 its gradients, computed in "
    "the forward for a unit cotangent in bfloat16 and scaled after, land at 2-5x the budget (grad "
    "of weight and bias at small hidden, grad of hidden at 2 classes); in float32 at hidden 1 "
    "grad of bias 1.7e-5 where the budget is 1.2e-5")

KNOWN_INCORRECT.update({
    ("rms_norm", "liger"): (
        lambda f: _hidden_1(f) and _grad(f, "float32", "bfloat16"),
        "at hidden 1 the gradient of x is w * eps / (x^2 + eps)^1.5, the rounding of terms that "
        "cancel: Liger's backward lands at ~2.5x the reference's error (and 1e4 relative on "
        "'large' values, where the value is ~1e-12)"),
    ("rms_norm", "fla"): (
        lambda f: _hidden_1(f) and _grad(f, "float32"),
        "at hidden 1 the gradient of x is the rounding of terms that cancel: FLA's float32 backward "
        "lands at ~5x the reference's error"),
    ("layer_norm", "liger"): (
        lambda f: _hidden_1(f) and _grad(f, "float32"),
        "at hidden 1 the gradient of x is exactly 0 (the output does not depend on x): Liger's float32 "
        "backward returns rounding of ~1e-4 relative"),
    ("layer_norm", "fla"): (
        lambda f: _hidden_1(f) and _grad(f, "float32"),
        "at hidden 1 the gradient of x is exactly 0 (the output does not depend on x): FLA's float32 "
        "backward returns rounding of ~1e-4 relative"),
    ("cross_entropy", "liger"): (
        lambda f: (f["regime"] == "special" and f["grad"] == "1") or _grad(f, "float16", "bfloat16"),
        "Liger's cross-entropy computes the logits' gradient in its forward, in the logits' dtype, for "
        "a unit cotangent, and our backward scales it: in float16 / bfloat16 that rounds twice (2-5x "
        "the budget for a random cotangent; loss.backward()'s cotangent of exactly 1 is not scaled); "
        "with label smoothing a NaN or Inf logit makes its whole row's gradient NaN"),
    ("linear_cross_entropy", "liger"): _LCE_LIGER,
    ("linear_cross_entropy", "liger_fp32_accum"): _LCE_LIGER,
})

# Backends that serve only calls that need no gradient on a device, and what their can_implement
# says for one that does (test_forward_only_backends_say_why): the gradient checks leave them out.
FORWARD_ONLY = {
    "cpu": {("rms_norm", "aten"): "ATen's fused rms_norm backward exists only for CUDA",
            ("layer_norm", "aten"): "ATen's CPU layer norm keeps its statistics in x's dtype"},
    "cuda": {("gated_delta_rule", "fla_fused_recurrent"): "FLA's fused-recurrent kernel has no backward of ours"},
}

# Ops whose backward does not keep every input, so that double backward cannot differentiate the
# reference again (src/core/op_mechanism.cpp), and linear_cross_entropy (its own autograd).
REFUSES_DOUBLE_BACKWARD = {"add_rms_norm", "rope", "linear_cross_entropy"}
REFUSAL = r"double backward \(create_graph=True\) is not supported"
# Ops whose plain PyTorch code PyTorch itself cannot differentiate twice: their eager backend
# refuses as the code does without kernelgate (attention: F.scaled_dot_product_attention's fused
# kernels have no derivative of their backward; attention_varlen: nor have its varlen kernels).
EAGER_REFUSES_DOUBLE_BACKWARD = {
    "attention": r"derivative for aten::_scaled_dot_product_\w+_backward is not implemented",
    "attention_varlen": r"backward through torch_attn\._varlen_attn_backward\S* but no autograd formula was registered"}


# Built-in backends that implement 16-bit dtypes only (ATen's flash and cuDNN attention kernels):
# the compile check takes them on a case they serve, as it does the libraries' narrow backends.
NARROW_BUILTINS = {("attention", "aten_flash"), ("attention", "aten_cudnn")}

LIBRARY_BACKENDS = {(b.op, b.name) for b in kg.backends.BACKENDS}  # the field's libraries: CUDA only


def serves_device(op: str, backend: str, device: str) -> bool:
    """Backends named for a device (kernelgate_cpu, kernelgate_cuda_narrow_accum) and the field's
    libraries' (CUDA) serve only that device's tensors; every other one (reference, aten, Python
    backends) serves both."""
    if (op, backend) in LIBRARY_BACKENDS:
        return device == "cuda"
    tokens = set(backend.split("_"))
    if "cpu" in tokens:
        return device == "cpu"
    if "cuda" in tokens:
        return device == "cuda"
    return True


def backends(op: str, device: str):
    """The op's backends for the device. On the GPU, built-in and library backends are listed even
    where they are unavailable: each GPU test asserts it is available, so none goes missing
    silently (the GPU machine gets the libraries' wheels)."""
    out = []
    for b in INFO[op]["backends"]:
        if not serves_device(op, b["name"], device):
            continue
        library = (op, b["name"]) in LIBRARY_BACKENDS
        if b["available"] or (device == "cuda" and (b["kind"] != "python" or library)):
            out.append(b["name"])
    return out


def pairs(device: str):
    return [pytest.param(op, b, id=f"{op}-{b}") for op in OPS for b in backends(op, device)]


def grad_pairs(device: str):
    return [p for p in pairs(device) if tuple(p.values) not in forward_only(device)]


def refused_backward(op: str, backend: str, device: str) -> str:
    """The words of the error a library raises in its backward on this machine (KNOWN_REFUSALS),
    or ""."""
    refused, words, _ = KNOWN_REFUSALS.get((op, backend), (lambda f: False, "", ""))
    return words if device == "cuda" and refused({"grad": "1"}) else ""


def forward_only(device: str) -> dict:
    """FORWARD_ONLY, and the backends whose library refuses their backward on this machine: the
    integration checks run them without gradients (the oracle records each refusal)."""
    out = dict(FORWARD_ONLY[device])
    for op, backend in KNOWN_REFUSALS:
        if refused_backward(op, backend, device):
            out[op, backend] = KNOWN_REFUSALS[op, backend][2]
    return out


def require_available(op: str, backend: str) -> None:
    b = next(b for b in INFO[op]["backends"] if b["name"] == backend)
    assert b["available"], f"{op} backend {backend} is unavailable here: {b['reason']}"


# ---- cases ---------------------------------------------------------------------------------------

def cases(op: str, grid: str = "smoke", dtype: str = "float32", **where):
    """(case_id, encoded) of the op's generated cases (small sizes) whose fields match `where`."""
    out = []
    for cid, enc in _C.make_cases(op, grid, dtypes=[dtype], max_elements=1 << 14):
        f = fields(enc)
        if all(f[k] == v for k, v in where.items()):
            out.append((cid, enc))
    assert out, f"{op}: no {grid} case with dtype {dtype} and {where}"
    return out


def op_fn(op: str):
    return getattr(torch.ops.kernelgate, op).default


def as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def call_args(encoded: str, device: str, float64: bool = False):
    """The case's arguments in schema order and the leaves gradients are taken against."""
    args, leaves = _C.case_arguments(encoded, on_gpu=device == "cuda", float64=float64)
    return args, [l for l in leaves if l is not None]


def serves(op: str, backend: str, args) -> bool:
    with kg.use(force={op: backend}):
        return kg.explain(op, *args).backend == backend


def served_cases(op, backend, device, candidates):
    """The candidate cases that `backend` serves when forced (at least one)."""
    out = [(cid, enc) for cid, enc in candidates if serves(op, backend, call_args(enc, device)[0])]
    assert out, f"{backend} serves none of {[cid for cid, _ in candidates]}"
    return out


def cotangents(outs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs]


def grads(outs, leaves, cots, create_graph=False):
    """Gradients of the outputs that need one, w.r.t. the leaves; zeros where one is unused."""
    used = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    return list(torch.autograd.grad([o for o, _ in used], leaves, [c for _, c in used],
                                    create_graph=create_graph, allow_unused=True, materialize_grads=True))


# ---- production calls fall in regions the sweep measures -----------------------------------------

def test_rope_production_shapes_are_swept_in_attention_codes_layout():
    """rope's q and k as attention code makes them (q_proj(x).view(b, s, h, d).transpose(1, 2)):
    the grid sweeps its production shapes in that layout, and a case of it falls in the same
    region as such a call (strided, not the contiguous one)."""
    made = [fields(enc) for _, enc in _C.make_cases("rope", "full", dtypes=["bfloat16"], max_elements=1 << 30)]
    step = "batch=4,cos_batch=1,head_dim=128,kv_heads=4,q_heads=16,seq=2048"
    at_step = {(f["layout"], f["grad"]) for f in made if f["dims"] == step}
    assert at_step == {("contiguous", "1"), ("contiguous", "0"), ("transposed", "1"), ("transposed", "0")}, at_step
    # A small transposed case: its q and k are the view attention code passes.
    (cid, enc), *_ = cases("rope", "quick", "bfloat16", layout="transposed", regime="normal", grad="1")
    args, _ = call_args(enc, "cpu")
    q, k = args[0], args[1]
    assert not q.is_contiguous() and q.transpose(1, 2).is_contiguous(), (cid, q.stride())
    assert not k.is_contiguous() and k.transpose(1, 2).is_contiguous(), (cid, k.stride())
    b, h, s, d = q.shape
    qv = torch.randn(b, s, h, d, dtype=q.dtype).transpose(1, 2).requires_grad_()
    kv = torch.randn(b, s, k.shape[1], d, dtype=k.dtype).transpose(1, 2).requires_grad_()
    key = kg.explain("rope", qv, kv, args[2], args[3]).key
    assert key == kg.explain("rope", *args).key and " strided " in key, key


def test_linear_cross_entropy_production_shapes_are_swept_without_a_bias():
    """An lm_head has no bias: linear_cross_entropy's production shapes are swept without one
    (the key of a call without a bias is another region than with one); the mid-size shape
    still has cases with and without."""
    made = [fields(enc) for _, enc in _C.make_cases("linear_cross_entropy", "full", dtypes=["bfloat16"],
                                                    max_elements=1 << 30)]
    step = [f for f in made if f["dims"] == "classes=128256,hidden=2048,rows=8192"]
    assert step and {f["optional"] for f in step} == {"0"}, {f["optional"] for f in step}
    assert {f["optional"] for f in made} == {"0", "1"}
    h, w = torch.randn(8, 16), torch.randn(32, 16)
    t = torch.randint(0, 32, (8,))
    without = kg.explain("linear_cross_entropy", h, w, t).key
    with_bias = kg.explain("linear_cross_entropy", h, w, t, torch.randn(32)).key
    assert without != with_bias and ",none " in without, (without, with_bias)


# ---- forward and every gradient against the float64 oracle --------------------------------------

def backend_kind(op: str, backend: str) -> str:
    return next(b["kind"] for b in INFO[op]["backends"] if b["name"] == backend)


# Where a library refuses calls by raising (a guard of its own), with the words its error has: the
# run records the refusal (disposition "crashed"), nothing is served wrong; xfailed with the
# reason once everything else passes.
def _fla_refuses_gated_backward():
    from kernelgate.fla import _fla_refuses_gated_backward as refuses

    return ON_GPU and refuses(torch.device("cuda"))


KNOWN_REFUSALS = {
    ("gated_delta_rule", "fla_chunk"): (
        lambda f: f["grad"] == "1" and _fla_refuses_gated_backward(), "chunk_bwd_dqkwg",
        "FLA refuses its gated chunk backward on Hopper with Triton 3.4 to 3.7.0 (its own guard: a "
        "wrong result of chunk_bwd_dqkwg there, it says)"),
}


def check_oracle(op: str, backend: str, sizes: str, dtype: str = "") -> None:
    """Every case of the grid (of one dtype where given) through the oracle."""
    grid, max_elements = GRID[sizes]
    made = _C.make_cases(op, grid, max_elements=max_elements, **({"dtypes": [dtype]} if dtype else {}))
    assert made, f"{op}: the {grid} grid made no cases"
    passed, unsupported, failures, known, listed_passes = 0, [], [], [], []
    listed, why = KNOWN_INCORRECT.get((op, backend), (lambda f: False, ""))
    refused, words, refusal = KNOWN_REFUSALS.get((op, backend), (lambda f: False, "", ""))
    refusals = []
    if backend_kind(op, backend) == "eager":
        # The op as plain PyTorch code is what the user's program computes without kernelgate:
        # where it is less accurate than the rule, that is recorded (the sweeps rank it out of
        # those regions), not a defect of ours. It must still compute the op: every float32 case
        # of ordinary values passes.
        listed = lambda f: not (f["regime"] == "normal" and f["dtype"] == "float32")  # noqa: E731
        why = "the plain PyTorch code is less accurate than the oracle rule on these cases"
    for cid, enc in made:
        r = _C.run_case(enc, backend)
        f = fields(enc)
        if r["disposition"] == "passed":
            passed += 1
            if listed(f):
                listed_passes.append(cid)
        elif r["disposition"] == "unsupported" and r["reason"]:
            unsupported.append(f"{cid}: {r['reason']}")
        elif r["disposition"] == "crashed" and refused(f) and words in r["reason"]:
            refusals.append(f"{cid}: {r['reason']}")
        else:
            line = f"{cid}: {r['disposition']}: {r['reason'] or '(no reason given)'}"
            (known if listed(f) and r["disposition"] == "incorrect" else failures).append(line)
    assert not failures, f"{backend} on {op}: {len(failures)} of {len(made)} cases failed:\n" + "\n".join(failures)
    assert passed, f"{backend} on {op} passed none of its {len(made)} cases:\n" + "\n".join(unsupported)
    assert known or not listed_passes or backend_kind(op, backend) == "eager", (
        f"{backend} on {op}: the KNOWN_INCORRECT entry is gone: {listed_passes}")
    if known:
        pytest.xfail(f"{why} ({len(known)} cases, e.g. {known[0]})")
    if refusals:
        pytest.xfail(f"{refusal} ({len(refusals)} cases, e.g. {refusals[0][:300]})")


@pytest.mark.parametrize("op,backend", pairs(RUN_DEVICE))
def test_oracle(op, backend):
    if RUN_DEVICE == "cuda":
        require_available(op, backend)
    check_oracle(op, backend, "small")


def gpu_oracle_params():
    """Each (op, backend) pair; a library backend's once per dtype: its Triton kernels autotune at
    every new shape (FLA's norms ~0.6 s a case), so its cases are spread over the xdist workers."""
    implements = {(b.op, b.name): {str(d).split(".")[-1] for d in b.dtypes} for b in kg.backends.BACKENDS}
    out = []
    for p in pairs("cuda"):
        op, backend = p.values
        if (op, backend) in LIBRARY_BACKENDS:
            out += [pytest.param(op, backend, d, id=f"{op}-{backend}-{d}")
                    for d in INFO[op]["dtypes"] if d in implements[op, backend]]
        else:
            out.append(pytest.param(op, backend, "", id=f"{op}-{backend}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend,dtype", gpu_oracle_params())
def test_gpu_oracle(op, backend, dtype):
    require_available(op, backend)
    check_oracle(op, backend, "gpu", dtype)


# Where a reference backend is known to differ from its reference op beyond the rule, and why
# (keyed by op; a test of the case's fields and the output index). As KNOWN_INCORRECT: xfailed
# with the reason once everything else agrees, failed if no listed output differs any more.
# None today: linear_cross_entropy's (a bfloat16 cotangent rounded before it scaled the forward's
# gradients) went with its float32 loss and cotangent.
KNOWN_REFERENCE_DIFFERENCES = {}


def check_reference_backend(op, device):
    """run_case's budget is the reference backend at the tested dtype, so on the reference backend
    itself it checks only NaN/Inf patterns. Here the reference backend (its own forward and
    backward functions, routed) is held to the reference op at the same dtype differentiated by
    ATen's autograd instead, an independent budget, on every smoke case of every dtype."""
    listed, why = KNOWN_REFERENCE_DIFFERENCES.get(op, (lambda f, i: False, ""))
    known, unexpectedly_fine = [], []
    for dtype in INFO[op]["dtypes"]:
        for cid, enc in cases(op, dtype=dtype):
            grad = fields(enc)["grad"] == "1"

            def run(fn, float64=False, cots=None):
                args, leaves = call_args(enc, device, float64)
                outs = as_list(fn(*args))
                if not grad:
                    return outs, None
                cots = cotangents(outs) if cots is None else [c.to(o.dtype) for c, o in zip(cots, outs)]
                return outs + grads(outs, leaves, cots), cots

            with kg.use(force={op: "reference"}):
                got, cots = run(op_fn(op))
            ref, _ = run(reference_op(op), cots=cots)
            ora, _ = run(reference_op(op), True, cots)
            for i, (g, r, o) in enumerate(zip(got, ref, ora, strict=True)):
                failure = oracle_metrics(f"{cid}: tensor {i}", g, r, o, g.dtype)["failure"]
                if listed(fields(enc), i):
                    known.append(failure) if failure else unexpectedly_fine.append(f"{cid}: tensor {i}")
                else:
                    assert not failure, failure
    assert known or not unexpectedly_fine, f"the listed difference is gone: {unexpectedly_fine}"
    if known:
        pytest.xfail(f"{why} ({len(known)} outputs, e.g. {known[0]})")


@pytest.mark.parametrize("op", OPS)
def test_reference_backend_against_the_reference_op(op):
    check_reference_backend(op, "cpu")


@pytest.mark.parametrize("op,backend", sorted(FORWARD_ONLY["cpu"]))
def test_forward_only_backends_say_why(op, backend):
    """A FORWARD_ONLY backend serves the no-grad call and declines the grad one with a reason."""
    (_, grad_case), = [c for c in cases(op, grad="1", regime="normal", strings="") if fields(c[1])["dims"] == mid_dims(op)
                       and fields(c[1])["layout"] == "contiguous" and fields(c[1])["optional"] == "1"]
    args, _ = call_args(grad_case, "cpu")
    with kg.use(force={op: backend}):
        with torch.no_grad():
            assert kg.explain(op, *args).backend == backend
        e = kg.explain(op, *args)
    assert e.backend == "reference"
    assert FORWARD_ONLY["cpu"][op, backend] in next(c.reason for c in e.candidates if c.backend == backend), str(e)


# ---- PyTorch integration: opcheck, torch.compile, double backward ----------------------------------

def integration_cases(op, backend, device, grad=None, **where):
    """Cases of the smoke grid with normal values that `backend` serves, in float32 or, for a
    backend that serves none in float32 (kernel-fun's 16-bit kernels), the first dtype it
    serves: both grad modes (or `grad`), a non-contiguous layout, absent optionals, every
    variant."""
    if grad is not None:
        where["grad"] = "1" if grad else "0"
    for dtype in sorted(INFO[op]["dtypes"], key=lambda d: d != "float32"):
        candidates = cases(op, dtype=dtype, regime="normal", **where)
        out = [(cid, enc) for cid, enc in candidates if serves(op, backend, call_args(enc, device)[0])]
        if out:
            return out
    return served_cases(op, backend, device, cases(op, regime="normal", **where))  # fails, naming them


# opcheck's checks that depend on the backend (aliasing and mutation; the Meta shapes and strides
# against the backend's outputs) run on the layouts, absent optionals and variants; all of them
# (the autograd registration and AOT dispatch too) on the smallest shape, with and without
# gradients.
BACKEND_CHECKS = ("test_schema", "test_faketensor")


def elements(encoded):
    return math.prod(max(int(v.split("=")[1]), 1) for v in fields(encoded)["dims"].split(","))


def check_opcheck(op, backend, device):
    # opcheck's autograd checks run the backward: without gradients where the library refuses it
    served = integration_cases(op, backend, device, grad=False if refused_backward(op, backend, device) else None)
    smallest = fields(min(served, key=lambda c: elements(c[1]))[1])["dims"]
    for cid, enc in served:
        f = fields(enc)
        full = f["dims"] == smallest  # the smoke grid's odd shape, contiguous, in both grad modes
        if not full and f["layout"] == "contiguous" and f["optional"] == "1" and not f["strings"]:
            continue  # the mid shape's plain cases: the odd shape has them
        args, _ = call_args(enc, device)
        with kg.use(force={op: backend}):
            if full:
                torch.library.opcheck(op_fn(op), args)
            else:
                torch.library.opcheck(op_fn(op), args, test_utils=BACKEND_CHECKS)


@pytest.mark.parametrize("op,backend", pairs("cpu"))
def test_opcheck(op, backend):
    check_opcheck(op, backend, "cpu")


def compiled_block(op, args):
    """A function calling the op on `args`, on each of its variants and with its optional tensor
    arguments absent, with work around the calls; for torch.compile, one graph."""
    schema = op_fn(op)._schema.arguments
    calls = [list(args)]
    for name, values in INFO[op]["variant_args"]:
        i = next(i for i, a in enumerate(schema) if a.name == name)
        calls += [[v if j == i else a for j, a in enumerate(args)] for v in values if v != args[i]]
    optional = [i for i, a in enumerate(schema) if isinstance(a.type, torch.OptionalType) and torch.is_tensor(args[i])]
    if optional:
        calls.append([None if j in optional else a for j, a in enumerate(args)])

    def block(*xs):
        outs = []
        for call in calls:
            outs += as_list(op_fn(op)(*[xs[j] if torch.is_tensor(a) else a for j, a in enumerate(call)]))
        return [o * 2 for o in outs]

    return block


def check_compile(op, device):
    """Compiled once (fullgraph), run with each backend forced: forward and gradients equal to
    eager with the same backend. Without gradients too where a backend serves only such calls."""
    fwd_only = forward_only(device)
    no_grad_only = [b for o, b in fwd_only if o == op]
    elsewhere = []  # backends that implement no call of the default form
    for grad in (True, False) if no_grad_only else (True,):
        (cid, enc), = [c for c in cases(op, regime="normal", layout="contiguous", optional="1", strings="",
                                        grad="1" if grad else "0") if fields(c[1])["dims"] == mid_dims(op)]
        args, _ = call_args(enc, device)
        named = backends(op, device) if grad else ["reference", *no_grad_only]
        served = [b for b in named if serves(op, b, args) and not (grad and (op, b) in fwd_only)]
        for backend in set(named) - set(served):
            if (op, backend) in fwd_only:
                continue
            library = any((b.op, b.name) == (op, backend) for b in kg.backends.BACKENDS)
            assert library or (op, backend) in NARROW_BUILTINS, f"{backend} does not serve {cid}"
            elsewhere.append(backend)
        assert "reference" in served, (cid, served)
        compile_and_compare(op, cid, enc, device, served, grad)
    # A library backend that implements one form only (kernel-fun's causal_conv1d: silu without a
    # bias, 16-bit dtypes): compiled on the first contiguous case of the grid it serves.
    for backend in elsewhere:
        cid, enc = integration_cases(op, backend, device, grad=True, layout="contiguous")[0]
        compile_and_compare(op, cid, enc, device, [backend], True)


def compile_and_compare(op, cid, enc, device, names, grad):
    args, leaves = call_args(enc, device)
    block = compiled_block(op, args)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    for backend in names:
        with kg.use(force={op: backend}):
            got, eager = compiled(*args), block(*args)
            for i, (g, e) in enumerate(zip(got, eager, strict=True)):
                torch.testing.assert_close(g, e, msg=lambda m: f"{backend}, {cid}, output {i}: {m}")
            if grad:
                cots = cotangents(eager)
                for i, (g, e) in enumerate(zip(grads(got, leaves, cots), grads(eager, leaves, cots), strict=True)):
                    torch.testing.assert_close(g, e, msg=lambda m: f"{backend}, {cid}, gradient {i}: {m}")


def mid_dims(op):
    """The dims of the smoke grid's mid-size shape (the one its layouts and regimes use)."""
    return fields(cases(op, layout="row_strided")[0][1])["dims"]


@pytest.mark.parametrize("op", OPS)
def test_torch_compile_fullgraph_matches_eager(op):
    check_compile(op, "cpu")


def check_double_backward(op, backend, device):
    """Gradients taken with create_graph=True, and the gradient of their dot product with random
    tensors, against the reference differentiated twice (the oracle rule, the reference at the
    dtype setting the budget); or the op's refusal, for an op listed as refusing."""
    for cid, enc in integration_cases(op, backend, device, grad=True):
        args, leaves = call_args(enc, device)
        with kg.use(force={op: backend}):
            outs = as_list(op_fn(op)(*args))
            cots = cotangents(outs)
            # The eager backend is differentiated by PyTorch's autograd: twice too.
            if op in REFUSES_DOUBLE_BACKWARD and backend_kind(op, backend) != "eager":
                with pytest.raises(RuntimeError, match=REFUSAL):
                    grads(outs, leaves, cots, create_graph=True)
                continue
            try:
                got, vs = second_order(outs, leaves, cots)
            except RuntimeError as exc:
                # The plain code's refusal, where PyTorch picks a kernel without a double backward.
                if not (op in EAGER_REFUSES_DOUBLE_BACKWARD and backend_kind(op, backend) == "eager"
                        and re.search(EAGER_REFUSES_DOUBLE_BACKWARD[op], str(exc))):
                    raise
                continue
        ref_args, ref_leaves = call_args(enc, device)
        ref, _ = second_order(as_list(reference_op(op)(*ref_args)), ref_leaves, cots, vs)
        ora_args, ora_leaves = call_args(enc, device, float64=True)
        ora, _ = second_order(as_list(reference_op(op)(*ora_args)), ora_leaves, [c.double() for c in cots],
                              [v.double() for v in vs])
        dtype = leaves[0].dtype
        for i, (g, r, o) in enumerate(zip(got, ref, ora, strict=True)):
            order = "first" if i < len(leaves) else "second"
            check_against_oracle(f"{cid}: {order}-order gradient {i % len(leaves)}", g, r, o, dtype)


def reference_op(op):
    return getattr(torch.ops.kernelgate, f"_{op}_reference").default


def second_order(outs, leaves, cots, vs=None):
    """First-order gradients (create_graph=True) and the gradient of their dot product with
    random tensors `vs` (drawn if not given), w.r.t. the same leaves; and `vs`."""
    first = grads(outs, leaves, cots, create_graph=True)
    vs = cotangents(first, seed=1) if vs is None else vs
    dot = sum((g * v).sum() for g, v in zip(first, vs) if g.requires_grad)
    assert torch.is_tensor(dot), "no first-order gradient depends on the inputs"
    second = torch.autograd.grad(dot, leaves, allow_unused=True, materialize_grads=True)
    return [g.detach() for g in first] + [g.detach() for g in second], vs


@pytest.mark.parametrize("op,backend", grad_pairs("cpu"))
def test_double_backward(op, backend):
    check_double_backward(op, backend, "cpu")


@pytest.mark.parametrize("op", [op for op in OPS if op not in REFUSES_DOUBLE_BACKWARD])
def test_the_references_second_derivatives_match_finite_differences(op):
    """The double-backward check's oracle is the reference differentiated twice, so that is
    checked on its own: for each first-order gradient g_l (float64, a smoke case), the gradient of
    g_l . v_l along a random direction d equals v_l . (g_l(x + e d) - g_l(x - e d)) / 2e. A
    reference whose backward autograd cannot differentiate again (a Function's backward written
    with once_differentiable or in-place ops) gives a second derivative that fails it."""
    cid, enc = integration_cases(op, "reference", "cpu", grad=True)[0]
    args, per_arg = _C.case_arguments(enc, on_gpu=False, float64=True)
    named = [(n, x) for n, x in zip(INFO[op]["tensor_args"], per_arg, strict=True) if x is not None]
    leaves = [x for _, x in named]
    gen = torch.Generator().manual_seed(2)
    # Only the inputs the op differentiates move (rope's cos and sin get no gradient, by contract).
    dirs = [torch.randn(x.shape, generator=gen, dtype=torch.float64) * (n in INFO[op]["gradients"])
            for n, x in named]

    def first_order(create_graph=False):
        outs = as_list(reference_op(op)(*args))
        return grads(outs, leaves, cotangents(outs), create_graph=create_graph)

    first = first_order(create_graph=True)
    vs = cotangents(first, seed=1)
    along = []  # d . grad(g_l . v_l), before the leaves move
    for g, v in zip(first, vs):
        if not g.requires_grad:  # a gradient that does not depend on the inputs
            along.append((torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)))
            continue
        second = torch.autograd.grad((g * v).sum(), leaves, allow_unused=True, materialize_grads=True,
                                     retain_graph=True)
        along.append((sum((s * d).sum() for s, d in zip(second, dirs)),
                      sum((s.abs() * d.abs()).sum() for s, d in zip(second, dirs))))
    del first
    eps = 1e-6
    with torch.no_grad():
        for x, d in zip(leaves, dirs):
            x.add_(eps * d)
    plus = first_order()
    with torch.no_grad():
        for x, d in zip(leaves, dirs):
            x.sub_(2 * eps * d)
    minus = first_order()
    for l, ((analytic, size), v) in enumerate(zip(along, vs)):
        fd = ((plus[l] - minus[l]) * v).sum() / (2 * eps)
        assert abs(analytic - fd) <= 1e-6 * (size + fd.abs()) + 1e-9, (
            f"{cid}: gradient {l}: second derivative along a direction {float(analytic):.6e}, "
            f"finite differences {float(fd):.6e}")


# ---- no backend modifies its inputs --------------------------------------------------------------

def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_unchanged(before, after, what):
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        same = b.shape == a.shape and torch.equal(b.reshape(-1).view(torch.uint8), a.detach().reshape(-1).view(torch.uint8))
        assert same, f"{what}: tensor {i} was modified"


def check_inputs_unmodified(op, backend, device):
    """Every argument tensor and leaf (padding included: the leaves of strided views are compared
    whole), and the cotangents, bit for bit before and after the forward and the backward (or
    the library's refusal of its backward, where KNOWN_REFUSALS lists one for this machine)."""
    candidates = [(cid, enc) for dt in INFO[op]["dtypes"] for cid, enc in cases(op, dtype=dt)]
    words = refused_backward(op, backend, device)
    for cid, enc in served_cases(op, backend, device, candidates):
        args, leaves = call_args(enc, device)
        inputs = [a for a in args if torch.is_tensor(a)] + leaves
        before = snapshot(inputs)
        with kg.use(force={op: backend}):
            outs = as_list(op_fn(op)(*args))
            assert_unchanged(before, inputs, f"{cid}: forward")
            if fields(enc)["grad"] == "1":
                cots = cotangents(outs)
                cots_before = snapshot(cots)
                if words:
                    with pytest.raises(RuntimeError, match=words):
                        grads(outs, leaves, cots)
                else:
                    grads(outs, leaves, cots)
                assert_unchanged(before, inputs, f"{cid}: backward")
                assert_unchanged(cots_before, cots, f"{cid}: backward, cotangents")


@pytest.mark.parametrize("op,backend", pairs("cpu"))
def test_inputs_unmodified(op, backend):
    check_inputs_unmodified(op, backend, "cpu")


# ---- leading dims given as several dims ----------------------------------------------------------

def variadic_args(op):
    """Tensor arguments whose named dims start with a variadic one ("x: [*rows, hidden]")."""
    out = set()
    for entry in INFO[op]["dims"].split(";"):
        name, dims = entry.split(":", 1)
        if dims.strip().lstrip("[").startswith("*"):
            out.add(name.strip().rstrip("?"))
    return out


VARIADIC_OPS = [op for op in OPS if variadic_args(op)]


def check_leading_dims(op, backend, device):
    """[*rows, ...] as (2, 4, rows / 8, ...): outputs and gradients against the oracle on the same
    inputs (the generated cases give *rows as one dim)."""
    names = variadic_args(op)
    schema = [a.name for a in op_fn(op)._schema.arguments]
    grad = (op, backend) not in forward_only(device)
    cid, enc = served_cases(op, backend, device, cases(op, regime="normal", grad="1" if grad else "0", optional="1",
                                                        layout="contiguous", strings=""))[0]
    args, _ = call_args(enc, device)
    rows, dtype = args[0].shape[0], args[0].dtype
    assert rows % 8 == 0, cid
    split = [a.detach().reshape(2, 4, rows // 8, *a.shape[1:]) if n in names else a.detach() if torch.is_tensor(a) else a
             for n, a in zip(schema, args)]

    def run(fn, cast=None, cots=None):
        xs = [a.to(cast or a.dtype).clone().requires_grad_(orig.requires_grad) if torch.is_tensor(a) else a
              for a, orig in zip(split, args)]
        outs = as_list(fn(*xs))
        if not grad:
            return outs, None
        cots = cotangents(outs) if cots is None else [c.to(cast or c.dtype) for c in cots]
        return outs + grads(outs, [x for x in xs if torch.is_tensor(x) and x.requires_grad], cots), cots

    with kg.use(force={op: backend}):
        got, cots = run(op_fn(op))
    ref, _ = run(reference_op(op), cots=cots)
    ora, _ = run(reference_op(op), torch.float64, cots)
    assert got[0].shape[:3] == (2, 4, rows // 8), got[0].shape
    for i, (g, r, o) in enumerate(zip(got, ref, ora, strict=True)):
        check_against_oracle(f"{cid} with rows as (2, 4, {rows // 8}): tensor {i}", g, r, o, dtype)


@pytest.mark.parametrize("op,backend", [p for p in pairs("cpu") if p.values[0] in VARIADIC_OPS])
def test_leading_dims(op, backend):
    check_leading_dims(op, backend, "cpu")


# ---- the same on the GPU (pytest -m gpu) -----------------------------------------------------------

GPU_PAIRS = pairs("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", GPU_PAIRS)
def test_gpu_opcheck(op, backend):
    require_available(op, backend)
    check_opcheck(op, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_torch_compile_fullgraph_matches_eager(op):
    for backend in backends(op, "cuda"):
        require_available(op, backend)
    check_compile(op, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", grad_pairs("cuda"))
def test_gpu_double_backward(op, backend):
    require_available(op, backend)
    check_double_backward(op, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", GPU_PAIRS)
def test_gpu_inputs_unmodified(op, backend):
    require_available(op, backend)
    check_inputs_unmodified(op, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", [p for p in GPU_PAIRS if p.values[0] in VARIADIC_OPS])
def test_gpu_leading_dims(op, backend):
    require_available(op, backend)
    check_leading_dims(op, backend, "cuda")


def check_cuda_graph(op, backend, device):
    """Forward and backward captured once, replayed on refilled inputs and cotangents, equal to
    eager each time (bfloat16, every normal-valued smoke case the backend serves). The case's
    tensors are made on the capturing stream, as code that captures makes its inputs: a strided
    argument, a view made before capture, keeps its leaf's AccumulateGrad on the stream it was
    made on (assert_cuda_graph_replays)."""
    grad = (op, backend) not in forward_only(device)  # forward only: the forward captured
    for cid, enc in served_cases(op, backend, device, cases(op, dtype="bfloat16", regime="normal",
                                                            grad="1" if grad else "0")):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), kg.use(force={op: backend}):
            args, leaves = call_args(enc, device)
            cots = cotangents(as_list(op_fn(op)(*args)))

            def step():
                outs = as_list(op_fn(op)(*args))
                return outs + grads(outs, leaves, cots) if grad else outs

            def refill():
                for t in leaves + cots:
                    t.copy_(torch.randn_like(t))

            assert_cuda_graph_replays(step, refill, stream=side)
        torch.cuda.current_stream().wait_stream(side)


# Pairs whose forward+backward cannot be captured yet, why, and whether the failure is certain
# (strict: a capture that succeeds fails the test, so the entry goes when it is fixed) or depends
# on what ran before in the process (not strict: reported as XFAIL or XPASS, never as passed).
# None now: every cudaErrorStreamCaptureImplicit recorded here before (the reference and eager
# backends of the norms and losses, four library pairs) was the test's own strided arguments,
# made on the legacy stream before capture (check_cuda_graph); with them made on the capturing
# stream the strict entry (add_rms_norm/reference) passed on the H200.
KNOWN_CAPTURE_FAILURES: dict = {}


# Library backends that sync with the host never serve under capture (they are refused there,
# test_library_backends.py): capturing them would test another backend.
UNCAPTURABLE = {(b.op, b.name) for b in kg.backends.BACKENDS if not b.capturable}


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", [p for p in GPU_PAIRS if tuple(p.values) not in UNCAPTURABLE])
def test_gpu_cuda_graph_capture_and_replay(op, backend, request):
    require_available(op, backend)
    if (op, backend) in KNOWN_CAPTURE_FAILURES:
        strict, why = KNOWN_CAPTURE_FAILURES[op, backend]
        request.applymarker(pytest.mark.xfail(reason=why, strict=strict))
    check_cuda_graph(op, backend, "cuda")


# ---- end to end on the CPU: a Python backend of a Python-defined op --------------------------------

def run_cli(capsys, *args):
    capsys.readouterr()
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_python_backend_end_to_end(tmp_path, capsys, monkeypatch):
    """validate -> bench run (sweeps in the Python worker, which loads pyops_example.py) -> policy
    show ranks py_softcap -> with the store's evidence installed the dispatcher serves it ->
    explain names it, with the evidence as the reason."""
    module = pyops_example.__file__
    db = str(tmp_path / "evidence.sqlite")
    sweep = ["softcap", "--backend", "py_softcap", "--dtype", "float32", "--seeds", "1", "--db", db, "--load", module]
    validated = run_cli(capsys, "validate", *sweep)["softcap"]
    assert validated["planned"] > 0 and validated["dispositions"] == {"passed": validated["planned"]}, validated
    timed = run_cli(capsys, "bench", "run", *sweep, "--grid", "smoke", "--time-cap", "0.01")["softcap"]
    assert timed["dispositions"] == {"passed": timed["planned"]}, timed
    regions = run_cli(capsys, "policy", "show", "softcap", "--db", db, "--load", module)["softcap"]["regions"]
    assert regions and all(r["ranked"] == ["py_softcap"] for r in regions), regions
    assert all(s["failures"] == {} for r in regions for s in r["standings"]), regions
    # A call in the smoke grid's mid-size region (rows, hidden <= 2^8, no grad), on the device the
    # sweep ran on.
    x, bias = torch.randn(200, 200, device=RUN_DEVICE), torch.randn(200, device=RUN_DEVICE)
    monkeypatch.setenv("KERNELGATE_DB", db)
    try:
        kg.evidence.install()
        calls = pyops_example.CALLS["py_softcap"]
        y = kg.softcap(x, bias)
        assert pyops_example.CALLS["py_softcap"] == calls + 1  # py_softcap computed it
        torch.testing.assert_close(y, pyops_example.softcap_reference(x, bias, 30.0))
        e = run_cli(capsys, "explain", "softcap", "--shape", "x=200x200", "--dtype", "float32", "--device",
                    RUN_DEVICE, "--load", module)
        assert e["key"] in [r["region"] for r in regions] and e["backend"] == "py_softcap", e
        assert "ranked first by policy" in e["reason"] and db in e["reason"], e["reason"]
    finally:
        monkeypatch.undo()
        kg.evidence.install()
    assert kg.explain("softcap", x, bias).backend == "reference"  # the tests' own (empty) store again


# ---- without evidence, the op as plain PyTorch code serves ---------------------------------------

@pytest.mark.parametrize("op", [o for o in OPS if any(b["kind"] == "eager" for b in INFO[o]["backends"])])
def test_without_evidence_the_eager_backend_serves_through_pytorchs_autograd(op, tmp_path):
    """With no evidence at all, a call needing gradients is served by the op's eager backend,
    recorded by PyTorch's own autograd (its grad_fn is an ATen node, not kernelgate's), and
    explain says so; excluding it gives the reference back."""
    try:
        _C.use_evidence(str(tmp_path / "none.sqlite"), [])
        (cid, enc), *_ = cases(op, grad="1")
        args, _ = call_args(enc, "cpu")
        e = kg.explain(op, *args)
        assert e.backend == "eager" and "plain PyTorch" in e.reason, str(e)
        outs = as_list(op_fn(op)(*args))
        assert all(type(o.grad_fn).__name__ != "CppFunction" for o in outs if o.grad_fn is not None), outs
        with kg.use(exclude={op: "eager"}):
            assert kg.explain(op, *args).backend != "eager"
    finally:
        kg.evidence.install()


@pytest.mark.parametrize("op", [o for o in OPS if any(b["kind"] == "eager" for b in INFO[o]["backends"])])
def test_without_evidence_a_call_needing_no_gradient_runs_the_plain_code_too(op, tmp_path):
    """With no evidence, a call needing no gradient dispatches the ATen ops of the plain code, as
    the call needing gradients does (there PyTorch's autograd records the plain code itself), and
    none of another backend's: linear_cross_entropy's such calls once ran its reference."""
    try:
        _C.use_evidence(str(tmp_path / "none.sqlite"), [])
        (cid, enc), *_ = cases(op, grad="1")
        args, _ = call_args(enc, "cpu")

        def aten_ops(grad: bool) -> set:
            with torch.set_grad_enabled(grad), torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU]) as prof:
                op_fn(op)(*args)
            return {e.name for e in prof.events() if e.name.startswith("aten::")}

        with_grad, without = aten_ops(True), aten_ops(False)
        assert without and without <= with_grad, (cid, sorted(without - with_grad))
    finally:
        kg.evidence.install()


@pytest.mark.parametrize("op", [o for o in OPS if any(b["kind"] == "eager" for b in INFO[o]["backends"])])
def test_without_evidence_torch_compile_traces_the_plain_pytorch_code(op, tmp_path):
    """Inside torch.compile, where no evidence ranks a backend, the graph holds the eager
    backend's plain PyTorch code (which the compiler fuses as it would the user's own), not the
    op's routed forward and backward; forward and gradients as the eager call's. Forced to
    another backend, the op stays one node and routes when the graph runs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiled_targets(fn, *args):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm)

        torch._dynamo.reset()
        out = torch.compile(fn, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture),
                            fullgraph=True)(*args)
        return out, {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}

    try:
        _C.use_evidence(str(tmp_path / "none.sqlite"), [])
        (cid, enc), = [c for c in cases(op, regime="normal", layout="contiguous", optional="1", strings="",
                                        grad="1") if fields(c[1])["dims"] == mid_dims(op)]
        args, leaves = call_args(enc, "cpu")
        block = compiled_block(op, args)
        got, targets = compiled_targets(block, *args)
        assert targets and not any("kernelgate" in t for t in targets), (cid, sorted(targets))
        eager = block(*args)
        cots = cotangents(eager)
        for i, (g, e) in enumerate(zip(as_list(got), as_list(eager), strict=True)):
            torch.testing.assert_close(g, e, msg=lambda m: f"{cid}, output {i}: {m}")
        for i, (g, e) in enumerate(zip(grads(as_list(got), leaves, cots), grads(as_list(eager), leaves, cots),
                                       strict=True)):
            torch.testing.assert_close(g, e, msg=lambda m: f"{cid}, gradient {i}: {m}")
        with kg.use(force={op: "reference"}):
            _, targets = compiled_targets(block, *args)
        assert any("kernelgate" in t for t in targets), (cid, sorted(targets))
    finally:
        torch._dynamo.reset()
        kg.evidence.install()


def test_an_op_defined_from_python_takes_its_plain_code_as_its_eager_backend():
    """kg.define_op(eager=...): the op's plain PyTorch code becomes its eager backend (served
    without evidence, through PyTorch's autograd); its code is part of the op's definition."""
    def reference(x, alpha):
        acc = torch.promote_types(x.dtype, torch.float32)
        return torch.tanh(x.to(acc) * alpha).to(x.dtype)

    def plain(x, alpha):
        return torch.tanh(x * alpha)

    schema, dims = "py_plain_tanh(Tensor x, float alpha=1.0) -> Tensor", "x: [*rows, hidden]"
    with pytest.raises(TypeError, match="eager must be callable or None, got int"):
        kg.define_op(schema, dims=dims, reference=reference, eager=3)
    op = kg.define_op(schema, dims=dims, reference=reference, eager=plain)
    info = next(o for o in kg.ops() if o["name"] == "py_plain_tanh")
    assert [(b["name"], b["kind"]) for b in info["backends"]] == [("reference", "reference"), ("eager", "eager")]
    assert kg.define_op(schema, dims=dims, reference=reference, eager=plain) is not None  # the same: no-op
    with pytest.raises(ValueError, match="already defined with another schema, dims, reference, eager code"):
        kg.define_op(schema, dims=dims, reference=reference, eager=lambda x, alpha: torch.tanh(alpha * x))
    x = torch.randn(4, 8, requires_grad=True)
    e = kg.explain("py_plain_tanh", x, 0.5)
    assert e.backend == "eager" and "no evidence for this region" in e.reason, str(e)
    y = op(x, 0.5)
    assert type(y.grad_fn).__name__ == "TanhBackward0"  # PyTorch's autograd recorded the plain code
    torch.testing.assert_close(y, torch.tanh(x * 0.5))


def test_an_op_that_records_its_reference_trains_through_its_graph_without_a_second_forward():
    """kg.define_op(record_reference=True): where the reference serves a call needing gradients,
    PyTorch's autograd records it (its graph, not a kernelgate node, and the backward runs no second
    forward); the gradients, first and second, are those of the default, which recomputes. A call
    needing no gradient goes through the router as before. gated_delta_rule and kda record theirs."""
    calls = []

    def reference(x, w):
        calls.append(1)
        acc = torch.promote_types(x.dtype, torch.float32)
        return (torch.sin(x.to(acc)) * w.to(acc)).to(x.dtype)

    dims = "x: [*rows, hidden]; w: [hidden]"
    recorded = kg.define_op("py_recorded_sin(Tensor x, Tensor w) -> Tensor", dims=dims, reference=reference,
                            record_reference=True)
    default = kg.define_op("py_recomputed_sin(Tensor x, Tensor w) -> Tensor", dims=dims, reference=reference)
    with pytest.raises(ValueError, match="or record_reference"):
        kg.define_op("py_recorded_sin(Tensor x, Tensor w) -> Tensor", dims=dims, reference=reference)
    x, w = torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True)
    dy = torch.randn(5, 7)
    got = {}
    for name, op in (("recorded", recorded), ("default", default)):
        calls.clear()
        y = op(x, w)
        grads = torch.autograd.grad(y, (x, w), dy)
        got[name] = (y, grads, len(calls), type(y.grad_fn).__name__)
    assert got["recorded"][2] == 1 and got["default"][2] == 2  # forward, and forward again in the backward
    assert got["recorded"][3] == "MulBackward0"  # the reference's last op, recorded
    assert got["default"][3] != "MulBackward0"
    for a, b in zip((got["recorded"][0],) + got["recorded"][1], (got["default"][0],) + got["default"][1]):
        assert torch.equal(a, b)
    assert kg.explain("py_recorded_sin", x, w).backend == "reference"
    with torch.no_grad():
        calls.clear()
        assert recorded(x, w).grad_fn is None and len(calls) == 1
    # second derivatives through the recorded graph: those of the default's double backward
    r = torch.randn(5, 7)
    second = []
    for op in (recorded, default):
        (gx,) = torch.autograd.grad(op(x, w), x, dy, create_graph=True)
        second.append(torch.autograd.grad((gx * r).sum(), (x, w)))
    for a, b in zip(*second):
        torch.testing.assert_close(a, b)
    # the linear-attention ops record theirs: a call trained through keeps the reference's graph
    B, T, H, K = 1, 20, 2, 8
    q, k, v = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
    g, beta, A_log = torch.randn(B, T, H), torch.randn(B, T, H), torch.randn(H)
    assert type(default(x, w).grad_fn).__name__ == "CppFunction"  # kernelgate's node
    for o in (kg.gated_delta_rule(q, k, v, g, beta, A_log)[0], kg.kda(q, k, v, torch.randn(B, T, H, K), beta, A_log)[0]):
        assert type(o.grad_fn).__name__ in ("CloneBackward0", "SliceBackward0")  # the reference's last step
