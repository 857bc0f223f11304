"""kernelgate's ops reach Inductor as fallbacks kernelgate registers (python/kernelgate/_inductor.py),
not through Inductor's implicit-fallback path, whose log message prints every argument's IR and
its whole history (on the H200 the training step's compile never finished that way). Each check
runs in a fresh interpreter: which modules are imported, and in which order, is the point."""

import json
import os
import subprocess
import sys

import pytest

# Prints what the checks read: whether importing kernelgate imported Inductor, which kernelgate
# ops Inductor would lower without a registered lowering, and (with COMPILE) the kernelgate ops
# that went through the implicit path while a small training step compiled.
PROBE = r"""
import json, os, sys
if os.environ.get("INDUCTOR_FIRST") == "1":
    import torch._inductor.lowering
import kernelgate as kg
import torch
out = {"inductor_imported_by_kernelgate": "torch._inductor.lowering" in sys.modules}
import torch._inductor.lowering as lowering
import torch._inductor.exc as exc
implicit = []
inner = exc.OperatorIssue.operator_str
def recording(target, args, kwargs):
    implicit.append(str(target))
    return inner(target, args, kwargs)
exc.OperatorIssue.operator_str = staticmethod(recording)
if os.environ.get("DEFINE_LATE") == "1":
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import pyops_example  # noqa: F401  (defines softcap now, after Inductor's import)
def missing():
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("kernelgate::")]
    ops = [getattr(getattr(torch.ops.kernelgate, n.split("::")[1]), o)
           for n in names for o in getattr(torch.ops.kernelgate, n.split("::")[1]).overloads()]
    return sorted(str(op) for op in ops
                  if op not in lowering.lowerings and op not in lowering.decompositions)
out["missing"] = missing()
out["source_readable"] = "def make_fallback" in lowering.__loader__.get_source(lowering.__name__)
if os.environ.get("COMPILE") == "1":
    torch._inductor.config.force_disable_caches = True  # a cache hit would skip the lowering
    def f(x, w, g, u):
        y = kg.rms_norm(x, w, 1e-6)
        return (kg.swiglu(y, u) + g).square().mean()
    args = [torch.randn(8, 16, requires_grad=True), torch.randn(16, requires_grad=True),
            torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)]
    torch.compile(f, fullgraph=True)(*args).backward()
    out["grads"] = all(a.grad is not None and bool(torch.isfinite(a.grad).all()) for a in args)
out["implicit"] = sorted({t for t in implicit if t.startswith("kernelgate.")})
print("RESULT " + json.dumps(out))
"""


def probe(**env_vars):
    env = {**os.environ, "TESTS_DIR": os.path.dirname(os.path.abspath(__file__)), **env_vars}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_importing_kernelgate_does_not_import_inductor_and_its_import_registers_the_fallbacks():
    got = probe()
    assert got["inductor_imported_by_kernelgate"] is False
    assert got["missing"] == []
    assert got["source_readable"] is True  # the module's loader still answers what it did


def test_inductor_imported_before_kernelgate_gets_the_fallbacks_at_kernelgate_import():
    got = probe(INDUCTOR_FIRST="1")
    assert got["inductor_imported_by_kernelgate"] is True
    assert got["missing"] == []


def test_an_op_defined_after_inductor_is_imported_gets_its_fallback_when_defined():
    got = probe(DEFINE_LATE="1")
    assert got["missing"] == []


@pytest.mark.parametrize("fallbacks", ["1", "0"])
def test_a_compiled_training_step_never_takes_the_implicit_fallback_path(fallbacks):
    """With KERNELGATE_INDUCTOR_FALLBACKS=0 (kernelgate registers nothing) the same compile takes
    the implicit path for kernelgate's ops: the check sees it, so it can fail."""
    got = probe(COMPILE="1", KERNELGATE_INDUCTOR_FALLBACKS=fallbacks)
    assert got["grads"] is True
    if fallbacks == "1":
        assert got["implicit"] == []
        assert got["missing"] == []
    else:
        assert "kernelgate._rms_norm_fwd.default" in got["implicit"], got
        assert "kernelgate._rms_norm_fwd.default" in got["missing"], got
