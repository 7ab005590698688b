#!/usr/bin/env python3
"""Sweep carnator's resume step on the embedded world: quality and speed of forced reuses at each step.

    python scripts/sweep_resume.py [-n 40] [--steps-list 10,15,20,25,30] [--out sweep.jsonl]

Pairs as `carnator calibrate` draws them (train split, edit kinds in turn). For each pair the source
request is generated and cached, the target is generated dense, and then reused from the source at
every resume step in the list with the thresholds open (every pair that passes recall and the noun
filter reuses; nothing is stored). Printed per resume step: reuses, mean fidelity and artifact of the
reuse minus dense (with the standard error), the share the calibration rule calls acceptable, and
the DiT and end-to-end speedups over the same pair's dense run. Rows are appended to --out as they
finish, and a rerun with the same --out skips them.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--steps-list", default="10,15,20,25,30")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="sweep_resume.jsonl")
    args = ap.parse_args()

    import diffusers

    from carnator import Carnator
    from carnator.calibration import QualityRule, make_pairs
    from carnator.policies.carnator import CarnatorConfig, CarnatorPolicy
    from carnator.reuse import Thresholds
    from carnator.world.judge import judge

    diffusers.utils.logging.disable_progress_bar()
    resume_steps = [int(x) for x in args.steps_list.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="sweep-resume-"))
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp / "cache", device="cpu")
    open_tau = tmp / "open.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf).save(open_tau, model_id=eng.model_identity)
    base = eng.policy("carnator").cfg
    for r in resume_steps:
        eng._policies[f"forced{r}"] = CarnatorPolicy(CarnatorConfig(**{**vars(base), "thresholds": str(open_tau), "resume_step": r}))
    rule = QualityRule()
    out = Path(args.out)
    done = {json.loads(line)["i"] for line in out.read_text().splitlines()} if out.exists() else set()
    with open(out, "a") as log:
        for i, (kind, src, s_seed, tgt, t_seed) in enumerate(make_pairs(args.n, seed=args.seed)):
            if i in done:
                continue
            tenant = f"sweep{i}"
            eng.generate(src, seed=s_seed, policy="carnator", tenant=tenant)
            dense = eng.generate(tgt, seed=t_seed, policy="dense", tenant=tenant, store=False)
            jd = judge(dense.frames, tgt)
            row = {"i": i, "kind": kind, "dense": {"fidelity": jd.fidelity, "artifact": jd.artifact, "dit": dense.stats.timings["dit"],
                                                   "total": dense.stats.timings["total"]}, "reuse": {}}
            for r in resume_steps:
                res = eng.generate(tgt, seed=t_seed, policy=f"forced{r}", tenant=tenant, store=False)
                if not res.stats.hit:
                    row["reuse"][r] = None
                    continue
                jr = judge(res.frames, tgt)
                row["reuse"][r] = {"fidelity": jr.fidelity, "artifact": jr.artifact, "dit": res.stats.timings["dit"],
                                   "total": res.stats.timings["total"], "active_fraction": res.stats.active_fraction,
                                   "acceptable": bool(jr.fidelity >= jd.fidelity - rule.delta_fidelity and jr.artifact <= jd.artifact + rule.delta_artifact)}
            eng.bank.clear(tenant=tenant)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"{i + 1}/{args.n} {kind:7s} " + " ".join(f"r{r}:{'-' if v is None else round(v['fidelity'] - jd.fidelity, 2)}" for r, v in row["reuse"].items()), flush=True)

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"\n{len(rows)} pairs; reuse minus dense, mean (standard error); rule: fidelity >= dense - {rule.delta_fidelity}, artifact <= dense + {rule.delta_artifact}")
    print("| resume step | reuses | fidelity | artifact | acceptable | DiT speedup | E2E speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in resume_steps:
        got = [(row["dense"], row["reuse"][str(r)]) for row in rows if row["reuse"].get(str(r))]
        if not got:
            print(f"| {r} | 0 | | | | | |")
            continue
        df = np.array([u["fidelity"] - d["fidelity"] for d, u in got])
        da = np.array([u["artifact"] - d["artifact"] for d, u in got])
        se = lambda x: x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")  # noqa: E731
        acc = np.mean([u["acceptable"] for _, u in got])
        sp_dit = np.mean([d["dit"] / u["dit"] for d, u in got])
        sp_e2e = np.mean([d["total"] / u["total"] for d, u in got])
        print(f"| {r} | {len(got)} | {df.mean():+.3f} ({se(df):.3f}) | {da.mean():+.3f} ({se(da):.3f}) | {acc:.0%} | {sp_dit:.2f}x | {sp_e2e:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
