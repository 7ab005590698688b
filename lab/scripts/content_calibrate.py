"""Issue 26: decision rules on the 2,933 H200 calibration pairs, certified per kind of change (stratified).

Reads the calibration rows, the pair list they were drawn from (source seeds) and the judge's scores of every source's
own clip (``source_scores.py`` part A), and for each rule prints and writes the per-category table: pairs, accepted,
unsafe, the one-sided 90 % Clopper-Pearson bound of the unsafe rate, certified at delta 5 %. Rules:

- ``shipped``: the shipped certified file (linear risk score; session 12);
- ``shipped+content``: the same and the content of the two prompts equal (lever 3);
- ``content``: content equal alone (signature thresholds off);
- ``content+gate``: content equal, and the source's own clip passed the admission gate (lever 1);
- ``content+gate+risk``: both and the shipped risk score.

Certification uses calibrate's split (30 % selection / 70 % certification, seed 0, over the reused rows in pair order);
the content and gate rules have no fitted parameter (content distance 0 and the gate's bars follow from the quality
rule's Delta), so the selection split is unused by them; the table is the certification split's. ``--write FILE``
writes the ``content+gate`` rule as a thresholds file (with its per-category table and the gate it needs).

    python3 lab/scripts/content_calibrate.py [--rows ROWS.jsonl.gz] --pairs PAIRS.jsonl --sources sources.jsonl[.gz] [--write FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

from carnator.calibrate.run import calibration_pair
from carnator.judges import QualityRule
from carnator.calibrate.certify import CalibrationConfig, CalibrationPair, split_pairs, stratified_certification
from carnator.reuse import Discrepancies, Thresholds
from carnator.signature.content import LexiconContent, change_kind, content_distance

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "src/carnator/embedded/thresholds-nogate.json"
LEXICON = ROOT / "src/carnator/embedded/lexicon.json"
CATEGORY = {"reroll": "re-roll", "reword": "rewording", "noun": "object", "color": "colour", "size": "size",
            "context": "place", "motion": "motion", "unrelated": "unrelated", "count": "count"}
ORDER = ["re-roll", "rewording", "object", "small-object", "colour", "size", "place", "place-added", "place-removed", "motion",
         "count", "several"]
GATE = {"fidelity": 0.75, "artifact": 0.1}


def category(kind: str) -> str:
    base, _, other = kind.partition("/")
    c = CATEGORY.get(base, base)
    return f"{c} (other source)" if other else c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=Path, default=ROOT / "lab/notebook/bench-embedded/calibration-h200-w1000-modifiers1-2933-pairs.jsonl.gz")
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--sources", type=Path)
    ap.add_argument("--delta-fidelity", type=float, default=0.25)
    ap.add_argument("--delta-artifact", type=float, default=0.1)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--by", choices=("change", "stream"), default="change",
                    help="category of a pair: what changed between its two prompts (default), or how the stream made it")
    args = ap.parse_args()

    rule = QualityRule({"fidelity": args.delta_fidelity, "artifact": args.delta_artifact}, {"fidelity": 1, "artifact": -1})
    rows = [json.loads(line) for line in gzip.open(args.rows, "rt")]
    rows = sorted((r for r in rows if r["hit"] and r["d"] is not None), key=lambda r: r["i"])
    pairs = [json.loads(line) for line in args.pairs.read_text().splitlines()]
    quality = {}
    if args.sources is not None:
        text = gzip.open(args.sources, "rt").read() if args.sources.suffix == ".gz" else args.sources.read_text()
        for line in text.splitlines():
            q = json.loads(line)
            quality[(q["source"], int(q["seed"]))] = q
    read = LexiconContent.from_file(LEXICON)
    shipped = Thresholds.load(SHIPPED, model_id=json.loads(SHIPPED.read_text())["model_id"])

    cal, kinds, gate, unmatched = [], [], [], 0
    for r in rows:
        p = pairs[r["i"]] if r["i"] < len(pairs) else None
        matched = p is not None and p["source"] == r["source"] and p["target"] == r["target"]
        q = quality.get((r["source"], int(p["source_seed"]))) if matched else None
        if q is None:
            unmatched += 1
        ok = q is not None and q["fidelity"] >= GATE["fidelity"] and q["artifact"] <= GATE["artifact"]
        base = calibration_pair(r, rule.label(r))
        d = Discrepancies(**{**vars(base.d), "content": content_distance(read(r["target"]), read(r["source"]))})
        cal.append(CalibrationPair(d, base.acceptable, key=base.key))
        kinds.append(change_kind(r["target"], r["source"], read(r["target"]), read(r["source"])) if args.by == "change"
                     else category(r["kind"]))
        gate.append(ok)
    sel, cert = split_pairs(len(cal), CalibrationConfig())
    print(f"{len(cal)} reused rows; selection {len(sel)}, certification {len(cert)}; {unmatched} without a judged source"
          f"; sources failing the gate: {sum(not g for g in gate)} rows")

    inf = math.inf
    content_only = Thresholds(inf, inf, inf, inf, inf, content=0.0)
    rules = {
        "shipped": (shipped, False),
        "shipped+content": (Thresholds(**{**{k: getattr(shipped, k) for k in ("context", "size", "shape", "color", "text")},
                                          "content": 0.0, "risk": shipped.risk}), False),
        "content": (content_only, False),
        "content+gate": (content_only, True),
        "content+gate+risk": (Thresholds(inf, inf, inf, inf, inf, content=0.0, risk=shipped.risk), True),
    }
    results = {}
    for name, (tau, gated) in rules.items():
        if gated and not quality:
            continue
        # a source that failed the gate is never a candidate: its pairs are not accepted (d = inf content)
        ps = [cal[i] if (gate[i] or not gated) else CalibrationPair(Discrepancies(**{**vars(cal[i].d), "content": inf}),
                                                                     cal[i].acceptable, key=cal[i].key) for i in cert]
        table = stratified_certification(ps, [kinds[i] for i in cert], tau)
        results[name] = table
        print(f"\n## {name}")
        print("| category | pairs | accepted | unsafe | unsafe rate | 90 % bound | certified (<= 5 %) |")
        print("|---|---|---|---|---|---|---|")
        for k in ORDER + sorted(c for c in table if c not in ORDER and c != "all") + ["all"]:
            if k not in table:
                continue
            t = table[k]
            rate = "-" if t["unsafe_rate"] is None else f"{100 * t['unsafe_rate']:.1f} %"
            bound = "-" if t["bound"] is None else f"{100 * t['bound']:.1f} %"
            cert_s = "no hit" if t["certified"] is None else ("yes" if t["certified"] else "**no**")
            print(f"| {k} | {t['pairs']} | {t['accepted']} | {t['unsafe']} | {rate} | {bound} | {cert_s} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": len(cal), "certification": len(cert), "gate": GATE, "rules": results}, indent=1))
    if args.write is not None:
        table = results["content+gate"]
        every = all(t["certified"] is not False for t in table.values())
        doc = json.loads(SHIPPED.read_text())
        meta = {
            "certified": bool(every and table["all"]["certified"]),
            "rule": "content: the two prompts ask the same (d_content = 0); the source admitted by the gate",
            "admission": {"judge": "shapes", "rule": GATE, "directions": {"fidelity": 1, "artifact": -1}},
            "quality_rule": rule.to_dict(),
            "delta": 0.05, "confidence": 0.9,
            "calibration_rows": str(args.rows.relative_to(ROOT)) if args.rows.is_relative_to(ROOT) else str(args.rows),
            "certification_split": {"pairs": len(cert), "selection_fraction": 0.3, "split_seed": 0},
            "source_scores": str(args.sources.relative_to(ROOT)) if args.sources.is_relative_to(ROOT) else str(args.sources),
            "per_category": table,
            "generated_by": "lab/scripts/content_calibrate.py --write",
        }
        content_only.save(args.write, model_id=doc["model_id"], meta=meta, reading=doc.get("reading"))
        print(f"\nwrote {args.write} (certified: {meta['certified']})")


if __name__ == "__main__":
    main()
