"""Edit tiers on the embedded model: the calibration pairs of each kind of edit, and the thresholds file they certify.

``draw``: single-change edit pairs from the *train* split of the shapes world (the held-out stream is never used for
calibration): each edit request of ``world_trace(W, S, seed, split="train")`` with the warm request it edits, labelled
by what the content reader says changed (``change_kind``: colour, object, small-object, size, place, motion), at most
``--per-kind`` of each, the kinds interleaved (a run cut short still has every kind). Writes a pairs file for
``carnator calibrate --pairs-file F --resume-step 5,10,20,30``.

``certify``: one kind's tier at a step already selected (by an earlier run's selection split), certified once on
every row not used to select it, pooled: a run's certification split (``ROWS:cert``, the split ``certify_tiers``
made) and whole runs drawn afterwards (``ROWS``); ``--selection`` names the rows that selected the step (``ROWS`` or
``ROWS:sel``), counted per step into the tier's meta. Writes a thresholds.json that ``write`` takes.

``write``: the shipped thresholds file with such a file's certified edit tiers merged in: the same-content tiers
certified at step 45 (re-roll, rewording: ``meta.resume.at_45`` of the current shipped file) and every edit tier the
shipped file already certifies are kept; a kind in both takes the new one, and a kind the new file fails to certify
is withdrawn (its failed certificate kept in the meta).

    python3 lab/scripts/edit_tiers.py draw --out .cache/dev/edit-pairs.jsonl --per-kind 80
    python3 lab/scripts/edit_tiers.py certify --kind size --step 5 --rows H200.jsonl.gz:cert --rows NEW.jsonl --out T.json [--risk excess] [--selection H200.jsonl.gz]
    python3 lab/scripts/edit_tiers.py write --tiers OUT/thresholds.json --into src/carnator/embedded/thresholds.json
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEXICON = ROOT / "src/carnator/embedded/lexicon.json"
EDIT_KINDS = ("colour", "object", "small-object", "size", "place", "motion")


def draw(out: Path, per_kind: int, seed: int = 1, warm: int = 1000) -> dict[str, int]:
    from carnator.signature.content import LexiconContent, change_kind
    from carnator_lab.traces import world_trace

    read = LexiconContent.from_file(LEXICON)
    trace = world_trace(warm, 20 * per_kind * len(EDIT_KINDS), seed=seed, split="train")
    by_kind: dict[str, list[dict]] = {k: [] for k in EDIT_KINDS}
    for r in trace.test:
        if r.source is None or r.kind in ("reroll", "reword", "unrelated"):
            continue
        s = trace.warm[r.source]
        kind = change_kind(r.prompt, s.prompt, read(r.prompt), read(s.prompt))
        if kind in by_kind and len(by_kind[kind]) < per_kind:
            by_kind[kind].append({"kind": kind, "source": s.prompt, "source_seed": s.seed, "target": r.prompt,
                                  "target_seed": r.seed})
    rows = [by_kind[k][j] for j in range(per_kind) for k in EDIT_KINDS if j < len(by_kind[k])]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return {k: len(v) for k, v in by_kind.items()}


def _rows(spec: str) -> tuple[list[dict], bool]:
    path, _, part = spec.partition(":")
    if part not in ("", "cert"):
        raise SystemExit(f"--rows {spec!r}: expected PATH or PATH:cert")
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return _relabel(rows), part == "cert"


def _relabel(rows: list[dict]) -> list[dict]:
    """Each row's ``change`` as today's content reader names it (rows written before a kind was split, such as
    ``small-object`` out of ``object``, count under the kind they now belong to)."""
    from carnator.signature.content import LexiconContent, change_kind

    read = LexiconContent.from_file(LEXICON)
    for r in rows:
        if r.get("source") and r.get("target"):
            r["change"] = change_kind(r["target"], r["source"], read(r["target"]), read(r["source"]))
    return rows


def selection(kind: str, specs: list[str], rule: dict, risk: str = "pair") -> dict:
    """What selected ``kind``'s step: per resume step of the rows of ``specs`` (PATH, or PATH:sel for a run's selection
    split), the reused pairs and the unsafe among them, labelled as ``carnator calibrate --risk RISK`` labels them."""
    from carnator.calibrate.certify import CalibrationConfig, split_pairs
    from carnator.calibrate.run import label as label_row
    from carnator.judges import QualityRule

    cfg, label = CalibrationConfig(), QualityRule.from_dict(rule)
    out: dict = {"risk": risk, "on": []}
    for spec in specs:
        path, _, part = spec.partition(":")
        if part not in ("", "sel"):
            raise SystemExit(f"--selection {spec!r}: expected PATH or PATH:sel")
        rows, _ = _rows(path)
        mine = [r for r in rows if r.get("change") == kind]
        ids = sorted({int(r["i"]) for r in mine})
        keep = {ids[j] for j in split_pairs(len(ids), cfg)[0]} if part == "sel" and len(ids) >= 2 else set(ids)
        out["on"].append({"rows": Path(spec).name, "pairs": len(keep)})
        for r in mine:
            if int(r["i"]) in keep and r["hit"]:
                at = out.setdefault(str(int(r["resume_step"])), {"reused": 0, "unsafe": 0})
                at["reused"] += 1
                at["unsafe"] += int(not label_row(r, label, risk))
    return out


def certify(kind: str, step: int, specs: list[str], rule: dict, out: Path, risk: str = "pair",
            selected_on: list[str] | None = None) -> dict:
    """``kind``'s tier at ``step`` certified on the pooled certification rows of ``specs`` (see the module's doc),
    each row labelled as ``carnator calibrate --risk RISK`` labels it; with ``selected_on``, the rows that selected the
    step are counted per step into the tier's ``selection`` (:func:`selection`)."""
    from carnator.calibrate.certify import CalibrationConfig, clopper_pearson_upper, split_pairs
    from carnator.calibrate.run import label as label_row
    from carnator.judges import QualityRule

    cfg, label = CalibrationConfig(), QualityRule.from_dict(rule)
    used: list[dict] = []
    sources = []
    for spec in specs:
        rows, cert_only = _rows(spec)
        mine = [r for r in rows if r.get("change") == kind]
        ids = sorted({int(r["i"]) for r in mine})
        keep = set(ids)
        if cert_only and len(ids) >= 2:
            keep = {ids[j] for j in split_pairs(len(ids), cfg)[1]}   # as certify_tiers split this run's pairs
        at = [r for r in mine if int(r["i"]) in keep and int(r["resume_step"]) == step]
        reused = [r for r in at if r["hit"]]
        bad = sum(1 for r in reused if not label_row(r, label, risk))
        sources.append({"rows": Path(spec).name, "pairs": len(at), "reused": len(reused), "unsafe": bad})   # the file, not its folder
        used += reused
    of = int(used[0]["num_steps"]) if used else 50
    bad = sum(s["unsafe"] for s in sources)
    bound = clopper_pearson_upper(bad, len(used), cfg.confidence) if used else None
    tier = {"kind": kind, "step": step, "of": of, "scope": next((r["scope"] for r in used if r.get("scope")), "frame"),
            "pairs": sum(s["pairs"] for s in sources), "accepted": len(used), "unsafe": bad, "bound": bound,
            "certified": bool(bound is not None and bound <= cfg.delta), "rule": rule, "risk": risk, "certified_on": sources}
    if selected_on:
        tier["selection"] = selection(kind, list(selected_on), rule, risk)
    doc = {"thresholds": {"tiers": {kind: tier}}, "meta": {"tiers": {kind: tier}}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return tier


def write(tiers_file: Path, into: Path) -> dict:
    """Merge the certified edit tiers of ``tiers_file`` into ``into`` (see the module's doc)."""
    from carnator.reuse.tiers import Tier

    new = json.loads(tiers_file.read_text())
    doc = json.loads(into.read_text())
    at = doc["meta"]["resume"]
    tiers = {}
    for kind in ("re-roll", "rewording"):
        c = at["at_45"]["per_category"][kind]
        tiers[kind] = {"kind": kind, "step": at["step"], "of": at["of"], "scope": "frame", "pairs": c["pairs"],
                       "accepted": c["accepted"], "unsafe": c["unsafe"], "bound": c["bound"], "certified": bool(c["certified"])}
    old = doc["thresholds"].get("tiers", {})
    meta = dict(doc["meta"].get("tiers", {}))
    for kind, t in old.items():
        if kind not in tiers and t.get("certified"):
            tiers[kind] = t
    for kind, t in new["thresholds"].get("tiers", {}).items():
        if kind in ("re-roll", "rewording"):
            continue
        meta[kind] = new["meta"]["tiers"][kind]   # the newest certificate of a kind is the one that counts
        if t.get("certified"):
            tiers[kind] = Tier.from_dict(t).to_dict()
        else:   # more rows failed to certify it: no longer shipped
            tiers.pop(kind, None)
    doc["thresholds"]["tiers"] = tiers
    doc["meta"]["tiers"] = meta
    doc["meta"]["tiers_certified_by"] = "lab/scripts/edit_tiers.py (calibrate --resume-step over edit pairs; certify; write)"
    into.write_text(json.dumps(doc, indent=2) + "\n")
    return tiers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--per-kind", type=int, default=80)
    d.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("certify")
    c.add_argument("--kind", required=True)
    c.add_argument("--step", type=int, required=True)
    c.add_argument("--rows", action="append", required=True, help="PATH (every pair) or PATH:cert (its certification split)")
    c.add_argument("--rule", default='{"deltas": {"fidelity": 0.25, "artifact": 0.1, "size": 0.05}, '
                   '"directions": {"fidelity": 1, "artifact": -1, "size": 1}}', help="the kind's QualityRule as JSON")
    c.add_argument("--risk", choices=["pair", "excess"], default="pair", help="as carnator calibrate --risk")
    c.add_argument("--selection", action="append", default=[],
                   help="PATH (every pair) or PATH:sel (its selection split): the rows that selected the step, counted "
                        "per step into the tier's meta")
    c.add_argument("--out", type=Path, required=True)
    w = sub.add_parser("write")
    w.add_argument("--tiers", type=Path, required=True)
    w.add_argument("--into", type=Path, default=ROOT / "src/carnator/embedded/thresholds.json")
    a = ap.parse_args()
    if a.cmd == "draw":
        print(draw(a.out, a.per_kind, a.seed))
    elif a.cmd == "certify":
        print(json.dumps(certify(a.kind, a.step, a.rows, json.loads(a.rule), a.out, a.risk, a.selection), indent=1))
    else:
        print(json.dumps(write(a.tiers, a.into), indent=1))


if __name__ == "__main__":
    main()
