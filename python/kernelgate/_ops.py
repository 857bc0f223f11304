"""The op API. Each function is a direct call of the registered torch op: nothing is decided here.

Eager calls take a shorter way into the same op (kernelgate._C.fast_op: the op's own argument
kinds instead of torch.ops' generic parsing, about 2 us less per call) and fall back to
torch.ops.kernelgate.<op> for what it does not take (keywords, a tensor subclass, a proxy, a
__torch_function__ mode). Both reach PyTorch's dispatcher, so autograd, Python dispatch modes and
CUDA graphs see the same op either way; torch.compile traces the torch.ops call in its place.
"""

from typing import Callable, Optional, Tuple

import torch
import torch.utils.weak
from torch._dynamo import substitute_in_graph

from . import _C


def routed(name: str) -> Callable:
    """The op `name` as a function (kg.<op> for ops without a wrapper of their own)."""
    slow = getattr(torch.ops.kernelgate, name).default
    fast = _C.fast_op(name, slow)

    # What torch.compile traces instead of the builtin: the op itself.
    @substitute_in_graph(fast, skip_signature_check=True)
    def traced(*args, **kwargs):
        return slow(*args, **kwargs)

    return fast


_rms_norm = routed("rms_norm")
_swiglu = routed("swiglu")
_geglu = routed("geglu")
_add_rms_norm = routed("add_rms_norm")
_layer_norm = routed("layer_norm")
_rope = routed("rope")
_qk_norm_rope = routed("qk_norm_rope")
_cross_entropy = routed("cross_entropy")
_linear_cross_entropy = routed("linear_cross_entropy")
_attention = routed("attention")


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """Normalise `x` over its last dim by its root mean square and scale by `weight`.

    Accumulates in float32 and returns x's dtype. Supports float32, float16 and bfloat16, any
    leading shape, autograd (x and weight), torch.compile and CUDA graphs.
    """
    return _rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, float32 math, in gate's dtype; gate and up of one shape."""
    return _swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up (approximate: "tanh" or "none"), float32 math."""
    return _geglu(gate, up, approximate)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6
) -> Tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype, as `h = x + residual` is); returns
    (rms_norm(h) * weight, h) with float32 statistics. Gradients flow into both outputs."""
    return _add_rms_norm(x, residual, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm over the last dim with float32 statistics, as
    torch.nn.functional.layer_norm(x, (x.size(-1),), weight, bias, eps)."""
    return _layer_norm(x, weight, bias, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, rotate-half convention (Llama / Hugging Face):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``.

    q: [batch, q_heads, seq, head_dim], k: [batch, kv_heads, seq, head_dim] (q_heads and kv_heads
    may differ: GQA); head_dim even. cos, sin: [1 or batch, seq, head_dim], shared by all heads, in
    q's dtype. q and k may be strided (e.g. a [b, s, h, d] projection transposed). float32 math;
    returns (q_out, k_out), contiguous, in q's dtype.

    Gradients flow to q and k only: cos and sin are treated as constants (no gradient is
    computed for them even if they require one).
    """
    return _rope(q, k, cos, sin)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head rms_norm of q and k over head_dim (weights q_weight and k_weight, [head_dim];
    float32 statistics), then :func:`rope`, fused (Qwen3 / OLMo2-style qk-norm).

    Shapes as for :func:`rope`. The normalised heads stay in float32 between the norm and the
    rotation (an eager ``rope(rms_norm(q), ...)`` rounds them to q's dtype in between; the
    float64 oracle does not, so this is at least as accurate). Gradients flow to q, k, q_weight
    and k_weight; cos and sin are constants.
    """
    return _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """torch.nn.functional.cross_entropy of 2-D logits [rows, classes] against target [rows]
    (int64 or int32), float32 math, loss in logits' dtype.

    reduction "mean" averages over the rows whose target is not ignore_index (NaN when every row
    is ignored, as F.cross_entropy), "sum" sums, "none" gives per-row losses (0 for ignored rows).
    label_smoothing in [0, 1]. A target outside [0, classes) is an error on the CPU; on CUDA its
    row's loss (and gradient) is NaN, since checking would need a device sync.
    """
    return _cross_entropy(logits, target, ignore_index, label_smoothing, reduction)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) computed in chunks of rows, never
    holding the float32 logits: hidden [rows, hidden], weight [classes, hidden], bias [classes].
    The loss is float32 whatever hidden's dtype, as ``F.cross_entropy(logits.float(), ...)``
    gives it.

    With gradients on and reduction "mean" or "sum", the forward also computes the gradients
    (hidden, weight, bias) and the backward scales them; backward through the same graph a
    second time (retain_graph=True) is refused for these reductions.
    """
    return _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: Optional[float] = None, *, cu_seqlens: Optional[torch.Tensor] = None,
              max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Softmax attention, as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=scale, enable_gqa=True)``: q [batch, heads, seq, head_dim], k and v [batch, kv_heads,
    seq, head_dim] with heads a multiple of kv_heads (query head h reads kv head
    h // (heads // kv_heads)); scale None means 1 / sqrt(head_dim); returns [batch, heads, seq,
    head_dim] in q's dtype. causal masks key j > query i (q and k of one length).

    The routed op is ``attention`` with q grouped by kv head, [batch, kv_heads, group, seq,
    head_dim], a view of this q (``kg.explain("attention", ...)`` takes that form).

    Varlen form (``cu_seqlens`` given), as FlashAttention's ``flash_attn_varlen_func``: packed
    sequences, q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], cu_seqlens the
    1-D integer offsets of the sequences (0, increasing, ending at tokens; on q's device or the
    CPU); each token attends within its own sequence. max_seqlen: the longest sequence, computed
    from cu_seqlens when None. Checking cu_seqlens reads it on the host: one device sync for a
    CUDA tensor (none for a CPU one) at its first call; later calls with the same tensor, unchanged
    (every layer of a model's step), reuse the check. The routed op is ``attention_varlen``.
    """
    if cu_seqlens is not None:
        return _attention_varlen(q, k, v, causal, scale, cu_seqlens, max_seqlen)
    if max_seqlen is not None:
        raise ValueError("kg.attention: max_seqlen is for the varlen form: give cu_seqlens with it")
    heads, kv_heads = _check_qkv(q, k, v, 4, "", "[batch, heads, seq, head_dim]")
    _check_causal_and_scale(causal, scale)
    b, _, s, d = q.shape
    o = _attention(q.view(b, kv_heads, heads // kv_heads, s, d), k, v, "causal" if causal else "none",
                   0.0 if scale is None else float(scale))
    return o.view(b, heads, s, o.shape[-1])


def _check_qkv(q, k, v, dims: int, form: str, layout: str) -> Tuple[int, int]:
    """q, k and v tensors of `dims` dims with heads a multiple of kv_heads (dim 1 in both forms);
    returns (heads, kv_heads)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            got = f"a {t.dim()}-D tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"kg.attention: {form}{name} must be a {dims}-D tensor {layout}, got {got}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"kg.attention: q's heads must be a multiple of k's kv_heads (grouped-query "
                         f"attention), got q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}")
    return heads, kv_heads


def _check_causal_and_scale(causal, scale) -> None:
    if not isinstance(causal, bool):  # causal="none" would otherwise mask as causal, silently
        raise ValueError(f"kg.attention: causal must be True or False, got {causal!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale == 0):
        raise ValueError(f"kg.attention: scale must be a non-zero number, or None for 1 / sqrt(head_dim); got {scale!r}")


def _attention_varlen(q, k, v, causal, scale, cu_seqlens, max_seqlen) -> torch.Tensor:
    heads, kv_heads = _check_qkv(q, k, v, 3, "with cu_seqlens, ", "[tokens, heads, head_dim]")
    tokens, _, d = q.shape
    _check_causal_and_scale(causal, scale)
    # Traced by torch.compile, the offsets' values are not known: they go unchecked (the op reads
    # any offsets as a set of boundaries) and max_seqlen, if not given, is the tokens' count.
    longest, cu_seqlens = _check_cu_seqlens(cu_seqlens, tokens, q.device, values=not torch.compiler.is_compiling())
    if max_seqlen is None:
        max_seqlen = tokens if longest is None else longest
    elif not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < (longest or 0):
        raise ValueError(f"kg.attention: max_seqlen must be an int at least the longest sequence of cu_seqlens "
                         f"({'unknown while traced' if longest is None else longest}), got {max_seqlen!r}")
    from .attention_varlen import attention_varlen

    o = attention_varlen(q.view(tokens, kv_heads, heads // kv_heads, d), k, v, cu_seqlens,
                         "causal" if causal else "none", 0.0 if scale is None else float(scale), max_seqlen)
    return o.view(tokens, heads, o.shape[-1])


# cu_seqlens tensors already checked, with what the check found: a model passes one batch's
# cu_seqlens to every layer's attention, and only the first call reads it on the host (a device
# sync for a CUDA tensor). Keyed by the tensor itself (not its values); its version counter tells
# an in-place change.
_CHECKED_OFFSETS: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()


def _check_cu_seqlens(cu_seqlens, tokens: int, device: torch.device,
                      values: bool = True) -> Tuple[Optional[int], torch.Tensor]:
    """A cu_seqlens the varlen form takes (check_offsets_tensor, check_offsets_values unless not
    `values`) on `device` or the CPU. Returns the longest sequence (None where values are not
    read) and cu_seqlens on `device` (a CPU one copied once)."""
    check_offsets_tensor(cu_seqlens, "kg.attention", "cu_seqlens")
    if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise ValueError(f"kg.attention: cu_seqlens must be on q's device ({device}) or the CPU, got {cu_seqlens.device}")
    if not values:
        return None, cu_seqlens.to(device)
    seen = _CHECKED_OFFSETS.get(cu_seqlens)
    if seen is not None and seen[:3] == (cu_seqlens._version, tokens, device):
        return seen[3], cu_seqlens if seen[4] is None else seen[4]
    offsets = check_offsets_values(cu_seqlens, tokens, f"q's tokens ({tokens})", "kg.attention", "cu_seqlens")
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    on_device = cu_seqlens.to(device)
    # The entry must not hold the tensor it is keyed by (it would never be freed).
    _CHECKED_OFFSETS[cu_seqlens] = (cu_seqlens._version, tokens, device, longest,
                                    None if on_device is cu_seqlens else on_device)
    if on_device is not cu_seqlens:  # the copy the op gets is checked too
        _CHECKED_OFFSETS[on_device] = (on_device._version, tokens, device, longest, None)
    return longest, on_device


def offsets_checked(cu_seqlens: torch.Tensor, tokens: int) -> bool:
    """Whether kg.attention checked this cu_seqlens tensor for `tokens` tokens and it is unchanged
    since: then it starts at 0, never decreases and ends at tokens."""
    seen = _CHECKED_OFFSETS.get(cu_seqlens)
    return seen is not None and seen[:2] == (cu_seqlens._version, tokens)


def check_offsets_tensor(offsets, what: str, name: str) -> None:
    """Sequence offsets (cu_seqlens) must be a 1-D int32 or int64 tensor of at least two offsets:
    an error naming `name` otherwise (the device is the caller's rule)."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a tensor of sequence offsets, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: {name} must be a 1-D int32 or int64 tensor of at least 2 offsets, "
                         f"got {offsets.dtype} of shape {list(offsets.shape)}")


def check_offsets_values(offsets: torch.Tensor, total: int, total_is: str, what: str, name: str) -> list:
    """The offsets read on the host (one device sync for a CUDA tensor), which must start at 0,
    never decrease (an empty sequence is allowed) and end at `total` (described as `total_is`)."""
    v = offsets.tolist()
    if v[0] != 0 or any(b < a for a, b in zip(v, v[1:])) or v[-1] != total:
        shown = v if len(v) <= 12 else v[:6] + ["..."] + v[-6:]
        raise ValueError(f"{what}: {name} must start at 0, never decrease and end at {total_is}, got {shown}")
    return v
