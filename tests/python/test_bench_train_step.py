"""bench/bench_train_step.py on a small model on the CPU: the script runs, kernelgate's step agrees
with eager PyTorch's (loss and every gradient), and it records which backend served each op.
(Its timings on the CPU mean nothing; the H200 run is in bench/results/h200/.)"""

import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_train_step_script_agrees_with_eager(tmp_path):
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_train_step.py"), "--tiny",
                    "--device", "cpu", "--variants", "eager,kernelgate", "--warmup", "0", "--steps", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["variants"]}
    assert set(rows) == {"eager", "kernelgate"}
    kg_row = rows["kernelgate"]
    assert abs(kg_row["loss_minus_eager"]) < 1e-4 * abs(rows["eager"]["loss"])
    assert kg_row["grad_rel_err_max"] < 1e-4, kg_row
    assert rows["eager"]["grad_rel_err_max"] == 0
    assert set(kg_row["served"]) == {"rms_norm", "add_rms_norm", "rope", "swiglu", "linear_cross_entropy"}
    assert all(s["backend"] and s["reason"] for s in kg_row["served"].values())
    assert kg_row["step_ms"] > 0 and kg_row["tokens_per_s"] > 0
