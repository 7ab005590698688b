"""Offline analysis of calibration rows: would another decision rule separate safe reuses better than the box?

    python scripts/risk_score_analysis.py PAIRS.jsonl[.gz] [--splits 20]

Reads ``carnator calibrate`` rows (pairs.jsonl). Prints

* each discrepancy's AUC (unacceptable against acceptable), and, when the rows hold both Early Signatures
  (``signatures``, written since session 11), those of two extra dimensions: ``shared size`` / ``shared shape``,
  the size and shape discrepancies taken over the nouns both prompts share (the paper compares shared nouns by
  colour only, in ``context``);
* the cross-validated AUC (5 folds) of a logistic regression on log(1 + d) of the five discrepancies plus a
  "no substitution" flag (None -> 50, inf -> 1000 before the log), and of text alone;
* the paper's protocol with that linear risk score in place of the box of per-dimension thresholds: on each of
  ``--splits`` random 30/70 splits, fit the regression on the selection split, take the loosest score threshold
  whose selection unsafe share (point) or its 90 % Clopper-Pearson bound (bound) is <= delta, and certify on the
  other 70 % with the one-sided 90 % Clopper-Pearson bound, as ``carnator.reuse.calibrate`` does for the box;
  and the box itself on the same splits (``carnator.reuse.calibrate``, ``--box-candidates`` grid values per
  dimension; calibrate's default is 64, which takes minutes per split).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math

import numpy as np
from scipy.stats import beta
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import cross_val_predict

from carnator.calibration import calibration_pair
from carnator.reuse import CalibrationConfig, CompatConfig, calibrate, noun_diff
from carnator.reuse.calibrate import split_pairs
from carnator.reuse.compat import shape_distance
from carnator.signature import EarlySignature
from carnator.signature.nouns import extract_nouns


def _num(v) -> float:
    if v is None:
        return 50.0
    v = float(v)
    return 1e3 if math.isinf(v) else v


def _auc(y, v) -> float:
    v = np.where(np.isinf(v), 1e9, v)
    return float(roc_auc_score(y, v))


def _cp(k: int, n: int, c: float = 0.9) -> float:
    return 1.0 if n == 0 or k == n else float(beta.ppf(c, k + 1, n - k))


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
    args = ap.parse_args()
    opener = gzip.open if args.pairs.endswith(".gz") else open
    with opener(args.pairs, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("hit") and r.get("d")]
    y = np.array([not r["acceptable"] for r in rows])
    print(f"{len(rows)} reused pairs, {int(y.sum())} unacceptable")
    for k in ("context", "size", "shape", "color", "text"):
        v = np.array([np.nan if r["d"].get(k) is None else float(r["d"][k]) for r in rows])
        m = ~np.isnan(v)
        print(f"AUC {k}: {_auc(y[m], v[m]):.3f} (n {int(m.sum())})")
    with_sig = [i for i, r in enumerate(rows) if (r.get("signatures") or {}).get("query") and r["signatures"].get("source")]
    if with_sig:
        g = np.array([shared_geometry(rows[i]) for i in with_sig])
        print(f"AUC shared size: {_auc(y[with_sig], g[:, 0]):.3f}, shared shape: {_auc(y[with_sig], g[:, 1]):.3f} (n {len(with_sig)})")
    X = np.log1p(np.array([[_num(r["d"]["context"]), _num(r["d"].get("size")), _num(r["d"].get("shape")), _num(r["d"].get("color")),
                            float(r["d"]["text"]), float(r["d"].get("size") is None)] for r in rows]))
    p = cross_val_predict(LogisticRegression(max_iter=5000), X, y, cv=5, method="predict_proba")[:, 1]
    pt = cross_val_predict(LogisticRegression(max_iter=5000), X[:, [4]], y, cv=5, method="predict_proba")[:, 1]
    print(f"cross-validated AUC: linear risk score {roc_auc_score(y, p):.3f}, text alone {roc_auc_score(y, pt):.3f}")
    n_sel = round(0.3 * len(y))
    print("| delta | selection rule | decision rule | certified splits | mean cert. coverage | unsafe share of what it accepts |")
    print("|---|---|---|---|---|---|")
    cal_pairs = [calibration_pair(r) for r in rows]
    for delta in (0.05, 0.075, 0.10):
        for rule in ("point", "bound"):
            res = []
            for seed in range(args.splits):
                S, C = split_pairs(len(y), CalibrationConfig(split_seed=seed))  # the splits calibrate uses
                clf = LogisticRegression(max_iter=5000).fit(X[S], y[S])
                ps, pc = clf.predict_proba(X[S])[:, 1], clf.predict_proba(X[C])[:, 1]
                best = None
                for t in np.unique(ps):
                    acc = ps <= t
                    n, k = int(acc.sum()), int(y[S][acc].sum())
                    if (k / n if rule == "point" else _cp(k, n)) <= delta:
                        best = t
                if best is None:
                    res.append((0, 0, False))
                    continue
                acc = pc <= best
                n, k = int(acc.sum()), int(y[C][acc].sum())
                res.append((n, k, _cp(k, n) <= delta))
            box = []
            for seed in range(args.splits):
                c = calibrate(cal_pairs, CalibrationConfig(delta=delta, split_seed=seed, max_candidates=args.box_candidates,
                                                           selection_confidence=None if rule == "point" else 0.9))
                box.append((c.certification_accepted, c.certification_unsafe, c.certified))
            for name, rs in (("box (paper)", box), ("linear risk", res)):
                acc_n, acc_k = sum(r[0] for r in rs), sum(r[1] for r in rs)
                print(f"| {delta:g} | {rule} | {name} | {sum(r[2] for r in rs)} / {args.splits} | "
                      f"{acc_n / args.splits / (len(y) - n_sel):.3f} | {acc_k / max(acc_n, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
