"""Risk tiers: one certified resume step and scope per kind of change (hand-computed certificates; edits reused on the
embedded model and checked on the frames for the asked colour and shape)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carnator import Carnator, EngineConfig
from carnator.judges import register_judge
from carnator.calibrate.certify import CalibrationConfig, certify_tiers, split_pairs
from carnator.reuse import Thresholds
from carnator.reuse.tiers import Tier
from carnator.testing import hashed_embedder

# The embedded world's palette (RGB) for the colours these tests ask for; every pixel is read as its nearest one.
PALETTE = {"red": (220, 30, 35), "blue": (35, 70, 225), "green": (30, 165, 55)}
N, STEP = 20, 5   # 20 steps; the edit tiers resume at step 5 (of 20): after the 4-step probe


class _Pass:
    name, identity, directions = "tiers-pass", "tiers-pass", {"fidelity": 1, "artifact": -1}

    def score(self, frames, prompt, reference=None):
        return {"fidelity": 1.0, "artifact": 0.0}


register_judge("tiers-pass", lambda arg: _Pass())


def _rows(kind, steps_unsafe: dict[int, list[bool]]):
    """Calibration rows of one kind: for each step, one row per pair, unsafe where the list says so."""
    return [{"i": i, "change": kind, "resume_step": s, "num_steps": 50, "hit": True, "acceptable": not bad}
            for s, flags in steps_unsafe.items() for i, bad in enumerate(flags)]


def test_certify_tiers_selects_the_latest_safe_step_and_certifies_it_once():
    # 100 pairs: 30 select, 70 certify (split seed 0). Step 30 is unsafe on every pair, step 15 on none, step 5 on none:
    # selection picks 15 (the latest step whose unsafe share is within 5 %), and certifies it on the other 70.
    rows = _rows("colour", {5: [False] * 100, 15: [False] * 100, 30: [True] * 100})
    t = certify_tiers(rows, CalibrationConfig())["colour"]
    assert t["step"] == 15 and t["of"] == 50 and t["scope"] == "region"
    assert t["selection"]["30"] == {"reused": 30, "unsafe": 30} and t["selection"]["15"] == {"reused": 30, "unsafe": 0}
    assert t["pairs"] == 70 and t["accepted"] == 70 and t["unsafe"] == 0
    assert t["bound"] == pytest.approx(1 - 0.1 ** (1 / 70))   # Clopper-Pearson upper bound, 0 of 70, 90 %
    assert t["certified"] is True


def test_a_kind_too_few_or_too_unsafe_to_certify_gets_no_certified_tier():
    few = certify_tiers(_rows("object", {5: [False] * 20}))["object"]
    # 6 of 20 select, 14 would certify: even 0 unsafe of 14 bounds at 1 - 0.1 ** (1 / 14) = 15.2 % > 5 %, so no step
    # is worth the one test
    assert few["step"] is None and few["selection"]["5"] == {"reused": 6, "unsafe": 0}
    # 100 pairs, 1 unsafe in selection at step 5: 70 certify, where 1 unsafe already bounds above 5 % (0 must be)
    first = int(split_pairs(100)[0][0])   # the first pair of the selection split
    one = certify_tiers(_rows("size", {5: [i == first for i in range(100)], 15: [False] * 50 + [True] * 50}))["size"]
    assert one["selection"]["5"]["unsafe"] == 1 and one["step"] is None
    bad = certify_tiers(_rows("motion", {5: [i % 2 == 0 for i in range(100)]}))["motion"]
    assert bad["step"] is None and "certified" not in bad   # no step passes selection: nothing to certify
    same = certify_tiers(_rows("re-roll", {45: [False] * 100}))["re-roll"]
    assert same["scope"] == "frame" and same["certified"] is True


def test_an_edits_rule_reads_the_attribute_it_asks_and_the_noise_floor_is_dense_against_another_sample():
    from carnator.calibrate.run import noise_floor
    from carnator.cli import _tier_rules, build_parser
    from carnator.errors import CarnatorError
    from carnator.judges import QualityRule, get_judge

    judge = get_judge("shapes")
    base = QualityRule.for_judge(judge, fidelity=0.25, artifact=0.1)
    args = build_parser().parse_args(["calibrate", "--tier-quality", "colour:color=0.05", "--tier-quality", "object:shape=0.05"])
    rules = _tier_rules(args, judge, base)
    assert set(rules) == {"colour", "object"} and rules["colour"].deltas == {"fidelity": 0.25, "artifact": 0.1, "color": 0.05}
    # a colour edit that kept the cached colour of one of two objects: fidelity loses 1 of 8 checks (within 0.25),
    # color loses 1 of 2 - the base rule passes it, the colour rule does not
    dense = {"fidelity": 1.0, "artifact": 0.01, "color": 1.0, "shape": 1.0}
    kept = {"fidelity": 7 / 8, "artifact": 0.01, "color": 0.5, "shape": 1.0}
    assert base.acceptable(kept, dense) and not rules["colour"].acceptable(kept, dense) and rules["object"].acceptable(kept, dense)
    with pytest.raises(CarnatorError, match="KIND:SCORE=DELTA"):
        _tier_rules(build_parser().parse_args(["calibrate", "--tier-quality", "hue:color=0.05"]), judge, base)
    # the noise floor: per kind, one verdict per pair (rows of several steps share it), by that kind's rule
    rows = [{"i": i, "change": "colour", "resume_step": s, "dense": dense, "dense_other": kept if i < 2 else dense}
            for i in range(5) for s in (2, 5)]
    rows += [{"i": 9, "change": "object", "resume_step": 2, "dense": dense, "dense_other": kept}]
    assert noise_floor(rows, base, rules) == {"colour": {"pairs": 5, "fails": 2, "share": 0.4},
                                              "object": {"pairs": 1, "fails": 0, "share": 0.0}}
    assert noise_floor(rows, base)["colour"]["fails"] == 0


def test_the_excess_risk_counts_a_failure_only_where_another_dense_sample_passes():
    from carnator.calibrate.run import label
    from carnator.errors import CarnatorError
    from carnator.judges import QualityRule, get_judge

    rule = QualityRule.for_judge(get_judge("shapes"), fidelity=0.25, artifact=0.1, shape=0.05)
    good = {"fidelity": 1.0, "artifact": 0.01, "shape": 1.0}
    lost = {"fidelity": 0.8, "artifact": 0.01, "shape": 0.0}   # the asked shape missing: shape loses 1, beyond 0.05

    def row(reuse, other):
        return {"i": 0, "dense": good, "reuse": reuse, **({"dense_other": other} if other is not None else {})}

    # (reuse, another dense sample) -> (pair label, excess label)
    assert (label(row(good, lost), rule), label(row(good, lost), rule, "excess")) == (True, True)
    assert (label(row(lost, good), rule), label(row(lost, good), rule, "excess")) == (False, False)
    # the reuse fails as a fresh sample of the same request does: unsafe for the pair, not in excess of sampling
    assert (label(row(lost, lost), rule), label(row(lost, lost), rule, "excess")) == (False, True)
    # an excess label needs the other sample; a passing reuse does not
    assert label(row(good, None), rule, "excess") is True
    with pytest.raises(CarnatorError, match="--noise-floor"):
        label(row(lost, None), rule, "excess")
    with pytest.raises(CarnatorError, match="risk must be one of pair, excess"):
        label(row(good, good), rule, "relative")


def test_calibrate_refuses_the_excess_risk_without_tiers_or_another_sample(tmp_path, capsys):
    from carnator.cli import main

    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join('{"kind": "object", "source": "a red ball on grass", "source_seed": 1, '
                             f'"target": "a red box on grass", "target_seed": {k}}}\n' for k in range(4)))
    base = ["calibrate", "--pairs-file", str(pairs), "--pairs", "4", "--risk", "excess", "--out", str(tmp_path / "o")]
    assert main(base + ["--resume-step", "5"]) == 2
    assert "carnator: error: --risk excess certifies risk tiers" in capsys.readouterr().err
    assert main(base + ["--resume-step", "5,12"]) == 2
    assert "add --noise-floor" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()   # refused before anything ran


def test_tiers_round_trip_through_a_thresholds_file_and_scale_to_the_schedule(tmp_path):
    tiers = (Tier("re-roll", 45, 50, scope="frame", pairs=120, accepted=120, bound=0.019, certified=True),
             Tier("colour", 5, 50, pairs=56, accepted=56, bound=0.04, certified=True))
    path = tmp_path / "t.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf, tiers=tiers).save(path, model_id="m")
    back = Thresholds.load(path, model_id="m")
    assert back.tiers == tiers
    assert [tiers[0].resume_at(n) for n in (50, 32, 10)] == [45, 29, 9] and tiers[1].resume_at(20) == 2
    with pytest.raises(ValueError, match="scope"):
        Tier("colour", 5, 50, scope="everything")
    with pytest.raises(ValueError, match="step"):
        Tier("colour", 50, 50)


def _engine(tmp_path, kinds=("colour", "object"), frame=("re-roll",)):
    eng0 = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c0", device="cpu", embedder=hashed_embedder(64))
    tiers = tuple(Tier(k, STEP, N, scope="region", pairs=70, accepted=70, bound=0.032, certified=True) for k in kinds)
    tiers += tuple(Tier(k, 15, N, scope="frame", pairs=120, accepted=120, bound=0.019, certified=True) for k in frame)
    path = tmp_path / "tiers.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf, tiers=tiers).save(
        path, model_id=eng0.model_identity, reading=eng0.policy("carnator").reading(), meta={"certified": True})
    cfg = EngineConfig(admission_judge="tiers-pass", policy_options={"carnator": {"thresholds": str(path)}})
    return Carnator(eng0.pipe, tmp_path / "cache", config=cfg, embedder=hashed_embedder(64), adapter=eng0.adapter)


def _nearest(frames: np.ndarray) -> np.ndarray:
    names = list(PALETTE)
    pal = np.array([PALETTE[n] for n in names], float)
    idx = ((frames.reshape(-1, 1, 3).astype(float) - pal[None]) ** 2).sum(-1).argmin(1)
    return np.array(names)[idx].reshape(frames.shape[:-1])


def _corner_fill(frames: np.ndarray, colour: str) -> float:
    """How much of the four corners of the object's bounding box its colour fills, averaged over frames: about 0.2-0.35
    for a ball, 0.6 and more for a box (hand-measured on this model's clips)."""
    names = _nearest(frames)
    out = []
    for m in names == colour:
        ys, xs = np.nonzero(m)
        if len(ys) < 20:
            continue
        b = m[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        c = max(1, round(0.25 * min(b.shape)))
        out.append(np.mean([b[:c, :c].mean(), b[:c, -c:].mean(), b[-c:, :c].mean(), b[-c:, -c:].mean()]))
    return float(np.mean(out))


def test_colour_and_object_edits_are_reused_by_their_tiers_and_show_what_was_asked(tmp_path):
    eng = _engine(tmp_path)
    a = eng.generate("a big red ball on grass", seed=1, num_inference_steps=N)
    src = _nearest(a.frames)
    assert not a.stats.hit and (src == "red").sum() > 2000 and (src == "blue").sum() == 0
    assert _corner_fill(a.frames, "red") < 0.45   # a ball

    blue = eng.generate("a big blue ball on grass", seed=2, num_inference_steps=N, store=False)
    assert blue.stats.hit and blue.stats.source_id == a.stats.entry_id and blue.stats.resume_step == STEP
    assert "colour" in blue.stats.reason and "red -> blue" in blue.stats.reason and "region-guided from step 5" in blue.stats.reason
    got = _nearest(blue.frames)
    assert (got == "blue").sum() > 2000 and (got == "red").sum() < 100   # the asked colour, none of the cached one
    assert blue.stats.dit_forwards == 2 * (4 + N - STEP)   # the probe's 4 steps, then steps 5..19 (both guidance branches)

    box = eng.generate("a big red box on grass", seed=2, num_inference_steps=N, store=False)
    assert box.stats.hit and box.stats.resume_step == STEP and "object" in box.stats.reason
    assert _corner_fill(box.frames, "red") > 0.5   # a box, not the cached ball


def test_kinds_without_a_tier_miss_naming_the_kind_and_same_content_resumes_late_without_a_probe(tmp_path):
    eng = _engine(tmp_path)
    a = eng.generate("a big red ball moving left on grass", seed=1, num_inference_steps=N)
    for prompt, kind in (("a big red ball moving right on grass", "motion"), ("a big red ball moving left in the snow", "place")):
        r = eng.generate(prompt, seed=3, num_inference_steps=N, store=False)
        assert not r.stats.hit, prompt
        assert f"no certified tier reuses a {kind} change" in r.stats.reason
    again = eng.generate("a big red ball moving left on grass", seed=4, num_inference_steps=N, store=False)
    assert again.stats.hit and again.stats.source_id == a.stats.entry_id and again.stats.resume_step == 15
    assert "re-roll" in again.stats.reason and "whole frame" in again.stats.reason
    assert again.stats.dit_forwards == 2 * (N - 15)   # no probe: the frame tier reads none


def test_an_entry_keeps_the_latents_its_tiers_read_and_a_frame_tier_reads_one(tmp_path):
    # region tiers at 5 of 20 blend with the source after every later step (traj.4 .. traj.19); the frame tier at 15
    # reads traj.14 alone
    eng = _engine(tmp_path)
    pol = eng.policy("carnator")
    assert pol.stored_steps(N) == set(range(STEP - 1, N))
    only_frame = _engine(tmp_path / "f", kinds=())
    assert only_frame.policy("carnator").stored_steps(N) == {14}
    a = only_frame.generate("a big red ball moving left on grass", seed=1, num_inference_steps=N)
    kept = sorted(k for k in only_frame.store.load(a.stats.entry_id) if k.startswith("traj."))
    assert kept == ["traj.14"]
    again = only_frame.generate("a big red ball moving left on grass", seed=4, num_inference_steps=N, store=False)
    assert again.stats.hit and again.stats.resume_step == 15   # served from that one latent


def test_one_resume_step_with_a_tier_scope_calibrates_tiers_at_that_step(tmp_path):
    """A tier calibration at one step (a kind's step known, more pairs wanted there): each reuse goes through the open
    tier of its kind and is planned as a served one (a frame tier: the whole frame from the step, no probe blended in)."""
    from carnator.calibrate.run import run_calibration
    from carnator.judges import QualityRule

    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c", device="cpu", embedder=hashed_embedder(64))
    pairs = [("colour", "a big red ball on grass", 1, "a big blue ball on grass", 2)]
    summary = run_calibration(eng, tmp_path / "cal", pairs, judge=_Pass(), rule=QualityRule({"fidelity": 0.25}, _Pass.directions),
                              steps=10, resume_step=[5], tier_scope="frame", progress=lambda *a: None)
    (row,) = [__import__("json").loads(line) for line in (tmp_path / "cal" / "pairs.jsonl").read_text().splitlines()]
    assert row["hit"] and (row["resume_step"], row["scope"], row["change"]) == (5, "frame", "colour")
    assert "colour of" in row["reason"] and "whole frame from step 5 of 10" in row["reason"]
    assert set(summary["tiers"]) == {"colour"}   # one kind, one step: too few pairs to certify, but tabled per kind


def test_a_tier_calibration_reuses_from_steps_the_engines_own_tiers_do_not_keep(tmp_path):
    """The engine's file (the shipped one: frame tiers, each keeping one latent) does not decide what a calibration's
    source keeps: a reuse from each asked step finds its latent."""
    import json

    from carnator.calibrate.run import run_calibration
    from carnator.judges import QualityRule

    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c", device="cpu", embedder=hashed_embedder(64))
    shipped = eng.policy("carnator").tiers.values()   # frame tiers, each keeping its own step's latent alone
    assert shipped and all(t.scope == "frame" for t in shipped) and 7 not in {t.resume_at(10) for t in shipped}
    pairs = [("place", "a big red ball on grass", 1, "a big red ball in the snow", 2)]
    run_calibration(eng, tmp_path / "cal", pairs, judge=_Pass(), rule=QualityRule({"fidelity": 0.25}, _Pass.directions),
                    steps=10, resume_step=[5, 7], tier_scope="frame", progress=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "cal" / "pairs.jsonl").read_text().splitlines()]
    assert [(r["resume_step"], r["hit"]) for r in sorted(rows, key=lambda r: r["resume_step"])] == [(5, True), (7, True)]
    assert all("cannot serve" not in r["reason"] for r in rows)


def test_an_object_edit_is_reused_by_the_shipped_object_tier_and_shows_the_asked_shape(tmp_path):
    # the default engine and its shipped file (the admission gate on): the object tier (12 of 50, frame scope, certified
    # in excess of a fresh sample) scaled to 20 steps resumes at 5 (round(4.8)) and recomputes every token from there
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c", device="cpu", embedder=hashed_embedder(64))
    tier = eng.policy("carnator").tiers["object"]
    assert (tier.step, tier.of, tier.scope, tier.certified) == (12, 50, "frame", True)
    a = eng.generate("a big red ball on grass", seed=1, num_inference_steps=N)
    assert not a.stats.hit and _corner_fill(a.frames, "red") < 0.45   # a ball
    box = eng.generate("a big red box on grass", seed=2, num_inference_steps=N, store=False)
    assert box.stats.hit and box.stats.source_id == a.stats.entry_id and box.stats.resume_step == 5
    assert box.stats.reason.startswith(f"object of {a.stats.entry_id[:8]} (object circle -> square): whole frame from step 5 of 20")
    assert box.stats.dit_forwards == 2 * (N - 5)   # no probe: a frame tier reads none
    assert _corner_fill(box.frames, "red") > 0.5   # a box, not the cached ball


def test_the_shipped_place_tier_reuses_a_place_replaced_and_misses_a_place_added_or_taken_away(tmp_path):
    # the place tier is certified on pairs that replace one place by another: a scene gaining or losing its place is
    # another kind of change, with no tier
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c", device="cpu", embedder=hashed_embedder(64))
    assert eng.policy("carnator").tiers["place"].step == 20 and "place-added" not in eng.policy("carnator").tiers
    a = eng.generate("a big red ball on grass", seed=1, num_inference_steps=N)
    snow = eng.generate("a big red ball in the snow", seed=2, num_inference_steps=N, store=False)
    assert snow.stats.hit and snow.stats.source_id == a.stats.entry_id and snow.stats.resume_step == 8
    assert snow.stats.reason.startswith(f"place of {a.stats.entry_id[:8]} (place grass -> snow)")
    gone = eng.generate("a big red ball", seed=3, num_inference_steps=N, store=False)   # "place-removed": no tier
    assert not gone.stats.hit and gone.stats.reason == "no cached request passes the noun filter"


def test_an_edit_finds_the_request_it_edits_by_content_among_nearer_sentences(tmp_path):
    # top_k 1: the sentence search returns only the nearest cached request, another scene's (its box moves left: a
    # motion change, no tier); the object edit's own source, one object change away, is found by content all the same
    hashed = hashed_embedder(64)
    prompts = ["a big red ball on grass", "a big red box moving left on grass", "a big red box on grass"]
    e = hashed(prompts)
    assert float(e[1] @ e[2]) > float(e[0] @ e[2])   # the other scene's sentence is the nearer

    def engine(**opts):
        cfg = EngineConfig(policy_options={"carnator": {"top_k": 1, **opts}})
        return Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c", device="cpu", embedder=hashed, config=cfg)

    eng = engine()
    a = eng.generate(prompts[0], seed=1, num_inference_steps=N)
    b = eng.generate(prompts[1], seed=3, num_inference_steps=N)
    assert not a.stats.hit and not b.stats.hit
    box = eng.generate(prompts[2], seed=2, num_inference_steps=N, store=False)
    assert box.stats.hit and box.stats.source_id == a.stats.entry_id
    assert box.stats.reason.startswith(f"object of {a.stats.entry_id[:8]} (object circle -> square)")
    assert _corner_fill(box.frames, "red") > 0.5   # a box
    # recall by sentence alone (content recall off) sees only the other scene: a miss naming its kind of change
    alone = engine(content_recall=False).generate(prompts[2], seed=2, num_inference_steps=N, store=False)
    assert not alone.stats.hit and "motion change" in alone.stats.reason


def test_the_contents_one_edit_away_are_those_of_the_asked_kinds_only():
    from carnator.embedded import HERE
    from carnator.signature.content import LexiconContent, change_kind

    read = LexiconContent.from_file(HERE / "lexicon.json")
    c = read("a big red ball moves left on grass")
    assert c == ["object:circle|size:big|color:red|motion:left", "place:grass"]
    near = read.neighbours(c, ["object", "place"])
    # 6 other shapes; 7 other places (none added or removed)
    assert len(near) == 6 + 7 and c not in near
    assert ["object:square|size:big|color:red|motion:left", "place:grass"] in near
    assert ["object:circle|size:big|color:red|motion:left", "place:snow"] in near
    assert ["object:circle|size:big|color:red|motion:left"] not in near
    assert {change_kind("q", "s", n, c) for n in near} == {"object", "place"}
    assert len(read.neighbours(c, ["colour"])) == 9 and read.neighbours(c, []) == []
    two = read("a small blue star and a big red ball")
    assert {change_kind("q", "s", n, two) for n in read.neighbours(two, ["size", "place"])} == {"size"}
    assert len(read.neighbours(two, ["size", "place"])) == 2   # each object's other size; no place to replace
