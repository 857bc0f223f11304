"""Evidence across GPUs of one architecture (docs/evidence.md): shipped evidence of another
device of this architecture, measured by an identical build, is borrowed — its pass/fail results
transfer, its timings do not — and `kernelgate rerank` times here what it shows correct. Tested on
the CPU with a foreign fingerprint: another device name and core count, everything else this
build's."""

import importlib.util
import os
import shutil
import sqlite3

import pytest
import torch

import kernelgate as kg
from kernelgate import _C, cli

from test_evidence import REPO, plugin_path, run, sweep_args

FOREIGN = "Foreign CPU 9000"


def _as_foreign(src, dst, tmp_path, **change):
    """The store `src` as if measured on another device (scripts/rerank_check.py's rewrite)."""
    spec = importlib.util.spec_from_file_location(
        "rerank_check", os.path.join(REPO, "scripts", "rerank_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.as_foreign(src, dst, str(tmp_path), **change)


@pytest.fixture(scope="module")
def lender(tmp_path_factory):
    """A smoke sweep of rms_norm on the CPU (float32; reference, kernelgate_cpu and a backend that
    ignores eps, which fails), rewritten as measured on another CPU model."""
    tmp = tmp_path_factory.mktemp("lending")
    here = str(tmp / "here.sqlite")
    assert cli.main(["bench", "run", "rms_norm", "--grid", "smoke", "--time-cap", "0.01",
                     "--load", plugin_path(), *sweep_args(here), "--backend", "reference",
                     "--backend", "kernelgate_cpu", "--backend", "faulty_ignores_eps", "--json"]) == 0
    foreign = str(tmp / "foreign.sqlite")
    _as_foreign(here, foreign, tmp, gpu_name=FOREIGN, sm_count=7)
    return here, foreign


def _call():
    return torch.randn(256, 256), torch.randn(256)


def lender_plan(store, slower=3.0):
    """What a rerank should time, from the lender's rows (docs/evidence.md): its passed, timed
    runs whose time is at most `slower` times the fastest passed, timed run of the same case."""
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    rows = con.execute("SELECT backend, case_id, COALESCE(device_median_us, eager_median_us) FROM results "
                       "WHERE disposition = 'passed' AND "
                       "(device_median_us IS NOT NULL OR eager_median_us IS NOT NULL)").fetchall()
    con.close()
    fastest = {}
    for _, case, us in rows:
        fastest[case] = min(us, fastest.get(case, us))
    return {(b, case) for b, case, us in rows if us <= slower * fastest[case]}


def test_rerank_leaves_out_what_was_far_slower_on_the_lender(lender, tmp_path):
    """A backend the lender timed more than 3x slower than the fastest one on a case is not timed
    again (such a gap does not close on a GPU of the same architecture), and the policy notes say
    how many runs that leaves out."""
    _, foreign = lender
    slow = str(tmp_path / "slow.sqlite")
    shutil.copy(foreign, slow)
    con = sqlite3.connect(slow)
    # On the lender, the reference now took 10x the time of kernelgate_cpu on every case.
    con.execute("UPDATE results SET device_median_us = 10 * (SELECT k.device_median_us FROM results k "
                "WHERE k.case_id = results.case_id AND k.backend = 'kernelgate_cpu' AND "
                "k.device_median_us IS NOT NULL) WHERE backend = 'reference' AND device_median_us IS NOT NULL "
                "AND EXISTS (SELECT 1 FROM results k WHERE k.case_id = results.case_id AND "
                "k.backend = 'kernelgate_cpu' AND k.device_median_us IS NOT NULL AND k.disposition = 'passed')")
    con.commit()
    con.close()
    user = str(tmp_path / "user.sqlite")
    plan = set(_C.rerank_plan("rms_norm", user, [slow]))
    assert plan == lender_plan(slow) and plan, (len(plan), len(lender_plan(slow)))
    assert "reference" not in {b for b, _ in plan} and "kernelgate_cpu" in {b for b, _ in plan}
    notes = _C.policy_regions("rms_norm", user, [slow])["notes"]
    assert any("a rerank leaves out" in n and "3x slower" in n for n in notes), notes


def test_borrowed_evidence_proves_correctness_but_ranks_nothing(lender, tmp_path, capsys):
    _, foreign = lender
    user = str(tmp_path / "user.sqlite")
    try:
        _C.use_evidence(user, [foreign])
        e = kg.explain("rms_norm", *_call())
        # Correct on another CPU is not fastest here: the fallback serves, and says why.
        assert e.backend == "aten", str(e)
        assert "borrowed from " + FOREIGN in e.reason and "rerank" in e.reason, str(e)
        assert "borrowed from " + FOREIGN in _C.describe_policy()
    finally:
        kg.evidence.install()
    regions = _C.policy_regions("rms_norm", user, [foreign])
    assert any("borrowed (another GPU of this architecture)" in n for n in regions["notes"]), regions["notes"]
    assert regions["regions"] and all(not r["ranked"] for r in regions["regions"])
    assert all(r["evidence"].startswith("evidence borrowed from " + FOREIGN) for r in regions["regions"])
    # The borrowed failure is kept: its backend is marked failing where it failed.
    failing = [s for r in regions["regions"] for s in r["standings"] if s["backend"] == "faulty_ignores_eps"]
    assert any(s["failures"] for s in failing), failing
    shown = run(capsys, "policy", "show", "rms_norm", "--db", user)
    assert all("borrowed" in r["evidence"] for r in shown["rms_norm"]["regions"])


def test_rerank_times_what_borrowed_evidence_shows_correct(lender, tmp_path, capsys):
    here, foreign = lender
    user = str(tmp_path / "user.sqlite")
    before = _C.policy_regions("rms_norm", user, [foreign])["regions"]
    failing = {r["region"] for r in before for s in r["standings"]
               if s["backend"] == "faulty_ignores_eps" and s["failures"]}
    assert failing
    plan = _C.rerank_plan("rms_norm", user, [foreign])
    # Only what passed there and was timed there, and not more than 3x slower there than the
    # fastest backend of its case: the lender's passed, timed rows, no others.
    assert plan and set(plan) == lender_plan(foreign), (len(plan), len(lender_plan(foreign)))
    assert "kernelgate_cpu" in {b for b, _ in plan}
    assert all("/normal/" in c and c.endswith("/seed=0") for _, c in plan), plan[:3]
    try:
        _C.use_evidence(user, [foreign])
        out = run(capsys, "rerank", "rms_norm", "--db", user, "--lender", foreign, "--time-cap", "0.01",
                  "--case-timeout", "5", "--load", plugin_path())
        assert out["rms_norm"]["planned"] == len(plan) and out["rms_norm"]["skipped"] == 0, out
        assert out["rms_norm"]["dispositions"] == {"passed": len(plan)}, out
        # The user's store now times those runs; the other cases' verdicts stay borrowed.
        assert _C.rerank_plan("rms_norm", user, [foreign]) == []
        regions = _C.policy_regions("rms_norm", user, [foreign])["regions"]
        ranked = [r for r in regions if r["ranked"]]
        assert ranked, regions
        for r in ranked:
            assert r["evidence"].startswith(f"evidence in {user}"), r["evidence"]
            assert "borrowed from " + FOREIGN in r["evidence"], r["evidence"]
        # A backend that failed there stays out where it failed, though it passed every run here.
        kept_out = [r for r in ranked if r["region"] in failing]
        assert kept_out and all("faulty_ignores_eps" not in r["ranked"] for r in kept_out)
        _C.use_evidence(user, [foreign])
        e = kg.explain("rms_norm", *_call())
        assert e.backend in {"kernelgate_cpu", "reference"} and "ranked first by policy" in e.reason, str(e)
        assert f"evidence in {user}" in e.reason and "borrowed from " + FOREIGN in e.reason, str(e)
        # A second rerank has nothing left to time.
        capsys.readouterr()
        assert cli.main(["rerank", "rms_norm", "--db", user, "--lender", foreign]) == 0
        assert "no borrowed evidence to time" in capsys.readouterr().out
    finally:
        kg.evidence.install()


def test_rerank_names_a_missing_lender():
    with pytest.raises(SystemExit, match="--lender: expected an evidence store file, got '/no/such.sqlite'"):
        cli.main(["rerank", "--lender", "/no/such.sqlite"])


def test_no_borrowing_across_architectures_or_builds(lender, tmp_path):
    here, _ = lender
    for i, change in enumerate([{"gpu_name": FOREIGN, "compute_capability": "9.0"},
                                {"gpu_name": FOREIGN, "torch_version": "0.0.0"},
                                {"gpu_name": FOREIGN, "source_hash": "0" * 16}]):
        other = str(tmp_path / f"other{i}.sqlite")
        _as_foreign(here, other, tmp_path, **change)
        user = str(tmp_path / f"user{i}.sqlite")
        regions = _C.policy_regions("rms_norm", user, [other])
        assert regions["regions"] == [], change
        assert _C.rerank_plan("rms_norm", user, [other]) == []
        try:
            _C.use_evidence(user, [other])
            e = kg.explain("rms_norm", *_call())
            assert e.backend == "aten" and "no evidence for this region" in e.reason, (change, str(e))
        finally:
            kg.evidence.install()


def test_evidence_of_this_very_device_is_not_borrowed(lender, tmp_path):
    here, _ = lender
    regions = _C.policy_regions("rms_norm", str(tmp_path / "user.sqlite"), [here])
    assert regions["regions"] and all(r["evidence"] == "evidence shipped with kernelgate"
                                      for r in regions["regions"])
    assert not any("borrowed (another GPU" in n for n in regions["notes"])


def test_a_rerank_shipped_as_this_gpus_evidence_ranks_as_the_users_own(lender, tmp_path, capsys):
    """A GPU model whose shipped evidence is a rerank of another's (timed runs only; the H100's
    is one: scripts/gpu_rerank_ship.sh) ranks as a user's own rerank would: the lender's verdicts
    fill in, case by case, the runs the shipped store lacks, so a backend that failed a
    special-value case on the lender stays out where it failed, and the provenance names both."""
    _, foreign = lender
    rerank = str(tmp_path / "rerank.sqlite")
    try:
        _C.use_evidence(rerank, [foreign])
        out = run(capsys, "rerank", "rms_norm", "--db", rerank, "--lender", foreign, "--time-cap", "0.01",
                  "--case-timeout", "5", "--load", plugin_path())
        assert out["rms_norm"]["dispositions"] == {"passed": out["rms_norm"]["planned"]}, out
    finally:
        kg.evidence.install()
    as_user = _C.policy_regions("rms_norm", rerank, [foreign])["regions"]
    as_shipped = _C.policy_regions("rms_norm", str(tmp_path / "empty.sqlite"), [foreign, rerank])["regions"]
    assert {r["region"]: r["ranked"] for r in as_shipped} == {r["region"]: r["ranked"] for r in as_user}
    assert any(r["ranked"] for r in as_shipped)
    failing = {r["region"] for r in as_user for s in r["standings"]
               if s["backend"] == "faulty_ignores_eps" and s["failures"]}
    assert failing and all("faulty_ignores_eps" not in r["ranked"] for r in as_shipped if r["region"] in failing)
    for r in as_shipped:
        if r["ranked"]:
            assert r["evidence"] == ("evidence shipped with kernelgate; correctness of cases not run here "
                                     "borrowed from " + FOREIGN), r["evidence"]
    # Nothing is left for a user's rerank: the shipped store timed it.
    assert _C.rerank_plan("rms_norm", str(tmp_path / "empty.sqlite"), [foreign, rerank]) == []
