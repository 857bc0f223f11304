"""kernelgate.fla: FLA's signatures and returns; a call kernelgate serves only with every argument
whitelisted and evidence for its region, every other call to FLA verbatim (the same function
with the same arguments: bit-identical, checked with torch.equal on the GPU)."""

import inspect
import logging

import pytest
import torch

import kernelgate as kg
from kernelgate import fla as kfla
from test_gated_delta_rule import NAMES as GDR_NAMES  # q, k, v, g, beta, A_log, dt_bias, initial_state


def fla_conv():
    return pytest.importorskip("fla.modules.convolution").causal_conv1d


def test_signature_is_flas():
    ours, theirs = inspect.signature(kfla.causal_conv1d), inspect.signature(fla_conv())
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


def test_every_fla_parameter_is_classified():
    """A parameter FLA adds is either implemented or sends calls to FLA: which, is decided here."""
    names = set(inspect.signature(fla_conv()).parameters)
    assert names == set(kfla.CONV_HANDLED) | set(kfla.CONV_FORWARDED), names
    assert not set(kfla.CONV_HANDLED) & set(kfla.CONV_FORWARDED)


def conv_inputs(device="cpu", dtype=torch.float32):
    return torch.randn(2, 33, 24, device=device, dtype=dtype), torch.randn(24, 4, device=device, dtype=dtype)


def _cpu_kernel(x, w, b, activation):
    return torch.ops.kernelgate._causal_conv1d_reference(x, w, b, activation)


def rank(backend="test_dropin_kernel"):
    # test_dropin_kernel: a CPU backend standing for a kernel of ours (evidence ranking the
    # reference or the eager fallback does not make the drop-in serve: the caller asked for
    # FLA's kernel, not plain PyTorch). Registered once (again: a no-op).
    kg.register_backend("causal_conv1d", "test_dropin_kernel", _cpu_kernel, device="cpu")
    kg.policy.add_rule("causal_conv1d", [backend], evidence="test: ranked")


def test_without_evidence_a_call_goes_to_fla():
    x, w = conv_inputs()
    why = kfla.explain_causal_conv1d(x, w, activation="silu")
    assert why.startswith("FLA: no evidence ranks a kernelgate kernel for this call (causal_conv1d cpu"), why


@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_evidence_ranking_plain_pytorch_first_still_goes_to_fla(backend):
    x, w = conv_inputs()
    rank(backend)
    why = kfla.explain_causal_conv1d(x, w, activation="silu")
    assert why.startswith("FLA: no evidence ranks a kernelgate kernel") and f": {backend}, ranked first" in why, why


def test_a_forced_backend_serves():
    x, w = conv_inputs()
    with kg.use(force={"causal_conv1d": "reference"}):
        assert kfla.explain_causal_conv1d(x, w) == "kernelgate"


@pytest.mark.parametrize("kwargs,why", [
    ({"residual": "x"}, "residual is given"),
    ({"initial_state": torch.zeros(2, 24, 4)}, "initial_state is given"),
    ({"output_final_state": True}, "output_final_state=True"),
    ({"backend": "cuda"}, "backend='cuda'"),
    ({"activation": "relu"}, "activation='relu'"),
    ({"cu_seqlens": torch.tensor([0, 33])}, "cu_seqlens is given"),
    ({"seq_idx": 3}, "arguments kernelgate does not know: seq_idx"),
])
def test_a_call_kernelgate_does_not_implement_goes_to_fla(kwargs, why):
    x, w = conv_inputs()
    rank()
    kwargs = {k: (x if v == "x" else v) for k, v in kwargs.items()}
    got = kfla.explain_causal_conv1d(x, w, **kwargs)
    assert got.startswith("FLA: " + why), got


def test_shapes_and_dtypes_kernelgate_does_not_take_go_to_fla():
    x, w = conv_inputs()
    rank()
    assert kfla.explain_causal_conv1d(x, w) == "kernelgate"
    assert kfla.explain_causal_conv1d(x, w.double()).startswith("FLA: dtypes")
    assert kfla.explain_causal_conv1d(x[0], w).startswith("FLA: shapes")
    assert kfla.explain_causal_conv1d(x, w[:5]).startswith("FLA: shapes")
    assert kfla.explain_causal_conv1d(x, w, torch.randn(5)).startswith("FLA: bias")
    assert kfla.explain_causal_conv1d(x, None).startswith("FLA: x and weight")


def test_with_evidence_kernelgate_serves_with_flas_return():
    x, w = conv_inputs()
    rank()
    for activation, ours in [(None, "none"), ("silu", "silu"), ("swish", "silu")]:
        y, state = kfla.causal_conv1d(x, w, activation=activation)
        assert state is None
        assert torch.equal(y, kg.causal_conv1d(x, w, None, ours))
    # the decision follows the policy: its change is seen by the cache
    kg.policy.clear()
    assert kfla.explain_causal_conv1d(x, w).startswith("FLA: no evidence")


def test_under_torch_compile_the_decision_is_made_at_trace_time_without_a_graph_break():
    x, w = conv_inputs()
    rank()

    def step(x, w):
        return kfla.causal_conv1d(x, w, activation="silu")[0] * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(x, w).graph_break_count == 0
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(x, w),
                       kg.causal_conv1d(x, w, None, "silu") * 2)
    torch._dynamo.reset()


def test_a_call_to_fla_is_verbatim_and_logged_once(monkeypatch, caplog):
    conv = pytest.importorskip("fla.modules.convolution")
    seen = []
    sentinel = (torch.zeros(1), torch.ones(1))

    def recorder(*args, **kwargs):
        seen.append((args, kwargs))
        return sentinel

    params = set(inspect.signature(conv.causal_conv1d).parameters)
    monkeypatch.setattr(conv, "causal_conv1d", recorder)
    x, w = conv_inputs()
    r = torch.randn_like(x)
    kfla._logged.clear()
    with caplog.at_level(logging.INFO, logger="kernelgate"):
        for _ in range(2):
            assert kfla.causal_conv1d(x, w, residual=r, activation="silu", seq_idx=7) is sentinel
    (args, kwargs), _ = seen
    assert args == (x,) and kwargs["weight"] is w and kwargs["residual"] is r and kwargs["seq_idx"] == 7
    assert kwargs["activation"] == "silu" and kwargs["backend"] == "triton" and kwargs["bias"] is None
    assert set(kwargs) == (params - {"x", "kwargs"}) | {"seq_idx"}
    msgs = [r.getMessage() for r in caplog.records if "kernelgate.fla" in r.getMessage()]
    assert len(msgs) == 1 and "residual is given" in msgs[0], msgs


# ---- on the GPU, against FLA itself ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, {"residual": True}, {"output_final_state": True}, {"bias": True}],
                         ids=["no_evidence", "residual", "final_state", "bias_no_evidence"])
def test_gpu_fallback_is_bit_identical_to_fla(kwargs):
    fla = fla_conv()
    x, w = conv_inputs("cuda", torch.bfloat16)
    extra = {}
    if kwargs.get("residual"):
        extra["residual"] = torch.randn_like(x)
    if kwargs.get("output_final_state"):
        extra["output_final_state"] = True
    if kwargs.get("bias"):
        extra["bias"] = torch.randn(24, device="cuda", dtype=torch.bfloat16)
    assert kfla.explain_causal_conv1d(x, w, activation="silu", **extra).startswith("FLA: ")
    ours = kfla.causal_conv1d(x, w, activation="silu", **extra)
    theirs = fla(x, w, activation="silu", **extra)
    assert torch.equal(ours[0], theirs[0])
    assert (ours[1] is None and theirs[1] is None) or torch.equal(ours[1], theirs[1])


@pytest.mark.gpu
def test_gpu_served_call_agrees_with_fla():
    x, w = conv_inputs("cuda", torch.bfloat16)
    rank("kernelgate_cuda")
    assert kfla.explain_causal_conv1d(x, w, activation="silu") == "kernelgate"
    ours, _ = kfla.causal_conv1d(x, w, activation="silu")
    theirs, _ = fla_conv()(x, w, activation="silu")
    ref = torch.ops.kernelgate._causal_conv1d_reference(x.double(), w.double(), None, "silu")
    err = lambda y: ((y.double() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    assert err(ours) < 1e-2 and err(theirs) < 1e-2, (err(ours), err(theirs))


# ---- chunk_gated_delta_rule ---------------------------------------------------------------------------

def fla_gdr():
    return pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule


FUSED = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "use_gate_in_kernel": True}


def gdr_inputs(device="cpu", dtype=torch.float32, B=2, T=70, H=3, K=16, V=8, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H), (H,), (H,)]
    q, k, v, g, beta, A_log, dt_bias = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_(requires_grad)
                                        for s in shapes]
    return (q, k, v, g, beta), {"A_log": A_log, "dt_bias": dt_bias, **FUSED}


def _gdr_kernel(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    return torch.ops.kernelgate._gated_delta_rule_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, scale)


def rank_gdr():
    # as rank(): a CPU backend standing for a kernel ranked by evidence
    kg.register_backend("gated_delta_rule", "test_dropin_gdr", _gdr_kernel, device="cpu")
    kg.policy.add_rule("gated_delta_rule", ["test_dropin_gdr"], evidence="test: ranked")


def test_gdr_signature_is_flas():
    ours, theirs = inspect.signature(kfla.chunk_gated_delta_rule), inspect.signature(fla_gdr())
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


def test_every_fla_gdr_parameter_and_keyword_is_classified():
    """FLA's parameters and the keywords it reads from **kwargs (kwargs.get / pop / 'x' in kwargs)."""
    import re

    fn = fla_gdr()
    names = set(inspect.signature(fn).parameters)
    names |= set(re.findall(r"""kwargs(?:\.get|\.pop)\(\s*['"](\w+)['"]""", inspect.getsource(fn)))
    names |= set(re.findall(r"""['"](\w+)['"]\s+in\s+kwargs""", inspect.getsource(fn)))
    assert {"use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"} <= names  # the scan finds them
    assert names == set(kfla.GDR_HANDLED) | set(kfla.GDR_FORWARDED), names ^ (set(kfla.GDR_HANDLED) | set(kfla.GDR_FORWARDED))
    assert not set(kfla.GDR_HANDLED) & set(kfla.GDR_FORWARDED)


def test_gdr_without_evidence_goes_to_fla():
    args, kw = gdr_inputs()
    why = kfla.explain_chunk_gated_delta_rule(*args, **kw)
    assert why.startswith("FLA: no evidence ranks a kernelgate kernel for this call (gated_delta_rule cpu"), why


@pytest.mark.parametrize("change,why", [
    ({"use_gate_in_kernel": False}, "not the fused layer form"),
    ({"use_qk_l2norm_in_kernel": False}, "not the fused layer form"),
    ({"use_beta_sigmoid_in_kernel": False}, "not the fused layer form"),
    ({"allow_neg_eigval": True}, "allow_neg_eigval or state_v_first"),
    ({"state_v_first": True}, "allow_neg_eigval or state_v_first"),
    ({"cu_seqlens": torch.tensor([0, 70])}, "cu_seqlens is given"),
    ({"chunk_size": 32}, "arguments kernelgate does not know: chunk_size"),
    ({"scale": -1.0}, "scale=-1.0"),
    ({"A_log": None}, "q, k, v, g, beta and A_log must be tensors"),
])
def test_gdr_call_kernelgate_does_not_implement_goes_to_fla(change, why):
    args, kw = gdr_inputs()
    rank_gdr()
    assert kfla.explain_chunk_gated_delta_rule(*args, **kw) == "kernelgate"
    kw.update(change)
    got = kfla.explain_chunk_gated_delta_rule(*args, **kw)
    assert got.startswith("FLA: " + why), got


# A wrong cu_seqlens is an error before any kernel runs (FLA's would read out of bounds or
# compute a wrong answer from it), naming the argument, what was expected and what came.
BAD_CU_SEQLENS = [
    (torch.tensor([0, 4, 9]), None, ValueError, r"cu_seqlens must start at 0, never decrease and end at the "
                                                r"total length 10 \(x's dim 1\), got \[0, 4, 9\]"),
    (torch.tensor([1, 10]), None, ValueError, r"cu_seqlens must start at 0.*got \[1, 10\]"),
    (torch.tensor([0, 6, 4, 10]), None, ValueError, r"never decrease.*got \[0, 6, 4, 10\]"),
    (torch.tensor([0.0, 10.0]), None, ValueError, r"cu_seqlens must be a 1-D int32 or int64 tensor .* got torch.float32"),
    (torch.tensor([10]), None, ValueError, r"at least 2 offsets, got torch.int64 of shape \[1\]"),
    ([0, 10], None, TypeError, r"cu_seqlens must be a tensor of sequence offsets, got list"),
    (None, torch.tensor([0, 3, 11]), ValueError, r"cu_seqlens_cpu must start at 0.*got \[0, 3, 11\]"),
    (torch.tensor([0, 10]), torch.tensor([0, 3, 10]), ValueError, r"must hold the same offsets, got 2 and 3"),
]


@pytest.mark.parametrize("which", ["causal_conv1d", "chunk_gated_delta_rule"])
@pytest.mark.parametrize("cu,cu_cpu,error,message", BAD_CU_SEQLENS)
def test_a_wrong_cu_seqlens_is_an_error_naming_it(which, cu, cu_cpu, error, message):
    if which == "causal_conv1d":
        args, kw = (torch.randn(1, 10, 8), torch.randn(8, 4)), {"activation": "silu"}
    else:
        args, kw = gdr_inputs(B=1, T=10)
    with pytest.raises(error, match=f"{which}: .*{message}"):
        getattr(kfla, which)(*args, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **kw)


def test_a_varlen_call_must_be_batch_one_and_offsets_on_the_right_device():
    x = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match=r"causal_conv1d: with cu_seqlens, x must hold the sequences "
                                         r"concatenated as batch 1 \(\[1, total, ...\]\), got shape \[2, 10, 8\]"):
        kfla.causal_conv1d(x, torch.randn(8, 4), cu_seqlens=torch.tensor([0, 10]))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="cu_seqlens_cpu must be on cpu"):
            kfla._check_cu_seqlens(x[:1], None, torch.tensor([0, 10], device="cuda"), "causal_conv1d")


@pytest.mark.parametrize("offsets", [[0, 10], [0, 4, 10], [0, 0, 10], [0, 10, 10]])
def test_a_right_cu_seqlens_passes_the_check(offsets):
    x = torch.randn(1, 10, 8)
    for dtype in (torch.int32, torch.int64):
        t = torch.tensor(offsets, dtype=dtype)
        assert kfla._check_cu_seqlens(x, t, None, "causal_conv1d") is None
        assert kfla._check_cu_seqlens(x, t, t.clone(), "causal_conv1d") is None


@pytest.mark.parametrize("tilelang", [False, True])
def test_flas_gated_backward_refusal_is_lifted_by_its_tilelang_backend(monkeypatch, tilelang):
    """On Hopper with Triton 3.4 to 3.7.0 FLA refuses its gated chunk backward unless its tilelang
    backend serves chunk_bwd_dqkwg; the drop-in and the fla_chunk adapter read the same."""
    pytest.importorskip("fla")
    import importlib.metadata

    from fla.backends import _load_operation_registry

    backend = _load_operation_registry("common")._backends["tilelang"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "3.6.0" if p == "triton" else real_version(p))
    monkeypatch.setattr(type(backend), "is_available", classmethod(lambda cls: tilelang))
    monkeypatch.setattr(backend, "is_enabled", lambda: True)
    kfla._fla_refuses_on_cuda.cache_clear()
    try:
        assert kfla._fla_tilelang_serves_dqkwg() is tilelang
        assert kfla._fla_refuses_gated_backward(torch.device("cuda", 0)) is not tilelang
        monkeypatch.setattr(backend, "is_enabled", lambda: False)  # FLA_TILELANG=0
        kfla._fla_refuses_on_cuda.cache_clear()
        assert kfla._fla_refuses_gated_backward(torch.device("cuda", 0))
    finally:
        monkeypatch.undo()
        kfla._fla_refuses_on_cuda.cache_clear()


def test_gdr_with_evidence_kernelgate_serves_with_flas_return():
    args, kw = gdr_inputs()
    rank_gdr()
    want_o, want_state = kg.gated_delta_rule(*args, kw["A_log"], kw["dt_bias"])
    o, state = kfla.chunk_gated_delta_rule(*args, **kw)
    assert state is None and torch.equal(o, want_o)
    o, state = kfla.chunk_gated_delta_rule(*args, scale=0.25, output_final_state=True, **kw)
    want_o, want_state = kg.gated_delta_rule(*args, kw["A_log"], kw["dt_bias"], None, 0.25)
    assert torch.equal(o, want_o) and torch.equal(state, want_state) and state.dtype == torch.float32


def test_gdr_under_torch_compile_without_a_graph_break():
    args, kw = gdr_inputs()
    rank_gdr()

    def step(*args):
        return kfla.chunk_gated_delta_rule(*args, **kw)[0] * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(*args).graph_break_count == 0
    torch._dynamo.reset()
    want = kg.gated_delta_rule(*args, kw["A_log"], kw["dt_bias"])[0] * 2
    torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(*args), want)
    torch._dynamo.reset()


VARLEN_OFFSETS = [0, 5, 5, 70, 141, 150]  # a sequence below a chunk, an empty one, across chunks


def _varlen_inputs(device="cpu", dtype=torch.float32):
    args, kw = gdr_inputs(device, dtype, B=1, T=VARLEN_OFFSETS[-1], requires_grad=True)
    n, (_, _, H, K), V = len(VARLEN_OFFSETS) - 1, args[0].shape, args[2].shape[-1]
    h0 = torch.randn(n, H, K, V, generator=torch.Generator().manual_seed(1)).to(device, dtype).requires_grad_()
    return args, kw, h0


def test_gdr_varlen_training_where_fla_refuses_its_backward_is_one_op_call_per_sequence(monkeypatch):
    """Where FLA refuses its gated backward, a varlen call of the fused form that needs gradients is
    kernelgate's op on each sequence (an empty one included): its outputs and every gradient (the
    initial states' too) are those of the per-sequence calls, and they agree with the float64
    recurrence of each sequence. Without gradients, or where FLA has its backward, FLA serves."""
    from kernelgate.testing import check_against_oracle
    from test_gated_delta_rule import recurrence

    args, kw, h0 = _varlen_inputs()
    cu = torch.tensor(VARLEN_OFFSETS)
    assert kfla.explain_chunk_gated_delta_rule(*args, cu_seqlens=cu, **kw).startswith("FLA: cu_seqlens is given")
    monkeypatch.setattr(kfla, "_fla_refuses_gated_backward", lambda device: True)
    assert kfla.explain_chunk_gated_delta_rule(*args, cu_seqlens=cu, initial_state=h0, **kw) == "kernelgate"
    with torch.no_grad():
        assert kfla.explain_chunk_gated_delta_rule(*args, cu_seqlens=cu, **kw).startswith("FLA: cu_seqlens is given")
    for given in ({"cu_seqlens": cu}, {"cu_seqlens_cpu": cu}, {"cu_seqlens": cu, "cu_seqlens_cpu": cu}):
        o, state = kfla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, **given, **kw)
        assert o.shape == (1, 150, 3, 8) and state.shape == (5, 3, 16, 8) and state.dtype == torch.float32
    leaves = [*args, kw["A_log"], kw["dt_bias"], h0]
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)), torch.randn(state.shape)
    got = torch.autograd.grad((o * weights[0]).sum() + (state * weights[1]).sum(), leaves)
    outs, states = [], []
    for i, (a, b) in enumerate(zip(VARLEN_OFFSETS, VARLEN_OFFSETS[1:])):
        o_i, s_i = kg.gated_delta_rule(*[t[:, a:b] for t in args], kw["A_log"], kw["dt_bias"], h0[i:i + 1])
        outs.append(o_i)
        states.append(s_i)
        if a == b:
            continue
        o64, s64 = recurrence(*[t[:, a:b].detach().double() for t in args], kw["A_log"].detach().double(),
                              kw["dt_bias"].detach().double(), h0[i:i + 1].detach().double(), 0.0)
        check_against_oracle("o", o[:, a:b].detach(), o64.float(), o64, torch.float32)
        check_against_oracle("final_state", state[i:i + 1].detach(), s64.float(), s64, torch.float32)
    assert torch.equal(states[1], h0[1:2].float())  # the empty sequence keeps its initial state
    want = torch.autograd.grad((torch.cat(outs, 1) * weights[0]).sum() + (torch.cat(states) * weights[1]).sum(),
                               leaves)
    assert torch.equal(o, torch.cat(outs, 1)) and torch.equal(state, torch.cat(states))
    for name, a, b in zip(GDR_NAMES, got, want):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"chunk_gated_delta_rule: with cu_seqlens, initial_state must hold one "
                                         r"state per sequence \(\[5, H, K, V\] for 5 sequences\), got shape \[4, 3, 16, 8\]"):
        kfla.chunk_gated_delta_rule(*args, initial_state=h0[:4], cu_seqlens=cu, **kw)


def _flas_form_in_float64(q, k, v, g, beta, A_log, dt_bias, h0, form):
    """chunk_gated_delta_rule's definition for FLA's form `form` (its three in-kernel switches),
    step by step in float64, independent of kernelgate's chunked code."""
    from test_kda import steps

    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if form["use_qk_l2norm_in_kernel"]:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    if form["use_gate_in_kernel"]:
        g = -torch.exp(A_log.double()) * torch.nn.functional.softplus(g + dt_bias.double())
    b = torch.sigmoid(beta) if form["use_beta_sigmoid_in_kernel"] else beta
    return steps(q, k, v, g[..., None].expand(q.shape), b, q.shape[-1] ** -0.5, h0.double())


# FLA's forms other than the fused one, as models call them: Hugging Face's Qwen3-Next (a log decay
# and beta computed in float32 beside bf16 q, k, v; q and k normalised in the kernel), FLA's layer
# without its in-kernel gate, and the fused form with its gate parameters in float32.
OTHER_FORMS = {
    "qwen3_next": (dict(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_qk_l2norm_in_kernel=True),
                   torch.bfloat16),
    "raw_qk_beta_logits": (dict(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=True,
                                use_qk_l2norm_in_kernel=False), torch.float32),
    "fused_gates_in_float32": (FUSED, torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(OTHER_FORMS))
def test_gdr_other_forms_train_through_kernelgate_where_fla_refuses_its_backward(name, monkeypatch):
    """Where FLA refuses its gated backward, a call of another of FLA's forms that needs gradients
    is computed by kernelgate.gated_delta_rule's reference code on that form (q, k, v in their
    dtype, the gates in float32): its output, final state and every gradient agree with the form's
    float64 recurrence. Without gradients, or where FLA has its backward, it goes to FLA."""
    _other_form_case(name, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OTHER_FORMS))
def test_gpu_gdr_other_forms_train_through_kernelgate_where_fla_refuses_its_backward(name):
    """The test above on the GPU, where FLA itself raises in that backward."""
    _other_form_case(name, "cuda", None)


def _other_form_case(name, device, monkeypatch):
    form, dtype = OTHER_FORMS[name]
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 70, 3, 16, 8
    q, k = (torch.randn(B, T, H, K, generator=gen) / (1 if form["use_qk_l2norm_in_kernel"] else 4) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    raw_g, raw_beta = torch.randn(B, T, H, generator=gen), torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    g = raw_g if form["use_gate_in_kernel"] else -torch.nn.functional.softplus(raw_g) * A_log.exp()
    beta = raw_beta if form["use_beta_sigmoid_in_kernel"] else torch.sigmoid(raw_beta)
    h0 = torch.randn(B, H, K, V, generator=gen)
    leaves = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, A_log, dt_bias, h0]
    leaves = [t.to(device).requires_grad_() for t in leaves]
    h0 = leaves[7]
    kw = {**form, "A_log": leaves[5], "dt_bias": leaves[6]} if form["use_gate_in_kernel"] else dict(form)
    args = leaves[:5]
    if device == "cpu":
        assert kfla.explain_chunk_gated_delta_rule(*args, initial_state=h0, **kw).startswith("FLA: ")
        monkeypatch.setattr(kfla, "_fla_refuses_gated_backward", lambda device: True)
    else:
        fla = fla_gdr()
        if not kfla._fla_refuses_gated_backward(args[0].device):
            pytest.skip("FLA runs its own backward on this GPU and Triton")
        o, _ = fla(*args, initial_state=h0, **kw)
        with pytest.raises(RuntimeError, match="chunk_bwd_dqkwg"):
            o.float().sum().backward()
    assert kfla.explain_chunk_gated_delta_rule(*args, initial_state=h0, **kw) == "kernelgate"
    with torch.no_grad():
        assert kfla.explain_chunk_gated_delta_rule(*args, initial_state=h0, **kw).startswith("FLA: ")
    with pytest.raises(ValueError, match=r"initial_state must hold one state per batch entry \(\[2, H, K, V\]\), "
                                         r"got shape \[1, 3, 16, 8\]"):
        kfla.chunk_gated_delta_rule(*args, initial_state=h0[:1], **kw)
    o, state = kfla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, **kw)
    assert o.dtype == dtype and o.shape == (B, T, H, V) and state.dtype == torch.float32
    w = torch.randn(o.shape, generator=gen).to(device), torch.randn(state.shape, generator=gen).to(device)
    used = leaves if form["use_gate_in_kernel"] else leaves[:5] + leaves[7:]
    got = torch.autograd.grad((o.float() * w[0]).sum() + (state * w[1]).sum(), used)
    o64, s64 = _flas_form_in_float64(*leaves, form)
    want = torch.autograd.grad((o64 * w[0].double()).sum() + (s64 * w[1].double()).sum(), used)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o.double(), o64, **tol)
    torch.testing.assert_close(state.double(), s64, **tol)
    for n, a, b in zip([n for n in GDR_NAMES if form["use_gate_in_kernel"] or n not in ("A_log", "dt_bias")],
                       got, want):
        assert a.dtype == dict(zip(GDR_NAMES, leaves))[n].dtype
        # relative to the gradient's size: bf16 q, k, v round each product at 2^-8
        b = b.double()
        torch.testing.assert_close(a.double() / b.abs().max(), b / b.abs().max(), **tol, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.gpu
def test_gpu_gdr_fallback_is_bit_identical_to_fla():
    fla = fla_gdr()
    args, kw = gdr_inputs("cuda", torch.bfloat16)
    for change in ({}, {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None}):
        k2 = {**kw, **change}
        assert kfla.explain_chunk_gated_delta_rule(*args, **k2).startswith("FLA: ")
        ours = kfla.chunk_gated_delta_rule(*args, output_final_state=True, **k2)
        theirs = fla(*args, output_final_state=True, **k2)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.gpu
def test_gpu_gdr_training_where_fla_refuses_its_backward_trains_through_kernelgate():
    """On Hopper with Triton 3.4 to 3.7.0 FLA raises in this backward; the drop-in's call trains,
    with the gradients of kernelgate's op."""
    fla = fla_gdr()
    args, kw = gdr_inputs("cuda", torch.bfloat16, requires_grad=True)
    if not kfla._fla_refuses_gated_backward(args[0].device):
        pytest.skip("FLA runs its own backward on this GPU and Triton")
    o, _ = fla(*args, **kw)
    with pytest.raises(RuntimeError, match="chunk_bwd_dqkwg"):
        o.float().sum().backward()
    assert kfla.explain_chunk_gated_delta_rule(*args, **kw) == "kernelgate"
    leaves = list(args) + [kw["A_log"], kw["dt_bias"]]
    o, _ = kfla.chunk_gated_delta_rule(*args, **kw)
    got = torch.autograd.grad(o.float().square().sum(), leaves)
    o2, _ = kg.gated_delta_rule(*args, kw["A_log"], kw["dt_bias"])
    want = torch.autograd.grad(o2.float().square().sum(), leaves)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_gdr_varlen_training_where_fla_refuses_its_backward_trains_through_kernelgate():
    """The varlen form of the test above on the GPU: FLA raises in its backward, the drop-in's call
    trains, with the gradients of kernelgate's op called per sequence."""
    fla = fla_gdr()
    args, kw, h0 = _varlen_inputs("cuda", torch.bfloat16)
    if not kfla._fla_refuses_gated_backward(args[0].device):
        pytest.skip("FLA runs its own backward on this GPU and Triton")
    cu = torch.tensor(VARLEN_OFFSETS, device="cuda")
    o, _ = fla(*args, initial_state=h0, cu_seqlens=cu, **kw)
    with pytest.raises(RuntimeError, match="chunk_bwd_dqkwg"):
        o.float().sum().backward()
    leaves = [*args, kw["A_log"], kw["dt_bias"], h0]
    o, state = kfla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    got = torch.autograd.grad(o.float().square().sum() + state.sum(), leaves)
    outs, states = zip(*[kg.gated_delta_rule(*[t[:, a:b] for t in args], kw["A_log"], kw["dt_bias"], h0[i:i + 1])
                         for i, (a, b) in enumerate(zip(VARLEN_OFFSETS, VARLEN_OFFSETS[1:]))])
    want = torch.autograd.grad(torch.cat(outs, 1).float().square().sum() + torch.cat(states).sum(), leaves)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---- chunk_kda ------------------------------------------------------------------------------------

def fla_kda():
    return pytest.importorskip("fla.ops.kda").chunk_kda


KDA_FUSED = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "use_gate_in_kernel": True}


def kda_inputs(B=2, T=40, H=3, K=16, V=8):
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H), (H,), (H * K,)]
    q, k, v, g, beta, A_log, dt_bias = [torch.randn(s, generator=gen) for s in shapes]
    return (q, k, v, g, beta), {"A_log": A_log, "dt_bias": dt_bias, **KDA_FUSED}


def _kda_kernel(q, k, v, g, beta, A_log, dt_bias, initial_state, scale):
    return torch.ops.kernelgate._kda_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, scale)


def rank_kda():
    # as rank(): a CPU backend standing for a kernel ranked by evidence
    kg.register_backend("kda", "test_dropin_kda", _kda_kernel, device="cpu")
    kg.policy.add_rule("kda", ["test_dropin_kda"], evidence="test: ranked")


def test_kda_signature_is_flas():
    ours, theirs = inspect.signature(kfla.chunk_kda), inspect.signature(fla_kda())
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


def test_every_fla_kda_parameter_and_keyword_is_classified():
    import re

    fn = fla_kda()
    names = set(inspect.signature(fn).parameters)
    names |= set(re.findall(r"""kwargs(?:\.get|\.pop)\(\s*['"](\w+)['"]""", inspect.getsource(fn)))
    names |= set(re.findall(r"""['"](\w+)['"]\s+in\s+kwargs""", inspect.getsource(fn)))
    assert {"A_log", "dt_bias", "chunk_size", "transpose_state_layout"} <= names  # the scan finds them
    assert names == set(kfla.KDA_HANDLED) | set(kfla.KDA_FORWARDED), names ^ (set(kfla.KDA_HANDLED) | set(kfla.KDA_FORWARDED))
    assert not set(kfla.KDA_HANDLED) & set(kfla.KDA_FORWARDED)


def test_kda_without_evidence_goes_to_fla():
    args, kw = kda_inputs()
    why = kfla.explain_chunk_kda(*args, **kw)
    assert why.startswith("FLA: no evidence ranks a kernelgate kernel for this call (kda cpu"), why


@pytest.mark.parametrize("change,why", [
    ({"use_gate_in_kernel": False}, "not the fused layer form"),
    ({"use_qk_l2norm_in_kernel": False}, "not the fused layer form"),
    ({"safe_gate": True}, "allow_neg_eigval, safe_gate"),
    ({"lower_bound": -5.0}, "allow_neg_eigval, safe_gate"),
    ({"return_intermediate_states": True}, "allow_neg_eigval, safe_gate"),
    ({"cu_seqlens": torch.tensor([0, 40])}, "cu_seqlens is given"),
    ({"chunk_size": 32}, "arguments kernelgate does not know: chunk_size"),
    ({"dt_bias": torch.randn(3, 16)}, "dt_bias of shape [3, 16]"),
    ({"A_log": None}, "q, k, v, g, beta and A_log must be tensors"),
])
def test_kda_call_kernelgate_does_not_implement_goes_to_fla(change, why):
    args, kw = kda_inputs()
    rank_kda()
    assert kfla.explain_chunk_kda(*args, **kw) == "kernelgate"
    kw.update(change)
    got = kfla.explain_chunk_kda(*args, **kw)
    assert got.startswith("FLA: " + why), got


def test_kda_with_grouped_values_goes_to_fla():
    """GVA (more value heads than query heads) is FLA's alone."""
    (q, k, v, g, beta), kw = kda_inputs()
    rank_kda()
    v2, g2, b2 = torch.cat([v, v], 2), torch.cat([g, g], 2), torch.cat([beta, beta], 2)
    got = kfla.explain_chunk_kda(q, k, v2, g2, b2, **kw)
    assert got.startswith("FLA: shapes q"), got


def test_kda_with_evidence_kernelgate_serves_with_flas_return():
    args, kw = kda_inputs()
    rank_kda()
    H, K = args[0].shape[2], args[0].shape[3]
    o, state = kfla.chunk_kda(*args, scale=0.25, output_final_state=True, disable_recompute=True, **kw)
    want_o, want_state = kg.kda(*args, kw["A_log"], kw["dt_bias"].view(H, K), None, 0.25)
    assert torch.equal(o, want_o) and torch.equal(state, want_state) and state.dtype == torch.float32
    o, state = kfla.chunk_kda(*args, **kw)
    assert state is None and torch.equal(o, kg.kda(*args, kw["A_log"], kw["dt_bias"].view(H, K))[0])
