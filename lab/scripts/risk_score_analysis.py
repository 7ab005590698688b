"""Offline analysis of calibration rows: would another decision rule separate safe reuses better than the box?

    python lab/scripts/risk_score_analysis.py PAIRS.jsonl[.gz] [--splits 20]

Reads ``carnator calibrate`` rows (pairs.jsonl). Prints

* each discrepancy's AUC (unacceptable against acceptable), and, when the rows hold both Early Signatures
  (``signatures``, written since session 11), those of two extra dimensions: ``shared size`` / ``shared shape``,
  the size and shape discrepancies taken over the nouns both prompts share (the paper compares shared nouns by
  colour only, in ``context``);
* the cross-validated AUC (5 folds) of a logistic regression on log(1 + d) of the five discrepancies plus a
  "no substitution" flag (``reuse.risk_features``, what ``--rule linear`` fits on), and of text alone;
* ``carnator.calibrate.certify`` with each decision rule on ``--splits`` random splits (split seeds 0..; selection
  share ``--fractions``, the paper's 0.3) at each of ``--deltas``: the paper's box of per-dimension thresholds
  (``--box-candidates`` grid values per dimension; calibrate's default is 64, which takes minutes per split) and
  ``rule="linear"`` (that risk score fitted on the selection split, one threshold on it), each with every
  ``--selection`` rule (point: the paper's; a number C: the Clopper-Pearson bound at C), certified with the
  one-sided 90 % Clopper-Pearson bound on the rest.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import cross_val_predict

from carnator.calibrate.run import calibration_pair
from carnator.calibrate.certify import CalibrationConfig, calibrate, separation
from carnator.reuse import CompatConfig, noun_diff, risk_features
from carnator.reuse.compat import shape_distance
from carnator.signature import EarlySignature
from carnator.signature.nouns import extract_nouns


def _auc(y, v) -> float:
    v = np.where(np.isinf(v), 1e9, v)
    return float(roc_auc_score(y, v))


def shared_geometry(row, cfg=CompatConfig()) -> tuple[float, float]:
    q, j = (EarlySignature.from_dict(row["signatures"][s]) for s in ("query", "source"))
    diff = noun_diff(extract_nouns(row["target"]), extract_nouns(row["source"]))
    size, shape = 0.0, 0.0
    for n in diff.shared:
        a, b = q.get(n), j.get(n)
        if a is None or b is None:
            return math.inf, 1.0
        size = max(size, abs(math.log(max(a.area, cfg.area_floor) / max(b.area, cfg.area_floor))))
        shape = max(shape, shape_distance(a.mask_tail, b.mask_tail, cfg))
    return size, shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs")
    ap.add_argument("--splits", type=int, default=20)
    ap.add_argument("--box-candidates", type=int, default=24)
    ap.add_argument("--deltas", default="0.05,0.075,0.1", help="comma-separated tolerated unsafe rates")
    ap.add_argument("--selection", default="point,0.9",
                    help="comma-separated selection rules: point (the paper) or a confidence C (the Clopper-Pearson bound at C)")
    ap.add_argument("--fractions", default="0.3", help="comma-separated selection-split fractions (the paper: 0.3)")
    args = ap.parse_args()
    opener = gzip.open if args.pairs.endswith(".gz") else open
    with opener(args.pairs, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("hit") and r.get("d")]
    y = np.array([not r["acceptable"] for r in rows])
    print(f"{len(rows)} reused pairs, {int(y.sum())} unacceptable")
    cal_pairs = [calibration_pair(r) for r in rows]
    for k, v in separation(cal_pairs).items():
        print(f"AUC {k}: {v['auc']:.3f} (n {v['unacceptable'] + v['acceptable']})")
    with_sig = [i for i, r in enumerate(rows) if (r.get("signatures") or {}).get("query") and r["signatures"].get("source")]
    if with_sig:
        g = np.array([shared_geometry(rows[i]) for i in with_sig])
        print(f"AUC shared size: {_auc(y[with_sig], g[:, 0]):.3f}, shared shape: {_auc(y[with_sig], g[:, 1]):.3f} (n {len(with_sig)})")
    X = np.stack([risk_features(p.d) for p in cal_pairs])   # the features the library's linear rule fits on
    p = cross_val_predict(LogisticRegression(max_iter=5000), X, y, cv=5, method="predict_proba")[:, 1]
    pt = cross_val_predict(LogisticRegression(max_iter=5000), X[:, [4]], y, cv=5, method="predict_proba")[:, 1]
    print(f"cross-validated AUC: linear risk score {roc_auc_score(y, p):.3f}, text alone {roc_auc_score(y, pt):.3f}")
    print("| delta | selection split | selection rule | decision rule | certified splits | mean cert. coverage | unsafe share of what it accepts |")
    print("|---|---|---|---|---|---|---|")
    for delta in map(float, args.deltas.split(",")):
        for frac in map(float, args.fractions.split(",")):
            for sel in args.selection.split(","):
                conf = None if sel == "point" else float(sel)
                rows_out = {}
                for name, kw in (("box (paper)", {"rule": "box", "max_candidates": args.box_candidates}), ("linear risk", {"rule": "linear"})):
                    res = [calibrate(cal_pairs, CalibrationConfig(delta=delta, split_seed=seed, selection_fraction=frac,
                                                                  selection_confidence=conf, **kw))
                           for seed in range(args.splits)]
                    acc_n, acc_k = sum(r.certification_accepted for r in res), sum(r.certification_unsafe for r in res)
                    rows_out[name] = (sum(r.certified for r in res), acc_n / args.splits / res[0].certification_size, acc_k / max(acc_n, 1))
                for name, (cert, cov, share) in rows_out.items():
                    rule = "point" if conf is None else f"bound {conf:g}"
                    print(f"| {delta:g} | {frac:g} | {rule} | {name} | {cert} / {args.splits} | {cov:.3f} | {share:.3f} |", flush=True)

if __name__ == "__main__":
    main()
