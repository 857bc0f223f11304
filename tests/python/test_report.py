"""kernelgate report: the page of the shipped evidence, its staleness column, and the page as a
real headless browser renders it (Chromium, a screenshot)."""

import html.parser
import os
import shutil
import sqlite3
import struct
import subprocess

import pytest

import kernelgate as kg
from kernelgate import report


class _Counter(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = {}, []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_data(self, data):
        self.text.append(data)


def _parse(page):
    c = _Counter()
    c.feed(page)
    return c.tags, " ".join(c.text)


def _shipped(op):
    return next(p for p in kg.evidence.shipped_paths() if os.path.basename(p).startswith(f"h200-{op}-"))


def test_the_page_of_the_shipped_rms_norm_evidence():
    page = report.build(["rms_norm"], [_shipped("rms_norm")])
    tags, text = _parse(page)
    assert "NVIDIA H200" in text and "current: same sources and torch as this build" in text
    # Every backend's dispositions; aten's failures in gray with a reason.
    for b in ("aten", "kernelgate_cuda", "reference"):
        assert f"<td>{b}</td>" in page
    assert "<tr class='failed'><td>aten</td>" in page and "NaN pattern differs" in text
    # The envelope: bfloat16 forward and forward+backward, one line per timed backend.
    assert tags["svg"] == 2 and tags["polyline"] >= 6
    assert "regions; fastest in each: kernelgate_cuda" in text
    assert "<script" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_evidence_measured_on_other_sources_is_marked_stale(tmp_path):
    store = tmp_path / "old.sqlite"
    shutil.copyfile(_shipped("swiglu"), store)
    con = sqlite3.connect(store)
    con.execute("UPDATE fingerprints SET source_hash = '0000000000000000'")
    con.commit()
    con.close()
    _, text = _parse(report.build(["swiglu"], [str(store)]))
    assert "stale: this build's sources hash to" in text


def test_report_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown op 'nosuch'"):
        report.build(["nosuch"])
    bad = tmp_path / "not.sqlite"
    bad.write_text("not a database")
    with pytest.raises(ValueError, match="is not an evidence store"):
        report.build(None, [str(bad)])
    _, text = _parse(report.build(None, [str(tmp_path / "missing.sqlite")]))
    assert "No evidence in these stores" in text


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_a_headless_chromium_renders_the_page(tmp_path):
    """The page as a browser parses it (its DOM holds the SVG lines) and draws it (a screenshot
    far larger than that of an empty page of the same size)."""
    browser = report.chromium()
    assert browser, "Chromium is needed for this test (scripts/setup.sh installs it: apt-get install chromium)"
    page = tmp_path / "report.html"
    page.write_text(report.build(["rms_norm", "swiglu"], [_shipped("rms_norm"), _shipped("swiglu")]))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"file://{page}"],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<polyline") == page.read_text().count("<polyline") >= 12
    shot, empty = tmp_path / "report.png", tmp_path / "empty.png"
    report.render_png(str(page), str(shot), 1280, 1600)
    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><html><body></body></html>")
    report.render_png(str(blank), str(empty), 1280, 1600)
    assert _png_size(shot) == (1280, 1600)
    assert os.path.getsize(shot) > 10 * os.path.getsize(empty), (os.path.getsize(shot), os.path.getsize(empty))
    rc = subprocess.run(["kernelgate", "report", "swiglu", "--out", str(tmp_path / "cli.html"),
                         "--png", str(tmp_path / "cli.png")], capture_output=True, text=True)
    assert rc.returncode == 0 and os.path.getsize(tmp_path / "cli.png") > 0, rc.stderr
