"""The lab's command line: the shapes world's benchmark and calibration through the library's `carnator bench` and
`carnator calibrate` with the shapes judge (the library's, by name), and the lab package's other contracts."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import carnator.recall.embedder
from carnator_lab.cli import main

REAL_DEFAULT_EMBEDDER = carnator.recall.embedder.default_embedder


@pytest.mark.slow
def test_bench_jobs_runs_policies_in_processes_with_the_same_quality_and_hits(tmp_path, monkeypatch):
    """``--jobs 3``: nirvana's warm fill in three processes, then its test stream and dense's in one each, over one
    folder; every quality and hit number equals a one-process run's (the speed columns are measured under
    contention, so they are not compared)."""
    # The worker processes load the real recall embedder; so must this process, or recall would differ.
    monkeypatch.setattr(carnator.recall.embedder, "default_embedder", REAL_DEFAULT_EMBEDDER)
    common = ["bench", "--warm", "4", "--test", "3", "--steps", "3", "--policies", "dense,nirvana", "--device", "cpu",
              "--cache-dir", str(tmp_path / "c"), "--keep-clips", "0"]
    assert main(common + ["--jobs", "3", "--out", str(tmp_path / "par")]) == 0
    assert main(common + ["--out", str(tmp_path / "seq")]) == 0
    par, seq = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("par", "seq"))
    exact = ("hit_rate", "fidelity_all", "artifact_all", "fidelity_hits", "dense_fidelity_on_hits", "unsafe_hit_rate", "bytes_per_entry")
    for pol in ("dense", "nirvana"):
        assert {k: par["policies"][pol][k] for k in exact} == {k: seq["policies"][pol][k] for k in exact}
    assert par["policies"]["nirvana"]["hit_rate"] > 0  # the re-rolls and rewordings of the trace hit
    rows = [json.loads(line) for line in (tmp_path / "par" / "requests.jsonl").read_text().splitlines()]
    assert sorted((r["policy"], r["i"]) for r in rows) == sorted((p, i) for p in ("dense", "nirvana") for i in range(3))


def test_bench_latent_dtype_is_the_stored_latents_dtype(tmp_path):
    from carnator.cache import CacheBank

    out = tmp_path / "b"
    assert main(["bench", "--warm", "1", "--test", "1", "--steps", "2", "--policies", "dense,nirvana", "--device", "cpu",
                 "--cache-dir", str(tmp_path / "c"), "--keep-clips", "0", "--latent-dtype", "float16", "--out", str(out)]) == 0
    bank = CacheBank(out / "caches" / "nirvana")
    entry = bank.load(bank.entries()[0].id)
    assert any(k.startswith("traj.") for k in entry)
    assert all(entry[k].dtype == torch.float16 for k in entry if k.startswith("traj."))




def test_the_librarys_shapes_judge_scores_a_clip_the_lab_rendered():
    """The judge the library ships for the embedded model reads the world the lab renders: a clip rendered from a
    caption scores full fidelity and no artifact against that caption, and less against another."""

    from carnator.judges import available_judges, get_judge
    from carnator_lab.world import caption, render, sample_scenes, to_uint8

    assert "shapes" in available_judges()
    judge = get_judge("shapes")
    scenes = sample_scenes(2, rng=0)
    texts = [caption(sc, rng=0) for sc in scenes]
    clip = to_uint8(render(scenes[:1]).video)[0]
    s = judge.score(clip, texts[0])
    assert set(s) == {"fidelity", "artifact", "shape", "color", "size", "motion", "background"}
    assert s["fidelity"] == 1.0 and s["artifact"] < 0.01 and all(s[k] == 1.0 for k in ("shape", "color", "size", "background"))
    assert judge.score(clip, texts[1])["fidelity"] < 1.0
    assert judge.identity.startswith("shapes-") and judge.directions == {"fidelity": 1, "artifact": -1, "shape": 1, "color": 1, "size": 1, "motion": 1, "background": 1}


def test_the_shipped_lexicon_is_the_worlds():
    """The embedded model reads nouns from its shipped lexicon.json without importing the world: it must equal what
    the world's grammar gives (`carnator-lab export-lexicon` rewrites it), and read the world's nouns exactly."""
    import numpy as np

    from carnator.signature.nouns import LexiconNouns
    from carnator_lab.lexicon import LEXICON_PATH, lexicon
    from carnator_lab.world.captions import caption, nouns
    from carnator_lab.world.scene import sample_scene

    shipped = json.loads(LEXICON_PATH.read_text())
    assert {k: shipped[k] for k in ("vocabulary", "phrases")} == {k: lexicon()[k] for k in ("vocabulary", "phrases")}
    read = LexiconNouns.from_file(LEXICON_PATH)
    rng = np.random.default_rng(1)
    for i in range(500):
        text = caption(sample_scene(rng, split=None if i % 2 else "train"), rng)
        assert read(text) == nouns(text), text


def test_calibration_pairs_come_in_the_bench_streams_proportions_and_unrelated_ones_pass_the_noun_filter():
    """The thresholds are certified on pairs drawn like the stream they serve: every 10 pairs hold the traces' mix
    (re-roll and noun 2 each, the other kinds 1), and an unrelated pair is two different scenes whose nouns recall's
    filter would still hand to the compatibility test."""
    from carnator.reuse import noun_diff
    from carnator_lab.pairs import make_pairs
    from carnator_lab.world.captions import nouns as extract_nouns
    from carnator_lab.traces import MIX

    pairs = make_pairs(40, seed=3)
    assert Counter(p[0] for p in pairs[:10]) == {k: round(s * 10) for k, s in MIX}
    unrelated = [p for p in pairs if p[0] == "unrelated"]
    assert len(unrelated) == 4
    for _, source, _, target, _ in unrelated:
        assert source != target and noun_diff(extract_nouns(target), extract_nouns(source)) is not None


