"""The field's libraries as backends (kernelgate.backends): availability and its reasons, the
requirements checked in C++ (device, dtypes, variants, present optionals), lazy import, the
fingerprint, and on the CPU the fallback from every library backend. test_contracts.py checks
every library backend on the GPU like every other backend: the float64 oracle forward and every
gradient on the generated cases, inputs (and cotangents) unmodified, opcheck, torch.compile, CUDA
graphs. Here on the GPU: no device-to-host sync beyond what the library's own call does."""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import kernelgate as kg
from kernelgate import backends
from kernelgate.testing import device_syncs

INFO = {o["name"]: o for o in kg.ops()}
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def backend_info(op, name):
    return next(b for b in INFO[op]["backends"] if b["name"] == name)


def installed(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the table -----------------------------------------------------------------------------------

def test_every_library_backend_is_listed_with_its_availability_and_version():
    for b in backends.BACKENDS:
        lib = backends.LIBRARIES[b.library]
        info = backend_info(b.op, b.name)
        assert info["kind"] == "python"
        version = installed(lib.dist)
        ok = version is not None and backends._within(version, lib.tested)
        assert info["available"] == ok, (b, info)
        if ok:
            assert info["version"].startswith(f"{lib.dist}=={version};code="), info
            assert info["reason"] == ""
        else:
            assert lib.dist in info["reason"] and f"kernelgate[{lib.extra}]" in info["reason"], info


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI installs the libraries (requirements-dev.txt)")
def test_ci_installs_the_libraries():
    for lib in backends.LIBRARIES:
        assert backends.status(backends.LIBRARIES[lib])[0], backends.status(backends.LIBRARIES[lib])


def test_release_numbers_and_the_tested_range():
    assert backends.release("0.8.5") == (0, 8, 5)
    assert backends.release("0.8.5.post1") == (0, 8, 5)
    assert backends.release("0.9.0rc1") == (0, 9, 0)
    assert backends.release("v1.2") == (1, 2)
    assert backends._within("0.8.5", ("0.8.5", "0.9"))
    assert backends._within("0.8.12", ("0.8.5", "0.9"))
    assert not backends._within("0.8.4", ("0.8.5", "0.9"))
    assert not backends._within("0.9.0", ("0.8.5", "0.9"))
    assert not backends._within("1.0", ("0.8.5", "0.9"))


def test_a_library_that_is_not_installed_says_how_to_install_it():
    lib = backends.Library("nosuch", "kernelgate-no-such-dist", ("1.0", "2"), "liger")
    ok, reason, version = backends.status(lib)
    assert not ok and version == ""
    assert reason == "kernelgate-no-such-dist is not installed (pip install kernelgate[nosuch])"


def test_a_library_outside_the_tested_range_is_unavailable_with_the_reason(tmp_path):
    """A fake liger-kernel 0.7.0 first on the path: every Liger backend is unavailable, says why,
    and explain and the dispatcher pass it by; the library is never imported."""
    dist = tmp_path / "liger_kernel-0.7.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: liger-kernel\nVersion: 0.7.0\n")
    code = textwrap.dedent("""
        import sys, torch, kernelgate as kg
        info = {o["name"]: o for o in kg.ops()}
        b = next(b for b in info["rms_norm"]["backends"] if b["name"] == "liger")
        print(b["available"], b["reason"], sep="|")
        x = torch.randn(3, 8)
        with kg.use(force={"rms_norm": "liger"}):
            e = kg.explain("rms_norm", x, None)
            y = kg.rms_norm(x)
        print(e.backend, [c.reason for c in e.candidates if c.backend == "liger"][0], sep="|")
        print("liger_kernel" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    want = "liger-kernel 0.7.0 is installed; kernelgate tests liger-kernel >= 0.8.5, < 0.9"
    assert lines[0].startswith("False|" + want), lines
    backend, reason = lines[1].split("|")
    assert backend != "liger" and reason.startswith("not available: " + want), lines
    assert lines[2] == "False", "the library was imported"


# ---- requirements, checked in C++ ------------------------------------------------------------------

def test_requirements_of_a_python_backend():
    """device, dtypes, variants and present of kg.register_backend on a CPU op: each a reason in
    explain, and a call that meets them all is served (forced)."""
    calls = []

    def fwd(gate, up, approximate):
        calls.append(approximate)
        return torch.ops.kernelgate._geglu_reference(gate, up, approximate)

    kg.register_backend("geglu", "test_requirements", fwd, device="cpu", dtypes=[torch.float32],
                        variants={"approximate": ["none"]})
    g = torch.randn(4, 8)

    def reason(*args):
        with kg.use(force={"geglu": "test_requirements"}):
            e = kg.explain("geglu", *args)
        return e.backend, next(c.reason for c in e.candidates if c.backend == "test_requirements")

    assert reason(g, g, "tanh")[1] == "ranked #1 but cannot implement this call: implements approximate none only"
    assert reason(g.half(), g.half(), "none")[1] == "ranked #1 but cannot implement this call: implements float32 only"
    assert reason(g, g, "none")[0] == "test_requirements"
    with kg.use(force={"geglu": "test_requirements"}):
        y = kg.geglu(g, g, "none")
    assert calls == ["none"]
    torch.testing.assert_close(y, torch.nn.functional.gelu(g) * g)

    kg.register_backend("rms_norm", "test_rows", lambda x, w, eps: None, nonempty=True, max_row_bytes=64)
    for x, want in [(torch.randn(0, 8), "needs tensors with elements (x has none)"),
                    (torch.randn(2, 17), "implements rows (the last dim of x) of at most 64 bytes only")]:
        with kg.use(force={"rms_norm": "test_rows"}):
            e = kg.explain("rms_norm", x, None)
        got = next(c.reason for c in e.candidates if c.backend == "test_rows")
        assert e.backend != "test_rows" and got == "ranked #1 but cannot implement this call: " + want, got
    with kg.use(force={"rms_norm": "test_rows"}):  # 16 float32s: 64 bytes, which it implements
        assert kg.explain("rms_norm", torch.randn(2, 16), None).backend == "test_rows"
    kg.register_backend("rms_norm", "test_row_multiple", lambda x, w, eps: None, row_bytes_multiple=4)
    with kg.use(force={"rms_norm": "test_row_multiple"}):
        e = kg.explain("rms_norm", torch.randn(2, 7).half(), None)  # 14 bytes
        got = next(c.reason for c in e.candidates if c.backend == "test_row_multiple")
        assert e.backend != "test_row_multiple"
        assert got == ("ranked #1 but cannot implement this call: implements rows (the last dim of x) "
                       "of a multiple of 4 bytes only"), got
        assert kg.explain("rms_norm", torch.randn(2, 8).half(), None).backend == "test_row_multiple"
        assert kg.explain("rms_norm", torch.randn(2, 7), None).backend == "test_row_multiple"  # 28 bytes

    kg.register_backend("layer_norm", "test_present", lambda x, w, b, eps: None, present=["bias"], device="cuda")
    with kg.use(force={"layer_norm": "test_present"}):
        e = kg.explain("layer_norm", torch.randn(2, 8), torch.randn(8), None)
    got = next(c.reason for c in e.candidates if c.backend == "test_present")
    assert got == "ranked #1 but cannot implement this call: runs on cuda tensors only", got

    kg.register_backend("causal_conv1d", "test_absent_max_dims", lambda x, w, b, a: x, device="cpu",
                        absent=["bias"], max_dims={"width": 4})
    x, w = torch.randn(2, 8, 16), torch.randn(16, 4)
    for args, want in [((x, w, torch.randn(16)), "implements calls without bias only (it is given)"),
                       ((x, torch.randn(16, 5), None), "implements width (weight.size(-1)) of at most 4 only")]:
        with kg.use(force={"causal_conv1d": "test_absent_max_dims"}):
            e = kg.explain("causal_conv1d", *args)
        got = next(c.reason for c in e.candidates if c.backend == "test_absent_max_dims")
        assert e.backend != "test_absent_max_dims" and got == "ranked #1 but cannot implement this call: " + want, got
    with kg.use(force={"causal_conv1d": "test_absent_max_dims"}):
        assert kg.explain("causal_conv1d", x, w, None).backend == "test_absent_max_dims"


@pytest.mark.gpu
def test_gpu_library_requirements_are_reasons_in_explain():
    g = torch.randn(4, 8, device="cuda")
    cases = [
        ("geglu", "liger", (g, g, "none"), "implements approximate tanh only"),
        ("linear_cross_entropy", "liger", (g.half(), torch.randn(16, 8, device="cuda").half(),
                                           torch.zeros(4, dtype=torch.long, device="cuda")),
         "implements float32, bfloat16 only"),
        ("linear_cross_entropy", "liger", (g, torch.randn(16, 8, device="cuda"),
                                           torch.zeros(4, dtype=torch.long, device="cuda"), None, -100, 0.0, "none"),
         "implements reduction mean or sum only"),
        ("layer_norm", "liger", (g, torch.randn(8, device="cuda"), None), "needs bias (it is absent)"),
        ("cross_entropy", "liger", (g[:0], torch.zeros(0, dtype=torch.long, device="cuda")),
         "needs tensors with elements (logits has none)"),
        ("rms_norm", "fla", (torch.randn(2, 16385, device="cuda"), None),
         "implements rows (the last dim of x) of at most 65536 bytes only"),
        ("rms_norm", "quack", (torch.randn(2, 4095, device="cuda").bfloat16(), None),
         "implements rows (the last dim of x) of a multiple of 4 bytes only"),
        ("add_rms_norm", "quack", (torch.randn(2, 65535, device="cuda"), torch.randn(2, 65535, device="cuda")),
         "implements rows (the last dim of x) of at most 131072 bytes only"),
    ]
    for op, name, args, reason in cases:
        with kg.use(force={op: name}):
            e = kg.explain(op, *args)
        got = next(c.reason for c in e.candidates if c.backend == name)
        assert e.backend != name and got == "ranked #1 but cannot implement this call: " + reason, (op, got)


@pytest.mark.parametrize("kwargs,error", [
    (dict(device="tpu"), "device must be 'cuda', 'cpu' or None"),
    (dict(dtypes=["float32"]), "dtypes must be a non-empty list of torch dtypes"),
    (dict(variants={"reduction": ["mean"]}), "geglu has no variant argument 'reduction'"),
    (dict(variants={"approximate": ["erf"]}), "approximate must be a non-empty list of"),
    (dict(present=["bias"]), "geglu has no tensor argument 'bias'"),
    (dict(max_row_bytes=0), "max_row_bytes must be a positive int"),
    (dict(max_row_bytes=1.5), "max_row_bytes must be a positive int"),
    (dict(row_bytes_multiple=0), "row_bytes_multiple must be a positive int"),
    (dict(absent=["bias"]), "geglu has no tensor argument 'bias'"),
    (dict(max_dims={"hidden": -1}), "max_dims: hidden must map to a non-negative int"),
    (dict(max_dims={"width": 4}), "max_dims: geglu has no named dim 'width'"),
    (dict(absent=["gate"]), "absent: gate of geglu is not optional"),
])
def test_bad_requirements_are_clear_errors(kwargs, error):
    # ValueError / TypeError from Python's checks, RuntimeError from the engine's (the contract's
    # named dims and optional arguments)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=error):
        kg.register_backend("geglu", "test_bad_requirements", lambda g, u, a: g, **kwargs)


# ---- lazy import -------------------------------------------------------------------------------

def test_library_backends_import_their_library_only_when_called():
    code = ("import sys, kernelgate; "
            "print(any(m.split('.')[0] in ('liger_kernel', 'fla', 'kernel_fun', 'quack', 'cutlass')"
            " for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_library_that_is_installed_but_cannot_be_imported_lets_the_next_backend_serve(simulated_capture):
    """A library backend is imported at the first call that reaches it; an import that fails (a
    missing or broken dependency) makes it a backend that cannot implement any call, with the
    reason in explain and a warning once: the call is served by the next backend, never raised
    into the user's program. Never imported inside a CUDA-graph capture."""
    from kernelgate._define import register_library_backend

    register_library_backend("swiglu", "test_lazy_missing", forward="kernelgate_no_such_module:fwd", backward=None,
                             needs={"device": "cpu"}, available=True, reason="", version="")
    g = torch.randn(2, 4)
    why = ("swiglu backend 'test_lazy_missing' forward: cannot import kernelgate_no_such_module:fwd: "
           "ModuleNotFoundError")
    with kg.use(force={"swiglu": "test_lazy_missing"}):
        simulated_capture(True)
        e = kg.explain("swiglu", g, g)
        simulated_capture(False)
        got = next(c.reason for c in e.candidates if c.backend == "test_lazy_missing")
        assert got.endswith("its library is not imported yet, which a CUDA-graph capture forbids"), got
        with pytest.warns(RuntimeWarning, match="kernelgate: " + why):
            y = kg.swiglu(g, g)
        e = kg.explain("swiglu", g, g)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once: the second call is quiet
            kg.swiglu(g, g)
    got = next(c.reason for c in e.candidates if c.backend == "test_lazy_missing")
    assert e.backend != "test_lazy_missing" and got.startswith("ranked #1 but cannot implement this call: " + why), got
    torch.testing.assert_close(y, torch.nn.functional.silu(g) * g)


def test_import_check_runs_the_import_in_a_fresh_process_and_names_the_error():
    missing = backends.Library("nothing", "no-such-dist", ("0", "1"), "no_such_adapter")
    ok, error = backends.import_check(missing, timeout=120)
    assert not ok and error == "ModuleNotFoundError: No module named 'kernelgate.backends.no_such_adapter'", error
    assert "kernelgate.backends.no_such_adapter" not in sys.modules


def test_doctor_lists_the_libraries_and_whether_they_import():
    """kernelgate doctor --import-libraries: every available library imported in a fresh process,
    with the error where it fails (on a CPU machine with quack-kernels but without its CuTe DSL
    runtime, quack's import fails: what its first call would find, which then lets the next
    backend serve)."""
    out = subprocess.run([sys.executable, "-m", "kernelgate.cli", "doctor", "--json", "--import-libraries"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    libs = {lib["library"]: lib for lib in json.loads(out.stdout)["libraries"]}
    assert set(libs) == set(backends.LIBRARIES)
    for name, lib in libs.items():
        assert lib["available"] == backends.status(backends.LIBRARIES[name])[0]
        if lib["available"]:
            assert isinstance(lib["imports"], bool) and (lib["imports"] or lib["import_error"]), lib
            if not lib["imports"]:
                code = "import kernelgate.backends." + backends.LIBRARIES[name].adapter
                assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode != 0
        else:
            assert "imports" not in lib


# ---- the CPU: every library backend falls back ---------------------------------------------------

@pytest.mark.parametrize("op,name", [(b.op, b.name) for b in backends.BACKENDS], ids=lambda v: str(v))
def test_on_the_cpu_a_forced_library_backend_falls_back(op, name, caplog):
    if not backend_info(op, name)["available"]:
        pytest.skip(f"{op}/{name} unavailable here: {backend_info(op, name)['reason']}")
    from test_contracts import call_args, cases, op_fn, reference_op

    cid, enc = cases(op, regime="normal", grad="0", layout="contiguous", strings="")[0]
    args, _ = call_args(enc, "cpu")
    with kg.use(force={op: name}):
        e = kg.explain(op, *args)
        got = op_fn(op)(*args)
    assert e.backend != name
    assert next(c.reason for c in e.candidates if c.backend == name).endswith("runs on cuda tensors only")
    want = reference_op(op)(*args)
    for g, w in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, (tuple, list)) else [want]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class _QuackRowsStandIn:
    """quack.rmsnorm's rmsnorm_fwd / rmsnorm_bwd as the adapter uses them, on the CPU in float64
    (quack's kernels take contiguous [rows, hidden] matrices with 16-byte aligned data only: the
    stand-in refuses others)."""

    @staticmethod
    def _matrix(*ts):
        for t in ts:
            assert t is None or (t.dim() == 2 and t.is_contiguous() and t.data_ptr() % 16 == 0), t.shape

    def rmsnorm_fwd(self, x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None,
                    eps=1e-6, store_rstd=False, weight_offset=0.0):
        self._matrix(x, residual)
        assert weight is None or weight.data_ptr() % 16 == 0
        h = x.double() if residual is None else x.double() + residual.double()
        rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
        y = h * rstd[:, None] * (1 if weight is None else weight.double())
        res_out = x if residual is None else h.to(residual_dtype)
        return y.to(x.dtype), res_out, rstd.float() if store_rstd else None

    def rmsnorm_bwd(self, x, weight, dout, rstd, dresidual_out=None, has_bias=False, has_residual=False,
                    weight_offset=0.0):
        self._matrix(x, dout, dresidual_out)
        xh = x.double() * rstd.double()[:, None]
        g = dout.double() * (1 if weight is None else weight.double())
        dx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
        if dresidual_out is not None:
            dx = dx + dresidual_out.double()
        dw = None if weight is None else (dout.double() * xh).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw, None, dx.to(x.dtype) if has_residual else None


def test_quack_adapter_against_autograd_with_a_cpu_stand_in(monkeypatch):
    """The adapter's part (flattening leading dims, non-contiguous inputs, the residual's
    gradient, an absent output gradient) checked on the CPU against float64 autograd, quack's
    functions replaced by a float64 stand-in of their matrix contract. The GPU tests check the
    real kernels against the oracle."""
    import importlib.util
    import types

    fake = types.ModuleType("quack")
    fake.rmsnorm = _QuackRowsStandIn()
    monkeypatch.setitem(sys.modules, "quack", fake)
    monkeypatch.setitem(sys.modules, "quack.rmsnorm", fake.rmsnorm)  # the module's two functions
    # A private copy of the adapter module, bound to the stand-in: the package's own stays as it
    # was (on a GPU machine, bound to quack).
    spec = importlib.util.find_spec("kernelgate.backends.quack")
    adapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapter)

    torch.manual_seed(0)
    eps = 1e-5
    x = torch.randn(3, 10, 7, dtype=torch.float64).transpose(0, 1)  # [10, 3, 7], not contiguous
    r = torch.randn(10 * 3 * 7 + 1, dtype=torch.float64)[1:].view(10, 3, 7)  # at an 8-byte offset
    w = torch.randn(8, dtype=torch.float64)[1:]
    dy, dh = torch.randn(10, 3, 7, dtype=torch.float64), torch.randn(10, 3, 7, dtype=torch.float64)

    def ref(x, r, w):
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w, h

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y_ref, h_ref = ref(*leaves)
    gx, gr, gw = torch.autograd.grad((y_ref, h_ref), leaves, (dy, dh))
    y, h, rstd = adapter.add_rms_norm_fwd(x, r, w, eps)
    assert y.shape == h.shape == x.shape and rstd.shape == x.shape[:-1]
    torch.testing.assert_close((y, h), (y_ref.detach(), h_ref.detach()))
    dx, dw = adapter.add_rms_norm_bwd(dy, dh, h, w, rstd, eps)
    torch.testing.assert_close((dx, dx, dw), (gx, gr, gw), rtol=1e-5, atol=1e-6)
    dx, dw = adapter.add_rms_norm_bwd(None, dh, h, w, rstd, eps)  # only h's gradient
    torch.testing.assert_close((dx, dw), (dh, torch.zeros_like(w)))

    leaves = [t.clone().requires_grad_() for t in (x, w)]
    y_ref = ref(leaves[0], torch.zeros_like(x), leaves[1])[0]
    gx, gw = torch.autograd.grad(y_ref, leaves, dy)
    y, rstd = adapter.rms_norm_fwd(x, w, eps)
    torch.testing.assert_close(y, y_ref.detach())
    dx, dw = adapter.rms_norm_bwd(dy.transpose(0, 1).contiguous().transpose(0, 1), x, w, rstd, eps)
    torch.testing.assert_close((dx, dw), (gx, gw), rtol=1e-5, atol=1e-6)
    y, rstd = adapter.rms_norm_fwd(x, None, eps)  # no weight: no weight gradient
    assert adapter.rms_norm_bwd(dy, x, None, rstd, eps)[1] is None


def test_adapter_code_hash_ignores_comments():
    from kernelgate._define import source_hash

    a = "def f(x):\n    return x + 1\n"
    assert source_hash(a) == source_hash("# a note\ndef f(x):  # why\n\n    return x + 1\n")
    assert source_hash(a) != source_hash("def f(x):\n    return x + 2\n")


# ---- GPU: no sync beyond the library's own -----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(b.op, b.name) for b in backends.BACKENDS], ids=lambda v: str(v))
def test_gpu_a_routed_library_call_syncs_no_more_than_the_library(op, name):
    sys.path.insert(0, BENCH)
    from library_calls import DIRECT

    assert backend_info(op, name)["available"], backend_info(op, name)["reason"]
    make, direct = DIRECT[op, name]
    args = make()

    def backward(out):  # calls without gradients (library_calls says which) compare the forwards
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
        if outs:
            sum(o.float().sum() for o in outs).backward()

    def routed():
        with kg.use(force={op: name}):
            backward(getattr(kg, op)(*args))

    def library():
        backward(direct(*args))

    routed(), library()  # compiled and autotuned outside the count
    with kg.use(force={op: name}):
        assert kg.explain(op, *args).backend == name
    assert device_syncs(routed) <= device_syncs(library)


# ---- warmup and the CUDA-graph rule for JIT (Python) backends -------------------------------------

def test_grad_request_tells_a_forward_which_gradients_the_call_needs():
    """grad_request=True: forward gets needs_grad, the tensor arguments needing gradients, also
    where the tensors it gets carry no requires_grad (AOT autograd's traced forward)."""
    seen = []

    def fwd(gate, up, *, needs_grad):
        seen.append(needs_grad)
        return torch.ops.kernelgate._swiglu_reference(gate, up)

    def bwd(dc, gate, up):
        s = torch.sigmoid(gate)
        return dc * up * s * (1 + gate * (1 - s)), dc * gate * s

    kg.register_backend("swiglu", "test_grad_request", fwd, bwd, device="cpu", grad_request=True)
    g, u = torch.randn(3, 40), torch.randn(3, 40)
    with kg.use(force={"swiglu": "test_grad_request"}):
        kg.swiglu(g, u)
        kg.swiglu(g.requires_grad_(), u)
        kg.swiglu(g, u.requires_grad_()).sum().backward()
        assert seen == [(), ("gate",), ("gate", "up")]
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b: kg.swiglu(a, b).sum(), backend="aot_eager", fullgraph=True)
        compiled(g, u.detach()).backward()
        assert seen[-1] == ("gate",), seen
        torch._dynamo.reset()


@pytest.fixture
def simulated_capture():
    """Every call made as if a CUDA graph were being captured, while `on` is set."""
    state = {"on": False}

    def set_on(on):
        state["on"] = on
        kg._C.simulate_capture_for_tests(on)

    try:
        yield set_on
    finally:
        kg._C.simulate_capture_for_tests(False)


def test_under_capture_a_python_backend_serves_only_calls_it_served_eagerly(simulated_capture, caplog):
    ran = []

    def fwd(gate, up):
        ran.append(tuple(gate.shape))
        return torch.ops.kernelgate._swiglu_reference(gate, up)

    def bwd(dc, gate, up):
        ran.append("bwd")
        s = torch.sigmoid(gate)
        return dc * up * s * (1 + gate * (1 - s)), dc * gate * s

    kg.register_backend("swiglu", "test_jit", fwd, bwd, device="cpu")
    g = torch.randn(3, 40)
    with kg.use(force={"swiglu": "test_jit"}):
        simulated_capture(True)
        with caplog.at_level("INFO", logger="kernelgate"):
            y = kg.swiglu(g, g)  # never served eagerly: the next backend serves
        assert ran == []
        torch.testing.assert_close(y, torch.nn.functional.silu(g) * g)
        assert any("not warm for CUDA-graph capture" in r.getMessage() for r in caplog.records), caplog.text
        simulated_capture(False)
        kg.swiglu(g, g)  # eagerly: now warm
        assert ran == [(3, 40)]
        simulated_capture(True)
        kg.swiglu(g, g)
        assert ran == [(3, 40), (3, 40)]
        kg.swiglu(torch.randn(3, 4000), torch.randn(3, 4000))  # another key: not warm
        assert len(ran) == 2

        # Training calls: forward and backward are warmed separately, by kg.warmup here.
        x = torch.randn(5, 24, requires_grad=True)
        kg.swiglu(x, x).sum().backward()
        assert len(ran) == 2
        simulated_capture(False)
        report = kg.warmup("swiglu", x, x)
        assert report.served == [{"backend": "test_jit", "ran": "forward+backward"}] and report.seconds > 0
        assert ran[2:] == [(5, 24), "bwd"]
        simulated_capture(True)
        kg.swiglu(x, x).sum().backward()
        assert ran[4:] == [(5, 24), "bwd"]


def test_warmup_from_shapes_warms_the_key_of_such_calls(simulated_capture):
    """kg.warmup(op, shapes=..., dtype=...) makes the calls the sweeps would (the op's named dims),
    so a JIT backend then serves a captured call of that shape, dtype and layout, and no other."""
    ran = []

    def fwd(gate, up, approximate):
        ran.append((tuple(gate.shape), gate.dtype, approximate))
        return torch.ops.kernelgate._geglu_reference(gate, up, approximate)

    kg.register_backend("geglu", "test_jit_shapes", fwd, device="cpu")
    with kg.use(force={"geglu": "test_jit_shapes"}):
        report = kg.warmup("geglu", shapes=[{"rows": 6, "hidden": 40}, {"rows": 2, "hidden": 8}],
                           dtype=torch.bfloat16, variants={"approximate": "none"}, grad=False, device="cpu")
        assert report.served == [{"backend": "test_jit_shapes", "ran": "forward"}] * 2
        assert ran == [((6, 40), torch.bfloat16, "none"), ((2, 8), torch.bfloat16, "none")]
        simulated_capture(True)
        g = torch.randn(6, 40, dtype=torch.bfloat16)
        kg.geglu(g, g, "none")
        assert len(ran) == 3  # warm: served under capture
        kg.geglu(g.float(), g.float(), "none")  # another dtype: not warm, the next backend serves
        kg.geglu(g, g, "tanh")  # another variant: not warm
        assert len(ran) == 3


@pytest.mark.parametrize("kwargs,error", [
    (dict(shapes=[]), "shapes is empty"),
    (dict(shapes={"rows": 2, "hidden": 8}), "with shapes, give dtype"),
    (dict(shapes={"rows": 2, "hid": 8}, dtype=torch.float32), "dims are rows, hidden .* got hid"),
    (dict(shapes={"rows": -1, "hidden": 8}, dtype=torch.float32), "got rows=-1"),
    (dict(shapes={"rows": 2}, dtype=torch.float32), "no size for dim 'hidden'"),
    (dict(shapes=[(2, 8)], dtype=torch.float32), "each shape is a dict"),
    (dict(shapes={"rows": 2, "hidden": 8}, dtype=torch.int32), "takes dtypes float32, float16, bfloat16, got int32"),
    (dict(shapes={"rows": 2, "hidden": 8}, dtype=torch.float32, layout="tiled"), "layout must be one of"),
    (dict(shapes={"rows": 2, "hidden": 8}, dtype=torch.float32, device="meta"), "device must be a cuda or cpu"),
    (dict(shapes={"rows": 2, "hidden": 8}, dtype=torch.float32, variants={"approximate": "erf"}),
     "variant arguments approximate"),
])
def test_warmup_from_shapes_errors(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        kg.warmup("geglu", **{"device": "cpu", **kwargs})


def test_warmup_errors_and_calls():
    with pytest.raises(ValueError, match="give swiglu an example call"):
        kg.warmup("swiglu")
    with pytest.raises(ValueError, match="not several"):
        kg.warmup("swiglu", torch.randn(2, 3), shapes={"rows": 2, "hidden": 3})
    with pytest.raises(ValueError, match="calls is empty"):
        kg.warmup("swiglu", calls=[])
    with pytest.raises(ValueError, match="unknown op 'nosuch'"):
        kg.warmup("nosuch", torch.randn(2))
    with pytest.raises(RuntimeError):
        kg.warmup("swiglu", torch.randn(2, 3), torch.randn(2, 4))
    x = torch.randn(2, 8)
    report = kg.warmup("rms_norm", calls=[(x, None), (x.half(), None, 1e-5)])
    assert [s["ran"] for s in report.served] == ["forward", "forward"]


def test_a_backend_that_syncs_is_refused_under_capture(simulated_capture):
    """Liger's cross-entropy counts the valid rows on the host (.item()): never under capture."""
    for b in backends.BACKENDS:
        if b.capturable or not backend_info(b.op, b.name)["available"]:
            continue
        kg.register_backend(b.op, f"test_uncapturable_{b.name}", lambda *a: None, device="cpu", capturable=False)
        from test_contracts import call_args, cases

        args, _ = call_args(cases(b.op, regime="normal", grad="0", layout="contiguous", strings="")[0][1], "cpu")
        with kg.use(force={b.op: f"test_uncapturable_{b.name}"}):
            simulated_capture(True)
            e = kg.explain(b.op, *args)
            simulated_capture(False)
        reason = next(c.reason for c in e.candidates if c.backend == f"test_uncapturable_{b.name}")
        assert e.backend != f"test_uncapturable_{b.name}"
        assert reason.endswith("syncs with the host, which CUDA-graph capture forbids"), reason


# Each library backend's kernels, as the profiler names them: a launch witness.
KERNELS = {
    ("rms_norm", "liger"): "rms_norm_forward_kernel", ("layer_norm", "liger"): "_layer_norm_forward_kernel",
    ("swiglu", "liger"): "_swiglu_forward_kernel", ("geglu", "liger"): "_geglu_tanh_forward_kernel",
    ("cross_entropy", "liger"): "liger_cross_entropy_kernel",
    ("linear_cross_entropy", "liger"): "liger_cross_entropy_kernel",
    ("linear_cross_entropy", "liger_fp32_accum"): "liger_cross_entropy_kernel",
    ("rms_norm", "fla"): "layer_norm_fwd_kernel", ("layer_norm", "fla"): "layer_norm_fwd_kernel",
    ("swiglu", "fla"): "swiglu_fwd_kernel", ("causal_conv1d", "fla"): "causal_conv1d_fwd_kernel",
    ("causal_conv1d", "kernel_fun"): "cconv_fwd_strip",
    ("gated_delta_rule", "fla_chunk"): "chunk_fwd_kernel_o",
    ("gated_delta_rule", "fla_fused_recurrent"): "fused_recurrent_gated_delta_rule_fwd_kernel",
    ("kda", "fla_chunk"): "chunk_gla_fwd_kernel_o",  # read in fla-core 0.6.0's chunk_kda_fwd, not yet seen run
    # CuTe DSL kernels are named after their class (quack.rmsnorm.RMSNorm) and its arguments
    ("rms_norm", "quack"): "RMSNorm", ("add_rms_norm", "quack"): "RMSNorm",
}


def test_every_library_backend_has_a_launch_witness():
    assert set(KERNELS) == {(b.op, b.name) for b in backends.BACKENDS}


def _kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(b.op, b.name) for b in backends.BACKENDS], ids=lambda v: str(v))
def test_gpu_warm_library_backend_launch_witness_and_capture(op, name):
    """After kg.warmup, the forced call runs the library's kernels and none of ours (profiler
    device events); a capturable backend's forward captured on a side stream replays
    bit-identically to the eager call. (The rule for cold shapes under capture is tested on the
    CPU with a simulated capture.)"""
    sys.path.insert(0, BENCH)
    from library_calls import DIRECT

    assert backend_info(op, name)["available"], backend_info(op, name)["reason"]
    make, _ = DIRECT[op, name]
    args = make()
    with kg.use(force={op: name}):
        report = kg.warmup(op, *args)
        assert report.served[0]["backend"] == name, report
        names = _kernels(lambda: getattr(kg, op)(*args))
        assert any(KERNELS[op, name] in n for n in names), names
        assert not any("kernelgate" in n for n in names), names
        lib = next(b for b in backends.BACKENDS if (b.op, b.name) == (op, name))
        if not lib.capturable:
            return
        inputs = [a.detach() if torch.is_tensor(a) else a for a in args]
        kg.warmup(op, *inputs)
        eager = getattr(kg, op)(*inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                captured = getattr(kg, op)(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        for c, e in zip(captured if isinstance(captured, tuple) else [captured], eager if isinstance(eager, tuple) else [eager]):
            assert torch.equal(c, e)
