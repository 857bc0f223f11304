"""A Python-defined op's reference at several git revisions, timed in one run: forward+backward
(every input's gradient) of the linear-attention references (gated_delta_rule, kda) in the Gated
DeltaNet layer's fused form (raw gate and beta logits, A_log, dt_bias), bf16 inputs, no initial
state. A change to a reference that serves users (FLA refuses the gated backward on Hopper, so
kernelgate's drop-in trains through the gated_delta_rule reference there) is measured against the
revision before it on the same GPU, in the same process.

Each revision's `python/kernelgate/<op>.py` is read with `git show` and run in kernelgate's package
(its own imports resolve to the installed package, so a helper module such as
kernelgate._state_scan is the checkout's at every revision: the JSON's `installed_package` says
which; the op is not defined a second time). With --helpers, the kernelgate helper modules the
op's file imports by name (`from ._state_scan import chunk_pass`; not `_define`) are read at the
revision too (the revision's import line is not run: the installed helper may lack the name), so
each revision's whole reference is timed. The
revisions are timed in order, then in reverse order, so a clock that drifts over the run shows as
a difference between the two passes. CUDA-event medians of whole calls (host gaps included), each
after an L2 flush; peak memory is the forward+backward's above its inputs. On a machine without a
GPU it runs the same on the CPU at a tiny shape (a check of the script; its times mean nothing).

    python bench/bench_reference_revisions.py --revs 22a0b6f,341f695,66685f5,82a843b \
        --out bench/results/h100/reference_revisions_gdr_kda.json
    python bench/bench_reference_revisions.py --revs 084a10e,. --helpers
"""

import argparse
import os
import re
import subprocess
import sys
import time
import types

import torch

from common import environment, print_table, time_ms, write_json

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORKTREE = "."  # as a revision: the files of this checkout as they are (committed or not)


def _folder(rev: str):
    """The folder a revision's files are read from, if not git: '.' is the checkout's
    python/kernelgate; an existing folder holds the op's file and its helpers (for a machine whose
    copy of the checkout lacks the commit: stage them with `git show REV:python/kernelgate/...`)."""
    if rev == WORKTREE:
        return os.path.join(REPO, "python", "kernelgate")
    return rev if os.path.isdir(rev) else None


def git(*args: str) -> str:
    """git's output in this checkout (raises where git fails)."""
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, text=True).stdout


_HELPER_IMPORT = re.compile(r"^from \.(_\w+) import ([\w, ]+)$", re.M)


def load_reference(op: str, rev: str, helpers: bool = False):
    """`<op>_reference` of python/kernelgate/<op>.py at git revision `rev` (with `helpers`, the
    helper modules it imports from that revision too)."""
    folder = _folder(rev)

    def source(name):
        if folder is not None:
            with open(os.path.join(folder, f"{name}.py")) as f:
                return f.read()
        return git("show", f"{rev}:python/kernelgate/{name}.py")

    return reference_from_text(op, rev, source(op), source if helpers else None)


def _module(name: str, rev: str, src: str, given=None) -> types.ModuleType:
    """Module text `src` run in kernelgate's package (its relative imports resolve there), with
    the names in `given` defined before it runs."""
    mod = types.ModuleType(f"kernelgate._rev_{rev}_{name}")
    mod.__package__ = "kernelgate"
    mod.__dict__.update(given or {})
    mod._not_defined = lambda *args, **kwargs: None
    exec(compile(src, f"{rev}:{name}.py", "exec"), mod.__dict__)
    return mod


def reference_from_text(op: str, rev: str, src: str, helper_source=None):
    """`<op>_reference` of the module text `src` (revision `rev`'s python/kernelgate/<op>.py);
    `helper_source(name)`, if given, is the text of each helper module `_name` it imports by name,
    whose names then replace the installed package's in the op's module."""
    marker = f"\n{op} = define_op("
    if marker not in src:
        raise ValueError(f"{rev}:python/kernelgate/{op}.py does not define the op as `{op} = define_op(`")
    src = src.replace(marker, f"\n{op} = _not_defined(")
    given = {}
    for helper, names in _HELPER_IMPORT.findall(src) if helper_source else ():
        if helper != "_define":  # the op is not defined: define_op is never called
            loaded = _module(helper, rev, helper_source(helper))
            given.update({n: loaded.__dict__[n] for n in (n.strip() for n in names.split(","))})
            # the revision's import of the helper is not run: the installed helper may lack its names
            src = src.replace(f"from .{helper} import {names}\n", "")
    return _module(op, rev, src, given).__dict__[f"{op}_reference"]


def layer_inputs(op: str, B: int, T: int, H: int, K: int, device: str, dtype=torch.bfloat16,
                 param_dtype=torch.float32):
    """q, k, v, g, beta (in `dtype`), A_log, dt_bias (in `param_dtype`) of the layer (dv = dk),
    every one requiring its gradient, from a generator seeded 0 on `device`."""
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    per_channel = op == "kda"  # kda's gate and dt_bias have a value per key channel
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    g = r(B, T, H, K) if per_channel else r(B, T, H)
    beta, A_log = r(B, T, H), r(H, dt=param_dtype)
    dt_bias = r(H, K, dt=param_dtype) if per_channel else r(H, dt=param_dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta, A_log, dt_bias)]


def fwd_bwd(reference, leaves):
    def call():
        o, state = reference(*leaves, None, 0.0)
        (o.float().sum() + state.sum()).backward()
        for x in leaves:
            x.grad = None
    return call


def measure(reference, leaves, samples: int):
    call = fwd_bwd(reference, leaves)
    if not torch.cuda.is_available():
        call()
        t0 = time.perf_counter()
        call()
        return {"fwdbwd_ms": 1e3 * (time.perf_counter() - t0), "peak_extra_mib": None}
    ms = time_ms(call, warmup=1, samples=samples)["median_ms"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return {"fwdbwd_ms": ms, "peak_extra_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gated_delta_rule,kda")
    ap.add_argument("--revs", required=True,
                    help="comma-separated git revisions, the baseline first; '.' is this checkout's files, "
                         "a folder holds a revision's python/kernelgate files")
    ap.add_argument("--shapes", default=None,
                    help="B,T,H,K;... (dv = dk); default 4,2048,16,128;4,4096,16,128 on a GPU, 1,70,2,8 on the CPU")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--helpers", action="store_true",
                    help="read the helper modules the op imports (kernelgate._state_scan, ...) at each revision too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shapes or ("4,2048,16,128;4,4096,16,128" if device == "cuda" else "1,70,2,8")
    revs = args.revs.split(",")
    env = environment("python bench/bench_reference_revisions.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    env["revisions"] = {rev: "worktree" if rev == WORKTREE else f"folder {rev}" if _folder(rev)
                        else git("rev-parse", "--short", rev).strip() for rev in revs}
    # Without --helpers only the op's own file comes from each revision: what it imports
    # (kernelgate._state_scan, say) is the installed package's, built from this checkout.
    env["helpers_from_each_revision"] = args.helpers
    changed = git("status", "--porcelain", "--", "python/kernelgate").splitlines()
    env["installed_package"] = {"checkout": git("rev-parse", "--short", "HEAD").strip(),
                                "uncommitted_in_python_kernelgate": [c[3:] for c in changed if c.strip()]}
    rows = []
    for op in args.ops.split(","):
        refs = {rev: load_reference(op, rev, args.helpers) for rev in revs}
        for shape in shapes.split(";"):
            B, T, H, K = (int(x) for x in shape.split(","))
            leaves = layer_inputs(op, B, T, H, K, device)
            times = {rev: [] for rev in revs}
            for rev in revs + revs[::-1]:  # forward, then reverse order
                try:
                    rec = measure(refs[rev], leaves, args.samples)
                except Exception as exc:  # noqa: BLE001 -- an out-of-memory is a result
                    rec = {"fwdbwd_ms": None, "peak_extra_mib": None, "error": repr(exc)[:300]}
                    if device == "cuda":
                        torch.cuda.empty_cache()
                times[rev].append(rec)
            base = [r["fwdbwd_ms"] for r in times[revs[0]]]
            for rev in revs:
                ms = [r["fwdbwd_ms"] for r in times[rev]]
                row = {"op": op, "shape": f"B{B} T{T} H{H} K{K}", "rev": env["revisions"][rev],
                       "fwdbwd_ms_pass1": ms[0], "fwdbwd_ms_pass2": ms[1],
                       "peak_extra_mib": times[rev][0]["peak_extra_mib"],
                       "errors": [r["error"] for r in times[rev] if "error" in r]}
                if None not in ms and None not in base:
                    row["x_baseline"] = (sum(base) / 2) / (sum(ms) / 2)
                rows.append(row)
            if args.out:  # after every shape: a run cut short keeps what it measured
                write_json(args.out, {**env, "rows": rows})
    print_table(rows, ["op", "shape", "rev", "fwdbwd_ms_pass1", "fwdbwd_ms_pass2", "x_baseline", "peak_extra_mib"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
