"""``carnator calibrate``: risk-aware thresholds for a model, its prompts and a quality judge (PAPER step 6).

Request-cache pairs ``(kind, source prompt, source seed, target prompt, target seed)`` come from the caller: a user's
prompt log paired as recall pairs requests in service (:func:`recall_pairs`: each stream request with the first
recalled warm request that passes the noun filter, the candidate the carnator policy tests first), or a pairs file.

For each pair the cached request is generated through the carnator policy (so it carries a signature and masks), the
query is generated densely and through a *forced* reuse of that entry (thresholds open), both are scored by the judge
(the reuse also against the dense clip, for reference scores), and the pair is labelled acceptable by the
:class:`~carnator.judges.QualityRule`. Thresholds are selected on one split and certified on the other
(:func:`carnator.calibrate.certify.calibrate`). Every pair is appended to a JSONL file as it finishes, so an interrupted run
resumes; a run resumed with another rule relabels the stored pairs from their stored scores (no generation).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CarnatorError
from ..judges import Judge, QualityRule
from ..reuse import Discrepancies, Thresholds
from ..reuse.tiers import KINDS, SAME_CONTENT_KINDS, Tier
from ..signature.content import change_kind
from .certify import CalibrationConfig, CalibrationPair, calibrate, certify_tiers, separation

Pair = tuple[str, str, int, str, int]

#: ``noise_floor``'s other sample of a target: its seed plus this
NOISE_SEED_OFFSET = 100_003
#: what a calibration reuse's label compares: ``pair`` the rule against the dense run of its request; ``excess`` the same,
#: and a failure counts only when another dense sample of the request passes the rule (:func:`label`)
RISKS = ("pair", "excess")


def resample_seed(seed: int) -> int:
    """The seed of a request's other dense sample (``noise_floor``, the excess risk): ``seed`` plus
    :data:`NOISE_SEED_OFFSET`, wrapped into the signed 64-bit seeds."""
    return (seed + NOISE_SEED_OFFSET + 2**63) % 2**64 - 2**63


def is_tiered(resume_steps: Sequence[int], tier_rules: Mapping[str, Any] | None, tier_scope: str) -> bool:
    """Whether a calibration run certifies risk tiers: several resume steps, or a kind's own rule or a tier scope asked
    for (one step then certifies one tier per kind)."""
    return len({int(r) for r in resume_steps}) > 1 or bool(tier_rules) or tier_scope != "auto"


def risk_problem(risk: str, *, tiered: bool, generate: bool, noise_floor: bool) -> str | None:
    """Why ``risk`` cannot label this calibration run (None: it can)."""
    if risk not in RISKS:
        return f"risk must be one of {', '.join(RISKS)}, got {risk!r}"
    if risk == "excess" and not tiered:
        return "--risk excess certifies risk tiers: give several --resume-step values, --tier-scope or --tier-quality"
    if risk == "excess" and generate and not noise_floor:
        return "--risk excess compares each reuse with another dense sample of its request: add --noise-floor"
    return None


def label(row: Mapping[str, Any], rule: QualityRule, risk: str = "pair") -> bool:
    """A calibration row's label (acceptable) under ``rule``. ``risk="pair"``: the rule on the reuse against the dense
    run of the same request. ``risk="excess"``: a reuse that fails it is still acceptable when another dense sample of
    the request (``dense_other``, :data:`NOISE_SEED_OFFSET`) fails it too. The unsafe share is then P(reuse fails and a
    fresh sample passes) >= P(reuse fails) - P(fresh sample fails), so its certified bound also bounds how much more
    often a reuse fails the rule than a fresh dense sample of the request does (the rule's sampling noise, which a
    pair label counts as unsafe, cancels)."""
    if risk not in RISKS:
        raise CarnatorError(f"risk must be one of {', '.join(RISKS)}, got {risk!r}")
    ok = rule.label(row)
    if ok or risk == "pair":
        return ok
    other = row.get("dense_other")
    if other is None:
        raise CarnatorError(f"pair {row.get('i')} has no other dense sample (dense_other): the excess risk needs rows "
                            "generated with --noise-floor")
    return not rule.acceptable(other, row["dense"])


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


def _row_key(row: Mapping, tiered: bool):
    """A stored row's key: its pair, and with several resume steps (tiers) its step too."""
    return (row["i"], row["resume_step"]) if tiered else row["i"]


def reused_rows(rows) -> list[dict]:
    """The stored calibration rows that select and certify: those reused with measured discrepancies, in pair
    order (the split depends on the order; workers of ``calibrate --jobs`` append out of order)."""
    return sorted((r for r in rows if r["hit"] and r["d"] is not None), key=lambda r: r["i"])


def recall_pairs(warm, stream, embedder, nouns, *, top_k: int = 10, n: int | None = None):
    """Pair each ``stream`` request (:class:`~carnator.bench.traces.TraceRequest`) with its first recalled ``warm``
    request: the ``top_k`` nearest by ``embedder`` cosine (nearest first, ties by warm order, as
    :meth:`carnator.cache.CacheBank.recall`), the first whose nouns pass the noun filter - the candidate the carnator
    policy tests first (``CarnatorConfig.tested`` = 1). A request without one, or identical to it (an exact hit),
    makes no pair. Returns up to ``n`` (kind, source caption, source seed, target caption, target seed) tuples;
    ``kind`` is the stream request's, with ``"/other"`` appended when the source is not the warm request the
    edit was made from."""
    from ..reuse import noun_diff

    W, Q = _unit(embedder, [r.prompt for r in warm]), _unit(embedder, [r.prompt for r in stream])
    warm_nouns = [nouns(r.prompt) for r in warm]
    out: list[tuple[str, str, int, str, int]] = []
    for r, q in zip(stream, Q):
        if n is not None and len(out) == n:
            break
        q_nouns = nouns(r.prompt)
        for j in np.argsort(-(W @ q), kind="stable")[:top_k]:
            if noun_diff(q_nouns, warm_nouns[j]) is None:
                continue
            src = warm[j]
            if (src.prompt, src.seed) != (r.prompt, r.seed):
                kind = r.kind if r.source == j or r.kind == "unrelated" else f"{r.kind}/other"
                out.append((kind, src.prompt, src.seed, r.prompt, r.seed))
            break
    return out


def seconds_per_pair(rows) -> dict[str, float]:
    """Mean wall seconds per generated pair, by part (source, dense, reuse, judge; decode and dit summed over the
    pair's three generations, inside the first three), over the rows that recorded them."""
    parts = [r["seconds"] for r in rows if isinstance(r.get("seconds"), dict) and "judge" in r["seconds"]]
    if not parts:
        return {}
    keys = ("source", "dense", "reuse", "judge", "decode", "dit")
    out = {k: round(float(np.mean([p.get(k, 0.0) for p in parts])), 4) for k in keys}
    out["total"] = round(out["source"] + out["dense"] + out["reuse"] + out["judge"], 4)
    out["pairs"] = len(parts)
    return out


def run_calibration(engine, out_dir: Path, pairs: Sequence[Pair] | None, *, judge: Judge, rule: QualityRule,
                    source: Mapping | None = None, steps: int | None = None, settings: Mapping | None = None,
                    cfg: CalibrationConfig = CalibrationConfig(), resume_step: int | Sequence[int] | None = None,
                    progress=print, shard: tuple[int, int] | None = None, tier_scope: str = "auto",
                    tier_rules: Mapping[str, QualityRule] | None = None, noise_floor: bool = False,
                    risk: str = "pair") -> dict | None:
    """Generate and judge the ``pairs`` not yet in ``out_dir/pairs.jsonl``, then select and certify thresholds and write
    them (thresholds.json, calibration.json); returns the summary. ``pairs=None`` (``--select-only``) generates nothing:
    it selects and certifies from every pair already there, e.g. under another rule. ``source``: how the pairs were
    drawn (recorded in pairs.meta.json with the policy's reading and the judge; a resumed run must match it).
    ``settings``: generation settings (height, width, num_frames, guidance_scale) for every request.
    ``shard=(k, n)``: only pairs k, k + n, ... and return None without selecting (a worker of ``--jobs n``).

    ``resume_step``: one step, or several (risk tiers; one step with ``tier_rules`` or a ``tier_scope`` other than
    "auto" is tiers at that step): each pair's source is then generated once and its target
    reused from every step, one row per (pair, step), and the thresholds file certifies one tier per kind of change
    (:func:`carnator.calibrate.certify.certify_tiers`) instead of one set of thresholds. ``tier_scope``: how those reuses
    recompute: "frame" every token from the step, "region" the probe's regions (blending the source in outside them),
    "auto" frame for re-rolls and rewordings, region for edits. ``tier_rules``: a kind of change's own rule (an edit's
    rule reads the attribute it asks for), the ``rule`` for the others.

    ``noise_floor``: each pair's target is also generated densely at another seed (:data:`NOISE_SEED_OFFSET` added) and
    judged (``dense_other``): how often the rule fails dense against dense, per kind, is the summary's ``noise_floor``
    - the unsafe share a reuse shows when it is merely another sample of the target, which the certificate cannot
    get below. ``risk``: how a row is labelled (:func:`label`); "excess" (tiers only) needs ``noise_floor``'s samples."""
    from ..policies.carnator import DEFAULT_RESUME_STEP, CarnatorConfig, CarnatorPolicy

    log_path = out_dir / "pairs.jsonl"
    generate = pairs is not None
    tier_rules = dict(tier_rules or {})

    def rule_for(row: Mapping) -> QualityRule:
        return tier_rules.get(str(row.get("change")), rule)

    def label_of(row: Mapping) -> bool:
        return label(row, rule_for(row), risk)

    if not generate and not (log_path.exists() and log_path.stat().st_size > 0):
        raise CarnatorError(f"{out_dir} holds no pairs to select from (pairs.jsonl); run without --select-only first")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = engine.policy("carnator").cfg
    if resume_step is None or isinstance(resume_step, int):
        resume_step = [int(resume_step or base.resume_step or DEFAULT_RESUME_STEP)]
    at_steps = sorted({int(r) for r in resume_step})
    tiered = is_tiered(at_steps, tier_rules, tier_scope)
    problem = risk_problem(risk, tiered=tiered, generate=generate, noise_floor=noise_floor)
    if problem:
        raise CarnatorError(problem)
    # Forced reuse: thresholds that accept every pair (with tiers, a tier open for every kind of change, so that the
    # reuse is decided and planned as a served one is; its resume step is the run's, not the nominal 1 of 2).
    open_tau = out_dir / "open_thresholds.json"
    if tier_scope not in ("auto", "frame", "region"):
        raise CarnatorError(f"tier scope must be auto, frame or region, got {tier_scope!r}")
    scope_of = {k: tier_scope if tier_scope != "auto" else ("frame" if k in SAME_CONTENT_KINDS else "region") for k in KINDS}
    open_tiers = tuple(Tier(k, 1, 2, scope=scope_of[k], certified=True) for k in KINDS) if tiered else ()
    Thresholds(math.inf, math.inf, math.inf, math.inf, tiers=open_tiers).save(open_tau, model_id=engine.model_identity)
    # One resume step for every pair, named (not the thresholds file's own), and recorded with the thresholds it certifies;
    # the probe on every request, so that every pair's discrepancies are measured whatever the thresholds read.
    forced_name = {}
    for r in at_steps:
        forced = CarnatorPolicy(CarnatorConfig(**{**vars(base), "thresholds": str(open_tau), "resume_step": r, "probe": "always"}))
        forced.name = forced_name[r] = "carnator-forced" if not tiered else f"carnator-forced-{r}"
        engine.use_policy(forced)
        if isinstance(getattr(engine, "_warned", None), set):  # forced reuse is the point here: no "uncertified" notice
            engine._warned.add(f"uncertified:{forced.name}")
    # The source runs carnator from the earliest resume step under a file without tiers, so that its entry keeps every
    # latent the reuses read, traj.{r-1} .. traj.{n-1} (EngineConfig.capture_steps="auto"; under the engine's own file a
    # frame tier would keep only its own step's); it is alone in its tenant, so always a miss.
    source_tau = out_dir / "source_thresholds.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf).save(source_tau, model_id=engine.model_identity)
    at = {"resume_step": at_steps[0], "probe": "always", "thresholds": str(source_tau)}
    source_pol = CarnatorPolicy(CarnatorConfig(**{**vars(base), **at}))
    source_pol.name = "carnator-source"
    engine.use_policy(source_pol)
    reading = CarnatorPolicy(base).reading()
    # The reading and the judge are part of what a pair means: a resumed run must read and judge as the first did.
    drawn = {**dict(source or {}), "reading": json.loads(json.dumps(reading)), "judge": judge.identity}
    if tiered:
        drawn["resume_steps"], drawn["tier_scope"] = at_steps, tier_scope
    meta_path = out_dir / "pairs.meta.json"
    if meta_path.exists():
        stored = json.loads(meta_path.read_text())
        if not generate:  # nothing is drawn: how the stored pairs were drawn is theirs to say
            for key, what in (("reading", "whose signatures were read as"), ("judge", "judged by")):
                if stored.get(key) != drawn[key]:
                    raise CarnatorError(f"{out_dir} holds pairs {what} {stored.get(key)}, not {drawn[key]}; "
                                        + ("set the same --option carnator.FIELD values" if key == "reading" else "use the same --judge"))
            drawn = stored
        elif stored != drawn:
            raise CarnatorError(f"{out_dir} holds pairs drawn as {stored}, not {drawn}; use another --out")
    else:
        meta_path.write_text(json.dumps(drawn))
    done = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            r = json.loads(line)
            r["acceptable"] = label_of(r)   # this run's rule: a run resumed with other deltas relabels
            done[_row_key(r, tiered)] = r
    kw = {"num_inference_steps": steps, **dict(settings or {})}
    pairs = pairs or ()
    todo = [i for i in range(len(pairs)) if (shard is None or i % shard[1] == shard[0])
            and any(_row_key({"i": i, "resume_step": r}, tiered) not in done for r in at_steps)]
    t_start, n_todo = time.perf_counter(), len(todo)
    # every pair runs the same settings: their number of steps, recorded with each row (the file's meta.resume)
    n_steps = engine.resolve(pairs[todo[0]][3], seed=0, **kw).num_inference_steps if todo else None
    from tqdm import tqdm

    # disable=None: a bar (pairs done, rate, ETA) only on a terminal; the per-pair lines go above it (and alone in logs)
    bar = tqdm(total=n_todo, desc="calibrate", unit="pair", disable=None if progress is not None else True, leave=False)
    say = (lambda line: bar.write(line) if not bar.disable else progress(line)) if progress is not None else (lambda line: None)
    with open(log_path, "a") as log, bar:
        for k, i in enumerate(todo):
            kind, src, s_seed, tgt, t_seed = pairs[i]
            tenant = f"calib{i}"
            t0 = time.perf_counter()
            source_res = engine.generate(src, seed=s_seed, policy="carnator-source", tenant=tenant, **kw)
            engine.flush(source_res)  # the source's entry is written (write-behind on a GPU) before the reuse reads it
            t1 = time.perf_counter()
            dense = engine.generate(tgt, seed=t_seed, policy="dense", tenant=tenant, store=False, **kw)
            t2 = time.perf_counter()
            # (reference scores of the dense clip are against itself: the best a reuse can reach)
            jd = judge.score(dense.frames, tgt, reference=dense.frames)
            # what changed from the source to the target, as the policy names it when it decides (the tier's kind)
            change = change_kind(tgt, src, engine.content(tgt), engine.content(src))
            other = None
            if noise_floor:  # another sample of the target, judged as a reuse would be
                dense2 = engine.generate(tgt, seed=resample_seed(t_seed), policy="dense", tenant=tenant, store=False, **kw)
                other = judge.score(dense2.frames, tgt, reference=dense.frames)
            for r_step in at_steps:
                if _row_key({"i": i, "resume_step": r_step}, tiered) in done:
                    continue
                t3 = time.perf_counter()
                reuse = engine.generate(tgt, seed=t_seed, policy=forced_name[r_step], tenant=tenant, store=False, **kw)
                t4 = time.perf_counter()
                jr = judge.score(reuse.frames, tgt, reference=dense.frames)
                t5 = time.perf_counter()
                d = reuse.stats.notes.get("discrepancies")
                row = {"i": i, "kind": kind, "change": change, "scope": scope_of.get(change) if tiered else None,
                       "source": src, "target": tgt, "hit": reuse.stats.hit, "d": d,
                       "reason": reuse.stats.reason,
                       "dense": jd, "reuse": jr, **({"dense_other": other} if other is not None else {}),
                       "dit_dense": dense.stats.timings.get("dit"), "dit_reuse": reuse.stats.timings.get("dit"),
                       # wall seconds of the pair's four parts; each generation's own decode and DiT seconds are inside them
                       "seconds": {"source": t1 - t0, "dense": t2 - t1, "reuse": t4 - t3, "judge": t5 - t4,
                                   "decode": sum(g.stats.timings.get("decode", 0.0) for g in (source_res, dense, reuse)),
                                   "dit": sum(g.stats.timings.get("dit", 0.0) for g in (source_res, dense, reuse))},
                       # the plan's parameters (bench-scale replays these at real sizes)
                       "resume_step": reuse.stats.resume_step if reuse.stats.hit else r_step,
                       "active_fraction": reuse.stats.active_fraction, "mask_density": reuse.stats.mask_density,
                       "num_steps": n_steps}
                # Both Early Signatures, so that other discrepancy definitions can be evaluated on these rows offline.
                src_meta = engine.store.get(reuse.stats.source_id) if reuse.stats.hit and reuse.stats.source_id else None
                row["signatures"] = {"query": reuse.stats.notes.get("signature"),
                                     "source": None if src_meta is None else src_meta.extra.get("signature")}
                row["acceptable"] = label_of(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                done[_row_key(row, tiered)] = row
            engine.store.clear(tenant=tenant)
            bar.update(1)
            per = (time.perf_counter() - t_start) / (k + 1)
            # a worker (shard) counts its own rows of the one pairs.jsonl, out of its share of the pairs, named
            mine, n_done = len(pairs), len(done)
            if shard is not None:
                mine = len(range(shard[0], len(pairs), shard[1]))
                n_done = sum(1 for key in done if (key[0] if tiered else key) % shard[1] == shard[0])
            say(f"{'' if shard is None else f'worker {shard[0] + 1} of {shard[1]}: '}{n_done}/{mine * len(at_steps)} "
                f"{kind:7s} hit={row['hit']} acceptable={row['acceptable']} "
                f"({per:.1f} s/pair, ETA {per * (n_todo - k - 1):.0f} s)")
    if shard is not None:
        return None
    if tiered:
        return _write_tiers(engine, out_dir, done.values(), cfg, rule, judge, reading, drawn, tier_rules, risk)
    rows = reused_rows(done.values())
    if any("text" not in r["d"] for r in rows):
        backfill_text(rows, engine.embedder)
    if len(rows) < 2:
        raise CarnatorError(f"only {len(rows)} of {len(done)} pairs could reuse their source (the resume step must lie "
                            f"inside the steps, and the noun filter must pass); selection and certification need at least 2")
    cal_pairs = [calibration_pair(r) for r in rows]
    res = calibrate(cal_pairs, cfg)
    tau_path = out_dir / "thresholds.json"
    # The step the certified reuses resumed at, of how many: the step a policy loading the file resumes at. Rows of
    # mixed steps (or from before rows recorded them) certify none in particular, and the file names none.
    run_steps = {(r.get("resume_step"), r.get("num_steps")) for r in rows}
    resume = {}
    only_step, only_of = next(iter(run_steps))
    if len(run_steps) == 1 and only_step is not None and only_of is not None:
        resume = {"resume": {"step": int(only_step), "of": int(only_of), "certified_steps": [int(only_step)]}}
    res.thresholds.save(tau_path, model_id=engine.model_identity, reading=reading,
                        meta={**res.to_dict(), "rule": rule.to_dict(), "judge": judge.identity, **resume,
                              "selection_confidence": cfg.selection_confidence, "text_threshold": cfg.text, "decision_rule": cfg.rule})
    summary = {"pairs": len(done), **drawn, "reusable_pairs": len(rows), "acceptable": sum(r["acceptable"] for r in rows),
               "rule": rule.to_dict(), "selection_confidence": cfg.selection_confidence, "text_threshold": cfg.text,
               "decision_rule": cfg.rule, "separation": separation(cal_pairs), "result": res.to_dict(), "thresholds_file": str(tau_path),
               "seconds_per_pair": seconds_per_pair(done.values())}
    (out_dir / "calibration.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def noise_floor(rows, rule: QualityRule, tier_rules: Mapping[str, QualityRule] | None = None) -> dict[str, dict[str, Any]]:
    """Per kind of change, how often the rule fails another dense sample of the target against its dense run (rows
    with ``dense_other``, one per pair): the unsafe share of a reuse that is merely another sample."""
    seen: dict[tuple, Mapping] = {}
    for r in rows:
        if r.get("dense_other") is not None:
            seen.setdefault((r.get("change") or r.get("kind"), r["i"]), r)
    out: dict[str, dict[str, Any]] = {}
    for (kind, _), r in sorted(seen.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        label = (tier_rules or {}).get(str(kind), rule).acceptable(r["dense_other"], r["dense"])
        e = out.setdefault(str(kind), {"pairs": 0, "fails": 0})
        e["pairs"] += 1
        e["fails"] += int(not label)
    for e in out.values():
        e["share"] = round(e["fails"] / e["pairs"], 4)
    return out


def _write_tiers(engine, out_dir: Path, rows, cfg: CalibrationConfig, rule: QualityRule, judge: Judge, reading, drawn,
                 tier_rules: Mapping[str, QualityRule] | None = None, risk: str = "pair") -> dict:
    """Certify one tier per kind of change from rows of several resume steps and write the thresholds file: the
    certified tiers, and thresholds that read no signature (a tier's kind is read from the two prompts)."""
    rows = sorted(rows, key=lambda r: (r["i"], r["resume_step"]))
    table = certify_tiers(rows, cfg)
    for kind, own in (tier_rules or {}).items():   # the rule each kind was labelled by
        if kind in table:
            table[kind]["rule"] = own.to_dict()
    for t in table.values():
        t["risk"] = risk
    tiers = tuple(Tier.from_dict(t) for t in table.values() if t.get("certified"))
    tau = Thresholds(math.inf, math.inf, math.inf, math.inf, tiers=tiers)
    tau_path = out_dir / "thresholds.json"
    tau.save(tau_path, model_id=engine.model_identity, reading=reading,
             meta={"certified": bool(tiers), "tiers": table, "rule": rule.to_dict(), "risk": risk, "judge": judge.identity,
                   "delta": cfg.delta, "confidence": cfg.confidence, "selection_confidence": cfg.selection_confidence,
                   "certification_split": {"selection_fraction": cfg.selection_fraction, "split_seed": cfg.split_seed}})
    floor = noise_floor(rows, rule, tier_rules)
    summary = {"pairs": len({r["i"] for r in rows}), **drawn, "rows": len(rows), "rule": rule.to_dict(), "risk": risk, "tiers": table,
               **({"noise_floor": floor} if floor else {}),
               "thresholds_file": str(tau_path), "seconds_per_pair": seconds_per_pair(rows)}
    (out_dir / "calibration.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
