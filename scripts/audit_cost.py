#!/usr/bin/env python
"""What the shadow audits of ``carnator serve`` cost: the share of device time they take at a given rate and budget.

Runs the service in this process (the embedded model on CPU, the shipped thresholds, a SQLite job table in a
temporary directory; no HTTP) and feeds it one client's stream of related requests (new scenes, and re-rolls of
earlier ones with new seeds, which the shipped file reuses), one after another with ``--think`` seconds between a
job's end and the next submission, then waits until no sampled hit waits for its audit. Prints the jobs' device seconds
(the engine's own time per job), the audits' (preempted runs included) and the audits' share of both.

    python scripts/audit_cost.py --requests 40 --steps 32 --audit 0.1 --budget 0.1
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

SCENES = [f"a {size} {colour} {shape} {motion} on {place}" for size in ("small", "big")
          for colour in ("red", "blue", "green") for shape in ("ball", "box")
          for motion in ("moving left", "moving right") for place in ("grass", "snow")]


def stream(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out, seen = [], []
    for i in range(n):
        if seen and rng.random() < 0.6:
            out.append((rng.choice(seen), 1000 + i))   # a re-roll: an earlier prompt, a new seed
        else:
            p = rng.choice(SCENES)
            seen.append(p)
            out.append((p, i))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--audit", type=float, default=0.1)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--think", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from carnator.service.server import ServeConfig, Service

    with tempfile.TemporaryDirectory(prefix="carnator-audit-cost-") as tmp:
        svc = Service(ServeConfig(cache_dir=tmp, audit=args.audit, audit_budget=args.budget, audit_seed=args.seed))
        svc.start()
        t_start = time.monotonic()
        jobs = []
        try:
            for prompt, seed in stream(args.requests, args.seed):
                params = {"prompt": prompt, "seed": seed, "num_inference_steps": args.steps, "policy": "carnator",
                          "cache": "reuse", "store": True}
                for k in ("negative_prompt", "num_frames", "height", "width", "guidance_scale"):
                    params[k] = None
                svc.validate(params, "default")
                job, _ = svc.store.submit("default", params)
                svc.pool.notify()
                while (j := svc.store.get("default", job.id)).status not in ("completed", "failed", "cancelled"):
                    time.sleep(0.02)
                jobs.append(j)
                time.sleep(args.think)
            t_stream = time.monotonic() - t_start
            while svc.auditor.report()["pending"]:
                time.sleep(0.2)
            rep = svc.auditor.report()
        finally:
            svc.stop()
    job_s = sum(j.stats["seconds"] for j in jobs if j.stats)
    tiers = {t: sum(1 for j in jobs if j.stats and j.stats["tier"] == t) for t in ("exact", "reuse", "miss")}
    misses = [j.stats["seconds"] for j in jobs if j.stats and j.stats["tier"] == "miss"]
    out = {
        "command": "python scripts/audit_cost.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.machine(),
        "jobs": len(jobs), "tiers": tiers, "stream_seconds": round(t_stream, 1), "job_device_seconds": round(job_s, 2),
        "miss_mean_seconds": round(sum(misses) / max(1, len(misses)), 3),
        "audit_seconds": rep["seconds"], "audits": rep["counts"],
        "audit_share": round(rep["seconds"] / (job_s + rep["seconds"]), 4) if job_s else None,
        "tiers_live": rep["tiers"],
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
