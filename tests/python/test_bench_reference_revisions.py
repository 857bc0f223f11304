"""bench/bench_reference_revisions.py on the CPU: a reference loaded from a git revision is the
installed op's reference (same outputs and gradients, float64, to the bit), with --helpers its
helper modules come from the revision too, loading does not define the op a second time, and the script runs and records one row per op, shape and revision.
(Its timings on the CPU mean nothing; the revisions are compared on a GPU.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_reference_revisions as brr  # noqa: E402

import kernelgate  # noqa: E402

# the modules (kernelgate.gated_delta_rule the attribute is the op itself)
gdr_module = sys.modules["kernelgate.gated_delta_rule"]
kda_module = sys.modules["kernelgate.kda"]

needs_git = pytest.mark.skipif(
    subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="not a git checkout")


def _f64(leaves):
    return [x.detach().double().requires_grad_() for x in leaves]


@needs_git
@pytest.mark.parametrize("op,module", [("gated_delta_rule", gdr_module), ("kda", kda_module)])
def test_a_revisions_reference_is_the_installed_one(op, module):
    loaded = brr.load_reference(op, "HEAD")
    installed = getattr(module, f"{op}_reference")
    assert loaded is not installed  # a second copy, run from git's text
    leaves = brr.layer_inputs(op, 1, 37, 2, 8, "cpu")
    a_in, b_in = _f64(leaves), _f64(leaves)
    a_out, a_state = loaded(*a_in, None, 0.0)
    b_out, b_state = installed(*b_in, None, 0.0)
    assert torch.equal(a_out, b_out) and torch.equal(a_state, b_state)
    (a_out.sum() + a_state.sum()).backward()
    (b_out.sum() + b_state.sum()).backward()
    for x, y in zip(a_in, b_in):
        assert x.grad is not None and torch.equal(x.grad, y.grad)


@needs_git
def test_with_helpers_a_revision_runs_its_own_state_pass():
    """084a10e's gated_delta_rule with its own kernelgate._state_scan (the pass that formed a
    [dk, dk] matrix per chunk), not the installed one, though the installed module no longer has
    the name it imported: the same op, so the same result to rounding. Without --helpers that
    revision imports the name from the installed package, which is a clear ImportError."""
    with_helpers = brr.load_reference("gated_delta_rule", "084a10e", helpers=True)
    revision_scan = with_helpers.__globals__["state_scan"]
    assert not hasattr(sys.modules["kernelgate._state_scan"], "state_scan")
    assert "_transition" in revision_scan.__globals__
    with pytest.raises(ImportError, match="state_scan"):
        brr.load_reference("gated_delta_rule", "084a10e")
    leaves = _f64(brr.layer_inputs("gated_delta_rule", 1, 70, 2, 8, "cpu"))
    a, a_state = with_helpers(*leaves, None, 0.0)
    b, b_state = gdr_module.gated_delta_rule_reference(*leaves, None, 0.0)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a_state, b_state, rtol=1e-12, atol=1e-12)


def test_the_worktree_or_a_folder_as_a_revision(tmp_path):
    """'.' reads the checkout's files as they are, a folder the files staged in it (a GPU machine's
    copy of a checkout may carry stale git metadata): the checkout's kda gives the installed
    reference's results to the bit; a staged state pass is the one the reference then runs."""
    leaves = _f64(brr.layer_inputs("kda", 1, 37, 2, 8, "cpu"))
    b, b_state = kda_module.kda_reference(*leaves, None, 0.0)
    package = os.path.join(REPO, "python", "kernelgate")
    for name in ("kda", "_state_scan", "_l2norm"):
        text = open(os.path.join(package, f"{name}.py")).read()
        if name == "_state_scan":
            text += "\nSTAGED = True\n"
        (tmp_path / f"{name}.py").write_text(text)
    for rev in (brr.WORKTREE, str(tmp_path)):
        loaded = brr.load_reference("kda", rev, helpers=True)
        a, a_state = loaded(*leaves, None, 0.0)
        assert torch.equal(a, b) and torch.equal(a_state, b_state)
        assert loaded.__globals__["chunk_pass"].__globals__.get("STAGED", False) == (rev != brr.WORKTREE)


@needs_git
def test_loading_a_revision_defines_no_op():
    before = [o["name"] for o in kernelgate.ops()]
    assert "gated_delta_rule" in before
    brr.load_reference("gated_delta_rule", "HEAD")
    assert [o["name"] for o in kernelgate.ops()] == before


@needs_git
def test_a_file_that_does_not_define_the_op_is_a_clear_error():
    text = subprocess.run(["git", "-C", REPO, "show", "HEAD:python/kernelgate/kda.py"],
                          check=True, capture_output=True, text=True).stdout
    with pytest.raises(ValueError, match="does not define the op"):
        brr.reference_from_text("gated_delta_rule", "HEAD", text)


@needs_git
def test_the_script_records_every_op_shape_and_revision(tmp_path):
    out = tmp_path / "revs.json"
    rc = brr.main(["--revs", "HEAD", "--shapes", "1,20,2,8", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["revisions"]) == {"HEAD"}
    rows = data["rows"]
    assert [(r["op"], r["shape"]) for r in rows] == [("gated_delta_rule", "B1 T20 H2 K8"), ("kda", "B1 T20 H2 K8")]
    for r in rows:
        assert r["errors"] == [] and r["fwdbwd_ms_pass1"] > 0 and r["fwdbwd_ms_pass2"] > 0
        assert r["x_baseline"] == pytest.approx(1.0)  # the baseline against itself
    assert data["helpers_from_each_revision"] is False
