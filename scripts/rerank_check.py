"""Measures `kernelgate rerank` on this machine as a user of another GPU of its architecture would
meet it: each given store (e.g. the shipped H200 evidence, unpacked) is rewritten as if measured
on a GPU named --as (another SM count too), then `kernelgate rerank --lender` runs into an empty
user store; prints and writes the time, the runs and the policy's standing after it.

    python scripts/rerank_check.py --out rerank.json STORE...
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time


def as_foreign(src, dst, work, **change):
    """The store `src` as if measured on another device: its fingerprints' fields changed (the
    fields of kernelgate._C.fingerprint), each id made anew from them. Also used by the tests."""
    from kernelgate import _C, cli

    path = os.path.join(work, os.path.basename(src) + ".json")
    if cli.main(["db", "export", path, "--db", src]) != 0:
        raise RuntimeError(f"cannot export {src}")
    with open(path) as f:
        doc = json.load(f)
    ids = {}
    for fp in doc["fingerprints"]:
        fp.update(change)
        new = _C.fingerprint_id(fp)
        ids[fp["id"]], fp["id"] = new, new
    for row in doc["runs"] + doc["results"]:
        if "fingerprint_id" in row:
            row["fingerprint_id"] = ids[row["fingerprint_id"]]
    # Another device's runs are runs of their own (a run id is unique to one sweep): a merge of
    # the two stores keeps both.
    runs = {r["uuid"]: hashlib.sha256(("foreign" + r["uuid"]).encode()).hexdigest()[:32] for r in doc["runs"]}
    for r in doc["runs"]:
        r["uuid"] = runs[r["uuid"]]
    for r in doc["results"]:
        r["run_uuid"] = runs.get(r["run_uuid"], r["run_uuid"])
    with open(path, "w") as f:
        json.dump(doc, f)
    if cli.main(["db", "import", path, "--db", dst]) != 0:
        raise RuntimeError(f"cannot import into {dst}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--as", dest="gpu", default="NVIDIA H100 80GB HBM3")
    ap.add_argument("--sm-count", type=int, default=114)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kg-rerank-")
    lenders = []
    for s in a.stores:
        dst = os.path.join(work, "foreign-" + os.path.basename(s))
        as_foreign(s, dst, work, gpu_name=a.gpu, sm_count=a.sm_count)
        lenders.append(dst)
    user = os.path.join(work, "user.sqlite")
    cmd = ["kernelgate", "rerank", "--db", user, "--json"] + [x for p in lenders for x in ("--lender", p)]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.time() - t0
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    report = json.loads(done.stdout)
    out = {"command": "python scripts/rerank_check.py " + " ".join(sys.argv[1:]),
           "rerank_command": " ".join(cmd), "seconds": seconds, "as": a.gpu, "ops": report}
    for op, r in report.items():
        print(f"{op}: {r['planned']} runs, {r['dispositions']}, {r['seconds']:.1f} s")
    print(f"rerank of {len(report)} ops: {seconds:.1f} s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
