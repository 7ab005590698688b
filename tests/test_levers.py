"""Issue 26: content evidence, the admission gate, own sample and per-kind certification (hand-computed cases)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from carnator import Carnator, EngineConfig
from carnator.embedded import HERE
from carnator.judges import register_judge
from carnator.calibrate.certify import CalibrationPair, stratified_certification
from carnator.reuse import Discrepancies, Thresholds
from carnator.signature.content import LexiconContent, change_kind, content_change, content_distance, heuristic_content
from carnator.testing import hashed_embedder

READ = LexiconContent.from_file(HERE / "lexicon.json")
SRC = "a small red ball moving left on grass"


@pytest.mark.parametrize("other, kind, distance", [
    ("footage of a small red ball moving left on grass, 4k", "rewording", 0),
    ("a little red circle sliding to the left on a grassy field, cinematic", "rewording", 0),   # synonyms
    ("a small red ball moving left on grass", "re-roll", 0),
    ("a small red ball moving right on grass", "motion", 2),
    ("a small blue ball moving left on grass", "colour", 2),
    ("a big red ball moving left on grass", "size", 2),
    ("a small red box moving left on grass", "small-object", 2),   # a small object's substitution: its own kind
    ("a small red ball moving left in the snow", "place", 2),
    ("a small red ball moving left", "place-removed", 1),
    ("a small red ball moving left and a big blue box rising on grass", "count", 1),
])
def test_content_reads_what_a_caption_asks(other, kind, distance):
    assert content_distance(READ(other), READ(SRC)) == distance
    assert change_kind(other, SRC, READ(other), READ(SRC)) == kind


def test_an_object_substitution_is_an_object_change_for_a_big_object_and_a_small_object_change_for_a_small_one():
    big, small = "a big red ball on grass and a tiny blue star", "a big red box on grass and a tiny blue star"
    assert change_kind(small, big, READ(small), READ(big)) == "object"   # the big ball became a box
    tiny = "a big red ball on grass and a tiny blue ring"
    assert change_kind(tiny, big, READ(tiny), READ(big)) == "small-object"   # the tiny star became a ring
    near = READ.neighbours(READ(big), ["object"])
    assert near and {change_kind("q", "s", n, READ(big)) for n in near} == {"object"}
    assert {change_kind("q", "s", n, READ(big)) for n in READ.neighbours(READ(big), ["small-object"])} == {"small-object"}


def test_content_change_names_the_attribute_and_unknown_content_is_infinitely_far():
    assert content_change(READ("a small red ball moving right on grass"), READ(SRC)) == "motion left -> right"
    assert content_change(READ("footage of " + SRC), READ(SRC)) == "same content"
    assert content_distance(READ(SRC), None) == math.inf


def test_heuristic_content_drops_style_and_framing_words_only():
    a = heuristic_content("A dog running on the beach")
    assert heuristic_content("cinematic footage of a dog running on the beach, 4k, high quality") == a
    assert heuristic_content("A cat running on the beach") != a


def test_stratified_certification_bounds_each_kind_alone():
    ok = Discrepancies(context=0.0, content=0.0)
    edit = Discrepancies(context=0.0, content=2.0)
    pairs = [CalibrationPair(ok, True)] * 50 + [CalibrationPair(ok, True)] * 9 + [CalibrationPair(ok, False)] \
        + [CalibrationPair(edit, False)] * 10
    kinds = ["re-roll"] * 50 + ["rewording"] * 10 + ["motion"] * 10
    tau = Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0)
    t = stratified_certification(pairs, kinds, tau)
    assert t["re-roll"]["accepted"] == 50 and t["re-roll"]["unsafe"] == 0
    assert t["re-roll"]["bound"] == pytest.approx(1 - 0.1 ** (1 / 50)) and t["re-roll"]["certified"]   # 4.5 %
    assert t["rewording"]["accepted"] == 10 and t["rewording"]["unsafe"] == 1 and not t["rewording"]["certified"]
    assert t["motion"]["accepted"] == 0 and t["motion"]["certified"] is None
    # the mix: 60 accepted, 1 unsafe; its bound (6.4 %) hides nothing here, but the rewording row is what fails
    assert t["all"]["accepted"] == 60 and t["all"]["unsafe"] == 1


def test_own_sample_latent_is_the_flow_matching_state_through_the_source_clean_latent():
    from carnator.denoise import own_sample_latent

    class Sched:
        sigmas = torch.tensor([1.0, 0.6, 0.25, 0.0])

    class State:
        scheduler = Sched()
        latents = torch.zeros(1, 2, 3)

    e_req = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(1))

    class Adapter:
        def make_generator(self, req):
            return None

        def prepare_latents(self, req, gen):
            return e_req.clone()

    x0, e_src = torch.randn(1, 2, 3), torch.randn(1, 2, 3)
    z_src = 0.75 * x0 + 0.25 * e_src                    # the source's latent entering step 2 (sigma 0.25)
    same = own_sample_latent(Adapter(), State(), None, z_src, x0, 2, 0.0)
    assert torch.allclose(same, z_src, atol=1e-6)
    own = own_sample_latent(Adapter(), State(), None, z_src, x0, 2, 1.0)
    assert torch.allclose(own, 0.75 * x0 + 0.25 * e_req, atol=1e-6)
    half = own_sample_latent(Adapter(), State(), None, z_src, x0, 2, 0.6)
    assert torch.allclose(half, 0.75 * x0 + 0.25 * (0.6 * e_req + 0.8 * e_src), atol=1e-6)


# ---- end to end on the embedded model (8 steps, resume at 5; seeds other than calibration's) ----------------------

STEPS, RESUME = 8, 5


class _Judge:
    name, identity, directions = "fixed", "fixed", {"fidelity": 1, "artifact": -1}

    def __init__(self, fidelity):
        self.fidelity = fidelity

    def score(self, frames, prompt, reference=None):
        return {"fidelity": self.fidelity, "artifact": 0.0}


register_judge("test-pass", lambda arg: _Judge(1.0))
register_judge("test-fail", lambda arg: _Judge(0.5))


class _SlowJudge(_Judge):
    def score(self, frames, prompt, reference=None):
        time.sleep(1.0)   # a write-behind store that is still running when the request returns
        return super().score(frames, prompt, reference)


register_judge("test-slow", lambda arg: _SlowJudge(1.0))


def _engine(tmp_path, judge="test-pass", write_behind=None, **opts):
    eng0 = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c0", device="cpu", embedder=hashed_embedder(64))
    path = tmp_path / "content.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0).save(
        path, model_id=eng0.model_identity, reading=eng0.policy("carnator").reading())
    cfg = EngineConfig(admission_judge=judge, write_behind=write_behind, policy_options={
        "carnator": {"resume_step": RESUME, "thresholds": str(path), "probe": "auto", **opts}})
    return Carnator(eng0.pipe, tmp_path / "cache", config=cfg, embedder=hashed_embedder(64), adapter=eng0.adapter)


def test_rewordings_and_rerolls_hit_edits_miss_with_the_reason(tmp_path):
    eng = _engine(tmp_path)
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    assert not a.stats.hit and eng.store.get(a.stats.entry_id).extra["admitted"] is True
    for prompt, seed in (("footage of a little red circle sliding to the left on a grassy field, 4k", 102), (SRC, 103)):
        r = eng.generate(prompt, seed=seed, num_inference_steps=STEPS, store=False)
        assert r.stats.hit and r.stats.source_id == a.stats.entry_id and "same content" in r.stats.reason
        assert r.stats.dit_forwards == 2 * (STEPS - RESUME)   # a content-only rule needs no probe
    for prompt, change in (("a small red ball moving right on grass", "motion left -> right"),
                           ("a small red ball moving left in the snow", "place grass -> snow"),
                           ("a small blue ball moving left on grass", "color red -> blue")):
        r = eng.generate(prompt, seed=104, num_inference_steps=STEPS, store=False)
        assert not r.stats.hit, prompt
        assert r.stats.dit_forwards == 2 * STEPS


def test_a_reuse_is_never_the_source_of_another(tmp_path):
    """A hit's own entry begins at its resume step, so it cannot serve a reuse: the demo's second rewording was
    recalled to the first rewording's entry first and missed ("a tensor is missing"). Now the original is the source."""
    eng = _engine(tmp_path)
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    reworded = "footage of a small red ball moving left on grass, 4k"
    h = eng.generate(reworded, seed=102, num_inference_steps=STEPS)
    assert h.stats.hit and eng.store.get(h.stats.entry_id).extra["approximate"] is True
    r = eng.generate(reworded, seed=103, num_inference_steps=STEPS, store=False)  # nearest entry: h's, same prompt
    assert r.stats.hit and r.stats.source_id == a.stats.entry_id
    assert eng.generate(reworded, seed=102, num_inference_steps=STEPS).stats.exact_hit  # h still serves its own repeat


def test_a_rewording_finds_its_source_by_content_beyond_the_nearest_sentences(tmp_path):
    """With one recalled candidate, the rewording's nearest sentence is a colour edit of it (one word apart), not its
    source (three words apart): recall by sentence alone tests the edit and misses; recall by content also returns
    the source, which asks the same, and the request hits it."""
    eng = _engine(tmp_path, top_k=1)
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    eng.generate("footage of a small blue ball moving left on grass, 4k", seed=109, num_inference_steps=STEPS)
    reworded = "footage of a small red ball moving left on grass, 4k"
    r = eng.generate(reworded, seed=102, num_inference_steps=STEPS, store=False)
    assert r.stats.hit and r.stats.source_id == a.stats.entry_id and "same content" in r.stats.reason
    off = _engine(tmp_path, top_k=1, content_recall=False)   # the same cache, recall by sentence only
    m = off.generate(reworded, seed=102, num_inference_steps=STEPS, store=False)
    assert not m.stats.hit and "color blue -> red" in m.stats.reason


def test_a_same_content_rule_recalls_by_content_key_without_a_sentence_embedding(tmp_path):
    """Under a content-only file at content 0, recall reads the entries that ask the same: a hit that stores nothing
    computes no embedding, a miss computes one, to store its entry; the edit's miss says that nothing asks the same."""
    eng = _engine(tmp_path)
    embedded, embed = [], eng.embed
    eng.embed = lambda prompt: (embedded.append(prompt), embed(prompt))[1]
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    assert not a.stats.hit and embedded == [SRC]                       # stored: embedded once, for the entry
    r = eng.generate("footage of a small red ball moving left on grass, 4k", seed=102, num_inference_steps=STEPS, store=False)
    assert r.stats.hit and r.stats.source_id == a.stats.entry_id and embedded == [SRC]
    assert r.stats.notes["recall"] == "content" and "similarity" not in r.stats.notes
    e = eng.generate("a small blue ball moving left on grass", seed=104, num_inference_steps=STEPS, store=False)
    assert not e.stats.hit and e.stats.reason.startswith("nothing cached asks the same") and embedded == [SRC]
    # a rule with a text threshold reads the sentence similarity: recall embeds before deciding
    assert _engine(tmp_path / "t", content_recall=False).policy("carnator").recall_by_sentence()


def test_write_behind_returns_before_the_entry_is_written_and_flush_waits(tmp_path):
    """With write_behind the entry is judged, embedded and stored on a background thread; flush() waits for it, after
    which the result's stats name it and a re-roll reuses it. The default (None) is on only for a CUDA device."""
    assert EngineConfig().write_behind is None and not _engine(tmp_path / "cpu").write_behind
    eng = _engine(tmp_path, write_behind=True)
    assert eng.write_behind
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    eng.flush()
    assert a.stats.entry_id is not None and eng.store.get(a.stats.entry_id).extra["admitted"] is True
    assert a.stats.notes["admitted"] is True and "admission_judge" in a.stats.timings
    r = eng.generate(SRC, seed=103, num_inference_steps=STEPS, store=False)
    assert r.stats.hit and r.stats.source_id == a.stats.entry_id


def test_write_behind_holds_the_single_flight_lease_until_the_entry_is_written(tmp_path):
    """The same request sent again while the first one's entry is still being written (a slow judge) waits for the
    write and is served from it (an exact hit), not generated a second time; each result's flush waits for its own."""
    eng = _engine(tmp_path, judge="test-slow", write_behind=True)
    a = eng.generate(SRC, seed=101, num_inference_steps=STEPS)
    assert a.stats.entry_id is None   # returned before its write (which judges for a second) ended
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("b", eng.generate(SRC, seed=101, num_inference_steps=STEPS)))
    t.start()
    t.join(60)
    b = got["b"]
    assert b.stats.exact_hit and b.stats.entry_id is None and b.stats.source_id is not None
    eng.flush(a)
    assert a.stats.entry_id == b.stats.source_id


def test_a_source_that_fails_the_admission_judge_is_never_reused(tmp_path):
    from carnator.explain import describe

    eng = _engine(tmp_path, judge="test-fail")
    a = eng.generate(SRC, seed=105, num_inference_steps=STEPS)
    assert eng.store.get(a.stats.entry_id).extra["admitted"] is False
    r = eng.generate(SRC, seed=106, num_inference_steps=STEPS, store=False)
    assert not r.stats.hit
    # the reason says why the request that asks the same was no source (describe keeps it)
    assert r.stats.reason.startswith("1 cached request asks the same, but its own clip failed the admission judge")
    assert describe(eng, r).reason == r.stats.reason
    # the same entry is a source when the policy does not ask for admission
    eng2 = _engine(tmp_path / "b", judge="test-fail", admitted_only=False)
    eng2.generate(SRC, seed=105, num_inference_steps=STEPS)
    assert eng2.generate(SRC, seed=106, num_inference_steps=STEPS, store=False).stats.hit


def test_own_sample_gives_a_reroll_its_own_clip(tmp_path):
    same = _engine(tmp_path / "s")
    own = _engine(tmp_path / "o", own_sample=1.0)
    src = [e.generate(SRC, seed=107, num_inference_steps=STEPS).frames.astype(np.float32) for e in (same, own)]
    assert np.array_equal(src[0], src[1])
    a = same.generate(SRC, seed=108, num_inference_steps=STEPS, store=False)
    b = own.generate(SRC, seed=108, num_inference_steps=STEPS, store=False)
    assert a.stats.hit and b.stats.hit
    assert np.abs(a.frames - src[0]).mean() < np.abs(b.frames - src[0]).mean()


def _tiered(tmp_path, resume: dict | None, **opts):
    """An engine whose content-only thresholds file is certified (``meta.certified``) at ``resume`` (``meta.resume``)."""
    eng0 = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c0", device="cpu", embedder=hashed_embedder(64))
    path = tmp_path / "tiered.json"
    meta = {"certified": True, **({"resume": resume} if resume else {})}
    Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0).save(
        path, model_id=eng0.model_identity, reading=eng0.policy("carnator").reading(), meta=meta)
    cfg = EngineConfig(admission_judge="test-pass", policy_options={"carnator": {"thresholds": str(path), "probe": "auto", **opts}})
    return Carnator(eng0.pipe, tmp_path / "cache", config=cfg, embedder=hashed_embedder(64), adapter=eng0.adapter)


def test_the_resume_step_is_the_one_the_thresholds_file_is_certified_at_scaled_to_the_schedule(tmp_path):
    # lever 2: certified at step 45 of 50 (and at 30): 45 of 50, round(45 * 32 / 50) = round(28.8) = 29 of 32, 9 of 10
    tier = {"step": 45, "of": 50, "certified_steps": [30, 45]}
    pol = _tiered(tmp_path / "a", tier).policy("carnator")
    assert pol.certified and [pol.resume_at(n) for n in (50, 32, 10)] == [45, 29, 9]
    assert pol.stored_steps(10) == {8, 9}   # a reuse at 9 reads traj.8 and blends with traj.9
    # a file that names no step: 30, whatever the schedule (as before lever 2)
    assert [_tiered(tmp_path / "b", None).policy("carnator").resume_at(n) for n in (50, 32)] == [30, 30]
    # an explicit step wins; one the file was certified at keeps the certificate, another loses it, with the reason
    assert _tiered(tmp_path / "c", tier, resume_step=30).policy("carnator").certified
    other = _tiered(tmp_path / "d", tier, resume_step=40).policy("carnator")
    assert other.resume_at(50) == 40 and not other.certified
    assert "certified at resume steps [30, 45] of 50, not 40" in other.thresholds_source
    with pytest.raises(ValueError, match="resume_step"):
        _tiered(tmp_path / "e", tier, resume_step=0)


def test_a_hit_resumes_at_the_files_step_and_entries_keep_only_the_latents_it_reads(tmp_path):
    eng = _tiered(tmp_path, {"step": 8, "of": 10, "certified_steps": [8]})   # 8 of 10 is 6 of 8
    a = eng.generate(SRC, seed=111, num_inference_steps=STEPS)
    kept = sorted(k for k in eng.store.get(a.stats.entry_id).tensor_names if k.startswith("traj."))
    assert kept == ["traj.5", "traj.6", "traj.7"]
    b = eng.generate("footage of " + SRC + ", 4k", seed=112, num_inference_steps=STEPS, store=False)
    assert b.stats.hit and b.stats.certified and b.stats.resume_step == 6
    assert b.stats.dit_forwards == 2 * (STEPS - 6)   # steps 6 and 7, both guidance branches, no probe


def test_explain_leaves_out_what_was_neither_measured_nor_read():
    from carnator.reuse import explain

    content_only = Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0)
    # a hit under a content-only file: no probe ran (context infinite), the sentence distance measured but not read
    assert explain(Discrepancies(context=math.inf, text=0.18, content=0.0), content_only) == "content 0.00 <= 0.00, text 0.18"
    # an infinite value against a finite threshold is a failed check, and stays
    assert explain(Discrepancies(context=math.inf, content=0.0), Thresholds(1.0, math.inf, math.inf, math.inf, content=0.0)) \
        == "context inf > 1.00, content 0.00 <= 0.00"
