"""Run policies over one trace with one engine model, each policy on its own cache, and report.

Per policy: hit rate; E2E and DiT latency and speedup vs dense (whole workload and hits only);
quality (each judge score the rule names) on all requests and on hits; unsafe-hit rate (hits the
quality rule rejects against dense on the same request); cache
bytes per entry. Results are appended per request to a JSONL file so an interrupted run resumes.

The warm cache of each policy is the trace's W warm requests generated as misses (dense, recording what the
policy stores), so every policy's test stream starts from the same completed requests, as in the paper's
protocol (1,000 cached + 300 test requests).

Policies can run in parallel processes over one ``out`` (``carnator bench --jobs N``): first the warm caches are
filled by workers running ``run_bench(..., [policy], warm_shard=(k, n), only=True, report=False)``, several
per policy (the fills are independent); then each policy's test stream runs in one worker (its requests
depend on the entries its earlier ones stored; dense's too, so all streams share the machine alike), all
appending rows to the shared requests.jsonl (one ``write`` per line in append mode); a last ``run_bench`` over every policy finds
all rows done and writes the report.

Outputs in ``out``: trace.json, requests.jsonl, report.json, report.md and report.html (see
:mod:`carnator.bench.report`). With ``keep_clips=N`` every test request's clip is written as a
small GIF under ``clips/<policy>/`` while the run goes on; at the end only the clips of the first
N hits of each non-dense policy are kept, for dense and every policy, so the report can show them
side by side (a policy added to a finished run later finds those dense clips pruned).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..judges import Judge, QualityRule
from .report import clip_requests, to_markdown, write_html
from .traces import Trace

__all__ = ["run_bench", "summarize", "thumbnail", "to_markdown"]


def run_bench(engine_factory, trace: Trace, policies: list[str], out: Path, *, judge: Judge, rule: QualityRule,
              steps: int | None = None, settings: dict | None = None, keep_clips: int = 0, progress=print,
              only: bool = False, report: bool = True, warm_shard: tuple[int, int] | None = None) -> dict | None:
    """Run ``policies`` (dense first, always included unless ``only``) and, with ``report``, summarize and write
    the report; without ``report`` (a worker of a parallel run) return None once the rows are written.

    The warm cache: every warm request generated as a miss (``cache="off"``: dense, recording and storing what the
    policy keeps), so each policy starts its test stream from the same W completed requests. Requests already in
    the cache are skipped (an interrupted fill resumes); ``warm_shard=(k, n)`` fills only requests k, k + n, ...
    and returns (parallel fills of one cache)."""
    from ..video import write_video

    out.mkdir(parents=True, exist_ok=True)
    trace.save(out / "trace.json")
    log_path = out / "requests.jsonl"
    kw = dict(settings or {})
    dense_frames: dict[int, np.ndarray] = {}  # dense's clip of each test request: the reference of reference scores
    done: dict[tuple[str, int | str], dict] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["policy"], r["i"])] = r
    order = list(dict.fromkeys(policies)) if only else ["dense"] + [p for p in policies if p != "dense"]
    with open(log_path, "a") as log:
        for pol in order:
            cache = out / "caches" / pol
            started = cache / ".test-started"
            if not any(k[0] == pol for k in done) and started.exists():
                shutil.rmtree(cache)  # test-stream entries of a run whose rows were lost: start again from nothing
            eng = engine_factory(cache)
            if pol != "dense" and not (cache / ".warm").exists():
                k0, n = warm_shard or (0, 1)
                todo = trace.warm[k0::n]
                for k, r in enumerate(todo):
                    if not eng.is_cached(r.prompt, seed=r.seed, num_inference_steps=steps, **kw):
                        eng.generate(r.prompt, seed=r.seed, policy=pol, num_inference_steps=steps, cache="off", **kw)
                    progress(f"[{pol}] warm {k + 1}/{len(todo)}" + (f" (shard {k0 + 1} of {n})" if n > 1 else ""))
                if hasattr(eng, "flush"):
                    eng.flush()  # write-behind stores: the warm cache is complete before it counts as filled
                if warm_shard is None:
                    (cache / ".warm").write_text("ok")
            if warm_shard is not None:
                continue
            if pol != "dense":
                started.write_text("ok")
            for i, r in enumerate(trace.test):
                if (pol, i) in done:
                    continue
                res = eng.generate(r.prompt, seed=r.seed, policy=pol, num_inference_steps=steps, store=pol != "dense", **kw)
                ref = dense_frames.get(i) if pol != "dense" else res.frames
                scores = judge.score(res.frames, r.prompt, reference=ref)
                if pol == "dense":
                    dense_frames[i] = res.frames
                s = res.stats
                row = {"policy": pol, "i": i, "kind": r.kind, "hit": s.hit, "exact": s.exact_hit, "resume_step": s.resume_step,
                       "e2e": s.timings["total"], "dit": s.timings.get("dit", 0.0), **scores,
                       "mask_density": s.mask_density, "active_fraction": s.active_fraction}
                if s.hit and getattr(s, "source_id", None) is not None:  # which cached request it reused, and why (for per-hit analysis)
                    src = eng.store.get(s.source_id)
                    row["source_prompt"] = None if src is None else src.prompt
                    for key in ("similarity", "discrepancies"):
                        if key in getattr(s, "notes", {}):
                            row[key] = s.notes[key]
                if keep_clips > 0:
                    rel = f"clips/{pol}/{i:04d}.gif"
                    write_video(thumbnail(res.frames), out / rel)
                    row["clip"] = rel
                log.write(json.dumps(row) + "\n")
                log.flush()
                done[(pol, i)] = row
                progress(f"[{pol}] {i + 1}/{len(trace.test)} {r.kind:9s} hit={s.hit} e2e={row['e2e']:.2f}s "
                         + " ".join(f"{k}={v:.3f}" for k, v in scores.items()))
            if hasattr(eng, "flush"):
                eng.flush()
            st = eng.store.stats()
            done[(pol, "bytes")] = {"bytes_per_entry": st.bytes / max(st.count, 1)}
    if not report:
        return None
    rep = summarize(done, order, len(trace.test), rule)
    rows = [done[(pol, i)] for pol in order for i in range(len(trace.test))]
    if keep_clips > 0:
        prune_clips(out, rows, order, keep_clips)
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    (out / "report.md").write_text(to_markdown(rep))
    write_html(out, rep, rows, [r.prompt for r in trace.test])
    return rep


def thumbnail(frames: np.ndarray, max_side: int = 128, max_frames: int = 32) -> np.ndarray:
    """A small copy of a clip for the report: every k-th frame and pixel so it fits the limits."""
    frames = np.asarray(frames)
    ft = -(-frames.shape[0] // max_frames)
    fs = -(-max(frames.shape[1:3]) // max_side)
    return np.ascontiguousarray(frames[::ft, ::fs, ::fs])


def prune_clips(out: Path, rows: list[dict], order: list[str], n: int) -> list[int]:
    """Delete kept clips except those of :func:`~carnator.bench.report.clip_requests` (all policies)."""
    keep = set(clip_requests(rows, order, n))
    for pol in order:
        d = out / "clips" / pol
        if not d.is_dir():
            continue
        for f in d.glob("*.gif"):
            if not f.stem.isdigit() or int(f.stem) not in keep:
                f.unlink()
    return sorted(keep)


def summarize(done, order, n, rule: QualityRule) -> dict:
    """Per-policy metrics of a finished run; a hit is unsafe when ``rule`` rejects it against dense. For every score the
    rule names: its mean over all requests and over hits, and dense's mean over the same hits."""
    dense = {i: done[("dense", i)] for i in range(n)}
    rep = {"requests": n, "rule": rule.to_dict(), "policies": {}}
    for pol in order:
        rows = [done[(pol, i)] for i in range(n)]
        hits = [r for r in rows if r["hit"]]
        unsafe = [r for r in hits if not rule.acceptable(r, dense[r["i"]])]

        def ratio(key, sel):
            a = sum(dense[r["i"]][key] for r in sel)
            b = sum(r[key] for r in sel)
            return a / b if b > 0 else None

        m = {
            "hit_rate": len(hits) / n,
            "workload_e2e_speedup": ratio("e2e", rows), "workload_dit_speedup": ratio("dit", rows),
            "hit_e2e_speedup": ratio("e2e", hits) if hits else None, "hit_dit_speedup": ratio("dit", hits) if hits else None,
            "unsafe_hit_rate": len(unsafe) / len(hits) if hits else None,
            "bytes_per_entry": done.get((pol, "bytes"), {}).get("bytes_per_entry"),
        }
        for k in rule.directions:  # every score the rule names (deltas and floors)
            m[f"{k}_all"] = float(np.nanmean([r[k] for r in rows]))
            m[f"{k}_hits"] = float(np.nanmean([r[k] for r in hits])) if hits else None
            m[f"dense_{k}_on_hits"] = float(np.nanmean([dense[r["i"]][k] for r in hits])) if hits else None
        rep["policies"][pol] = m
    return rep
