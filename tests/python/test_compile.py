"""The compile hook (kernelgate.compile) on the CPU (and, marked gpu, on a GPU): each pattern fires in training and inference
graphs and computes what the code it replaced computes (against float64, no worse than twice the
eager code's error); it does not fire where it must not; the evidence rule; the interface; and
the Hugging Face Llama and Qwen3 modeling code, unmodified, with unchanged graph breaks."""

import functools

import pytest
import torch
import torch.nn.functional as F
import torch._inductor.config as inductor_config

import kernelgate as kg
import kernelgate.compile as kc

H = 64


@pytest.fixture
def hook():
    """A fresh Dynamo, no FX graph cache (a cached graph skips every pass), the hook in mode
    "always" (the CPU has no evidence), removed after."""
    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        kc.stats(reset=True)
        kc.enable("always")
        try:
            yield
        finally:
            kc.disable()
            torch._dynamo.reset()


def hf_rms_norm(x, w, eps=1e-6):
    """Hugging Face's LlamaRMSNorm / Qwen3RMSNorm forward."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(input_dtype)


FORMS = {
    "rms_norm: hugging face": lambda x, w, b: hf_rms_norm(x, w, 1e-5),
    "rms_norm: F.rms_norm": lambda x, w, b: F.rms_norm(x, (H,), w, 1e-6),
    # the residual r = x * 0.5: a tensor of x's shape; the sum used after, and not
    "add_rms_norm: x + residual, then hugging face":
        lambda x, w, b: (lambda h: hf_rms_norm(h, w, 1e-5) + h)(x + x * 0.5),
    "add_rms_norm: x + residual, then hugging face (the sum not used after)":
        lambda x, w, b: hf_rms_norm(x + x * 0.5, w, 1e-5),
    "add_rms_norm: x + residual, then F.rms_norm":
        lambda x, w, b: (lambda h: F.rms_norm(h, (H,), w, 1e-6) * h)(x + x * 0.5),
    "add_rms_norm: x + residual, then F.rms_norm (the sum not used after)":
        lambda x, w, b: F.rms_norm(x + x * 0.5, (H,), w, 1e-6),
    "layer_norm: F.layer_norm": lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5),
    "swiglu: F.silu(g) * u": lambda x, w, b: F.silu(x) * (x * 0.5 + w),
    "geglu: F.gelu(g, approximate='tanh') * u": lambda x, w, b: F.gelu(x, approximate="tanh") * (x - w),
    "geglu: F.gelu(g) * u": lambda x, w, b: F.gelu(x) * (x + b),
}


def _inputs(dtype, grad, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, H, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    b = (0.1 * torch.randn(H, generator=g)).to(device, dtype)
    return [t.requires_grad_(grad) for t in (x, w, b)]


def _run(fn, inputs, grad):
    """fn's output and the floating inputs' gradients (for a fixed random cotangent)."""
    out = fn(*inputs)
    if not grad:
        return [out.detach()]
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], cot, allow_unused=True)
    return [out.detach()] + [g for g in grads if g is not None]


def _rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_against_float64(fn, compiled, dtype, grad, device="cpu", make=None):
    """The compiled result no further from float64 than twice the eager code's distance (or
    float32 rounding); `make(dtype, grad, device=...)` makes the inputs (default _inputs), whose
    integer tensors (class indices) stay as they are and whose floating tensors keep whether they
    require a gradient (rope's cos and sin do not)."""
    make = make or _inputs
    inputs = make(dtype, grad, device=device)
    with torch.set_grad_enabled(grad):
        eager = _run(fn, inputs, grad)
        got = _run(compiled, make(dtype, grad, device=device), grad)
        exact = _run(fn, [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                          for t in inputs], grad)
    assert len(got) == len(eager) == len(exact)
    floor = 1e-6 if dtype == torch.float32 else 4e-3
    for i, (g, e, ref) in enumerate(zip(got, eager, exact)):
        assert g.dtype == e.dtype and g.shape == e.shape and g.device == e.device, (i, g.dtype, e.dtype, g.shape, e.shape)
        assert _rel(g, ref) <= max(2 * _rel(e, ref), floor), (i, _rel(g, ref), _rel(e, ref))


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_pattern_fires_and_computes_what_it_replaced(hook, form, dtype, grad):
    fn = FORMS[form]
    compiled = torch.compile(fn)
    check_against_float64(fn, compiled, dtype, grad)
    rewritten = kc.stats()["rewritten"]
    # In a float32 model the Hugging Face norm's casts vanish: a form of its own.
    key = form.replace("hugging face", "hugging face (float32)") if dtype == torch.float32 else form
    # An inference graph has no tangents: the form whose sum has other users matches both.
    accepted = {key, key.replace(" (the sum not used after)", "")} if not grad else {key}
    assert rewritten and set(rewritten) <= accepted, kc.stats()


def _eps_outside(x, w, b):  # another eps placement
    h = x.float()
    return w * (h * (torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6)).to(x.dtype)


def _variance_used(x, w, b):  # an intermediate used outside the subgraph
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + 1e-6)).to(x.dtype) + var.to(x.dtype)


def _float32_weight(x, w, b):  # another dtype flow: the weight multiply promotes to float32
    return hf_rms_norm(x, w.float())


def _other_dim(x, w, b):  # the mean over another dim
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def _cube(x, w, b):  # another exponent
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(3).abs().mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _broadcast_up(x, w, b):  # swiglu with u broadcast over the rows
    return F.silu(x) * w


def _gelu_of_other(x, w, b):  # gelu's result times something of another shape and dtype
    return F.gelu(x, approximate="tanh") * w.float()


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("fn", [_eps_outside, _variance_used, _float32_weight, _other_dim, _cube, _broadcast_up,
                                _gelu_of_other], ids=lambda f: f.__name__)
def test_a_pattern_does_not_fire_where_it_must_not(hook, fn, grad):
    check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad)
    assert kc.stats()["rewritten"] == {}, kc.stats()


def test_without_evidence_for_a_kernel_inductor_keeps_the_subgraph():
    """Mode "evidence": on the CPU no evidence ranks a kernelgate kernel first, so the dispatcher
    would serve a stand-in, slower than Inductor's code: the match is left, with the reason. A
    forced backend is the user's choice: then it is rewritten."""
    fn = FORMS["rms_norm: hugging face"]
    with inductor_config.patch(fx_graph_cache=False):
        try:
            torch._dynamo.reset()
            kc.stats(reset=True)
            kc.enable()
            torch.compile(fn)(*_inputs(torch.bfloat16, True))
            s = kc.stats(reset=True)
            assert s["rewritten"] == {}, s
            assert any("no evidence ranks a kernelgate kernel" in why for why in s["left"]), s
            torch._dynamo.reset()
            with kg.use(force={"rms_norm": "kernelgate_cpu"}):
                check_against_float64(fn, torch.compile(fn), torch.bfloat16, True)
            assert kc.stats()["rewritten"] == {"rms_norm: hugging face": 1}, kc.stats()
            served = kc.stats()["served"]
            assert list(served) and all(k.startswith("rms_norm: kernelgate_cpu (forced") for k in served), served
        finally:
            kc.disable()
            torch._dynamo.reset()


def test_enable_disable_options_and_a_pass_installed_before():
    seen = []

    def user_pass(graph):
        seen.append(len(graph.nodes))

    with inductor_config.patch(fx_graph_cache=False, joint_custom_post_pass=user_pass):
        assert not kc.enabled()
        kc.enable("always")
        assert kc.enabled() and inductor_config.joint_custom_post_pass.then is user_pass
        kc.enable("always")  # twice: still one pass, the user's kept once
        assert inductor_config.joint_custom_post_pass.then is user_pass
        torch._dynamo.reset()
        torch.compile(FORMS["swiglu: F.silu(g) * u"])(*_inputs(torch.float32, False))
        assert seen, "the pass installed before kernelgate's was not run"
        kc.disable()
        assert inductor_config.joint_custom_post_pass is user_pass
        opts = kc.options("always")
        assert opts["joint_custom_post_pass"].then is user_pass
    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        kc.stats(reset=True)
        fn = FORMS["geglu: F.gelu(g) * u"]
        compiled = torch.compile(fn, options=kc.options("always"))
        check_against_float64(fn, compiled, torch.bfloat16, True)
        assert kc.stats()["rewritten"] == {"geglu: F.gelu(g) * u": 1}
        assert not kc.enabled()
        # A compile's mode is its own: the global pass's mode does not reach it, nor it the global's.
        kc.enable()
        try:
            torch._dynamo.reset()
            kc.stats(reset=True)
            check_against_float64(fn, torch.compile(fn, options=kc.options("always")), torch.bfloat16, True)
            assert kc.stats()["rewritten"] == {"geglu: F.gelu(g) * u": 1}, kc.stats()
            assert inductor_config.joint_custom_post_pass.mode == "evidence"
        finally:
            kc.disable()
    with pytest.raises(ValueError, match="mode must be one of evidence, always, got 'sometimes'"):
        kc.enable("sometimes")
    assert {p["op"] for p in kc.patterns()} == {"rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu",
                                                "rope", "qk_norm_rope", "attention", "linear_cross_entropy"}


# ---- rope and qk_norm_rope: Hugging Face's apply_rotary_pos_emb, after Qwen3's q and k norms or not

def _rope_inputs(dtype, grad, device="cpu"):
    """Grouped-query heads as a projection makes them, [batch, seq, heads, head_dim] (4 query and
    2 kv heads of 32, 7 positions), q and k norm weights, and cos and sin as a Hugging Face
    rotary embedding gives them ([1, seq, head_dim], in the model's dtype, no gradient)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 32, generator=g).to(device, dtype)
    k = torch.randn(2, 7, 2, 32, generator=g).to(device, dtype)
    qw = (1 + 0.1 * torch.randn(32, generator=g)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(32, generator=g)).to(device, dtype)
    angle = torch.arange(7.0)[:, None] * 10000 ** (-torch.arange(16.0) / 16)
    angle = torch.cat((angle, angle), -1)[None]
    return [t.requires_grad_(grad) for t in (q, k, qw, kw)] + [angle.cos().to(device, dtype), angle.sin().to(device, dtype)]


def _both(pair):
    """q's and k's results as one tensor (the checks take one output)."""
    return torch.cat((pair[0].flatten(), pair[1].flatten()))


def _hf_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _rotate_second_first(x):  # rotate-half with its second half sliced first
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _rope_with(rotate, q, k, cos, sin):
    q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


ROPE_FORMS = {
    "rope: hugging face (apply_rotary_pos_emb)": lambda q, k, qw, kw, cos, sin: _both(_hf_rope(q, k, cos, sin)),
    "rope: rotate-half rope, second half sliced first":
        lambda q, k, qw, kw, cos, sin: _both(_rope_with(_rotate_second_first, q, k, cos, sin)),
    "qk_norm_rope: hugging face of q and k, then rotate-half rope, second half sliced first":
        lambda q, k, qw, kw, cos, sin: _both(_rope_with(_rotate_second_first, hf_rms_norm(q, qw), hf_rms_norm(k, kw),
                                                        cos, sin)),
    "qk_norm_rope: hugging face of q and k, then hugging face rope":
        lambda q, k, qw, kw, cos, sin: _both(_hf_rope(hf_rms_norm(q, qw), hf_rms_norm(k, kw), cos, sin)),
    "qk_norm_rope: F.rms_norm of q and k, then hugging face rope":
        lambda q, k, qw, kw, cos, sin: _both(_hf_rope(F.rms_norm(q, (32,), qw, 1e-6), F.rms_norm(k, (32,), kw, 1e-6),
                                                      cos, sin)),
}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_the_rope_patterns_fire_and_compute_what_they_replaced(hook, form, dtype, grad):
    """Each spelling is rewritten once, into its op. (Which of the op's forms matches can differ
    from the spelling: the two rotate-half spellings differ only in the order in which autograd
    sums their gradients, which depends on the graph around them too.)"""
    fn = ROPE_FORMS[form]
    check_against_float64(fn, torch.compile(fn), dtype, grad, make=_rope_inputs)
    _assert_rewritten_once_into_its_op(form, dtype)


def _assert_rewritten_once_into_its_op(form, dtype):
    """One rewrite, into the spelling's op (and for qk_norm_rope, of its norm's spelling: the
    Hugging Face norm is "hugging face (float32)" in a float32 graph)."""
    rewritten = kc.stats()["rewritten"]
    op = form.split(":")[0]
    assert sum(rewritten.values()) == 1 and all(key.startswith(f"{op}: ") for key in rewritten), kc.stats()
    if " of q and k" in form:
        norm = form.split(": ")[1].split(" of q")[0]
        norm = f"{norm} (float32)" if norm == "hugging face" and dtype == torch.float32 else norm
        assert all(key.startswith(f"{op}: {norm} of q and k") for key in rewritten), kc.stats()


def _rotate_every_two(x):  # GPT-J's interleaved rotation, not rotate-half
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def _split_elsewhere(x):  # a rotation of another split point
    return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)


def _rope_with(rotate, q, k, cos, sin):
    q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def _rotation_used_after(q, k, qw, kw, cos, sin):  # an intermediate read outside the rope
    from transformers.models.llama.modeling_llama import rotate_half

    q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)
    rq = rotate_half(q)
    return _both((q * cos + rq * sin, k * cos + rotate_half(k) * sin)) + rq.sum()


ROPE_NOT_MATCHED = {
    # (the function, the ops that must not be rewritten)
    "interleaved rotation": (lambda q, k, qw, kw, cos, sin: _both(_rope_with(_rotate_every_two, q, k, cos, sin)),
                             {"rope", "qk_norm_rope"}),
    "another split point": (lambda q, k, qw, kw, cos, sin: _both(_rope_with(_split_elsewhere, q, k, cos, sin)),
                            {"rope", "qk_norm_rope"}),
    "cos and sin in float32": (lambda q, k, qw, kw, cos, sin: _both(_hf_rope(q, k, cos.float(), sin.float())),
                               {"rope", "qk_norm_rope"}),
    "q's rotation used after": (_rotation_used_after, {"rope", "qk_norm_rope"}),
    # q and k norms of other eps: not one qk_norm_rope (rope and the norms alone may be rewritten)
    "q and k norms of other eps": (lambda q, k, qw, kw, cos, sin: _both(_hf_rope(hf_rms_norm(q, qw, 1e-6),
                                                                                 hf_rms_norm(k, kw, 1e-5), cos, sin)),
                                   {"qk_norm_rope"}),
}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(ROPE_NOT_MATCHED))
def test_the_rope_patterns_do_not_fire_where_they_must_not(hook, case, grad):
    fn, ops = ROPE_NOT_MATCHED[case]
    check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad, make=_rope_inputs)
    rewritten = {key.split(":")[0] for key in kc.stats()["rewritten"]}
    assert not rewritten & ops, kc.stats()


def test_rope_is_not_rewritten_where_cos_and_sin_need_a_gradient(hook):
    """The op computes no gradient for cos and sin: a rope whose cos and sin are learned stays
    Inductor's, and their gradients are the eager code's."""
    def fn(q, k, qw, kw, cos, sin):
        return _both(_hf_rope(q, k, cos, sin))

    def make(dtype, grad, device="cpu"):
        inputs = _rope_inputs(dtype, grad, device)
        return inputs[:4] + [t.requires_grad_(grad) for t in inputs[4:]]

    check_against_float64(fn, torch.compile(fn), torch.float32, True, make=make)
    assert kc.stats()["rewritten"] == {}, kc.stats()


# ---- attention: F.scaled_dot_product_attention, causal, and Hugging Face's form under compile

def _attention_inputs(dtype, grad, device="cpu", seq=13):
    """q [2, 4, seq, 16] and k, v [2, 2, seq, 16] as attention code makes them (views of [batch,
    seq, heads, head_dim] projections), and a padding mask (all kept) as a model gets one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, seq, h, 16, generator=g).to(device, dtype).requires_grad_(grad) for h in (4, 2, 2))
    return [q, k, v, torch.ones(2, seq, dtype=torch.bool, device=device)]


def _heads_first(q, k, v):
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _causal_from_constants(s, device):
    """A causal mask built inside the compiled code, not given to it."""
    i = torch.arange(s, device=device)
    return (i[None, :] <= i[:, None])[None, None]


def _sdpa_hf(q, k, v, mask):
    from transformers.integrations.sdpa_attention import repeat_kv

    q, k, v = _heads_first(q, k, v)
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask, scale=0.3)


ATTENTION_FORMS = {
    # (the function of q, k, v and a padding mask; its form)
    "SDPA causal, grouped kv heads": (
        lambda q, k, v, pad: F.scaled_dot_product_attention(*_heads_first(q, k, v), is_causal=True, enable_gqa=True),
        "attention: F.scaled_dot_product_attention(q, k, v, is_causal=True)"),
    "SDPA causal, a scale": (
        lambda q, k, v, pad: F.scaled_dot_product_attention(*_heads_first(q, k, v), is_causal=True, scale=0.2,
                                                            enable_gqa=True),
        "attention: F.scaled_dot_product_attention(q, k, v, is_causal=True)"),
    "kv heads repeated, a causal mask built in the graph": (
        lambda q, k, v, pad: _sdpa_hf(q, k, v, _causal_from_constants(q.shape[1], q.device)),
        "attention: hugging face sdpa (repeat_kv, a causal mask)"),
}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(ATTENTION_FORMS))
def test_the_attention_patterns_fire_and_compute_what_they_replaced(hook, case, dtype, grad):
    fn, form = ATTENTION_FORMS[case]
    check_against_float64(fn, torch.compile(fn), dtype, grad, make=_attention_inputs)
    assert kc.stats()["rewritten"] == {form: 1}, kc.stats()


def _window(s, device):  # a sliding window of 4: not the causal mask
    i = torch.arange(s, device=device)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4))[None, None]


ATTENTION_NOT_MATCHED = {
    "not causal": lambda q, k, v, pad: F.scaled_dot_product_attention(*_heads_first(q, k, v), enable_gqa=True),
    "a sliding-window mask": lambda q, k, v, pad: _sdpa_hf(q, k, v, _window(q.shape[1], q.device)),
    # the causal mask and a padding mask the model is given: the mask depends on an input
    "a padding mask": lambda q, k, v, pad: _sdpa_hf(q, k, v, _causal_from_constants(q.shape[1], q.device)
                                                    & pad[:, None, None, :]),
    # causal with fewer keys than queries (SDPA aligns the mask top-left; the op takes one length)
    "k and v shorter than q": lambda q, k, v, pad: F.scaled_dot_product_attention(
        *_heads_first(q, k[:, :9], v[:, :9]), is_causal=True, enable_gqa=True),
}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(ATTENTION_NOT_MATCHED))
def test_the_attention_patterns_do_not_fire_where_they_must_not(hook, case, grad):
    fn = ATTENTION_NOT_MATCHED[case]
    check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad, make=_attention_inputs)
    assert not any(key.startswith("attention:") for key in kc.stats()["rewritten"]), kc.stats()


def test_attention_with_dropout_is_not_rewritten(hook):
    """The op has no dropout: SDPA with dropout_p > 0 stays Inductor's (its values are random, so
    only the rewrite is checked)."""
    def fn(q, k, v, pad):
        return F.scaled_dot_product_attention(*_heads_first(q, k, v), is_causal=True, dropout_p=0.1, enable_gqa=True)

    out = torch.compile(fn)(*_attention_inputs(torch.float32, True))
    out.sum().backward()
    assert kc.stats()["rewritten"] == {}, kc.stats()


def test_the_hook_leaves_training_attention_that_cudnn_would_serve(monkeypatch):
    """The rule the GPU test below exercises: a training attention call the dispatcher would serve
    with aten_cudnn, or with eager (PyTorch's SDPA) on a GPU where SDPA runs cuDNN, is not
    rewritten (ATen caches cuDNN's backward by q, k and v alone); its inference calls, other
    backends, other GPUs and other ops are."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    why = kc._unsafe_in_a_graph("attention", True, {"backend": "aten_cudnn"}, gpu)
    assert why is not None and "aten_cudnn" in why and "by q, k and v alone" in why
    assert kc._unsafe_in_a_graph("attention", False, {"backend": "aten_cudnn"}, gpu) is None
    assert kc._unsafe_in_a_graph("attention", True, {"backend": "eager"}, cpu) is None
    assert kc._unsafe_in_a_graph("rms_norm", True, {"backend": "aten_cudnn"}, gpu) is None
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    for capability, eager_unsafe in (((9, 0), True), ((10, 0), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        why = kc._unsafe_in_a_graph("attention", True, {"backend": "eager"}, gpu)
        assert (why is not None and "PyTorch's SDPA" in why) is eager_unsafe, (capability, why)
        assert kc._unsafe_in_a_graph("attention", False, {"backend": "eager"}, gpu) is None
        for backend in ("aten_flash", "aten_efficient", "reference"):
            assert kc._unsafe_in_a_graph("attention", True, {"backend": backend}, gpu) is None
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)  # the user turned it off
    assert kc._unsafe_in_a_graph("attention", True, {"backend": "eager"}, gpu) is None


def test_ops_limits_what_a_compile_rewrites():
    """options(ops=[...]) rewrites only those ops; a pattern that holds an excluded op is left
    and the smaller ones it holds are still rewritten (qk_norm_rope excluded: rope and the norms)."""
    def fn(x, w, b):
        return F.silu(hf_rms_norm(x, w)) * x

    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        kc.stats(reset=True)
        check_against_float64(fn, torch.compile(fn, options=kc.options("always", ops=["swiglu"])), torch.bfloat16, True)
        assert kc.stats()["rewritten"] == {"swiglu: F.silu(g) * u": 1}, kc.stats()
        assert any("not among the ops this compile rewrites" in why for why in kc.stats()["left"]), kc.stats()
        torch._dynamo.reset()
        kc.stats(reset=True)
        qk = ROPE_FORMS["qk_norm_rope: hugging face of q and k, then hugging face rope"]
        opts = kc.options("always", ops=["rope", "rms_norm"])
        check_against_float64(qk, torch.compile(qk, options=opts), torch.bfloat16, True, make=_rope_inputs)
        assert {key.split(":")[0] for key in kc.stats()["rewritten"]} == {"rope", "rms_norm"}, kc.stats()
        torch._dynamo.reset()
    with pytest.raises(ValueError, match="ops must be a list of .*attention.*, got \\['sdpa'\\]"):
        kc.options(ops=["sdpa"])
    with pytest.raises(ValueError, match="ops must be a list of"):
        kc.enable(ops="swiglu")


# ---- linear_cross_entropy: a language model's loss, F.cross_entropy(F.linear(h, w).float(), t)

def _lce_inputs(dtype, grad, device="cpu"):
    """37 rows of H, 101 classes, int64 targets with every 7th row ignored (-100)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, H, generator=g).to(device, dtype)
    w = (0.1 * torch.randn(101, H, generator=g)).to(device, dtype)
    t = torch.randint(0, 101, (37,), generator=g)
    t[::7] = -100
    return [h.requires_grad_(grad), w.requires_grad_(grad), t.to(device)]


def _lce_float(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _lce_plain(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_linear_cross_entropy_pattern_fires_and_computes_what_it_replaced(hook, dtype, grad):
    fn = _lce_float if dtype != torch.float32 else _lce_plain
    check_against_float64(fn, torch.compile(fn), dtype, grad, make=_lce_inputs)
    form = ("F.cross_entropy(F.linear(h, w).float(), t)" if dtype != torch.float32
            else "F.cross_entropy(F.linear(h, w), t)")
    assert kc.stats()["rewritten"] == {f"linear_cross_entropy: {form}": 1}, kc.stats()


LCE_NOT_MATCHED = {
    "reduction sum": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, reduction="sum"),
    "label smoothing": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, label_smoothing=0.1),
    "another ignore_index": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t.clamp_min(0), ignore_index=3),
    "the logits used after": lambda h, w, t: (lambda z: F.cross_entropy(z, t) + z.mean())(F.linear(h, w).float()),
    "a bias": lambda h, w, t: F.cross_entropy(F.linear(h, w, w[:, 0]).float(), t),
    "a 16-bit loss": _lce_plain,  # without the upcast the loss is bf16; the op's is float32
}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(LCE_NOT_MATCHED))
def test_the_linear_cross_entropy_pattern_does_not_fire_where_it_must_not(hook, case, grad):
    fn = LCE_NOT_MATCHED[case]
    check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad, make=_lce_inputs)
    assert kc.stats()["rewritten"] == {}, kc.stats()


def _kernelgate_kernels(fn):
    """The names of kernelgate's CUDA kernels that fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "kernelgate" in e.name}


# Every form in both modes. In CUDA training graphs F.rms_norm (alone and after a residual add) and
# bfloat16 F.layer_norm decompose otherwise than on the CPU; the patterns traced on the CPU
# alone missed them there (session_2026_12_02_c in bench/results/h200/gpu_tests.json), so the
# hook traces each form on CUDA too where that differs.
def _gpu_cases():
    for form in FORMS:
        for grad in (True, False):
            yield pytest.param(form, grad, id=f"{form}-{'training' if grad else 'inference'}")


@pytest.mark.gpu
@pytest.mark.parametrize("form,grad", list(_gpu_cases()))
def test_a_pattern_fires_on_the_gpu_and_runs_a_kernelgate_kernel(hook, form, grad):
    """On a GPU, in bf16: the rewrite fires in the CUDA graph Inductor compiles, the replacement
    calls kernelgate's CUDA kernel (seen by torch.profiler: _kernelgate_kernels), and the
    result is as close to float64 as the eager code's (twice its error)."""
    fn = FORMS[form]
    op = form.split(":")[0]
    with kg.use(force={op: "kernelgate_cuda"}):
        compiled = torch.compile(fn)
        check_against_float64(fn, compiled, torch.bfloat16, grad, device="cuda")
        inputs = _inputs(torch.bfloat16, grad, device="cuda")
        with torch.set_grad_enabled(grad):
            launched = _kernelgate_kernels(lambda: _run(compiled, inputs, grad))
    assert launched, f"no kernelgate CUDA kernel ran in the compiled {form}"
    accepted = {form, form.replace(" (the sum not used after)", "")} if not grad else {form}
    rewritten = kc.stats()["rewritten"]
    assert rewritten and set(rewritten) <= accepted, kc.stats()


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_the_rope_patterns_fire_on_the_gpu_and_run_a_kernelgate_kernel(hook, form, grad):
    """rope and qk_norm_rope in bf16 on a GPU: the rewrite fires in the CUDA graph, kernelgate's
    CUDA kernel runs it, and the result is as close to float64 as the eager code's."""
    fn = ROPE_FORMS[form]
    with kg.use(force={form.split(":")[0]: "kernelgate_cuda"}):
        compiled = torch.compile(fn)
        check_against_float64(fn, compiled, torch.bfloat16, grad, device="cuda", make=_rope_inputs)
        inputs = _rope_inputs(torch.bfloat16, grad, "cuda")
        with torch.set_grad_enabled(grad):
            launched = _kernelgate_kernels(lambda: _run(compiled, inputs, grad))
    assert launched, f"no kernelgate CUDA kernel ran in the compiled {form}"
    _assert_rewritten_once_into_its_op(form, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("case", list(ATTENTION_FORMS))
def test_the_attention_patterns_fire_on_the_gpu(hook, case, grad):
    """In bf16 on a GPU: the rewrite fires in the CUDA graph (each SDPA kernel ATen may pick is a
    pattern of its own), the dispatcher serves the call, and the result is as close to float64 as
    the eager code's. (kg.attention's kernels are ATen's: there is no kernelgate kernel to see.)
    Sequences of 16: the patterns are traced at 16, and ATen's memory-efficient kernel pads a
    mask whose length is not a multiple of 16, a graph of another shape."""
    fn, form = ATTENTION_FORMS[case]
    # Training calls that cuDNN would run (aten_cudnn, or eager: PyTorch's SDPA, which runs cuDNN
    # on Hopper) stay Inductor's (the next test): the rest of the ranking serves.
    with kg.use(exclude={"attention": ["aten_cudnn", "eager"]}):
        check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad, device="cuda",
                              make=functools.partial(_attention_inputs, seq=16))
    assert kc.stats()["rewritten"] == {form: 1}, kc.stats()
    assert all(key.startswith("attention: ") for key in kc.stats()["served"]), kc.stats()


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_a_training_attention_cudnn_would_serve_stays_inductors_on_the_gpu(hook, grad):
    """ATen caches cuDNN's attention backward by q, k and v alone, so in a compiled graph it can read
    the output gradient in another SDPA call's layout: where the dispatcher would serve a training
    call with aten_cudnn, the hook leaves the subgraph to Inductor (its forward alone is safe)."""
    fn, form = ATTENTION_FORMS["SDPA causal, grouped kv heads"]
    with kg.use(force={"attention": "aten_cudnn"}):
        check_against_float64(fn, torch.compile(fn), torch.bfloat16, grad, device="cuda",
                              make=functools.partial(_attention_inputs, seq=16))
    if grad:
        assert kc.stats()["rewritten"] == {}, kc.stats()
        assert any("aten_cudnn, whose backward ATen caches" in key for key in kc.stats()["left"]), kc.stats()
    else:
        assert kc.stats()["rewritten"] == {form: 1}, kc.stats()


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_the_linear_cross_entropy_pattern_fires_on_the_gpu_and_runs_a_kernelgate_kernel(hook, grad):
    """In bf16 on a GPU: the loss's rewrite fires in the CUDA graph, kernelgate's CUDA kernels run
    it, and loss and gradients are as close to float64 as the eager code's (twice its error)."""
    with kg.use(force={"linear_cross_entropy": "kernelgate_cuda"}):
        compiled = torch.compile(_lce_float)
        check_against_float64(_lce_float, compiled, torch.bfloat16, grad, device="cuda", make=_lce_inputs)
        inputs = _lce_inputs(torch.bfloat16, grad, "cuda")
        with torch.set_grad_enabled(grad):
            launched = _kernelgate_kernels(lambda: compiled(*inputs))
    assert launched, "no kernelgate CUDA kernel ran in the compiled loss"
    assert kc.stats()["rewritten"] == {"linear_cross_entropy: F.cross_entropy(F.linear(h, w).float(), t)": 1}, \
        kc.stats()


def _tiny(name, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[name]
    torch.manual_seed(0)
    cfg = config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
    return model(cfg).to(dtype)


def _step(model, ids, compiled=None):
    model.zero_grad(set_to_none=True)
    loss = (model if compiled is None else compiled)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _graphs(fn):
    from torch._dynamo.utils import counters

    counters.clear()
    out = fn()
    return out, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _assert_as_close_as_inductor(eager, inductor, hooked, floor):
    """Loss and every gradient of the hooked compile within twice Inductor's distance from the
    uncompiled step's (or floor, relative)."""
    (loss0, grads0), (loss_i, grads_i), (loss_k, grads_k) = eager, inductor, hooked
    assert abs(float(loss_k) - float(loss0)) <= max(2 * abs(float(loss_i) - float(loss0)), floor * float(loss0))
    for n, g0 in grads0.items():
        d_k = float((grads_k[n].float() - g0.float()).norm() / g0.float().norm().clamp_min(1e-30))
        d_i = float((grads_i[n].float() - g0.float()).norm() / g0.float().norm().clamp_min(1e-30))
        assert d_k <= max(2 * d_i, floor), (n, d_k, d_i)


# (model, dtype): what the hook rewrites in its training graph. In a float32 model a norm of a
# tensor that something else also reads has its input's gradients accumulated by autograd into the
# norm's own backward sum, which its pattern does not have: those norms stay Inductor's (the
# 16-bit models' casts keep the sums apart).
_ADD = "add_rms_norm: x + residual, then hugging face"
_ADD32 = "add_rms_norm: x + residual, then hugging face (float32)"
_ROPE = "rope: hugging face (apply_rotary_pos_emb)"
_QK = "qk_norm_rope: hugging face{} of q and k, then hugging face rope"
_ATTENTION = {"attention: hugging face sdpa (repeat_kv, a causal mask)": 2}
HF_REWRITES = {
    # 2 layers: the first layer's input norm (of the embeddings), 3 norms of a residual sum used
    # after, the final norm (its sum is not), 2 MLPs, 2 ropes, 2 attentions (their kv heads
    # repeated, the causal mask the compiled model builds); Qwen3's q and k norms with its rope
    # are one qk_norm_rope.
    ("llama", torch.bfloat16): {"rms_norm: hugging face": 1, _ADD: 3, f"{_ADD} (the sum not used after)": 1,
                                "swiglu: F.silu(g) * u": 2, _ROPE: 2, **_ATTENTION},
    ("qwen3", torch.bfloat16): {"rms_norm: hugging face": 1, _ADD: 3, f"{_ADD} (the sum not used after)": 1,
                                "swiglu: F.silu(g) * u": 2, _QK.format(""): 2, **_ATTENTION},
    # float32: the first layer's input norm reads the embeddings, which the residual also reads
    ("llama", torch.float32): {_ADD32: 3, f"{_ADD32} (the sum not used after)": 1, "swiglu: F.silu(g) * u": 2,
                               _ROPE: 2, **_ATTENTION},
    ("qwen3", torch.float32): {_ADD32: 3, f"{_ADD32} (the sum not used after)": 1, "swiglu: F.silu(g) * u": 2,
                               _QK.format(" (float32)"): 2, **_ATTENTION},
}


def _compiled_without_and_with_the_hook(model, ids, launched=False):
    """One training step compiled by Inductor alone, then with the hook in mode "always" (its stats
    reset first): each run's ((loss, grads), graphs, graph breaks), and with launched=True the
    kernelgate kernels a second hooked step runs (None otherwise)."""
    with inductor_config.patch(fx_graph_cache=False):
        try:
            torch._dynamo.reset()
            inductor = _graphs(lambda: _step(model, ids, torch.compile(model)))
            torch._dynamo.reset()
            kc.stats(reset=True)
            kc.enable("always")
            compiled = torch.compile(model)
            hooked = _graphs(lambda: _step(model, ids, compiled))
            kernels = _kernelgate_kernels(lambda: _step(model, ids, compiled)) if launched else None
        finally:
            kc.disable()
            torch._dynamo.reset()
    return inductor, hooked, kernels


@pytest.mark.parametrize("name,dtype", list(HF_REWRITES), ids=lambda v: str(v).replace("torch.", ""))
def test_hugging_face_models_train_with_the_hook(name, dtype):
    """The transformers modeling code, unmodified, compiled with and without the hook: the same
    graphs and graph breaks, the expected rewrites, and loss and gradients that agree with the
    uncompiled model's as closely as Inductor alone does (to twice its difference, or float32
    rounding)."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model = _tiny(name, dtype)
    loss0, grads0 = _step(model, ids)
    ((loss_i, grads_i), graphs_i, breaks_i), ((loss_k, grads_k), graphs_k, breaks_k), _ = \
        _compiled_without_and_with_the_hook(model, ids)
    assert kc.stats()["rewritten"] == HF_REWRITES[name, dtype], kc.stats()
    assert (graphs_k, breaks_k) == (graphs_i, breaks_i)
    _assert_as_close_as_inductor((loss0, grads0), (loss_i, grads_i), (loss_k, grads_k),
                                 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hugging_face_models_train_with_the_hook_on_the_gpu(name):
    """The transformers modeling code in bf16 on a GPU, compiled with the hook (kernelgate's CUDA
    kernels forced where the evidence has no tiny shapes): the rewrites the CPU run makes (but
    attention's where PyTorch's SDPA, which serves it, runs cuDNN: the rule of
    test_a_training_attention_cudnn_would_serve_stays_inductors_on_the_gpu), the
    same graphs and graph breaks as Inductor alone, kernelgate kernels in the step, and loss and
    gradients as close to the uncompiled model's as Inductor alone is (twice, or bf16 rounding)."""
    dtype = torch.bfloat16
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    model = _tiny(name, dtype).cuda()
    loss0, grads0 = _step(model, ids)
    with kg.use(force="kernelgate_cuda"):
        ((loss_i, grads_i), graphs_i, breaks_i), ((loss_k, grads_k), graphs_k, breaks_k), launched = \
            _compiled_without_and_with_the_hook(model, ids, launched=True)
    want = dict(HF_REWRITES[name, dtype])
    if kc._sdpa_may_pick_cudnn(ids.device):  # attention, served by eager (SDPA, cuDNN here), stays Inductor's
        for form in _ATTENTION:
            del want[form]
        # each layer's (2), once for every attention form that matched it
        assert sum(n for why, n in kc.stats()["left"].items() if "PyTorch's SDPA" in why) >= 2, kc.stats()
    assert kc.stats()["rewritten"] == want, kc.stats()
    assert (graphs_k, breaks_k) == (graphs_i, breaks_i)
    assert launched, "no kernelgate CUDA kernel ran in the compiled step"
    _assert_as_close_as_inductor((loss0, grads0), (loss_i, grads_i), (loss_k, grads_k), 2e-2)
