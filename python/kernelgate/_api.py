"""explain, ops and the override context manager."""

import contextlib
import dataclasses
import time
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import torch

from . import _C
from .testing import encode_case


@dataclasses.dataclass
class Candidate:
    backend: str
    kind: str
    selected: bool
    reason: str


@dataclasses.dataclass
class Explanation:
    """Why a call goes where it goes: the serving backend and every candidate's reason. A call the
    op would refuse is `valid=False`, with no backend and the reason it would raise."""

    op: str
    key: str
    backend: str
    reason: str
    candidates: List[Candidate]
    valid: bool = True
    evidence_problems: List[str] = dataclasses.field(default_factory=list)  # evidence left out, why

    def __str__(self) -> str:
        if not self.valid:
            return f"{self.op}: {self.reason}"
        lines = [f"{self.op} -> {self.backend}: {self.reason}", f"  key: {self.key}"]
        width = max(len(c.backend) for c in self.candidates)
        for c in self.candidates:
            mark = "*" if c.selected else " "
            lines.append(f"  {mark} {c.backend:<{width}}  [{c.kind}] {c.reason}")
        lines += [f"  warning: {p}" for p in self.evidence_problems]
        return "\n".join(lines)


def ops() -> List[dict]:
    """Every op with its contract and backends (availability and reason)."""
    return _C.ops()


def _op_info(op: str) -> dict:
    for info in _C.ops():
        if info["name"] == op:
            return info
    names = ", ".join(i["name"] for i in _C.ops())
    raise ValueError(f"unknown op '{op}'; kernelgate has: {names}")


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def kernel_serves(decision: dict) -> Optional[str]:
    """From an explanation (``_C.explain``'s dict): None when the call gets a kernel rather than
    a stand-in — a backend is forced, or evidence ranks first one that is neither the
    plain-PyTorch fallback nor the reference; otherwise why not. The drop-in modules and the
    compile hook leave a call to the code it replaces where it would get only a stand-in."""
    reason, backend = decision["reason"], decision["backend"]
    if reason.startswith("forced"):
        return None
    if reason.startswith("ranked first by policy") and backend not in ("eager", "reference"):
        return None
    return f"no evidence ranks a kernelgate kernel for this call ({decision['key']}): {backend}, {reason}"


def explain(op: str, *args, device: Optional[str] = None, **kwargs) -> Explanation:
    """The decision the dispatcher makes for `op(*args, **kwargs)`, without running it.

    The tensors may be meta tensors standing for a call on `device` ("cuda", "cuda:1", "cpu"):
    nothing is allocated or computed. A call the op would refuse comes back `valid=False` with
    the error it would raise.
    """
    info = _op_info(op)
    if device is not None:
        where = torch.device(device)
        if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"explain: device '{device}' is not visible to this process "
                             f"({torch.cuda.device_count()} CUDA devices); it answers for the devices "
                             "the process can run on")
    schema = getattr(torch.ops.kernelgate, op).default._schema
    names = [a.name for a in schema.arguments]
    if len(args) > len(names):
        raise TypeError(f"{op} takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{op} has no argument '{k}'; its schema is {schema}")
        if k in bound:
            raise TypeError(f"{op} got argument '{k}' twice")
        bound[k] = v
    tensors = [bound.get(name) for name in info["tensor_args"]]
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )
    strings = {k: v for k, v in bound.items() if isinstance(v, str)}
    # The op's own checks, on meta tensors of the same shapes, strides and dtypes: what it would
    # refuse is answered as such.
    try:
        with torch.no_grad():
            getattr(torch.ops.kernelgate, op).default(**{k: _meta(v) for k, v in bound.items()})
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        reason = str(exc).split("\n")[0]
        return Explanation(op=op, key="", backend="", reason=f"invalid call: {reason}", candidates=[],
                           valid=False)
    d = _C.explain(op, tensors, grad, strings, device)
    return Explanation(
        op=d["op"],
        key=d["key"],
        backend=d["backend"],
        reason=d["reason"],
        candidates=[Candidate(**c) for c in d["candidates"]],
        evidence_problems=d["evidence_problems"],
    )


@dataclasses.dataclass
class Warmup:
    """What kg.warmup ran: its wall time and, per example call, the backend that served it
    (forward, and backward where gradients are needed)."""

    seconds: float
    served: List[Dict[str, str]]


_LAYOUTS = ("contiguous", "row_strided", "offset", "transposed", "expanded")


def _shape_calls(info: dict, shapes, dtype, variants, layout: str, grad: bool, device) -> List[tuple]:
    """Example calls of the op built from named dims (as the sweeps build theirs)."""
    op = info["name"]
    if isinstance(shapes, Mapping):
        shapes = [shapes]
    shapes = list(shapes)
    if not shapes:
        raise ValueError("warmup: shapes is empty; nothing would be warmed")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"warmup: with shapes, give dtype (a torch dtype), got {dtype!r}")
    dtype_name = str(dtype).split(".")[-1]
    if dtype_name not in info["dtypes"]:
        raise ValueError(f"warmup: {op} takes dtypes {', '.join(info['dtypes'])}, got {dtype_name}")
    if layout not in _LAYOUTS:
        raise ValueError(f"warmup: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"warmup: device must be a cuda or cpu device, got {device}")
    known = dict(info["variant_args"])
    strings = dict(variants or {})
    for arg, value in strings.items():
        if arg not in known or value not in known[arg]:
            takes = ", ".join(f"{a} in {v}" for a, v in known.items()) or "none"
            raise ValueError(f"warmup: {op} has variant arguments {takes}; got {arg}={value!r}")
    calls = []
    for dims in shapes:
        if not isinstance(dims, Mapping) or not dims:
            raise TypeError(f"warmup: each shape is a dict of {op}'s dims ({', '.join(info['named_dims'])}), "
                            f"got {dims!r}")
        unknown = [d for d in dims if d not in info["named_dims"]]
        bad = [f"{d}={v!r}" for d, v in dims.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if unknown or bad:
            raise ValueError(f"warmup: {op}'s dims are {', '.join(info['named_dims'])} (non-negative ints); "
                             f"got {', '.join(unknown + bad)}")
        fields = {"op": op, "dims": ",".join(f"{d}={v}" for d, v in sorted(dims.items())), "dtype": dtype_name,
                  "layout": layout, "regime": "normal", "scalars": "",
                  "strings": ",".join(f"{a}={v}" for a, v in sorted(strings.items())),
                  "optional": "1", "grad": "1" if grad else "0", "seed": "0"}
        try:
            args, _ = _C.case_arguments(encode_case(fields), on_gpu=device.type == "cuda")
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"warmup: {op} with dims {dict(dims)}: {str(exc).splitlines()[0]}") from None
        if device.type == "cuda" and (device.index or 0) != 0:
            args = [a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in args]
        calls.append((tuple(args), {}))
    return calls


def warmup(op: str, *args, calls: Optional[Sequence[tuple]] = None, shapes=None, dtype=None,
           variants: Optional[Mapping[str, str]] = None, layout: str = "contiguous", grad: bool = True,
           device="cuda", **kwargs) -> Warmup:
    """Runs `op` eagerly on example calls, forward and (where a tensor argument requires grad)
    backward, so that each backend the policy picks for such calls has compiled and autotuned
    before it matters: before step 1 of a training run, and before a CUDA graph is captured (a
    JIT backend serves a captured call only if it served that call's key eagerly before; other
    calls under capture go to the next ranked backend, with a logged reason).

        kg.warmup("rms_norm", x, w)                                  # one example call
        kg.warmup("rms_norm", calls=[(x1, w), (x2, w, 1e-5)])        # several (positional args)
        kg.warmup("rms_norm", shapes=[{"rows": 8192, "hidden": 4096}], dtype=torch.bfloat16)
        kg.warmup("geglu", shapes={"rows": 8192, "hidden": 14336}, dtype=torch.bfloat16,
                  variants={"approximate": "tanh"})

    The examples are computed on (their values do not matter; their shapes, dtypes, layouts and
    devices do). With shapes (the op's named dims, as ``kg.ops()`` lists them), the calls are made
    on `device` in `dtype`, in `layout` (contiguous; or row_strided, offset, transposed, expanded,
    as the sweeps make them), with the optional tensors given, requiring grad unless grad=False.
    Returns the time it took and what served each call; raises ValueError if given no call, and
    what the op raises for an invalid one.
    """
    info = _op_info(op)
    if shapes is not None:
        if args or kwargs or calls is not None:
            raise ValueError("warmup: give shapes, one example call or calls=[...], not several")
        calls = _shape_calls(info, shapes, dtype, variants, layout, grad, device)
    elif calls is None:
        if not args and not kwargs:
            raise ValueError(f"warmup: give {op} an example call (its arguments), calls=[...] or shapes=[...]")
        calls = [(args, kwargs)]
    else:
        if args or kwargs:
            raise ValueError("warmup: give either one example call or calls=[...], not both")
        calls = [c if len(c) == 2 and isinstance(c[1], Mapping) and isinstance(c[0], tuple) else (tuple(c), {})
                 for c in calls]
        if not calls:
            raise ValueError("warmup: calls is empty; nothing would be warmed")
    fn = getattr(torch.ops.kernelgate, op).default
    served = []
    start = time.perf_counter()
    for call_args, call_kwargs in calls:
        backend = explain(op, *call_args, **call_kwargs).backend
        out = fn(*call_args, **call_kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        direction = "forward"
        if outs:
            leaves = [t for t in list(call_args) + list(call_kwargs.values())
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
            direction = "forward+backward"
        served.append({"backend": backend, "ran": direction})
    for t in {c[0][0].device for c in calls if c[0] and isinstance(c[0][0], torch.Tensor)}:
        if t.type == "cuda":
            torch.cuda.synchronize(t)
    return Warmup(seconds=time.perf_counter() - start, served=served)


Spec = Union[None, str, Mapping[str, Union[str, Iterable[str]]], Iterable[str]]


def _pairs(spec: Spec, what: str, single: bool) -> List[tuple]:
    """Normalises a force/exclude spec to (op, backend) pairs; op '' means every op."""
    if spec is None:
        return []
    if isinstance(spec, str):
        pairs = [("", spec)]
    elif isinstance(spec, Mapping):
        pairs = []
        for op, backends in spec.items():
            if isinstance(backends, str):
                backends = [backends]
            elif single:
                raise TypeError(f"{what}: give one backend per op, got {backends!r} for '{op}'")
            pairs.extend((op, b) for b in backends)
    elif not single:
        pairs = [("", b) for b in spec]
    else:
        raise TypeError(f"{what} must be a backend name or a dict op -> backend, got {spec!r}")
    known: Dict[str, set] = {i["name"]: {b["name"] for b in i["backends"]} for i in _C.ops()}
    for op, backend in pairs:
        if op and op not in known:
            raise ValueError(f"{what}: unknown op '{op}'; kernelgate has: {', '.join(known)}")
        scope = [known[op]] if op else list(known.values())
        if not any(backend in s for s in scope):
            where = f"op '{op}'" if op else "any op"
            raise ValueError(f"{what}: {where} has no backend '{backend}'")
    return pairs


@contextlib.contextmanager
def use(force: Spec = None, exclude: Spec = None) -> Iterator[None]:
    """Force or exclude backends inside a `with` block (process-wide, restored on exit).

        with kg.use(force="kernelgate_cuda"): ...                 # every op
        with kg.use(force={"rms_norm": "aten"}): ...
        with kg.use(exclude=["kernelgate_cuda"]): ...

    A forced backend that cannot implement a call falls back to the normal decision (policy, then
    the reference), with a logged warning. The reference cannot be excluded.
    """
    forced = _pairs(force, "force", single=True)
    excluded = _pairs(exclude, "exclude", single=False)
    if any(b == "reference" for _, b in excluded):
        raise ValueError("exclude: the reference cannot be excluded; it serves every call nothing else may")
    saved = _C.get_overrides()
    new_forced = [p for p in saved[0] if p[0] not in {op for op, _ in forced}] + forced
    _C.set_overrides(new_forced, list(saved[1]) + excluded)
    try:
        yield
    finally:
        _C.set_overrides(*saved)
