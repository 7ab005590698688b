"""Issue 26: the calibration pairs that recall by content adds, and their certification beside the earlier rows.

``draw``: over the same train-split stream the 2,933-pair calibration drew from (``stream_pairs(3000, MiniLM,
warm=1000)``: ``world_trace(1000, 18050, seed=0, split="train")``, the same prefix of it), the pairs that the
deployed policy now tests and the old draw did not: each stream request's first tested candidate as the carnator
policy orders them (the sentence top-10 and, by content, the newest 10 warm requests asking the same; same-content
candidates first, then recall order; the noun filter) where it is a same-content warm request other than the old
draw's source. Writes them as a pairs file for ``carnator calibrate --pairs-file`` and ``source_scores.py``.

``certify``: the per-kind table of the content + gate rule on the earlier rows' certification split and every new row
(the rule has no fitted parameter, so no new row is needed for selection), and ``--write`` a thresholds file.

``tiers``: the pairs the shipped rule accepts (same content, the source's own clip passed the admission gate), drawn
from both lists above, at most ``--per-kind`` of each kind of change (seeded), for ``carnator calibrate --resume-step R``:
lever 2 certifies a later resume step for exactly the hits the rule makes. ``tier-certify``: their per-kind table from
the ``calibrate --resume-step`` rows, and ``--write`` the step into a thresholds file's ``meta.resume``.

    python3 lab/scripts/content_pairs.py draw --out PAIRS.jsonl
    python3 lab/scripts/content_pairs.py tiers --out TIER-PAIRS.jsonl [--per-kind 80]
    python3 lab/scripts/content_pairs.py tier-certify --rows ROWS.jsonl.gz --step 45 [--write THRESHOLDS.json]
    python3 lab/scripts/content_pairs.py certify --new-rows R.jsonl.gz --new-pairs P.jsonl --new-sources S.jsonl.gz \
        --pairs .cache/dev/pairs3000.jsonl [--write src/carnator/embedded/thresholds.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
LEXICON = ROOT / "src/carnator/embedded/lexicon.json"


def draw(out: Path, n: int = 3000, warm: int = 1000, top_k: int = 10) -> None:
    from carnator.calibrate.run import _unit
    from carnator.recall.embedder import default_embedder
    from carnator.reuse import noun_diff
    from carnator.signature.content import LexiconContent
    from carnator_lab.traces import world_trace
    from carnator_lab.world.captions import nouns

    read = LexiconContent.from_file(LEXICON)
    trace = world_trace(warm, 6 * n + 50, seed=0, split="train")
    emb = default_embedder()
    W, Q = _unit(emb, [r.prompt for r in trace.warm]), _unit(emb, [r.prompt for r in trace.test])
    wn = [nouns(r.prompt) for r in trace.warm]
    wc = [tuple(read(r.prompt)) for r in trace.warm]
    by_content: dict[tuple, list[int]] = {}
    for j, c in enumerate(wc):
        by_content.setdefault(c, []).append(j)
    old = new = 0
    rows = []
    for r, q in zip(trace.test, Q):
        if old == n:
            break
        qn, qc = nouns(r.prompt), tuple(read(r.prompt))
        sims = W @ q
        top = list(np.argsort(-sims, kind="stable")[:top_k])
        old_src = next((j for j in top if noun_diff(qn, wn[j]) is not None), None)
        if old_src is not None and (trace.warm[old_src].prompt, trace.warm[old_src].seed) != (r.prompt, r.seed):
            old += 1
        extra = [j for j in by_content.get(qc, [])[-top_k:][::-1] if j not in top]   # newest 10 asking the same
        extra.sort(key=lambda j: (-sims[j], j))
        cands = [j for j in top + extra if noun_diff(qn, wn[j]) is not None or wc[j] == qc]
        cands.sort(key=lambda j: wc[j] != qc)   # stable: same content first, recall order otherwise
        if not cands or wc[cands[0]] != qc or cands[0] == old_src:
            continue
        s = trace.warm[cands[0]]
        if (s.prompt, s.seed) == (r.prompt, r.seed):
            continue
        new += 1
        rows.append({"kind": r.kind if r.source == cands[0] else f"{r.kind}/other", "source": s.prompt,
                     "source_seed": s.seed, "target": r.prompt, "target_seed": r.seed,
                     "found": "top-k" if cands[0] in top else "content"})
    out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    found = sum(x["found"] == "content" for x in rows)
    print(f"{old} old-draw pairs over the stream prefix; {new} new pairs ({found} found by content beyond the top {top_k}, "
          f"{new - found} same-content candidates in the top {top_k} the old draw passed over) -> {out}")


def tiers(args) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "lab/scripts"))
    from content_calibrate import GATE

    from carnator.signature.content import LexiconContent, change_kind, content_distance

    read = LexiconContent.from_file(LEXICON)
    by_kind: dict[str, list[dict]] = {}
    for pairs_path, sources_path in ((args.pairs, args.sources), (args.new_pairs, args.new_sources)):
        quality = {(q["source"], int(q["seed"])): q for q in map(json.loads, _text(sources_path).splitlines())}
        for p in map(json.loads, _text(pairs_path).splitlines()):
            q = quality.get((p["source"], int(p["source_seed"])))
            if q is None or q["fidelity"] < GATE["fidelity"] or q["artifact"] > GATE["artifact"]:
                continue
            t, s = read(p["target"]), read(p["source"])
            if content_distance(t, s) != 0 or (p["source"], p["source_seed"]) == (p["target"], p["target_seed"]):
                continue
            by_kind.setdefault(change_kind(p["target"], p["source"], t, s), []).append(p)
    rng = np.random.default_rng(args.seed)
    rows = []
    for kind in sorted(by_kind):
        got = by_kind[kind]
        pick = sorted(rng.choice(len(got), size=min(args.per_kind, len(got)), replace=False))
        rows += [{**got[i], "kind": kind} for i in pick]
        print(f"{kind}: {len(pick)} of {len(got)} accepted pairs")
    rng.shuffle(rows)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    print(f"{len(rows)} pairs -> {args.out}")


def _rel(path: Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def _text(path: Path) -> str:
    return gzip.open(path, "rt").read() if str(path).endswith(".gz") else Path(path).read_text()


def certify(args) -> None:
    import math
    import sys

    sys.path.insert(0, str(ROOT / "lab/scripts"))
    from content_calibrate import GATE, ORDER

    from carnator.calibrate.run import calibration_pair
    from carnator.judges import QualityRule
    from carnator.calibrate.certify import CalibrationConfig, CalibrationPair, split_pairs, stratified_certification
    from carnator.reuse import Discrepancies, Thresholds
    from carnator.signature.content import LexiconContent, change_kind, content_distance

    rule = QualityRule({"fidelity": 0.25, "artifact": 0.1}, {"fidelity": 1, "artifact": -1})
    read = LexiconContent.from_file(LEXICON)

    def load(rows_path, pairs_path, sources_path, certification_only):
        rows = sorted((r for r in map(json.loads, _text(rows_path).splitlines()) if r["hit"] and r["d"] is not None),
                      key=lambda r: r["i"])
        pairs = [json.loads(x) for x in _text(pairs_path).splitlines()]
        quality = {(q["source"], int(q["seed"])): q for q in map(json.loads, _text(sources_path).splitlines())}
        keep = set(split_pairs(len(rows), CalibrationConfig())[1]) if certification_only else set(range(len(rows)))
        out, kinds, missing = [], [], 0
        for i, r in enumerate(rows):
            if i not in keep:
                continue
            p = pairs[r["i"]] if r["i"] < len(pairs) else None
            matched = p is not None and p["source"] == r["source"] and p["target"] == r["target"]
            q = quality.get((r["source"], int(p["source_seed"]))) if matched else None   # unmatched: fails the gate
            missing += q is None
            ok = q is not None and q["fidelity"] >= GATE["fidelity"] and q["artifact"] <= GATE["artifact"]
            d = content_distance(read(r["target"]), read(r["source"])) if ok else math.inf
            base = calibration_pair(r, rule.label(r))
            out.append(CalibrationPair(Discrepancies(**{**vars(base.d), "content": d}), base.acceptable, key=base.key))
            kinds.append(change_kind(r["target"], r["source"], read(r["target"]), read(r["source"])))
        return out, kinds, missing

    old, ok_, m0 = load(args.rows, args.pairs, args.sources, True)
    new, nk, m1 = load(args.new_rows, args.new_pairs, args.new_sources, False)
    tau = Thresholds(math.inf, math.inf, math.inf, math.inf, math.inf, content=0.0)
    tables = {"earlier rows (certification split)": stratified_certification(old, ok_, tau),
              "new rows (recall by content)": stratified_certification(new, nk, tau),
              "both": stratified_certification(old + new, ok_ + nk, tau)}
    print(f"earlier {len(old)} rows ({m0} without a judged source); new {len(new)} rows ({m1} without a judged source)")
    for name, table in tables.items():
        print(f"\n## {name}\n| category | pairs | accepted | unsafe | 90 % bound | certified (<= 5 %) |\n|---|---|---|---|---|---|")
        for k in ORDER + sorted(c for c in table if c not in ORDER and c != "all") + ["all"]:
            if k in table:
                t = table[k]
                bound = "-" if t["bound"] is None else f"{100 * t['bound']:.1f} %"
                cert = "no hit" if t["certified"] is None else ("yes" if t["certified"] else "**no**")
                print(f"| {k} | {t['pairs']} | {t['accepted']} | {t['unsafe']} | {bound} | {cert} |")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1))
    if args.write:
        table = tables["both"]
        doc = json.loads(args.write.read_text())
        meta = dict(doc["meta"])
        meta["certified"] = bool(all(t["certified"] is not False for t in table.values()) and table["all"]["certified"])
        meta["per_category"] = table
        meta["content_pairs"] = {"rows": str(args.new_rows), "pairs": str(args.new_pairs), "sources": str(args.new_sources),
                                 "count": len(new), "drawn_by": "lab/scripts/content_pairs.py draw"}
        meta["certification_split"] = {**meta["certification_split"], "pairs": len(old) + len(new)}
        meta["generated_by"] = "lab/scripts/content_calibrate.py --write, per_category from content_pairs.py certify"
        tau.save(args.write, model_id=doc["model_id"], meta=meta, reading=doc.get("reading"))
        print(f"\nwrote {args.write} (certified: {meta['certified']})")


def tier_certify(args) -> None:
    """Lever 2: the per-kind certificate of the rule's hits reused from ``--step`` (``carnator calibrate --resume-step``
    rows of the ``tiers`` pairs; every one is a hit the rule makes, so each is in the certification), and ``--write``:
    the thresholds file's ``meta.resume`` names the step as its default and adds it to the certified steps."""
    import math

    from carnator.calibrate.certify import CalibrationPair, stratified_certification
    from carnator.reuse import Discrepancies, Thresholds

    pairs = [json.loads(x) for x in _text(args.pairs).splitlines()]
    rows = [r for r in map(json.loads, _text(args.rows).splitlines()) if r["hit"]]
    bad = [r["i"] for r in rows if r["resume_step"] != args.step or (pairs[r["i"]]["source"], pairs[r["i"]]["target"]) != (r["source"], r["target"])]
    if bad:
        raise SystemExit(f"rows {bad[:5]} are not the pairs file's, reused from step {args.step}")
    cal = [CalibrationPair(Discrepancies(0.0, 0.0, 0.0, 0.0, 0.0), bool(r["acceptable"])) for r in rows]
    kinds = [pairs[r["i"]]["kind"] for r in rows]
    table = stratified_certification(cal, kinds, Thresholds(math.inf, math.inf, math.inf, math.inf, math.inf))
    print(f"{len(rows)} hits of {len(pairs)} pairs, reused from step {args.step}")
    print("| category | hits | unsafe | 90 % bound | certified (<= 5 %) |\n|---|---|---|---|---|")
    for k, t in table.items():
        print(f"| {k} | {t['accepted']} | {t['unsafe']} | {100 * t['bound']:.1f} % | {'yes' if t['certified'] else '**no**'} |")
    if args.write:
        doc = json.loads(args.write.read_text())
        meta = dict(doc["meta"])
        ok = all(t["certified"] for t in table.values())
        old = meta.get("resume") or {"step": 30, "of": 50, "certified_steps": [30]}
        steps = sorted({*old.get("certified_steps", [old["step"]]), *([args.step] if ok else [])})
        meta["resume"] = {"step": args.step if ok else old["step"], "of": old["of"], "certified_steps": steps,
                          f"at_{args.step}": {"per_category": table, "rows": _rel(args.rows), "pairs": _rel(args.pairs),
                                              "drawn_by": "lab/scripts/content_pairs.py tiers",
                                              "certified_by": "lab/scripts/content_pairs.py tier-certify"}}
        Thresholds.from_dict(doc["thresholds"]).save(args.write, model_id=doc["model_id"], meta=meta, reading=doc.get("reading"))
        print(f"wrote {args.write}: resume {meta['resume']['step']} of {meta['resume']['of']}, certified at {steps}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw")
    d.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("certify")
    c.add_argument("--rows", type=Path, default=ROOT / "lab/notebook/bench-embedded/calibration-h200-w1000-modifiers1-2933-pairs.jsonl.gz")
    c.add_argument("--pairs", type=Path, default=ROOT / ".cache/dev/pairs3000.jsonl")
    c.add_argument("--sources", type=Path, default=ROOT / "lab/notebook/bench-embedded/shipped-h100-sources.jsonl.gz")
    c.add_argument("--new-rows", type=Path, required=True)
    c.add_argument("--new-pairs", type=Path, required=True)
    c.add_argument("--new-sources", type=Path, required=True)
    c.add_argument("--json", type=Path)
    c.add_argument("--write", type=Path)
    t = sub.add_parser("tiers")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--per-kind", type=int, default=80)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--pairs", type=Path, default=ROOT / ".cache/dev/pairs3000.jsonl")
    t.add_argument("--sources", type=Path, default=ROOT / "lab/notebook/bench-embedded/shipped-h100-sources.jsonl.gz")
    t.add_argument("--new-pairs", type=Path, default=ROOT / "lab/notebook/bench-embedded/shipped-content-pairs.jsonl.gz")
    t.add_argument("--new-sources", type=Path,
                   default=ROOT / "lab/notebook/bench-embedded/shipped-content-pairs-h100-sources.jsonl.gz")
    c2 = sub.add_parser("tier-certify")
    c2.add_argument("--rows", type=Path, required=True)
    c2.add_argument("--pairs", type=Path, default=ROOT / "lab/notebook/bench-embedded/shipped-tier-pairs.jsonl.gz")
    c2.add_argument("--step", type=int, required=True)
    c2.add_argument("--write", type=Path)
    args = ap.parse_args()
    {"tier-certify": lambda: tier_certify(args), "draw": lambda: draw(args.out), "certify": lambda: certify(args), "tiers": lambda: tiers(args)}[args.cmd]()


if __name__ == "__main__":
    main()
