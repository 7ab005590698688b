#!/usr/bin/env python
"""What one admission costs the other replicas of a shared store, at 10^5 and 10^6 entries.

For each size: N synthetic entries (one scope, 384-d float32 recall embeddings, as MiniLM's) are bulk-loaded into a
fresh PostgreSQL schema (COPY); a *replica* (:class:`SharedStore`) builds its FAISS index from PostgreSQL (a cold
start); then a *writer* (another SharedStore) admits entries one at a time and after each the replica syncs (the
sequence/epoch design: the rows after its last sequence number, the removal log after its last removal) and recalls.
Measured: cold build, admission (PostgreSQL transaction + blob write), per-admission sync on the replica, recall
(top-10), with the store unbounded and with a capacity that makes every admission evict one entry (LRU, decided in
SQL), and PostgreSQL's size of the table. PostgreSQL is a throwaway local cluster unless ``--store`` names one.

    python scripts/index_sync_bench.py --sizes 100000,1000000 --admissions 30
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch


def load(store, n: int, dim: int, rng: np.random.Generator) -> None:
    """``n`` rows in one scope via COPY (metadata as an admission writes it; blob-less layout)."""
    layout = json.dumps({"blobs": {}, "tensors": {}})
    nbytes = 1000
    with store._tx(write=True) as c:
        with c.cursor().copy("COPY entries (id, tenant, compat_key, prompt, created, last_used, nbytes, embedding, layout) "
                             "FROM STDIN") as cp:
            for start in range(0, n, 10000):
                vecs = rng.standard_normal((min(10000, n - start), dim), dtype=np.float32)
                for j, v in enumerate(vecs):
                    t = float(start + j)
                    cp.write_row((uuid.uuid4().hex, "t", "k", f"p{start + j}", t, t, nbytes, v.tobytes(), layout))
        c.execute("INSERT INTO scopes VALUES ('t', 'k', %s) ON CONFLICT DO NOTHING", (dim,))
        c.execute("UPDATE meta SET value = %s WHERE key = 'total_bytes'", (str(n * nbytes),))
        c.execute("ANALYZE entries")


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.1f} / {1000 * max(xs):.1f}"


def bench(url: str, n: int, dim: int, admissions: int, blobs: str) -> dict:
    from carnator.cache import StoreSpec
    from carnator.cache.shared import SharedStore

    schema_url = f"{url}{'&' if '?' in url else '?'}schema=sync_{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(0)
    writer = SharedStore(schema_url, blobs=blobs)
    t0 = time.perf_counter()
    load(writer, n, dim, rng)
    load_s = time.perf_counter() - t0
    replica = SharedStore(schema_url, blobs=blobs)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    assert replica.sync("t", "k") == n
    build_s = time.perf_counter() - t0
    q = rng.standard_normal(dim, dtype=np.float32)
    replica.recall("t", "k", q, k=10)  # FAISS's own index is built at the first search after a change

    def spec(i: int) -> StoreSpec:
        return StoreSpec(tenant="t", compat_key="k", prompt=f"new {i}", embedding=rng.standard_normal(dim, dtype=np.float32),
                         tensors={"traj.30": torch.zeros(16)}, steps_saved=20)

    out: dict = {"entries": n, "dim": dim, "bulk_load_s": round(load_s, 1), "cold_build_s": round(build_s, 2)}
    for label, capacity in (("unbounded", None), ("evicting", "full")):
        if capacity == "full":
            writer.configure(capacity_bytes=writer.stats().bytes)  # every admission now evicts (LRU, in SQL)
        adm, sync, rec = [], [], []
        for i in range(admissions):
            t0 = time.perf_counter()
            assert writer.admit(spec(i)) is not None
            adm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            replica.sync("t", "k")
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hits = replica.recall("t", "k", q, k=10)
            rec.append(time.perf_counter() - t0)
            assert len(hits) == 10
        out[label] = {"admit_ms_p50_max": ms(adm), "sync_ms_p50_max": ms(sync), "recall_ms_p50_max": ms(rec)}
    with writer._tx() as c:
        out["table_mb"] = round(c.execute("SELECT pg_total_relation_size('entries')").fetchone()[0] / 2**20)
    out["replica_rss_growth_mb"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)
    writer.close()
    replica.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--admissions", type=int, default=30)
    ap.add_argument("--store", default=None, help="a PostgreSQL URL (default: a throwaway local cluster)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pg = None
    if args.store is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harnesses, tests/harness/
        from harness.postgres import LocalPostgres

        pg = LocalPostgres().start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as blobs:
            for n in (int(s) for s in args.sizes.split(",")):
                row = bench(args.store or pg.url, n, args.dim, args.admissions, blobs)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        if pg is not None:
            pg.stop()
    print("| entries | cold build s | admit ms p50 / max | sync per admission ms p50 / max | recall top-10 ms p50 / max "
          "| admit+evict ms | sync after evict ms | table MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        u, e = r["unbounded"], r["evicting"]
        print(f"| {r['entries']:,} | {r['cold_build_s']} | {u['admit_ms_p50_max']} | {u['sync_ms_p50_max']} | "
              f"{u['recall_ms_p50_max']} | {e['admit_ms_p50_max']} | {e['sync_ms_p50_max']} | {r['table_mb']} |")
    info = f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}; {platform.machine()}, {os.cpu_count()} CPU cores; " \
           f"`python scripts/index_sync_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
    print(f"\n{info}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
