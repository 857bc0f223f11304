"""Dispatch cost of the libraries' backends: host time per forward call (no grad) of each
library backend routed through kernelgate (forced) against calling the library the way its
users do (bench/library_calls.py), same inputs, same run. Target (the ecosystem issue): a routed
call costs <= 3 us more host time than the direct call.

Two measures per backend:
  routed_us / direct_us / added_us  wall time per call over rounds of --calls calls with a device
      synchronisation at each round's end (the medians of --rounds interleaved rounds): host time
      where the host is the bound, and it includes whatever device work a call adds
  paired_added_us  the median, over --calls pairs, of one routed call's host time minus the next
      direct call's (the order alternates): no synchronisation inside a pair, so for calls whose
      host time bounds them (the small inputs here) it is the host time a routed call adds, with
      the drift of the clock and of Python's allocator common to both halves of a pair;
      paired_iqr_us is the spread of those differences

    python bench/bench_dispatch_libraries.py --out bench/results/h200/dispatch_libraries.json
"""

import argparse
import statistics
import time

import torch

import kernelgate as kg
from common import environment, print_table, write_json
from library_calls import DIRECT


def per_call_us(fn, args, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def paired_added_us(routed, direct, args, calls: int):
    """Median and interquartile range of routed-minus-direct host time, one pair at a time."""
    diffs = []
    clock = time.perf_counter
    for i in range(calls):
        if i % 2 == 0:
            t0 = clock(); routed(*args); t1 = clock(); direct(*args); t2 = clock()
            diffs.append((t1 - t0) - (t2 - t1))
        else:
            t0 = clock(); direct(*args); t1 = clock(); routed(*args); t2 = clock()
            diffs.append((t2 - t1) - (t1 - t0))
    torch.cuda.synchronize()
    q = statistics.quantiles(diffs, n=4)
    return statistics.median(diffs) * 1e6, (q[2] - q[0]) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for b in kg.backends.BACKENDS:
        info = next(x for o in kg.ops() if o["name"] == b.op for x in o["backends"] if x["name"] == b.name)
        if not info["available"]:
            rows.append({"op": b.op, "backend": b.name, "error": info["reason"]})
            continue
        make, direct = DIRECT[b.op, b.name]
        inputs = [a.detach() if torch.is_tensor(a) else a for a in make()]
        routed_op = getattr(kg, b.op)

        def routed(*a):
            return routed_op(*a)

        with torch.no_grad(), kg.use(force={b.op: b.name}):
            assert kg.explain(b.op, *inputs).backend == b.name
            for fn in (routed, direct):  # compile, autotune, warm the caches
                for _ in range(20):
                    fn(*inputs)
            # Interleaved rounds: the clock drifts with the power draw; each round compares
            # both under the same conditions.
            r_us, d_us = [], []
            for _ in range(args.rounds):
                r_us.append(per_call_us(routed, inputs, args.calls))
                d_us.append(per_call_us(direct, inputs, args.calls))
            paired, iqr = paired_added_us(routed, direct, inputs, args.calls)
        r, d = statistics.median(r_us), statistics.median(d_us)
        rows.append({"op": b.op, "backend": b.name, "routed_us": round(r, 2), "direct_us": round(d, 2),
                     "added_us": round(r - d, 2), "paired_added_us": round(paired, 2),
                     "paired_iqr_us": round(iqr, 2), "meets_3us": paired <= 3.0})
    print_table(rows, ["op", "backend", "routed_us", "direct_us", "added_us", "paired_added_us",
                       "paired_iqr_us", "meets_3us"])
    if args.out:
        write_json(args.out, {"environment": environment("python bench/bench_dispatch_libraries.py"),
                              "target": "routed - direct <= 3 us host time per forward call (paired_added_us)",
                              "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
