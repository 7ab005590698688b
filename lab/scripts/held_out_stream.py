"""Issue 26: the held-out W = 1,000 / S = 300 stream (lab trace seed 0, held-out split; calibration used the train
split) for dense and carnator variants that differ only in how they decide, sharing one warm cache.

The warm cache is filled once (W requests generated as misses by the carnator policy: probe, signature, latents from
the resume step on; the admission judge scores every clip) by ``--jobs`` processes; each variant then streams the S
test requests, in order, in one process of its own, over its own copy of that cache (blobs hard-linked, the index
copied), so every variant starts from the same W completed requests. Dense streams the same requests without a cache.
Optionally (``--sources``) part A of ``source_scores.py`` (the judge's scores of the calibration sources' own clips)
runs beside the warm fill. Rows go to ``OUT/requests.jsonl`` as they finish; ``OUT/summary.json`` at the end.

Variants (``--variants``, comma-separated):
  content   the content rule (d_content = 0, signature thresholds off), every entry a source (no gate)
  gate      the content rule, and only sources whose own clip passed the admission gate (lever 1 on top of lever 3);
            since 2026-12-06 07:40 UTC with recall by content (``CarnatorConfig.content_recall``, on by default)
  topk      ``gate`` with recall by sentence only (the sentence top-10; ``gate`` before recall by content)
  fast      ``gate`` with the write-behind store and the probe skipped (``probe`` "auto"; lever 5)
  fast40    ``fast`` resuming at step 40 (fast45: 45) instead of 30 (lever 2: a later tier for same-content reuse)
  own       ``gate`` with ``own_sample`` 1 (lever 6)
  shipped   the shipped files with ``admitted_only`` off, i.e. ``thresholds-nogate.json`` (before 2026-12-06 04:27 UTC
            this was the shipped file itself, the same rule)
  sentence  ``default`` with recall by sentence and same content only (an edit's source not also found one edit away)
  default   what a user gets: the shipped (gated) file at its certified resume step (45 of 50), every setting default
            (since 2026-12-06 17:20 UTC the probe is skipped under a content-only file by default; since 21:00 UTC
            recall reads the same-content entries without a sentence embedding and write-behind is on for CUDA)
  sync      ``default`` with ``write_behind`` off
  content45 the default before risk tiers (lab/notebook/thresholds-embedded-content45.json: same content only, step 45)
  nirvana   the NIRVANA baseline (its entries are filled into the same warm cache beside carnator's)
  resample  dense at another seed of each request (seed + calibrate's NOISE_SEED_OFFSET): a hit is unsafe in excess
            when it fails the rule against dense and this sample passes (``calibrate --risk excess``'s label)

Every variant's hits are also judged by their kind's own rule (an edit's asked attribute within 0.05, as the edit tiers
are calibrated), the summary's ``unsafe_hits_kind_rule`` (and ``unsafe_hits_excess`` with ``resample``).

    python3 lab/scripts/held_out_stream.py --out DIR [--warm 1000 --test 300 --jobs 12 --variants content,gate,fast]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

VARIANTS = {
    "content": ({}, {"admitted_only": False, "probe": "always"}),
    "gate": ({}, {"admitted_only": True, "probe": "always"}),
    "topk": ({}, {"admitted_only": True, "content_recall": False, "probe": "always"}),
    "fast": ({"write_behind": True}, {"admitted_only": True, "probe": "auto"}),
    "fast40": ({"write_behind": True}, {"admitted_only": True, "probe": "auto", "resume_step": 40}),
    "fast45": ({"write_behind": True}, {"admitted_only": True, "probe": "auto", "resume_step": 45}),
    "own": ({}, {"admitted_only": True, "own_sample": 1.0, "probe": "always"}),
    "shipped": ({}, {"admitted_only": False, "thresholds": None}),
    "default": ({}, {"thresholds": None}),
    "sync": ({"write_behind": False}, {"thresholds": None}),
    # the default with recall by sentence and same content only (before 2026-12-07 21:40 UTC): an edit finds its source
    # only among the top_k nearest sentences, not also one edit away by content (recall_near off in its process)
    "sentence": ({}, {"thresholds": None}),
    # the default before risk tiers: the same-content file at step 45 (re-rolls and rewordings; every edit a miss)
    "content45": ({}, {"thresholds": str(HERE.parent / "notebook" / "thresholds-embedded-content45.json")}),
}
#: the step the warm fill keeps latents from (its entries serve every variant's earliest resume: an edit tier's 5)
FILL_RESUME = int(os.environ.get("FILL_RESUME", "5"))


def engine(cache, device, *, write_behind=None, capture_steps="auto", **carnator):
    from carnator import Carnator
    from carnator.engine import EngineConfig

    cfg = EngineConfig(cuda_graphs=device.startswith("cuda"), latent_dtype="float16", write_behind=write_behind,
                       capture_steps=capture_steps, admission_judge="shapes",
                       policy_options={"carnator": carnator} if carnator else {})
    return Carnator.from_pretrained("embedded", str(cache), device=device, config=cfg)


def fill(args):
    k, n, trace_path, cache, device, policies = args
    os.environ["OMP_NUM_THREADS"] = "1"
    from carnator.bench.traces import Trace

    trace = Trace.load(trace_path)
    # entries every variant can reuse: a signature (the probe) and the latents from step FILL_RESUME - 1 on
    # (named, not "auto": a policy keeps only the latents its own tiers read, and a frame tier reads one)
    eng = engine(cache, device, write_behind=False, probe="always", resume_step=FILL_RESUME,
                 capture_steps=list(range(FILL_RESUME - 1, 50)))
    for r in trace.warm[k::n]:
        for policy in policies:
            eng.generate(r.prompt, seed=r.seed, policy=policy, cache="off")
    return k


def clone(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "blobs":
            shutil.copytree(f, dst / "blobs", copy_function=os.link)
        elif f.is_dir():
            shutil.copytree(f, dst / f.name)
        elif f.suffix == ".sqlite":
            with sqlite3.connect(f) as a, sqlite3.connect(dst / f.name) as b:
                a.backup(b)
        elif not f.name.startswith("bank.sqlite-"):
            shutil.copy2(f, dst / f.name)


def stream(name, trace_path, cache, device, tau_path, out_path, deadline=math.inf):
    os.environ["OMP_NUM_THREADS"] = "1"
    from carnator.bench.traces import Trace
    from carnator.judges import get_judge
    from carnator.signature.content import change_kind

    from carnator.calibrate.run import resample_seed

    trace = Trace.load(trace_path)
    if name == "sentence":
        from carnator.policies.carnator import CarnatorPolicy

        CarnatorPolicy.recall_near = lambda self: ()  # type: ignore[method-assign]  # this stream's own process
    if name in ("dense", "nirvana"):
        eng, policy = engine(cache, device), name
    elif name == "resample":
        eng, policy = engine(cache, device), "dense"
    else:
        ecfg, pcfg = VARIANTS[name]
        pcfg = dict(pcfg)
        if "thresholds" not in pcfg:
            pcfg["thresholds"] = str(tau_path)
        elif pcfg["thresholds"] is None:
            del pcfg["thresholds"]
        eng, policy = engine(cache, device, **ecfg, **pcfg), "carnator"
    judge = get_judge("shapes")
    with open(out_path, "a") as log:
        for i, r in enumerate(trace.test):
            if time.time() > deadline:
                break   # a cut run still has every variant's rows for a prefix of the same test order
            seed = resample_seed(r.seed) if name == "resample" else r.seed
            res = eng.generate(r.prompt, seed=seed, policy=policy, store=name not in ("dense", "resample"))
            s = res.stats
            row = {"policy": name, "i": i, "kind": r.kind, "hit": bool(s.hit), "exact": bool(s.exact_hit),
                   "e2e": s.timings["total"], "dit": s.timings.get("dit", 0.0),
                   # (a copy: a write-behind store may still add to the timings)
                   "timings": {k: float(v) for k, v in dict(s.timings).items()}, **judge.score(res.frames, r.prompt),
                   "reason": s.reason, "admitted": s.notes.get("admitted")}
            base = trace.warm[r.source].prompt if getattr(r, "source", None) is not None else None
            src = eng.store.get(s.source_id) if s.hit and s.source_id else None
            if src is not None:
                row["source_prompt"] = src.prompt
                try:  # how far the hit is from the clip it reused (0: the cached clip itself)
                    v = eng.store.load(s.source_id, ["video"])["video"].numpy().astype(np.float32)
                    row["vs_source"] = float(np.abs(res.frames.astype(np.float32) - v).mean())
                except Exception:  # noqa: BLE001 - a diagnostic only
                    pass
                row["change"] = change_kind(r.prompt, src.prompt, eng.content(r.prompt), eng.content(src.prompt))
            elif base is not None:
                row["change"] = change_kind(r.prompt, base, eng.content(r.prompt), eng.content(base))
            log.write(json.dumps(row) + "\n")
            log.flush()
    eng.flush()


#: the attribute each edit kind asks for: its own rule is the stream's rule with that score within 0.05 (as the edit
#: tiers are calibrated: ``--tier-quality colour:color=0.05`` ...)
KIND_SCORE = {"colour": "color", "object": "shape", "small-object": "shape", "size": "size", "motion": "motion",
              "place": "background"}


def kind_rules(rule) -> dict:
    from carnator.judges import QualityRule

    return {k: QualityRule({**rule.deltas, sc: 0.05}, {**rule.directions, sc: 1}) for k, sc in KIND_SCORE.items()}


def summarize(rows, names, rule):
    dense = {r["i"]: r for r in rows if r["policy"] == "dense"}
    other = {r["i"]: r for r in rows if r["policy"] == "resample"}
    own = kind_rules(rule)

    def fails(r, by_kind=False):
        return not (own.get(str(r.get("change")), rule) if by_kind else rule).acceptable(r, dense[r["i"]])

    def fails_excess(r):   # calibrate's excess label under its kind's rule: fails where another dense sample passes
        from carnator.calibrate.run import label

        if r["i"] not in other:
            return False
        pair = {"i": r["i"], "reuse": r, "dense": dense[r["i"]], "dense_other": other[r["i"]]}
        return not label(pair, own.get(str(r.get("change")), rule), "excess")

    out = {}
    for name in names:
        rs = [r for r in rows if r["policy"] == name and r["i"] in dense]
        if not rs:
            continue
        hits = [r for r in rs if r["hit"]]
        unsafe = [r for r in hits if fails(r)]
        by = {}
        for key in ("kind", "change"):
            t = {}
            for r in rs:
                k = str(r.get(key))
                e = t.setdefault(k, {"requests": 0, "hits": 0, "unsafe": 0, "unsafe_kind_rule": 0})
                e["requests"] += 1
                e["hits"] += int(r["hit"])
                e["unsafe"] += int(r["hit"] and fails(r))
                e["unsafe_kind_rule"] += int(r["hit"] and fails(r, True))
                if other:
                    e["unsafe_excess"] = e.get("unsafe_excess", 0) + int(r["hit"] and fails_excess(r))
            by[key] = t
        sd = sum(dense[r["i"]]["e2e"] for r in rs)
        out[name] = {
            "requests": len(rs), "hit_rate": len(hits) / len(rs), "hits": len(hits), "unsafe_hits": len(unsafe),
            "unsafe_hits_kind_rule": sum(fails(r, True) for r in hits),
            **({"unsafe_hits_excess": sum(fails_excess(r) for r in hits)} if other else {}),
            "workload_e2e_speedup": sd / sum(r["e2e"] for r in rs),
            "workload_dit_speedup": sum(dense[r["i"]]["dit"] for r in rs) / max(sum(r["dit"] for r in rs), 1e-9),
            "hit_e2e_speedup": (sum(dense[r["i"]]["e2e"] for r in hits) / sum(r["e2e"] for r in hits)) if hits else None,
            "miss_e2e_over_dense": (sum(r["e2e"] for r in rs if not r["hit"]) / max(sum(dense[r["i"]]["e2e"] for r in rs if not r["hit"]), 1e-9)),
            "fidelity_all": float(np.mean([r["fidelity"] for r in rs])),
            "fidelity_hits": float(np.mean([r["fidelity"] for r in hits])) if hits else None,
            "dense_fidelity_on_hits": float(np.mean([dense[r["i"]]["fidelity"] for r in hits])) if hits else None,
            "mean_timings": {k: float(np.mean([r["timings"].get(k, 0.0) for r in rs])) for k in
                             ("recall", "probe", "signature", "decision", "dit", "decode", "store", "admission_judge", "total")},
            "by": by,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--variants", default="content,gate,fast")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--root", type=Path, default=Path("/tmp/held-out-stream"))
    ap.add_argument("--sources", type=Path, help="run source_scores.py part A on this pair list beside the warm fill")
    ap.add_argument("--sources-jobs", type=int, default=4)
    ap.add_argument("--own-n", type=int, default=0, help="source_scores.py part B's prompts, beside the warm fill")
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("--budget", type=float, default=math.inf, help="seconds from the start after which streams stop")
    ap.add_argument("--sequential", action="store_true",
                    help="one stream at a time (each alone on the machine: no stream's timings share it with another's)")
    ap.add_argument("--keep-warm", action="store_true", help="reuse ROOT/warm from an earlier run of the same trace")
    ap.add_argument("--fill-nirvana", action="store_true",
                    help="fill NIRVANA's entries into the warm cache even when it does not stream (a --keep-warm run may)")
    args = ap.parse_args()
    from carnator.judges import QualityRule

    rule = QualityRule({"fidelity": 0.25, "artifact": 0.1}, {"fidelity": 1, "artifact": -1})
    names = ["dense", *args.variants.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "requests.jsonl"
    if not args.summarize_only:
        from carnator.bench.traces import Trace  # noqa: F401
        from carnator.reuse import Thresholds
        from carnator_lab.traces import world_trace

        warm = args.root / "warm"
        keep = args.keep_warm and warm.is_dir()
        if keep:
            for old in args.root.glob("c-*"):
                shutil.rmtree(old)
        else:
            shutil.rmtree(args.root, ignore_errors=True)
            args.root.mkdir(parents=True)
        trace_path = args.root / "trace.json"
        world_trace(args.warm, args.test, seed=0).save(trace_path)
        t0 = time.time()
        side = None
        if args.sources is not None:
            side = subprocess.Popen([sys.executable, str(HERE / "source_scores.py"), "--pairs", str(args.sources), "--out",
                                     str(args.out), "--jobs", str(args.sources_jobs), "--own-n", str(args.own_n), "--device", args.device,
                                     "--root", str(args.root / "sources"), "--same-content"])
        probe = engine(args.root / "probe", args.device)
        tau_path = args.root / "content.json"
        Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0).save(
            tau_path, model_id=probe.model_identity, reading=probe.policy("carnator").reading(), meta={"certified": False})
        del probe
        ctx = mp.get_context("spawn")
        # one process writes the index first (creates the cache), then the rest join
        if not keep:
            with ctx.Pool(args.jobs) as pool:
                fills = ["carnator", "nirvana"] if "nirvana" in names or args.fill_nirvana else ["carnator"]
                list(pool.imap_unordered(fill, [(k, args.jobs, str(trace_path), str(warm), args.device, fills)
                                                for k in range(args.jobs)]))
            print(f"warm cache filled in {time.time() - t0:.0f}s", flush=True)
        procs = []
        for name in names:
            cache = args.root / f"c-{name}"
            if name != "dense":
                clone(warm, cache)
            p = ctx.Process(target=stream, args=(name, str(trace_path), str(cache), args.device, str(tau_path), str(log_path),
                                                 t0 + args.budget))
            p.start()
            procs.append(p)
            if args.sequential:
                p.join()
        for p in procs:
            p.join()
        print(f"test streams run in {time.time() - t0:.0f}s", flush=True)
        if side is not None:
            try:
                side.wait(timeout=max(1.0, t0 + args.budget + 20 - time.time()))
            except subprocess.TimeoutExpired:   # its rows so far are in OUT/sources.jsonl
                print("source_scores.py cut at the budget", flush=True)
                side.kill()
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    summary = summarize(rows, names, rule)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, m in summary.items():
        more = f"kind rule {m['unsafe_hits_kind_rule']}" + (f", excess {m['unsafe_hits_excess']}" if "unsafe_hits_excess" in m else "")
        print(f"{name:8s} n={m['requests']} hits={m['hits']} ({100 * m['hit_rate']:.0f}%) unsafe={m['unsafe_hits']} ({more}) "
              f"workload x{m['workload_e2e_speedup']:.2f} hit x{(m['hit_e2e_speedup'] or 0):.2f} miss/dense {m['miss_e2e_over_dense']:.3f} "
              f"fid all {m['fidelity_all']:.3f} hits {m['fidelity_hits'] or 0:.3f} (dense {m['dense_fidelity_on_hits'] or 0:.3f})", flush=True)


if __name__ == "__main__":
    main()
