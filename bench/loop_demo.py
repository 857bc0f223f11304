"""The optimization loop on a GPU, from a naive CUDA rms_norm to a kernel compared with kernelgate's own.

Starts `kernelgate loop` on tests/python/loop_candidates/rms_norm_naive.cu (bf16, timed at rows=16384,
hidden=4096 with and without gradients), then applies the edits in bench/loop_demo/*.patch in order,
one try each, as an engineer or an agent would: an edit the loop does not accept (incorrect,
rejected, a cheat) is reverted with `kernelgate loop revert`, and the next edit applies to the
incumbent. Each patch names the edit; EXPECTED says what the edit was written to show. Finally the
incumbent is timed against the shipped kernel (`kernelgate loop compare --against kernelgate_cuda`).
Writes the JSON after every step (a run cut by a time limit keeps what it did).

    python bench/loop_demo.py --out bench/results/h200/loop_demo.json
"""

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import environment, write_json  # noqa: E402

NAIVE = os.path.join(HERE, "..", "tests", "python", "loop_candidates", "rms_norm_naive.cu")

# What each edit was written to show (the loop decides; the record says whether it agreed).
EXPECTED = {
    "01_block_per_row": "accepted",
    "02_dweight_partial_sums": "accepted",
    "03_vectorized_dot_without_weight": "incorrect",  # the weight left out of the backward's dot product
    "04_vectorized": "accepted",
    "05_dweight_atomics": "rejected",  # one fewer read of x and dy, but every row's atomics collide
    "06_forward_row_in_registers": "accepted",
    "07_backward_persistent_row_in_registers": "accepted",
}


def apply_patch(text: str, patch: str) -> str:
    """The unified diff `patch` applied to `text`; every hunk's old lines must match exactly."""
    lines = text.splitlines(keepends=True)
    out, pos = [], 0
    for hunk in re.split(r"(?m)^(?=@@ )", patch)[1:]:
        header, *body = hunk.splitlines(keepends=True)
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", header)
        if m is None:
            raise ValueError(f"not a hunk header: {header.strip()!r}")
        old = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
        new = [ln[1:] for ln in body if ln[:1] in (" ", "+")]
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        if start < pos or lines[start:start + len(old)] != old:
            raise ValueError(f"hunk {header.strip()} does not apply")
        out += lines[pos:start] + new
        pos = start + len(old)
    return "".join(out + lines[pos:])


def summary(entry: dict) -> dict:
    t = entry.get("timing") or {}
    return {"disposition": entry["disposition"], "reason": entry.get("reason", ""),
            "speedup_over_incumbent": 1 / t["geomean"] if t.get("geomean") else None,
            "noise_floor": t.get("noise_floor"), "device_us": t.get("candidate_us"),
            "host_us": t.get("candidate_host_us"), "limit_fraction": t.get("limit_fraction"),
            "cases": [c["case"] for c in t.get("cases", [])], "errors": entry.get("errors"),
            "gate_cases": entry.get("gate_cases"), "seconds": entry.get("seconds"),
            "diff_hunks": (entry.get("diff") or {}).get("hunks")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="loop_demo.json")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--against", default="kernelgate_cuda")
    ap.add_argument("--steps", default="", help="only the patches whose names contain this")
    args = ap.parse_args()

    from kernelgate import loop

    work = tempfile.mkdtemp(prefix="kg-loop-demo-")
    source, root = os.path.join(work, "rms_norm.cu"), os.path.join(work, "state")
    shutil.copyfile(NAIVE, source)
    command = "python bench/loop_demo.py " + " ".join(sys.argv[1:])
    record = {"environment": environment(command), "op": "rms_norm", "dtype": "bfloat16",
              "time_shape": {"rows": args.rows, "hidden": args.hidden}, "steps": []}
    loop.start("rms_norm", "demo", source, device="cuda", dtypes=["bfloat16"],
               time_shapes=[{"rows": args.rows, "hidden": args.hidden}], root=root)

    def step(name: str, expected: str) -> dict:
        entry = loop.try_("demo", root=root)
        s = {"step": name, "expected": expected, **summary(entry)}
        record["steps"].append(s)
        write_json(args.out, record)
        if entry["disposition"] not in ("accepted", "baseline") and loop.status("demo", root=root)["incumbent"]:
            loop.revert("demo", root=root)
            s["reverted"] = True
        speed = f"{s['speedup_over_incumbent']:.2f}x" if s["speedup_over_incumbent"] else "-"
        fr = ", ".join(f"{f:.2f}" for f in s["limit_fraction"] or [])
        print(f"{name:<42} {s['disposition']:<10} (expected {expected:<9}) {speed:>7}  limit [{fr}]  "
              f"{' '.join(s['reason'].split())[:150]}", flush=True)
        return s

    if step("00_naive", "baseline")["disposition"] != "baseline":
        return 1
    for patch in sorted(glob.glob(os.path.join(HERE, "loop_demo", "*.patch"))):
        name = os.path.basename(patch)[:-len(".patch")]
        if args.steps and args.steps not in name:
            continue
        with open(source) as f, open(patch) as p:
            try:
                text = apply_patch(f.read(), p.read())
            except ValueError as exc:  # written on an edit the loop did not keep: the demo ends here
                record["steps"].append({"step": name, "expected": EXPECTED.get(name, "?"),
                                        "disposition": "not_applied", "reason": str(exc)})
                print(f"{name}: not applied ({exc}); the demo stops here", flush=True)
                break
        with open(source, "w") as f:
            f.write(text)
        step(name, EXPECTED.get(name, "?"))

    cmp = loop.compare("demo", args.against, root=root)
    t = cmp.get("timing") or {}
    record["compare"] = {"against": args.against, "disposition": cmp["disposition"], "reason": cmp.get("reason"),
                         "incumbent_try": cmp.get("incumbent_try"),
                         "cases": [{"case": c["case"], "against_us": c["median_us"]["against"],
                                    "incumbent_us": c["median_us"][loop.CANDIDATE],
                                    "ratio": c["median_us"][loop.CANDIDATE] / c["median_us"]["against"],
                                    "limit_us": c["limit_us"]} for c in t.get("cases", [])],
                         "aa_noise": t.get("aa_noise")}
    state = loop.status("demo", root=root)
    record["final_incumbent_try"] = state["incumbent"]["try"] if state["incumbent"] else None
    with open(source) as f:
        record["final_source"] = f.read()
    write_json(args.out, record)
    print(f"compare: {cmp['disposition']}: {cmp.get('reason')}")
    for c in record["compare"]["cases"]:
        print(f"  {c['case']}: {args.against} {c['against_us']:.1f} us, incumbent {c['incumbent_us']:.1f} us, "
              f"ratio {c['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
