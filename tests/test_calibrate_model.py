"""`carnator calibrate` on a user's own model, prompts and judge: a tiny Wan pipeline and a tiny CLIP, a few pairs on
the CPU. The thresholds file it writes is bound to the model, the policy's reading and the judge: it loads for that
model (``Carnator(pipe, thresholds=PATH)``, ``--option carnator.thresholds=PATH``) and is refused, in one line, for
another model or judge."""

import json

import pytest
import torch

import carnator.recall.embedder
from carnator import Carnator
from carnator.cli import main
from carnator.errors import CarnatorError
from carnator.judges import get_judge
from carnator.testing import hashed_embedder, tiny_clip, tiny_pipeline

WARM = ["a red ball on green grass", "a blue cube on yellow sand", "a white cat under a tree", "a black dog in the snow"]
STREAM = ["a yellow ball on green grass", "a blue cube on white sand", "a grey cat under a tree", "a brown dog in the snow",
          "a red ball on grey grass"]
GEN = ["--frames", "5", "--height", "16", "--width", "16", "--steps", "6", "--guidance", "5", "--device", "cpu"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _offline_and_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(carnator.recall.embedder, "default_embedder", lambda: hashed_embedder(32))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("carnator: error: "), err
    for w in words:
        assert w in lines[0], lines[0]


def test_calibrate_on_a_tiny_wan_with_a_tiny_clip_writes_thresholds_bound_to_model_reading_and_judge(capsys, tmp_path):
    model, clip = tmp_path / "wan", tiny_clip(tmp_path / "clip")
    tiny_pipeline("wan").save_pretrained(model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(WARM + STREAM) + "\n")
    out, cache = tmp_path / "cal", tmp_path / "cache"
    argv = ["calibrate", "--model", model, "--prompts", prompts, "--judge", f"clip={clip}", "--pairs", 4, "--warm", 4,
            "--resume-step", 5, "--out", out, "--cache-dir", cache, *GEN]
    code, stdout, err = run(capsys, *argv)
    assert code == 0, err
    assert "s/pair, ETA" in stdout
    summary = json.loads(stdout[stdout.index("{"):])
    judge = get_judge(f"clip={clip}", device="cpu")
    assert summary["pairs"] == 4 and summary["judge"] == judge.identity
    assert summary["rule"] == {"deltas": {"clip_t": 0.02}, "directions": {"clip_t": 1, "ssim": 1}, "floors": {"ssim": 0.5}}
    assert set(summary["seconds_per_pair"]) >= {"source", "dense", "reuse", "judge", "decode", "total"}
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(set(r["dense"]) == {"clip_t", "ssim", "psnr", "flicker"} for r in rows)
    assert all(r["dense"]["ssim"] == pytest.approx(1.0) for r in rows)  # dense against itself
    doc = json.loads((out / "thresholds.json").read_text())
    assert doc["meta"]["judge"] == judge.identity and doc["meta"]["rule"]["floors"] == {"ssim": 0.5}
    assert doc["reading"]["probe_steps"] == 4
    # the step every pair reused from: what the file certifies, and so the step its reuse resumes at (lever 2)
    assert doc["meta"]["resume"] == {"step": 5, "of": int(GEN[GEN.index("--steps") + 1]), "certified_steps": [5]}
    assert {r["resume_step"] for r in rows} == {5}

    # resumable: a second run generates nothing (every pair is in pairs.jsonl) and selects the same thresholds
    code, stdout2, err = run(capsys, *argv)
    assert code == 0, err
    assert "ETA" not in stdout2 and json.loads(stdout2[stdout2.index("{"):])["result"] == summary["result"]

    # loads for this model, by the library and the CLI
    tau = out / "thresholds.json"
    eng = Carnator.from_pretrained(str(model), tmp_path / "c2", device="cpu", thresholds=tau, embedder=hashed_embedder(32))
    pol = eng.policy("carnator")
    assert str(tau) in pol.thresholds_source and pol.certified == doc["meta"]["certified"]
    code, stdout, err = run(capsys, "generate", "a red ball on green grass", "--model", model, "--option",
                            f"carnator.thresholds={tau}", "--out", tmp_path / "a.gif", "--cache-dir", cache, *GEN)
    assert code == 0, err
    # refused for another model (other weights), and when another judge is required, in one line each
    with pytest.raises(CarnatorError, match="calibrated for model"):
        Carnator(tiny_pipeline("wan", seed=1), tmp_path / "c3", thresholds=tau, embedder=hashed_embedder(32))
    other = tiny_pipeline("wan", seed=1)
    other.save_pretrained(tmp_path / "wan1")
    capsys.readouterr()  # (diffusers' notes on building the tiny pipelines)
    code, _, err = run(capsys, "generate", "a red ball", "--model", tmp_path / "wan1", "--option", f"carnator.thresholds={tau}",
                       "--out", tmp_path / "b.gif", "--cache-dir", cache, *GEN)
    one_error_line(code, err, "calibrated for model", "recalibrate")
    code, _, err = run(capsys, "generate", "a red ball", "--model", model, "--option", f"carnator.thresholds={tau}",
                       "--option", "carnator.judge=clip:0000000000000000", "--out", tmp_path / "b.gif", "--cache-dir", cache, *GEN)
    one_error_line(code, err, "certified by judge", judge.identity)
    # a resumed run with another judge is refused too
    other_clip = tiny_clip(tmp_path / "clip1", seed=1)
    code, _, err = run(capsys, *[f"clip={other_clip}" if a == f"clip={clip}" else a for a in argv])
    one_error_line(code, err, "holds pairs drawn as")


def test_reuse_on_uncertified_thresholds_is_marked_said_once_and_refused_without_allow_uncertified(tmp_path, caplog):
    import logging
    import math

    from carnator.engine import EngineConfig
    from carnator.reuse import Thresholds

    pipe = tiny_pipeline("wan")
    probe = Carnator(pipe, tmp_path / "probe", embedder=hashed_embedder(32))
    open_tau = tmp_path / "open.json"  # every pair compatible, and no certificate in the file
    Thresholds(math.inf, math.inf, math.inf, math.inf).save(open_tau, model_id=probe.model_identity)
    kw = dict(num_frames=5, height=16, width=16, num_inference_steps=6, guidance_scale=5.0)
    for allow in (True, False):
        cfg = EngineConfig(allow_uncertified=allow, policy_options={"carnator": {"resume_step": 5}})
        eng = Carnator(pipe, tmp_path / f"c{allow}", config=cfg, embedder=hashed_embedder(32), thresholds=open_tau)
        eng.generate("a red ball on green grass", seed=0, **kw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="carnator"):
            hits = [eng.generate(p, seed=1, store=False, **kw) for p in ("a yellow ball on green grass", "a blue ball on green grass")]
        said = [r.message for r in caplog.records if "uncertified" in r.message]
        if allow:  # reused, each hit marked, the notice given once
            assert all(h.stats.hit and h.stats.certified is False for h in hits)
            assert len(said) == 1 and "certified: false" in said[0]
        else:  # carnator serve's default: a miss, saying why
            assert not any(h.stats.hit for h in hits) and not said
            assert all("allow_uncertified is off" in h.stats.reason for h in hits)
