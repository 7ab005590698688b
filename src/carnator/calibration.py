"""``carnator calibrate``: risk-aware thresholds for the embedded model (PAPER step 6).

Request-cache pairs come from one of two sources (``pairs_from``):

* ``"stream"`` (default): as deployed. A warm cache of W train-split requests and a stream in the bench traces'
  mix (:func:`carnator.bench.traces.world_trace`); each stream request is paired with the first recalled warm
  request (top-K by recall-embedding cosine) that passes the noun filter - the candidate the carnator policy
  tests first (``CarnatorConfig.tested`` = 1). Requests with no such candidate are misses and make no pair.
* ``"edits"``: each pair is an edit of one scene (noun substitution, context, colour, size, motion reversal,
  rewording, re-roll) or two unrelated scenes whose nouns pass the noun filter, in the traces' proportions
  (``EDIT_MIX``). The source is always the scene the request was made from, which recall does not guarantee:
  certified on these pairs, the stream's unsafe rate came out twice the certification split's (docs/RESULTS.md).

For each pair: the cached request is generated
through the carnator policy (so it carries a signature and masks), the query is generated densely
and through a *forced* reuse of that entry (thresholds open), both are judged, and the pair is
labelled acceptable iff the reuse's prompt fidelity >= dense's - Delta and its artifact score <=
dense's + Delta'. Pairs the noun filter rejects are never reused and are skipped. Thresholds are
selected on one split and certified on the other (:func:`carnator.reuse.calibrate`).
Every pair is appended to a JSONL file as it finishes, so an interrupted run resumes; a run resumed
with another rule relabels the stored pairs from their stored scores (no generation).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .errors import CarnatorError
from .quality import QualityRule
from .reuse import CalibrationConfig, CalibrationPair, Discrepancies, Thresholds, calibrate, separation


def _edit_mix() -> tuple[str, ...]:
    # The bench traces' mix (carnator.bench.traces.MIX, shares in tenths), so that the pairs the thresholds are
    # certified on come in the proportions of the stream they serve: every run of 10 pairs holds each share.
    from .bench.traces import MIX

    return tuple(kind for kind, share in MIX for _ in range(round(share * 10)))


EDIT_MIX = _edit_mix()
UNRELATED_TRIES = 64


def calibration_pair(row: dict, acceptable: bool | None = None) -> CalibrationPair:
    """A stored calibration row (reused, with discrepancies) as a :class:`CalibrationPair`; ``acceptable``
    overrides the stored label. A context discrepancy the signature could not measure is infinite."""
    d = {k: (math.inf if v is None and k == "context" else v) for k, v in row["d"].items()}
    return CalibrationPair(Discrepancies(**d), row["acceptable"] if acceptable is None else acceptable, key=str(row["i"]))


def _unit(embedder, texts) -> np.ndarray:
    v = np.asarray(embedder(texts), dtype=np.float64)
    return v / np.linalg.norm(v, axis=1, keepdims=True).clip(1e-12)


def backfill_text(rows, embedder) -> None:
    """Give stored rows written before ``d_text`` existed their text discrepancy, 1 - the ``embedder`` cosine of
    source and target prompts (what recall scores; the policy records it from recall since)."""
    todo = [r for r in rows if r.get("d") is not None and "text" not in r["d"]]
    if todo:
        cos = (_unit(embedder, [r["source"] for r in todo]) * _unit(embedder, [r["target"] for r in todo])).sum(1)
        for r, c in zip(todo, cos):
            r["d"]["text"] = max(0.0, 1.0 - float(c))


def reused_rows(rows) -> list[dict]:
    """The stored calibration rows that select and certify: those reused with measured discrepancies, in pair
    order (the split depends on the order; workers of ``calibrate --jobs`` append out of order)."""
    return sorted((r for r in rows if r["hit"] and r["d"] is not None), key=lambda r: r["i"])


def make_pairs(n: int, seed: int = 0):
    """n (kind, source caption, source seed, target caption, target seed) tuples from the train split."""
    from .reuse import noun_diff
    from .signature.nouns import extract_nouns
    from .world.captions import caption, edit
    from .world.scene import sample_scene

    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        kind = EDIT_MIX[len(out) % len(EDIT_MIX)]
        scene = sample_scene(rng, split="train")
        if kind == "reroll":
            text = caption(scene, rng)
            out.append((kind, text, int(rng.integers(1 << 30)), text, int(rng.integers(1 << 30))))
            continue
        if kind == "unrelated":
            # A new scene, paired with an unrelated cached one that recall's noun filter would still pass to the
            # compatibility test (as the stream's unrelated requests reach it); drawn again if none is found.
            target = caption(scene, rng)
            nouns = extract_nouns(target)
            for _ in range(UNRELATED_TRIES):
                source = caption(sample_scene(rng, split="train"), rng)
                if source != target and noun_diff(nouns, extract_nouns(source)) is not None:
                    out.append((kind, source, int(rng.integers(1 << 30)), target, int(rng.integers(1 << 30))))
                    break
            continue
        try:
            e = edit(scene, kind, rng)
        except ValueError:
            continue
        out.append((kind, e.source_text, int(rng.integers(1 << 30)), e.target_text, int(rng.integers(1 << 30))))
    return out


def stream_pairs(n: int, embedder, *, warm: int = 100, top_k: int = 10, seed: int = 0):
    """n (kind, source caption, source seed, target caption, target seed) tuples as recall draws them in service:
    :func:`recall_pairs` over a trace of ``warm`` train-split warm requests and a stream in the traces' mix
    (:func:`carnator.bench.traces.world_trace`)."""
    from .bench.traces import world_trace

    trace = world_trace(warm, 6 * n + 50, seed=seed, split="train")
    out = recall_pairs(trace.warm, trace.test, embedder, top_k=top_k, n=n)
    if len(out) < n:
        raise CarnatorError(f"only {len(out)} of {len(trace.test)} stream requests found a recall candidate; {n} pairs were asked for")
    return out


def recall_pairs(warm, stream, embedder, *, top_k: int = 10, n: int | None = None):
    """Pair each ``stream`` request (:class:`~carnator.bench.traces.TraceRequest`) with its first recalled ``warm``
    request: the ``top_k`` nearest by ``embedder`` cosine (nearest first, ties by warm order, as
    :meth:`carnator.cache.CacheBank.recall`), the first whose nouns pass the noun filter - the candidate the carnator
    policy tests first (``CarnatorConfig.tested`` = 1). A request without one, or identical to it (an exact hit),
    makes no pair. Returns up to ``n`` (kind, source caption, source seed, target caption, target seed) tuples;
    ``kind`` is the stream request's, with ``"/other"`` appended when the source is not the warm request the
    edit was made from."""
    from .reuse import noun_diff
    from .signature.nouns import extract_nouns

    W, Q = _unit(embedder, [r.prompt for r in warm]), _unit(embedder, [r.prompt for r in stream])
    warm_nouns = [extract_nouns(r.prompt) for r in warm]
    out = []
    for r, q in zip(stream, Q):
        if n is not None and len(out) == n:
            break
        nouns = extract_nouns(r.prompt)
        for j in np.argsort(-(W @ q), kind="stable")[:top_k]:
            if noun_diff(nouns, warm_nouns[j]) is None:
                continue
            src = warm[j]
            if (src.prompt, src.seed) != (r.prompt, r.seed):
                kind = r.kind if r.source == j or r.kind == "unrelated" else f"{r.kind}/other"
                out.append((kind, src.prompt, src.seed, r.prompt, r.seed))
            break
    return out


def run_calibration(engine, out_dir: Path, n_pairs: int, *, steps: int | None = None, rule: QualityRule = QualityRule(),
                    cfg: CalibrationConfig = CalibrationConfig(), resume_step: int | None = None, progress=print,
                    shard: tuple[int, int] | None = None, pairs_from: str = "stream", warm: int = 100,
                    generate: bool = True) -> dict | None:
    """Generate and judge the pairs not yet in ``out_dir/pairs.jsonl``, then select and certify thresholds and write
    them (thresholds.json, calibration.json); returns the summary. ``generate=False`` (``--select-only``) generates
    nothing: it selects and certifies from every pair already there (``n_pairs`` ignored), e.g. under another rule.
    ``shard=(k, n)``: only pairs k, k + n, ... and return None without selecting (a worker of
    ``carnator calibrate --jobs n``; workers append to one pairs.jsonl).
    ``pairs_from``: "stream" (:func:`stream_pairs` over ``warm`` warm requests, recalled with the engine's
    embedder) or "edits" (:func:`make_pairs`)."""
    from .policies.carnator import CarnatorConfig, CarnatorPolicy
    from .world.judge import judge

    log_path = out_dir / "pairs.jsonl"
    if not generate and not (log_path.exists() and log_path.stat().st_size > 0):
        raise CarnatorError(f"{out_dir} holds no pairs to select from (pairs.jsonl); run without --select-only first")
    out_dir.mkdir(parents=True, exist_ok=True)
    open_tau = out_dir / "open_thresholds.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf).save(open_tau, model_id=engine.model_identity)
    base = engine.policy("carnator").cfg
    at = {"resume_step": resume_step} if resume_step else {}
    forced = CarnatorPolicy(CarnatorConfig(**{**vars(base), "thresholds": str(open_tau), **at}))
    forced.name = "carnator-forced"
    engine.use_policy(forced)
    # The source runs carnator with the same resume step, so that its entry keeps the latents the reuse reads
    # (EngineConfig.capture_steps="auto"); it is alone in its tenant, so always a miss.
    source_pol = CarnatorPolicy(CarnatorConfig(**{**vars(base), **at}))
    source_pol.name = "carnator-source"
    engine.use_policy(source_pol)
    if pairs_from not in ("stream", "edits"):
        raise CarnatorError(f"pairs_from must be 'stream' or 'edits', not {pairs_from!r}")
    reading = CarnatorPolicy(base).reading()
    # The reading is part of what a pair's discrepancies mean: a resumed run must read signatures as the first did.
    source = {"pairs_from": pairs_from, **({"warm": warm, "top_k": base.top_k} if pairs_from == "stream" else {}),
              "reading": json.loads(json.dumps(reading))}
    meta_path = out_dir / "pairs.meta.json"
    if not generate and meta_path.exists():
        # Nothing is drawn: how the stored pairs were drawn is theirs to say; only the reading must be this policy's.
        stored = json.loads(meta_path.read_text())
        if stored.get("reading") != source["reading"]:
            raise CarnatorError(f"{out_dir} holds pairs whose signatures were read as {stored.get('reading')}, not as this policy "
                                f"reads them ({source['reading']}); set the same --option carnator.FIELD values")
        source = stored
    if meta_path.exists() and json.loads(meta_path.read_text()) != source:
        raise CarnatorError(f"{out_dir} holds pairs drawn as {json.loads(meta_path.read_text())}, not {source}; use another --out")
    if not meta_path.exists():
        if log_path.exists() and pairs_from != "edits":   # pairs of a run from before pairs.meta.json: they were edits
            raise CarnatorError(f"{out_dir} holds pairs drawn as edits; use another --out")
        meta_path.write_text(json.dumps(source))
    done = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            r = json.loads(line)
            r["acceptable"] = rule.label(r)   # this run's rule: a run resumed with other deltas relabels
            done[r["i"]] = r
    if not generate:
        pairs = []
    else:
        pairs = make_pairs(n_pairs) if pairs_from == "edits" else stream_pairs(n_pairs, engine.embedder, warm=warm, top_k=base.top_k)
    with open(log_path, "a") as log:
        for i, (kind, src, s_seed, tgt, t_seed) in enumerate(pairs):
            if i in done or (shard is not None and i % shard[1] != shard[0]):
                continue
            tenant = f"calib{i}"
            engine.generate(src, seed=s_seed, policy="carnator-source", tenant=tenant, num_inference_steps=steps)
            dense = engine.generate(tgt, seed=t_seed, policy="dense", tenant=tenant, num_inference_steps=steps, store=False)
            reuse = engine.generate(tgt, seed=t_seed, policy="carnator-forced", tenant=tenant, num_inference_steps=steps, store=False)
            jd, jr = judge(dense.frames, tgt), judge(reuse.frames, tgt)
            d = reuse.stats.notes.get("discrepancies")
            row = {"i": i, "kind": kind, "source": src, "target": tgt, "hit": reuse.stats.hit, "d": d,
                   "dense": {"fidelity": jd.fidelity, "artifact": jd.artifact}, "reuse": {"fidelity": jr.fidelity, "artifact": jr.artifact},
                   "dit_dense": dense.stats.timings.get("dit"), "dit_reuse": reuse.stats.timings.get("dit"),
                   # the plan's parameters (bench-scale replays these at real sizes)
                   "resume_step": reuse.stats.resume_step, "active_fraction": reuse.stats.active_fraction,
                   "mask_density": reuse.stats.mask_density}
            # Both Early Signatures, so that other discrepancy definitions can be evaluated on these rows offline.
            src_meta = engine.store.get(reuse.stats.source_id) if reuse.stats.hit and reuse.stats.source_id else None
            row["signatures"] = {"query": reuse.stats.notes.get("signature"),
                                 "source": None if src_meta is None else src_meta.extra.get("signature")}
            row["acceptable"] = rule.label(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            done[i] = row
            engine.store.clear(tenant=tenant)
            progress(f"{i + 1}/{n_pairs} {kind:7s} hit={row['hit']} acceptable={row['acceptable']} fid {jd.fidelity:.2f}->{jr.fidelity:.2f}")
    if shard is not None:
        return None
    rows = reused_rows(done.values())
    if any("text" not in r["d"] for r in rows):
        backfill_text(rows, engine.embedder)
    if len(rows) < 2:
        raise CarnatorError(f"only {len(rows)} of {len(done)} pairs could reuse their source (the resume step must lie "
                            f"inside the steps, and the noun filter must pass); selection and certification need at least 2")
    cal_pairs = [calibration_pair(r) for r in rows]
    res = calibrate(cal_pairs, cfg)
    tau_path = out_dir / "thresholds.json"
    res.thresholds.save(tau_path, model_id=engine.model_identity, reading=reading, meta={**res.to_dict(), "rule": vars(rule), "selection_confidence": cfg.selection_confidence, "text_threshold": cfg.text,
                                 "decision_rule": cfg.rule})
    summary = {"pairs": len(done), **source, "reusable_pairs": len(rows), "acceptable": sum(r["acceptable"] for r in rows),
               "rule": vars(rule), "selection_confidence": cfg.selection_confidence, "text_threshold": cfg.text,
               "decision_rule": cfg.rule, "separation": separation(cal_pairs), "result": res.to_dict(), "thresholds_file": str(tau_path)}
    (out_dir / "calibration.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
