"""Edit tiers on the embedded model: the calibration pairs of each kind of edit, and the thresholds file they certify.

``draw``: single-change edit pairs from the *train* split of the shapes world (the held-out stream is never used for
calibration): each edit request of ``world_trace(W, S, seed, split="train")`` with the warm request it edits, labelled
by what the content reader says changed (``change_kind``: colour, object, size, place, motion), at most
``--per-kind`` of each, the kinds interleaved (a run cut short still has every kind). Writes a pairs file for
``carnator calibrate --pairs-file F --resume-step 5,10,20,30``.

``write``: the shipped thresholds file from such a calibration's thresholds.json (its certified edit tiers) and the
same-content tiers certified at step 45 (re-roll, rewording: ``meta.resume.at_45`` of the current shipped file).

    python3 lab/scripts/edit_tiers.py draw --out .cache/dev/edit-pairs.jsonl --per-kind 80
    python3 lab/scripts/edit_tiers.py write --tiers OUT/thresholds.json --into src/carnator/embedded/thresholds.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEXICON = ROOT / "src/carnator/embedded/lexicon.json"
EDIT_KINDS = ("colour", "object", "size", "place", "motion")


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


def write(tiers_file: Path, into: Path) -> dict:
    """Merge the certified edit tiers of ``tiers_file`` and the same-content tiers at 45 into ``into``."""
    new = json.loads(tiers_file.read_text())
    doc = json.loads(into.read_text())
    at = doc["meta"]["resume"]
    tiers = {}
    for kind in ("re-roll", "rewording"):
        c = at["at_45"]["per_category"][kind]
        tiers[kind] = {"kind": kind, "step": at["step"], "of": at["of"], "scope": "frame", "pairs": c["pairs"],
                       "accepted": c["accepted"], "unsafe": c["unsafe"], "bound": c["bound"], "certified": bool(c["certified"])}
    for kind, t in new["thresholds"].get("tiers", {}).items():
        if kind not in tiers and t.get("certified"):
            tiers[kind] = t
    doc["thresholds"]["tiers"] = tiers
    doc["meta"]["tiers"] = new["meta"]["tiers"]
    doc["meta"]["tiers_certified_by"] = "lab/scripts/edit_tiers.py write (calibrate --resume-step over edit pairs)"
    into.write_text(json.dumps(doc, indent=2) + "\n")
    return tiers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--per-kind", type=int, default=80)
    d.add_argument("--seed", type=int, default=1)
    w = sub.add_parser("write")
    w.add_argument("--tiers", type=Path, required=True)
    w.add_argument("--into", type=Path, default=ROOT / "src/carnator/embedded/thresholds.json")
    a = ap.parse_args()
    if a.cmd == "draw":
        print(draw(a.out, a.per_kind, a.seed))
    else:
        print(json.dumps(write(a.tiers, a.into), indent=1))


if __name__ == "__main__":
    main()
