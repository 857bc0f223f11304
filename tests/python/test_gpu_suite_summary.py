"""scripts/gpu_suite_summary.py: a GPU test part's result read from its pytest -v log, whole or
cut by a time limit, in pytest's plain and xdist formats."""

import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)

import gpu_suite_summary as summary  # noqa: E402


def test_a_real_plain_log(tmp_path):
    (tmp_path / "test_four.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.xfail(strict=True)\n"
        "def test_known(): assert False\n"
        "@pytest.mark.parametrize('v', [1, 2])\n"
        "def test_p(v): assert v == 1\n"
        "def test_unselected(): pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", "not unselected",
                          "test_four.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    got = summary.summarize(run.stdout)
    assert got["outcomes"] == {"PASSED": 2, "FAILED": 2, "XFAIL": 1}, run.stdout
    assert sorted(got["failed"]) == ["test_four.py::test_bad", "test_four.py::test_p[2]"]
    assert (got["collected"], got["reported"], got["unfinished"]) == (5, 5, 0)


def test_an_xdist_log_cut_by_the_time_limit(tmp_path):
    log = ("bringing up nodes...\n"
           "4 workers [6 items]\n\n"
           "[gw0] [ 16%] PASSED test_a.py::test_x[cpu-bf16] \n"
           "[gw2] [ 33%] FAILED test_a.py::test_y[rms_norm: F.rms_norm-training] \n"
           "[gw1] [ 50%] XFAIL test_b.py::test_z \n"
           "[gw3] [ 66%] ERROR test_b.py::test_w \n")
    (tmp_path / "part.log").write_text(log)
    out = tmp_path / "part.json"
    assert summary.main(["--part", "contracts", "--rc", "124", "--seconds", "450", "--files", "test_a.py",
                         "test_b.py", "--log", str(tmp_path / "part.log"), "--out", str(out)]) == 0
    import json
    doc = json.loads(out.read_text())
    assert doc["cut_by_time_limit"] is True
    assert doc["outcomes"] == {"PASSED": 1, "FAILED": 1, "XFAIL": 1, "ERROR": 1}
    assert doc["failed"] == ["test_a.py::test_y[rms_norm: F.rms_norm-training]"]
    assert doc["errors"] == ["test_b.py::test_w"]
    assert (doc["collected"], doc["reported"], doc["unfinished"]) == (6, 4, 2)
