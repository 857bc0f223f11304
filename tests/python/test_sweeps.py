"""Sweeps over many GPUs on the CPU (kernelgate.sweeps): a sweep process per GPU sharing the cases
through the store's claims, the crash of one GPU's process, a Slurm job array through a fake
sbatch, merging its shards, and which GPU models the shipped evidence covers."""

import json
import os
import sqlite3
import stat
import subprocess
import sys

import pytest

import kernelgate as kg
from kernelgate import cli, sweeps

SWEEP = ["rms_norm", "--backend", "kernelgate_cpu", "--backend", "reference", "--dtype", "float32",
         "--case-timeout", "3"]


def run(capsys, *args) -> dict:
    capsys.readouterr()
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def stored(db: str) -> list:
    """Every stored run: (case, backend, disposition), sorted (duplicates kept)."""
    with sqlite3.connect(db) as c:
        return sorted(c.execute("SELECT case_id, backend, disposition FROM results").fetchall())


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """One plain validation sweep: what every split of it must store."""
    db = str(tmp_path_factory.mktemp("one") / "one.sqlite")
    assert cli.main(["validate", *SWEEP, "--db", db, "--json"]) == 0
    rows = stored(db)
    assert rows and len(set(rows)) == len(rows)
    return rows


@pytest.mark.parametrize("value,message", [
    ("0,0", "distinct device indices"), ("-1", "distinct device indices"), ("x", "distinct device indices"),
    ("all", "no CUDA GPU is visible"), ("3", "no GPU 3 (this process sees 0)"),
])
def test_gpus_argument_errors(tmp_path, monkeypatch, value, message):
    monkeypatch.setattr(sweeps.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        cli.main(["validate", *SWEEP, "--db", str(tmp_path / "x.sqlite"), "--gpus", value])


def _pretend_two_gpus(monkeypatch, kill_gpu=None):
    """This CPU machine as a node of two GPUs: each child gets CUDA_VISIBLE_DEVICES as on a real
    node (and runs on the CPU). kill_gpu's child is killed once the store holds 4 results (its
    sweep under way, runs of it claimed)."""
    monkeypatch.setattr(sweeps.torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched, real = [], sweeps._launch

    def launch(argv, env):
        launched.append(env["CUDA_VISIBLE_DEVICES"])
        if env["CUDA_VISIBLE_DEVICES"] == str(kill_gpu) and launched.count(str(kill_gpu)) == 1:
            db = argv[argv.index("--db") + 1]
            argv = [sys.executable, "-c", KILLER, db, *argv]
        return real(argv, env)

    monkeypatch.setattr(sweeps, "_launch", launch)
    return launched


# Runs the sweep in argv[2:], and SIGKILLs it once the store argv[1] holds 4 results.
KILLER = """
import os, signal, sqlite3, subprocess, sys, time
p = subprocess.Popen(sys.argv[2:])
while p.poll() is None:
    try:
        with sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=1) as c:
            if c.execute("SELECT COUNT(*) FROM results").fetchone()[0] >= 4:
                p.send_signal(signal.SIGKILL)
                break
    except sqlite3.Error:
        pass
    time.sleep(0.05)
sys.exit(-p.wait())
"""


def test_a_sweep_process_per_gpu_shares_the_cases_through_the_store(tmp_path, monkeypatch, capsys, unsharded):
    launched = _pretend_two_gpus(monkeypatch)
    db = str(tmp_path / "node.sqlite")
    out = run(capsys, "validate", *SWEEP, "--db", db, "--gpus", "all")
    assert sorted(launched) == ["0", "1"] and out["gpus"] == [0, 1] and len(out["rounds"]) == 1
    assert stored(db) == unsharded  # every run once: none twice, none lost
    r = out["ops"]["rms_norm"]
    assert sum(r["dispositions"].values()) == len(unsharded)
    assert len(r["fingerprint_ids"]) == 1  # identical devices: one fingerprint, one policy
    assert all(res["status"] == 0 for res in out["rounds"][0].values())


def test_a_gpu_whose_sweep_dies_loses_nothing(tmp_path, monkeypatch, capsys, unsharded):
    launched = _pretend_two_gpus(monkeypatch, kill_gpu=1)
    db = str(tmp_path / "node.sqlite")
    out = run(capsys, "validate", *SWEEP, "--db", db, "--gpus", "0,1")
    first = out["rounds"][0]
    assert first["1"]["status"] != 0 and "the sweep on GPU 1 exited" in first["1"]["error"], first
    assert first["0"]["status"] == 0
    assert len(out["rounds"]) == 2 and list(out["rounds"][1]) == ["0"]  # the rest, on the healthy GPU
    assert launched == ["0", "1", "0"] or sorted(launched[:2]) == ["0", "1"] and launched[2:] == ["0"]
    assert stored(db) == unsharded


FAKE_SBATCH = """#!/bin/bash
# A fake sbatch: runs the job array's tasks here, one after another, and prints a job id.
script="${@: -1}"
last=$(sed -n 's/^#SBATCH --array=0-\\([0-9]*\\)$/\\1/p' "$script")
for i in $(seq 0 "$last"); do SLURM_ARRAY_TASK_ID=$i bash "$script" > /dev/null 2>&1 || exit 7; done
echo 4242
"""


def test_bench_submit_runs_shards_as_a_job_array_and_merge_is_lossless(tmp_path, monkeypatch, capsys, unsharded):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out_dir = tmp_path / "job"
    out = run(capsys, "bench", "submit", *SWEEP, "--shards", "3", "--out", str(out_dir), "--grid", "smoke",
              "--time-cap", "0.01", "--sbatch=--partition=gpu")
    assert out["job_id"] == "4242"
    script = (out_dir / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and "#SBATCH --partition=gpu" in script
    assert '--shard "$SLURM_ARRAY_TASK_ID/3"' in script
    shards = [str(out_dir / f"shard-{i}.sqlite") for i in range(3)]
    parts = [stored(s) for s in shards]
    assert all(parts)  # every task swept its shard
    merged = str(tmp_path / "merged.sqlite")
    for s in shards:
        run(capsys, "db", "merge", s, "--db", merged)
    # The same runs as one unsharded sweep (a validation's case ids say "untimed" where a bench
    # run's do not).
    assert stored(merged) == sorted(sum(parts, [])) == sorted((c.replace("/untimed", ""), b, d)
                                                              for c, b, d in unsharded)
    regions = run(capsys, "policy", "show", "rms_norm", "--db", merged)["rms_norm"]["regions"]
    assert regions and all(r["ranked"] for r in regions)
    for backend in ("kernelgate_cpu", "reference"):  # the policy counts every merged run
        assert sum(st["cases"] for r in regions for st in r["standings"] if st["backend"] == backend) == sum(
            1 for _, b, _ in stored(merged) if b == backend)


def test_bench_submit_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(SystemExit, match="sbatch is not on PATH"):
        cli.main(["bench", "submit", *SWEEP, "--shards", "2", "--out", str(tmp_path / "a")])
    assert (tmp_path / "a" / "sweep.sbatch").exists()  # written; the message says how to submit it
    out = run(capsys, "bench", "submit", *SWEEP, "--shards", "2", "--out", str(tmp_path / "b"), "--no-submit")
    assert out["job_id"] is None and out["script"].endswith("sweep.sbatch")
    with pytest.raises(SystemExit, match="an sbatch option like --partition=gpu"):
        cli.main(["bench", "submit", *SWEEP, "--shards", "2", "--out", str(tmp_path / "c"), "--sbatch", "partition"])
    with pytest.raises(SystemExit, match="unknown op"):
        cli.main(["bench", "submit", "nosuch", "--shards", "2", "--out", str(tmp_path / "d")])
    bad = tmp_path / "bad" / "sbatch"
    bad.parent.mkdir()
    bad.write_text("#!/bin/bash\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    bad.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(bad.parent))
    with pytest.raises(SystemExit, match="sbatch exited with status 1: sbatch: error: invalid partition"):
        cli.main(["bench", "submit", *SWEEP, "--shards", "2", "--out", str(tmp_path / "e")])


def test_doctor_lists_the_gpu_models_the_shipped_evidence_covers(capsys):
    out = run(capsys, "doctor")
    models = {m["gpu_name"]: m for m in out["shipped"]}
    assert "NVIDIA H200" in models, out["shipped"]
    assert {"rms_norm", "swiglu", "linear_cross_entropy"} <= set(models["NVIDIA H200"]["ops"])
    assert models["NVIDIA H200"]["results"] > 1000
    assert out["shipped"] == kg.evidence.shipped_coverage()
    capsys.readouterr()
    assert cli.main(["doctor"]) == 0
    assert "shipped evidence: NVIDIA H200:" in capsys.readouterr().out


def test_stores_of_two_gpu_models_merge_into_one_file_each_model_apart(tmp_path, capsys):
    """A file merged from two devices' stores keeps each one's rows under its fingerprint, and the
    coverage doctor prints names both models."""
    from test_borrowed_evidence import FOREIGN, _as_foreign

    here, foreign = str(tmp_path / "here.sqlite"), str(tmp_path / "foreign.sqlite")
    assert cli.main(["validate", *SWEEP, "--shard", "0/6", "--db", here, "--json"]) == 0
    _as_foreign(here, foreign, tmp_path, gpu_name=FOREIGN, sm_count=7)
    merged = str(tmp_path / "two-rms_norm.sqlite")
    for s in (here, foreign):
        run(capsys, "db", "merge", s, "--db", merged)
    n = len(stored(here))
    assert len(stored(merged)) == 2 * n  # the same runs, once per device
    local = kg._C.fingerprint("rms_norm")["gpu_name"]
    coverage = {m["gpu_name"]: m for m in kg.evidence.shipped_coverage([merged])}
    assert set(coverage) == {local, FOREIGN}
    assert all(m["results"] == n and m["ops"] == ["rms_norm"] for m in coverage.values())
