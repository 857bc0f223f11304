"""A GPU test part's result from its pytest -v log (scripts/gpu_suite.sh): counts per outcome,
the failed and errored tests by name, and, for a part its time limit cut, the tests collected
that never reported. Works on a log cut anywhere: it reads the per-test lines, not pytest's
final summary.

    python scripts/gpu_suite_summary.py --part ops --rc 0 --seconds 300 --files test_rms_norm.py \
        --log suite_ops.log --out suite_ops.json
"""

import argparse
import collections
import json
import re
import sys

# "[gw3] [ 12%] PASSED test_rms_norm.py::test_x[a-b]" (xdist) or "test_rms_norm.py::test_x PASSED [ 12%]"
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::.+?)\s*$")
_PLAIN = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: +\[\s*\d+%\])?\s*$")
_COLLECTED = re.compile(r"\d+ workers \[(\d+) items\]|collected (\d+) items?(?:.* (\d+) selected)?")


def summarize(log_text: str) -> dict:
    outcomes, names = collections.Counter(), collections.defaultdict(list)
    collected = None
    for line in log_text.splitlines():
        m = _COLLECTED.search(line)
        if m:
            collected = int(m.group(1) or m.group(3) or m.group(2))
        m = _XDIST.match(line)
        if m:
            outcome, name = m.group(1), m.group(2)
        else:
            m = _PLAIN.match(line)
            if not m:
                continue
            name, outcome = m.group(1), m.group(2)
        outcomes[outcome] += 1
        if outcome in ("FAILED", "ERROR", "XPASS"):
            names[outcome].append(name)
    reported = sum(outcomes.values())
    return {"outcomes": dict(outcomes), "reported": reported, "collected": collected,
            "unfinished": None if collected is None else collected - reported,
            "failed": names["FAILED"], "errors": names["ERROR"], "xpassed": names["XPASS"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", required=True)
    ap.add_argument("--rc", type=int, required=True, help="pytest's exit status (124: cut by the limit)")
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--files", nargs="+", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.log, errors="replace") as f:
        doc = {"part": a.part, "files": a.files, "rc": a.rc, "cut_by_time_limit": a.rc in (124, 137),
               "seconds": a.seconds, **summarize(f.read())}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    o = doc["outcomes"]
    print(f"{a.part}: {o.get('PASSED', 0)} passed, {o.get('FAILED', 0)} failed, {o.get('ERROR', 0)} errors, "
          f"{o.get('XFAIL', 0)} xfailed, {o.get('SKIPPED', 0)} skipped; {doc['unfinished']} unfinished; "
          f"rc {a.rc}, {a.seconds} s")
    for outcome, key in (("FAILED", "failed"), ("ERROR", "errors")):
        for name in doc[key]:
            print(f"  {outcome} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
