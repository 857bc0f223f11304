"""Packs sweep stores into the package's shipped evidence: one store per op,
python/kernelgate/evidence/<gpu>-<op>.sqlite.xz (docs/evidence.md, "Shipped evidence").

    python scripts/ship_evidence.py pack --gpu h200 --out python/kernelgate/evidence STORE...
    python scripts/ship_evidence.py unpack --out DIR PACKED...   # e.g. to resume a sweep

pack copies each op's rows (with their runs and fingerprints) out of the stores into a fresh
store of the same schema, compacts it and compresses it; an op present in several stores takes
the rows of all of them (a sweep resumed in several calls).
"""

import argparse
import lzma
import os
import sqlite3
import sys
import tempfile


def ops_of(path):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT DISTINCT op FROM results ORDER BY op")]
    finally:
        con.close()


def pack_op(op, stores, dest):
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "op.sqlite")
        # The first store's schema (tables, indexes, meta) with none of its rows.
        src = sqlite3.connect(f"file:{stores[0]}?mode=ro", uri=True)
        src.execute(f"VACUUM INTO '{work}'")
        src.close()
        con = sqlite3.connect(work)
        for table in ("results", "claims", "runs", "fingerprints"):
            con.execute(f"DELETE FROM {table}")
        cols = {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")]
                for t in ("results", "runs", "fingerprints")}
        for i, store in enumerate(stores):
            con.execute(f"ATTACH DATABASE 'file:{store}?mode=ro' AS s{i}")
            s = f"s{i}"
            fp = ",".join(cols["fingerprints"])
            con.execute(f"INSERT OR IGNORE INTO fingerprints ({fp}) SELECT {fp} FROM {s}.fingerprints "
                        f"WHERE id IN (SELECT fingerprint_id FROM {s}.results WHERE op = ?)", (op,))
            run_cols = [c for c in cols["runs"] if c != "id"]
            rc = ",".join(run_cols)
            con.execute(f"INSERT OR IGNORE INTO runs ({rc}) SELECT {rc} FROM {s}.runs "
                        f"WHERE id IN (SELECT run_id FROM {s}.results WHERE op = ?)", (op,))
            res_cols = [c for c in cols["results"] if c not in ("id", "run_id")]
            sel = ",".join(f"r.{c}" for c in res_cols)
            con.execute(
                f"INSERT OR REPLACE INTO results (run_id, {','.join(res_cols)}) "
                f"SELECT (SELECT id FROM runs WHERE uuid = sr.uuid), {sel} "
                f"FROM {s}.results r JOIN {s}.runs sr ON sr.id = r.run_id WHERE r.op = ?", (op,))
            con.commit()
            con.execute(f"DETACH DATABASE {s}")
        n = con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        con.execute("VACUUM")
        con.close()
        with open(work, "rb") as f:
            data = lzma.compress(f.read(), preset=9)
    with open(dest, "wb") as f:
        f.write(data)
    return n


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--out", required=True)
    ap.add_argument("--op", action="append", default=[], help="only these ops (default: every op)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.action == "unpack":
        for p in a.files:
            name = os.path.basename(p)[: -len(".xz")] if p.endswith(".xz") else os.path.basename(p)
            with open(p, "rb") as f, open(os.path.join(a.out, name), "wb") as out:
                out.write(lzma.decompress(f.read()))
            print(os.path.join(a.out, name))
        return 0
    ops = sorted({op for s in a.files for op in ops_of(s)})
    for op in a.op or ops:
        stores = [s for s in a.files if op in ops_of(s)]
        if not stores:
            raise SystemExit(f"--op: no store holds rows of '{op}'")
        dest = os.path.join(a.out, f"{a.gpu}-{op}.sqlite.xz")
        n = pack_op(op, stores, dest)
        print(f"{dest}: {n} rows, {os.path.getsize(dest)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
