"""The optimization loop: a candidate backend is gated on the float64 oracle, probed for the ways a
kernel can look fast without being so, timed against the incumbent with the noise floor measured
in the same run, and kept only where it is faster by more than that floor.

A candidate is a Python file with the backend protocol of ``kg.register_backend``: ``forward``,
optionally ``backward`` and ``can_implement``; or a CUDA source with C entry points on raw
pointers (``kernelgate._loop_cuda``), built with nvcc at each try. Each try runs in its own worker process (a
candidate that crashes or hangs is a recorded result) on a snapshot of the file, so the history
holds every version tried. State lives in a directory (``--dir``, ``KERNELGATE_LOOP_DIR``, default
``.kernelgate/loop``), one folder per loop, written atomically.

Each try, in order; the first that fails decides it and nothing after it runs:
1. build: the file imports and defines ``forward``;
2. gate: cases drawn afresh from the op's grid (fresh value seeds every try; every layout, value
   regime and grad setting the grid has) through the harness's oracle check (forward and every
   gradient);
3. probes, on the gate's cases: inputs left unmodified; outputs that do not change after the call
   returns (work finished later, on another stream or thread); the right answer with every input
   inside a NaN-filled guard buffer (reads outside its tensors) and the guards untouched (writes
   outside them); the right answer after the inputs' values change in place (outputs served from a
   cache of earlier inputs, or stale memory left unwritten);
4. timing: the incumbent (A), the candidate (B) and the incumbent again (A') interleaved, each
   repetition on one of four value sets copied into the same tensors, its result checked against
   that set's oracle (both untimed); on CUDA the device time of the call's work (a sleep kernel
   holds the stream while the host enqueues it), the host's time recorded beside it;
   |log(A/A')| per case is the noise; a candidate whose fastest repetition takes under 0.8x the
   case's floor is impossible (a result computed before the call: a cache) and rejected. The floor
   is the longer of the fastest copy of the call's bytes and its matrix FLOPs (the reference's, by
   torch's flop counter) at the fastest matmul rate, all measured in the same run (fastest against
   fastest: noise only ever adds time, so an honest kernel's fastest run is not below it; the
   report's limit_us is the same bound from the medians);
5. decision: accepted when the geometric mean of B/A is below exp(-floor) and no case is above
   exp(+floor), where floor = max(NOISE_MIN, the largest A/A noise of the run). The first try
   that passes the gate and probes is the baseline (the first incumbent).

``compare`` times the incumbent against another backend of the op (the shipped kernel, say) by
the same protocol, on cases both pass.
"""

import argparse
import contextlib
import datetime
import difflib
import gc
import hashlib
import importlib.util
import json
import math
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

from .testing import case_fields, encode_case

NOISE_MIN = 0.02            # the floor never goes below 2%
IMPOSSIBLE = 0.8            # a fastest time under 0.8x the fastest copy of the call's bytes is rejected
GATE_CASES = 32
GATE_MAX_ELEMENTS = {"cpu": 1 << 14, "cuda": 1 << 22}
TIME_MAX_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 24}
TIME_CASES = 2
VALUE_SETS = 4
CANDIDATE, INCUMBENT = "loop_candidate", "loop_incumbent"


# ---- state -----------------------------------------------------------------------------------

def root_dir(path: Optional[str] = None) -> str:
    return os.path.abspath(path or os.environ.get("KERNELGATE_LOOP_DIR") or os.path.join(".kernelgate", "loop"))


def _loop_dir(root: str, name: str) -> str:
    if not name or not all(c.isalnum() or c in "_-." for c in name) or name.startswith("."):
        raise ValueError(f"loop name must be letters, digits, '_', '-' or '.', got {name!r}")
    return os.path.join(root, name)


def _write_json(path: str, data) -> None:
    """Atomically: a failure leaves the previous file whole."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _load(root: str, name: str) -> dict:
    path = os.path.join(_loop_dir(root, name), "state.json")
    if not os.path.exists(path):
        raise ValueError(f"no loop '{name}' in {root} (kernelgate loop start OP --name {name} --source FILE)")
    with open(path) as f:
        return json.load(f)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def start(op: str, name: str, source: str, device: str = "cpu", dtypes: Sequence[str] = ("float32",),
          time_shapes: Optional[List[Dict[str, int]]] = None, root: Optional[str] = None) -> dict:
    """Registers a loop: an op, a candidate file, the device and dtypes it is gated and timed on,
    and the shapes it is timed at (the op's named dims; default: the grid's largest cases)."""
    import kernelgate as kg

    root = root_dir(root)
    info = next((o for o in kg.ops() if o["name"] == op), None)
    if info is None:
        raise ValueError(f"unknown op '{op}'; kernelgate has: {', '.join(o['name'] for o in kg.ops())}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    bad = [d for d in dtypes if d not in info["dtypes"]]
    if not dtypes or bad:
        raise ValueError(f"dtypes: {op} takes {', '.join(info['dtypes'])}, got {', '.join(dtypes) or 'none'}")
    for dims in time_shapes or []:
        if (not isinstance(dims, dict) or not dims or any(d not in info["named_dims"] for d in dims)
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in dims.values())):
            raise ValueError(f"time_shapes: each a dict of {op}'s dims ({', '.join(info['named_dims'])}) "
                             f"to positive ints, got {dims!r}")
    source = os.path.abspath(source)
    if not os.path.isfile(source):
        raise ValueError(f"source: no file {source}")
    if os.path.splitext(source)[1] not in (".py", ".cu"):
        raise ValueError(f"source: a .py file (a Python backend) or a .cu file (CUDA entry points), got {source}")
    if source.endswith(".cu") and device != "cuda":
        raise ValueError("source: a .cu candidate runs on device cuda")
    d = _loop_dir(root, name)
    if os.path.exists(os.path.join(d, "state.json")):
        raise ValueError(f"loop '{name}' exists in {root}; choose another name")
    state = {"op": op, "name": name, "source": source, "device": device, "dtypes": list(dtypes),
             "time_shapes": list(time_shapes or []), "created": _now(), "incumbent": None, "tries": []}
    _write_json(os.path.join(d, "state.json"), state)
    return state


def status(name: str, root: Optional[str] = None) -> dict:
    s = _load(root_dir(root), name)
    counts: Dict[str, int] = {}
    for t in s["tries"]:
        counts[t["disposition"]] = counts.get(t["disposition"], 0) + 1
    return {"op": s["op"], "name": name, "source": s["source"], "device": s["device"], "dtypes": s["dtypes"],
            "tries": len(s["tries"]), "dispositions": counts, "incumbent": s["incumbent"],
            "comparisons": len(s.get("comparisons", []))}


def log(name: str, root: Optional[str] = None) -> List[dict]:
    return _load(root_dir(root), name)["tries"]


def revert(name: str, root: Optional[str] = None) -> dict:
    """Writes the incumbent's source back over the candidate file; the file's current text is
    kept first (as tries/reverted-<time>.py), so nothing is lost."""
    root = root_dir(root)
    s = _load(root, name)
    if s["incumbent"] is None:
        raise ValueError(f"loop '{name}' has no incumbent yet: no try has passed")
    d = _loop_dir(root, name)
    kept = None
    if os.path.exists(s["source"]):
        kept = os.path.join(d, "tries", f"reverted-{datetime.datetime.now().strftime('%Y%m%dT%H%M%S%f')}.py")
        shutil.copyfile(s["source"], kept)
    shutil.copyfile(os.path.join(d, s["incumbent"]["snapshot"]), s["source"])
    return {"name": name, "restored_try": s["incumbent"]["try"], "kept": kept}


def compare(name: str, against: str, root: Optional[str] = None, timeout: float = 900.0) -> dict:
    """Times the incumbent against another backend of the op (e.g. the shipped kernel) as a try
    times it against the incumbent; recorded in the loop's state under comparisons."""
    root = root_dir(root)
    s = _load(root, name)
    if s["incumbent"] is None:
        raise ValueError(f"loop '{name}' has no incumbent yet: no try has passed")
    d = _loop_dir(root, name)
    with _locked(d):
        spec = {"op": s["op"], "device": s["device"], "dtypes": s["dtypes"], "seed": secrets.randbits(31),
                "time_shapes": s.get("time_shapes", []), "candidate": os.path.join(d, s["incumbent"]["snapshot"]),
                "incumbent": None, "against": against, "build_dir": os.path.join(d, "builds", "compare")}
        entry = {"time": _now(), "incumbent_try": s["incumbent"]["try"], **_run_worker(spec, timeout)}
        s = _load(root, name)
        s.setdefault("comparisons", []).append(entry)
        _write_json(os.path.join(d, "state.json"), s)
    return entry


def _diff(old: str, new: str) -> dict:
    lines = list(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "incumbent", "candidate", n=1))
    return {"text": "".join(lines), "hunks": sum(1 for ln in lines if ln.startswith("@@"))}


@contextlib.contextmanager
def _locked(d: str):
    """One try of a loop at a time (another process waits)."""
    import fcntl

    with open(os.path.join(d, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def try_(name: str, root: Optional[str] = None, timeout: float = 900.0) -> dict:
    """One try of the candidate file as it is now; returns the recorded entry."""
    root = root_dir(root)
    _load(root, name)
    with _locked(_loop_dir(root, name)):
        return _try_locked(name, root, timeout)


def _try_locked(name: str, root: str, timeout: float) -> dict:
    s = _load(root, name)
    d = _loop_dir(root, name)
    with open(s["source"], encoding="utf-8") as f:
        text = f.read()
    n = len(s["tries"]) + 1
    snapshot = os.path.join("tries", f"{n:04d}{os.path.splitext(s['source'])[1]}")
    os.makedirs(os.path.join(d, "tries"), exist_ok=True)
    with open(os.path.join(d, snapshot), "w", encoding="utf-8") as f:
        f.write(text)
    inc = s["incumbent"]
    spec = {"op": s["op"], "device": s["device"], "dtypes": s["dtypes"], "seed": secrets.randbits(31),
            "time_shapes": s.get("time_shapes", []),
            "candidate": os.path.join(d, snapshot),
            "incumbent": None if inc is None else os.path.join(d, inc["snapshot"]),
            "build_dir": os.path.join(d, "builds", f"{n:04d}")}
    result = _run_worker(spec, timeout)
    entry = {"try": n, "time": _now(), "snapshot": snapshot, "sha256": hashlib.sha256(text.encode()).hexdigest(),
             "seed": spec["seed"], **result}
    if inc is not None:
        with open(os.path.join(d, inc["snapshot"]), encoding="utf-8") as f:
            entry["diff"] = _diff(f.read(), text)
    if entry["disposition"] in ("accepted", "baseline"):
        s["incumbent"] = {"try": n, "snapshot": snapshot, "sha256": entry["sha256"],
                          "times_us": entry.get("timing", {}).get("candidate_us")}
    s["tries"].append(entry)
    _write_json(os.path.join(d, "state.json"), s)
    return entry


def _run_worker(spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kg-loop-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        spec["out"] = out_path
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        if spec["device"] == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the harness runs cases on a GPU where it sees one
        start_t = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "kernelgate.loop", "--worker", spec_path],
                               capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"disposition": "hung", "reason": f"the try did not finish in {timeout:g} s"}
        seconds = round(time.monotonic() - start_t, 2)
        if os.path.exists(out_path):
            with open(out_path) as f:
                return {**json.load(f), "seconds": seconds}
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-8:]
        return {"disposition": "crashed", "seconds": seconds,
                "reason": f"the worker exited with status {p.returncode} before a result: " + " | ".join(tail)}


# ---- the worker ------------------------------------------------------------------------------

class Rejected(Exception):
    def __init__(self, disposition: str, reason: str, **extra):
        super().__init__(reason)
        self.disposition, self.reason, self.extra = disposition, reason, extra


def _load_module(path: str, tag: str):
    spec = importlib.util.spec_from_file_location(f"kernelgate_loop_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "forward", None)):
        raise AttributeError(f"{os.path.basename(path)} defines no function 'forward'")
    return module


def _functions(kg, op: str, name: str, path: str, build_dir: str) -> tuple:
    """(forward, backward, can_implement, grad_request) of a candidate file: a Python module's, or
    a .cu file's entry points built with nvcc (a compiler error is the build's result)."""
    if path.endswith(".cu"):
        from . import _loop_cuda

        info = next(o for o in kg.ops() if o["name"] == op)
        try:
            lib = _loop_cuda.build(path, os.path.join(build_dir, name))
        except RuntimeError as exc:
            raise Rejected("build_error", str(exc))
        return (*_loop_cuda.wrap(info, lib), None, True)
    m = _load_module(path, name)
    return m.forward, getattr(m, "backward", None), getattr(m, "can_implement", None), False


def _register(kg, op: str, name: str, path: str, device: str, build_dir: str) -> None:
    import traceback

    try:
        fwd, bwd, can, grad_request = _functions(kg, op, name, path, build_dir)
        kg.register_backend(op, name, fwd, bwd, can_implement=can, device=device, grad_request=grad_request)
    except Rejected:
        raise
    except Exception:  # noqa: BLE001 -- the candidate's error is the result, with its traceback
        raise Rejected("build_error", traceback.format_exc(limit=6).strip())


def _gate_cases(_C, op: str, device: str, dtypes: List[str], rng: random.Random) -> List[tuple]:
    """One case of each (layout, regime, grad) the grid has, then random ones, fresh seeds."""
    made = _C.make_cases(op, "quick", dtypes=dtypes, max_elements=GATE_MAX_ELEMENTS[device])
    buckets: Dict[tuple, list] = {}
    for cid, enc in made:
        parts = cid.split("/")
        buckets.setdefault((parts[3], parts[4], parts[-2], parts[2]), []).append((cid, enc))
    chosen = [rng.choice(b) for b in buckets.values()]
    rest = [c for c in made if c not in chosen]
    chosen += rng.sample(rest, min(len(rest), max(0, GATE_CASES - len(chosen))))
    return [_reseed(cid, enc, rng.randrange(1, 2 ** 31 - 1)) for cid, enc in chosen]


def _reseed(cid: str, enc: str, seed: int) -> tuple:
    return cid.rsplit("/seed=", 1)[0] + f"/seed={seed}", encode_case({**case_fields(enc), "seed": str(seed)})


class _Case:
    """A case's calls: the candidate or the incumbent forced, the reference, float64 oracle."""

    def __init__(self, kg, _C, op: str, enc: str, device: str):
        self.kg, self._C, self.op, self.enc, self.device = kg, _C, op, enc, device
        self.grad = case_fields(enc)["grad"] == "1"
        self.reference = getattr(torch.ops.kernelgate, f"_{op}_reference")

    def args(self, float64=False, enc=None):
        args, leaves = self._C.case_arguments(enc or self.enc, on_gpu=self.device == "cuda", float64=float64)
        return list(args), [leaf for leaf in leaves if leaf is not None]

    def run(self, backend: Optional[str], args, leaves, cots=None):
        """Outputs, then gradients of the outputs that need one (cotangents `cots`): of the
        reference (backend None) or of `backend`, forced."""
        if backend is None:
            return self.call(self.reference, args, leaves, cots)
        with self.kg.use(force={self.op: backend}):
            return self.call(getattr(self.kg, self.op), args, leaves, cots)

    def call(self, fn, args, leaves, cots=None):
        outs = fn(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if not (self.grad and leaves):
            return outs, cots
        used = [o for o in outs if o.requires_grad]
        if cots is None:
            gen = torch.Generator().manual_seed(1)
            cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in used]
        cs = [c.to(o.device, o.dtype) for c, o in zip(cots, used)]
        grads = torch.autograd.grad(used, leaves, cs, allow_unused=True, materialize_grads=True)
        return outs + list(grads), cots

    def placed(self, cots, args):
        """The cotangents on the outputs' devices and dtypes, made once and untimed: a timed call
        would otherwise copy them from the host (for a 16384 x 4096 output, 35 ms of PCIe
        transfer hiding a kernel of 0.2 ms)."""
        if cots is None:
            return None
        outs = self.reference(*args)
        used = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if o.requires_grad]
        return [c.to(o.device, o.dtype) for c, o in zip(cots, used)]

    def expected(self, enc=None):
        """(reference at the dtype, oracle) results, and the cotangents."""
        ref, cots = self.run(None, *self.args(enc=enc))
        ora, _ = self.run(None, *self.args(True, enc), cots=cots)
        return [r.detach() for r in ref], [o.detach() for o in ora], cots

    def failure(self, got, ref, ora) -> str:
        from .testing import oracle_metrics

        for i, (g, r, o) in enumerate(zip(got, ref, ora)):
            f = oracle_metrics(f"tensor {i}", g.detach(), r, o, r.dtype)["failure"]
            if f:
                return f
        return ""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _same(a, b) -> bool:
    """Bitwise equal (NaN included)."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return (a.shape == b.shape and a.dtype == b.dtype
            and bool((a.view(-1).view(torch.uint8) == b.view(-1).view(torch.uint8)).all()))


def _probes(case: _Case, cid: str) -> None:
    from .testing import poison_cuda_allocator

    dev = torch.device(case.device)
    # Inputs unmodified, outputs final at return.
    args, leaves = case.args()
    before = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref, ora, cots = case.expected()
    got, _ = case.run(CANDIDATE, args, leaves, cots)
    snap = [g.detach().clone() for g in got]  # stream-ordered, before any sync
    _sync(case.device)
    time.sleep(0.05)
    names = next(o for o in case.kg.ops() if o["name"] == case.op)["tensor_args"]
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and not _same(a, b):
            raise Rejected("cheat", f"{cid}: it modifies its input {names[i] if i < len(names) else i}")
    for i, (g, s) in enumerate(zip(got, snap)):
        if not _same(g, s):
            raise Rejected("cheat", f"{cid}: tensor {i} changed after the call returned (work finished "
                                    "outside the call, on another stream or thread)")
    f = case.failure(snap, ref, ora)
    if f:
        raise Rejected("incorrect", f"{cid}: {f}")

    # Inside NaN guards: reads and writes outside its tensors.
    args, leaves = case.args()
    guarded, guards = [], []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.is_contiguous() and a.numel():
            pad = 64
            buf = torch.full((a.numel() + 2 * pad,), float("nan"), dtype=a.dtype, device=a.device)
            view = buf[pad:pad + a.numel()].view(a.shape)
            with torch.no_grad():
                view.copy_(a)
            view.requires_grad_(a.requires_grad)
            guarded.append(view)
            guards.append((buf, pad, a.numel()))
        else:
            guarded.append(a)
    leaves_g = [g for g, a in zip(guarded, args) if isinstance(a, torch.Tensor) and any(a is lf for lf in leaves)]
    got, _ = case.run(CANDIDATE, guarded, leaves_g, cots)
    _sync(case.device)
    f = case.failure(got, ref, ora)
    if f:
        raise Rejected("cheat", f"{cid}: with its inputs inside NaN-filled buffers: {f} (it reads outside "
                                "its tensors)")
    for buf, pad, n in guards:
        if not (buf[:pad].isnan().all() and buf[pad + n:].isnan().all()):
            raise Rejected("cheat", f"{cid}: it writes outside its input tensors")

    # New values in the same tensors: no output from an earlier call.
    args, leaves = case.args()
    got, _ = case.run(CANDIDATE, args, leaves, cots)
    del got
    other = _reseed(cid, case.enc, int(case_fields(case.enc)["seed"]) + 1)[1]
    _refill(args, case.args(enc=other)[0])
    poison_cuda_allocator(dev)
    ref2, ora2, _ = case.expected(enc=other)
    got, _ = case.run(CANDIDATE, args, leaves, cots)
    _sync(case.device)
    f = case.failure(got, ref2, ora2)
    if f:
        raise Rejected("cheat", f"{cid}: after its inputs' values changed in place: {f} (an output of an "
                                "earlier call, from a cache or memory left unwritten)")


def _refill(args, values) -> None:
    """New values into the same tensors (their data pointers unchanged)."""
    with torch.no_grad():
        for a, v in zip(args, values):
            if isinstance(a, torch.Tensor):
                a.copy_(v)


class _Timer:
    """Times calls. On CUDA, a call's device time: a sleep kernel queued ahead of the start event
    holds the stream while the host enqueues the call, so the events bracket the GPU's work and
    not the host's launch path (a Python backend's host time would otherwise hide its kernel's
    speed); the host's own time for the call is recorded apart. The sleep lasts twice the slowest
    host time seen, 50 us at least, 20 ms at most. On the CPU, wall time, which is both."""

    def __init__(self, device: str):
        self.device = device
        self.slowest_host_us = 0.0
        self.cycles_per_us = 0.0

    def _hold_stream(self) -> None:
        if not self.cycles_per_us:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(2):  # the second, warm
                a.record()
                torch.cuda._sleep(1_000_000)
                b.record()
                b.synchronize()
            self.cycles_per_us = 1_000_000 / max(a.elapsed_time(b) * 1e3, 1.0)
        us = min(20_000.0, max(50.0, 2.0 * self.slowest_host_us))
        torch.cuda._sleep(int(us * self.cycles_per_us))

    @contextlib.contextmanager
    def __call__(self, out: list, host: Optional[list] = None):
        if self.device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._hold_stream()
            a.record()
            t = time.perf_counter_ns()
            yield
            host_us = (time.perf_counter_ns() - t) / 1e3
            b.record()
            b.synchronize()
            self.slowest_host_us = max(self.slowest_host_us, host_us)
            out.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter_ns()
            yield
            host_us = (time.perf_counter_ns() - t) / 1e3
            out.append(host_us)
        if host is not None:
            host.append(host_us)


def _median(xs) -> float:
    """The upper median (the middle sample, no averaging)."""
    return sorted(xs)[len(xs) // 2]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _copy_us(device: str, nbytes: int, timer: _Timer) -> tuple:
    """(median, fastest) time of copying nbytes / 2 bytes (nbytes of traffic: read and write)."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ts: list = []
    for _ in range(15):
        with timer(ts):
            dst.copy_(src)
    return _median(ts), min(ts)


def _matmul_rate(device: str, dtype: torch.dtype, timer: _Timer) -> tuple:
    """FLOP/s of a square matrix product in `dtype` on `device` (torch's own: cuBLAS on CUDA): of
    the median and of the fastest repetition."""
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ts: list = []
    for _ in range(8):
        with timer(ts):
            torch.mm(a, b)
    return 2 * n ** 3 / (_median(ts) * 1e-6), 2 * n ** 3 / (min(ts) * 1e-6)


def _matrix_flops(case: "_Case") -> int:
    """The FLOPs of the matrix products, convolutions and attention in the reference's call,
    forward and, with gradients, backward (torch's flop counter; an op whose reference is one
    opaque kernel counts none, and only the bytes bound its time)."""
    from torch.utils.flop_counter import FlopCounterMode

    args, leaves = case.args()
    with FlopCounterMode(display=False) as counter:
        case.run(None, args, leaves)
    return int(counter.get_total_flops())


def _time_case(case: _Case, cid: str, backends: Dict[str, str], timer: _Timer, seed: int, budget_s: float) -> dict:
    """Interleaved repetitions of each backend (label -> backend name: a label's twin may name the
    same backend, for the A/A noise), each on one of VALUE_SETS value sets copied into the same
    tensors (untimed) and its result checked against that set's oracle (untimed)."""
    args, leaves = case.args()
    sets = []
    for k in range(VALUE_SETS):
        enc = _reseed(cid, case.enc, seed + k)[1]
        values, _ = case.args(enc=enc)
        sets.append((values, *case.expected(enc=enc)))
    cots = case.placed(sets[0][3], args)
    labels = list(backends)
    times: Dict[str, list] = {b: [] for b in labels}
    host: Dict[str, list] = {b: [] for b in labels}
    op_fn = getattr(case.kg, case.op)
    traffic = 0
    start_t, rounds = time.monotonic(), 0
    while rounds < 3 * VALUE_SETS + 1 or (time.monotonic() - start_t < budget_s and rounds < 60):
        for i, b in enumerate(labels):
            values, ref, ora, _ = sets[(rounds + i) % VALUE_SETS]
            _refill(args, values)
            _sync(case.device)
            with case.kg.use(force={case.op: backends[b]}):  # entered untimed
                gc.disable()  # a collection inside the timed call is not the call's (as timeit)
                try:
                    with timer(times[b], host[b]):
                        got, _ = case.call(op_fn, args, leaves, cots)
                finally:
                    gc.enable()
            f = case.failure(got, ref, ora)
            if f:
                raise Rejected("cheat" if b == CANDIDATE else "incorrect",
                               f"{cid}: while timed, on a fresh set of values: {f}"
                               + (f" ({backends[b]})" if b != CANDIDATE else ""))
            traffic = max(traffic, _nbytes(args) + _nbytes(cots or []) + _nbytes(got))
            del got
        rounds += 1
    copy_us, copy_fastest_us = _copy_us(case.device, traffic, timer)
    return {"case": cid, "median_us": {b: _median(t) for b, t in times.items()},
            "fastest_us": {b: min(t) for b, t in times.items()},
            "host_median_us": {b: _median(t) for b, t in host.items()},
            "reps": rounds, "bytes": traffic, "copy_us": copy_us, "copy_fastest_us": copy_fastest_us,
            "matrix_flops": _matrix_flops(case)}


def _limits(per_case: List[dict], device: str, dtype: torch.dtype, timer: _Timer) -> None:
    """Each case's limit_us: the longer of copying its bytes and its matrix FLOPs at the measured
    matmul rate (medians); floor_us: the same of the fastest copy and the fastest matmul."""
    rate, fastest = _matmul_rate(device, dtype, timer) if any(c["matrix_flops"] for c in per_case) else (0.0, 0.0)
    for c in per_case:
        c["flop_us"] = c["matrix_flops"] / rate * 1e6 if rate else 0.0
        c["flop_fastest_us"] = c["matrix_flops"] / fastest * 1e6 if fastest else 0.0
        c["limit_us"] = max(c["copy_us"], c["flop_us"])
        c["floor_us"] = max(c["copy_fastest_us"], c["flop_fastest_us"])


def _impossible(per_case: List[dict], label: str) -> None:
    for c in per_case:
        if c["fastest_us"][label] < IMPOSSIBLE * c["floor_us"]:
            bound = (f"the fastest copy of its {c['bytes']} bytes" if c["floor_us"] == c["copy_fastest_us"]
                     else f"its {c['matrix_flops']:.3g} matrix FLOPs at the fastest measured matmul rate")
            raise Rejected("cheat", f"{c['case']}: {c['fastest_us'][label]:.1f} us (its fastest repetition), under "
                                    f"{IMPOSSIBLE:g}x the {c['floor_us']:.1f} us that {bound} takes: impossible (an "
                                    "output computed before the timed call, e.g. from a cache)",
                           timing={"cases": per_case})


def worker(spec: dict) -> dict:
    import kernelgate as kg
    from kernelgate import _C

    op, device, rng = spec["op"], spec["device"], random.Random(spec["seed"])
    _register(kg, op, CANDIDATE, spec["candidate"], device, spec["build_dir"])
    if device == "cuda" and not torch.cuda.is_available():
        raise Rejected("error", "the loop's device is cuda and no CUDA device is visible (it built)")
    if spec.get("against"):
        return _compare(kg, _C, spec, rng)
    if spec["incumbent"]:
        _register(kg, op, INCUMBENT, spec["incumbent"], device, spec["build_dir"])

    gate = _gate_cases(_C, op, device, spec["dtypes"], rng)
    passed, unsupported, worst = [], 0, {"rel_l2": [], "max_over_rms": []}
    for cid, enc in gate:
        r = _C.run_case(enc, CANDIDATE)
        if r["disposition"] == "unsupported":
            unsupported += 1
            continue
        if r["disposition"] != "passed":
            raise Rejected("incorrect", f"{cid}: {r['disposition']}: {r['reason']}", gate_cases=len(gate))
        passed.append((cid, enc))
        worst["rel_l2"].append(r["max_rel_l2"])
        worst["max_over_rms"].append(r["max_max_over_rms"])
    if not passed:
        raise Rejected("incorrect", f"it implements none of the {len(gate)} gate cases", gate_cases=len(gate))
    # The probes refill tensors in place and guard them: dense (contiguous) cases.
    for cid, enc in [c for c in passed if "/contiguous/" in c[0]][:6]:
        _probes(_Case(kg, _C, op, enc, device), cid)
    errors = {k: {"median": _median(v), "max": max(v)} for k, v in worst.items()}

    timed = _timing_cases(_C, spec, rng, [CANDIDATE])
    # Each label's twin (_again) is built anew from its file: the A/A pair are two loads of one source.
    labels = [INCUMBENT, CANDIDATE, INCUMBENT + "_again"] if spec["incumbent"] else [CANDIDATE, CANDIDATE + "_again"]
    for b in labels:
        if b.endswith("_again"):
            first = b.removesuffix("_again")
            path = spec["candidate"] if first == CANDIDATE else spec["incumbent"]
            fwd, bwd, _, grad_request = _functions(kg, op, b, path, spec["build_dir"])
            kg.register_backend(op, b, fwd, bwd, device=device, grad_request=grad_request)
    timing = _measure(kg, _C, spec, rng, timed, {b: b for b in labels})
    floor, ratios, geo = timing["noise_floor"], timing["ratios"], timing["geomean"]
    common = {"gate_cases": len(gate), "gate_unsupported": unsupported, "errors": errors, "timing": timing}
    if not spec["incumbent"]:
        return {"disposition": "baseline", "reason": "the first try to pass: the incumbent", **common}
    if geo < math.exp(-floor) and max(ratios) < math.exp(floor):
        return {"disposition": "accepted", "reason": f"{1 / geo:.3f}x the incumbent (noise floor "
                                                     f"{floor * 100:.1f}%)", **common}
    if geo >= math.exp(-floor):
        why = (f"{geo:.3f}x the incumbent's time (geometric mean): not faster by more than the noise floor "
               f"of {floor * 100:.1f}%")
    else:
        why = (f"{1 / geo:.3f}x the incumbent, but a case takes {max(ratios):.3f}x its time, beyond the noise "
               f"floor of {floor * 100:.1f}%")
    return {"disposition": "rejected", "reason": why, **common}


def _timing_cases(_C, spec: dict, rng: random.Random, must_pass: List[str]) -> List[tuple]:
    """The loop's shapes, or the grid's largest contiguous cases of ordinary values: the first
    TIME_CASES that every backend of must_pass passes."""
    op, device = spec["op"], spec["device"]
    if spec["time_shapes"]:
        big = _shape_cases(op, spec["time_shapes"], spec["dtypes"][0])
    else:
        made = _C.make_cases(op, "quick", dtypes=spec["dtypes"], max_elements=TIME_MAX_ELEMENTS[device])
        big = [(cid, enc) for cid, enc in made if "/contiguous/normal/" in cid]
        big.sort(key=lambda c: -_case_elements(c[1]))
    timed = []
    for cid, enc in big:
        if len(timed) >= TIME_CASES:
            break
        cid, enc = _reseed(cid, enc, rng.randrange(1, 2 ** 31 - 1))
        if all(_C.run_case(enc, b)["disposition"] == "passed" for b in must_pass):
            timed.append((cid, enc))
    if not timed:
        raise Rejected("incorrect", f"{' and '.join(must_pass)} pass none of the timing cases")
    return timed


def _measure(kg, _C, spec: dict, rng: random.Random, timed: List[tuple], backends: Dict[str, str]) -> dict:
    """Times the cases: the first label is the base, the last its A/A twin, CANDIDATE the one judged."""
    device = spec["device"]
    timer = _Timer(device)
    per_case = [_time_case(_Case(kg, _C, spec["op"], enc, device), cid, backends, timer, rng.randrange(1, 2 ** 30),
                           budget_s=1.0) for cid, enc in timed]
    _limits(per_case, device, getattr(torch, spec["dtypes"][0]), timer)
    labels = list(backends)
    base, again = labels[0], labels[-1]
    noise = max(abs(math.log(c["median_us"][base] / c["median_us"][again])) for c in per_case)
    _impossible(per_case, CANDIDATE)
    ratios = [c["median_us"][CANDIDATE] / c["median_us"][base] for c in per_case]
    return {"cases": per_case, "noise_floor": max(NOISE_MIN, noise), "aa_noise": noise, "ratios": ratios,
            "geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
            "candidate_us": [c["median_us"][CANDIDATE] for c in per_case],
            "candidate_host_us": [c["host_median_us"][CANDIDATE] for c in per_case],
            "limit_fraction": [c["limit_us"] / c["median_us"][CANDIDATE] for c in per_case]}


def _compare(kg, _C, spec: dict, rng: random.Random) -> dict:
    """The incumbent (registered as the candidate) against another backend of the op, timed as a
    try is, on cases both pass."""
    against = spec["against"]
    names = [b["name"] for b in next(o for o in kg.ops() if o["name"] == spec["op"])["backends"]]
    if against not in names:
        raise Rejected("error", f"against: {spec['op']} has no backend '{against}' (it has {', '.join(names)})")
    timed = _timing_cases(_C, spec, rng, [CANDIDATE, against])
    timing = _measure(kg, _C, spec, rng, timed, {"against": against, CANDIDATE: CANDIDATE,
                                                 "against_again": against})
    return {"disposition": "compared", "against": against,
            "reason": f"the incumbent takes {timing['geomean']:.3f}x {against}'s time (geometric mean; A/A noise "
                      f"{timing['aa_noise'] * 100:.1f}%)", "timing": timing}


def _shape_cases(op: str, shapes: List[Dict[str, int]], dtype: str) -> List[tuple]:
    """Cases of the given dims (contiguous, ordinary values), with and without gradients."""
    out = []
    for dims in shapes:
        joined = ",".join(f"{d}={v}" for d, v in sorted(dims.items()))
        for grad in ("1", "0"):
            fields = {"op": op, "dims": joined, "dtype": dtype, "layout": "contiguous", "regime": "normal",
                      "scalars": "", "strings": "", "optional": "1", "grad": grad, "seed": "0"}
            cid = f"{op}/{joined}/{dtype}/contiguous/normal/{'grad' if grad == '1' else 'nograd'}/seed=0"
            out.append((cid, encode_case(fields)))
    return out


def _case_elements(enc: str) -> int:
    dims = [int(kv.split("=")[1]) for kv in case_fields(enc)["dims"].split(",") if kv]
    return math.prod(dims) if dims else 0


def _worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = worker(spec)
    except Rejected as r:
        result = {"disposition": r.disposition, "reason": r.reason, **r.extra}
    except Exception as exc:  # noqa: BLE001 -- anything else the candidate raised is its result
        import traceback

        result = {"disposition": "crashed", "reason": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=8)}
    _write_json(spec["out"], result)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kernelgate.loop")
    ap.add_argument("--worker", required=True)
    sys.exit(_worker_main(ap.parse_args().worker))
