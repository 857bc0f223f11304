"""Drop-in replacements for flash-linear-attention (FLA) functions: the same signatures and the
same returns.

    from kernelgate.fla import causal_conv1d      # for fla.modules.convolution.causal_conv1d
    from kernelgate.fla import chunk_gated_delta_rule   # for fla.ops.gated_delta_rule's
    from kernelgate.fla import chunk_kda                # for fla.ops.kda's

A call is served by kernelgate only where kernelgate can and evidence says it should: every
argument is one it implements (a whitelist: FLA's other arguments, set to anything but their
defaults, send the call to FLA), and the call's region has evidence ranking one of its kernels
first (where none does, or the plain-PyTorch fallback is ranked first, kernelgate would serve
plain PyTorch, and the caller asked for FLA's kernel). Under torch.compile the decision is made
when the graph is traced, without a graph break.
Every other call goes to FLA verbatim — the same function with the same arguments, so the same
result bit for bit — with the reason logged once per process (logger ``kernelgate``). FLA is
imported only for such a call. ``explain_causal_conv1d(...)`` says which way a call goes and why.
"""

import functools
import inspect
import logging
from typing import Optional, Tuple

import torch

from . import _C
from ._api import kernel_serves
from ._ops import check_offsets_tensor, check_offsets_values

log = logging.getLogger("kernelgate")

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ACTIVATIONS = {None: "none", "silu": "silu", "swish": "silu"}

# FLA's causal_conv1d parameters: those kernelgate implements (within the checks below), and
# those that send a call to FLA unless they have their default. A parameter FLA adds that is in
# neither set fails tests/python/test_fla_dropin.py.
CONV_HANDLED = ("x", "weight", "bias", "output_final_state", "activation", "backend")
CONV_FORWARDED = ("residual", "initial_state", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context",
                  "kwargs")

_logged = set()
_served_cache = {}
_MISS = object()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.info("kernelgate.fla: to FLA: %s", reason)


def _call_key(op: str, tensors, strings, grad: bool, aligned: bool) -> tuple:
    metas = tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device),
                                          0 if aligned else t.data_ptr() % 16)
                  for t in tensors)
    return op, grad, tuple(sorted(strings.items())), metas


@torch._dynamo.assume_constant_result
def _traced_decision(key: tuple) -> Optional[str]:
    """Under torch.compile: decided once, when the graph is traced (a constant of the graph, no
    graph break), from meta tensors of the call's shapes, strides and dtypes."""
    op, grad, strings, metas = key
    tensors = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta")
               for m in metas]
    device = next(m[3] for m in metas if m is not None)
    return kernel_serves(_C.explain(op, tensors, grad, dict(strings), device))


def _routed_by_evidence(op: str, tensors, strings) -> Optional[str]:
    """None when kernelgate should serve this call (see kernel_serves); otherwise why not. Eagerly:
    cached per dispatch-relevant description of the call and the policy's generation."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if torch.compiler.is_compiling():
        return _traced_decision(_call_key(op, tensors, strings, grad, aligned=True))
    key = (_C.generation(),) + _call_key(op, tensors, strings, grad, aligned=False)
    hit = _served_cache.get(key, _MISS)
    if hit is not _MISS:
        return hit
    why = kernel_serves(_C.explain(op, list(tensors), grad, strings, None))
    if len(_served_cache) > 4096:
        _served_cache.clear()
    _served_cache[key] = why
    return why


def _check_cu_seqlens(x: torch.Tensor, cu_seqlens, cu_seqlens_cpu, what: str) -> None:
    """A cu_seqlens that FLA's kernels would read out of bounds (or compute a wrong answer from)
    is an error: a 1-D integer tensor on x's device (cu_seqlens_cpu: on the CPU) of at least two
    offsets, starting at 0, never decreasing (an empty sequence is allowed) and ending at x's
    length, x [1, total, ...] (FLA's varlen layout). The offsets' values are read from
    cu_seqlens_cpu where it is given (no device sync: what it is for), else from cu_seqlens (one
    sync, where FLA reads them on the host too); under torch.compile the check is left to FLA."""
    if cu_seqlens is None and cu_seqlens_cpu is None:  # every fixed-length call: nothing to do
        return
    if torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or x.dim() < 3:
        return
    given = [(n, o, d) for n, o, d in (("cu_seqlens", cu_seqlens, x.device),
                                       ("cu_seqlens_cpu", cu_seqlens_cpu, torch.device("cpu"))) if o is not None]
    for name, offsets, device in given:
        check_offsets_tensor(offsets, what, name)
        if offsets.device != device:
            raise ValueError(f"{what}: {name} must be on {device} (x is on {x.device}), got {offsets.device}")
        if x.shape[0] != 1:
            raise ValueError(f"{what}: with {name}, x must hold the sequences concatenated as batch 1 "
                             f"([1, total, ...]), got shape {list(x.shape)}")
    if len(given) == 2 and given[0][1].numel() != given[1][1].numel():
        raise ValueError(f"{what}: cu_seqlens and cu_seqlens_cpu must hold the same offsets, got "
                         f"{given[0][1].numel()} and {given[1][1].numel()} of them")
    if given:
        name, offsets, _ = given[-1]
        check_offsets_values(offsets, x.shape[1], f"the total length {x.shape[1]} (x's dim 1)", what, name)


def _conv_refusal(x, weight, bias, residual, initial_state, output_final_state, activation, backend,
                  cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context, kwargs) -> Optional[str]:
    forwarded = {"residual": residual, "initial_state": initial_state, "cu_seqlens": cu_seqlens,
                 "cu_seqlens_cpu": cu_seqlens_cpu, "chunk_indices": chunk_indices, "cp_context": cp_context}
    for name, value in forwarded.items():
        if value is not None:
            return f"{name} is given (kernelgate implements it as None only)"
    if kwargs:
        return f"arguments kernelgate does not know: {', '.join(sorted(kwargs))}"
    if output_final_state:
        return "output_final_state=True (kernelgate implements False only)"
    if backend != "triton":
        return f"backend={backend!r} (kernelgate stands in for the default 'triton' only)"
    if activation not in _ACTIVATIONS:
        return f"activation={activation!r} (kernelgate implements None, 'silu' and 'swish')"
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x and weight must be tensors"
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        return f"shapes x {list(x.shape)}, weight {list(weight.shape)} (kernelgate implements [B, T, D], [D, W])"
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (x.shape[2],)):
        return "bias is not a [D] tensor"
    if x.dtype not in _FLOATS or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"dtypes x {x.dtype}, weight {weight.dtype} (kernelgate implements one float dtype for all)"
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) != 1:
        return "tensors on more than one device"
    return _routed_by_evidence("causal_conv1d", (x, weight, bias), {"activation": _ACTIVATIONS[activation]})


def causal_conv1d(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: Optional[bool] = False,
    activation: Optional[str] = None,
    backend: Optional[str] = "triton",
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    chunk_indices: Optional[torch.LongTensor] = None,
    cp_context=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``fla.modules.convolution.causal_conv1d``: returns ``(y, final_state)``. Served by
    ``kernelgate.causal_conv1d`` (final_state None) where the module docstring says; by FLA
    verbatim otherwise."""
    _check_cu_seqlens(x, cu_seqlens, cu_seqlens_cpu, "causal_conv1d")
    why = _conv_refusal(x, weight, bias, residual, initial_state, output_final_state, activation, backend,
                        cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context, kwargs)
    if why is None:
        return torch.ops.kernelgate.causal_conv1d(x, weight, bias, _ACTIVATIONS[activation]), None
    _log_once(why)
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d

    return fla_causal_conv1d(x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                             output_final_state=output_final_state, activation=activation, backend=backend,
                             cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                             cp_context=cp_context, **kwargs)


def _defaults_after(fn, leading: int) -> dict:
    """fn's named parameters after its first `leading`, with their defaults (FLA's)."""
    return {n: p.default for n, p in list(inspect.signature(fn).parameters.items())[leading:]
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}


def _explain(refusal, defaults: dict, leading: tuple, kwargs: dict) -> str:
    """A drop-in's decision for a call given as its leading arguments and keywords: the keywords
    FLA's function names, with its defaults for those not given, and the rest as its **kwargs."""
    args = dict(defaults)
    extra = {k: v for k, v in kwargs.items() if k not in args}
    args.update({k: v for k, v in kwargs.items() if k in args})
    why = refusal(*leading, kwargs=extra, **args)
    return "kernelgate" if why is None else f"FLA: {why}"


def explain_causal_conv1d(x, weight=None, bias=None, **kwargs) -> str:
    """Which way ``causal_conv1d(x, weight, bias, **kwargs)`` goes: "kernelgate" or "FLA: <why>"."""
    return _explain(_conv_refusal, _CONV_DEFAULTS, (x, weight, bias), kwargs)


_CONV_DEFAULTS = _defaults_after(causal_conv1d, 3)  # after x, weight and bias


# ---- chunk_gated_delta_rule -------------------------------------------------------------------

# FLA's chunk_gated_delta_rule parameters, and the keywords it reads from **kwargs: those
# kernelgate implements (the fused layer form of its gated_delta_rule op, within the checks
# below), and those that send a call to FLA unless they have their default.
GDR_HANDLED = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
               "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
               "use_gate_in_kernel", "A_log", "dt_bias", "cu_seqlens", "cu_seqlens_cpu")
GDR_FORWARDED = ("chunk_indices", "cp_context", "chunk_size",
                 "transpose_state_layout", "head_first", "kwargs")
_GDR_KEYWORDS = ("use_gate_in_kernel", "A_log", "dt_bias")  # read from FLA's **kwargs


def _fla_refuses_gated_backward(device: torch.device) -> bool:
    """FLA's own guard (fla-core 0.6): its gated chunk backward raises on Hopper with Triton >= 3.4
    and < 3.7.1, naming a wrong result of chunk_bwd_dqkwg there, unless FLA's tilelang backend
    (the `tilelang` package with a usable nvcc) takes that kernel's place."""
    return device.type == "cuda" and _fla_refuses_on_cuda(torch.cuda.current_device() if device.index is None
                                                          else device.index)


@torch._dynamo.assume_constant_result
@functools.lru_cache(maxsize=None)
def _fla_refuses_on_cuda(index: int) -> bool:
    """Once per device (under torch.compile a constant of the graph)."""
    import importlib.metadata

    from .backends import release

    try:
        v = release(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:
        return False
    guarded = torch.cuda.get_device_capability(index) == (9, 0) and (3, 4) <= v < (3, 7, 1)
    return guarded and not _fla_tilelang_serves_dqkwg()


def _fla_tilelang_serves_dqkwg() -> bool:
    """Whether FLA dispatches its gated chunk_bwd_dqkwg to its tilelang backend (registered for
    its 'common' ops: available where tilelang imports and nvcc works, enabled by default on Hopper
    unless FLA_TILELANG=0), the way FLA's own dispatch decides it. An FLA without that registry
    refuses."""
    try:
        from fla.backends import _load_operation_registry

        backend = _load_operation_registry("common")._backends.get("tilelang")
        return backend is not None and backend.is_available() and backend.is_enabled()
    except Exception:  # noqa: BLE001 - an FLA of another layout: its own guard stands
        return False


def _gdr_refusal(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
                 chunk_indices, cp_context, kwargs) -> Optional[str]:
    for name, value in {"chunk_indices": chunk_indices, "cp_context": cp_context}.items():
        if value is not None:
            return f"{name} is given (kernelgate implements it as None only)"
    unknown = set(kwargs) - set(_GDR_KEYWORDS)
    if unknown:
        return f"arguments kernelgate does not know: {', '.join(sorted(unknown))}"
    if allow_neg_eigval or state_v_first:
        return "allow_neg_eigval or state_v_first is True (kernelgate implements False only)"
    gate = bool(kwargs.get("use_gate_in_kernel"))
    tensors = (q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"), initial_state)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if grad and isinstance(q, torch.Tensor) and _fla_refuses_gated_backward(q.device) \
            and _gdr_chunked_refusal(tensors, scale, gate) is None:
        return None  # FLA would raise in the backward; kernelgate's code has one (_gdr_serve)
    if not (use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel and gate):
        return ("not the fused layer form (kernelgate implements use_qk_l2norm_in_kernel, "
                "use_beta_sigmoid_in_kernel and use_gate_in_kernel all True)")
    why = _delta_rule_call_refusal(tensors, scale)
    if why is not None:
        return why
    if cu_seqlens is not None or cu_seqlens_cpu is not None:
        return ("cu_seqlens is given (kernelgate serves a varlen call only where FLA refuses its own "
                "backward, one call per sequence)")
    return _routed_by_evidence("gated_delta_rule", tensors, {})


def _gdr_chunked_refusal(tensors, scale, gate) -> Optional[str]:
    """What kernelgate.gated_delta_rule's chunked code cannot take of a call of any of FLA's forms
    (the three in-kernel switches either way; the gates and initial state in any float dtype), or
    None: q and k [B, T, H, K] and v [B, T, H, V] of one float dtype, g and beta [B, T, H], A_log
    [H] with use_gate_in_kernel (dt_bias [H] or None), initial_state [., H, K, V] or None, on one
    device."""
    q, k, v, g, beta, A_log, dt_bias, h0 = tensors
    given = [t for t in tensors if t is not None]
    if any(not isinstance(t, torch.Tensor) for t in given) or any(t is None for t in tensors[:5]) \
            or (gate and A_log is None):
        return "tensors missing"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3] \
            or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        return "shapes"
    H = q.shape[2]
    if gate and (A_log.shape != (H,) or (dt_bias is not None and dt_bias.shape != (H,))):
        return "gate shapes"
    if h0 is not None and (h0.dim() != 4 or h0.shape[1:] != (H, q.shape[3], v.shape[3])):
        return "initial_state shape"  # its count (batch, or sequences with cu_seqlens): _gdr_serve
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype \
            or any(t.dtype not in _FLOATS for t in given):
        return "dtypes"
    if len({t.device for t in given}) != 1:
        return "devices"
    return _scale_refusal(scale)


def _gdr_serve(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
               cu_seqlens, cu_seqlens_cpu, kwargs):
    """A call the drop-in serves: kernelgate's op where it takes the call (the fused form, one dtype),
    else the op reference's chunked code on the call's own form (only where FLA refuses its
    backward); a varlen call one call per sequence, on views of the packed tensors, o concatenated
    back and the final states stacked, [N, H, K, V], as FLA returns them."""
    from .gated_delta_rule import chunked, gates

    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    gate = bool(kwargs.get("use_gate_in_kernel"))
    s = 0.0 if scale is None else float(scale)
    via_op = use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel and gate and _delta_rule_call_refusal(
        (q, k, v, g, beta, A_log, dt_bias, initial_state), scale) is None
    if via_op:
        def one(sl, h0):
            return torch.ops.kernelgate.gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], A_log, dt_bias, h0, s)
    else:
        def one(sl, h0):
            decay, b = gates(q.dtype, g[sl], beta[sl], A_log if gate else None, dt_bias, use_beta_sigmoid_in_kernel)
            return chunked(q[sl], k[sl], v[sl], decay, b, h0, s, normalize=use_qk_l2norm_in_kernel)
    if cu_seqlens is None and cu_seqlens_cpu is None:
        if not via_op and initial_state is not None and initial_state.shape[0] != q.shape[0]:
            raise ValueError(f"chunk_gated_delta_rule: initial_state must hold one state per batch entry "
                             f"([{q.shape[0]}, H, K, V]), got shape {list(initial_state.shape)}")
        return one(slice(None), initial_state)
    offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()  # on the host, as FLA
    n = len(offsets) - 1
    if initial_state is not None and (initial_state.dim() != 4 or initial_state.shape[0] != n):
        raise ValueError(f"chunk_gated_delta_rule: with cu_seqlens, initial_state must hold one state per "
                         f"sequence ([{n}, H, K, V] for {n} sequences), got shape {list(initial_state.shape)}")
    outs, states = [], []
    for i in range(n):
        o, state = one((slice(None), slice(offsets[i], offsets[i + 1])),
                       None if initial_state is None else initial_state[i:i + 1])
        outs.append(o)
        states.append(state)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _delta_rule_call_refusal(tensors, scale) -> Optional[str]:
    """What the gated_delta_rule and kda ops cannot take of a call's (q, k, v, g, beta, A_log,
    dt_bias, initial_state) and scale, or None."""
    q, v = tensors[0], tensors[2]
    if any(t is not None and not isinstance(t, torch.Tensor) for t in tensors) or any(
            t is None for t in tensors[:6]):
        return "q, k, v, g, beta and A_log must be tensors (dt_bias and initial_state tensors or None)"
    if q.dim() != 4 or v.dim() != 4 or v.shape[2] != q.shape[2]:
        return f"shapes q {list(q.shape)}, v {list(v.shape)} (kernelgate implements [B, T, H, K], [B, T, H, V])"
    if q.dtype not in _FLOATS or any(t is not None and t.dtype != q.dtype for t in tensors):
        return "dtypes differ (kernelgate implements one float dtype for every tensor)"
    if len({t.device for t in tensors if t is not None}) != 1:
        return "tensors on more than one device"
    return _scale_refusal(scale)


def _scale_refusal(scale) -> Optional[str]:
    if not isinstance(scale, (int, float, type(None))) or (scale is not None and scale <= 0):
        return f"scale={scale!r} (kernelgate implements None or a positive number)"
    return None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    chunk_indices: Optional[torch.LongTensor] = None,
    cp_context=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: returns ``(o, final_state)``.

    Served by ``kernelgate.gated_delta_rule`` for FLA's fused layer form (``use_qk_l2norm_in_kernel``,
    ``use_beta_sigmoid_in_kernel`` and ``use_gate_in_kernel`` with ``A_log`` all given) where evidence
    ranks a kernel for the call, and, when the call needs gradients, wherever FLA refuses its own
    backward (Hopper with Triton 3.4 to 3.7.0): there FLA's backward raises, and kernelgate's op
    (its reference, unless evidence ranks another) computes it — for FLA's other forms (a
    precomputed log decay ``g``, beta after its sigmoid, q and k not normalised, gates in float32
    beside bf16 q) its reference's chunked code on that form, and for a varlen call
    (``cu_seqlens``) one call per sequence. Every other call goes to FLA verbatim."""
    _check_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu, "chunk_gated_delta_rule")
    why = _gdr_refusal(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
                       chunk_indices, cp_context, kwargs)
    if why is None:
        o, state = _gdr_serve(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                              use_beta_sigmoid_in_kernel, cu_seqlens, cu_seqlens_cpu, kwargs)
        return o, (state if output_final_state else None)
    _log_once(why)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    return fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                      allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                                      cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                      chunk_indices=chunk_indices, cp_context=cp_context, **kwargs)


def explain_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs) -> str:
    """Which way ``chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)`` goes: "kernelgate" or "FLA: <why>"."""
    return _explain(_gdr_refusal, _GDR_DEFAULTS, (q, k, v, g, beta), kwargs)


_GDR_DEFAULTS = _defaults_after(chunk_gated_delta_rule, 5)  # after q, k, v, g and beta


# ---- chunk_kda ------------------------------------------------------------------------------------

# FLA's chunk_kda parameters and the keywords it reads from **kwargs, as for chunk_gated_delta_rule.
# disable_recompute only trades FLA's memory for its speed: any value is kernelgate's to serve.
KDA_HANDLED = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
               "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
               "safe_gate", "lower_bound", "disable_recompute", "return_intermediate_states", "state_v_first",
               "A_log", "dt_bias")
KDA_FORWARDED = ("cu_seqlens", "cu_seqlens_cpu", "cp_context", "use_graph", "max_num_seqs", "chunk_size",
                 "transpose_state_layout", "kwargs")
_KDA_KEYWORDS = ("A_log", "dt_bias")  # read from FLA's **kwargs


def _kda_refusal(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                 disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                 cp_context, use_graph, max_num_seqs, kwargs) -> Optional[str]:
    forwarded = {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu, "cp_context": cp_context,
                 "max_num_seqs": max_num_seqs}
    for name, value in forwarded.items():
        if value is not None:
            return f"{name} is given (kernelgate implements it as None only)"
    unknown = set(kwargs) - set(_KDA_KEYWORDS)
    if unknown:
        return f"arguments kernelgate does not know: {', '.join(sorted(unknown))}"
    if not (use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel):
        return ("not the fused layer form (kernelgate implements use_qk_l2norm_in_kernel, "
                "use_gate_in_kernel and use_beta_sigmoid_in_kernel all True)")
    if allow_neg_eigval or safe_gate or lower_bound is not None or state_v_first or use_graph \
            or return_intermediate_states:
        return ("allow_neg_eigval, safe_gate, lower_bound, state_v_first, use_graph or "
                "return_intermediate_states is set (kernelgate implements their defaults only)")
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if isinstance(dt_bias, torch.Tensor) and isinstance(q, torch.Tensor) and q.dim() == 4:
        if dt_bias.dim() != 1 or dt_bias.numel() != q.shape[2] * q.shape[3]:
            return f"dt_bias of shape {list(dt_bias.shape)} (kernelgate implements FLA's [H * K])"
        dt_bias = dt_bias.view(q.shape[2], q.shape[3])
    tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    why = _delta_rule_call_refusal(tensors, scale)
    if why is not None:
        return why
    if g.shape != q.shape:
        return f"g of shape {list(g.shape)} (kernelgate implements q's, [B, T, H, K]: no GVA)"
    return _routed_by_evidence("kda", tensors, {})


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    **kwargs,
):
    """``fla.ops.kda.chunk_kda``: returns ``(o, final_state)``. Served by ``kernelgate.kda`` for
    FLA's fused layer form (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with ``A_log``,
    ``use_beta_sigmoid_in_kernel``; as many value heads as query heads) where evidence ranks a
    kernel for the call; every other call goes to FLA verbatim."""
    _check_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu, "chunk_kda")
    why = _kda_refusal(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                       disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                       cp_context, use_graph, max_num_seqs, kwargs)
    if why is None:
        H, K = q.shape[2], q.shape[3]
        dt_bias = kwargs.get("dt_bias")
        o, state = torch.ops.kernelgate.kda(q, k, v, g, beta, kwargs["A_log"],
                                            None if dt_bias is None else dt_bias.view(H, K), initial_state,
                                            0.0 if scale is None else float(scale))
        return o, (state if output_final_state else None)
    _log_once(why)
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                         allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                         disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
                         state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                         cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs, **kwargs)


def explain_chunk_kda(q, k, v, g, beta, **kwargs) -> str:
    """Which way ``chunk_kda(q, k, v, g, beta, **kwargs)`` goes: "kernelgate" or "FLA: <why>"."""
    return _explain(_kda_refusal, _KDA_DEFAULTS, (q, k, v, g, beta), kwargs)


_KDA_DEFAULTS = _defaults_after(chunk_kda, 5)  # after q, k, v, g and beta
