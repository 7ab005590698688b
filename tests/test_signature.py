"""Known-answer tests for carnator.signature: colour maths, Evidence Regions, Early Signatures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from carnator.signature import (
    EarlySignature,
    EvidenceRegion,
    NounSignature,
    RegionConfig,
    Seeds,
    ciede2000,
    early_signature,
    evidence_region,
    fuse,
    hysteresis,
    mean_lab,
    noun_signature,
    select_seeds,
    self_attention_expansion,
    srgb_to_lab,
    upsample_mask,
)

# ---- colour ----------------------------------------------------------------------------------------

# Sharma, Wu & Dalal (2005), "The CIEDE2000 color-difference formula: implementation notes,
# supplementary test data, and mathematical observations", Table 1: L1 a1 b1 L2 a2 b2 dE00.
SHARMA_2005 = """
50.0000 2.6772 -79.7751 50.0000 0.0000 -82.7485 2.0425
50.0000 3.1571 -77.2803 50.0000 0.0000 -82.7485 2.8615
50.0000 2.8361 -74.0200 50.0000 0.0000 -82.7485 3.4412
50.0000 -1.3802 -84.2814 50.0000 0.0000 -82.7485 1.0000
50.0000 -1.1848 -84.8006 50.0000 0.0000 -82.7485 1.0000
50.0000 -0.9009 -85.5211 50.0000 0.0000 -82.7485 1.0000
50.0000 0.0000 0.0000 50.0000 -1.0000 2.0000 2.3669
50.0000 -1.0000 2.0000 50.0000 0.0000 0.0000 2.3669
50.0000 2.4900 -0.0010 50.0000 -2.4900 0.0009 7.1792
50.0000 2.4900 -0.0010 50.0000 -2.4900 0.0010 7.1792
50.0000 2.4900 -0.0010 50.0000 -2.4900 0.0011 7.2195
50.0000 2.4900 -0.0010 50.0000 -2.4900 0.0012 7.2195
50.0000 -0.0010 2.4900 50.0000 0.0009 -2.4900 4.8045
50.0000 -0.0010 2.4900 50.0000 0.0010 -2.4900 4.8045
50.0000 -0.0010 2.4900 50.0000 0.0011 -2.4900 4.7461
50.0000 2.5000 0.0000 50.0000 0.0000 -2.5000 4.3065
50.0000 2.5000 0.0000 73.0000 25.0000 -18.0000 27.1492
50.0000 2.5000 0.0000 61.0000 -5.0000 29.0000 22.8977
50.0000 2.5000 0.0000 56.0000 -27.0000 -3.0000 31.9030
50.0000 2.5000 0.0000 58.0000 24.0000 15.0000 19.4535
50.0000 2.5000 0.0000 50.0000 3.1736 0.5854 1.0000
50.0000 2.5000 0.0000 50.0000 3.2972 0.0000 1.0000
50.0000 2.5000 0.0000 50.0000 1.8634 0.5757 1.0000
50.0000 2.5000 0.0000 50.0000 3.2592 0.3350 1.0000
60.2574 -34.0099 36.2677 60.4626 -34.1751 39.4387 1.2644
63.0109 -31.0961 -5.8663 62.8187 -29.7946 -4.0864 1.2630
61.2901 3.7196 -5.3901 61.4292 2.2480 -4.9620 1.8731
35.0831 -44.1164 3.7933 35.0232 -40.0716 1.5901 1.8645
22.7233 20.0904 -46.6940 23.0331 14.9730 -42.5619 2.0373
36.4612 47.8580 18.3852 36.2715 50.5065 21.2231 1.4146
90.8027 -2.0831 1.4410 91.1528 -1.6435 0.0447 1.4441
90.9257 -0.5406 -0.9208 88.6381 -0.8985 -0.7239 1.5381
6.7747 -0.2908 -2.4247 5.8714 -0.0985 -2.2286 0.6377
2.0776 0.0795 -1.1350 0.9033 -0.0636 -0.5514 0.9082
"""


def _sharma() -> np.ndarray:
    rows = np.array([[float(v) for v in line.split()] for line in SHARMA_2005.strip().splitlines()])
    assert rows.shape == (34, 7)
    return rows


def test_ciede2000_sharma_pairs_each_and_symmetric():
    rows = _sharma()
    for i, r in enumerate(rows, 1):
        assert round(ciede2000(r[:3], r[3:6]), 4) == pytest.approx(r[6], abs=1e-9), f"pair {i}"
        assert round(ciede2000(r[3:6], r[:3]), 4) == pytest.approx(r[6], abs=1e-9), f"pair {i} reversed"


def test_ciede2000_vectorized_and_identity():
    rows = _sharma()
    d = ciede2000(rows[:, :3], rows[:, 3:6])
    assert d.shape == (34,)
    np.testing.assert_allclose(d, rows[:, 6], atol=5e-5)
    assert ciede2000((50.0, 10.0, -3.0), (50.0, 10.0, -3.0)) == 0.0
    assert isinstance(ciede2000((50.0, 0.0, 0.0), (60.0, 0.0, 0.0)), float)


@pytest.mark.parametrize(
    "rgb, lab",
    [
        ((1.0, 1.0, 1.0), (100.0, 0.0, 0.0)),
        ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
        ((1.0, 0.0, 0.0), (53.2408, 80.0925, 67.2032)),
        ((0.0, 1.0, 0.0), (87.7347, -86.1827, 83.1793)),
        ((0.0, 0.0, 1.0), (32.2970, 79.1875, -107.8602)),
        ((0.5, 0.5, 0.5), (53.3889, 0.0, 0.0)),
    ],
)
def test_srgb_to_lab_known_values(rgb, lab):
    got = srgb_to_lab(np.array(rgb))
    assert got.shape == (3,)
    np.testing.assert_allclose(got, lab, atol=1e-2)


def test_srgb_to_lab_shapes_and_clipping():
    img = np.random.default_rng(0).random((4, 5, 3))
    assert srgb_to_lab(img).shape == (4, 5, 3)
    np.testing.assert_allclose(srgb_to_lab(np.array([1.2, -0.1, 0.0])), srgb_to_lab(np.array([1.0, 0.0, 0.0])))
    with pytest.raises(ValueError):
        srgb_to_lab(np.zeros((4, 4)))


def test_mean_lab_averages_in_lab_not_rgb():
    img = np.zeros((2, 2, 3))
    img[0, 0] = (1, 0, 0)
    img[0, 1] = (0, 0, 1)
    mask = np.array([[True, True], [False, False]])
    expected = (srgb_to_lab(np.array([1.0, 0, 0])) + srgb_to_lab(np.array([0, 0, 1.0]))) / 2
    np.testing.assert_allclose(mean_lab(img, mask), expected)
    assert mean_lab(img, np.zeros((2, 2), bool)) is None
    np.testing.assert_allclose(mean_lab(np.ones((3, 3, 3))), (100, 0, 0), atol=1e-2)


# ---- Evidence Regions ------------------------------------------------------------------------------


def test_select_seeds_hand_case():
    cfg = RegionConfig(pos_fraction=0.2, neg_fraction=0.5, max_neg=3)
    seeds = select_seeds(np.arange(10.0), (1, 2, 5), cfg)
    np.testing.assert_array_equal(seeds.pos, [9, 8])  # top 20 % of 10, by decreasing response
    # eligible: the 5 lowest outside I+ = {0..4}; 3 of them evenly spaced in raster order
    np.testing.assert_array_equal(seeds.neg, [0, 2, 4])
    np.testing.assert_array_equal(seeds.columns, [9, 8, 0, 2, 4])


def test_select_seeds_bounds_disjoint_and_grid_input():
    rng = np.random.default_rng(1)
    c = rng.random((2, 4, 4))
    seeds = select_seeds(c, (2, 4, 4), RegionConfig(pos_fraction=1.0, max_pos=5, neg_fraction=1.0, max_neg=100))
    assert seeds.pos.size == 5 and seeds.neg.size == 32 - 5
    assert not set(seeds.pos) & set(seeds.neg)
    assert np.all(c.reshape(-1)[seeds.pos].min() >= c.reshape(-1)[seeds.neg].max())
    with pytest.raises(ValueError):
        select_seeds(np.zeros(7), (1, 2, 4))  # wrong number of tokens


def test_self_attention_expansion_hand_case():
    # heads=2, N=3; positives: 2 columns, negatives: 1 column
    ap = np.array([[[0.5, 0.1], [0.2, 0.3], [0.0, 0.0]], [[0.3, 0.4], [0.1, 0.1], [0.2, 0.0]]])
    an = np.array([[[0.1], [0.6], [0.2]], [[0.0], [0.5], [0.1]]])
    # head 0: max+ = [.5,.3,0] - [.1,.6,.2] = [.4,-.3,-.2]; head 1: [.4,.1,.2] - [0,.5,.1] = [.4,-.4,.1]
    np.testing.assert_allclose(self_attention_expansion(ap, an), [0.4, -0.35, -0.05], atol=1e-6)


def test_fuse_hand_case():
    S = np.array([1.0, 0.5, -1.0, 0.0])
    C = np.array([3.0, 1.0, 2.0, 1.0])  # min-max -> [1, 0, 0.5, 0]
    # gate = 0.5 + 0.5 * C_n = [1, .5, .75, .5]; S * gate = [1, .25, -.75, 0]; min-max over [-.75, 1]
    F = fuse(S, C, RegionConfig(eps=0.5, gamma=1.0))
    np.testing.assert_allclose(F, [1.0, 1.0 / 1.75, 0.0, 0.75 / 1.75], atol=1e-6)
    # gamma = 2 squares the normalized response: gate = [1, .5, .625, .5]
    F2 = fuse(S, C, RegionConfig(eps=0.5, gamma=2.0))
    prod = np.array([1.0, 0.25, -0.625, 0.0])
    np.testing.assert_allclose(F2, (prod + 0.625) / 1.625, atol=1e-6)
    # constant product -> no evidence anywhere
    np.testing.assert_array_equal(fuse(np.zeros(4), C), np.zeros(4))


def test_hysteresis_skimage_example_and_connectivity():
    f = np.array([1, 2, 3, 2, 1, 2, 1, 3, 2], float).reshape(1, 1, 9) / 4
    cfg = RegionConfig(low=1.5 / 4, high=2.5 / 4)
    np.testing.assert_array_equal(hysteresis(f, cfg).reshape(-1).astype(int), [0, 1, 1, 1, 0, 0, 0, 1, 1])
    # frame 1 only has a "low" token, temporally adjacent to frame 0's seed
    g = np.array([[[0.9, 0.0, 0.0]], [[0.4, 0.0, 0.0]]])
    vol = hysteresis(g, RegionConfig(low=0.3, high=0.5, connectivity="volume"))
    per = hysteresis(g, RegionConfig(low=0.3, high=0.5, connectivity="frame"))
    np.testing.assert_array_equal(vol[:, 0, 0], [True, True])
    np.testing.assert_array_equal(per[:, 0, 0], [True, False])


def _synthetic_scene(grid=(2, 6, 6)):
    """An object on rows/cols 1..3 of every frame; attention stays within object or background."""
    obj = np.zeros(grid, bool)
    obj[:, 1:4, 1:4] = True
    flat = obj.reshape(-1)
    rng = np.random.default_rng(0)
    C = np.where(flat, 0.8, 0.1) + 0.05 * rng.random(flat.size)
    same = flat[:, None] == flat[None, :]
    logits = np.where(same, 2.0, 0.0) + 0.1 * rng.random((3, flat.size, flat.size))
    A = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)  # (heads, query i, key u)
    return obj, C, A


def test_evidence_region_recovers_synthetic_object_tensor_and_callable():
    torch = pytest.importorskip("torch")
    grid = (2, 6, 6)
    obj, C, A = _synthetic_scene(grid)
    cfg = RegionConfig(pos_fraction=0.1, neg_fraction=0.5, max_neg=16)
    seeds = select_seeds(C, grid, cfg)
    assert obj.reshape(-1)[seeds.pos].all() and not obj.reshape(-1)[seeds.neg].any()
    region = evidence_region(C, A[:, :, seeds.columns], seeds, grid, cfg)
    assert isinstance(region, EvidenceRegion) and region.mask.shape == grid and region.mask.dtype == bool
    np.testing.assert_array_equal(region.mask, obj)
    assert region.fused.shape == grid and region.fused.min() == 0.0 and region.fused.max() == pytest.approx(1.0)
    np.testing.assert_array_equal(region.tail, obj[-1])

    asked = []

    def columns(idx):
        asked.append(np.array(idx))
        return torch.from_numpy(A[:, :, idx]).to(torch.bfloat16)

    region2 = evidence_region(torch.from_numpy(C), columns, seeds, grid, cfg)
    np.testing.assert_array_equal(asked[0], seeds.columns)
    np.testing.assert_array_equal(region2.mask, obj)


def test_evidence_region_rejects_wrong_column_count():
    grid = (1, 2, 2)
    seeds = Seeds(pos=np.array([0]), neg=np.array([3]))
    with pytest.raises(ValueError, match="attention columns"):
        evidence_region(np.arange(4.0), np.zeros((1, 4, 3)), seeds, grid)


def test_region_config_validation():
    with pytest.raises(ValueError):
        RegionConfig(high=1.0)
    with pytest.raises(ValueError):
        RegionConfig(low=0.6, high=0.5)
    with pytest.raises(ValueError):
        RegionConfig(connectivity="4")  # type: ignore[arg-type]


# ---- Early Signature -------------------------------------------------------------------------------


def test_upsample_mask_kron_and_nearest():
    m = np.array([[1, 0, 1], [0, 1, 0]], bool)
    np.testing.assert_array_equal(upsample_mask(m, (4, 6)), np.kron(m, np.ones((2, 2), bool)))
    up = upsample_mask(m, (5, 7))  # rows floor(y*2/5) = 0,0,0,1,1; cols floor(x*3/7) = 0,0,0,1,1,2,2
    np.testing.assert_array_equal(up, m[[0, 0, 0, 1, 1]][:, [0, 0, 0, 1, 1, 2, 2]])
    with pytest.raises(ValueError):
        upsample_mask(m, (1, 6))


def test_noun_signature_area_and_colour():
    mask = np.zeros((3, 2, 2), bool)
    mask[0] = True  # earlier frames do not matter
    mask[-1, 0, 0] = True
    img = np.ones((8, 8, 3))
    img[:4, :4] = (1.0, 0.0, 0.0)  # the top-left token's 4x4 pixels are pure red
    sig = noun_signature("  Ball ", mask, img)
    assert sig.noun == "ball"
    assert sig.area == 0.25
    np.testing.assert_array_equal(sig.mask_tail, mask[-1])
    np.testing.assert_allclose(sig.lab, (53.2408, 80.0925, 67.2032), atol=1e-3)
    empty = noun_signature("cube", np.zeros((1, 2, 2), bool), img)
    assert empty.area == 0.0 and empty.lab is None


def test_early_signature_roundtrip_compact():
    rng = np.random.default_rng(3)
    regions = {
        "Ball": rng.random((2, 30, 52)) > 0.7,
        "grass": EvidenceRegion(mask=rng.random((2, 30, 52)) > 0.4, fused=np.zeros((2, 30, 52), np.float32)),
        "cube": np.zeros((2, 30, 52), bool),
    }
    sig = early_signature(regions, rng.random((480, 832, 3)))
    assert set(sig) == {"ball", "grass", "cube"} and "BALL" in sig and sig["Ball"].noun == "ball"
    s = sig.to_json()
    assert len(s) < 3 * 400  # 1,560 mask bits are 195 bytes, 260 base64 characters per noun
    back = EarlySignature.from_json(s)
    assert back == sig
    assert EarlySignature.from_json(json.loads(s)) == sig  # the dict form stored in the bank's extra
    assert back["cube"].lab is None
    np.testing.assert_array_equal(back["ball"].mask_tail, regions["Ball"][-1])
    d = sig.to_dict()
    d["v"] = 99
    with pytest.raises(ValueError, match="version"):
        EarlySignature.from_dict(d)


def test_early_signature_rejects_duplicate_canonical_nouns():
    with pytest.raises(ValueError):
        early_signature({"Ball": np.ones((1, 1, 1), bool), "ball": np.ones((1, 1, 1), bool)}, np.ones((2, 2, 3)))
    with pytest.raises(ValueError):
        EarlySignature({"Ball": NounSignature("Ball", np.ones((1, 1), bool), 1.0, None)})


def test_expansion_on_torch_tensors_equals_numpy():
    import torch

    from carnator.signature.regions import self_attention_expansion

    g = torch.Generator().manual_seed(0)
    ap, an = torch.rand(3, 50, 4, generator=g), torch.rand(3, 50, 6, generator=g)
    got = self_attention_expansion(ap, an)          # reduced by torch, only (N,) leaves the tensor's device
    want = self_attention_expansion(ap.numpy(), an.numpy())
    assert isinstance(got, np.ndarray) and got.shape == (50,)
    np.testing.assert_allclose(got, want, atol=1e-6)


# ---- noun phrases (CarnatorConfig.modifiers) ---------------------------------------------------------------


def test_noun_phrase_spans_hand_cases():
    from carnator.signature.nouns import noun_phrase_spans

    t = "a video of a big red ball, two cats and a tiny Blue star on grass; red ball"

    def words(noun, m):
        return [t[a:b] for a, b in noun_phrase_spans(t, noun, m)]

    assert words("ball", 0) == ["ball", "ball"]
    assert words("ball", 1) == ["red ball", "red ball"]
    assert words("ball", 3) == ["big red ball", "red ball"]   # stops at the article, and at the ";"
    assert words("cats", 3) == ["cats"]                       # "two" is a stop word
    assert words("STAR", 2) == ["tiny Blue star"]             # case-insensitive
    assert words("grass", 3) == ["grass"]                     # "on"
    assert words("balloon", 3) == [] and words("bal", 3) == []   # whole words only
    assert noun_phrase_spans("a sky-blue ball", "ball", 2) == [(6, 15)]   # "blue ball": "-" is not a space
    assert noun_phrase_spans("a ball-like toy", "ball", 0) == [(2, 6)]    # a whole word, as \b sees it


def test_embedded_positions_with_modifiers_are_per_occurrence():
    """One token per known word: "a video of a big red ball moving left and a tiny red star on grass"."""
    from carnator.backbones.embedded import EmbeddedAdapter
    from carnator.embedded import load_pipeline

    ad = EmbeddedAdapter(load_pipeline("cpu"))
    p = "a video of a big red ball moving left and a tiny red star on grass, 4k"
    assert ad.word_token_positions(p, "ball") == [6]
    assert ad.word_token_positions(p, "ball", 3) == [4, 5, 6]
    assert ad.word_token_positions(p, "star", 1) == [12, 13]   # its own "red", not the ball's
    assert ad.word_token_positions(p, "grass", 3) == [15]
    # an unknown word is not a token: the positions after it shift as the transformer sees them
    assert ad.word_token_positions("a big zorblax red ball", "ball", 3) == [1, 2, 3]
