"""The compile hook: under ``torch.compile``, unmodified model code gets kernelgate's kernels.

    import kernelgate.compile
    kernelgate.compile.enable()            # every torch.compile (Inductor) from here on
    model = torch.compile(model)

    # or for one compile only:
    model = torch.compile(model, options=kernelgate.compile.options())

A pass over Inductor's joint forward+backward graph (and over the forward graph of inference)
finds subgraphs that compute what a kernelgate op computes and replaces them with a call of the
op, routed by the dispatcher as usual; the backward of the replaced subgraph becomes the op's
backward. It runs after Inductor's own joint-graph passes (``joint_custom_post_pass``), on ATen
graphs after decomposition, so every spelling that decomposes to the same ATen graph matches
(``F.rms_norm``; Hugging Face's ``LlamaRMSNorm`` and ``Qwen3RMSNorm``, with the float32 upcast or,
in a float32 model, without). Graph breaks cannot change: Dynamo has finished with the graph.

What it rewrites (``patterns()`` lists each with its forms):

* rms_norm over the last dim — the Hugging Face form ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
  (16-bit x and w; in a float32 model the same without the casts) and ``F.rms_norm(x, (H,), w, eps)``;
* add_rms_norm — a residual add whose sum such a norm reads: ``h = x + r`` then either norm, the
  sum used after (the next residual) or not (a model's last norm);
* layer_norm over the last dim with weight and bias (``F.layer_norm``, ``nn.LayerNorm``);
* swiglu ``F.silu(g) * u`` and geglu ``F.gelu(g, approximate="tanh" | "none") * u``, g and u of one
  shape and dtype;
* rope — Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)``: ``q * cos + rotate_half(q) * sin``
  and the same of k, q and k [batch, heads, seq, head_dim] (grouped-query heads too), cos and sin
  [batch or 1, seq, head_dim] in q's dtype and needing no gradient (the op computes none for
  them); rotate_half as Hugging Face writes it or with its second half sliced first;
* qk_norm_rope — Qwen3's attention: per-head norms (either spelling above) of the projections
  [batch, seq, heads, head_dim], one eps for both, the heads moved first, then that rope;
* attention — causal softmax attention: ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
  scale=..., enable_gqa=...)`` (grouped kv heads or as many as the query heads), and Hugging
  Face's SDPA attention as a compiled model runs it: the kv heads repeated (``repeat_kv``) and a
  mask tensor instead of ``is_causal``, rewritten only where that mask is computed from
  constants alone (no padding mask or positions given to the model) and, computed once at
  compile time, is the causal mask — kg.attention then reads the kv heads unrepeated. No
  dropout, q and k of one length, and on CUDA sequence lengths whose graphs are those of the
  traced patterns (a multiple of 16 where ATen's memory-efficient kernel pads its mask);
* linear_cross_entropy — a language model's loss ``F.cross_entropy(F.linear(h, w).float(), t)``
  (16-bit h and w; in a float32 model without the cast), 2-D h, int64 targets, no bias, the
  defaults of ``F.cross_entropy`` (mean, ignore_index -100, no label smoothing): the logits are
  never materialised.

A subgraph is replaced only where the replacement computes the same thing within the oracle rule:
the pattern, traced again at the match's shapes, dtypes and eps, must match node for node with
every constant equal (the exponent 2, the reduction over the last dim, the casts' dtypes, the
gelu constants; Inductor's check of a replacement), no intermediate may be used outside the
subgraph, and the tensors must be a call the op accepts, of one dtype, with a result of the
input's shape and dtype (no broadcast, no type promotion). kernelgate's ops round once where
the eager code rounds to the input dtype in between (Hugging Face's norms round the normalised x
before the weight multiply): results differ by that rounding, toward the float64 answer.

Where a call would not get one of kernelgate's kernels — no evidence ranks one first for its
region on this GPU, so the dispatcher would serve its plain-PyTorch fallback — Inductor's own
code is faster than that fallback, and the subgraph is left to Inductor (mode ``"evidence"``, the
default). Mode ``"always"`` rewrites wherever the op accepts the call (to test a pattern, or with
a backend forced through ``kg.use``). ``stats()`` counts what was rewritten and why a match was
left alone.

rope's backward reads neither q nor k, so in a training graph the backward of q and that of k
look alike; each further output of a pattern is matched only where its gradient has that
output's shape and dtype and no graph node is matched twice (``_Outputs``).

Not matched (left to Inductor): in a float32 model, a norm of a tensor that something else also
reads (the residual stream): autograd accumulates that tensor's gradients into the norm's own
backward sum, which the pattern does not have (16-bit models keep them apart with their casts);
a norm whose weight or input needs no gradient (the patterns are traced with both).
"""

import collections
import contextlib
import functools
import logging
import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch._inductor.config as inductor_config
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils._ordered_set import OrderedSet

from . import _C
from ._api import kernel_serves

log = logging.getLogger("kernelgate")

MODES = ("evidence", "always")
# A scalar argument of a pattern (eps) is traced with this value, which the matcher then treats
# as a wildcard: exact in float32 and bfloat16, so a decomposition that rounds it keeps it.
_EPS = 2.0 ** -17
_SCALE = 0.3125  # attention's scale, likewise (exact, and no head dim's 1/sqrt)

_lock = threading.Lock()
_stats = {"rewritten": collections.Counter(), "left": collections.Counter(), "served": collections.Counter()}
_active = threading.local()  # .mode, .ops: the mode and ops of the pass now running on this thread


class _Form:
    """One way of writing an op: the search function, its replacement, the dtypes it is traced
    for, the tensor arguments (in the op's order) and the op's string arguments."""

    def __init__(self, op: str, name: str, search: Callable, replace: Callable, args: Sequence[str],
                 dtype: torch.dtype, shapes: Sequence[Sequence[int]], strings: Optional[Dict[str, str]] = None,
                 eps: bool = False, classes: Optional[Dict[str, int]] = None, scalar_float32: bool = False,
                 absent: int = 0, constants: Sequence[str] = (), op_args: Optional[Callable] = None,
                 any_dtype: bool = False, scale: bool = False, causal_mask: Optional[str] = None,
                 out_shape: Optional[Callable] = None, cuda_contexts: Optional[Callable] = None,
                 canonical: bool = False):
        self.op, self.name, self.search, self.replace = op, name, search, replace
        self.args, self.dtype, self.shapes, self.strings = list(args), dtype, shapes, strings or {}
        # classes: the int64 class-index arguments (targets), each with the class count it is
        # traced with. scalar_float32: the result is a float32 scalar (a loss), not a tensor of
        # the first input's shape and dtype.
        self.classes, self.scalar_float32 = classes or {}, scalar_float32
        self.absent = absent  # optional tensor arguments after these, not given (a bias)
        # constants: inputs that never need a gradient (rope's cos and sin: the op computes none).
        # op_args: the op's tensor arguments made from the search function's, where they differ
        # (a transpose); the first output has the first of them's shape and dtype.
        self.constants = set(constants)
        self.op_args = op_args or list
        # any_dtype: the graph has no casts, so one trace matches float32 and 16-bit graphs alike
        # (the matcher refuses a second, identical pattern).
        self.any_dtype = any_dtype
        # The scalar arguments the search function takes last, by name, with the values they are
        # traced with (eps, attention's scale).
        self.scalars = {**({"eps": _EPS} if eps else {}), **({"scale": _SCALE} if scale else {})}
        # causal_mask: an argument (a boolean attention mask) that is not the op's: the match
        # stands only where it provably is the causal mask (_not_causal). out_shape: the first
        # output's shape from the op's arguments, where it is not the first of them's.
        self.causal_mask, self.out_shape = causal_mask, out_shape
        # cuda_contexts(): contexts each of which makes CUDA tracing take another path (SDPA's
        # kernels), each traced where it takes the example.
        self.cuda_contexts = cuda_contexts
        # Inductor's own joint-graph passes rewrite some graphs before kernelgate's pass sees them
        # (cross_entropy's backward scatter becomes an iota compare, a scalar_tensor a full): such
        # a form is traced through those passes too.
        self.canonical = canonical or bool(self.classes)


def _hf_rms(x, w, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _plain_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _f_rms(x, w, eps):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def _rms(x, w, eps):
    return torch.ops.kernelgate.rms_norm(x, w, eps)


def _add_hf_rms(x, r, w, eps):
    h = x + r
    return _hf_rms(h, w, eps), h


def _add_plain_rms(x, r, w, eps):
    h = x + r
    return _plain_rms(h, w, eps), h


def _add_f_rms(x, r, w, eps):
    h = x + r
    return _f_rms(h, w, eps), h


def _add_rms(x, r, w, eps):
    return torch.ops.kernelgate.add_rms_norm(x, r, w, eps)


def _norm_only(search):
    """The form whose sum has no other use (a model's last norm): only the normalised output."""
    def f(x, r, w, eps):
        return search(x, r, w, eps)[0]
    return f


def _add_rms_norm_only(x, r, w, eps):
    return torch.ops.kernelgate.add_rms_norm(x, r, w, eps)[0]


def _f_layer_norm(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def _layer_norm(x, w, b, eps):
    return torch.ops.kernelgate.layer_norm(x, w, b, eps)


def _silu_mul(g, u):
    return torch.nn.functional.silu(g) * u


def _swiglu(g, u):
    return torch.ops.kernelgate.swiglu(g, u)


def _gelu_tanh_mul(g, u):
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def _geglu_tanh(g, u):
    return torch.ops.kernelgate.geglu(g, u, "tanh")


def _gelu_mul(g, u):
    return torch.nn.functional.gelu(g) * u


def _geglu_none(g, u):
    return torch.ops.kernelgate.geglu(g, u, "none")


def _rotate_half(x):
    """Hugging Face's, as written there."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_second_first(x):
    """The same rotation with its second half sliced first (as other model code writes it): the
    order of the slices decides the order in which autograd sums their gradients, which a
    training graph's pattern must match."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Each rotate-half spelling, with the name its forms take.
_ROTATIONS = ((_rotate_half, "hugging face rope"), (_rotate_half_second_first, "rotate-half rope, second half sliced first"))


def _rope_of(rotate):
    """Hugging Face's apply_rotary_pos_emb after its unsqueeze of cos and sin (which a model's
    layers share), with this rotation: q and k [batch, heads, seq, head_dim], cos and sin
    [batch or 1, 1, seq, head_dim]."""
    def f(q, k, cos, sin):
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    return f


def _rope_args(ts):
    """rope's arguments from its search function's: cos and sin without the heads dim (a 4-D
    cos whose second dim is not 1 stays 4-D, which the op refuses)."""
    q, k, cos, sin = ts
    return [q, k, cos.squeeze(1), sin.squeeze(1)]


def _rope(q, k, cos, sin):
    return torch.ops.kernelgate.rope(*_rope_args((q, k, cos, sin)))


def _qk_norm_rope_args(ts):
    """qk_norm_rope's arguments from its search function's: q and k [batch, seq, heads, head_dim]
    as the op takes them, [batch, heads, seq, head_dim] (views), and cos and sin as rope's."""
    q, k, qw, kw, cos, sin = ts
    return [q.transpose(1, 2), k.transpose(1, 2), qw, kw, cos.squeeze(1), sin.squeeze(1)]


def _qk_norm_then_rope(norm, rotate):
    """Qwen3's attention: per-head norms of the projections [batch, seq, heads, head_dim], the
    heads moved first, then the rope."""
    rope = _rope_of(rotate)

    def f(q, k, qw, kw, cos, sin, eps):
        return rope(norm(q, qw, eps).transpose(1, 2), norm(k, kw, eps).transpose(1, 2), cos, sin)
    return f


def _qk_norm_rope(q, k, qw, kw, cos, sin, eps):
    return torch.ops.kernelgate.qk_norm_rope(*_qk_norm_rope_args((q, k, qw, kw, cos, sin)), eps)


def _sdpa_causal(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _repeat_kv(x, n):
    """Hugging Face's repeat_kv: each kv head repeated for its n query heads."""
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n, s, d).reshape(b, kv_heads * n, s, d)


def _hf_sdpa_gqa(q, k, v, mask, scale):
    """Hugging Face's sdpa_attention_forward under torch.compile: the kv heads repeated, and the
    causal mask as a tensor (the model builds one where it is compiled)."""
    n = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n), attn_mask=mask,
                                                            scale=scale)


def _hf_sdpa(q, k, v, mask, scale):
    """The same with as many kv heads as query heads (nothing repeated)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _attention_args(ts):
    """attention's arguments from its search function's: q [batch, heads, seq, head_dim] grouped
    by kv head (a view), k, v (the mask is not the op's)."""
    q, k, v = ts[:3]
    b, heads, s, d = q.shape
    return [q.view(b, k.shape[1], heads // max(k.shape[1], 1), s, d), k, v]


def _attention_out(args):
    q, _, v = args
    return (q.shape[0], q.shape[1] * q.shape[2], q.shape[3], v.shape[-1])


def _attention(q, k, v, scale=None):
    """kg.attention, causal, on _attention_args; scale None (a graph's SDPA without one) is
    1/sqrt(head_dim), the op's 0."""
    args = _attention_args((q, k, v))
    o = torch.ops.kernelgate.attention(*args, "causal", 0.0 if scale is None else scale)
    return o.view(_attention_out(args))


def _attention_masked(q, k, v, mask, scale):
    return _attention(q, k, v, scale)


def _sdpa_kernels():
    """One context per SDPA kernel ATen has on CUDA: SDPA traced under each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [sdpa_kernel([b]) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                       SDPBackend.EFFICIENT_ATTENTION)]


def _not_causal(node) -> Optional[str]:
    """None where the attention mask `node` ([batch or 1, 1, seq, seq], boolean: the patterns
    are traced with one) is computed from constants alone (no input of the graph:
    no padding, no positions given) and is the causal mask: key j visible to query i iff j <= i.
    Checked by computing it, once per node; otherwise why not."""
    if not isinstance(node, torch.fx.Node):
        return "an attention mask that is not a tensor"
    if "kernelgate_not_causal" not in node.meta:
        node.meta["kernelgate_not_causal"] = _mask_refusal(node)
    return node.meta["kernelgate_not_causal"]


def _mask_refusal(node) -> Optional[str]:
    val = _val(node)
    if (not isinstance(val, torch.Tensor) or val.dim() != 4 or val.shape[1] != 1
            or val.shape[-1] != val.shape[-2]):
        return "an attention mask not of shape [batch or 1, 1, seq, seq]"
    if any(isinstance(d, torch.SymInt) for d in val.shape) or val.shape[-1] > 2 ** 14:
        return "an attention mask of symbolic size, or over 16384 positions (not checked)"
    order, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        target = n.target
        if n.op != "call_function" or (isinstance(target, torch._ops.OpOverload)
                                       and torch.Tag.nondeterministic_seeded in target.tags):
            return ("an attention mask computed from the graph's inputs (padding or positions given) or from random "
                    "numbers: not provably causal")
        order.append(n)
        stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    # Computed for real (the compile traces with fake tensors).
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        env = {}
        try:
            for n in sorted(order, key=index.get):
                env[n] = n.target(*torch.fx.node.map_arg(n.args, env.get), **torch.fx.node.map_arg(n.kwargs, env.get))
        except Exception as e:  # noqa: BLE001 (any op that does not run outside the compile)
            return f"an attention mask that could not be computed to check it ({type(e).__name__})"
        m = env[node]
        causal = torch.ones(m.shape[-2:], dtype=torch.bool, device=m.device).tril()
        same = m.dtype == torch.bool and all(bool((m[b, 0] == causal).all()) for b in range(m.shape[0]))
    return None if same else "an attention mask that is not the causal mask"


def _linear_ce_float(h, w, t):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), t)


def _linear_ce_plain(h, w, t):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), t)


def _linear_ce(h, w, t):
    return torch.ops.kernelgate.linear_cross_entropy(h, w, t)


def _hugging_face(dt: torch.dtype):
    """The Hugging Face norm, alone and after a residual add, and its name, as a model of dtype
    dt has them: in a float32 model its casts are no-ops and vanish from the graph."""
    if dt == torch.float32:
        return _plain_rms, _add_plain_rms, "hugging face (float32)"
    return _hf_rms, _add_hf_rms, "hugging face"


def _forms() -> List[_Form]:
    rows, hidden = (8, 64), (64,)
    out = []
    # Where one pattern holds another (q and k norms then rope holds rope and the norms; a
    # residual add then a norm holds the norm), the larger first: the matcher takes the first
    # registered pattern that matches at a node.
    heads = ((2, 8, 4, 16), (2, 8, 2, 16), (16,), (16,), (1, 1, 8, 16), (1, 1, 8, 16))
    for dt in (torch.bfloat16, torch.float32):
        hf, _, hf_name = _hugging_face(dt)
        for norm, spelled in ((hf, hf_name), (_f_rms, "F.rms_norm")):
            for rotate, rope in _ROTATIONS:
                out.append(_Form("qk_norm_rope", f"{spelled} of q and k, then {rope}", _qk_norm_then_rope(norm, rotate),
                                 _qk_norm_rope, ("q", "k", "qw", "kw", "cos", "sin"), dt, heads, eps=True,
                                 constants=("cos", "sin"), op_args=_qk_norm_rope_args))
    for rotate, rope in _ROTATIONS:
        out.append(_Form("rope", "hugging face (apply_rotary_pos_emb)" if rotate is _rotate_half else rope,
                         _rope_of(rotate), _rope, ("q", "k", "cos", "sin"), torch.bfloat16,
                         ((2, 4, 8, 16), (2, 2, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16)),
                         constants=("cos", "sin"), op_args=_rope_args, any_dtype=True))
    # Attention: SDPA causal (the kv heads grouped, or as many as the query heads), and Hugging
    # Face's form under torch.compile (its kv heads repeated, its causal mask a tensor).
    qkv = ((2, 4, 16, 16), (2, 2, 16, 16), (2, 2, 16, 16))
    mha = ((2, 4, 16, 16),) * 3
    attention = dict(dtype=torch.bfloat16, any_dtype=True, op_args=_attention_args, out_shape=_attention_out,
                     cuda_contexts=_sdpa_kernels, strings={"mask": "causal"})
    out += [
        # (a graph's SDPA without a scale has scale None, which the pattern's scale matches too)
        _Form("attention", "F.scaled_dot_product_attention(q, k, v, is_causal=True)", _sdpa_causal,
              _attention, ("q", "k", "v"), shapes=qkv, scale=True, **attention),
        _Form("attention", "hugging face sdpa (repeat_kv, a causal mask)", _hf_sdpa_gqa, _attention_masked,
              ("q", "k", "v", "mask"), shapes=(*qkv, (2, 1, 16, 16)), scale=True, causal_mask="mask",
              constants=("mask",), canonical=True, **attention),
        _Form("attention", "hugging face sdpa (a causal mask)", _hf_sdpa, _attention_masked,
              ("q", "k", "v", "mask"), shapes=(*mha, (2, 1, 16, 16)), scale=True, causal_mask="mask",
              constants=("mask",), canonical=True, **attention),
    ]
    for dt in (torch.bfloat16, torch.float32):
        hf, add_hf, hf_name = _hugging_face(dt)
        # A residual add feeding a norm first: its pattern holds the rms_norm pattern, and the
        # matcher takes the first registered pattern that matches.
        for search, spelled in ((add_hf, hf_name), (_add_f_rms, "F.rms_norm")):
            out += [
                _Form("add_rms_norm", f"x + residual, then {spelled}", search, _add_rms, ("x", "r", "w"), dt,
                      (rows, rows, hidden), eps=True),
                _Form("add_rms_norm", f"x + residual, then {spelled} (the sum not used after)", _norm_only(search),
                      _add_rms_norm_only, ("x", "r", "w"), dt, (rows, rows, hidden), eps=True),
            ]
        out += [
            _Form("rms_norm", hf_name, hf, _rms,
                  ("x", "w"), dt, (rows, hidden), eps=True),
            _Form("rms_norm", "F.rms_norm", _f_rms, _rms, ("x", "w"), dt, (rows, hidden), eps=True),
            _Form("layer_norm", "F.layer_norm", _f_layer_norm, _layer_norm, ("x", "w", "b"), dt,
                  (rows, hidden, hidden), eps=True),
            _Form("swiglu", "F.silu(g) * u", _silu_mul, _swiglu, ("g", "u"), dt, (rows, rows)),
            _Form("geglu", "F.gelu(g, approximate='tanh') * u", _gelu_tanh_mul, _geglu_tanh, ("g", "u"), dt,
                  (rows, rows), strings={"approximate": "tanh"}),
            _Form("geglu", "F.gelu(g) * u", _gelu_mul, _geglu_none, ("g", "u"), dt, (rows, rows),
                  strings={"approximate": "none"}),
            # A language model's loss: the float32 loss of the logits (16-bit models upcast them;
            # in a float32 model the cast vanishes). The op's loss is float32 whatever the input
            # dtype, so a 16-bit loss (no upcast) is not this op.
            _Form("linear_cross_entropy",
                  "F.cross_entropy(F.linear(h, w).float(), t)" if dt != torch.float32 else "F.cross_entropy(F.linear(h, w), t)",
                  _linear_ce_float if dt != torch.float32 else _linear_ce_plain, _linear_ce, ("h", "w", "t"), dt,
                  ((8, 64), (24, 64), (8,)), classes={"t": 24}, scalar_float32=True, absent=1),
        ]
    return out


def patterns() -> List[dict]:
    """The op, form and traced dtype family of every pattern the pass looks for."""
    return [{"op": f.op, "form": f.name,
             "dtypes": "any" if f.any_dtype else "float32" if f.dtype == torch.float32 else "16-bit"}
            for f in _forms()]


# ---- matching ---------------------------------------------------------------------------------

def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _examples(form: _Form, grad: bool, device: str) -> list:
    def example(a, s):
        if a in form.classes:
            return torch.randint(0, form.classes[a], s, device=device)
        if a == form.causal_mask:
            return torch.ones(s[-2:], dtype=torch.bool, device=device).tril().expand(s)
        return torch.randn(*s, dtype=form.dtype, device=device, requires_grad=grad and a not in form.constants)
    return [example(a, s) for a, s in zip(form.args, form.shapes)]


def _meta_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A meta tensor of a graph value's shape, strides and dtype (hints for symbolic sizes)."""
    try:
        shape = [int(s) if not isinstance(s, torch.SymInt) else s.node.hint for s in t.shape]
        stride = [int(s) if not isinstance(s, torch.SymInt) else s.node.hint for s in t.stride()]
    except Exception:  # noqa: BLE001 (a size without a hint)
        return None
    if any(v is None for v in shape + stride):
        return None
    return torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")


def _check(form: _Form, grad: bool, match: pm.Match) -> bool:
    decision = {}
    why = _refusal(form, grad, match, decision)
    with _lock:
        if why is None:
            _stats["rewritten"][f"{form.op}: {form.name}"] += 1
            _stats["served"][f"{form.op}: {decision['backend']} ({decision['reason']})"] += 1
        else:
            _stats["left"][f"{form.op}: {form.name}: {why}"] += 1
    if why is not None:
        log.debug("kernelgate.compile: left to Inductor: %s (%s): %s", form.op, form.name, why)
    return why is None


def _sdpa_may_pick_cudnn(device: torch.device) -> bool:
    """Whether PyTorch's own scaled_dot_product_attention may run cuDNN's kernels on `device`
    (its cuDNN backend enabled, a Hopper or later GPU, where SDPA ranks it first)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _unsafe_in_a_graph(op: str, grad: bool, decision: dict, device: torch.device) -> Optional[str]:
    """Why a training call the dispatcher would serve with `decision["backend"]` must not be
    rewritten into a compiled graph, or None. ATen caches cuDNN's compiled attention backward by
    the sizes and strides of q, k and v alone, with those of o, the output gradient and the
    log-sum-exp built in; in a compiled graph the output gradient comes in the layout the graph
    gives it, which need not be the one another SDPA call of the program compiled the cached
    graph with, and the second call then reads it in the first's layout. On the H100 the step
    benchmark's compile_hook variant, attention served by aten_cudnn after the process's eager and
    compiled SDPA had run, had a gradient 173% off (docs/evidence.md). The eager backend is
    PyTorch's SDPA, which runs those cuDNN kernels wherever it picks them: on the H100 the Hugging
    Face Llama and Qwen3 training steps, attention served by eager after other SDPA calls of the
    same q, k and v sizes in the process, had their embeddings' gradient 76% and 102% off."""
    if op != "attention" or not grad:
        return None
    if decision.get("backend") == "aten_cudnn":
        return ("the backend that would serve it is aten_cudnn, whose backward ATen caches by q, k and v "
                "alone: in a compiled graph it can read the output gradient in another SDPA call's layout")
    if decision.get("backend") == "eager" and _sdpa_may_pick_cudnn(device):
        return ("the backend that would serve it is eager, PyTorch's SDPA, which runs cuDNN's attention on "
                "this GPU, whose backward ATen caches by q, k and v alone: in a compiled graph it can read "
                "the output gradient in another SDPA call's layout")
    return None


def _refusal(form: _Form, grad: bool, match: pm.Match, decision: dict) -> Optional[str]:
    """Why the match is left to Inductor, or None; `decision` gets the dispatcher's explanation
    of the op's call where it got that far."""
    if _active.ops is not None and form.op not in _active.ops:
        return "not among the ops this compile rewrites (ops=...)"
    every = [_val(match.kwargs.get(a)) for a in form.args]
    if any(not isinstance(t, torch.Tensor) for t in every):
        return "an input is not a tensor"
    if any(t.dtype != torch.int64 for a, t in zip(form.args, every) if a in form.classes):
        return "class indices that are not int64"
    tensors = [t for a, t in zip(form.args, every) if a not in form.classes and a != form.causal_mask]
    x = tensors[0]
    if any(t.dtype != x.dtype for t in tensors):
        return f"dtypes {[str(t.dtype) for t in tensors]} (the op takes one dtype for all)"
    if not x.dtype.is_floating_point or (not form.any_dtype and (form.dtype == torch.float32) != (x.dtype == torch.float32)):
        return f"dtype {x.dtype} (this form is for {'float32' if form.dtype == torch.float32 else '16-bit'} inputs)"
    if x.dtype == torch.float64:
        return "float64 (kernelgate's ops take float32, float16 and bfloat16)"
    if any(t.device != x.device for t in every):
        return "tensors on more than one device"
    metas = [_meta_of(t) for t in every]
    if any(m is None for m in metas):
        return "symbolic sizes without a hint"
    if form.causal_mask is not None:
        why = _not_causal(match.kwargs[form.causal_mask])
        if why is not None:
            return why
    try:
        metas = form.op_args(metas)
    except RuntimeError as e:  # a view the op's layout cannot take
        return f"the op refuses the call: {e}"
    outputs = match.output_nodes()
    out = _val(outputs[0])
    shape = tuple(form.out_shape(metas) if form.out_shape else metas[0].shape)
    want = (torch.float32, ()) if form.scalar_float32 else (x.dtype, shape)
    if out is None or (out.dtype, tuple(out.shape)) != want:
        return "its result's dtype or shape differs from the op's (a broadcast or a type promotion)"
    try:
        decision.update(_C.explain(form.op, metas + [None] * form.absent, grad, dict(form.strings), str(x.device)))
    except RuntimeError as e:
        return f"the op refuses the call: {e}"
    why = _unsafe_in_a_graph(form.op, grad, decision, x.device)
    if why is not None:
        return why
    if _active.mode == "evidence":
        return kernel_serves(decision)
    return None


class _Pass(CustomGraphPass):
    """Inductor's joint_custom_post_pass: kernelgate's patterns over the joint (or inference)
    graph, in its own mode; then another custom pass the user had installed, if any."""

    def __init__(self, mode: str, then: Optional[Callable] = None, ops: Optional[Sequence[str]] = None):
        if mode not in MODES:
            raise ValueError(f"kernelgate.compile: mode must be one of {', '.join(MODES)}, got {mode!r}")
        known = sorted({f.op for f in _forms()}) if ops is not None else []
        if ops is not None and (isinstance(ops, str) or any(op not in known for op in ops)):
            raise ValueError(f"kernelgate.compile: ops must be a list of {', '.join(known)}, got {ops!r}")
        self.mode, self.then = mode, then
        self.ops = None if ops is None else frozenset(ops)

    def __call__(self, graph: torch.fx.Graph) -> None:
        _active.mode, _active.ops = self.mode, self.ops
        with warnings.catch_warnings():
            # A multi-output pattern whose outputs share a node (add_rms_norm's two input
            # gradients are one tensor) has it replaced once per output: harmless, not the user's.
            warnings.filterwarnings("ignore", message=r"erase_node\(.*\) on an already erased node")
            n = _pattern_pass().apply(graph)
        if n:
            pm.stable_topological_sort(graph)
            graph.lint()
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else repr(self.then)
        return (get_hash_for_files((__file__,)), self.mode, sorted(self.ops or ()), self.ops is None,
                _C.generation(), then)


def _forward_only(fn, args):
    """The forward graph with a decomposition's in-place op on an intermediate (F.rms_norm's
    ``add_``) made functional, as Inductor's functionalized inference graphs have it."""
    gm = pm.fwd_only(fn, args)
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        name = n.target.overloadpacket.__name__
        first = n.args[0] if n.args else None
        if (name.endswith("_") and not name.endswith("__") and isinstance(first, torch.fx.Node)
                and first.op != "placeholder" and len(first.users) == 1):
            n.target = getattr(getattr(torch.ops.aten, name[:-1]), n.target._overloadname)
    gm.recompile()
    return gm


@functools.lru_cache(maxsize=None)
def _pattern_pass() -> pm.PatternMatcherPass:
    """Every form traced twice: as a joint forward+backward graph (training, both inputs
    requiring grad) and as a forward graph (inference), on the CPU and, where there is one, on a
    CUDA device: PyTorch decomposes some backwards per device (on CUDA F.rms_norm's, and
    bfloat16 F.layer_norm's, come out as other ATen graphs than on the CPU), and a pattern
    matches only graphs like the one it was traced from; a device's trace is registered where
    it differs from the CPU's. Traced once per process, at the first compile that runs the pass."""
    passes = pm.PatternMatcherPass(pass_name="kernelgate")
    cuda = torch.cuda.is_available()
    forms = _forms()
    if any(form.canonical for form in forms):
        # Inductor registers its own joint-graph patterns at their first use, through the
        # function a form is registered with, which cannot run inside itself: first, here.
        from torch._inductor.fx_passes.joint_graph import lazy_init
        lazy_init(None)
    for form in forms:
        # The matcher names a pattern's inputs after the search function's parameters: x, w,
        # b, g, u, h, t, q, k, qw, kw, cos, sin and eps.
        for grad, trace in ((True, pm.joint_fwd_bwd), (False, _forward_only)):
            trace = _canonical(trace) if form.canonical else trace
            devices = ["cpu"]
            if cuda and _ops_traced(form, grad, trace, "cuda") != _ops_traced(form, grad, trace, "cpu"):
                devices.append("cuda")
            for device in devices:
                # attention: each SDPA kernel ATen may pick on CUDA is an op of its own in the graph
                for context in (form.cuda_contexts() if device == "cuda" and form.cuda_contexts else [None]):
                    try:
                        with context or contextlib.nullcontext():
                            pm.register_replacement(form.search, form.replace, _examples(form, grad, device), trace,
                                                    passes, extra_check=functools.partial(_check, form, grad),
                                                    scalar_workaround=form.scalars or None,
                                                    skip_duplicates=context is not None)
                    except RuntimeError as e:  # that kernel does not take the example
                        if context is None:
                            raise
                        log.debug("kernelgate.compile: %s (%s) not traced under %s: %s", form.op, form.name, context, e)
    for entries in passes.patterns.values():
        for entry in entries:
            if type(entry.pattern) is pm.MultiOutputPattern:
                entry.pattern.__class__ = _Outputs
    return passes


class _Outputs(pm.MultiOutputPattern):
    """A pattern of several outputs (a joint graph's results and input gradients), matched as
    Inductor matches them, with two more rules for each further output it finds from the nodes
    matched before: no graph node is matched by two of the pattern's ops, and a tangent (the
    gradient of forward output i) has that output's shape and dtype. Without them a pattern
    whose parts look alike (rope's q and k, whose backward reads neither) could take k's
    backward for q's, or q's forward for k's."""

    def _match_from_anchors(self, pattern, ctx):
        prior = dict(ctx.pattern_to_node)
        m = pm.FailedMatch("no anchor found")
        for node in pattern.find_anchor_nodes(ctx, OrderedSet()):
            m = ctx.match(pattern, node)
            if pm.is_match(m):
                why = self._inconsistent(ctx)
                if why is None:
                    return m
                m = pm.FailedMatch(why)
            ctx.pattern_to_node = dict(prior)
        return m

    def _inconsistent(self, ctx) -> Optional[str]:
        ops = [n for p, n in ctx.pattern_to_node.items() if isinstance(p, pm._TargetExpr) and n is not None]
        if len(ops) != len(set(ops)):
            return "a node matched twice"
        tangents = {p.name: n for p, n in ctx.pattern_to_node.items()
                    if isinstance(p, pm.KeywordArg) and p.name.startswith("tangents_") and n is not None}
        for name, tangent in tangents.items():
            i = int(name[len("tangents_"):]) - 1
            out = ctx.pattern_to_node.get(self.outputs[i]) if 0 <= i < len(self.outputs) else None
            a, b = _val(tangent), _val(out)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.shape, a.dtype) != (b.shape, b.dtype):
                return f"{name} is not the gradient of output {i}"
        return None


def _canonical(trace):
    """`trace`, then Inductor's joint-graph passes over the traced graph (in the fake mode the
    graph was traced in; no custom passes: kernelgate's own is one of them), which make a graph
    what kernelgate's pass is given."""
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    def traced(fn, args):
        gm = trace(fn, args)
        fake = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])
        # Set and restored by hand: this runs inside a compile whose config is patched already.
        custom = inductor_config.joint_custom_pre_pass, inductor_config.joint_custom_post_pass
        inductor_config.joint_custom_pre_pass = inductor_config.joint_custom_post_pass = None
        try:
            with V.set_fake_mode(fake), fake:
                joint_graph_passes(gm)
        finally:
            inductor_config.joint_custom_pre_pass, inductor_config.joint_custom_post_pass = custom
        return gm
    return traced


def _ops_traced(form: _Form, grad: bool, trace, device: str) -> List[str]:
    """The ATen ops, in order, of a form's graph as `trace` makes it on `device`."""
    fn = (lambda *t: form.search(*t, **form.scalars)) if form.scalars else form.search
    gm = trace(fn, _examples(form, grad, device))
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


# ---- the interface ----------------------------------------------------------------------------

def options(mode: str = "evidence", ops: Optional[Sequence[str]] = None) -> dict:
    """Options for one ``torch.compile(..., options=...)``: kernelgate's pass as Inductor's
    joint_custom_post_pass. `ops`: rewrite only these ops (default: every op of ``patterns()``)."""
    return {"joint_custom_post_pass": _Pass(mode, _installed_other(), ops)}


def enable(mode: str = "evidence", ops: Optional[Sequence[str]] = None) -> None:
    """Every Inductor compile from here on runs kernelgate's pass (after a joint_custom_post_pass
    installed before, which it keeps); `ops` as for ``options``."""
    inductor_config.joint_custom_post_pass = _Pass(mode, _installed_other(), ops)


def disable() -> None:
    """Removes kernelgate's pass (a pass it had kept stays installed)."""
    current = inductor_config.joint_custom_post_pass
    if isinstance(current, _Pass):
        inductor_config.joint_custom_post_pass = current.then


def enabled() -> bool:
    return isinstance(inductor_config.joint_custom_post_pass, _Pass)


def stats(reset: bool = False) -> dict:
    """{"rewritten": {"op: form": count}, "left": {"op: form: why": count}, "served": {"op: backend
    (the dispatcher's reason)": count}} since the last reset: one count per match (a training
    graph's match covers forward and backward); "served" says which backend the dispatcher
    chose for each rewritten call, as ``kg.explain`` would (a forced backend is the user's)."""
    with _lock:
        out = {k: dict(v) for k, v in _stats.items()}
        if reset:
            for v in _stats.values():
                v.clear()
    return out


def _installed_other():
    current = inductor_config.joint_custom_post_pass
    return current.then if isinstance(current, _Pass) else current
