#!/usr/bin/env python3
"""Sweep one carnator knob on the embedded world: quality and speed of forced reuses at each value.

    python lab/scripts/sweep_knob.py --knob resume_step --values 10,15,20,25,30,35 [-n 48] [--out sweep.jsonl]
    python lab/scripts/sweep_knob.py --knob p --values 0.5,0.7,0.8,0.9,0.97 [-n 40] [--out sweep_p.jsonl]
    python lab/scripts/sweep_knob.py --knob parts --values full,nomasks,nowindow,none --kinds reroll,reword [-n 24]

Pairs as `carnator calibrate` draws them (train split, edit kinds in turn). For each pair the target
is generated dense; for each value the source request is generated and cached under that value
(once for ``resume_step`` and ``parts``, once per value for ``p``, the attention-mass fraction its block
masks are recorded with), and the target reuses it with the thresholds open (every pair that passes recall and
the noun filter reuses; the target is not stored). Printed per value: reuses, mean fidelity and
artifact of the reuse minus dense (with the standard error), the share the calibration rule calls
acceptable, mean mask density, and the DiT and end-to-end speedups over the same pair's dense run.
``parts`` ablates the reuse's restrictions: ``full`` applies the source's block masks on any device
(``SparseConfig.apply = "always"``; the default "auto" applies them only where a block-sparse kernel runs),
``nomasks`` attends densely, ``nowindow`` recomputes every token in every layer (masks applied), ``none``
neither, ``exact`` / ``estimate`` record the source's masks from the exact block mass / the pooled
estimate (``full`` uses ``SparseConfig.mass``'s default); the source clip's own judge scores are
printed beside them (a reuse of an unchanged scene cannot beat its source by much).
Rows are appended to --out as they finish, and a rerun with the same --out skips them.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--knob", choices=["resume_step", "p", "parts"], default="resume_step")
    ap.add_argument("--kinds", default=None, help="only these edit kinds (comma-separated; default all)")
    ap.add_argument("--values", default="10,15,20,25,30")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="sweep.jsonl")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import diffusers

    from carnator import Carnator, EngineConfig
    from carnator_lab.pairs import make_pairs
    from carnator.embedded.judge import shapes_rule
    from carnator.policies.carnator import CarnatorConfig, CarnatorPolicy
    from carnator.reuse import Thresholds
    from carnator.embedded.world.judge import judge

    diffusers.utils.logging.disable_progress_bar()
    part_names = ("full", "nomasks", "nowindow", "none", "exact", "estimate")
    cast = {"resume_step": int, "p": float, "parts": str}[args.knob]
    values = [cast(x) for x in args.values.split(",")]
    if args.knob == "parts" and not set(values) <= set(part_names):
        ap.error(f"--knob parts takes values from {', '.join(part_names)}")
    one_source = args.knob != "p"  # p changes what the source records: a source per value
    tmp = Path(tempfile.mkdtemp(prefix="sweep-resume-"))
    # The resume-step sweep reuses one source at every value: keep every step of its trajectory.
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp / "cache", device=args.device, config=EngineConfig(capture_steps="all"))
    open_tau = tmp / "open.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf).save(open_tau, model_id=eng.model_identity)
    base = eng.policy("carnator").cfg
    masks, nomasks = replace(base.sparse, apply="always"), replace(base.sparse, apply="never")
    parts = {"full": {"sparse": masks}, "nomasks": {"sparse": nomasks}, "nowindow": {"sparse": masks, "window": (0.0, 0.0)},
             "none": {"sparse": nomasks, "window": (0.0, 0.0)}, "exact": {"sparse": replace(masks, mass="exact")},
             "estimate": {"sparse": replace(masks, mass="estimate")}}

    def setting(v):
        if args.knob == "resume_step":
            return {"resume_step": v}
        if args.knob == "parts":
            return parts[v]
        return {"sparse": replace(base.sparse, p=v)}

    for v in values:
        eng._policies[f"source{v}"] = CarnatorPolicy(CarnatorConfig(**{**vars(base), **setting(v)}))
        eng._policies[f"forced{v}"] = CarnatorPolicy(CarnatorConfig(**{**vars(base), "thresholds": str(open_tau), **setting(v)}))
    eng.generate("a red ball on grass", seed=0, policy="dense", tenant="warmup", store=False)  # first-call costs, not timed
    rule = shapes_rule()
    out = Path(args.out)
    done = {json.loads(line)["i"] for line in out.read_text().splitlines()} if out.exists() else set()
    with open(out, "a") as log:
        kinds = set(args.kinds.split(",")) if args.kinds else None
        for i, (kind, src, s_seed, tgt, t_seed) in enumerate(make_pairs(args.n, seed=args.seed)):
            if i in done or (kinds is not None and kind not in kinds):
                continue
            dense = eng.generate(tgt, seed=t_seed, policy="dense", tenant="dense", store=False)
            jd = judge(dense.frames, tgt)
            row = {"i": i, "kind": kind, "knob": args.knob, "dense": {"fidelity": jd.fidelity, "artifact": jd.artifact,
                                                                      "dit": dense.stats.timings["dit"], "total": dense.stats.timings["total"]}, "reuse": {}}
            for v in values:
                own = not one_source or "sparse" in setting(v)  # this value records its own source
                tenant = f"sweep{i}-{v}" if own else f"sweep{i}"
                if v == values[0] or own:
                    js = judge(eng.generate(src, seed=s_seed, policy=f"source{v}", tenant=tenant).frames, src)
                    eng.flush()  # written behind on a GPU: stored before the forced reuse reads it
                    row["source"] = {"fidelity": js.fidelity, "artifact": js.artifact}
                res = eng.generate(tgt, seed=t_seed, policy=f"forced{v}", tenant=tenant, store=False)
                if own:
                    eng.store.clear(tenant=tenant)
                if not res.stats.hit:
                    row["reuse"][v] = None
                    continue
                jr = judge(res.frames, tgt)
                row["reuse"][v] = {"fidelity": jr.fidelity, "artifact": jr.artifact, "dit": res.stats.timings["dit"],
                                   "total": res.stats.timings["total"], "active_fraction": res.stats.active_fraction,
                                   "mask_density": res.stats.mask_density,
                                   "acceptable": bool(rule.acceptable(vars(jr), vars(jd)))}
            eng.store.clear(tenant=f"sweep{i}")
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"{i + 1}/{args.n} {kind:7s} source {row['source']['fidelity'] - jd.fidelity:+.2f} " + " ".join(f"{v}:{'-' if u is None else round(u['fidelity'] - jd.fidelity, 2)}" for v, u in row["reuse"].items()), flush=True)

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in rows if r.get("knob", "resume_step") == args.knob]
    print(f"\n{len(rows)} pairs; reuse minus dense, mean (standard error); rule: fidelity >= dense - {rule.deltas['fidelity']}, artifact <= dense + {rule.deltas['artifact']}")
    src = [(row["dense"], row["source"]) for row in rows if "source" in row]
    if src:
        df = np.array([u["fidelity"] - d["fidelity"] for d, u in src])
        print(f"source clip (its own prompt) minus dense (the target): fidelity {df.mean():+.3f} over {len(src)} pairs")
    print(f"| {args.knob} | reuses | fidelity | artifact | acceptable | mask density | DiT speedup | E2E speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for v in values:
        got = [(row["dense"], row["reuse"][str(v)]) for row in rows if row["reuse"].get(str(v))]
        if not got:
            print(f"| {v} | 0 | | | | | | |")
            continue
        df = np.array([u["fidelity"] - d["fidelity"] for d, u in got])
        da = np.array([u["artifact"] - d["artifact"] for d, u in got])
        se = lambda x: x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")  # noqa: E731
        acc = np.mean([u["acceptable"] for _, u in got])
        sp_dit = np.mean([d["dit"] / u["dit"] for d, u in got])
        sp_e2e = np.mean([d["total"] / u["total"] for d, u in got])
        dens = np.mean([u.get("mask_density") or 0.0 for _, u in got])
        print(f"| {v} | {len(got)} | {df.mean():+.3f} ({se(df):.3f}) | {da.mean():+.3f} ({se(da):.3f}) | {acc:.0%} | {dens:.2f} | {sp_dit:.2f}x | {sp_e2e:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
