"""The evidence report: one self-contained HTML page (inline CSS and SVG, no script, nothing
fetched) of what evidence stores hold, per op: the fingerprints it was measured on and whether
this build's sources still match them (staleness), every backend's dispositions (failures and
crashes in gray, with their reasons), per region the fastest backend that passed all of its cases
and its margin over the next, and time against size per backend (the envelope). PNG: the page
rendered by a headless Chromium (``kernelgate report --png``).

The page reads the stores as they are (every fingerprint, not only this machine's); which
backend serves a call here is ``kernelgate policy show``, whose rules (noise, staleness, borrowed
evidence) the summary per region does not repeat.
"""

import html
import math
import os
import shutil
import sqlite3
import subprocess
from typing import Dict, List, Optional, Sequence

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
FAILED = ("incorrect", "crashed", "timed_out", "out_of_memory")


def _rows(paths: Sequence[str], ops: Optional[Sequence[str]]) -> List[dict]:
    out = []
    for path in paths:
        if not os.path.exists(path):
            continue
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            q = ("SELECT r.*, f.gpu_name, f.source_hash, f.torch_version, f.backend_versions "
                 "FROM results r JOIN fingerprints f ON f.id = r.fingerprint_id")
            for r in con.execute(q):
                if ops is None or r["op"] in ops:
                    out.append({**dict(r), "store": path})
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{path} is not an evidence store: {exc}") from None
        finally:
            con.close()
    return out


def _elements(shape: str) -> int:
    return math.prod(int(d) for d in shape.split("x") if d) if shape else 0


def _geomean(v: List[float]) -> float:
    return math.exp(sum(math.log(x) for x in v) / len(v))


def _svg_envelope(rows: List[dict], backends: List[str], title: str) -> str:
    """Device time against elements, log-log, one line per backend (its median per size); cases
    it failed as gray crosses on the axis."""
    w, h, m, legend = 640, 300, 48, 120
    passed = [r for r in rows if r["disposition"] == "passed" and (r["device_median_us"] or 0) > 0]
    if not passed:
        return ""
    xs = [max(1, _elements(r["shape"])) for r in passed]
    ys = [r["device_median_us"] for r in passed]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs)) + 1e-9
    y0, y1 = math.log10(min(ys)), math.log10(max(ys)) + 1e-9
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)

    def px(x):
        return m + (math.log10(max(1, x)) - x0) / (x1 - x0) * (w - m - legend)

    def py(y):
        return h - m - (math.log10(y) - y0) / (y1 - y0) * (h - 2 * m)

    parts = [f'<svg class="envelope" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(title)}">',
             f'<rect x="{m}" y="{m}" width="{w - m - legend}" height="{h - 2 * m}" fill="#fafafa" stroke="#ccc"/>',
             f'<text x="{(w - legend) / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<text x="{(w - legend) / 2}" y="{h - 8}" text-anchor="middle" font-size="11">elements (log)</text>',
             f'<text x="12" y="{h / 2}" font-size="11" transform="rotate(-90 12 {h / 2})" '
             f'text-anchor="middle">device time, us (log)</text>']
    for e in range(math.ceil(y0), math.floor(y1) + 1):
        parts.append(f'<text x="{m - 4}" y="{py(10 ** e) + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    for e in range(math.ceil(x0), math.floor(x1) + 1):
        parts.append(f'<text x="{px(10 ** e):.1f}" y="{h - m + 14}" font-size="10" text-anchor="middle">1e{e}</text>')
    for i, b in enumerate(backends):
        by_size: Dict[int, List[float]] = {}
        for r in passed:
            if r["backend"] == b:
                by_size.setdefault(max(1, _elements(r["shape"])), []).append(r["device_median_us"])
        if not by_size:
            continue
        pts = " ".join(f"{px(x):.1f},{py(sorted(v)[len(v) // 2]):.1f}" for x, v in sorted(by_size.items()))
        color = COLORS[i % len(COLORS)]
        parts.append(f'<polyline class="backend" data-backend="{html.escape(b)}" fill="none" stroke="{color}" '
                     f'stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{w - legend + 6}" y="{m + 12 * i + 8}" font-size="10" fill="{color}">'
                     f'{html.escape(b)}</text>')
    for r in rows:
        if r["disposition"] in FAILED:
            x = px(max(1, _elements(r["shape"])))
            parts.append(f'<text class="failure" x="{x:.1f}" y="{h - m - 2}" font-size="10" fill="#999" '
                         f'text-anchor="middle">x<title>{html.escape(r["backend"])}: {html.escape(r["disposition"])}'
                         f'</title></text>')
    parts.append("</svg>")
    return "".join(parts)


def build(ops: Optional[Sequence[str]] = None, stores: Optional[Sequence[str]] = None) -> str:
    """The report's HTML. ops: None for every op in the stores; stores: default the shipped
    evidence and the local store."""
    import kernelgate as kg
    from kernelgate import _C

    if stores is None:
        stores = list(kg.evidence.shipped_paths()) + [kg.evidence.db_path()]
    known = {o["name"] for o in kg.ops()}
    for op in ops or []:
        if op not in known:
            raise ValueError(f"unknown op '{op}'; kernelgate has: {', '.join(sorted(known))}")
    rows = _rows(stores, ops)
    this = _C.fingerprint()
    by_op: Dict[str, List[dict]] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>kernelgate evidence</title><style>",
           "body{font:14px system-ui,sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse;"
           "margin:8px 0 20px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}"
           "th{background:#f3f3f3}.failed{color:#888;background:#f4f4f4}.stale{color:#b00}.current{color:#070}"
           "h2{border-bottom:2px solid #333;padding-bottom:4px}</style></head><body>",
           "<h1>kernelgate evidence</h1>",
           f"<p>{len(rows)} results from {len([s for s in stores if os.path.exists(s)])} stores; this build: "
           f"kernelgate {e(this['kernelgate_version'])}, torch {e(this['torch_version'])}."
           "</p>"]
    if not rows:
        out.append("<p>No evidence in these stores (kernelgate bench run makes some).</p>")
    for op in sorted(by_op):
        rs = by_op[op]
        backends = sorted({r["backend"] for r in rs})
        out.append(f"<h2 id='{e(op)}'>{e(op)}</h2>")
        # Fingerprints, and whether this build still computes what they measured.
        here = _C.fingerprint(op) if op in known else None
        out.append("<table class='fingerprints'><tr><th>GPU</th><th>source hash</th><th>torch</th>"
                   "<th>results</th><th>staleness</th></tr>")
        fps: Dict[tuple, int] = {}
        for r in rs:
            key = (r["gpu_name"], r["source_hash"], r["torch_version"])
            fps[key] = fps.get(key, 0) + 1
        for (gpu, src, torch_v), n in sorted(fps.items()):
            if here is None:
                state, why = "stale", "the op is not defined in this build"
            elif src != here["source_hash"]:
                state, why = "stale", f"this build's sources hash to {here['source_hash']}"
            elif torch_v != here["torch_version"]:
                state, why = "stale", f"this build runs torch {here['torch_version']}"
            else:
                state, why = "current", "same sources and torch as this build"
            out.append(f"<tr><td>{e(gpu)}</td><td>{e(src)}</td><td>{e(torch_v)}</td><td>{n}</td>"
                       f"<td class='{state}'>{state}: {e(why)}</td></tr>")
        out.append("</table>")
        # Dispositions per backend.
        kinds = ["passed", "unsupported", *FAILED]
        out.append("<table class='dispositions'><tr><th>backend</th>" + "".join(f"<th>{k}</th>" for k in kinds)
                   + "<th>a failure's reason</th></tr>")
        for b in backends:
            mine = [r for r in rs if r["backend"] == b]
            counts = {k: sum(1 for r in mine if r["disposition"] == k) for k in kinds}
            failed = [r for r in mine if r["disposition"] in FAILED]
            cls = " class='failed'" if failed else ""
            reason = e(f"{failed[0]['case_id']}: {failed[0]['reason'][:300]}") if failed else ""
            out.append(f"<tr{cls}><td>{e(b)}</td>" + "".join(f"<td>{counts[k] or ''}</td>" for k in kinds)
                       + f"<td>{reason}</td></tr>")
        out.append("</table>")
        for dtype in sorted({r["dtype"] for r in rs}):
            for grad in (0, 1):
                sub = [r for r in rs if r["dtype"] == dtype and r["grad"] == grad]
                svg = _svg_envelope(sub, backends, f"{op} {dtype} {'forward+backward' if grad else 'forward'}")
                if svg:
                    out.append(svg)
        # Per region: the fastest backend that failed none of its cases there, and its margin.
        wins: Dict[str, int] = {}
        table = []
        table.append("<table class='regions'><tr><th>region</th><th>fastest</th><th>margin over the next</th>"
                   "<th>backends (geomean device us)</th><th>failed here</th></tr>")
        regions: Dict[str, List[dict]] = {}
        for r in rs:
            regions.setdefault(r["region"], []).append(r)
        for region in sorted(regions):
            standing, failed = [], []
            for b in backends:
                mine = [r for r in regions[region] if r["backend"] == b and r["disposition"] != "unsupported"]
                if not mine:
                    continue
                if any(r["disposition"] in FAILED for r in mine):
                    failed.append(b)
                    continue
                t = [r["device_median_us"] for r in mine if (r["device_median_us"] or 0) > 0]
                if t:  # the sweeps time the ordinary-value cases; the others check correctness
                    standing.append((_geomean(t), b))
            standing.sort()
            win = standing[0][1] if standing else "none timed"
            margin = f"{(standing[1][0] / standing[0][0] - 1) * 100:.1f}% ({standing[1][1]})" if len(standing) > 1 else ""
            cells = ", ".join(f"{b} {t:.1f}" for t, b in standing)
            wins[win] = wins.get(win, 0) + 1
            table.append(f"<tr><td>{e(region)}</td><td>{e(win)}</td><td>{e(margin)}</td><td>{e(cells)}</td>"
                         f"<td class='failed'>{e(', '.join(failed))}</td></tr>")
        table.append("</table>")
        said = ", ".join(f"{b} {n}" for b, n in sorted(wins.items(), key=lambda kv: -kv[1]))
        out.append(f"<details class='regions'><summary>{len(regions)} regions; fastest in each: {e(said)}</summary>"
                   + "".join(table) + "</details>")
    out.append("</body></html>")
    return "\n".join(out)


def chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def render_png(html_path: str, png_path: str, width: int = 1280, height: int = 2400) -> None:
    """The page as a PNG, by a headless Chromium."""
    browser = chromium()
    if browser is None:
        raise RuntimeError("a PNG needs a Chromium (apt-get install chromium); the HTML page needs nothing")
    p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={width},{height}", f"--screenshot={os.path.abspath(png_path)}",
                        "file://" + os.path.abspath(html_path)], capture_output=True, text=True, timeout=120)
    if p.returncode != 0 or not os.path.exists(png_path):
        raise RuntimeError(f"chromium could not render the page: {(p.stderr or p.stdout).strip()[-500:]}")
