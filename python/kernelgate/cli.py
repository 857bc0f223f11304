"""The `kernelgate` command: ops, validate, bench run, policy show, explain, db, doctor, demo.

Every command takes --json. The work is done in C++ (kernelgate._C); this is the shell around it.
"""

import argparse
import json
import math
import os
import shlex
import sys
from typing import Dict, List, Optional

import torch

import kernelgate as kg
from kernelgate import _C, plugins
from kernelgate.testing import check_against_oracle

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def cmd_ops(args) -> int:
    info = kg.ops()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for op in info:
        print(f"{op['schema']}\n  dims: {op['dims']}   dtypes: {', '.join(op['dtypes'])}")
        rows = [[b["name"], b["kind"], b["version"].split(";")[0], "yes" if b["available"] else "no", b["reason"]]
                for b in op["backends"]]
        print("  " + _table(rows, ["backend", "kind", "package", "available", "reason"]).replace("\n", "\n  "))
    rows = [[l["library"], f"kernelgate[{l['extra']}]", l["installed"] or "-", f">={l['tested'][0]},<{l['tested'][1]}",
             "yes" if l["available"] else "no", l["reason"]] for l in kg.backends.libraries()]
    print("libraries\n  " + _table(rows, ["library", "extra", "installed", "tested", "available", "reason"])
          .replace("\n", "\n  "))
    return 0


def _parse_shapes(specs: List[str]) -> Dict[str, List[int]]:
    shapes = {}
    for spec in specs:
        if "=" not in spec:
            raise SystemExit(f"kernelgate explain: --shape must be NAME=D0xD1x..., got '{spec}'")
        name, dims = spec.split("=", 1)
        try:
            shape = [int(d) for d in dims.split("x")] if dims else []
        except ValueError:
            raise SystemExit(f"kernelgate explain: --shape {name}: dims must be integers separated by 'x', "
                             f"got '{dims}'")
        if any(d < 0 or d >= 2**62 for d in shape):
            raise SystemExit(f"kernelgate explain: --shape {name}: every dim must be in [0, 2^62), got '{dims}'")
        shapes[name] = shape
    return shapes


def _tensors_for(op: dict, shapes: Dict[str, List[int]], dtype) -> List[Optional[torch.Tensor]]:
    """Meta tensors for each tensor argument (nothing is allocated): given shapes, or derived
    from the named dims. Index tensors (a dims entry ending in 'index') are int64."""
    specs, index = {}, set()
    for entry in op["dims"].split(";"):
        name, dims = entry.split(":", 1)
        name = name.strip().rstrip("?")
        specs[name] = [d.strip() for d in dims[dims.index("[") + 1 : dims.index("]")].split(",")]
        if dims.strip().endswith("index"):
            index.add(name)
    for name in shapes:
        if name not in specs:
            raise SystemExit(f"kernelgate explain: {op['name']} has no tensor argument '{name}'; "
                             f"it has {', '.join(specs)}")
    known: Dict[str, int] = {}
    for name, shape in shapes.items():
        fixed = [d for d in specs[name] if not d.startswith("*")]
        for d, size in zip(fixed[::-1], shape[::-1]):
            known[d] = size
    out = []
    for name in op["tensor_args"]:
        derivable = all(not d.startswith("*") and d in known for d in specs[name])
        if name in shapes:
            shape = shapes[name]
        elif derivable:
            shape = [known[d] for d in specs[name]]
        elif f"{name}?" in op["dims"]:
            out.append(None)
            continue
        else:
            raise SystemExit(f"kernelgate explain: give the shape of '{name}' with --shape {name}=...")
        out.append(torch.empty(shape, dtype=torch.int64 if name in index else dtype, device="meta"))
    return out


def _check_device(device: str, command: str) -> None:
    try:
        d = torch.device(device)
    except RuntimeError:
        raise SystemExit(f"kernelgate {command}: --device must be cpu or cuda[:N], got '{device}'")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"kernelgate {command}: --device {device}: no CUDA device is visible here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise SystemExit(f"kernelgate {command}: --device {device}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    if d.type not in ("cpu", "cuda"):
        raise SystemExit(f"kernelgate {command}: --device must be cpu or cuda[:N], got '{device}'")


def cmd_explain(args) -> int:
    op = next((o for o in kg.ops() if o["name"] == args.op), None)
    if op is None:
        raise SystemExit(f"kernelgate explain: unknown op '{args.op}'; kernelgate has: "
                         f"{', '.join(o['name'] for o in kg.ops())}")
    _check_device(args.device, "explain")
    tensors = _tensors_for(op, _parse_shapes(args.shape), DTYPES[args.dtype])
    with torch.set_grad_enabled(args.grad):
        for t in tensors:
            if t is not None and args.grad and t.is_floating_point():
                t.requires_grad_(True)
        e = kg.explain(args.op, *tensors, device=args.device)
    if args.json:
        print(json.dumps({"op": e.op, "key": e.key, "backend": e.backend, "reason": e.reason,
                          "valid": e.valid, "candidates": [c.__dict__ for c in e.candidates]}, indent=2))
    else:
        print(e)
    return 0 if e.valid else 1


# ---- the optimization loop --------------------------------------------------------------------

def _dims(text: str) -> Dict[str, int]:
    """rows=4096,hidden=1024 -> {"rows": 4096, "hidden": 1024}."""
    try:
        out = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be DIM=N[,DIM=N...], e.g. rows=4096,hidden=1024, got '{text}'")
    return out


def _try_line(t: dict) -> str:
    timing = t.get("timing") or {}
    speed = f"{1 / timing['geomean']:.3f}x" if timing.get("geomean") else ""
    floor = f"{timing['noise_floor'] * 100:.1f}%" if timing.get("noise_floor") else ""
    reason = " ".join(str(t.get("reason", "")).split())
    return f"{t['try']:>4}  {t['disposition']:<11} {speed:>7} {floor:>6}  {reason[:110]}"


def cmd_loop(args) -> int:
    from . import loop

    c = args.loop_command
    if c == "start":
        out = loop.start(args.op, args.name, args.source, args.device, args.dtype or ["float32"],
                         args.time_shape, root=args.dir)
        text = (f"loop '{out['name']}': {out['op']} on {out['device']} ({', '.join(out['dtypes'])}), "
                f"candidate {out['source']}; next: kernelgate loop try {out['name']}")
    elif c == "try":
        out = loop.try_(args.name, root=args.dir, timeout=args.timeout)
        text = "try  disposition speed  floor  reason\n" + _try_line(out)
    elif c == "status":
        out = loop.status(args.name, root=args.dir)
        inc = out["incumbent"]
        text = (f"loop '{out['name']}': {out['op']} on {out['device']}, {out['tries']} tries "
                f"({', '.join(f'{k} {v}' for k, v in sorted(out['dispositions'].items())) or 'none yet'}); "
                f"incumbent: {'try ' + str(inc['try']) if inc else 'none yet'}")
    elif c == "log":
        out = loop.log(args.name, root=args.dir)
        text = "\n".join(["try  disposition speed  floor  reason"] + [_try_line(t) for t in out])
    elif c == "compare":
        out = loop.compare(args.name, args.against, root=args.dir, timeout=args.timeout)
        rows = [[c["case"], f"{c['median_us']['against']:.1f}", f"{c['median_us'][loop.CANDIDATE]:.1f}",
                 f"{c['median_us'][loop.CANDIDATE] / c['median_us']['against']:.3f}"]
                for c in (out.get("timing") or {}).get("cases", [])]
        text = f"{out['disposition']}: {out['reason']}"
        if rows:
            text += "\n" + _table(rows, ["case", f"{args.against} us", "incumbent us", "ratio"])
    else:
        out = loop.revert(args.name, root=args.dir)
        text = f"restored try {out['restored_try']} into the candidate file; its previous text is in {out['kept']}"
    print(json.dumps(out, indent=1) if args.json else text)
    return 0


def cmd_report(args) -> int:
    from . import report

    ops = None if args.op == "all" else [args.op]
    stores = None if not args.db else args.db
    page = report.build(ops, stores)
    out = args.out or "kernelgate-report.html"
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    result = {"html": os.path.abspath(out)}
    if args.png:
        report.render_png(out, args.png)
        result["png"] = os.path.abspath(args.png)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


# ---- evidence: validate, bench run, policy show, db, doctor -------------------------------------

def _db(args) -> str:
    return args.db or kg.evidence.db_path()


def _progress(enabled: bool):
    if not enabled:
        return None
    tty = sys.stderr.isatty()
    state = {"last": -1}

    def report(done: int, total: int, what: str) -> None:
        width = 30
        filled = width * done // max(total, 1)
        pct = 100 * done // max(total, 1)
        if tty:
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:40]:<40}")
            if done == total:
                sys.stderr.write("\n")
        elif pct // 10 != state["last"]:
            state["last"] = pct // 10
            sys.stderr.write(f"{done}/{total} ({pct}%)\n")
        sys.stderr.flush()

    return report


def _load_plugins(items: List[str]) -> None:
    """Loads what --load names (libraries, Python modules or files) into this process, so that
    the ops and backends they register are known here too."""
    for item in items:
        try:
            plugins.load(item)
        except (RuntimeError, ImportError, OSError, SyntaxError) as exc:
            raise SystemExit(f"kernelgate: cannot load {item}: {exc}")
    if items:
        kg.evidence.install()


def _ops_for(name: str) -> List[str]:
    names = [o["name"] for o in kg.ops()]
    if name == "all":
        return names
    if name not in names:
        raise SystemExit(f"unknown op '{name}'; kernelgate has: {', '.join(names)}")
    return [name]


def _sweep_op(args, op: str, grid: str, time: bool, only=()) -> dict:
    infos = {o["name"]: o for o in kg.ops()}
    # Python backends and ops run in the Python worker; the others in kernelgate-worker.
    chosen = [b for b in infos[op]["backends"] if not args.backend or b["name"] in args.backend]
    python = (infos[op]["defined_in_python"] or any(b["kind"] == "python" and b["available"] for b in chosen)
              or any(plugins.needs_python_worker(p) for p in args.load))
    worker = kg.evidence.worker_argv(args.load, python)
    i, n = args.shard
    return _C.sweep(op, args.backend, args.dtype, grid, args.seeds, i, n, _db(args), time,
                    args.case_timeout, args.time_cap, worker,
                    "kernelgate " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                    _progress(not args.json), list(only))


def _rerank_op(args, op: str, lenders: List[str], only) -> dict:
    """The lender's runs (`only`, the op's rerank plan) may come from any grid: each grid in turn
    runs those of them it holds, until none is left."""
    total = {"planned": 0, "skipped": 0, "dispositions": {}, "worker_restarts": 0, "seconds": 0.0}
    for grid in ("full", "quick", "smoke"):
        if not only:
            break
        r = _sweep_op(args, op, grid, True, only)
        for k in ("planned", "skipped", "worker_restarts", "seconds"):
            total[k] += r[k]
        for k, v in r["dispositions"].items():
            total["dispositions"][k] = total["dispositions"].get(k, 0) + v
        total["fingerprint_id"] = r["fingerprint_id"]
        only = _C.rerank_plan(op, _db(args), lenders)  # what this grid did not hold
    total["not_found"] = len(only)  # runs no grid makes here
    return total


def _dispositions(counts: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing new"


def _run_on_gpus(args, grid: str) -> int:
    from . import sweeps

    try:
        gpus = sweeps.resolve_gpus(args.gpus)
        if args.command == "validate":
            command = ["validate", args.op] + (["--quick"] if args.quick else [])
        else:
            command = ["bench", "run", args.op, "--grid", grid]
        i, n = args.shard
        out = sweeps.run_on_gpus([*command, *_common_sweep_argv(args), "--db", _db(args), "--shard", f"{i}/{n}"],
                                 gpus)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"kernelgate: {exc}")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for k, r in enumerate(out["rounds"]):
        for g, res in r.items():
            print(f"round {k + 1}, GPU {g}: " + (res["error"] if "error" in res else "done"))
    for op, r in out["ops"].items():
        disp = _dispositions(r["dispositions"])
        print(f"{op}: {r.get('not_swept') or disp}; fingerprints {', '.join(f[:12] for f in r['fingerprint_ids'])}")
    print(f"evidence in {_db(args)}")
    return 0


def _run_sweep(args, time: bool, rerank=None) -> int:
    """rerank: (lenders, op -> its rerank plan) to time what borrowed evidence shows correct;
    else every run of the grid."""
    grid = "quick" if getattr(args, "quick", False) else getattr(args, "grid", "quick")
    if getattr(args, "gpus", None) is not None:
        return _run_on_gpus(args, grid)
    if rerank is None:
        _load_plugins(args.load)
    reports = {}
    for op in _ops_for(args.op):
        if rerank is not None and not rerank[1][op]:
            continue  # nothing borrowed to time for this op
        try:
            reports[op] = (_sweep_op(args, op, grid, time) if rerank is None
                           else _rerank_op(args, op, rerank[0], rerank[1][op]))
        except (RuntimeError, ValueError) as exc:
            if args.op == "all" and str(exc).startswith("cannot sweep"):
                reports[op] = {"not_swept": str(exc)}  # the other ops still run
                print(f"kernelgate: {exc}", file=sys.stderr)
                continue
            raise SystemExit(f"kernelgate: {exc}")
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    for op, r in reports.items():
        if "not_swept" in r:
            print(f"{op}: not swept: {r['not_swept']}")
            continue
        disp = _dispositions(r["dispositions"])
        print(f"{op}: {r['planned']} runs ({r['skipped']} already stored), {disp}; "
              f"{r['seconds']:.1f} s, {r['worker_restarts']} worker restarts")
    if any("not_swept" not in r for r in reports.values()):
        print(f"evidence in {_db(args)}")
    return 0


def cmd_bench_submit(args) -> int:
    """Writes a Slurm job array of `kernelgate bench run` shards, each into its own store, and
    submits it (kernelgate.sweeps)."""
    from . import sweeps

    _ops_for(args.op)
    sweep = ["bench", "run", args.op, "--grid", args.grid, *_common_sweep_argv(args)]
    try:
        script = sweeps.write_job(args.out, sweep, args.shards, args.name, args.sbatch)
        out = {"script": script, "job_id": None} if args.no_submit else sweeps.submit(script)
    except (RuntimeError, ValueError, OSError) as exc:
        raise SystemExit(f"kernelgate bench submit: {exc}")
    out["merge"] = f"kernelgate db merge {os.path.join(os.path.abspath(args.out), 'shard-*.sqlite')} --db MERGED.sqlite"
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"wrote {script}" + (f"; submitted as job {out['job_id']}" if out.get("job_id") else "")
              + f"\nwhen every task has ended: {out['merge']}")
    return 0


def cmd_validate(args) -> int:
    return _run_sweep(args, time=False)


def cmd_bench_run(args) -> int:
    return _run_sweep(args, time=True)


def cmd_rerank(args) -> int:
    """Times on this GPU what evidence borrowed from another GPU of its architecture (and this
    build) shows correct: the runs its lender timed, each validated again here (docs/evidence.md,
    "Across GPUs of one architecture"). The other runs' verdicts stay borrowed."""
    _load_plugins(args.load)
    for p in args.lender:
        if not os.path.isfile(p):
            raise SystemExit(f"kernelgate rerank: --lender: expected an evidence store file, got '{p}' "
                             "(no such file)")
    shipped = args.lender or kg.evidence.shipped_paths()
    plans = {op: _C.rerank_plan(op, _db(args), shipped) for op in _ops_for(args.op)}
    if not any(plans.values()):
        print(json.dumps({}) if args.json else
              "kernelgate rerank: no borrowed evidence to time here (none from another GPU of this "
              "architecture and build, or every run already timed)")
        return 0
    args.seeds, args.shard, args.backend, args.dtype = 1, (0, 1), [], []
    if not args.json:
        print("rerank: " + ", ".join(f"{op} {len(p)} runs" for op, p in plans.items() if p))
    rc = _run_sweep(args, time=True, rerank=(shipped, plans))
    kg.evidence.install()  # this process's policy reads the new rows
    return rc


def cmd_policy_show(args) -> int:
    out = {}
    for op in _ops_for(args.op):
        out[op] = _C.policy_regions(op, _db(args), kg.evidence.shipped_paths())
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for op, p in out.items():
        for note in p["notes"]:
            print(f"# {note}")
        rows = []
        for r in p["regions"]:
            ranked = r["ranked"]
            failures = []
            for s in r["standings"]:
                if s["failures"]:
                    f = ", ".join(f"{k} {v}" for k, v in s["failures"].items())
                    failures.append(f"{s['backend']}: {f}")
            margin = f"{r['margin'] * 100:+.1f}% ({r['comparison']})" if len(ranked) > 1 else ""
            none = ("none (borrowed evidence: correct here, not timed here)" if "borrowed from" in r["evidence"]
                    else "none (no passing, timed backend): the fallback serves")
            rows.append([r["region"], ranked[0] if ranked else none,
                         ranked[1] if len(ranked) > 1 else "", margin, "; ".join(failures) or "none"])
        if rows:
            print(_table(rows, ["region", "winner", "runner-up", "margin", "failures"]))
        else:
            print(f"{op}: no evidence for this fingerprint: every call runs the fallback "
                  "(the op as plain PyTorch code, else the reference)")
    return 0


def cmd_db(args) -> int:
    db = _db(args)
    try:
        if args.action == "path":
            result = {"path": db}
        elif args.action == "merge":
            result = _C.db_merge(db, args.file)
        elif args.action == "export":
            _C.db_export(db, args.file)
            result = {"exported": args.file}
        else:
            result = _C.db_import(db, args.file)
    except RuntimeError as exc:
        raise SystemExit(f"kernelgate db {args.action}: {exc}")
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.action == "path":
        print(db)
    else:
        print(", ".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def cmd_doctor(args) -> int:
    st = _C.store_status(_db(args))
    st["policy"] = _C.describe_policy()
    st["cuda_available"] = torch.cuda.is_available()
    st["backends"] = {o["name"]: {b["name"]: (b["available"], b["reason"]) for b in o["backends"]} for o in kg.ops()}
    st["shipped"] = kg.evidence.shipped_coverage()
    st["libraries"] = kg.backends.libraries()
    if args.import_libraries:
        for lib in st["libraries"]:
            if lib["available"]:
                lib["imports"], lib["import_error"] = kg.backends.import_check(
                    kg.backends.LIBRARIES[lib["library"]])
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    fp = st["fingerprint"]
    print(f"device: {fp['gpu_name']} (compute capability {fp['compute_capability']}, {fp['sm_count']} SMs), "
          f"driver {fp['driver']}, CUDA {fp['cuda_runtime']}, torch {fp['torch_version']}")
    print(f"kernelgate {fp['kernelgate_version']} (source {fp['source_hash']}), fingerprint {fp['id'][:12]}")
    print(f"store: {st['path']}")
    if not st["usable"]:
        print(f"  not usable: {st['problem']}")
    else:
        print(f"  schema {st['schema_version']}, {st['current_results']} results for this fingerprint")
        for s in st["stale"]:
            print(f"  stale: {s['results']} results from {s['gpu_name']} ({s['id'][:12]}): "
                  + "; ".join(s["why_stale"]))
    for m in st["shipped"]:
        print(f"shipped evidence: {m['gpu_name']}: {m['results']} results, {len(m['ops'])} ops "
              f"({', '.join(sorted(m['ops']))})")
    for lib in st["libraries"]:
        state = f"{lib['installed']}" if lib["available"] else f"unavailable: {lib['reason']}"
        if "imports" in lib:
            state += ", imports" if lib["imports"] else f", cannot import: {lib['import_error']}"
        print(f"library {lib['library']} ({lib['dist']}): {state}")
    print(f"policy: {st['policy']}")
    if "borrowed from" in st["policy"]:
        print("  borrowed evidence proves correctness only: `kernelgate rerank` times it on this GPU")
    return 0


def cmd_demo(args) -> int:
    """rms_norm forward and backward through kernelgate, and which backend served it and why."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device, "demo")
    ours = "kernelgate_cuda" if device.startswith("cuda") else "kernelgate_cpu"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    rows, hidden = (4096, 4096) if device == "cuda" else (256, 1024)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    report = {"device": device, "shape": [rows, hidden], "dtype": "bfloat16", "steps": []}

    def step(title: str):
        y = kg.rms_norm(x, w)
        gx, gw = torch.autograd.grad(y, [x, w], dy)
        e = kg.explain("rms_norm", x, w)
        print(f"\n== {title}\n{e}")
        report["steps"].append({"title": title, "backend": e.backend, "reason": e.reason})
        return y, gx, gw

    print(f"kernelgate demo: rms_norm on {device}, x {rows}x{hidden} bfloat16, forward and backward")
    step("1. no evidence yet: the reference serves the call")

    # 2. Prove our kernel correct for this call on this machine: forward and both gradients
    # against the float64 oracle, with the tolerance derived from the reference's own error.
    with kg.use(force={"rms_norm": ours}):
        y, gx, gw = step(f"2. validating {ours} (forced) against the float64 oracle")
    with kg.use(force={"rms_norm": "reference"}):
        ry = kg.rms_norm(x, w)
        rgx, rgw = torch.autograd.grad(ry, [x, w], dy)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    oy = torch.ops.kernelgate._rms_norm_reference(x64, w64, 1e-6)
    ogx, ogw = torch.autograd.grad(oy, [x64, w64], dy.double())
    errors = {}
    for name, g, r, o in [("y", y, ry, oy), ("dx", gx, rgx, ogx), ("dweight", gw, rgw, ogw)]:
        errors[name] = check_against_oracle(name, g, r, o, dtype)
        m = errors[name]
        print(f"   {name:8s} rel L2 error {m['rel_l2']:.2e} (reference {m['ref_rel_l2']:.2e})  passed")
    report["validation"] = errors

    arch = -1 if device == "cpu" else _C.cuda_arch(torch.cuda.current_device())
    kg.policy.add_rule("rms_norm", [ours], arch=arch, dtype=dtype, evidence="validated by `kernelgate demo` just now")
    step(f"3. with that evidence in the policy, {ours} serves the call")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _add_load_arg(p) -> None:
    p.add_argument("--load", action="append", default=[],
                   help="what registers extra backends or ops: a plugin library (.so), a Python "
                        "module or a .py file (repeat for several)")


_INT_MAX = 2**31 - 1


def _count(text: str) -> int:
    """A whole number in [1, 2^31 - 1] (argparse type)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got '{text}'")
    if not 1 <= v <= _INT_MAX:
        raise argparse.ArgumentTypeError(f"must be between 1 and {_INT_MAX}, got {v}")
    return v


def _seconds(positive: bool):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got '{text}'")
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise argparse.ArgumentTypeError(
                f"must be a finite number of seconds {'> 0' if positive else '>= 0'}, got '{text}'")
        return v
    return parse


def _shard(text: str):
    """i/N with 0 <= i < N <= 2^31 - 1."""
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be i/N, e.g. 0/4, got '{text}'")
    if not (0 <= i < n <= _INT_MAX):
        raise argparse.ArgumentTypeError(f"must be i/N with 0 <= i < N <= {_INT_MAX}, got '{text}'")
    return i, n


def _add_sweep_args(p, timing: bool) -> None:
    _add_sweep_options(p, timing)
    p.add_argument("--db", default=None, help="store file (default: KERNELGATE_DB or the cache directory)")
    p.add_argument("--shard", type=_shard, default=(0, 1), help="i/N: run every N-th case starting at i")
    p.add_argument("--gpus", type=_gpus, default=None,
                   help="'all' or 0,1,...: a sweep process per GPU, sharing the cases through the store")
    p.add_argument("--json", action="store_true")


def _add_sweep_options(p, timing: bool) -> None:
    """What a sweep runs (the op, backends, dtypes, seeds, time limits, plugins): `_common_sweep_argv`
    writes them back as arguments."""
    p.add_argument("op", help="an op name, or 'all'")
    p.add_argument("--backend", action="append", default=[], help="repeat for several; default all")
    p.add_argument("--dtype", action="append", default=[], choices=sorted(DTYPES))
    p.add_argument("--seeds", type=_count, default=1,
                   help="fresh inputs per case and value regime (>= 1; every case is tried in every regime)")
    p.add_argument("--case-timeout", type=_seconds(positive=True), default=120.0,
                   help="seconds before a case counts as hung (> 0)")
    p.add_argument("--time-cap", type=_seconds(positive=False), default=1.0 if timing else 0.0,
                   help="seconds of timing per run (>= 0)")
    _add_load_arg(p)


def _gpus(text: str):
    from .sweeps import gpu_list

    try:
        return gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _common_sweep_argv(args) -> List[str]:
    """The sweep options of args as command-line arguments (for the processes a sweep starts)."""
    out = []
    for b in args.backend:
        out += ["--backend", b]
    for d in args.dtype:
        out += ["--dtype", d]
    for item in args.load:
        out += ["--load", item]
    return out + ["--seeds", str(args.seeds), "--case-timeout", repr(args.case_timeout),
                  "--time-cap", repr(args.time_cap)]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit status 1), like every other error of the command."""

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: {message}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="kernelgate", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ops", help="ops, backends and their availability")
    _add_load_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ops)

    p = sub.add_parser("validate", help="check backends against the float64 oracle (no timing)")
    _add_sweep_args(p, timing=False)
    p.add_argument("--quick", action="store_true", help="the quick grid (default: smoke)")
    p.set_defaults(fn=cmd_validate, grid="smoke")

    p = sub.add_parser("bench", help="measure backends: validate, then time what passed")
    bench = p.add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("run", help="sweep an op's cases over its backends into the store")
    _add_sweep_args(p, timing=True)
    p.add_argument("--grid", choices=["smoke", "quick", "full"], default="quick")
    p.set_defaults(fn=cmd_bench_run)
    p = bench.add_parser("submit", help="a Slurm job array: shard i of N of a sweep per task, each into its "
                                        "own store (then kernelgate db merge)")
    _add_sweep_options(p, timing=True)
    p.add_argument("--shards", type=_count, required=True, help="array tasks (>= 1)")
    p.add_argument("--out", required=True, help="folder for the script, the shards' stores and logs")
    p.add_argument("--grid", choices=["smoke", "quick", "full"], default="full")
    p.add_argument("--sbatch", action="append", default=[], help="an sbatch option for every task, e.g. "
                                                                 "--sbatch=--partition=gpu (repeat)")
    p.add_argument("--name", default="kernelgate-sweep", help="the job's name")
    p.add_argument("--no-submit", action="store_true", help="write the script only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bench_submit)

    p = sub.add_parser("rerank", help="time on this GPU what evidence borrowed from another GPU "
                                      "of its architecture shows correct")
    p.add_argument("op", nargs="?", default="all", help="an op name, or 'all' (default)")
    p.add_argument("--case-timeout", type=_seconds(positive=True), default=120.0,
                   help="seconds before a case counts as hung (> 0)")
    p.add_argument("--time-cap", type=_seconds(positive=False), default=1.0,
                   help="seconds of timing per run (>= 0)")
    _add_load_arg(p)
    p.add_argument("--db", default=None, help="store file (default: KERNELGATE_DB or the cache directory)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--lender", action="append", default=[],
                   help="a store measured on another GPU to borrow from (repeat for several; "
                        "default: the evidence shipped with kernelgate)")
    p.set_defaults(fn=cmd_rerank)

    p = sub.add_parser("policy", help="the policy the evidence gives")
    pol = p.add_subparsers(dest="policy_command", required=True)
    p = pol.add_parser("show", help="per region: winner, runner-up, margin, failures")
    p.add_argument("op", help="an op name, or 'all'")
    p.add_argument("--db", default=None)
    _add_load_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_policy_show)

    p = sub.add_parser("explain", help="which backend serves a call of OP, and why")
    p.add_argument("op")
    p.add_argument("--shape", action="append", default=[], help="NAME=D0xD1..., e.g. x=16384x4096")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grad", action="store_true", help="the call is part of a training step")
    _add_load_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("db", help="the evidence store: path, merge, export, import")
    p.add_argument("action", choices=["path", "merge", "export", "import"])
    p.add_argument("file", nargs="?", help="the other store (merge) or the JSON file (export, import)")
    p.add_argument("--db", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_db)

    p = sub.add_parser("doctor", help="GPU, fingerprint, evidence status, why rows are stale, libraries")
    p.add_argument("--db", default=None)
    p.add_argument("--import-libraries", action="store_true",
                   help="also import each available library's backends (in a fresh process, seconds each): "
                        "what their first call would find")
    _add_load_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_doctor)

    p = sub.add_parser("report", help="the evidence as one self-contained HTML page (and a PNG of it)")
    p.add_argument("op", help="an op name, or 'all'")
    p.add_argument("--db", action="append", default=[],
                   help="a store to read (repeat; default: the shipped evidence and the local store)")
    p.add_argument("--out", default=None, help="the HTML file (default kernelgate-report.html)")
    p.add_argument("--png", default=None, help="also a PNG of the page (needs Chromium)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("loop", help="the optimization loop: gate, probe and time a candidate backend")
    lp = p.add_subparsers(dest="loop_command", required=True)
    q = lp.add_parser("start", help="register a candidate (a Python file with forward / backward)")
    q.add_argument("op")
    q.add_argument("--name", required=True)
    q.add_argument("--source", required=True, help="the candidate file, read at every try")
    q.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    q.add_argument("--dtype", action="append", default=[], choices=sorted(DTYPES))
    q.add_argument("--time-shape", action="append", default=[], type=_dims,
                   help="DIM=N,... to time at (repeat; default: the grid's largest cases)")
    q = lp.add_parser("try", help="gate, probe and time the candidate file as it is now")
    q.add_argument("name")
    q.add_argument("--timeout", type=_seconds(positive=True), default=900.0)
    q = lp.add_parser("compare", help="time the incumbent against another backend of the op (as a try times)")
    q.add_argument("name")
    q.add_argument("--against", required=True, help="a backend of the op, e.g. kernelgate_cuda")
    q.add_argument("--timeout", type=_seconds(positive=True), default=900.0)
    for n, h in (("status", "the loop's state"), ("log", "every try"),
                 ("revert", "write the incumbent back into the candidate file")):
        q = lp.add_parser(n, help=h)
        q.add_argument("name")
    for q in lp.choices.values():
        q.add_argument("--dir", default=None, help="loop state (default: KERNELGATE_LOOP_DIR or .kernelgate/loop)")
        q.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_loop)

    p = sub.add_parser("demo", help="rms_norm forward+backward: which backend served it and why")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda where there is one)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    if args.command == "db" and args.action != "path" and not args.file:
        parser.error(f"db {args.action} needs a FILE")
    try:
        _load_plugins(getattr(args, "load", []))
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"kernelgate {args.command}: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, TypeError, OSError) as exc:
        if args.debug:
            raise
        # One line, as for every other error; --debug shows where it came from.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"kernelgate {args.command}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
