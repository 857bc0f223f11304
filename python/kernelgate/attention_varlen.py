"""attention_varlen: softmax attention over packed sequences of different lengths (the varlen form
of FlashAttention's ``flash_attn_varlen_func`` and PyTorch's ``torch.nn.attention.varlen``), with
grouped kv heads. ``kg.attention(q, k, v, causal, scale, cu_seqlens=...)`` calls it.

q [tokens, kv_heads, group, head_dim] (a view of the user's [tokens, heads, head_dim], query head
h reading kv head h // group), k and v [tokens, kv_heads, head_dim]; the sequences are the runs of
tokens between consecutive boundaries. A token attends to the tokens of its own sequence (mask
"none"), or to those at or before it (mask "causal"), with the scores scaled by `scale` (0: 1 /
sqrt(head_dim)). Returns o in q's layout and dtype.

The boundaries are the op's cu_seqlens, taken as a set: sorted, clamped to [0, tokens], with 0
and tokens added, a repeated value an empty sequence. A user's cu_seqlens (0, then increasing to
tokens) is such a set as given; kg.attention checks that it is one before calling the op, so a
wrong one is an error, while any integer tensor is a valid input of the op itself (the harness
generates them at random). max_seqlen: the longest sequence if the caller knows it, 0 for
unknown (tokens is then its bound).

The reference computes every query against every key of the packed tokens with the mask of the
sequences (float32 accumulation; float64 for the oracle): simple, exact and twice differentiable
(as every reference must be; PyTorch's fused SDPA kernels have no double backward), and quadratic
in tokens in time and memory, for the harness's and small calls. torch_varlen (CUDA, 16-bit) is
PyTorch's varlen attention (FlashAttention's kernels, or cuDNN's where PyTorch picks them), its
backward from a recomputed forward; like every backend it serves only where evidence shows it
correct.
"""

import torch

from ._define import define_op, register_backend

SCHEMA = ("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, str mask=\"causal\", "
          "float scale=0.0, int max_seqlen=0) -> Tensor")
DIMS = ("q: [tokens, kv_heads, group, head_dim]; k: [tokens, kv_heads, head_dim]; "
        "v: [tokens, kv_heads, head_dim]; cu_seqlens: [bounds] index")


def boundaries(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The op's sequence boundaries: cu_seqlens sorted and clamped to [0, tokens], with 0 and
    tokens added (int64, on cu_seqlens' device; no host sync)."""
    cu = cu_seqlens.to(torch.int64).reshape(-1).clamp(0, tokens).sort().values
    return torch.cat([cu.new_zeros(1), cu, cu.new_full((1,), tokens)])


def attention_varlen_reference(q, k, v, cu_seqlens, mask, scale, max_seqlen):
    acc = torch.promote_types(q.dtype, torch.float32)
    T, Hkv, G, D = q.shape
    s = D ** -0.5 if scale == 0 and D > 0 else scale
    pos = torch.arange(T, device=q.device)
    seq = torch.searchsorted(boundaries(cu_seqlens, T), pos, right=True)  # a sequence's tokens share it
    allowed = seq[:, None] == seq[None, :]
    if mask == "causal":
        allowed = allowed & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("ikgd,jkd->kgij", q.to(acc), k.to(acc)) * s
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # a token sees itself
    return torch.einsum("kgij,jkd->ikgd", p, v.to(acc)).to(q.dtype)


attention_varlen = define_op(
    SCHEMA,
    dims=DIMS,
    reference=attention_varlen_reference,
    test_values={"scale": [0.0, 0.3]},
    variants={"mask": ["causal", "none"]},
    index_ranges={"cu_seqlens": "tokens"},
    dim_ranges={"tokens": (1, 65536), "kv_heads": (1, 32), "group": (1, 16), "head_dim": (1, 256),
                "bounds": (1, 65)},
    production_shapes=[{"tokens": 16384, "kv_heads": 8, "group": 4, "head_dim": 128, "bounds": 9},
                       {"tokens": 8192, "kv_heads": 4, "group": 4, "head_dim": 128, "bounds": 5},
                       {"tokens": 32768, "kv_heads": 8, "group": 1, "head_dim": 64, "bounds": 33}],
)


def _torch_varlen_call(q, k, v, cu_seqlens, mask, scale, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn

    T, Hkv, G, D = q.shape
    cu = boundaries(cu_seqlens, T).to(torch.int32)
    longest = max_seqlen if max_seqlen > 0 else T
    # PyTorch's varlen attention takes q with heads = kv_heads * group, query head h on kv head
    # h // group: q's [tokens, kv_heads, group, head_dim] flattened is that order.
    o = varlen_attn(q.reshape(T, Hkv * G, D), k, v, cu, cu, longest, longest,
                    scale=None if scale == 0 else scale, window_size=(-1, 0) if mask == "causal" else (-1, -1))
    return o.view(T, Hkv, G, D)


def torch_varlen_fwd(q, k, v, cu_seqlens, mask, scale, max_seqlen):
    return _torch_varlen_call(q, k, v, cu_seqlens, mask, scale, max_seqlen)


def torch_varlen_bwd(grad_o, q, k, v, cu_seqlens, mask, scale, max_seqlen):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = _torch_varlen_call(*leaves, cu_seqlens, mask, scale, max_seqlen)
        return torch.autograd.grad(o, leaves, grad_o)


def _torch_varlen_can_implement(q, k, v, cu_seqlens):
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return "this PyTorch has no torch.nn.attention.varlen"
    D = q.shape[-1]
    if D % 8 != 0 or D > 256:
        return f"head_dim {D}: PyTorch's varlen attention takes a multiple of 8 up to 256"
    return True


register_backend("attention_varlen", "torch_varlen", torch_varlen_fwd, torch_varlen_bwd,
                 can_implement=_torch_varlen_can_implement, device="cuda",
                 dtypes=(torch.float16, torch.bfloat16), nonempty=True)
