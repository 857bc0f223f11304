"""Sweeps over many GPUs: every GPU of a node at once (``--gpus``), and clusters through Slurm
(``kernelgate bench submit``).

One node: a sweep process per GPU (CUDA_VISIBLE_DEVICES set to it, so its workers run there), all
into one store. Each process walks every case and claims each run in the store before it runs it
(the store's claims), so no run is measured twice; a run claimed by a process that died is free
again at once on this host. When a GPU's process fails, a second round on the GPUs whose processes
succeeded runs what is left, so nothing is lost. Identical GPUs have one fingerprint: their rows
pool into one policy.

Clusters: ``submit`` writes a Slurm job-array script whose task i runs shard i/N into a store of
its own, and hands it to ``sbatch``; ``kernelgate db merge`` then combines the shards' stores
(losslessly: the same rows as one unsharded sweep, each fingerprint's rows apart).
"""

import json
import os
import shlex
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Union

import torch


def gpu_list(text: str) -> Union[str, List[int]]:
    """--gpus: 'all' or comma-separated device indices."""
    if text == "all":
        return text
    try:
        gpus = [int(t) for t in text.split(",")]
    except ValueError:
        gpus = []
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"must be 'all' or distinct device indices like 0,1,3, got '{text}'")
    return gpus


def resolve_gpus(spec: Union[str, List[int]]) -> List[int]:
    """The device indices of --gpus, checked against the GPUs this process sees."""
    n = torch.cuda.device_count()
    if spec == "all":
        if n == 0:
            raise ValueError("--gpus all: no CUDA GPU is visible")
        return list(range(n))
    bad = [g for g in spec if g >= n]
    if bad:
        raise ValueError(f"--gpus: no GPU {', '.join(map(str, bad))} (this process sees {n})")
    return list(spec)


def _visible(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES value that makes device index `gpu` of this process the child's only GPU."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer:
        return outer.split(",")[gpu].strip()
    return str(gpu)


def _launch(argv: List[str], env: Dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_on_gpus(child_args: List[str], gpus: List[int]) -> dict:
    """Runs `kernelgate <child_args> --json` once per GPU, then again on the GPUs that succeeded
    while any failed. Returns per op the summed dispositions, and per round and GPU what ran."""
    rounds, healthy, reports, pending = [], list(gpus), [], list(gpus)
    while pending:
        procs = {}
        for g in pending:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=_visible(g))
            procs[g] = _launch([sys.executable, "-m", "kernelgate.cli", *child_args, "--json"], env)
        this_round, failed = {}, []
        for g, p in procs.items():
            out, err = p.communicate()
            try:
                report = json.loads(out) if p.returncode == 0 else None
            except ValueError:
                report = None
            if report is None:
                failed.append(g)
                tail = " | ".join((err or out or "").strip().splitlines()[-4:])
                this_round[str(g)] = {"status": p.returncode, "error": f"the sweep on GPU {g} exited with status "
                                                                      f"{p.returncode}: {tail}"}
            else:
                reports.append(report)
                this_round[str(g)] = {"status": 0, "ops": report}
        rounds.append(this_round)
        healthy = [g for g in healthy if g not in failed]
        if not failed or len(rounds) == 2:
            break
        if not healthy:
            raise RuntimeError("every GPU's sweep failed: " + "; ".join(r["error"] for r in this_round.values()
                                                                         if "error" in r))
        pending = healthy  # a second round: what the failed ones left, on the GPUs that succeeded
    totals: Dict[str, dict] = {}
    for report in reports:
        for op, r in report.items():
            t = totals.setdefault(op, {"planned": 0, "dispositions": {}, "worker_restarts": 0,
                                       "fingerprint_ids": []})
            if "not_swept" in r:
                t["not_swept"] = r["not_swept"]
                continue
            t["worker_restarts"] += r["worker_restarts"]
            for k, v in r["dispositions"].items():
                t["dispositions"][k] = t["dispositions"].get(k, 0) + v
            if r["fingerprint_id"] not in t["fingerprint_ids"]:
                t["fingerprint_ids"].append(r["fingerprint_id"])
    return {"gpus": gpus, "rounds": rounds, "ops": totals}


# ---- Slurm ---------------------------------------------------------------------------------------

SBATCH_TEMPLATE = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --array=0-{last}
#SBATCH --gpus-per-task=1
#SBATCH --output={out}/shard-%a.log
{extra}
# Written by kernelgate bench submit: shard i of {n} of `kernelgate {sweep}` into a store of its own.
# When every task has ended: kernelgate db merge {out}/shard-*.sqlite --db MERGED.sqlite
set -euo pipefail
exec {python} -m kernelgate.cli {sweep} --shard "$SLURM_ARRAY_TASK_ID/{n}" --db "{out}/shard-$SLURM_ARRAY_TASK_ID.sqlite"
"""


def write_job(out_dir: str, sweep_args: Sequence[str], shards: int, name: str = "kernelgate-sweep",
              sbatch_options: Sequence[str] = ()) -> str:
    """The job-array script (path) running `kernelgate <sweep_args>` as `shards` shards."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    for o in sbatch_options:
        if not o.startswith("--") or "\n" in o:
            raise ValueError(f"--sbatch: each an sbatch option like --partition=gpu, got {o!r}")
    out = os.path.abspath(out_dir)
    os.makedirs(out, exist_ok=True)
    sweep = " ".join(shlex.quote(a) for a in sweep_args)
    text = SBATCH_TEMPLATE.format(name=name, last=shards - 1, n=shards, out=out, python=shlex.quote(sys.executable),
                                  sweep=sweep, extra="\n".join(f"#SBATCH {o}" for o in sbatch_options))
    path = os.path.join(out, "sweep.sbatch")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def submit(script: str, sbatch: Optional[str] = None) -> dict:
    """Hands the script to sbatch; returns the job id it printed."""
    import shutil

    exe = sbatch or shutil.which("sbatch")
    if exe is None:
        raise RuntimeError("sbatch is not on PATH: run this on a Slurm login node, or submit "
                           f"{script} yourself (--no-submit writes it only)")
    p = subprocess.run([exe, "--parsable", script], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch exited with status {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}")
    job = p.stdout.strip().split(";")[0].split()[-1] if p.stdout.strip() else ""
    return {"script": script, "job_id": job, "sbatch_output": p.stdout.strip()}
