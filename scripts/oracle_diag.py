"""One backend of one op through the float64 oracle on the quick grid, printing each kind of
failure as it is found (the pytest GPU oracle test prints its reasons only at the end, which a
time limit can cut off), then the counts by kind. For a GPU session with little time:

    python3 scripts/oracle_diag.py cross_entropy liger --seconds 120 [--dtype bfloat16]
"""

import argparse
import collections
import time

import kernelgate  # noqa: F401 -- registers the ops and the library backends
from kernelgate import _C

ap = argparse.ArgumentParser()
ap.add_argument("op")
ap.add_argument("backend")
ap.add_argument("--seconds", type=float, default=120.0, help="stop starting cases after this long")
ap.add_argument("--dtype", action="append", default=[])
ap.add_argument("--max-elements", type=int, default=1 << 24)
a = ap.parse_args()

made = _C.make_cases(a.op, "quick", **({"dtypes": a.dtype} if a.dtype else {}), max_elements=a.max_elements)
start, n = time.time(), 0
dispositions, kinds = collections.Counter(), collections.defaultdict(list)
for cid, enc in made:
    if time.time() - start > a.seconds:
        break
    r = _C.run_case(enc, a.backend)
    n += 1
    dispositions[r["disposition"]] += 1
    if r["disposition"] in ("passed", "unsupported"):
        continue
    parts = cid.split("/")  # op/dims/dtype/layout/regime/.../grad/seed
    kind = (r["disposition"], parts[2], parts[3], parts[4], parts[-2], r["reason"].split(":")[0][:60])
    kinds[kind].append(cid)
    if len(kinds[kind]) == 1:
        print("  e.g.", cid, "->", r["reason"][:400].replace("\n", " | "), flush=True)
for kind, cids in sorted(kinds.items()):
    print(f"  {len(cids):4d} {kind}")
print(f"== {a.op}/{a.backend}: {n} of {len(made)} cases in {time.time() - start:.0f} s: {dict(dispositions)}")
