#!/usr/bin/env python3
"""Re-label a finished calibration under other quality rules and select / certify again (no generation).

    python lab/scripts/rule_sweep.py /tmp/cal/pairs.jsonl [--rules 0.1:0.02,0.2:0.05,...]

`carnator calibrate` stores, per pair, the discrepancies and the dense and reuse judge scores, so the
label (acceptable or not) of any rule "fidelity >= dense - DF and artifact <= dense + DA" is a
function of the file. For each rule this prints the acceptable share of reused pairs and of the
re-roll pairs (same prompt, new seed: a reuse that should be as good as dense, so its unacceptable
share is the rule's noise floor), and the selection / certification numbers of
`carnator.calibrate.certify` with the default CalibrationConfig.
"""

from __future__ import annotations

import argparse
import json

from carnator.calibrate.run import calibration_pair, reused_rows
from carnator.embedded.judge import shapes_rule
from carnator.calibrate.certify import CalibrationConfig, calibrate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs")
    ap.add_argument("--rules", default="0.1:0.02,0.1:0.05,0.2:0.05,0.25:0.05,0.34:0.05")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.pairs)]
    rows = reused_rows(rows)
    print(f"{len(rows)} reused pairs")
    print("| rule (DF, DA) | acceptable | re-rolls acceptable | selection accepted / unsafe | certification accepted / unsafe | bound | certified |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.rules.split(","):
        df, da = (float(x) for x in spec.split(":"))
        rule = shapes_rule(df, da)
        ok = [rule.label(r) for r in rows]
        rr = [o for r, o in zip(rows, ok) if r["kind"] == "reroll"]
        res = calibrate([calibration_pair(r, o) for r, o in zip(rows, ok)], CalibrationConfig())
        print(f"| {df}, {da} | {sum(ok)}/{len(ok)} ({sum(ok) / len(ok):.0%}) | {sum(rr)}/{len(rr)} | {res.selection_accepted} / {res.selection_unsafe} "
              f"| {res.certification_accepted} / {res.certification_unsafe} | {res.certification_bound:.3f} | {res.certified} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
