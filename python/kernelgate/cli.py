"""The `kernelgate` command: ops, explain, demo."""

import argparse
import json
import sys
from typing import Dict, List, Optional

import torch

import kernelgate as kg
from kernelgate import _C
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
        rows = [[b["name"], b["kind"], "yes" if b["available"] else "no", b["reason"]] for b in op["backends"]]
        print("  " + _table(rows, ["backend", "kind", "available", "reason"]).replace("\n", "\n  "))
    return 0


def _parse_shapes(specs: List[str]) -> Dict[str, List[int]]:
    shapes = {}
    for spec in specs:
        if "=" not in spec:
            raise SystemExit(f"--shape must be NAME=D0xD1x..., got '{spec}'")
        name, dims = spec.split("=", 1)
        try:
            shapes[name] = [int(d) for d in dims.split("x")] if dims else []
        except ValueError:
            raise SystemExit(f"--shape {name}: dims must be integers separated by 'x', got '{dims}'")
    return shapes


def _tensors_for(op: dict, shapes: Dict[str, List[int]], dtype, device) -> List[Optional[torch.Tensor]]:
    """Tensors for each tensor argument: given shapes, or derived from the named dims."""
    specs = {}
    for entry in op["dims"].split(";"):
        name, dims = entry.split(":", 1)
        specs[name.strip().rstrip("?")] = [d.strip() for d in dims[dims.index("[") + 1 : dims.index("]")].split(",")]
    for name in shapes:
        if name not in specs:
            raise SystemExit(f"{op['name']} has no tensor argument '{name}'; it has {', '.join(specs)}")
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
            raise SystemExit(f"give the shape of '{name}' with --shape {name}=...")
        out.append(torch.empty(shape, dtype=dtype, device=device).normal_())
    return out


def cmd_explain(args) -> int:
    op = next((o for o in kg.ops() if o["name"] == args.op), None)
    if op is None:
        raise SystemExit(f"unknown op '{args.op}'; kernelgate has: {', '.join(o['name'] for o in kg.ops())}")
    tensors = _tensors_for(op, _parse_shapes(args.shape), DTYPES[args.dtype], args.device)
    with torch.set_grad_enabled(args.grad):
        for t in tensors:
            if t is not None and args.grad:
                t.requires_grad_(True)
        e = kg.explain(args.op, *tensors)
    if args.json:
        print(json.dumps({"op": e.op, "key": e.key, "backend": e.backend, "reason": e.reason,
                          "candidates": [c.__dict__ for c in e.candidates]}, indent=2))
    else:
        print(e)
    return 0


def cmd_demo(args) -> int:
    """rms_norm forward and backward through kernelgate, and which backend served it and why."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ours = "kernelgate_cuda" if device == "cuda" else "kernelgate_cpu"
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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ops", help="ops, backends and their availability")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ops)
    p = sub.add_parser("explain", help="which backend serves a call of OP, and why")
    p.add_argument("op")
    p.add_argument("--shape", action="append", default=[], help="NAME=D0xD1..., e.g. x=16384x4096")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grad", action="store_true", help="the call is part of a training step")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("demo", help="rms_norm forward+backward: which backend served it and why")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
