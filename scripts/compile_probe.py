"""Where the first step of a compiled training step spends its time: bench/bench_train_step.py's
model (FULL config; --tiny for a check) under torch.compile, one forward+backward, with the
Python stacks of every thread dumped every --every seconds (a compile stuck or slow in one place
shows as the same frames again and again), torch._dynamo's compile times per phase, and the
count of recompiles and graph breaks. Written to --out as the run goes, so a run cut short by
its time limit still leaves what it saw.

--str-callers also records who asks Inductor to print its IR (str of an IR node, which prints
everything the node was computed from): per outermost caller (the 14 frames above it), the
calls and seconds, and the caller of a print still running, in str_callers.json every --every
seconds and at the end.

    TORCH_LOGS=recompiles,graph_breaks python scripts/compile_probe.py \
        --variant kernelgate_compile --every 30 --out $OUT/compile_probe
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import bench_train_step as step  # noqa: E402


def compile_times() -> dict:
    """torch._dynamo's accumulated seconds per compile phase, largest first."""
    import torch._dynamo.utils as du

    names, values = du.compile_times(repr="csv", aggregate=True)
    pairs = [(n, float(v)) for n, v in zip(names, values) if v not in ("", None)]
    return dict(sorted(pairs, key=lambda p: -p[1]))


def record_str_callers(path: str, every: float) -> None:
    """Wraps Inductor's IRNode.str_helper (every IR node's __str__ goes through it)."""
    import collections
    import threading
    import traceback

    import torch._inductor.ir as ir

    depth, calls, spent = [0], collections.Counter(), collections.Counter()
    running = {}  # the outermost print in progress: caller, start
    inner = ir.IRNode.str_helper

    def str_helper(self, *a, **k):
        if depth[0] == 0:
            frames = traceback.extract_stack()[-15:-1]
            running["caller"] = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                                            for f in reversed(frames))
            running["start"] = time.perf_counter()
        depth[0] += 1
        try:
            return inner(self, *a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                calls[running["caller"]] += 1
                spent[running["caller"]] += time.perf_counter() - running["start"]
                running.clear()

    def dump() -> None:
        now = dict(running)
        with open(path, "w") as f:
            json.dump({"running": {"caller": now.get("caller"),
                                   "seconds": round(time.perf_counter() - now["start"], 1)} if now else None,
                       "done": [{"caller": c, "calls": calls[c], "seconds": round(t, 3)}
                                for c, t in spent.most_common(20)]}, f, indent=1)

    def loop() -> None:
        while True:
            time.sleep(every)
            dump()

    ir.IRNode.str_helper = str_helper
    threading.Thread(target=loop, daemon=True).start()
    atexit_dump.append(dump)


atexit_dump: list = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="kernelgate_compile",
                    help="a compiling variant of bench_train_step.py: compile, kernelgate_compile, compile_hook")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between stack dumps")
    ap.add_argument("--out", required=True, help="a folder: stacks.txt, times.json")
    ap.add_argument("--str-callers", action="store_true",
                    help="record who prints Inductor IR, and for how long (str_callers.json)")
    args = ap.parse_args()
    if not args.variant.endswith("compile") and args.variant != "compile_hook":
        raise SystemExit(f"--variant must be a compiling variant, got {args.variant!r}")
    os.makedirs(args.out, exist_ok=True)
    cfg = step.TINY if args.tiny else step.FULL
    dev = args.device
    dt = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    stacks = open(os.path.join(args.out, "stacks.txt"), "w")
    times_path = os.path.join(args.out, "times.json")
    t0 = time.perf_counter()
    if args.str_callers:
        record_str_callers(os.path.join(args.out, "str_callers.json"), args.every)

    def write_times(status: str) -> None:
        with open(times_path, "w") as f:
            json.dump({"variant": args.variant, "model": cfg, "device": dev, "status": status,
                       "seconds": round(time.perf_counter() - t0, 1), "compile_times_s": compile_times(),
                       "counters": {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                                    if k in ("stats", "graph_break", "recompiles", "unimplemented")}},
                      f, indent=1)

    def on_term(signum, frame):  # a time limit's SIGTERM / SIGINT: keep what was seen
        write_times(f"stopped by signal {signum}")
        for dump in atexit_dump:
            dump()
        faulthandler.dump_traceback(file=stacks, all_threads=True)
        stacks.flush()
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    faulthandler.dump_traceback_later(args.every, repeat=True, file=stacks)
    state, ids, targets = step.step_inputs(lambda c: step.Model(c, step.EagerOps()), cfg, dev, dt)
    # run_variant's first step is the compile; one warm and one timed step after it
    result, _ = step.run_variant(args.variant, cfg, state, ids, targets, dev, dt, warmup=1, steps=1)
    faulthandler.cancel_dump_traceback_later()
    write_times("finished")
    for dump in atexit_dump:
        dump()
    print(json.dumps({"first_step_s": round(result["first_step_s"], 1), "step_ms": round(result["step_ms"], 2),
                      "top_phases_s": dict(list(compile_times().items())[:8])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
