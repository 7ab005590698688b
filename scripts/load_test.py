#!/usr/bin/env python
"""A bounded load test of ``carnator serve`` on loopback: the same stream of related requests, cache on and cache off.

For each mode it starts a fresh server (its own cache directory, two tenants' API keys, the embedded model on CPU
unless ``--server-args`` says otherwise), then ``--clients`` concurrent clients (half per tenant) each send their
share of a fixed stream of related prompts (new scenes, re-rolls of earlier ones, exact repeats) one after another:
submit with an Idempotency-Key (a 429 is waited out per Retry-After and resubmitted with the same key), follow the
job's events to ``done``. It stops by itself after the fixed count (or ``--max-seconds``), then checks against the
server's own job lists that every submitted job completed exactly once (lost, duplicated) and prints a Markdown
table: throughput, latency and queue wait (p50/p99, from the client's clock), hit rate by tier, service time.

    python scripts/load_test.py --requests 32 --clients 4 --steps 32 --out load.json

Only loopback addresses are ever contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harnesses, tests/harness/
from harness.server import ServerProcess  # noqa: E402

TENANTS = {"load-key-alpha": "alpha", "load-key-bravo": "bravo"}
COLOURS = ["red", "blue", "green", "yellow"]
SHAPES = ["ball", "square", "triangle"]
MOTIONS = ["moving left", "moving right", "moving up", "bouncing"]
PLACES = ["on grass", "on sand", "on snow"]


def stream(n: int, rng: random.Random) -> list[dict]:
    """``n`` related requests: a new scene, a re-roll of an earlier prompt (new seed), or an exact repeat."""
    out: list[dict] = []
    for _ in range(n):
        r = rng.random()
        if not out or r < 0.4:
            prompt = f"a small {rng.choice(COLOURS)} {rng.choice(SHAPES)} {rng.choice(MOTIONS)} {rng.choice(PLACES)}"
            out.append({"prompt": prompt, "seed": rng.randrange(1000)})
        elif r < 0.75:
            out.append({"prompt": rng.choice(out)["prompt"], "seed": rng.randrange(1000)})
        else:
            out.append(dict(rng.choice(out)))
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def one(http: httpx.AsyncClient, key: str, body: dict, deadline: float, rec: dict) -> None:
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": rec["idempotency_key"]}
    t0 = time.monotonic()
    rec["retries"] = 0
    while True:
        r = await http.post("/v1/videos", json=body, headers=headers)
        if r.status_code in (200, 202):
            break
        if r.status_code in (429, 503) and time.monotonic() < deadline:
            rec["retries"] += 1
            await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), 5.0))
            continue
        rec["error"] = f"submit: HTTP {r.status_code} {r.text[:200]}"
        return
    job_id = r.json()["id"]
    rec["id"] = job_id
    started = None
    done = None
    async with http.stream("GET", f"/v1/videos/{job_id}/events", headers={"Authorization": f"Bearer {key}"},
                           timeout=httpx.Timeout(30.0, read=max(1.0, deadline - time.monotonic()))) as s:
        name = None
        async for line in s.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
                if name in ("in_progress", "progress", "decision") and started is None:
                    started = time.monotonic()
            elif line.startswith("data:") and name == "done":
                done = json.loads(line[5:])
                break
    t1 = time.monotonic()
    if done is None:
        rec["error"] = "the event stream ended without done"
        return
    rec.update(status=done["status"], latency=t1 - t0, queue_wait=(started or t1) - t0, stats=done.get("stats"))


async def client(http, key, requests, deadline, records):
    for body in requests:
        if time.monotonic() > deadline:
            break
        rec = {"tenant": TENANTS[key], "idempotency_key": uuid.uuid4().hex, "body": body}
        records.append(rec)
        try:
            await one(http, key, body, deadline, rec)
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"


async def drive(url: str, reqs: dict[str, list[dict]], clients: int, max_seconds: float) -> tuple[list[dict], float]:
    deadline = time.monotonic() + max_seconds
    records: list[dict] = []
    keys = list(TENANTS)
    shares = []
    for c in range(clients):  # clients alternate tenants; each tenant's stream is split over its clients
        key = keys[c % len(keys)]
        mine = [c2 for c2 in range(clients) if keys[c2 % len(keys)] == key]
        shares.append((key, reqs[key][mine.index(c)::len(mine)]))
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(client(http, k, share, deadline, records) for k, share in shares))
        return records, time.monotonic() - t0


def audit(url: str, records: list[dict]) -> dict:
    """Against the server's own lists: jobs lost (submitted, not completed) and duplicated (more jobs than requests)."""
    lost = [r for r in records if r.get("status") != "completed"]
    server_jobs = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        for key in TENANTS:
            after = None
            while True:
                page = http.get("/v1/videos", params={"limit": 100, **({"after": after} if after else {})},
                                headers={"Authorization": f"Bearer {key}"}).json()
                server_jobs += len(page["data"])
                if not page["has_more"]:
                    break
                after = page["last_id"]
        metrics = http.get("/metrics").text
    ids = [r["id"] for r in records if "id" in r]
    return {"lost": len(lost), "duplicated": server_jobs - len(set(ids)) + (len(ids) - len(set(ids))),
            "server_jobs": server_jobs, "metrics": metrics}


def summarize(mode: str, records: list[dict], wall: float, audit_: dict) -> dict:
    ok = [r for r in records if r.get("status") == "completed"]
    tiers = {t: sum(1 for r in ok if r["stats"]["tier"] == t) for t in ("exact", "reuse", "miss")}
    lat = [r["latency"] for r in ok]
    wait = [r["queue_wait"] for r in ok]
    service = [r["stats"]["seconds"] for r in ok]
    return {
        "mode": mode, "requests": len(records), "completed": len(ok), "wall_s": round(wall, 1),
        "throughput_per_min": round(60 * len(ok) / wall, 2) if wall else None,
        "latency_p50_s": round(pct(lat, 50), 2), "latency_p99_s": round(pct(lat, 99), 2),
        "queue_wait_p50_s": round(pct(wait, 50), 2), "queue_wait_p99_s": round(pct(wait, 99), 2),
        "service_mean_s": round(statistics.fmean(service), 2) if service else None,
        "hit_rate": round((tiers["exact"] + tiers["reuse"]) / len(ok), 3) if ok else None, "tiers": tiers,
        "steps_computed": sum(r["stats"]["steps_computed"] for r in ok),
        "steps_total": sum(r["stats"]["steps"] for r in ok),
        "retries_429": sum(r.get("retries", 0) for r in records),
        "lost": audit_["lost"], "duplicated": audit_["duplicated"],
        "shadow_audits": shadow_audits(audit_.get("metrics", "")),
        "errors": [r["error"] for r in records if "error" in r][:5],
    }


def shadow_audits(metrics: str) -> dict:
    """The server's shadow audits when the stream ended (``/metrics``): by outcome, and the device seconds they took."""
    import re

    out: dict = {m.group(1): int(float(m.group(2)))
                 for m in re.finditer(r'^carnator_audits_total\{outcome="(\w+)"\} (\S+)$', metrics, re.MULTILINE)}
    sec = re.search(r"^carnator_audit_seconds_total (\S+)$", metrics, re.MULTILINE)
    out["seconds"] = round(float(sec.group(1)), 2) if sec else 0.0
    return out


def table(rows: list[dict]) -> str:
    head = ["cache", "requests", "completed", "wall s", "jobs/min", "latency p50 / p99 s", "queue wait p50 / p99 s",
            "service mean s", "hit rate (exact / reuse / miss)", "steps computed", "429 retries", "lost", "duplicated"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["tiers"]
        out.append("| " + " | ".join(str(x) for x in [
            r["mode"], r["requests"], r["completed"], r["wall_s"], r["throughput_per_min"],
            f"{r['latency_p50_s']} / {r['latency_p99_s']}", f"{r['queue_wait_p50_s']} / {r['queue_wait_p99_s']}",
            r["service_mean_s"], f"{r['hit_rate']:.0%} ({t['exact']} / {t['reuse']} / {t['miss']})",
            f"{r['steps_computed']} of {r['steps_total']}", r["retries_429"], r["lost"], r["duplicated"]]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per mode, split evenly over the two tenants")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (alternating tenants)")
    ap.add_argument("--steps", type=int, default=32, help="denoising steps per request (32: the carnator policy can reuse)")
    ap.add_argument("--modes", default="reuse,off", help="cache modes to run, in order, each on a fresh server")
    ap.add_argument("--max-queue", type=int, default=8, help="the servers' --max-queue (per tenant: half)")
    ap.add_argument("--max-seconds", type=float, default=900, help="stop each mode after this many seconds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    ap.add_argument("--server-args", default="", help="more arguments for carnator serve (e.g. '--device cuda')")
    ap.add_argument("--workdir", default=None, help="where the servers' cache directories go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.requests < 2 or args.clients < 2:
        ap.error("--requests and --clients must be at least 2 (two tenants)")
    rng = random.Random(args.seed)
    per = args.requests // 2
    reqs = {k: [{**b, "num_inference_steps": args.steps} for b in stream(per, rng)] for k in TENANTS}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="carnator-load-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "keys.json").write_text(json.dumps(TENANTS))
    rows = []
    for mode in args.modes.split(","):
        body_reqs = {k: [{**b, "cache": mode} for b in v] for k, v in reqs.items()}
        srv_args = ["--keys", str(work / "keys.json"), "--max-queue", str(args.max_queue), *args.server_args.split()]
        with ServerProcess(work / f"cache-{mode}", srv_args) as srv:
            print(f"[{mode}] server at {srv.url}; {args.requests} requests from {args.clients} clients", file=sys.stderr)
            records, wall = asyncio.run(drive(srv.url, body_reqs, args.clients, args.max_seconds))
            row = summarize(mode, records, wall, audit(srv.url, records))
            srv.stop()
        rows.append(row)
        print(f"[{mode}] {json.dumps({k: v for k, v in row.items() if k != 'errors'})}", file=sys.stderr)
    info = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} CPU cores, {platform.system()} {platform.release()}", "python": platform.python_version(),
            "command": "python scripts/load_test.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(table(rows))
    print(f"\n{info['date']}; {info['machine']}; `{info['command']}`")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    return 0 if all(r["lost"] == 0 and r["duplicated"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
