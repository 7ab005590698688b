#!/usr/bin/env python
"""Scale-out, measured: one bounded trace of related prompts over 2 Ray Serve replicas, three ways.

  (a) separate   each replica its own local cache (SQLite bank), Ray Serve's default power-of-two router
  (b) shared     one shared store (PostgreSQL + a blob directory), Ray Serve's default router
  (c) affinity   the shared store with carnator's cache-affinity router

Each mode runs in this process: a fresh ``carnator serve`` service (its job table, 2 worker slots) with 2 CPU replicas
of the embedded model on a fresh local Ray cluster, driven by ``--clients`` closed-loop clients that submit the same
trace in the same order (each client takes the next request when its last one finished). Reported per mode: hit rate
by tier, unsafe-hit rate (each approximate hit judged against a dense run of the same request with the shapes judge's
rule; exact hits are the same request's stored video), blob bytes read across replicas (each replica's store counter),
end-to-end latency p50/p99 (submission to completion, the client's clock), and lost/duplicated jobs (the job table
against the trace). PostgreSQL is a throwaway local cluster unless ``--store`` names one.

    python scripts/scale_bench.py --requests 24 --steps 32 --out scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

COLOURS = ["red", "blue", "green", "yellow"]
SHAPES = ["ball", "square", "triangle"]
MOTIONS = ["moving left", "moving right", "moving up", "bouncing"]
PLACES = ["on grass", "on sand", "on snow"]


def trace(n: int, rng: random.Random) -> list[dict]:
    """``n`` related requests over a few scene families: a new scene, a variation of an earlier one (one word
    changed, new seed), or an exact repeat."""
    out: list[dict] = []
    for _ in range(n):
        r = rng.random()
        if not out or r < 0.3:
            words = [rng.choice(COLOURS), rng.choice(SHAPES), rng.choice(MOTIONS), rng.choice(PLACES)]
        elif r < 0.8:
            words = list(rng.choice(out)["words"])
            i = rng.randrange(4)
            words[i] = rng.choice([COLOURS, SHAPES, MOTIONS, PLACES][i])
        else:
            out.append(dict(rng.choice(out)))
            continue
        out.append({"words": words, "prompt": f"a small {words[0]} {words[1]} {words[2]} {words[3]}",
                    "seed": rng.randrange(1000)})
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_mode(mode: str, reqs: list[dict], args, pg_url: str, work: Path) -> dict:
    from carnator.service.server import ServeConfig, Service

    separate = mode == "separate"
    busy_at = int(mode.split("@", 1)[1]) if "@" in mode else 1  # affinity@2: a related request may wait behind one job
    store = None if separate else f"{pg_url}{'&' if '?' in pg_url else '?'}schema=bench_{uuid.uuid4().hex[:8]}"
    cfg = ServeConfig(cache_dir=str(work / f"{mode}-ingress"), store=store,
                      blobs=None if separate else str(work / f"{mode}-blobs"), replicas=2,
                      router="affinity" if mode.startswith("affinity") else "pow2", separate_caches=separate,
                      affinity_busy_at=busy_at,
                      allow_uncertified=True, max_queue=1000, max_steps=1000)
    svc = Service(cfg)
    svc.start()
    records: list[dict] = []
    lock = threading.Lock()
    it = iter(list(enumerate(reqs)))

    def client() -> None:
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            i, body = nxt
            t0 = time.monotonic()
            job, _ = svc.store.submit("default", {"prompt": body["prompt"], "seed": body["seed"],
                                                  "num_inference_steps": args.steps, "policy": "carnator"},
                                      idempotency_key=f"{mode}-{i}")
            svc.pool.notify()
            deadline = t0 + args.max_job_seconds
            while time.monotonic() < deadline:
                j = svc.store.get("default", job.id)
                if j.status in ("completed", "failed", "cancelled"):
                    break
                time.sleep(0.05)
            with lock:
                records.append({"i": i, "id": job.id, "status": j.status, "latency": time.monotonic() - t0,
                                "stats": j.stats, "error": j.error, "body": body})

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    jobs, _ = svc.store.list("default", limit=1000)
    counters = dict(svc.engine.counters)
    svc.stop()
    ok = [r for r in records if r["status"] == "completed"]
    ids = [r["id"] for r in records]
    tiers = {t: sum(1 for r in ok if r["stats"]["tier"] == t) for t in ("exact", "reuse", "miss")}
    lat = [r["latency"] for r in ok]
    return {
        "mode": mode, "requests": len(reqs), "completed": len(ok), "wall_s": round(wall, 1),
        "tiers": tiers, "hit_rate": round((tiers["exact"] + tiers["reuse"]) / len(reqs), 3),
        "latency_p50_s": round(pct(lat, 50), 2), "latency_p99_s": round(pct(lat, 99), 2),
        "service_mean_s": round(statistics.fmean(r["stats"]["seconds"] for r in ok), 2) if ok else None,
        "blob_bytes_read": sum(c.get("blob_bytes_read", 0) for c in counters.values()),
        "replicas_seen": len(counters),
        "lost": len(reqs) - len(ok), "duplicated": len(jobs) - len(set(ids)),
        "records": records,
    }


def judge_unsafe(rows: list[dict], steps: int) -> None:
    """Label every approximate hit: acceptable iff the shapes judge's default rule accepts it against a dense run of
    the same request (frames through the same GIF round trip as the served video)."""
    from carnator.engine import Carnator
    from carnator.judges import QualityRule, get_judge
    from carnator.video import read_video, write_video

    judge = get_judge("shapes")
    rule = QualityRule.for_judge(judge, **judge.default_deltas)
    with tempfile.TemporaryDirectory() as tmp:
        eng = Carnator.from_pretrained("embedded", Path(tmp) / "cache", device="cpu")
        dense: dict[tuple, np.ndarray] = {}
        for row in rows:
            unsafe = 0
            for r in row["records"]:
                if r["status"] != "completed" or r["stats"]["tier"] != "reuse":
                    continue
                key = (r["body"]["prompt"], r["body"]["seed"])
                if key not in dense:
                    res = eng.generate(key[0], seed=key[1], num_inference_steps=steps, policy="dense", cache="off",
                                       store=False)
                    p = Path(tmp) / "dense.gif"
                    write_video(res.frames, p, fps=8)
                    dense[key] = read_video(p)
                served = read_video(Path(r["video"])) if r.get("video") else None
                if served is None:
                    continue
                ref = dense[key]
                ok = rule.acceptable(judge.score(served, key[0], ref), judge.score(ref, key[0], ref))
                unsafe += 0 if ok else 1
            hits = row["tiers"]["exact"] + row["tiers"]["reuse"]
            row["unsafe_hits"] = unsafe
            row["unsafe_hit_rate"] = round(unsafe / hits, 3) if hits else 0.0


def table(rows: list[dict]) -> str:
    head = ["mode", "requests", "hit rate (exact / reuse / miss)", "unsafe hits", "blob bytes read (replicas)",
            "latency p50 / p99 s", "service mean s", "wall s", "lost", "duplicated"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["tiers"]
        out.append("| " + " | ".join(str(x) for x in [
            r["mode"], r["requests"], f"{r['hit_rate']:.0%} ({t['exact']} / {t['reuse']} / {t['miss']})",
            f"{r.get('unsafe_hits', '?')} ({r.get('unsafe_hit_rate', 0):.0%} of hits)",
            f"{r['blob_bytes_read']:,}", f"{r['latency_p50_s']} / {r['latency_p99_s']}", r["service_mean_s"], r["wall_s"],
            r["lost"], r["duplicated"]]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients (default: one per replica)")
    ap.add_argument("--steps", type=int, default=32, help="denoising steps (32: the carnator policy can reuse)")
    ap.add_argument("--modes", default="separate,shared,affinity",
                    help="of separate, shared, affinity, affinity@N (the home replica counts as overloaded at N jobs; "
                         "default 1: it must be idle)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="a PostgreSQL URL (default: a throwaway local cluster)")
    ap.add_argument("--max-job-seconds", type=float, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reqs = trace(args.requests, random.Random(args.seed))
    work = Path(tempfile.mkdtemp(prefix="carnator-scale-"))
    pg = None
    if args.store is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harnesses, tests/harness/
        from harness.postgres import LocalPostgres

        pg = LocalPostgres().start()
    rows = []
    try:
        for mode in args.modes.split(","):
            print(f"[{mode}] {len(reqs)} requests, {args.clients} clients, 2 replicas", file=sys.stderr, flush=True)
            row = run_mode(mode, reqs, args, args.store or pg.url, work)
            for r in row["records"]:  # the served video, for the unsafe-hit judge
                gif = work / f"{mode}-ingress" / "videos"
                found = list(gif.rglob(f"{r['id']}*.gif")) if gif.exists() else []
                r["video"] = str(found[0]) if found else None
            rows.append(row)
            print(f"[{mode}] {json.dumps({k: v for k, v in row.items() if k != 'records'})}", file=sys.stderr, flush=True)
        judge_unsafe(rows, args.steps)
    finally:
        if pg is not None:
            pg.stop()
    info = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}",
            "command": "python scripts/scale_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(table(rows))
    print(f"\n{info['date']}; {info['machine']}; `{info['command']}`")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "trace": reqs, "rows": rows}, indent=2, default=str))
    return 0 if all(r["lost"] == 0 and r["duplicated"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
