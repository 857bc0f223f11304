"""When evidence goes stale (docs/evidence.md): an op's source hash covers the tokens of its
computing files, not comments, formatting or registration glue."""

import importlib.util
import os

import pytest

import kernelgate as kg
from kernelgate import _C

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _hashes():
    spec = importlib.util.spec_from_file_location("source_hashes", os.path.join(REPO, "cmake", "source_hashes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_comments_and_formatting_do_not_count_tokens_do():
    n = _hashes().normalized
    base = 'int f(int x) {\n  return x + 1;  // one\n}\nconst char* s = "a // b";\n'
    assert n(base) == n('/* doc */ int f(int x)\n{\n    return x+1;\n}\n// note\nconst char* s = "a // b";')
    assert n(base) != n(base.replace("x + 1", "x + 2"))
    # A comment marker inside a string literal is code.
    assert n('const char* s = "a // b";') != n('const char* s = "a ";')


def test_a_real_kernel_reformatted_keeps_its_hash(tmp_path):
    m = _hashes()
    src = open(os.path.join(REPO, "src", "kernels", "rms_norm_cuda.cu")).read()
    reformatted = "// a new comment\n" + src.replace("\n", "\n\n").replace("  ", "    ")
    a, b, c = tmp_path / "a.cu", tmp_path / "b.cu", tmp_path / "c.cu"
    a.write_text(src)
    b.write_text(reformatted)
    c.write_text(src.replace("return", "return  /*x*/ ", 1) + "\nint kg_extra_token;\n")
    assert m.file_hash(str(a)) == m.file_hash(str(b))
    assert m.file_hash(str(a)) != m.file_hash(str(c))


SHARED = {"src/kernels/dtype.h", "src/kernels/vec16.cuh", "src/ops/op_util.h",
          "src/harness/cases.cpp", "src/harness/validate.cpp"}


@pytest.mark.parametrize("op,own", [
    ("rms_norm", {"src/ops/rms_norm.cpp", "src/kernels/rms_norm.h", "src/kernels/rms_norm_cuda.cu",
                  "src/kernels/rms_norm_cpu.cpp"}),
    ("swiglu", {"src/ops/gated.cpp", "src/kernels/gated.h", "src/kernels/gated_cuda.cu"}),
    ("linear_cross_entropy", {"src/ops/linear_cross_entropy.cpp", "src/ops/cross_entropy.cpp",
                              "src/ops/cross_entropy_common.h", "src/kernels/cross_entropy.h",
                              "src/kernels/cross_entropy_cuda.cu"}),
])
def test_each_op_hash_covers_its_stems_and_the_shared_computing_files(op, own):
    files = set(_C.op_source_files(op))
    assert SHARED <= files
    assert files - SHARED == own
    # Registration glue is not part of any op's evidence.
    assert not any(f.startswith(("src/core/", "include/", "src/store/", "src/python/")) for f in files)


def test_an_op_defined_from_python_is_hashed_with_the_shared_harness_files():
    # Its cases are made and judged by the same harness as the built-in ops': a change there
    # makes its evidence stale too. Its own part is its reference's and declaration's hash.
    import pyops_example  # noqa: F401  (defines softcap)

    assert set(_C.op_source_files("softcap")) == SHARED
    own = _C.fingerprint("softcap")["source_hash"]
    assert len(own) == 16
    others = {_C.fingerprint(o["name"])["source_hash"] for o in kg.ops() if o["name"] != "softcap"}
    assert own not in others


def test_every_op_has_a_hash_of_its_own_files():
    for info in kg.ops():
        if info["defined_in_python"]:
            continue
        files = set(_C.op_source_files(info["name"]))
        assert files - SHARED, f"{info['name']}: no file of its own in its source hash"
        assert len(_C.fingerprint(info["name"])["source_hash"]) == 16


def _module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_python_defined_ops_hash_covers_the_helpers_of_its_module_it_calls(tmp_path):
    """The code hash of kg.define_op: its reference and eager code and every function of their
    module they call, transitively, so a helper's change makes the op's evidence stale; a comment
    does not, nor does a function they do not call."""
    from kernelgate._define import _closure_hash

    base = (
        "import torch\n"
        "def _inner(x):\n    return x * 2\n"
        "def _helper(x):\n    return _inner(x) + 1\n"
        "def _unused(x):\n    return x\n"
        "def reference(x):\n    return torch.tanh(_helper(x))\n"
        "def eager(x):\n    return reference(x)\n")
    variants = {
        "base": base,
        "comment": base.replace("return x * 2", "return x * 2  # doubled"),
        "unused": base.replace("def _unused(x):\n    return x", "def _unused(x):\n    return x + 3"),
        "inner": base.replace("return x * 2", "return x * 3"),
        "helper": base.replace("_inner(x) + 1", "_inner(x) + 2"),
    }
    hashes = {}
    for i, (name, source) in enumerate(variants.items()):
        m = _module(tmp_path, f"closure_{i}", source)
        hashes[name] = (_closure_hash(m.reference), _closure_hash(m.reference, m.eager))
    assert hashes["comment"] == hashes["base"] and hashes["unused"] == hashes["base"]
    assert len({hashes[k][0] for k in ("base", "inner", "helper")}) == 3
    assert len({hashes[k][1] for k in ("base", "inner", "helper")}) == 3
    assert hashes["base"][0] != hashes["base"][1]  # the eager code counts too


def test_a_python_defined_ops_hash_covers_classes_and_kernelgates_own_helpers(tmp_path):
    """An autograd.Function the reference applies counts, with every method and the helpers its
    methods call; so does a helper of another kernelgate module (the chunked references' state
    pass lives in kernelgate._state_scan)."""
    import sys

    from kernelgate._define import _closure_hash

    package_helper = "def scan_helper(x):\n    return x - 1\n"
    op = (
        "import torch\n"
        "from kernelgate._closure_probe import scan_helper\n"
        "def _twice(x):\n    return x * 2\n"
        "class _Fn(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return _twice(x)\n"
        "    @staticmethod\n    @torch.autograd.function.once_differentiable\n"
        "    def backward(ctx, g):\n        return g * 2\n"
        "def reference(x):\n    return scan_helper(_Fn.apply(x))\n")
    variants = {
        "base": (package_helper, op),
        "method": (package_helper, op.replace("return g * 2", "return g * 3")),
        "method_helper": (package_helper, op.replace("return x * 2", "return x * 4")),
        "package_helper": (package_helper.replace("x - 1", "x - 2"), op),
    }
    hashes = {}
    try:
        for i, (name, (helper_src, op_src)) in enumerate(variants.items()):
            sys.modules["kernelgate._closure_probe"] = _module(tmp_path, f"probe_{i}", helper_src)
            sys.modules["kernelgate._closure_probe"].scan_helper.__module__ = "kernelgate._closure_probe"
            hashes[name] = _closure_hash(_module(tmp_path, f"op_{i}", op_src).reference)
    finally:
        sys.modules.pop("kernelgate._closure_probe", None)
    assert len(set(hashes.values())) == len(variants), hashes
