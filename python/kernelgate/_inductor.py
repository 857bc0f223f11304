"""kernelgate's ops in torch.compile: Inductor calls each one as a fallback kernel.

Left to find that out by itself, Inductor takes an op it has no lowering for through its
"implicit fallback" path, which formats a log message of the op's arguments whether or not that
log is enabled. The arguments are Inductor IR, printed with everything they were computed from,
so the message grows with the graph before the call. On the H200, torch.compile of
bench/bench_train_step.py's model calling kernelgate's ops spent its first step printing that
message (every stack sampled over 240 s was inside Inductor's IR __str__), then crashed with a
segmentation fault; with the fallbacks registered here its first step takes 6.3 s (plain
torch.compile's: 11.3 s). So kernelgate registers the same fallback itself
(the op's layout-constraint tag, or Inductor's default for an op without one, as the implicit
path decides), once torch._inductor.lowering is imported: now, if it is, or right after its
import, and for an op defined later when it is defined. Nothing here imports Inductor.
KERNELGATE_INDUCTOR_FALLBACKS=0 leaves every op to the implicit path.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading

_LOWERING = "torch._inductor.lowering"
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("KERNELGATE_INDUCTOR_FALLBACKS", "1") != "0"


def register_fallbacks() -> list[str]:
    """Registers a fallback for every kernelgate op Inductor has no lowering for, if Inductor's
    lowering module is imported; the names of the overloads registered."""
    lowering = sys.modules.get(_LOWERING)
    if lowering is None or not enabled() or not hasattr(lowering, "make_fallback"):
        return []
    import torch
    from torch._library.utils import get_layout_constraint_tag

    done = []
    with _lock:
        for qualified in sorted(torch._C._dispatch_get_all_op_names()):
            ns, _, name = qualified.partition("::")
            if ns != "kernelgate":
                continue
            packet = getattr(torch.ops.kernelgate, name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                # Ops with a decomposition (the composite ones) never reach a lowering.
                if op in lowering.lowerings or op in lowering.decompositions:
                    continue
                tag = get_layout_constraint_tag(op, with_default=True)
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag),
                                       warn=False)
                done.append(f"{qualified}.{overload}")
    return done


class _Loader(importlib.abc.Loader):
    """Runs the module's own loader, then registers the fallbacks."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        register_fallbacks()

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's own loader's
        return getattr(self.inner, name)


class _AfterLoweringImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _LOWERING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """At kernelgate's import: register now if Inductor's lowering is imported, else right
    after it is."""
    if not enabled():
        return
    if _LOWERING in sys.modules:
        register_fallbacks()
    elif not any(isinstance(f, _AfterLoweringImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoweringImport())
