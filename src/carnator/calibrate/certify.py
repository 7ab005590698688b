"""Risk-aware threshold selection (PAPER step 6), offline.

Input: request-cache pairs, each with its :class:`~carnator.reuse.compat.Discrepancies` and a
boolean ``acceptable`` (reuse quality within ``Delta_m`` of dense for every metric ``m``; deciding
that is the caller's job). The pairs are split deterministically into a *selection* and a disjoint
*certification* set (paper: 30 and 70 pairs).

* Selection: grid search over per-dimension candidate thresholds (the observed values, plus
  ``+inf`` = off, plus one value below every observation = reject every applicable pair) for the
  ``tau`` maximizing coverage (share of pairs accepted) subject to unsafe rate (unacceptable among
  accepted) ``<= delta`` (``CalibrationConfig.selection_confidence``: its Clopper-Pearson bound instead, a
  deviation). Ties: fewer unsafe pairs, then the tightest thresholds (smallest sum of candidate ranks), which
  generalize more conservatively. Dimensions: the paper's four and ``text`` (``CalibrationConfig.text``).
* Certification: apply ``tau`` to the certification set and compute the one-sided Clopper-Pearson
  upper bound on the unsafe rate at confidence ``1 - alpha``; certified iff the bound ``<= delta``.
  Paper: 50 of 70 accepted, 0 unsafe, bound ``1 - 0.1**(1/50) = 4.50 %`` at 90 %.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.stats import beta

from ..reuse.compat import DIMENSIONS, Discrepancies, RiskScore, Thresholds, risk_features
from ..reuse.tiers import SAME_CONTENT_KINDS

__all__ = [
    "CalibrationConfig",
    "CalibrationPair",
    "CalibrationResult",
    "calibrate",
    "clopper_pearson_upper",
    "evaluate",
    "fit_logistic",
    "select_risk",
    "select_thresholds",
    "separation",
    "split_pairs",
]


@dataclass(frozen=True)
class CalibrationPair:
    """One (query, cached request) pair: its discrepancies and whether reusing was acceptable."""

    d: Discrepancies
    acceptable: bool
    key: str | None = None
    """Optional identifier, carried for reports only."""


@dataclass(frozen=True)
class CalibrationConfig:
    """Knobs of the risk-aware selection. Paper values where it gives them (PAPER step 6)."""

    delta: float = 0.05
    """Maximum tolerated unsafe rate (paper: 5 %)."""
    confidence: float = 0.90
    """Confidence ``1 - alpha`` of the Clopper-Pearson certification bound (paper: 90 %)."""
    n_selection: int | None = None
    """Size of the selection split; ``None`` uses ``selection_fraction``. The paper uses 30 of 100."""
    selection_fraction: float = 0.3
    """Share of pairs used for selection when ``n_selection`` is ``None`` (paper: 30 of 100),
    rounded to the nearest integer and kept within ``[1, n - 1]``."""
    split_seed: int | None = 0
    """Seed of the deterministic shuffle before splitting; ``None`` keeps the given order (the first
    pairs select, the rest certify). Chosen default: 0."""
    max_candidates: int = 64
    """At most this many observed values per dimension are grid candidates (evenly spaced ranks of
    the sorted distinct values, always including the largest); the search costs about
    ``max_candidates**4`` operations (about a second at 64) per text candidate, plus ``O(n)``. Chosen default."""
    text: bool = True
    """Select a threshold on ``d_text`` (1 - recall cosine) as well; False keeps it off, as the paper (which
    calibrates the four signature dimensions only). Chosen default: on (docs/METHOD.md)."""
    selection_confidence: float | None = None
    """None (the paper): a selection threshold is feasible when its unsafe share on the selection split is
    ``<= delta``. A number: when the Clopper-Pearson upper bound of that share at this confidence is. On 480
    stream pairs the paper's rule picked thresholds that certified on 1 of 20 random splits (the
    coverage-maximising search lands on the loosest point a small split happens to favour), the bound at 90 %
    on 11 of 20 (docs/METHOD.md); but a bound needs a selection split of >= 45 accepted pairs to
    accept anything at delta 5 %, so it is no default for the paper's 30 selection pairs."""

    rule: str = "box"
    """The decision rule selected: "box" (the paper: one threshold per discrepancy) or "linear" (beyond it: a
    logistic risk score over all discrepancies, :class:`~carnator.reuse.compat.RiskScore`, fitted on the selection
    split, and one threshold on it). On the embedded world's 1,081 stream pairs the linear rule accepted fewer
    unsafe pairs on every delta and selection rule tried, and certified more often (docs/METHOD.md);
    on 2,933 pairs at delta 5 % with the 90 % bound selection it certified on 12 of 20 random splits, the box on 7,
    and the shipped embedded file is a linear one. Chosen default: the paper's."""
    l2: float = 1.0
    """L2 penalty on the risk score's weights (``rule="linear"``): the fit minimizes
    ``l2 / 2 * |w|^2 + sum of log-losses``, scikit-learn's ``LogisticRegression(C=1 / l2)``. Chosen default: 1."""

    def __post_init__(self) -> None:
        if self.rule not in ("box", "linear"):
            raise ValueError(f"CalibrationConfig: rule must be 'box' or 'linear', got {self.rule!r}")
        if not self.l2 > 0.0:
            raise ValueError(f"CalibrationConfig: l2 must be > 0, got {self.l2}")
        if not 0.0 <= self.delta < 1.0:
            raise ValueError(f"CalibrationConfig: delta must lie in [0, 1), got {self.delta}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"CalibrationConfig: confidence must lie in (0, 1), got {self.confidence}")
        if not 0.0 < self.selection_fraction < 1.0:
            raise ValueError(f"CalibrationConfig: selection_fraction must lie in (0, 1), got {self.selection_fraction}")
        if self.max_candidates < 1:
            raise ValueError("CalibrationConfig: max_candidates must be >= 1")
        if self.selection_confidence is not None and not 0.0 < self.selection_confidence < 1.0:
            raise ValueError(f"CalibrationConfig: selection_confidence must lie in (0, 1) or be None, got {self.selection_confidence}")


@dataclass(frozen=True)
class CalibrationResult:
    """Outcome of :func:`calibrate`."""

    thresholds: Thresholds
    delta: float
    confidence: float
    selection_size: int
    selection_accepted: int
    selection_unsafe: int
    certification_size: int
    certification_accepted: int
    certification_unsafe: int
    certification_bound: float
    """One-sided Clopper-Pearson upper bound on the unsafe rate among accepted certification pairs
    (1.0 when none is accepted)."""
    certified: bool
    """``certification_accepted > 0`` and ``certification_bound <= delta``."""
    selection_indices: tuple[int, ...] = field(default=(), repr=False)
    certification_indices: tuple[int, ...] = field(default=(), repr=False)

    @property
    def selection_coverage(self) -> float:
        return self.selection_accepted / self.selection_size if self.selection_size else 0.0

    @property
    def selection_unsafe_rate(self) -> float:
        return self.selection_unsafe / self.selection_accepted if self.selection_accepted else 0.0

    @property
    def certification_coverage(self) -> float:
        return self.certification_accepted / self.certification_size if self.certification_size else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (for ``Thresholds.save(meta=...)``)."""
        return {
            "delta": self.delta,
            "confidence": self.confidence,
            "selection": {
                "size": self.selection_size,
                "accepted": self.selection_accepted,
                "unsafe": self.selection_unsafe,
                "coverage": self.selection_coverage,
            },
            "certification": {
                "size": self.certification_size,
                "accepted": self.certification_accepted,
                "unsafe": self.certification_unsafe,
                "bound": self.certification_bound,
                "coverage": self.certification_coverage,
            },
            "certified": self.certified,
        }


def clopper_pearson_upper(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper confidence bound for a binomial rate with ``k`` of ``n``.

    The largest ``p`` with ``P(X <= k | n, p) >= 1 - confidence``, i.e. the ``confidence`` quantile of
    ``Beta(k + 1, n - k)``; 1 when ``k == n`` or ``n == 0``. For ``k = 0`` it is
    ``1 - (1 - confidence)**(1/n)`` (paper: ``n = 50`` at 90 % gives 4.50 %).
    """
    k, n = int(k), int(n)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"need 0 <= k <= n, got k={k} n={n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if n == 0 or k == n:
        return 1.0
    return float(beta.ppf(confidence, k + 1, n - k))


def clopper_pearson_lower(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson lower confidence bound for a binomial rate with ``k`` of ``n``.

    The smallest ``p`` with ``P(X >= k | n, p) >= 1 - confidence``, i.e. the ``1 - confidence`` quantile of
    ``Beta(k, n - k + 1)``; 0 when ``k == 0``. For ``k == n`` it is ``(1 - confidence)**(1/n)``. A lower bound above
    ``delta`` says, at ``confidence``, that the rate exceeds ``delta`` (the one-sided binomial test of ``p <= delta``
    rejects): what a live audit needs before it stops a certified tier."""
    k, n = int(k), int(n)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"need 0 <= k <= n, got k={k} n={n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if k == 0:
        return 0.0
    return float(beta.ppf(1.0 - confidence, k, n - k + 1))


def _matrix(pairs: Sequence[CalibrationPair]) -> tuple[np.ndarray, np.ndarray]:
    """``(n, len(DIMENSIONS))`` discrepancy values (not applicable -> -inf, always passes) and ``(n,)`` unsafe flags."""
    vals = np.array(
        [[-math.inf if getattr(p.d, k) is None else float(getattr(p.d, k)) for k in DIMENSIONS] for p in pairs],
        dtype=np.float64,
    ).reshape(len(pairs), len(DIMENSIONS))
    unsafe = np.array([not bool(p.acceptable) for p in pairs], dtype=bool)
    return vals, unsafe


def evaluate(pairs: Sequence[CalibrationPair], tau: Thresholds) -> tuple[int, int]:
    """``(accepted, unsafe)`` counts of ``tau`` on ``pairs`` (same rule as ``compat.compatible``)."""
    if not pairs:
        return 0, 0
    vals, unsafe = _matrix(pairs)
    t = np.array([getattr(tau, k) for k in DIMENSIONS])
    acc = np.all(vals <= t[None, :], axis=1)  # NaN compares False: rejected
    if not math.isinf(tau.content):
        acc &= np.array([p.d.content is None or p.d.content <= tau.content for p in pairs], dtype=bool)
    if tau.risk is not None:
        acc &= np.array([tau.risk.accepts(p.d) for p in pairs], dtype=bool)
    return int(acc.sum()), int((acc & unsafe).sum())


def stratified_certification(pairs: Sequence[CalibrationPair], kinds: Sequence[str], tau: Thresholds, *,
                             delta: float = 0.05, confidence: float = 0.90) -> dict[str, dict[str, Any]]:
    """The certificate per kind of change: for each kind, the pairs of that kind, how many ``tau`` accepts,
    how many of those are unsafe, the one-sided Clopper-Pearson upper bound of the unsafe rate at ``confidence``, and
    ``certified`` (bound <= ``delta``). A kind ``tau`` accepts nothing of is reported with ``certified`` None: no hit
    of that kind is served, so there is no rate to bound. A bound over a mix says nothing about the kind a user
    sends; this says it per kind. Also an ``"all"`` row over every pair."""
    if len(pairs) != len(kinds):
        raise ValueError(f"{len(pairs)} pairs but {len(kinds)} kinds")
    groups: dict[str, list[CalibrationPair]] = {}
    for p, k in zip(pairs, kinds):
        groups.setdefault(str(k), []).append(p)
    groups["all"] = list(pairs)
    out: dict[str, dict[str, Any]] = {}
    for k, ps in groups.items():
        acc, bad = evaluate(ps, tau)
        bound = clopper_pearson_upper(bad, acc, confidence) if acc else None
        out[k] = {"pairs": len(ps), "accepted": acc, "unsafe": bad, "unsafe_rate": bad / acc if acc else None,
                  "bound": bound, "certified": None if bound is None else bool(bound <= delta)}
    return out


def separation(pairs: Sequence[CalibrationPair]) -> dict[str, dict[str, Any]]:
    """How well each dimension alone tells unacceptable pairs from acceptable ones.

    Per dimension, over the pairs where it applies: ``auc`` = the probability that a random unacceptable pair has a
    larger discrepancy than a random acceptable one (ties count half; the Mann-Whitney ``U / (n_bad * n_good)``).
    1 separates perfectly, 0.5 is chance, below 0.5 means larger discrepancies go with *better* reuses, so a
    threshold on that dimension can only cost coverage. ``None`` when either class is empty. A diagnostic for
    why thresholds do or do not certify; the selection itself searches the dimensions jointly.
    """
    from scipy.stats import mannwhitneyu

    vals, unsafe = _matrix(pairs)
    out: dict[str, dict[str, Any]] = {}
    for j, k in enumerate(DIMENSIONS):
        col = vals[:, j]
        ok = ~np.isnan(col) & (col != -math.inf)   # -inf: not applicable; +inf (undefined) ranks highest
        bad, good = col[ok & unsafe], col[ok & ~unsafe]
        auc = None
        if len(bad) and len(good):
            auc = float(mannwhitneyu(bad, good, alternative="two-sided").statistic) / (len(bad) * len(good))
        out[k] = {"auc": auc, "unacceptable": int(len(bad)), "acceptable": int(len(good))}
    return out


def split_pairs(n: int, cfg: CalibrationConfig = CalibrationConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic disjoint (selection, certification) index arrays over ``range(n)``, each sorted."""
    if n < 2:
        raise ValueError(f"need at least 2 pairs to split into selection and certification, got {n}")
    n_sel = int(cfg.n_selection) if cfg.n_selection is not None else round(cfg.selection_fraction * n)
    if cfg.n_selection is not None and not 1 <= n_sel <= n - 1:
        raise ValueError(f"n_selection={n_sel} leaves an empty split for {n} pairs")
    n_sel = min(max(n_sel, 1), n - 1)
    order = np.arange(n) if cfg.split_seed is None else np.random.default_rng(cfg.split_seed).permutation(n)
    return np.sort(order[:n_sel]), np.sort(order[n_sel:])


def _candidates(col: np.ndarray, max_candidates: int) -> np.ndarray:
    obs = np.unique(col[np.isfinite(col)])
    if obs.size > max_candidates:
        obs = obs[np.linspace(0, obs.size - 1, max_candidates).round().astype(np.int64)]
    reject = (min(0.0, float(obs[0])) if obs.size else 0.0) - 1.0  # below every observation
    return np.concatenate([[reject], obs, [math.inf]])


def allowed_unsafe(n: int, delta: float, confidence: float | None = None) -> np.ndarray:
    """``a[k]``: the most unsafe pairs a threshold accepting ``k`` pairs may have and stay feasible in selection.

    ``confidence`` None (the paper): the point estimate, ``unsafe <= delta * k``. Else the one-sided Clopper-Pearson
    upper bound at that confidence must be ``<= delta``. Accepting nothing is always feasible (``a[0] = 0``).
    """
    k = np.arange(n + 1)
    if confidence is None:
        return np.floor(delta * k + 1e-9).astype(np.int64)
    out = np.full(n + 1, -1, dtype=np.int64)
    out[0] = 0
    for acc in range(1, n + 1):
        # The bound grows with the unsafe count and falls with the accepted count: start from acc - 1's (not the
        # forced a[0]).
        u = out[acc - 1] if acc > 1 else -1
        while u + 1 <= acc and clopper_pearson_upper(u + 1, acc, confidence) <= delta:
            u += 1
        out[acc] = u
    return out


def _search4(r: np.ndarray, unsafe: np.ndarray, keep: np.ndarray, sizes: Sequence[int], n: int, kmax: int,
             allowed: np.ndarray, rank_offset: int) -> tuple[int, tuple[int, int, int, int]]:
    """The best candidate indices of four dimensions over the pairs ``keep`` (see :func:`select_thresholds`)."""
    # Accepted / unsafe counts for every candidate combination are 4-D cumulative sums of the pair
    # histogram over r; sweep dimension 0 and keep a running 3-D slice (memory K^3, time ~K^4).
    k1, k2, k3 = sizes[1:]
    acc = np.zeros((k1, k2, k3), dtype=np.int64)
    uns = np.zeros((k1, k2, k3), dtype=np.int64)
    ranks123 = np.arange(k1)[:, None, None] + np.arange(k2)[None, :, None] + np.arange(k3)[None, None, :]
    best_key, best = -1, (0, 0, 0, 0)
    for c0 in range(sizes[0]):
        sel = keep & (r[:, 0] == c0)
        if sel.any():
            for counts, weights in ((acc, None), (uns, unsafe[sel])):
                h = np.zeros((k1, k2, k3), dtype=np.int64)
                idx = (r[sel, 1], r[sel, 2], r[sel, 3])
                np.add.at(h, idx, 1 if weights is None else weights.astype(np.int64))
                counts += h.cumsum(0).cumsum(1).cumsum(2)
        feasible = uns <= allowed[acc]
        # lexicographic: most accepted, then fewest unsafe, then tightest (smallest rank sum)
        key = np.where(feasible, (acc * (n + 1) + (n - uns)) * (kmax + 1) + (kmax - rank_offset - c0 - ranks123), -1)
        flat = int(np.argmax(key))
        kv = int(key.flat[flat])
        if kv > best_key:
            best_key = kv
            i1, i2, i3 = (int(i) for i in np.unravel_index(flat, key.shape))
            best = (c0, i1, i2, i3)
    return best_key, best


def select_thresholds(pairs: Sequence[CalibrationPair], delta: float, max_candidates: int = 64,
                      confidence: float | None = None) -> tuple[Thresholds, int, int]:
    """Grid search for the coverage-maximizing ``tau`` with unsafe rate ``<= delta`` on ``pairs`` (``confidence``:
    its Clopper-Pearson upper bound at that confidence, see :func:`allowed_unsafe`).

    Returns ``(tau, accepted, unsafe)``. Always feasible: accepting nothing has unsafe rate 0. The four signature
    dimensions are searched by cumulative sums; each candidate of the text dimension (which only removes pairs as
    it tightens) runs that search on the pairs it passes.
    """
    if not pairs:
        raise ValueError("select_thresholds needs at least one pair")
    vals, unsafe = _matrix(pairs)
    n, dims = vals.shape
    cands = [_candidates(vals[:, k], max_candidates) for k in range(dims)]
    sizes = [len(c) for c in cands]
    # r[p, k]: index of the tightest candidate of dimension k that pair p passes (values <= it);
    # not applicable (-inf) -> 0; NaN sorts past the end -> never passes.
    r = np.stack([np.searchsorted(cands[k], vals[:, k], side="left") for k in range(dims)], axis=1)
    valid = np.all(r < np.array(sizes)[None, :], axis=1)
    kmax = sum(s - 1 for s in sizes)
    allowed = allowed_unsafe(n, delta, confidence)
    best_key, best = -1, (0,) * dims
    for outer in itertools.product(*(range(s) for s in sizes[4:])):
        keep = valid & np.all(r[:, 4:] <= np.array(outer, dtype=np.int64)[None, :], axis=1)
        key, inner = _search4(r, unsafe, keep, sizes[:4], n, kmax, allowed, sum(outer))
        if key > best_key:
            best_key, best = key, (*inner, *outer)
    chosen: dict[str, Any] = {k: float(cands[i][best[i]]) for i, k in enumerate(DIMENSIONS)}
    tau = Thresholds(**chosen)
    acc_n, uns_n = evaluate(pairs, tau)
    return tau, acc_n, uns_n


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1.0) -> tuple[np.ndarray, float]:
    """L2-penalized logistic regression: ``(w, b)`` minimizing ``l2 / 2 * |w|^2 + sum_i log(1 + exp(-s_i (w . x_i + b)))``
    with ``s_i = +1`` for ``y_i`` true, else -1 (the bias is not penalized), as scikit-learn's
    ``LogisticRegression(C=1 / l2)`` defines it. Newton's method with backtracking, to a gradient below 1e-9: the
    objective is strictly convex in ``w``, so the solution is unique (``y`` must hold both classes)."""
    from scipy.special import expit, log_expit

    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=bool)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(f"fit_logistic needs X (n, d) and y (n,) with n >= 1, got {X.shape} and {y.shape}")
    if y.all() or not y.any():
        raise ValueError("fit_logistic needs both classes in y")
    A = np.hstack([X, np.ones((X.shape[0], 1))])
    s = np.where(y, 1.0, -1.0)
    reg = np.full(A.shape[1], float(l2))
    reg[-1] = 0.0

    def f(t: np.ndarray) -> float:
        return 0.5 * (reg * t) @ t - log_expit(s * (A @ t)).sum()

    t = np.zeros(A.shape[1])
    for _ in range(200):
        p = expit(A @ t)
        g = reg * t + A.T @ (p - y)
        if np.max(np.abs(g)) < 1e-9:
            break
        H = (A * (p * (1 - p))[:, None]).T @ A + np.diag(reg)
        step = np.linalg.solve(H + 1e-12 * np.eye(len(t)), g)
        fx, a = f(t), 1.0
        while f(t - a * step) > fx - 1e-4 * a * (g @ step) and a > 1e-10:
            a *= 0.5
        t = t - a * step
    return t[:-1].copy(), float(t[-1])


def select_risk(pairs: Sequence[CalibrationPair], delta: float, confidence: float | None = None,
                l2: float = 1.0) -> tuple[Thresholds, int, int]:
    """The ``rule="linear"`` selection: fit a :class:`~carnator.reuse.compat.RiskScore` on ``pairs`` (unacceptable =
    1), then take the loosest threshold on its score whose accepted pairs have an unsafe share ``<= delta``
    (``confidence``: its Clopper-Pearson bound, as :func:`select_thresholds`); ties go to fewer unsafe pairs, then the
    tighter threshold. Returns ``(tau, accepted, unsafe)`` with every per-dimension threshold off; accepting nothing
    (a threshold below every score) is always feasible."""
    if not pairs:
        raise ValueError("select_risk needs at least one pair")
    X = np.stack([risk_features(p.d) for p in pairs])
    unsafe = np.array([not bool(p.acceptable) for p in pairs], dtype=bool)
    ok = np.all(np.isfinite(X), axis=1)
    if unsafe[ok].all() or not unsafe[ok].any():   # one class only: no rule to learn; a flat score
        w, b = np.zeros(X.shape[1]), 0.0
    else:
        w, b = fit_logistic(X[ok], unsafe[ok], l2)
    off: dict[str, Any] = dict.fromkeys(DIMENSIONS, math.inf)
    base = RiskScore(tuple(w), b, -1.0)
    # Scored through RiskScore.risk itself, not a vectorized copy: the threshold is then exactly the value the policy
    # and evaluate() compare against. NaN inputs give NaN: never accepted.
    scores = np.array([base.risk(p.d) for p in pairs])
    allowed = allowed_unsafe(len(pairs), delta, confidence)
    best = (0, 0, -1.0)   # accepted, unsafe, threshold: nothing accepted
    for t in np.unique(scores[np.isfinite(scores)]):
        acc = scores <= t
        a, u = int(acc.sum()), int((acc & unsafe).sum())
        if u <= allowed[a] and (a, -u) > (best[0], -best[1]):
            best = (a, u, float(t))
    return Thresholds(**off, risk=RiskScore(tuple(w), b, best[2])), best[0], best[1]


def calibrate(pairs: Sequence[CalibrationPair], cfg: CalibrationConfig = CalibrationConfig()) -> CalibrationResult:
    """Split, select ``tau`` on the selection split, certify it on the certification split."""
    if not cfg.text:  # the paper's four dimensions: text not applicable in the search, off in the result
        pairs = [CalibrationPair(replace(p.d, text=None), p.acceptable, p.key) for p in pairs]
    sel_idx, cert_idx = split_pairs(len(pairs), cfg)
    sel = [pairs[i] for i in sel_idx]
    cert = [pairs[i] for i in cert_idx]
    if cfg.rule == "linear":
        tau, s_acc, s_uns = select_risk(sel, cfg.delta, cfg.selection_confidence, cfg.l2)
    else:
        tau, s_acc, s_uns = select_thresholds(sel, cfg.delta, cfg.max_candidates, cfg.selection_confidence)
    if not cfg.text:
        tau = replace(tau, text=math.inf)
    c_acc, c_uns = evaluate(cert, tau)
    bound = clopper_pearson_upper(c_uns, c_acc, cfg.confidence)
    return CalibrationResult(
        thresholds=tau,
        delta=cfg.delta,
        confidence=cfg.confidence,
        selection_size=len(sel),
        selection_accepted=s_acc,
        selection_unsafe=s_uns,
        certification_size=len(cert),
        certification_accepted=c_acc,
        certification_unsafe=c_uns,
        certification_bound=bound,
        certified=bool(c_acc > 0 and bound <= cfg.delta),
        selection_indices=tuple(int(i) for i in sel_idx),
        certification_indices=tuple(int(i) for i in cert_idx),
    )


def _unsafe(rows: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for r in rows if not r["acceptable"])


def certify_tiers(rows: Sequence[Mapping[str, Any]], cfg: CalibrationConfig = CalibrationConfig()) -> dict[str, dict[str, Any]]:
    """Per kind of change, its tier selected and certified from calibration rows of several resume steps.

    ``rows``: one per (pair, resume step) with ``i`` (the pair), ``change`` (its kind), ``resume_step``,
    ``num_steps``, ``hit`` (the forced reuse ran: the source passed the admission gate and a region was found) and
    ``acceptable`` (the judge's label). Each kind's pairs are split as :func:`split_pairs` splits
    (``cfg.selection_fraction``, ``cfg.split_seed``); on the selection split the latest step whose unsafe share among
    the reused would still certify at the size of the certification split's reuses (or, with
    ``cfg.selection_confidence``, whose bound is within ``cfg.delta``) is chosen, then certified once on the
    certification split. Returns, per kind, the :class:`Tier` as a dict with ``selection`` (per step:
    reused, unsafe) beside it; a kind no step passes in selection has ``step`` None."""
    by_kind: dict[str, dict[int, dict[int, Mapping[str, Any]]]] = {}
    of: dict[str, int] = {}
    for r in rows:
        kind = str(r.get("change") or r.get("kind"))
        by_kind.setdefault(kind, {}).setdefault(int(r["i"]), {})[int(r["resume_step"])] = r
        if r.get("num_steps"):
            of[kind] = int(r["num_steps"])
    out: dict[str, dict[str, Any]] = {}
    for kind, pairs in sorted(by_kind.items()):
        ids = sorted(pairs)
        if len(ids) < 2:
            out[kind] = {"kind": kind, "step": None, "of": of.get(kind), "selection": {}, "selection_pairs": 0}
            continue
        sel_idx, cert_idx = split_pairs(len(ids), cfg)
        sel, cert = [ids[j] for j in sel_idx], [ids[j] for j in cert_idx]
        steps = sorted({s for i in ids for s in pairs[i]})
        table, chosen = {}, None
        for s in steps:
            reused = [pairs[i][s] for i in sel if s in pairs[i] and pairs[i][s]["hit"]]
            bad = _unsafe(reused)
            table[str(s)] = {"reused": len(reused), "unsafe": bad}
            if not reused:
                continue
            if cfg.selection_confidence is None:
                # the unsafe share that would still certify at the size of the certification split's reuses at this
                # step (their count, not their labels): a step whose share could not certify is not worth the one test
                n_cert = sum(1 for i in cert if s in pairs[i] and pairs[i][s]["hit"])
                ok = n_cert > 0 and bad / len(reused) <= allowed_unsafe(n_cert, cfg.delta, cfg.confidence)[n_cert] / n_cert
            else:
                ok = clopper_pearson_upper(bad, len(reused), cfg.selection_confidence) <= cfg.delta
            if ok:
                chosen = s   # steps ascend: the latest that passes wins
        entry: dict[str, Any] = {"kind": kind, "step": chosen, "of": of.get(kind), "selection": table,
                                 "selection_pairs": len(sel)}
        if chosen is not None:
            reused = [pairs[i][chosen] for i in cert if chosen in pairs[i] and pairs[i][chosen]["hit"]]
            bad = _unsafe(reused)
            bound = clopper_pearson_upper(bad, len(reused), cfg.confidence) if reused else None
            scope = next((r.get("scope") for r in reused if r.get("scope")), None) or (
                "frame" if kind in SAME_CONTENT_KINDS else "region")   # how the rows' reuses recomputed
            entry.update(scope=scope, pairs=len(cert), accepted=len(reused),
                         unsafe=bad, bound=bound, certified=bool(bound is not None and bound <= cfg.delta))
        out[kind] = entry
    return out
