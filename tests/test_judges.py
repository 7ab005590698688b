"""Quality judges for real backbones: CLIP-T from a local CLIP (checked against a hand computation through
transformers' own forward), SSIM / PSNR / flicker on clips with known answers, the quality rule's floors, and the
embedded model's own ``shapes`` judge (shipped with the library, bound to the identity its calibrations record)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from carnator.errors import CarnatorError
from carnator.judges import QualityRule, available_judges, get_judge
from carnator.judges.reference import flicker, psnr, ssim
from carnator.testing import tiny_clip


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip"))


def _clip(seed, t=12, h=24, w=40):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def test_clip_t_is_the_mean_cosine_of_sampled_frames_and_prompt_as_transformers_computes_it(clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    judge = get_judge(f"clip={clip_dir}", device="cpu")
    frames, prompt = _clip(0), "a red ball rolls over green grass"
    got = judge.score(frames, prompt)
    # By hand: CLIPModel's own forward on the 8 evenly spaced frames (0, 2, 3, 5, 6, 8, 9, 11 of 12) and the prompt; its
    # image_embeds and text_embeds are unit vectors, so their dot product is the cosine.
    idx = np.unique(np.linspace(0, 11, 8).round().astype(int))
    assert list(idx) == [0, 2, 3, 5, 6, 8, 9, 11]
    model, proc = CLIPModel.from_pretrained(str(clip_dir)).eval(), CLIPProcessor.from_pretrained(str(clip_dir))
    with torch.no_grad():
        out = model(**proc(text=[prompt], images=list(frames[idx]), return_tensors="pt", padding=True))
    want = float((out.image_embeds @ out.text_embeds[0]).mean())
    assert got["clip_t"] == pytest.approx(want, abs=1e-6)
    assert -1 <= got["clip_t"] <= 1 and math.isnan(got["ssim"]) and math.isnan(got["psnr"])
    # batched like unbatched
    judge.batch = 3
    assert judge.score(frames, prompt)["clip_t"] == pytest.approx(want, abs=1e-6)
    # with a reference: the reference scores, against itself the best there is
    ref = judge.score(frames, prompt, reference=frames)
    assert ref["ssim"] == pytest.approx(1.0) and ref["psnr"] == math.inf


def test_clip_judge_identity_is_a_hash_of_the_weights(clip_dir, tmp_path):
    a = get_judge(f"clip={clip_dir}", device="cpu")
    assert a.identity == get_judge(f"clip={clip_dir}", device="cpu").identity and a.identity.startswith("clip:")
    other = tiny_clip(tmp_path / "other", seed=1)
    assert get_judge(f"clip={other}", device="cpu").identity != a.identity
    assert {"clip", "reference"} <= set(available_judges())
    with pytest.raises(CarnatorError, match="not a CLIP model directory"):
        get_judge(f"clip={tmp_path / 'nothing'}")


def test_ssim_psnr_flicker_known_answers():
    x = _clip(1)
    assert ssim(x, x) == pytest.approx(1.0) and psnr(x, x) == math.inf
    # constant clips 100 and 110: MSE 100, so PSNR = 10 log10(255^2 / 100); SSIM of constants a, b is
    # (2ab + C1) / (a^2 + b^2 + C1) with C1 = (0.01 * 255)^2 (the contrast-structure term is C2 / C2 = 1)
    a, b = np.full((3, 16, 16, 3), 100, np.uint8), np.full((3, 16, 16, 3), 110, np.uint8)
    assert psnr(b, a) == pytest.approx(10 * math.log10(255**2 / 100))
    c1 = (0.01 * 255) ** 2
    assert ssim(b, a) == pytest.approx((2 * 100 * 110 + c1) / (100**2 + 110**2 + c1), rel=1e-6)
    # flicker: a still clip 0, black/white alternation 1, a ramp of 51 per frame 0.2
    assert flicker(a) == 0.0
    assert flicker(np.stack([np.zeros((4, 4, 3)), np.full((4, 4, 3), 255)] * 2).astype(np.uint8)) == pytest.approx(1.0)
    ramp = np.stack([np.full((4, 4, 3), 51 * k) for k in range(5)]).astype(np.uint8)
    assert flicker(ramp) == pytest.approx(0.2)
    # a noisy copy scores below the clip itself
    noisy = np.clip(x.astype(int) + np.random.default_rng(2).integers(-40, 41, x.shape), 0, 255).astype(np.uint8)
    assert 0 < ssim(noisy, x) < 0.99 and 10 < psnr(noisy, x) < 30


def test_quality_rule_deltas_and_floors():
    judge = get_judge("reference")
    rule = QualityRule.for_judge(judge, {"ssim": 0.5, "flicker": 0.1}, psnr=1.0)
    assert rule.directions == {"psnr": 1, "ssim": 1, "flicker": -1}
    dense = {"ssim": 1.0, "psnr": 30.0, "flicker": 0.05}
    assert rule.acceptable({"ssim": 0.6, "psnr": 29.5, "flicker": 0.1}, dense)
    assert not rule.acceptable({"ssim": 0.4, "psnr": 29.5, "flicker": 0.1}, dense)   # below the SSIM floor
    assert not rule.acceptable({"ssim": 0.6, "psnr": 28.0, "flicker": 0.1}, dense)   # PSNR lost more than 1
    assert not rule.acceptable({"ssim": 0.6, "psnr": 29.5, "flicker": 0.2}, dense)   # above the flicker ceiling
    assert not rule.acceptable({"ssim": math.nan, "psnr": 29.5, "flicker": 0.1}, dense)  # NaN fails a floor
    assert QualityRule.from_dict(rule.to_dict()) == rule
    assert rule.describe() == "psnr >= dense - 1 and ssim >= 0.5 and flicker <= 0.1"
    # the default rule of the clip judge: the paper's Delta on CLIP-T and an SSIM floor
    from carnator.judges.clip import ClipJudge

    assert ClipJudge.default_deltas == {"clip_t": 0.02} and ClipJudge.default_floors == {"ssim": 0.5}
    with pytest.raises(CarnatorError, match="has no score"):
        QualityRule.for_judge(judge, {"clip_t": 0.3})


@pytest.mark.parametrize("quality, words", [
    (["flicker>=0.1"], "flicker is better lower; write flicker<=0.1"),
    (["ssim>0.5"], "expected SCORE=DELTA or SCORE>=FLOOR"),
    (["clip_t=0.02"], "judge reference has no score clip_t"),
])
def test_quality_flags_are_checked_in_one_line_before_any_model_loads(capsys, tmp_path, quality, words):
    from carnator.cli import main

    argv = ["calibrate", "--model", str(tmp_path / "no-model"), "--prompts", str(tmp_path / "p.txt"), "--judge", "reference"]
    for q in quality:
        argv += ["--quality", q]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("carnator: error: --quality") and words in lines[0], lines


def test_quality_flags_make_floors_and_deltas():
    import argparse

    from carnator.cli import _quality_rule

    rule = _quality_rule(argparse.Namespace(quality=["ssim>=0.6", "flicker<=0.2", "psnr=3"]), get_judge("reference"))
    assert rule.floors == {"ssim": 0.6, "flicker": 0.2} and rule.deltas == {"psnr": 3.0}
    assert _quality_rule(argparse.Namespace(quality=[]), get_judge("reference")).to_dict() == {
        "deltas": {"flicker": 0.02}, "directions": {"flicker": -1, "ssim": 1}, "floors": {"ssim": 0.5}}


REPO = Path(__file__).resolve().parents[1]


def test_the_shapes_judge_ships_with_the_library_under_the_identity_its_calibrations_record():
    """``shapes`` is a built-in (no package registers it); its identity is the hash of the clip reader's source, the
    one the summary of the embedded model's calibration at resume step 45 recorded (a changed reader would no longer match it)."""
    from carnator.embedded.judge import READER, ShapesJudge

    judge = get_judge("shapes")
    assert type(judge) is ShapesJudge and "shapes" in available_judges()
    assert READER.is_file() and READER.parent.parent.name == "embedded"
    recorded = json.loads((REPO / "lab/notebook/bench-embedded/shipped-tier45-h100-calibration.json").read_text())
    assert judge.identity == recorded["judge"] == "shapes-17fbf9e8578d"
    assert judge.directions == {"fidelity": 1, "artifact": -1, "shape": 1, "color": 1, "size": 1, "motion": 1, "background": 1}
    with pytest.raises(ValueError, match="takes no argument"):
        get_judge("shapes=x")


def _ball_moving_left_on_grass(frames=16, size=64):
    """A big red ball (radius 11 px) moving 27 px left over a grass gradient, anti-aliased as the world draws it."""
    from carnator.embedded.world.render import shape_sdf
    from carnator.embedded.world.scene import BACKGROUNDS, COLORS, SIZE_RADIUS

    top, bottom = (np.array(c, float) / 255 for c in BACKGROUNDS["grass"])
    rows = np.linspace(0, 1, size)[:, None, None]
    bg = np.broadcast_to(top + (bottom - top) * rows, (size, size, 3))
    r = SIZE_RADIUS["big"] * size
    ys, xs = np.mgrid[0:size, 0:size] + 0.5
    out = []
    for t in range(frames):
        cx = 45 - 27 * t / (frames - 1)
        alpha = np.clip(0.5 - shape_sdf("circle", (xs - cx) / r, (ys - 32) / r) * r, 0, 1)[..., None]
        out.append(bg * (1 - alpha) + np.array(COLORS["red"]) / 255 * alpha)
    return (np.stack(out) * 255).round().astype(np.uint8)


def test_the_shapes_judge_reads_a_clip_drawn_by_hand():
    """Every attribute the prompt states and the clip shows counts: all five for its own caption (nothing unexplained),
    none for a caption that differs in each, two of five for one that keeps only the place and the motion."""
    judge = get_judge("shapes")
    clip = _ball_moving_left_on_grass()
    own = judge.score(clip, "a big red ball moving left on grass")
    assert own["fidelity"] == 1.0 and own["artifact"] == 0.0
    assert judge.score(clip, "a small blue box moving right in the snow")["fidelity"] == 0.0
    assert judge.score(clip, "footage of a tiny yellow star drifting left on a grassy field, 4k")["fidelity"] == 2 / 5
    # each kind of attribute on its own: what an edit's rule reads (the colour kept, the shape lost)
    by_kind = judge.score(clip, "a big red box moving left on grass")
    assert {k: by_kind[k] for k in ("shape", "color", "size", "motion", "background")} == {
        "shape": 0.0, "color": 1.0, "size": 1.0, "motion": 1.0, "background": 1.0}
    assert math.isnan(judge.score(clip, "a red ball")["motion"])   # no motion stated: nothing to check
