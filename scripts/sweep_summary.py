"""Summarises shipped sweeps into bench/results/h200/sweeps.json: per op, the sweep's report, the
stores' fingerprints, cases, regions, rows by backend and disposition, the incorrect ones by
regime and grad mode, the backend served at each production shape; and the policy the dispatcher derives from them at the regions of
bench/bench_train_step.py's calls (the backend served there after installation, no user sweep).

The policy is derived here, on any machine: each store's rows are rewritten with this machine's
fingerprint (scripts/rerank_check.py's as_foreign), then kernelgate._C.policy_regions reads them
as the dispatcher on the GPU would. The step's regions are the keys kg.explain gives its calls
(meta tensors), with this machine's architecture replaced by the store's.

    python scripts/sweep_summary.py --out bench/results/h200/sweeps.json \
        --report sweep_rope.json ... STORE.sqlite ...
"""

import argparse
import datetime
import json
import os
import sqlite3
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import kernelgate as kg  # noqa: E402
from kernelgate import _C  # noqa: E402
from rerank_check import as_foreign  # noqa: E402


def step_calls():
    """The kernelgate calls of bench_train_step.py's model (its FULL config), as meta tensors."""
    import bench_train_step as step

    return step.step_calls(step.FULL, "meta", torch.bfloat16)


def op_of(store):
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        ops = [r[0] for r in db.execute("SELECT DISTINCT op FROM results")]
    if len(ops) != 1:
        raise SystemExit(f"{store}: expected the rows of one op, found {ops}")
    return ops[0]


def describe(store, op):
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        cols = [d[1] for d in db.execute("PRAGMA table_info(fingerprints)")]
        fps = [dict(zip(cols, r)) for r in db.execute("SELECT * FROM fingerprints")]
        for fp in fps:
            fp.pop("backend_versions", None), fp.pop("clocks_seen", None), fp.pop("memory_bytes", None)
        q = lambda sql: db.execute(sql).fetchall()  # noqa: E731
        return {
            "fingerprints": fps,
            "cases": q("SELECT COUNT(DISTINCT case_id) FROM results")[0][0],
            "regions": q("SELECT COUNT(DISTINCT region) FROM results")[0][0],
            "rows_by_backend_and_disposition": [list(r) for r in q(
                "SELECT backend, disposition, COUNT(*) FROM results GROUP BY 1, 2 ORDER BY 1, 2")],
            "incorrect_by_backend_regime_grad": [list(r) for r in q(
                "SELECT backend, regime, grad, COUNT(*), MIN(reason) FROM results "
                "WHERE disposition = 'incorrect' GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")],
            "largest_shapes": [r[0] for r in q(
                "SELECT shape FROM results GROUP BY shape ORDER BY MAX(LENGTH(shape)) DESC, shape DESC LIMIT 4")],
        }


def at_production_shapes(store, op, derived):
    """Per production shape (in each production layout and optional form, with and without
    gradients): the backend the derived policy serves there, and the runner-up."""
    info = next(o for o in kg.ops() if o["name"] == op)
    out = []
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        for dims in info["production_shapes"]:
            shape = "x".join(str(v) for _, v in sorted(dims.items()))
            rows = db.execute(
                "SELECT DISTINCT region, layout, grad FROM results WHERE shape = ? AND regime = 'normal' "
                "AND seed = 0 ORDER BY layout, grad DESC", (shape,)).fetchall()
            for region, layout, grad in rows:
                if layout not in info["production_layouts"]:
                    continue
                r = derived.get(region)
                out.append({"dims": dims, "layout": layout, "grad": bool(grad), "region": region,
                            "served": r["ranked"][0] if r and r["ranked"] else "fallback (no ranking)",
                            "runner_up": r["ranked"][1] if r and len(r["ranked"]) > 1 else None,
                            "vs_runner_up": r["comparison"] if r else None,
                            "margin_percent": round(100 * r["margin"], 1) if r else None})
            if not rows:
                out.append({"dims": dims, "served": "not swept (larger than the sweep's 2^30-element cap)"})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--report", action="append", default=[], help="a sweep's --json output")
    ap.add_argument("--command", default="", help="the command the sweeps ran as")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    reports = {}
    for path in a.report:
        with open(path) as f:
            reports.update(json.load(f))
    here = _C.fingerprint()
    local = {k: here[k] for k in ("gpu_name", "compute_capability", "sm_count", "memory_bytes", "driver",
                                  "cuda_runtime", "torch_version")}
    work = tempfile.mkdtemp(prefix="kg-summary-")
    calls = step_calls()
    ops, regions = {}, {}
    for store in a.stores:
        op = op_of(store)
        ops[op] = {"report": reports.get(op), **describe(store, op)}
        arch = "sm_" + ops[op]["fingerprints"][0]["compute_capability"].replace(".", "")
        mine = os.path.join(work, os.path.basename(store))
        as_foreign(store, mine, work, **local)
        derived = {r["region"]: r for r in _C.policy_regions(op, mine, [])["regions"]}
        ops[op]["served_at_production_shapes"] = at_production_shapes(store, op, derived)
        if op not in calls:
            continue
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                key = kg.explain(op, *calls[op], device="cpu").key.replace(" cpu ", f" {arch} ", 1)
            r = derived.get(key)
            regions[key] = ({"ranked": r["ranked"], "winner_vs_runner_up": r["comparison"],
                             "margin_percent": round(100 * r["margin"], 1),
                             "score_us": {s["backend"]: s["score_us"] for s in r["standings"]}} if r else
                            {"ranked": [], "note": "no evidence for this region"})
    doc = {
        "gpu": "NVIDIA H200",
        "date": datetime.date.today().isoformat(),
        "command": a.command,
        "grid": "full",
        "shipped_as": "python/kernelgate/evidence/h200-<op>.sqlite.xz",
        "ops": ops,
        "policy_at_train_step_shapes": {"how": __doc__.split("\n\n")[1].replace("\n", " "), "regions": regions},
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for key, r in regions.items():
        print(f"{key}: {r['ranked'][:3] or r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
