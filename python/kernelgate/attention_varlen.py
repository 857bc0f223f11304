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

The reference computes each sequence's attention on its own (float32 accumulation; float64 for
the oracle): exact and twice differentiable (as every reference must be; PyTorch's fused kernels
have no double backward), in time the sum of the sequences' squared lengths, in blocks of queries
whose scores fit 1 GiB in float64 (forward and backward: the backward recomputes them). It reads
the boundaries on the host (one sync); where it cannot (meta and traced tensors, torch.compile's
tracing, CUDA-graph capture) it computes every query against every packed key under the
sequences' mask instead, quadratic in tokens. The eager backend is the plain PyTorch code a user
would write: on CUDA in 16 bits PyTorch's varlen attention (FlashAttention's kernels, or cuDNN's
where PyTorch picks them; head_dim a multiple of 8 up to 256), its gradients by PyTorch's
autograd; elsewhere the reference. It serves where no evidence ranks a backend; like every
backend it is swept against the oracle.
"""

import importlib.util

import torch
import torch.utils.weak

from ._define import define_op
from ._ops import offsets_checked

SCHEMA = ("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, str mask=\"causal\", "
          "float scale=0.0, int max_seqlen=0) -> Tensor")
DIMS = ("q: [tokens, kv_heads, group, head_dim]; k: [tokens, kv_heads, head_dim]; "
        "v: [tokens, kv_heads, head_dim]; cu_seqlens: [bounds] index")


def boundaries(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The op's sequence boundaries: cu_seqlens sorted and clamped to [0, tokens], with 0 and
    tokens added (int64, on cu_seqlens' device; no host sync)."""
    cu = cu_seqlens.to(torch.int64).reshape(-1).clamp(0, tokens).sort().values
    return torch.cat([cu.new_zeros(1), cu, cu.new_full((1,), tokens)])


def _no_host_values(t: torch.Tensor) -> bool:
    """Where the boundaries' values cannot be read on the host: meta and traced tensors (a
    tensor subclass: FakeTensor, FunctionalTensor), torch.compile's tracing, CUDA-graph capture."""
    return (t.device.type == "meta" or type(t) is not torch.Tensor or torch.compiler.is_compiling()
            or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def _masked_scores(q, k, s, causal, start):
    """Scores [kv_heads, group, queries, keys] of queries at positions start.. of one sequence,
    -inf where causal masks a key."""
    scores = torch.einsum("ikgd,jkd->kgij", q, k) * s
    if causal:
        qpos = torch.arange(start, start + q.shape[0], device=q.device)
        later = torch.arange(k.shape[0], device=q.device)[None, :] > qpos[:, None]
        scores = scores.masked_fill(later, float("-inf"))  # a token sees itself
    return scores


# Scores a block of queries may hold at once (float64: 1 GiB): a sequence's attention is computed
# in blocks of queries, so the oracle of a long sequence fits where its whole score matrix would not.
_BLOCK_SCORES = 1 << 27


class _Attend(torch.autograd.Function):
    """One sequence's attention, o = softmax(q k^T s, causal) v, in blocks of queries: forward and
    backward keep [heads, block, keys] scores at a time where autograd through the plain code keeps
    every [heads, keys, keys] probability matrix. The backward recomputes each block's
    probabilities in differentiable ops (o the saved output), so autograd differentiates it again."""

    @staticmethod
    def forward(ctx, q, k, v, s, causal):
        n, heads = q.shape[0], q.shape[1] * q.shape[2]
        ctx.block = block = max(1, _BLOCK_SCORES // max(1, heads * k.shape[0]))
        ctx.s, ctx.causal = s, causal
        probs = (torch.softmax(_masked_scores(q[i:i + block], k, s, causal, i), -1) for i in range(0, n, block))
        o = torch.cat([torch.einsum("kgij,jkd->ikgd", p, v) for p in probs])
        ctx.save_for_backward(q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        s, causal, block = ctx.s, ctx.causal, ctx.block
        dq, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
        for i in range(0, q.shape[0], block):
            qb, ob, dob = q[i:i + block], o[i:i + block], do[i:i + block]
            p = torch.softmax(_masked_scores(qb, k, s, causal, i), -1)  # [kv_heads, group, b, keys]
            dv = dv + torch.einsum("kgij,ikgd->jkd", p, dob)
            dp = torch.einsum("ikgd,jkd->kgij", dob, v)
            ds = p * (dp - torch.einsum("ikgd,ikgd->kgi", dob, ob)[..., None]) * s
            dq.append(torch.einsum("kgij,jkd->ikgd", ds, k))
            dk = dk + torch.einsum("kgij,ikgd->jkd", ds, qb)
        return torch.cat(dq), dk, dv, None, None


def attention_varlen_reference(q, k, v, cu_seqlens, mask, scale, max_seqlen):
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    T, Hkv, G, D = q.shape
    s = D ** -0.5 if scale == 0 and D > 0 else scale
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    cu = boundaries(cu_seqlens, T)

    if _no_host_values(q):
        # Every query against every packed key, under the sequences' mask (shapes stay symbolic).
        pos = torch.arange(T, device=q.device)
        seq = torch.searchsorted(cu, pos, right=True)  # a sequence's tokens share it
        allowed = seq[:, None] == seq[None, :]
        if mask == "causal":
            allowed = allowed & (pos[None, :] <= pos[:, None])
        scores = _masked_scores(q, k, s, False, 0)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # a token sees itself
        o = torch.einsum("kgij,jkd->ikgd", p, v)
    else:
        b = cu.tolist()
        parts = [_Attend.apply(q[a:e], k[a:e], v[a:e], s, mask == "causal") for a, e in zip(b, b[1:]) if e > a]
        o = torch.cat(parts) if parts else q.new_zeros(0, Hkv, G, v.shape[-1])
    return o.to(dtype)


_HAS_VARLEN_ATTN = importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _varlen_attn_refuses(q) -> str:
    """Why PyTorch's varlen attention cannot take the call ("" if it can)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "PyTorch's varlen attention takes CUDA float16 and bfloat16 tensors"
    if q.shape[-1] % 8 != 0 or q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]}: PyTorch's varlen attention takes a multiple of 8 up to 256"
    if q.numel() == 0:
        return "no tokens"
    if not _HAS_VARLEN_ATTN:
        return "this PyTorch has no torch.nn.attention.varlen"
    return ""


def _dense_aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    # A traced tensor has no address: the graph's own buffers are aligned.
    return t.clone() if type(t) is torch.Tensor and t.data_ptr() % 16 else t


# The boundaries of a cu_seqlens tensor as PyTorch's varlen attention takes them (int32, dense).
# A cu_seqlens that kg.attention checked (0, never decreasing, tokens) is its own boundaries; any
# other gets 0 and tokens added (boundaries()), two empty sequences where it already has them, for
# which the kernels still size per-sequence buffers. Made once per tensor, tokens and stream
# while the tensor is unchanged: a model's layers share one cu_seqlens per step, and making them
# is up to six small kernels a call. Keyed by the tensor itself (its version counter tells an
# in-place change). Not where values are traced or captured: a CUDA graph's replays must
# recompute them from what its cu_seqlens then holds.
_INT32_BOUNDARIES: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()


def _int32_boundaries(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    if _no_host_values(cu_seqlens):
        return boundaries(cu_seqlens, tokens).to(torch.int32)
    checked = offsets_checked(cu_seqlens, tokens)
    if checked and cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous():
        return cu_seqlens
    stream = torch.cuda.current_stream(cu_seqlens.device).stream_id if cu_seqlens.is_cuda else None
    key = (cu_seqlens._version, tokens, stream, checked)
    seen = _INT32_BOUNDARIES.get(cu_seqlens)
    if seen is not None and seen[0] == key:
        return seen[1]
    cu = (cu_seqlens.to(torch.int32).contiguous() if checked
          else boundaries(cu_seqlens, tokens).to(torch.int32))
    _INT32_BOUNDARIES[cu_seqlens] = (key, cu)  # a new tensor: an entry holding its key would never go
    return cu


def attention_varlen_eager(q, k, v, cu_seqlens, mask, scale, max_seqlen):
    if _varlen_attn_refuses(q):
        return attention_varlen_reference(q, k, v, cu_seqlens, mask, scale, max_seqlen)
    from torch.nn.attention.varlen import varlen_attn

    T, Hkv, G, D = q.shape
    cu = _int32_boundaries(cu_seqlens, T)
    longest = max_seqlen if max_seqlen > 0 else T
    # Its kernels read 16-byte rows of dense tensors: strided or misaligned inputs (a view at an
    # odd offset) fault with a misaligned address, so they are copied first.
    q, k, v = (_dense_aligned(t) for t in (q, k, v))
    # PyTorch's varlen attention takes q with heads = kv_heads * group, query head h on kv head
    # h // group: q's [tokens, kv_heads, group, head_dim] flattened is that order.
    o = varlen_attn(q.reshape(T, Hkv * G, D), k, v, cu, cu, longest, longest,
                    scale=None if scale == 0 else scale, window_size=(-1, 0) if mask == "causal" else (-1, -1))
    return o.view(T, Hkv, G, D)


attention_varlen = define_op(
    SCHEMA,
    dims=DIMS,
    reference=attention_varlen_reference,
    eager=attention_varlen_eager,
    test_values={"scale": [0.0, 0.3]},
    variants={"mask": ["causal", "none"]},
    index_ranges={"cu_seqlens": "tokens"},
    dim_ranges={"tokens": (1, 65536), "kv_heads": (1, 32), "group": (1, 16), "head_dim": (1, 256),
                "bounds": (1, 65)},
    production_shapes=[{"tokens": 16384, "kv_heads": 8, "group": 4, "head_dim": 128, "bounds": 9},
                       {"tokens": 8192, "kv_heads": 4, "group": 4, "head_dim": 128, "bounds": 5},
                       {"tokens": 32768, "kv_heads": 8, "group": 1, "head_dim": 64, "bounds": 33}],
)
