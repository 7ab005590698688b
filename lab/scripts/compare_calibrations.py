#!/usr/bin/env python3
"""Compare two `carnator calibrate` runs over the same pairs (e.g. two reading settings), on the pairs both hold:
acceptable counts, each dimension's separation (AUC), and how often the labels agree.

    python lab/scripts/compare_calibrations.py RUN_A/pairs.jsonl RUN_B/pairs.jsonl [--delta-fidelity 0.25 --delta-artifact 0.1]
"""

import argparse
import gzip
import json

from carnator.calibrate.run import calibration_pair, reused_rows
from carnator.embedded.judge import shapes_rule
from carnator.calibrate.certify import separation


def load(path: str, rule) -> dict:
    rows = {}
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            r = json.loads(line)
            r["acceptable"] = rule.label(r)
            rows[r["i"]] = r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--delta-fidelity", type=float, default=0.25)
    ap.add_argument("--delta-artifact", type=float, default=0.1)
    args = ap.parse_args()
    rule = shapes_rule(args.delta_fidelity, args.delta_artifact)
    a, b = load(args.a, rule), load(args.b, rule)
    idx = sorted(set(a) & set(b))
    print(f"{len(idx)} pairs in both")
    for name, rows in ((args.a, a), (args.b, b)):
        rs = reused_rows([rows[i] for i in idx])
        sep = separation([calibration_pair(r) for r in rs])
        print(f"{name}: {sum(r['acceptable'] for r in rs)} of {len(rs)} acceptable; AUC "
              + ", ".join(f"{k} {v['auc']:.3f} ({v['unacceptable']}/{v['acceptable']})" for k, v in sep.items() if v["auc"] is not None))
    print(f"same label: {sum(a[i]['acceptable'] == b[i]['acceptable'] for i in idx)} of {len(idx)}")


if __name__ == "__main__":
    main()
