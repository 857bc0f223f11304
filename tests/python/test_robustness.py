"""No silent wrong answers, no destroyed files, no hangs: each defect a hostile user found has a
test here that failed before its fix (the CLI's error paths as a user meets them: exit status and
one line, no traceback)."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

import kernelgate as kg
from kernelgate import cli


def _cli(*args, env=None, timeout=120):
    """Runs the kernelgate command in a fresh process (for what the environment decides at
    import): (exit status, stdout, stderr)."""
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "kernelgate.cli", *args], capture_output=True, timeout=timeout,
                       env=full_env)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def _run(capsys, *args):
    """Runs the kernelgate command in this process, as a user meets it: (exit status, stdout,
    stderr); a usage error exits with its one-line message."""
    capsys.readouterr()
    try:
        rc = cli.main(list(args))
    except SystemExit as exc:
        rc = 0 if exc.code is None else (exc.code if isinstance(exc.code, int) else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- double backward (item 2) ---------------------------------------------------------------------

def _second_order(fn, inputs, seed=0):
    """d/d(inputs) of sum(grad(fn(inputs), inputs, cot)^2): a second-order gradient."""
    g = torch.Generator().manual_seed(seed)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cots = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    first = torch.autograd.grad(outs, leaves, cots, create_graph=True)
    total = sum((f.double() ** 2).sum() for f in first)
    return torch.autograd.grad(total, leaves, allow_unused=True)


CASES = {
    "rms_norm": (lambda x, w: kg.rms_norm(x, w, 1e-6),
                 lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
                 lambda: (torch.randn(5, 16, dtype=torch.float64).float(), torch.randn(16))),
    "layer_norm": (lambda x, w, b: kg.layer_norm(x, w, b, 1e-5),
                   lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
                   lambda: (torch.randn(5, 16), torch.randn(16), torch.randn(16))),
    "swiglu": (kg.swiglu, lambda g, u: F.silu(g) * u, lambda: (torch.randn(4, 8), torch.randn(4, 8))),
    "geglu": (lambda g, u: kg.geglu(g, u, "none"), lambda g, u: F.gelu(g) * u,
              lambda: (torch.randn(4, 8), torch.randn(4, 8))),
    "cross_entropy": (lambda x: kg.cross_entropy(x, torch.tensor([1, 0, 3, 2]), label_smoothing=0.1),
                      lambda x: F.cross_entropy(x, torch.tensor([1, 0, 3, 2]), label_smoothing=0.1),
                      lambda: (torch.randn(4, 7),)),
}


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("backend", ["reference", "kernelgate_cpu"])
def test_double_backward_matches_torch(op, backend):
    ours, theirs, make = CASES[op]
    names = {b["name"] for o in kg.ops() if o["name"] == op for b in o["backends"] if b["available"]}
    if backend not in names:
        backend = "reference"  # ops without a CPU kernel of ours: the reference serves
    inputs = make()
    with kg.use(force={op: backend}):
        got = _second_order(ours, inputs)
    want = _second_order(theirs, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _add_rms_norm():
    x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    return kg.add_rms_norm(x, r), [x, r]


def _rope():
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 1, 3, 8, requires_grad=True)
    return kg.rope(q, k, torch.randn(1, 3, 8), torch.randn(1, 3, 8)), [q, k]


def _linear_cross_entropy():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    return (kg.linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3])),), [h, w]


@pytest.mark.parametrize("call", [_add_rms_norm, _rope, _linear_cross_entropy],
                         ids=["add_rms_norm", "rope", "linear_cross_entropy"])
def test_double_backward_that_cannot_be_served_says_so(call):
    # Through a routed backend (the plain PyTorch fallback is differentiated by PyTorch: twice too).
    with kg.use(force="reference"):
        _double_backward_refused(call)


def _double_backward_refused(call):
    outs, leaves = call()
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported"):
        torch.autograd.grad(sum(o.sum() for o in outs), leaves, create_graph=True)
    # Without create_graph, the same call differentiates once as always.
    outs, leaves = call()
    assert all(g is not None for g in torch.autograd.grad(sum(o.sum() for o in outs), leaves))


# ---- cross_entropy with a +inf logit (item 11) --------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_inf_logit_away_from_the_target_is_an_inf_loss_as_documented(reduction):
    x = torch.randn(3, 6)
    x[0, 4] = float("inf")  # row 0's target is 1
    t = torch.tensor([1, 2, 5])
    # The op's kernels and reference; without evidence the eager backend (F.cross_entropy itself)
    # serves, and answers as it does (docs/evidence.md).
    eager = kg.cross_entropy(x, t, reduction=reduction)
    assert torch.equal(eager.isnan(), F.cross_entropy(x, t, reduction=reduction).isnan())
    with kg.use(exclude={"cross_entropy": "eager"}):
        check_inf_logit(x, t, reduction)


def check_inf_logit(x, t, reduction):
    ours = kg.cross_entropy(x, t, reduction=reduction)
    oracle = torch.ops.kernelgate._cross_entropy_reference(x.double(), t, -100, 0.0, reduction)
    assert torch.equal(torch.isinf(ours), torch.isinf(oracle)) and ours.flatten()[0] == float("inf")
    assert torch.isnan(F.cross_entropy(x, t, reduction=reduction).flatten()[0])  # the documented difference
    xl = x.clone().requires_grad_(True)
    kg.cross_entropy(xl, t, reduction="sum").backward()
    assert xl.grad[0, 1] == -1 and torch.isnan(xl.grad[0, 4]) and xl.grad[0, [0, 2, 3, 5]].eq(0).all()
    # Everywhere else the same NaN / Inf as F.cross_entropy: a +inf at the target, a -inf.
    for row, col in [(1, 2), (2, 0)]:
        y = torch.randn(3, 6)
        y[row, col] = float("inf") if col == 2 else float("-inf")
        a, b = kg.cross_entropy(y, t, reduction="none"), F.cross_entropy(y, t, reduction="none")
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())


# ---- files and paths (items 1, 4, 10) --------------------------------------------------------------

def test_db_export_never_replaces_what_the_path_is(tmp_path, capsys):
    db = str(tmp_path / "s.sqlite")
    assert cli.main(["validate", "rms_norm", "--db", db, "--dtype", "float32", "--seeds", "1",
                     "--backend", "reference", "--json"]) == 0
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for target in [fifo, str(tmp_path), "/dev/null"]:
        rc, _, err = _run(capsys, "db", "export", target, "--db", db)
        assert rc == 1 and "export writes only a regular file or a new path" in err, err
        assert len(err.strip().splitlines()) == 1
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert _run(capsys, "db", "export", str(link), "--db", db)[0] == 0
    assert link.is_symlink() and json.loads(real.read_text())["format"] == "kernelgate-evidence"


@pytest.mark.parametrize("what", ["fifo", "devnull", "empty", "tableless"])
def test_a_store_path_that_is_no_store_is_refused_never_opened_or_taken_over(tmp_path, capsys, monkeypatch, what):
    path = {"fifo": str(tmp_path / "fifo"), "devnull": "/dev/null", "empty": str(tmp_path / "e.sqlite"),
            "tableless": str(tmp_path / "t.sqlite")}[what]
    if what == "fifo":
        os.mkfifo(path)
    elif what == "empty":
        open(path, "wb").close()
    elif what == "tableless":
        import sqlite3

        con = sqlite3.connect(path)
        con.execute("PRAGMA user_version = 3")
        con.commit()
        con.close()
    before = None if what in ("fifo", "devnull") else open(path, "rb").read()
    env = {"KERNELGATE_DB": path, "KERNELGATE_LOG": "warning"}
    # An op call, doctor and a sweep all finish (a FIFO used to hang each of them).
    code = "import torch, kernelgate as kg; print(kg.rms_norm(torch.randn(2, 4)).shape)"
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    monkeypatch.setenv("KERNELGATE_DB", path)
    rc, out, _ = _run(capsys, "doctor")
    assert rc == 0 and "not usable" in out, out
    rc, _, err = _run(capsys, "validate", "rms_norm", "--backend", "reference", "--dtype", "float32", "--seeds", "1")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    if before is not None:
        assert open(path, "rb").read() == before
    assert not os.path.exists("/dev/null-journal") and not os.path.exists(path + "-journal")


# ---- the environment (item 5) --------------------------------------------------------------------------

def test_switches_with_any_bytes_never_raise():
    env = dict(os.environ)
    env_b = {k.encode(): v.encode() for k, v in env.items()}
    env_b[b"KERNELGATE_DB"] = os.path.join(tempfile.mkdtemp(), "\udcff").encode("utf-8", "surrogateescape")
    env_b[b"KERNELGATE_FORCE"] = b"rms_norm=\xff\xfe"
    env_b[b"KERNELGATE_EXCLUDE"] = b"reference"
    code = ("import logging, torch, kernelgate as kg\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "print(kg.rms_norm(torch.randn(2, 4)).shape)\n")
    p = subprocess.run([sys.executable, "-c", code], env=env_b, capture_output=True, timeout=60)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert "KERNELGATE_FORCE" in err and "\\xff" in err  # one warning, the bytes shown
    assert "the reference cannot be excluded" in err


# ---- the command line (items 6, 9) ----------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--seeds", "0"], "--seeds: must be between 1 and 2147483647"),
    (["--seeds", "-3"], "--seeds: must be between 1"),
    (["--seeds", str(2**31)], "--seeds: must be between 1"),
    (["--case-timeout", "0"], "--case-timeout: must be a finite number of seconds > 0"),
    (["--case-timeout", "nan"], "--case-timeout: must be a finite"),
    (["--case-timeout", "inf"], "--case-timeout: must be a finite"),
    (["--time-cap", "-1"], "--time-cap: must be a finite number of seconds >= 0"),
    (["--shard", "2/2"], "--shard: must be i/N with 0 <= i < N"),
    (["--shard", f"0/{2**31}"], "--shard: must be i/N with 0 <= i < N"),
])
def test_numeric_arguments_are_checked_and_nothing_is_stored(tmp_path, capsys, args, message):
    db = str(tmp_path / "x.sqlite")
    rc, _, err = _run(capsys, "validate", "rms_norm", "--db", db, *args)
    assert rc == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(db)


@pytest.mark.parametrize("args,message", [
    (["cross_entropy", "--shape", "logits=8x100"], None),
    (["linear_cross_entropy", "--shape", "hidden=8x64", "--shape", "weight=100x64", "--grad"], None),
    (["rms_norm", "--shape", "x=100000000000x4096"], None),  # meta tensors: nothing allocated
    (["rms_norm", "--shape", "x="], "invalid call: rms_norm: x must have at least 1 dim, got 0"),
    (["rms_norm", "--shape", "x=8x0"], "invalid call: rms_norm: x.size(-1) (hidden) must be at least 1"),
    (["rope", "--shape", "q=1x2x3x5", "--shape", "k=1x1x3x5", "--shape", "cos=1x3x5"],
     "invalid call: rope: head_dim (q.size(-1)) must be a positive even number"),
    (["rms_norm", "--shape", "x=8x64", "--shape", "weight=65"], "invalid call: rms_norm: weight.size(-1) must be 64"),
    (["rms_norm", "--shape", "x=-1x4"], "--shape x: every dim must be in [0, 2^62)"),
    (["rms_norm", "--shape", "x=8xq"], "dims must be integers"),
])
def test_explain_answers_without_tracebacks(capsys, args, message):
    rc, out, err = _run(capsys, "explain", *args, "--device", "cpu")
    text = out + err
    assert "Traceback" not in text, text
    if message is None:
        assert rc == 0 and "->" in out, text
    else:
        assert rc == 1 and message in text, text


def test_cuda_device_requested_where_there_is_none(capsys):
    if torch.cuda.is_available():  # on a GPU machine: a device it does not have
        device, message = f"cuda:{torch.cuda.device_count()}", "CUDA device(s)"
    else:
        device, message = "cuda", "no CUDA device is visible here"
    for cmd in (["explain", "rms_norm", "--shape", "x=8x64", "--device", device], ["demo", "--device", device]):
        rc, _, err = _run(capsys, *cmd)
        assert rc == 1 and message in err and "Traceback" not in err, err


# ---- every region sees every value regime (item 3) ------------------------------------------------

REGIMES = {"normal", "small", "special", "large", "offset"}


def _fields(encoded):
    """A case's fields (the worker protocol: key=value;..., values percent-escaped)."""
    from urllib.parse import unquote

    return {k: unquote(v) for k, v in (f.split("=", 1) for f in encoded.split(";"))}


@pytest.mark.parametrize("grid", ["smoke", "quick"])
def test_every_group_of_cases_is_tried_in_every_regime(grid):
    from kernelgate import _C

    for info in kg.ops():
        groups, seen = {}, {name: set() for name in info["scalar_test_values"]}
        for _, encoded in _C.make_cases(info["name"], grid, [], 1, 1 << 20):
            f = _fields(encoded)
            key = (f["dims"], f["dtype"], f["layout"], f["strings"], f["optional"], f["grad"])
            groups.setdefault(key, set()).add(f["regime"])
            for pair in filter(None, f["scalars"].split(",")):
                name, value = pair.split("=")
                seen[name].add(float(value))
        assert groups
        for key, regimes in groups.items():
            assert regimes == REGIMES, (info["name"], grid, key, regimes)
        # Every test value of every scalar argument is tried.
        for name, values in info["scalar_test_values"].items():
            assert set(values) <= seen[name], (info["name"], name, values, seen[name])


@pytest.fixture(scope="module")
def faulty_policy(tmp_path_factory):
    """A smoke sweep of the faulty test backends that answer (no crash, no hang): the policy it gives."""
    from test_evidence import plugin_path

    db = str(tmp_path_factory.mktemp("faulty") / "f.sqlite")
    backends = ["reference", "faulty_ignores_eps", "faulty_nan_to_zero", "faulty_stale_buffer",
                "faulty_skips_last_row", "faulty_partial_write", "faulty_assumes_contiguous"]
    args = ["bench", "run", "rms_norm", "--grid", "smoke", "--time-cap", "0.01", "--dtype", "float32",
            "--seeds", "1", "--load", plugin_path(), "--db", db, "--json"]
    for b in backends:
        args += ["--backend", b]
    assert cli.main(args) == 0
    from kernelgate import _C

    return _C.policy_regions("rms_norm", db, [])["regions"]


def test_faulty_backends_are_ranked_in_no_region_they_are_wrong_in(faulty_policy):
    """Each faulty backend is wrong on every input of some kind; it must be ranked in no region
    that holds such an input (every region holds every regime)."""
    assert faulty_policy
    for region in faulty_policy:
        key = region["region"]
        rows_zero = "rows=0" in key
        ranked = set(region["ranked"])
        assert "reference" in ranked or rows_zero, region
        if rows_zero:
            continue  # nothing to compute: every backend is right
        wrong_everywhere = {"faulty_ignores_eps", "faulty_nan_to_zero", "faulty_stale_buffer",
                            "faulty_skips_last_row"}
        if "hidden<=2^0" not in key:
            wrong_everywhere.add("faulty_partial_write")  # it skips the second half of each row
        if " strided " in key:
            wrong_everywhere.add("faulty_assumes_contiguous")
        assert not ranked & wrong_everywhere, (key, ranked & wrong_everywhere)


# ---- a run that measured nothing stores nothing (item 6) -----------------------------------------

def test_a_sweep_that_measures_nothing_writes_no_run(tmp_path, capsys):
    import sqlite3

    db = str(tmp_path / "resumed.sqlite")
    args = ["validate", "rms_norm", "--backend", "reference", "--dtype", "float32",
            "--shard", "0/20", "--db", db]
    assert _run(capsys, *args)[0] == 0
    count = lambda: sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone()[0]  # noqa: E731
    assert count() == 1
    assert _run(capsys, *args)[0] == 0  # everything resumed: nothing measured
    assert count() == 1


# ---- interrupting a sweep (item 7) -------------------------------------------------------------

def _workers_of(pid):
    """The pids of live workers a sweep process started (they carry its pid in their environment)."""
    mark = f"KERNELGATE_WORKER_PARENT={pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if mark in env and _state(int(entry)) not in ("Z", "gone"):
            found.append(int(entry))
    return found


def _start_hanging_sweep(db):
    """A sweep whose case hangs (case timeout 60 s), once its worker is running the case."""
    import signal

    from test_evidence import plugin_path

    # Ctrl-C's default disposition in the sweep, whatever this run inherited: a test runner
    # started as a background job of a non-interactive shell ignores SIGINT, and so would its
    # children.
    p = subprocess.Popen([sys.executable, "-m", "kernelgate.cli", "bench", "run", "rms_norm", "--grid",
                          "smoke", "--load", plugin_path(), "--backend", "reference", "--backend",
                          "faulty_hangs", "--dtype", "float32", "--shard", "0/20", "--case-timeout", "60",
                          "--db", db], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _workers_of(p.pid):
        time.sleep(0.1)
    assert _workers_of(p.pid), "the sweep started no worker"
    time.sleep(3)  # the reference's first cases are stored, the hanging one is running
    return p


def _gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_ctrl_c_stops_a_sweep_promptly_keeping_what_it_stored(tmp_path):
    import signal
    import sqlite3

    db = str(tmp_path / "interrupted.sqlite")
    p = _start_hanging_sweep(db)
    workers = _workers_of(p.pid)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < 5, "the sweep did not stop promptly"
    assert p.returncode == 130, err.decode()
    assert "interrupted" in err.decode() and "Traceback" not in err.decode(), err.decode()
    assert _gone(workers), "a worker outlived the interrupted sweep"
    rows = sqlite3.connect(db).execute("SELECT backend, disposition FROM results").fetchall()
    assert rows and all(d != "timed_out" for _, d in rows), rows  # kept; the run in flight not stored


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_workers_die_with_their_sweep(tmp_path, sig):
    import signal

    p = _start_hanging_sweep(str(tmp_path / "killed.sqlite"))
    workers = _workers_of(p.pid)
    p.send_signal(getattr(signal, sig))
    p.communicate(timeout=30)
    assert _gone(workers), f"a worker outlived its sweep after {sig}"


# ---- an unusable store is said, not silent (item 8) ----------------------------------------------

@pytest.mark.parametrize("what", ["corrupt", "foreign", "newer", "directory"])
def test_an_unusable_store_is_warned_once_and_explained(tmp_path, what):
    import sqlite3

    path = tmp_path / "store.sqlite"
    if what == "corrupt":
        path.write_bytes(b"SQLite format 3\0" + os.urandom(4096))
    elif what == "foreign":
        sqlite3.connect(path).execute("CREATE TABLE users (id INTEGER)").connection.commit()
    elif what == "newer":
        assert cli.main(["validate", "rms_norm", "--shard", "0/50", "--backend", "reference",
                         "--dtype", "float32", "--db", str(path)]) == 0
        c = sqlite3.connect(path)
        c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        c.commit()
        c.close()
    else:
        path.mkdir()
    before = sorted(os.listdir(tmp_path)), (path.read_bytes() if path.is_file() else b"")
    script = (
        "import logging, torch, kernelgate as kg\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "x, w = torch.randn(4, 8), torch.ones(8)\n"
        "kg.rms_norm(x, w); kg.rms_norm(x, w); kg.layer_norm(x, w, w)\n"
        "print(kg.explain('rms_norm', x, w))\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KERNELGATE_DB=str(path)))
    assert p.returncode == 0, p.stderr
    warnings = [line for line in p.stderr.splitlines() if "store not used" in line]
    assert len(warnings) == 1 and str(path) in warnings[0], p.stderr  # once, naming the file
    assert "store not used" in p.stdout and str(path) in p.stdout, p.stdout  # explain says it too
    assert (sorted(os.listdir(tmp_path)), (path.read_bytes() if path.is_file() else b"")) == before


def test_a_missing_store_is_no_warning(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import torch, kernelgate as kg; kg.rms_norm(torch.randn(4, 8), None)"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KERNELGATE_DB=str(tmp_path / "none.sqlite")))
    assert p.returncode == 0 and "store not used" not in p.stderr, p.stderr


# ---- concurrent sweeps share the work (item 12) --------------------------------------------------

def test_concurrent_sweeps_of_the_same_work_run_each_case_once(tmp_path):
    import sqlite3

    db = str(tmp_path / "shared.sqlite")
    cmd = [sys.executable, "-m", "kernelgate.cli", "validate", "rms_norm", "--backend",
           "kernelgate_cpu", "--backend", "reference", "--dtype", "float32", "--shard", "0/4", "--db", db,
           "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE) for _ in range(2)]
    reports = [json.loads(p.communicate(timeout=300)[0])["rms_norm"] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    planned = reports[0]["planned"]
    assert planned and all(r["planned"] == planned for r in reports)
    ran = [sum(r["dispositions"].values()) for r in reports]
    assert sum(ran) == planned, (ran, planned)  # no case ran twice, none was left out
    rows = sqlite3.connect(db).execute("SELECT count(*), count(DISTINCT backend || case_id) FROM results").fetchone()
    assert rows == (planned, planned)
    assert sqlite3.connect(db).execute("SELECT count(*) FROM claims").fetchone()[0] == 0
