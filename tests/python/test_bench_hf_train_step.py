"""bench/bench_hf_train_step.py on tiny Hugging Face Llama and Qwen3 models on the CPU, the hook in
mode "always" (the CPU has no evidence): the script runs, the hook rewrites what the models hold
without changing Dynamo's graphs or graph breaks, the compiled steps agree with eager (loss and
every gradient), and the JSON records the rewrites and which backend served them. (Timings on the
CPU mean nothing; the H200 run is in bench/results/h200/.)"""

import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# What the hook rewrites in each float32 model, op by op (the first layer's input norm reads the
# embeddings, which the residual also reads: Inductor's in a float32 model, see test_compile.py).
OPS = {"llama": {"add_rms_norm", "swiglu", "rope", "attention", "linear_cross_entropy"},
       "qwen3": {"add_rms_norm", "swiglu", "qk_norm_rope", "attention", "linear_cross_entropy"}}


def test_hf_train_step_script_rewrites_and_agrees_with_eager(tmp_path):
    out = tmp_path / "hf_step.json"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_hf_train_step.py"), "--tiny", "--device", "cpu",
                    "--warmup", "0", "--steps", "1", "--hook-mode", "always", "--out", str(out)],
                   check=True, capture_output=True, timeout=900)
    doc = json.loads(out.read_text())
    assert doc["hook_mode"] == "always" and set(doc["models"]) == set(OPS)
    for name, model_rows in doc["models"].items():
        rows = {r["variant"]: r for r in model_rows}
        assert set(rows) == {"eager", "compile", "compile_hook"}, (name, model_rows)
        hook, inductor = rows["compile_hook"], rows["compile"]
        assert (hook["graphs"], hook["graph_breaks"]) == (inductor["graphs"], inductor["graph_breaks"]), name
        assert hook["graphs"] >= 1
        stats = hook["served"]["compile hook"]
        assert {key.split(":")[0] for key in stats["rewritten"]} == OPS[name], (name, stats)
        assert sum(stats["served"].values()) == sum(stats["rewritten"].values()), (name, stats)
        for variant in ("compile", "compile_hook"):
            r = rows[variant]
            assert abs(r["loss_minus_eager"]) <= 1e-5 * abs(rows["eager"]["loss"]), (name, r)
            assert r["grad_rel_err_max"] < 1e-4, (name, r)
            assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
