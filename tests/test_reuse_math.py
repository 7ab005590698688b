"""Known-answer tests for carnator.reuse: noun filter, discrepancies, thresholds, calibration, scope."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy.stats import beta, binom

from carnator.errors import CarnatorError
from carnator.calibrate.certify import (
    CalibrationConfig,
    CalibrationPair,
    calibrate,
    clopper_pearson_upper,
    evaluate,
    select_thresholds,
    separation,
    split_pairs,
)
from carnator.reuse import (
    CompatConfig,
    Discrepancies,
    NounDiff,
    ScopeConfig,
    Thresholds,
    blend_weight,
    compatible,
    discrepancies,
    first_compatible,
    noun_diff,
    reuse_scope,
    shape_distance,
    smoothstep,
    upsample_tokens,
)
from carnator.reuse.compat import _area_weights
from carnator.signature import EarlySignature, NounSignature, ciede2000, srgb_to_lab

# ---- noun filter -----------------------------------------------------------------------------------


def test_noun_diff_cases():
    assert noun_diff(["Ball", "grass", "ball"], ["grass", "CUBE"]) == NounDiff(("grass",), ("ball", "cube"))
    assert noun_diff(["dog", "park"], ["Park", "DOG", "dog"]) == NounDiff(("dog", "park"), None)
    assert noun_diff([], []) == NounDiff((), None)
    assert noun_diff(["apple"], ["peach"]) == NounDiff((), ("apple", "peach"))
    assert noun_diff(["peach", "mountain", "snow"], ["apple", "mountain"]) is None  # 2 vs 1 differ
    assert noun_diff(["a", "b"], ["a"]) is None  # |N(q)\N(j)| = 1 != 0 = |N(j)\N(q)|
    assert noun_diff(["a", "b", "c"], ["a", "d", "e"]) is None  # two substitutions


# ---- discrepancies ---------------------------------------------------------------------------------


def test_area_weights_hand_case():
    # 3 input cells onto 2 output cells of width 1.5
    np.testing.assert_allclose(_area_weights(3, 2), [[2 / 3, 1 / 3, 0], [0, 1 / 3, 2 / 3]])
    np.testing.assert_allclose(_area_weights(2, 4), [[1, 0], [1, 0], [0, 1], [0, 1]])


@pytest.mark.parametrize("resample", ["area", "nearest"])
def test_shape_distance_hand_cases(resample):
    cfg = CompatConfig(shape_size=16, shape_resample=resample)
    square = np.zeros((6, 6), bool)
    square[1:3, 1:3] = True
    ell = square.copy()
    ell[2, 2] = False  # 3 of the 2x2 tokens: each token becomes an 8x8 block
    # Dice = 2 * 192 / (256 + 192) = 6/7
    assert shape_distance(square, ell, cfg) == pytest.approx(1 / 7)
    big = np.zeros((8, 8), bool)
    big[3:7, 2:6] = True  # other size and place, same shape after crop + resize
    assert shape_distance(square, big, cfg) == 0.0
    hbar, vbar = np.zeros((5, 5), bool), np.zeros((5, 5), bool)
    hbar[2, 1:4] = True
    vbar[1:4, 2] = True
    assert shape_distance(hbar, vbar, cfg) == 0.0  # aspect ratio is discarded by design
    assert shape_distance(square, np.zeros((6, 6), bool), cfg) == 1.0
    assert shape_distance(np.zeros((2, 2), bool), np.zeros((3, 3), bool), cfg) == 0.0


def _lab(rgb):
    return tuple(srgb_to_lab(np.array(rgb, float)))


def _ns(noun, mask, lab):
    m = np.asarray(mask, bool)
    return NounSignature(noun, m, float(m.mean()), lab)


def test_discrepancies_hand_case():
    red, green, green2 = _lab((1, 0, 0)), _lab((0, 1, 0)), _lab((0.1, 0.9, 0.1))
    ball = np.zeros((4, 4), bool)
    ball[:2, :2] = True  # area 1/4
    cube = np.zeros((4, 4), bool)
    cube[3, 3] = True  # area 1/16
    q = EarlySignature({"ball": _ns("ball", ball, red), "grass": _ns("grass", ~ball, green)})
    j = EarlySignature({"cube": _ns("cube", cube, red), "grass": _ns("grass", ~cube, green2)})
    diff = noun_diff(["ball", "grass"], ["cube", "grass"])
    d = discrepancies(q, j, diff)
    assert d.context == pytest.approx(ciede2000(green, green2))
    assert d.size == pytest.approx(math.log(4))
    assert d.shape == 0.0  # both squares
    assert d.color == 0.0
    # same nouns: only the context dimension applies
    d2 = discrepancies(q, q, noun_diff(["ball", "grass"], ["grass", "ball"]))
    assert d2 == Discrepancies(context=0.0)
    # no shared noun -> context 0
    assert discrepancies(q, j, NounDiff((), ("ball", "cube"))).context == 0.0


def test_discrepancies_missing_noun_empty_region_and_area_floor():
    red = _lab((1, 0, 0))
    tiny = np.zeros((10, 10), bool)
    tiny[0, 0] = True  # area 0.01
    q = EarlySignature({"ball": _ns("ball", np.zeros((10, 10), bool), None), "sky": _ns("sky", tiny, red)})
    j = EarlySignature({"cube": _ns("cube", tiny, red), "sky": _ns("sky", tiny, None)})
    d = discrepancies(q, j, NounDiff(("sky",), ("ball", "cube")))
    assert d.size == pytest.approx(math.log(10))  # |log(1e-3 / 1e-2)| with the default floor
    assert d.shape == 1.0 and d.color == math.inf and d.context == math.inf
    d = discrepancies(q, j, NounDiff((), ("horse", "cube")))
    assert (d.size, d.shape, d.color) == (math.inf, math.inf, math.inf)
    assert discrepancies(q, j, NounDiff((), ("ball", "cube")), CompatConfig(area_floor=0.1)).size == 0.0


def test_compatible_rules():
    tau = Thresholds()
    assert (tau.context, tau.size, tau.shape, tau.color) == (1.62, 2.17, 1.00, 7.58)
    assert compatible(Discrepancies(1.62, 2.17, 1.0, 7.58), tau)
    assert not compatible(Discrepancies(1.63), tau)
    assert compatible(Discrepancies(0.5, None, None, None), tau)
    assert not compatible(Discrepancies(0.5, 0.1, 0.1, 7.59), tau)
    assert not compatible(Discrepancies(0.5, math.nan, 0.1, 1.0), tau)
    assert compatible(Discrepancies(0.5, 0.1, 0.1, math.inf), Thresholds(color=math.inf))
    with pytest.raises(ValueError):
        Thresholds(size=math.nan)


def test_first_compatible_in_recall_order():
    red, blue = _lab((1, 0, 0)), _lab((0, 0, 1))
    m = np.eye(4, dtype=bool)
    q = EarlySignature({"ball": _ns("ball", m, red)})
    far = EarlySignature({"cube": _ns("cube", m, blue)})
    near = EarlySignature({"cube": _ns("cube", m, red)})
    same = EarlySignature({"ball": _ns("ball", m, red)})
    cands = [(far, noun_diff(["ball"], ["cube"])), (near, noun_diff(["ball"], ["cube"])), (same, noun_diff(["ball"], ["ball"]))]
    hit = first_compatible(q, cands, Thresholds())
    assert hit.index == 1 and hit.tested[1].color == 0.0 and len(hit.tested) == 2  # tested up to the winner
    miss = first_compatible(q, cands[:1], Thresholds())
    assert miss.index is None and len(miss.tested) == 1
    # with a recall similarity the text discrepancy is measured (1 - cosine) and can decide
    tau = Thresholds(text=0.1)
    assert first_compatible(q, [(near, cands[1][1], 0.95)], tau).index == 0
    assert first_compatible(q, [(near, cands[1][1], 0.8)], tau).index is None


def test_thresholds_save_load(tmp_path):
    tau = Thresholds(context=1.5, size=math.inf, shape=0.3, color=6.0)
    p = tmp_path / "sub" / "tau.json"
    tau.save(p, model_id="wan2.1-1.3b", meta={"delta": 0.05})
    doc = json.loads(p.read_text())
    assert doc["model_id"] == "wan2.1-1.3b" and doc["format_version"] == 1
    assert doc["carnator_version"] and doc["thresholds"]["size"] is None and doc["meta"] == {"delta": 0.05}
    assert doc["thresholds"]["text"] is None  # off unless calibrated
    assert Thresholds.load(p, model_id="wan2.1-1.3b") == tau
    del doc["thresholds"]["text"]  # a file from before the text threshold: loads with it off
    p.write_text(json.dumps(doc))
    assert Thresholds.load(p, model_id="wan2.1-1.3b") == tau and tau.text == math.inf

    with pytest.raises(CarnatorError) as e:
        Thresholds.load(p, model_id="ltx-13b")
    msg = str(e.value)
    assert "wan2.1-1.3b" in msg and "ltx-13b" in msg and "\n" not in msg

    doc["format_version"] = 2
    p.write_text(json.dumps(doc))
    with pytest.raises(CarnatorError, match="format version") as e:
        Thresholds.load(p, model_id="wan2.1-1.3b")
    assert "\n" not in str(e.value)
    with pytest.raises(CarnatorError, match="does not exist"):
        Thresholds.load(tmp_path / "nope.json", model_id="x")
    # The reading: a file without one (from before it was recorded) is not checked; with one, every field must match.
    doc["format_version"] = 1
    p.write_text(json.dumps(doc))
    assert Thresholds.load(p, model_id="wan2.1-1.3b", reading={"modifiers": 1}) == tau
    doc["reading"] = {"modifiers": 1, "region": {"high": 0.3}}
    p.write_text(json.dumps(doc))
    assert Thresholds.load(p, model_id="wan2.1-1.3b", reading={"modifiers": 1, "region": {"high": 0.3}, "extra": 2}) == tau
    assert Thresholds.load(p, model_id="wan2.1-1.3b") == tau  # the caller did not say how it reads
    with pytest.raises(CarnatorError, match="modifiers: file 1, policy 0"):
        Thresholds.load(p, model_id="wan2.1-1.3b", reading={"modifiers": 0, "region": {"high": 0.3}})
    tau.save(p, model_id="m", reading={"region": {"window": (0.2, 0.8)}})  # tuples are stored and compared as JSON lists
    assert Thresholds.load(p, model_id="m", reading={"region": {"window": (0.2, 0.8)}}) == tau
    p.write_text("{not json")
    with pytest.raises(CarnatorError, match="unreadable"):
        Thresholds.load(p, model_id="x")


# ---- calibration -----------------------------------------------------------------------------------


def test_separation_is_the_hand_counted_auc():
    """bad text 0.3, 0.5 vs good 0.1, 0.3, 0.6: bad > good in 1 + 0.5 (tie) + 0 and 1 + 1 + 0 of 6 comparisons."""
    P = CalibrationPair
    pairs = [P(Discrepancies(math.inf, None, None, None, 0.3), False), P(Discrepancies(2.0, 0.4, 0.1, 3.0, 0.5), False),
             P(Discrepancies(1.0, None, None, None, 0.1), True), P(Discrepancies(3.0, 0.1, 0.2, 9.0, 0.3), True),
             P(Discrepancies(0.5, 0.2, 0.3, 1.0, 0.6), True)]
    sep = separation(pairs)
    assert sep["text"] == {"auc": pytest.approx(3.5 / 6), "unacceptable": 2, "acceptable": 3}
    # context: inf (undefined) is the largest value: bad {inf, 2} vs good {1, 3, 0.5} -> 3 + 2 of 6
    assert sep["context"]["auc"] == pytest.approx(5 / 6)
    # size applies to 1 bad (0.4) and 2 good (0.1, 0.2): perfectly separated; shape 0.1 vs 0.2, 0.3: inverted
    assert sep["size"] == {"auc": pytest.approx(1.0), "unacceptable": 1, "acceptable": 2}
    assert sep["shape"]["auc"] == pytest.approx(0.0)
    assert separation(pairs[2:])["text"]["auc"] is None   # no unacceptable pair


def test_clopper_pearson_paper_case():
    ub = clopper_pearson_upper(0, 50, 0.90)
    assert ub == pytest.approx(1 - 0.1 ** (1 / 50), abs=1e-12)
    assert round(100 * ub, 2) == 4.50


@pytest.mark.parametrize("k, n", [(0, 10), (1, 10), (3, 70), (5, 100), (2, 30), (9, 10)])
def test_clopper_pearson_matches_definition(k, n):
    conf = 0.9
    ub = clopper_pearson_upper(k, n, conf)
    assert ub == pytest.approx(beta.ppf(conf, k + 1, n - k), rel=1e-12)
    # defining property, checked with the binomial CDF (independent of the beta quantile)
    assert binom.cdf(k, n, ub) == pytest.approx(1 - conf, abs=1e-9)
    if k == 0:
        assert ub == pytest.approx(1 - (1 - conf) ** (1 / n))
    if k == n - 1:
        assert ub == pytest.approx(conf ** (1 / n))
    assert clopper_pearson_upper(n, n, conf) == 1.0
    assert clopper_pearson_upper(0, 0, conf) == 1.0


def _ctx_pairs(values, unsafe_values=()):
    return [CalibrationPair(Discrepancies(context=v), acceptable=v not in unsafe_values) for v in values]


def test_select_thresholds_one_dimension_known_optimum():
    vals = [round(0.1 * i, 1) for i in range(1, 11)]
    pairs = _ctx_pairs(vals, unsafe_values=(0.8, 1.0))
    tau, acc, uns = select_thresholds(pairs, delta=0.0)
    assert (tau.context, acc, uns) == (0.7, 7, 0)
    tau, acc, uns = select_thresholds(pairs, delta=0.15)  # 1 of 9 = 11 % is allowed, 2 of 10 is not
    assert (tau.context, acc, uns) == (0.9, 9, 1)
    # no pair had a substituted noun: the search keeps those dimensions at "reject" (below all values)
    assert tau.size < 0 and tau.shape < 0 and tau.color < 0


def test_select_thresholds_colour_separates():
    safe = [CalibrationPair(Discrepancies(0.5, 0.5, 0.2, c), True) for c in (1.0, 2.0, 3.0, 4.0)]
    bad = [CalibrationPair(Discrepancies(0.5, 0.5, 0.2, c), False) for c in (10.0, 12.0)]
    tau, acc, uns = select_thresholds(safe + bad, delta=0.0)
    assert (acc, uns) == (4, 0)
    assert (tau.context, tau.size, tau.shape, tau.color) == (0.5, 0.5, 0.2, 4.0)  # tightest that accepts all safe
    tau, acc, uns = select_thresholds(safe + bad, delta=0.5)
    assert (acc, uns, tau.color) == (6, 2, 12.0)


def test_select_thresholds_matches_brute_force():
    rng = np.random.default_rng(7)
    for trial in range(3):
        n = 8
        pairs = []
        for _ in range(n):
            sub = rng.random() < 0.7
            d = Discrepancies(
                context=float(rng.integers(0, 4)),
                size=float(rng.integers(0, 3)) if sub else None,
                shape=round(float(rng.random()), 1) if sub else None,
                color=float(rng.integers(0, 5)) if sub else None,
                text=round(float(rng.random()) / 2, 1) if rng.random() < 0.8 else None,
            )
            pairs.append(CalibrationPair(d, acceptable=bool(rng.random() < 0.6)))
        for delta in (0.0, 0.2):
            tau, acc, uns = select_thresholds(pairs, delta)
            vals = np.array([[-np.inf if v is None else v for v in (p.d.context, p.d.size, p.d.shape, p.d.color, p.d.text)] for p in pairs])
            bad = np.array([not p.acceptable for p in pairs])
            grids = [sorted({v for v in vals[:, k] if np.isfinite(v)} | {-1.0, np.inf}) for k in range(5)]
            combos = np.array(list(itertools.product(*grids)))
            ok = np.all(vals[None, :, :] <= combos[:, None, :], axis=2)
            a, u = ok.sum(1), (ok & bad).sum(1)
            feas = u <= delta * a + 1e-9
            best_a = a[feas].max()
            assert acc == best_a, (trial, delta)
            assert uns == u[feas & (a == best_a)].min()
            assert evaluate(pairs, tau) == (acc, uns)


def test_select_thresholds_text_separates_what_the_signature_cannot():
    """Identical signatures, bad reuses where the prompts are far apart (d_text >= 0.3): the text threshold is the
    largest safe d_text, the signature thresholds the tightest that pass every safe pair; with the text
    dimension off (CalibrationConfig(text=False), the paper's four) nothing separates them and tau.text is inf."""
    safe = [CalibrationPair(Discrepancies(2.0, 0.1, 0.1, 3.0, text=t), True) for t in (0.0, 0.05, 0.1, 0.2)]
    bad = [CalibrationPair(Discrepancies(2.0, 0.1, 0.1, 3.0, text=t), False) for t in (0.3, 0.45)]
    tau, acc, uns = select_thresholds(safe + bad, delta=0.0)
    assert (acc, uns) == (4, 0)
    assert (tau.context, tau.size, tau.shape, tau.color, tau.text) == (2.0, 0.1, 0.1, 3.0, 0.2)
    res = calibrate(safe + bad + safe + bad, CalibrationConfig(text=False, split_seed=None, n_selection=6))
    assert res.thresholds.text == math.inf and (res.selection_accepted, res.selection_unsafe) == (0, 0)
    assert compatible(Discrepancies(2.0, text=0.2), tau) and not compatible(Discrepancies(2.0, text=0.21), tau)
    assert compatible(Discrepancies(2.0), tau)  # not measured: passes, as every None dimension


def test_split_pairs_deterministic_disjoint():
    sel, cert = split_pairs(100)
    assert len(sel) == 30 and len(cert) == 70
    assert not set(sel) & set(cert) and set(sel) | set(cert) == set(range(100))
    sel2, cert2 = split_pairs(100)
    np.testing.assert_array_equal(sel, sel2)
    np.testing.assert_array_equal(cert, cert2)
    s, c = split_pairs(10, CalibrationConfig(split_seed=None, n_selection=3))
    assert list(s) == [0, 1, 2] and list(c) == list(range(3, 10))
    with pytest.raises(ValueError):
        split_pairs(10, CalibrationConfig(n_selection=10))


def test_calibrate_reproduces_paper_certificate():
    # selection (first 30): 25 safe pairs with context <= 1.0, 5 unsafe at 3.0
    sel = _ctx_pairs([0.04 * i for i in range(1, 26)]) + _ctx_pairs([3.0] * 5, unsafe_values=(3.0,))
    # certification (70): 50 safe within the selected threshold, 20 unsafe far beyond it
    cert = _ctx_pairs([0.02 * i for i in range(1, 51)]) + _ctx_pairs([5.0] * 20, unsafe_values=(5.0,))
    res = calibrate(sel + cert, CalibrationConfig(n_selection=30, split_seed=None))
    assert res.thresholds.context == pytest.approx(1.0)
    assert (res.selection_accepted, res.selection_unsafe) == (25, 0)
    assert res.selection_coverage == pytest.approx(25 / 30)
    assert (res.certification_size, res.certification_accepted, res.certification_unsafe) == (70, 50, 0)
    assert res.certification_bound == pytest.approx(0.045007, abs=1e-6)
    assert res.certified
    assert json.loads(json.dumps(res.to_dict()))["certified"] is True
    # one unsafe acceptance in certification breaks the certificate (bound 7.6 % > 5 %)
    cert[0] = CalibrationPair(cert[0].d, acceptable=False)
    res = calibrate(sel + cert, CalibrationConfig(n_selection=30, split_seed=None))
    assert res.certification_unsafe == 1 and not res.certified
    assert res.certification_bound == pytest.approx(clopper_pearson_upper(1, 50, 0.9))


# ---- reuse scope and blend weights -----------------------------------------------------------------


def _single(grid, t, y, x):
    m = np.zeros(grid, bool)
    m[t, y, x] = True
    return m


def test_smoothstep():
    np.testing.assert_allclose(smoothstep([-1, 0, 0.5, 1, 2]), [0, 0, 0.5, 1, 1])
    assert smoothstep(1 / 3) == pytest.approx(7 / 27)


def test_scope_single_token_9x9():
    ev = _single((1, 9, 9), 0, 4, 4)
    sc = reuse_scope(ev)
    expected_active = np.zeros((1, 9, 9), bool)
    expected_active[0, 2:7, 2:7] = True  # the 5x5 square
    np.testing.assert_array_equal(sc.evidence, ev)
    np.testing.assert_array_equal(sc.active, expected_active)
    assert sc.context.all()  # 11x11 clipped to the 9x9 grid
    w = sc.weight[0]
    assert w[4, 4] == 1.0
    ring1 = np.zeros((9, 9), bool)
    ring1[3:6, 3:6] = True
    ring1[4, 4] = False
    np.testing.assert_allclose(w[ring1], 0.5)  # d = 1: 1 - smoothstep(1/2)
    np.testing.assert_allclose(w[expected_active[0] & ~ring1 & ~ev[0]], 0.0)  # d = 2: 1 - smoothstep(1)
    assert w[~expected_active[0]].max() == 0.0
    assert sc.active_fraction == pytest.approx(25 / 81)


def test_scope_context_extent_and_border_clipping():
    sc = reuse_scope(_single((1, 15, 15), 0, 7, 7))
    ys, xs = np.nonzero(sc.context[0])
    assert (ys.min(), ys.max(), xs.min(), xs.max()) == (2, 12, 2, 12) and sc.context.sum() == 121
    sc = reuse_scope(_single((1, 9, 9), 0, 0, 0))
    np.testing.assert_array_equal(np.argwhere(sc.active[0]).max(0), [2, 2])
    assert sc.active.sum() == 9 and sc.context.sum() == 36  # [0:3, 0:3] and [0:6, 0:6]


def test_scope_band_width_three_and_per_frame():
    ev = _single((2, 9, 9), 0, 4, 4)
    sc = reuse_scope(ev, ScopeConfig(band_width=3))
    assert sc.weight[0, 4, 5] == pytest.approx(20 / 27)
    assert sc.weight[0, 4, 6] == pytest.approx(7 / 27)
    assert sc.weight[0, 4, 7] == 0.0
    assert not sc.active[1].any() and not sc.context[1].any() and sc.weight[1].max() == 0.0  # no temporal spread


def test_scope_union_over_nouns():
    grid = (1, 12, 12)
    a = _single(grid, 0, 2, 2)
    b = np.zeros(grid, bool)
    b[0, 7:9, 7:10] = True
    sc = reuse_scope({"ball": a, "cube": b})
    union = reuse_scope(a | b)
    for f in ("evidence", "active", "context", "weight"):
        np.testing.assert_array_equal(getattr(sc, f), getattr(union, f))
    np.testing.assert_array_equal(sc.weight, np.maximum(blend_weight(a), blend_weight(b)))
    assert np.all(sc.evidence <= sc.active) and np.all(sc.active <= sc.context)
    assert np.all((sc.weight > 0) <= sc.active) and np.all(sc.weight[sc.evidence] == 1.0)


def test_upsample_tokens():
    w = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    up = upsample_tokens(w, (1, 2, 2))
    assert up.shape == (2, 4, 4)
    np.testing.assert_array_equal(up[1], np.kron(w[1], np.ones((2, 2))))


def test_quality_rule_hand_computed():
    """fidelity >= dense - 0.1 (higher is better) and artifact <= dense + 0.02 (lower is better), on floats and
    elementwise; a score the judge cannot read (NaN on both sides) passes; a negative delta is refused."""
    from carnator.judges import QualityRule

    r = QualityRule({"fidelity": 0.1, "artifact": 0.02}, {"fidelity": 1, "artifact": -1})
    dense = {"fidelity": 0.6, "artifact": 0.09}
    assert r.acceptable({"fidelity": 0.55, "artifact": 0.10}, dense)       # within both limits
    assert not r.acceptable({"fidelity": 0.4, "artifact": 0.09}, dense)    # lost an attribute (0.2)
    assert not r.acceptable({"fidelity": 0.6, "artifact": 0.12}, dense)    # artifact 0.03 above dense
    got = r.acceptable({"fidelity": np.array([0.55, 0.4, 0.6]), "artifact": np.array([0.10, 0.09, 0.12])},
                       {"fidelity": np.full(3, 0.6), "artifact": np.full(3, 0.09)})
    assert got.tolist() == [True, False, False]
    assert r.acceptable({"fidelity": float("nan"), "artifact": 0.0}, {"fidelity": float("nan"), "artifact": 0.0})
    assert r.label({"dense": dense, "reuse": {"fidelity": 0.5, "artifact": 0.09}}) is True
    assert QualityRule.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError):
        QualityRule({"clip_t": -0.02})


class FakeJudge:
    """A judge that reads a clip's first pixel (so a test can plant scores); directions as the shapes judge's."""

    name, identity = "fake", "fake-judge-1"
    directions = {"fidelity": 1, "artifact": -1}
    default_deltas = {"fidelity": 0.1, "artifact": 0.02}

    def score(self, frames, prompt, reference=None):
        return {"fidelity": 1.0, "artifact": 0.0}


def _rule(df=0.1, da=0.02):
    from carnator.judges import QualityRule

    return QualityRule({"fidelity": df, "artifact": da}, FakeJudge.directions)


def _fake_engine(**kw):
    from types import SimpleNamespace

    from carnator.policies.carnator import CarnatorConfig

    return SimpleNamespace(model_identity="embedded-test", use_policy=lambda p: None,
                           policy=lambda name: SimpleNamespace(cfg=CarnatorConfig(**kw)))


def test_resumed_calibration_relabels_stored_pairs_under_its_own_rule(tmp_path):
    """A finished pairs.jsonl re-run with other deltas: labels come from the stored scores and this
    run's rule (hand-computed), not from the stored labels; no pair is generated again."""
    from carnator.calibrate.run import run_calibration

    scores = [((1.0, 0.05), (0.8, 0.06)),   # lost 0.2: fails 0.1, passes 0.25
              ((0.9, 0.05), (0.9, 0.05)),   # equal: passes both
              ((1.0, 0.02), (0.6, 0.02)),   # lost 0.4: fails both
              ((0.8, 0.05), (0.8, 0.09))]   # artifact +0.04: fails 0.02, passes 0.05
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i, ((df, da), (rf, ra)) in enumerate(scores):
            f.write(json.dumps({"i": i, "kind": "noun", "hit": True, "acceptable": True,
                                "d": {"context": 1.0 + i, "size": 0.1 * i, "shape": 0.05 * i, "color": 2.0 * i, "text": 0.01 * i},
                                "dense": {"fidelity": df, "artifact": da}, "reuse": {"fidelity": rf, "artifact": ra}}) + "\n")
    engine = _fake_engine()
    got = run_calibration(engine, tmp_path, None, judge=FakeJudge(), rule=_rule(), progress=lambda *_: None)
    assert got["acceptable"] == 1
    got = run_calibration(engine, tmp_path, None, judge=FakeJudge(), rule=_rule(0.25, 0.05), progress=lambda *_: None)
    assert got["acceptable"] == 3
    want = {"deltas": {"fidelity": 0.25, "artifact": 0.05}, "directions": {"fidelity": 1, "artifact": -1}}
    assert json.loads((tmp_path / "calibration.json").read_text())["rule"] == want
    meta = json.loads((tmp_path / "thresholds.json").read_text())["meta"]
    assert meta["rule"] == want and meta["judge"] == "fake-judge-1"


def test_select_only_calibration_uses_every_stored_pair_and_generates_none(tmp_path):
    """calibrate --select-only: the stored pairs (holes and all, as a cut --jobs run leaves them) are selected and
    certified whatever --pairs says; the engine has no generate, embedder or bank, so touching one would raise.
    With no pairs stored it is a one-line error."""
    from carnator.calibrate.run import run_calibration
    from carnator.errors import CarnatorError
    from carnator.policies.carnator import CarnatorPolicy

    engine, judge = _fake_engine(), FakeJudge()
    with pytest.raises(CarnatorError, match="holds no pairs to select from"):
        run_calibration(engine, tmp_path, None, judge=judge, rule=_rule(), progress=lambda *_: None)
    # indices 0, 2, 5, 9: 3 acceptable (fidelity kept), 1 not (lost 0.4)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i, rf in zip((0, 2, 5, 9), (1.0, 1.0, 0.6, 1.0)):
            f.write(json.dumps({"i": i, "kind": "reroll", "source": "a red ball", "target": "a red ball", "hit": True,
                                "d": {"context": 1.0 + i, "size": None, "shape": None, "color": None, "text": 0.0},
                                "dense": {"fidelity": 1.0, "artifact": 0.0}, "reuse": {"fidelity": rf, "artifact": 0.0}}) + "\n")
    (tmp_path / "pairs.meta.json").write_text(json.dumps({"pairs_from": "edits", "judge": judge.identity,
                                                          "reading": json.loads(json.dumps(CarnatorPolicy().reading()))}))
    got = run_calibration(engine, tmp_path, None, judge=judge, rule=_rule(), progress=lambda *_: None)
    assert (got["pairs"], got["reusable_pairs"], got["acceptable"]) == (4, 4, 3)
    res = got["result"]
    assert res["selection"]["size"] + res["certification"]["size"] == 4
    assert json.loads((tmp_path / "thresholds.json").read_text())["meta"]["certification"] == res["certification"]
    # how the pairs were drawn comes from the folder ...
    again = run_calibration(engine, tmp_path, None, judge=judge, rule=_rule(), source={"pairs_from": "stream"}, progress=lambda *_: None)
    assert again["pairs_from"] == "edits" and again["result"] == res
    # ... but pairs read under another reading, or judged by another judge, are refused
    with pytest.raises(CarnatorError, match="signatures were read as"):
        run_calibration(_fake_engine(modifiers=0), tmp_path, None, judge=judge, rule=_rule(), progress=lambda *_: None)
    other = FakeJudge()
    other.identity = "fake-judge-2"
    with pytest.raises(CarnatorError, match="judged by"):
        run_calibration(engine, tmp_path, None, judge=other, rule=_rule(), progress=lambda *_: None)


def test_sharded_calibration_generates_each_pair_once(tmp_path, monkeypatch):
    """calibrate --jobs: shard (k, n) generates exactly pairs k, k + n, ... and selects nothing; the final
    unsharded run finds every pair stored, generates none, and selects over all of them."""
    from types import SimpleNamespace

    from carnator.calibrate.run import run_calibration

    pairs = [("noun", f"a red ball {k}", k, f"a red box {k}", 100 + k) for k in range(5)]
    calls = []

    def generate(prompt, *, seed, policy, tenant, num_inference_steps=None, store=True):
        calls.append((int(tenant[5:]), policy))
        notes = {"discrepancies": {"context": 1.0, "size": 0.1, "shape": 0.1, "color": 1.0, "text": 0.05}} if policy == "carnator-forced" else {}
        return SimpleNamespace(frames=np.zeros((1, 1, 1, 3), np.uint8), stats=SimpleNamespace(
            hit=policy == "carnator-forced", notes=notes, timings={}, resume_step=20, active_fraction=0.5, mask_density=1.0,
            source_id=None, reason=""))

    from carnator.signature.content import heuristic_content

    engine = _fake_engine()
    engine.generate, engine.store = generate, SimpleNamespace(clear=lambda tenant: None)
    engine.content = heuristic_content   # what a prompt asks (the rows name each pair's kind of change)
    engine.flush = lambda result=None: None   # (its stores are synchronous: nothing is written behind)
    engine.resolve = lambda prompt, *, seed, num_inference_steps=None: SimpleNamespace(num_inference_steps=50)
    kw = {"judge": FakeJudge(), "rule": _rule(), "source": {"pairs_from": "test"}, "progress": lambda *_: None}
    assert run_calibration(engine, tmp_path, pairs, shard=(1, 2), **kw) is None
    assert sorted({i for i, _ in calls}) == [1, 3] and not (tmp_path / "thresholds.json").exists()
    assert run_calibration(engine, tmp_path, pairs, shard=(0, 2), **kw) is None
    assert sorted({i for i, _ in calls}) == [0, 1, 2, 3, 4] and len(calls) == 3 * len(pairs)
    got = run_calibration(engine, tmp_path, pairs, **kw)
    assert len(calls) == 3 * len(pairs)                      # nothing generated again
    assert got["pairs"] == got["reusable_pairs"] == got["acceptable"] == len(pairs)
    assert sorted(json.loads(x)["i"] for x in (tmp_path / "pairs.jsonl").read_text().splitlines()) == list(range(len(pairs)))
    # every reuse resumed at step 20 of 50: the file certifies that step
    meta = json.loads((tmp_path / "thresholds.json").read_text())["meta"]
    assert meta["resume"] == {"step": 20, "of": 50, "certified_steps": [20]}


def test_calibration_without_reusable_pairs_is_a_clear_error(tmp_path):
    """Pairs stored but none reused (e.g. fewer steps than the resume step): one-line error, no traceback of the split."""
    from carnator.calibrate.run import run_calibration
    from carnator.errors import CarnatorError

    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"i": i, "kind": "noun", "hit": False, "d": None, "dense": {"fidelity": 1.0, "artifact": 0.0},
                                "reuse": {"fidelity": 1.0, "artifact": 0.0}}) + "\n")
    with pytest.raises(CarnatorError, match="only 0 of 4 pairs could reuse"):
        run_calibration(_fake_engine(), tmp_path, None, judge=FakeJudge(), rule=_rule(), progress=lambda *_: None)


def test_stream_pairs_take_the_first_recalled_candidate_that_passes_the_noun_filter():
    """Hand-made recall (one-hot warm embeddings, so each request's recall order is its vector's order): the pair's
    source is the nearest warm request whose nouns pass the filter (nearer ones with two nouns changed are skipped),
    only within the top K, never the request itself (an exact hit ends the search without a pair), and the kind
    says when recall handed over another warm request than the one the edit came from."""
    from carnator.bench.traces import TraceRequest
    from carnator.calibrate.run import recall_pairs

    warm = [TraceRequest("a red ball on grass", 1, "warm"),       # 0: ball, grass
            TraceRequest("a blue box on snow", 2, "warm"),        # 1: box, snow
            TraceRequest("a green ball on snow", 3, "warm"),      # 2: ball, snow
            TraceRequest("a red star at night", 4, "warm")]       # 3: star, night
    vec = {w.prompt: np.eye(4)[i] for i, w in enumerate(warm)}
    stream = [TraceRequest("a red box on grass", 10, "noun", 0),            # order 3 (2 nouns off), 0 -> warm 0
              TraceRequest("a red ball on grass", 1, "reroll", 0),          # exact hit of warm 0: no pair
              TraceRequest("a yellow ball on snow", 11, "color", 2),        # order 1 -> warm 1, not its source 2
              TraceRequest("a red ring under the stars", 12, "unrelated"),  # every warm request 2 nouns off
              TraceRequest("a blue box at night", 13, "context", 1)]        # order 0, 2 (off), 1 -> 3rd recalled
    vec.update({"a red box on grass": [0.5, 0.1, 0.0, 0.9], "a yellow ball on snow": [0.1, 0.9, 0.5, 0],
                "a red ring under the stars": [0.9, 0.1, 0.8, 0.3], "a blue box at night": [0.9, 0.5, 0.8, 0.4]})

    def embed(texts):
        return np.array([vec[t] for t in texts], float)

    two = [("noun", "a red ball on grass", 1, "a red box on grass", 10),
           ("color/other", "a blue box on snow", 2, "a yellow ball on snow", 11)]
    from carnator.signature.nouns import extract_nouns

    assert recall_pairs(warm, stream, embed, extract_nouns, top_k=2) == two
    assert recall_pairs(warm, stream, embed, extract_nouns, top_k=3) == two + [("context", "a blue box on snow", 2, "a blue box at night", 13)]
    assert recall_pairs(warm, stream, embed, extract_nouns, top_k=4, n=1) == two[:1]


def test_calibration_refuses_to_mix_pair_sources(tmp_path):
    """A folder started with edit pairs is not continued with stream pairs (their indices would mean other pairs)."""
    from carnator.calibrate.run import run_calibration
    from carnator.errors import CarnatorError

    (tmp_path / "pairs.meta.json").write_text(json.dumps({"pairs_from": "edits"}))
    with pytest.raises(CarnatorError, match="holds pairs drawn as"):
        run_calibration(_fake_engine(), tmp_path, [("noun", "a", 1, "b", 2)] * 4, judge=FakeJudge(), rule=_rule(),
                        source={"pairs_from": "stream"}, progress=lambda *_: None)


def test_backfill_text_is_one_minus_the_recall_cosine():
    """Rows stored before d_text existed get 1 - cosine of their prompts' embeddings (hand-made embedder:
    cos 1, 0.6 and 0); rows that have it, or were not reused, are left alone."""
    from carnator.calibrate.run import backfill_text

    vecs = {"a": [1.0, 0.0], "a'": [2.0, 0.0], "b": [0.6, 0.8], "c": [0.0, 3.0]}
    emb = lambda texts: np.array([vecs[t] for t in texts])  # noqa: E731
    rows = [{"source": "a", "target": "a'", "d": {"context": 1.0}}, {"source": "a", "target": "b", "d": {"context": 1.0}},
            {"source": "a", "target": "c", "d": {"context": 1.0}}, {"source": "a", "target": "c", "d": {"context": 1.0, "text": 0.5}},
            {"source": "a", "target": "c", "d": None}]
    backfill_text(rows, emb)
    assert [r["d"] and r["d"].get("text") for r in rows] == [pytest.approx(0.0), pytest.approx(0.4), pytest.approx(1.0), 0.5, None]


def test_allowed_unsafe_point_and_bound():
    """Selection feasibility as a table over the accepted count: the paper's point rule floor(delta k), and the
    Clopper-Pearson rule (0 unsafe needs 1 - 0.1**(1/k) <= 0.05, i.e. k >= 45 at 90 %; checked against scipy)."""
    from carnator.calibrate.certify import allowed_unsafe

    assert allowed_unsafe(45, 0.05).tolist() == [k // 20 for k in range(46)]
    a = allowed_unsafe(120, 0.05, 0.9)
    assert a[0] == 0 and (a[1:45] == -1).all() and a[45] == 0
    for k in range(1, 121):
        u = int(a[k])
        assert u < 0 or beta.ppf(0.9, u + 1, k - u) <= 0.05
        assert u + 1 > k or beta.ppf(0.9, u + 2, k - u - 1) > 0.05  # one more unsafe pair breaks it


def test_bound_selection_skips_the_loose_point_a_small_split_favours():
    """Point rule: 1 unsafe in 20 accepted (5 %) is feasible, so it takes the looser text threshold; the 90 % bound
    rule needs 45 clean pairs and takes the 50 safe ones at d_text <= 0.1."""
    good = [CalibrationPair(Discrepancies(1.0, text=0.1), True) for _ in range(50)]
    loose = [CalibrationPair(Discrepancies(1.0, text=0.3), True) for _ in range(19)] + [CalibrationPair(Discrepancies(1.0, text=0.3), False)]
    tau, acc, uns = select_thresholds(good + loose, 0.05)
    assert (tau.text, acc, uns) == (0.3, 70, 1)
    tau, acc, uns = select_thresholds(good + loose, 0.05, confidence=0.9)
    assert (tau.text, acc, uns) == (0.1, 50, 0)


# ---- the linear risk rule (CalibrationConfig.rule = "linear") ------------------------------------------------------


def test_risk_features_hand_computed():
    from carnator.reuse import RiskScore, risk_features

    x = risk_features(Discrepancies(context=1.0, size=None, shape=None, color=None, text=0.5))
    np.testing.assert_allclose(x, [math.log(2), math.log(51), math.log(51), math.log(51), math.log(1.5), 1.0])
    x = risk_features(Discrepancies(context=math.inf, size=0.0, shape=1.0, color=3.0, text=None))
    np.testing.assert_allclose(x, [math.log(1001), 0.0, math.log(2), math.log(4), math.log(2), 0.0])
    # risk = sigmoid(w . x + b): weight 1 on context alone, bias -log(2): context 1 -> sigmoid(0) = 0.5
    r = RiskScore(weights=(1, 0, 0, 0, 0, 0), bias=-math.log(2), threshold=0.5)
    assert r.risk(Discrepancies(context=1.0)) == pytest.approx(0.5)
    assert r.accepts(Discrepancies(context=1.0)) and not r.accepts(Discrepancies(context=1.01))
    assert r.risk(Discrepancies(context=3.0)) == pytest.approx(1 / (1 + 0.5))   # exp(log 4 - log 2) = 2 -> 2/3
    assert not r.accepts(Discrepancies(context=math.nan))
    with pytest.raises(ValueError):
        RiskScore(weights=(1, 0), bias=0.0, threshold=0.5)


def test_fit_logistic_is_the_penalized_optimum():
    """The gradient of the penalized log-loss vanishes at the fit (hand-derived), and scikit-learn's solver, where
    installed, finds the same weights."""
    from scipy.special import expit

    from carnator.calibrate.certify import fit_logistic

    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = rng.random(200) < expit(X @ np.array([1.5, -2.0, 0.0]) + 0.3)
    w, b = fit_logistic(X, y, l2=1.0)
    p = expit(X @ w + b)
    np.testing.assert_allclose(w + X.T @ (p - y), 0, atol=1e-6)    # d/dw: l2 w + sum (p - y) x
    assert abs((p - y).sum()) < 1e-6                                  # d/db: sum (p - y)
    assert w[0] > 1 and w[1] < -1
    sk = pytest.importorskip("sklearn.linear_model")
    m = sk.LogisticRegression(C=1.0, tol=1e-12, max_iter=10_000).fit(X, y)
    np.testing.assert_allclose(w, m.coef_[0], atol=1e-4)
    assert b == pytest.approx(m.intercept_[0], abs=1e-4)


def test_linear_rule_selects_the_loosest_feasible_score_and_certifies():
    """Context alone decides safety: context <= 2 safe, above unsafe. The fitted score is increasing in context, so
    the loosest feasible threshold at delta 0 accepts exactly the safe pairs; certification counts them and the bound
    is the Clopper-Pearson one (scipy), with the per-dimension thresholds off."""
    from carnator.calibrate.certify import select_risk

    ctx = np.linspace(0, 5, 60)
    pairs = [CalibrationPair(Discrepancies(context=float(c), text=0.1), acceptable=bool(c <= 2.0)) for c in ctx]
    tau, acc, uns = select_risk(pairs, delta=0.0)
    assert (acc, uns) == (int((ctx <= 2.0).sum()), 0)
    assert all(math.isinf(getattr(tau, k)) for k in ("context", "size", "shape", "color", "text"))
    assert tau.risk.weights[0] > 0
    assert compatible(Discrepancies(context=1.0, text=0.1), tau) and not compatible(Discrepancies(context=3.0, text=0.1), tau)
    # delta 10 %: one unsafe pair in every ten accepted is allowed, so it goes further
    _, acc10, uns10 = select_risk(pairs, delta=0.1)
    assert acc10 > acc and uns10 <= 0.1 * acc10
    res = calibrate(pairs, CalibrationConfig(rule="linear", delta=0.05, n_selection=30, split_seed=1))
    a, u = evaluate([pairs[i] for i in res.certification_indices], res.thresholds)
    assert (res.certification_accepted, res.certification_unsafe) == (a, u)
    assert res.certification_bound == pytest.approx(beta.ppf(0.9, u + 1, a - u))
    with pytest.raises(ValueError, match="rule"):
        CalibrationConfig(rule="tree")


def test_thresholds_with_a_risk_score_round_trip(tmp_path):
    from carnator.reuse import RiskScore

    tau = Thresholds(context=math.inf, size=math.inf, shape=math.inf, color=math.inf,
                     risk=RiskScore(weights=(0.1, 1.0, -0.8, 0.2, 5.9, -1.8), bias=-2.3, threshold=0.21))
    p = tmp_path / "tau.json"
    tau.save(p, model_id="m")
    assert Thresholds.load(p, model_id="m") == tau
    doc = json.loads(p.read_text())
    assert doc["thresholds"]["risk"]["features"] == ["context", "size", "shape", "color", "text", "no_substitution"]
    doc["thresholds"]["risk"]["features"] = ["context"]
    p.write_text(json.dumps(doc))
    with pytest.raises(CarnatorError, match="invalid thresholds"):
        Thresholds.load(p, model_id="m")
