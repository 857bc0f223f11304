"""Backends and ops defined from Python: kg.register_backend and kg.define_op.

Both go through the C++ engine's one mechanism: a Python backend is served through the same
torch.ops.kernelgate op as the C++ ones (autograd, torch.compile, CUDA graphs keep working) and
swept by the same harness (in Python worker processes); a Python-defined op gets the same
contract, harness, store, policy, CLI and explain as a built-in one.
"""

import hashlib
import importlib
import importlib.metadata
import inspect
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _C, _inductor, evidence
from ._ops import routed

Fn = Union[Callable, str]

_DEFAULT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_defined: Dict[str, tuple] = {}  # op -> what define_op was given, for idempotent re-definition
_registered: Dict[Tuple[str, str], tuple] = {}


def _resolve(fn: Fn, what: str) -> Callable:
    """A callable, or "module:attr" imported now (ImportError propagates)."""
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        if not module or not attr:
            raise ValueError(f"{what} must be a callable or 'module:attr', got {fn!r}")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        fn = obj
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
    return fn


def _code_text(src: str) -> str:
    lines = [re.sub(r"\s+#.*$", "", l).rstrip() for l in src.splitlines()]
    return "\n".join(l for l in lines if l.strip() and not l.strip().startswith("#"))


def source_hash(src: str) -> str:
    """A hash of Python source, comments and blank lines left out."""
    return hashlib.sha256(_code_text(src).encode()).hexdigest()[:16]


def _code_hash(*fns: Optional[Callable]) -> str:
    """A hash of the functions' source, comments and blank lines left out: a backend's evidence
    goes stale when its code changes, not its comments."""
    h = hashlib.sha256()
    for fn in fns:
        if fn is None:
            continue
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            code = getattr(fn, "__code__", None)
            src = repr(code.co_code) + repr(code.co_consts) if code is not None else repr(fn)
        h.update(_code_text(src).encode())
    return h.hexdigest()[:16]


def _code_names(code) -> set:
    """The global names a code object and the functions nested in it read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            names |= _code_names(c)
    return names


def _closure_hash(*fns: Optional[Callable]) -> str:
    """_code_hash of the functions and of every function or class (an autograd.Function, say) of
    their own modules or of this package that they use, transitively (a helper's change changes
    what the op computes): the given functions first, in order, then the helpers by qualified
    name. A class's methods are followed too."""
    given = [f for f in fns if f is not None]
    own = {f.__module__ for f in given} | {__name__.rpartition(".")[0]}

    def ours(obj) -> bool:
        mod = getattr(obj, "__module__", None) or ""
        return mod in own or mod.startswith(__name__.rpartition(".")[0] + ".")

    helpers, stack = {}, list(given)
    while stack:
        fn = stack.pop()
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or scope is None:
            continue
        for name in _code_names(code):
            obj = scope.get(name)
            if (not (inspect.isfunction(obj) or inspect.isclass(obj)) or not ours(obj)
                    or obj in given or (obj.__module__, obj.__qualname__) in helpers):
                continue
            helpers[(obj.__module__, obj.__qualname__)] = obj
            if inspect.isclass(obj):
                stack.extend(inspect.unwrap(m) for m in (getattr(v, "__func__", v) for v in vars(obj).values())
                             if inspect.isfunction(m))
            else:
                stack.append(obj)
    return _code_hash(*given, *(helpers[k] for k in sorted(helpers)))


def requirements(op: dict, device: Optional[str], dtypes: Optional[Sequence[torch.dtype]],
                 variants: Optional[Dict[str, Sequence[str]]], present: Sequence[str],
                 capturable: bool, nonempty: bool = False, max_row_bytes: Optional[int] = None,
                 absent: Sequence[str] = (), max_dims: Optional[Dict[str, int]] = None,
                 row_bytes_multiple: Optional[int] = None) -> dict:
    """What a backend needs of a call, checked in C++ before its can_implement (no Python on the
    hot path for these)."""
    r: dict = {}
    if device is not None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
        r["device"] = device
    if dtypes is not None:
        bad = [d for d in dtypes if not isinstance(d, torch.dtype)]
        if bad or not dtypes:
            raise TypeError(f"dtypes must be a non-empty list of torch dtypes, got {list(dtypes)!r}")
        r["dtypes"] = list(dtypes)
    if variants:
        known = dict(op.get("variant_args", []))
        for arg, values in variants.items():
            if arg not in known:
                raise ValueError(f"variants: {op['name']} has no variant argument '{arg}' "
                                 f"(it has: {', '.join(known) or 'none'})")
            if isinstance(values, str) or not set(values) <= set(known[arg]) or not values:
                raise ValueError(f"variants: {arg} must be a non-empty list of {known[arg]}, got {values!r}")
        r["variants"] = {k: list(v) for k, v in variants.items()}
    for field, args in (("present", present), ("absent", absent)):
        for arg in args:
            if arg not in op["tensor_args"]:
                raise ValueError(f"{field}: {op['name']} has no tensor argument '{arg}'")
        if args:
            r[field] = list(args)
    if not capturable:
        r["capturable"] = False
    if nonempty:
        r["nonempty"] = True
    for field, value in (("max_row_bytes", max_row_bytes), ("row_bytes_multiple", row_bytes_multiple)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
            r[field] = value
    if max_dims:
        for dim, most in max_dims.items():
            if isinstance(most, bool) or not isinstance(most, int) or most < 0:
                raise ValueError(f"max_dims: {dim} must map to a non-negative int, got {most!r}")
        r["max_dims"] = dict(max_dims)
    return r


def _claim(key: Tuple[str, str], given: tuple) -> bool:
    """False when the same backend was registered before with the same `given` (a module
    imported twice); raises for another one of that name; True when the name is free."""
    if key not in _registered:
        return True
    if _registered[key] == given:
        return False
    raise ValueError(f"{key[0]} already has a backend '{key[1]}'")


def register_backend(op: str, name: str, forward: Fn, backward: Optional[Fn] = None, *,
                     can_implement: Optional[Callable] = None, package: Optional[str] = None,
                     device: Optional[str] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
                     variants: Optional[Dict[str, Sequence[str]]] = None,
                     present: Sequence[str] = (), capturable: bool = True, nonempty: bool = False,
                     max_row_bytes: Optional[int] = None, absent: Sequence[str] = (),
                     max_dims: Optional[Dict[str, int]] = None, grad_request: bool = False,
                     row_bytes_multiple: Optional[int] = None) -> None:
    """Adds a backend of `op` written in Python.

    forward(*args) takes the op's arguments in schema order and returns its outputs (a tensor or
    a tuple), followed by the op's extras when it has any and gradients are needed.
    backward(*args) takes the arguments of the op's backward: the output gradients, the saved
    tensors, then the op's other arguments (``kg.ops()`` lists each op's ``outputs``, ``extras``,
    ``forward_schema`` and ``backward_schema``; the trailing ``needs`` is not passed); it returns
    one gradient per entry of the op's ``gradients`` (None where not needed).

    A backend without a backward serves only calls that need no gradient; a call that needs one
    goes to the next backend the policy ranks (or the reference), and ``explain`` says why.

    can_implement(*tensors) gets the op's tensor arguments (None for an absent optional) and
    answers True or None (it can), False or a reason string (it cannot). It is called on the hot
    path when the backend is ranked: keep it exact and cheap. What can be said declaratively is
    checked in C++ before it, without Python: ``device`` ("cuda" or "cpu": the call's device),
    ``dtypes`` (of the call's first tensor), ``variants`` (for each of the op's variant
    arguments, the values the backend implements, e.g. ``{"approximate": ["tanh"]}``) and
    ``present`` (optional tensor arguments it needs given), ``nonempty`` (no tensor without
    elements), ``max_row_bytes`` (the first tensor's last dim, in bytes, at most),
    ``row_bytes_multiple`` (that row's bytes a multiple of it, e.g. 4), ``absent`` (optional
    tensor arguments it needs not given), ``max_dims`` (named dims' largest sizes it implements,
    e.g. ``{"width": 4}``); ``capturable=False`` for a backend
    that syncs with the host, which never serves under CUDA-graph capture. Under capture a Python
    backend serves only calls it served eagerly before (``kg.warmup``).

    grad_request=True: forward also gets the keyword ``needs_grad``, a tuple of the names of the
    tensor arguments the call needs gradients for (empty: none). A forward that computes
    gradient work only when asked should read it, not ``requires_grad``: AOT autograd and
    torch.compile call forwards on tensors that do not carry it.

    package names the distribution (its pip name) the backend comes from: its version joins the
    fingerprint of the backend's evidence, and while it is not installed the backend is listed
    as unavailable with that reason. forward / backward may be "module:attr" strings, imported
    now: an ImportError also makes the backend unavailable with the reason.

    Like every backend, it serves a call only where evidence shows it correct (``kernelgate
    bench run OP --load your_module.py``) or where it is forced (``kg.use(force=...)``).
    """
    ops = {o["name"]: o for o in _C.ops()}
    if op not in ops:
        raise ValueError(f"unknown op '{op}'; kernelgate has: {', '.join(sorted(ops))}")
    key = (op, name)
    given = tuple(f if isinstance(f, (str, type(None))) else _code_hash(f)
                  for f in (forward, backward, can_implement)) + (package, grad_request)
    if not _claim(key, given):
        return
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise ValueError(f"backend name must be an identifier-like string, got {name!r}")
    if can_implement is not None and not callable(can_implement):
        raise TypeError(f"can_implement must be callable, got {type(can_implement).__name__}")
    needs = requirements(ops[op], device, dtypes, variants, present, capturable, nonempty, max_row_bytes,
                         absent, max_dims, row_bytes_multiple)
    available, reason, version = True, "", ""
    fwd = bwd = None
    if package is not None:
        try:
            version = f"{package}=={importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            available, reason = False, f"package '{package}' is not installed"
    if available:
        try:
            fwd = _resolve(forward, "forward")
            bwd = None if backward is None else _resolve(backward, "backward")
        except ImportError as exc:
            available, reason = False, f"cannot import it: {exc}"
    if available:
        version = ";".join(v for v in (version, f"code={_code_hash(fwd, bwd, can_implement)}") if v)
    _C.register_backend(op, name, fwd, bwd, can_implement, needs, available, reason, version,
                        grad_request=bool(grad_request))
    _registered[key] = given
    evidence.install()  # the evidence source learns the new backend's fingerprint


def register_library_backend(op: str, name: str, *, forward: str, backward: Optional[str],
                             needs: dict, available: bool, reason: str, version: str,
                             grad_request: bool = False) -> None:
    """A backend of one of the field's libraries (kernelgate.backends): its forward and backward
    are "module:attr" strings the engine imports at the first call; `needs` is requirements()'s;
    `available` and `version` come from the library's installed distribution. The caller
    installs the evidence after."""
    key = (op, name)
    given = (forward, backward, None, version, grad_request)
    if not _claim(key, given):
        return
    _C.register_backend(op, name, forward, backward, None, needs, available, reason, version,
                        grad_request=grad_request)
    _registered[key] = given


def define_op(schema: str, *, dims: str, reference: Callable,
              dtypes: Sequence[torch.dtype] = _DEFAULT_DTYPES,
              test_values: Optional[Dict[str, Sequence[float]]] = None,
              dim_ranges: Optional[Dict[str, Tuple[int, int]]] = None,
              production_shapes: Optional[List[Dict[str, int]]] = None,
              variants: Optional[Dict[str, Sequence[str]]] = None,
              index_ranges: Optional[Dict[str, str]] = None,
              dim_multiples: Optional[Dict[str, int]] = None,
              no_grad: Sequence[str] = (), outputs: Sequence[str] = (),
              eager: Optional[Callable] = None, record_reference: bool = False) -> Callable:
    """Defines a routed op from Python and returns it (also reachable as ``kg.<name>`` and
    ``torch.ops.kernelgate.<name>``).

    schema: PyTorch's schema syntax, e.g. ``"scaled_tanh(Tensor x, float alpha=1.0) -> Tensor"``
    (arguments Tensor, Tensor?, float, int, bool, str). dims: the named dims of every tensor
    argument, in schema order, e.g. ``"x: [*rows, hidden]"`` (``?`` marks an optional tensor,
    ``index`` an integer one). reference: a function of ATen ops taking the op's arguments; it
    defines the op's semantics and, through its autograd, its gradients; evaluated in float64 it
    is the oracle every backend is checked against, and it serves calls nothing else may.
    The rest guide the harness's cases: values of scalar arguments to try, each named dim's
    [lo, hi] range and production shapes; variants: str arguments that select different code,
    with their allowed values (default first); index_ranges: for each index tensor, the named dim
    that bounds its values; dim_multiples: named dims whose sizes must be a multiple; no_grad:
    float tensors that get no gradient.

    eager: the op as the plain PyTorch code a user would write without kernelgate (a function of
    the op's arguments, differentiated by PyTorch's autograd): the op's ``eager`` backend, which
    serves where no evidence ranks a backend (docs/evidence.md) and is swept like every backend.
    Without it the reference serves there.

    record_reference: where the reference serves a call needing gradients (not under
    torch.compile's tracing), it runs under PyTorch's autograd as plain code does, its graph kept
    from the forward to the backward; otherwise (the default) the forward keeps only the inputs
    and the backward runs the reference again. For a reference that is the op's fast fallback and
    keeps less than the plain code it replaces.
    """
    if not callable(reference):
        raise TypeError(f"reference must be callable, got {type(reference).__name__}")
    if eager is not None and not callable(eager):
        raise TypeError(f"eager must be callable or None, got {type(eager).__name__}")
    name = schema.split("(", 1)[0].strip()
    # The code that computes: the reference and the eager code where given, with the functions
    # of their modules they call.
    code = _closure_hash(reference, eager)
    given = (schema, dims, code, bool(record_reference))
    if name in _defined:
        if _defined[name] == given:
            return routed(name)
        raise ValueError(f"op '{name}' is already defined with another schema, dims, reference, eager code "
                         "or record_reference")
    if name in {o["name"] for o in _C.ops()}:
        raise ValueError(f"op '{name}' is already defined by kernelgate")
    spec = {
        "schema": schema,
        "dims": dims,
        "reference": reference,
        "dtypes": list(dtypes),
        "test_values": {k: [float(v) for v in vs] for k, vs in (test_values or {}).items()},
        "dim_ranges": {k: (int(lo), int(hi)) for k, (lo, hi) in (dim_ranges or {}).items()},
        "production_shapes": [dict(p) for p in (production_shapes or [])],
        "variants": {k: list(vs) for k, vs in (variants or {}).items()},
        "index_ranges": dict(index_ranges or {}),
        "dim_multiples": dict(dim_multiples or {}),
        "no_grad": list(no_grad),
        "outputs": list(outputs),
        "eager": eager,
        "record_reference": bool(record_reference),
    }
    # Evidence of the op goes stale when its reference or its declaration (what its cases are
    # made from) changes.
    # (How the reference's gradient is taken is not what it computes: record_reference is not part of it.)
    declared = repr({k: v for k, v in spec.items() if k not in ("reference", "eager", "record_reference")}).encode()
    spec["source_hash"] = hashlib.sha256(code.encode() + declared).hexdigest()[:16]
    _C.define_op(spec)
    _defined[name] = given
    evidence.install()  # the evidence source learns the new op's fingerprint
    _inductor.register_fallbacks()  # where Inductor is imported already
    return routed(name)
