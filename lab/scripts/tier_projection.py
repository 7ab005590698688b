"""A held-out stream's tier mix at real size: each request of one variant costed by the bench-scale replay of its plan.

    python3 lab/scripts/tier_projection.py --requests STREAM.jsonl.gz --scale REPORT.json [--variant default]
        [--what-if colour,object,size:5]
    python3 lab/scripts/tier_projection.py --requests STREAM.jsonl.gz --costs dense=66.93,miss=67.41,45=10.12,...

The stream (held_out_stream.py rows) says what each request got on the embedded model: a miss, an exact hit, or a
hit by a tier resuming at step r of 50 (read from the row's reason). ``carnator-lab bench-scale --frame-steps ...``
(random weights, Wan2.1-1.3B 480p) times a frame-tier hit from each such step, a miss under frame tiers (no probe,
masks captured) and dense. The projection replaces each request's embedded cost by its real-size cost relative to
dense: workload speedup = requests / sum of (cost / dense). An exact hit returns a stored video: its cost is taken
as the stream's own exact-hit seconds over the real-size dense E2E (model-size independent, an assumption stated in
the output). ``--what-if KINDS:STEP`` also costs the misses of those kinds as frame-tier hits from STEP: what a tier
would pay if it certified (it did not; the output says so). ``--costs`` gives the same E2E seconds by hand (dense,
miss, and STEP=seconds per frame-tier step), as a bench-scale run printed them, where its report file is not at hand.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

STEP = re.compile(r"from step (\d+) of (\d+)")
STEP_50 = re.compile(r"resumes at step (\d+)")   # NIRVANA's reason (of the 50 steps the stream runs)


def load_rows(path: Path, variant: str) -> list[dict]:
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        return [r for r in map(json.loads, f) if r.get("policy") == variant]


def resume_step(row: dict, default: int | None = None) -> int | None:
    """The step a hit resumed from, read from its reason; ``default`` where the reason names none (a file certified
    at one step, as the default before tiers: its ``meta.resume.step``)."""
    reason = row.get("reason") or ""
    m = STEP.search(reason)
    if m is not None:
        return round(int(m.group(1)) * 50 / int(m.group(2)))
    m = STEP_50.search(reason)
    return int(m.group(1)) if m is not None else default


def project(rows: list[dict], scale: dict, what_if: tuple[set[str], int] | None = None, default_step: int | None = None) -> dict:
    dense = scale["dense"]["e2e_seconds"]
    tier_cost = {t["frame_step"]: t["e2e_seconds"] / dense for t in scale["frame_tiers"]}
    miss_cost = scale["frame_miss"]["e2e_seconds"] / dense
    exact_s = [r["e2e"] for r in rows if r.get("exact")]
    exact_cost = (sum(exact_s) / len(exact_s)) / dense if exact_s else 0.0
    by_kind: dict[str, Counter] = defaultdict(Counter)
    total, missing = 0.0, Counter()
    for r in rows:
        kind = r.get("change") or "unknown"
        c = by_kind[kind]
        c["requests"] += 1
        if r.get("exact"):
            c["exact"] += 1
            total += exact_cost
            continue
        step = resume_step(r, default_step) if r.get("hit") else None
        if step is None and what_if is not None and kind in what_if[0]:
            step = what_if[1]
            c["what_if"] += 1
        if step is None:
            total += miss_cost
            continue
        if step not in tier_cost:
            missing[step] += 1
            total += miss_cost
            continue
        c["hits"] += 1
        c[f"step {step}"] += 1
        total += tier_cost[step]
    n = len(rows)
    hits = sum(c["hits"] + c["exact"] for c in by_kind.values())
    return {"requests": n, "hits": hits, "hit_rate": hits / n if n else 0.0, "workload_speedup": n / total if total else 0.0,
            "cost_per_request": {"miss": miss_cost, "exact": exact_cost, **{f"frame tier from step {s}": v for s, v in sorted(tier_cost.items())}},
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "unpriced_steps": dict(missing),
            "dense_e2e_seconds": dense, "device": scale.get("device"), "model": scale["spec"]["name"], "frames": scale["config"]["frames"]}


def costs_report(spec: str) -> dict:
    """``--costs`` as the part of a bench-scale report that :func:`project` reads."""
    got = dict(item.split("=", 1) for item in spec.split(","))
    try:
        sec = {k.strip(): float(v) for k, v in got.items()}
        tiers = [{"frame_step": int(k), "e2e_seconds": v} for k, v in sec.items() if k not in ("dense", "miss")]
        return {"dense": {"e2e_seconds": sec["dense"]}, "frame_miss": {"e2e_seconds": sec["miss"]}, "frame_tiers": tiers,
                "spec": {"name": "as given (--costs)"}, "config": {"frames": None}}
    except (KeyError, ValueError) as e:
        raise SystemExit(f"tier_projection: error: --costs needs dense=S,miss=S and STEP=S items, got {spec!r} ({e})") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=Path, required=True, help="held_out_stream.py rows (requests.jsonl[.gz])")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--scale", type=Path, help="bench-scale report.json with --frame-steps")
    src.add_argument("--costs", help="dense=S,miss=S,STEP=S,...: E2E seconds as a bench-scale run printed them")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--what-if", default=None, metavar="KINDS:STEP", help="cost these kinds' misses as frame-tier hits from STEP (not certified)")
    ap.add_argument("--default-step", type=int, default=None, help="the resume step of a hit whose reason names none")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    scale = json.loads(a.scale.read_text()) if a.scale else costs_report(a.costs)
    rows = load_rows(a.requests, a.variant)
    if not rows:
        raise SystemExit(f"tier_projection: error: no rows of variant {a.variant!r} in {a.requests}")
    res = {"variant": a.variant, "shipped": project(rows, scale, default_step=a.default_step)}
    if a.what_if:
        kinds, step = a.what_if.rsplit(":", 1)
        res["what_if"] = {"kinds": kinds.split(","), "step": int(step), "certified": False,
                          **project(rows, scale, (set(kinds.split(",")), int(step)), a.default_step)}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
