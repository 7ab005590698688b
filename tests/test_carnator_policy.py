"""The carnator policy end to end on the embedded model (short schedules to keep CPU time small)."""

from __future__ import annotations

import math

import pytest

from carnator import Carnator, EngineConfig
from carnator.recall.embedder import TextEmbedder
from carnator.errors import CarnatorError
from carnator.reuse import Thresholds
from carnator.testing import hashed_embedder

STEPS, RESUME = 8, 5


def bag_of_words_embedder() -> TextEmbedder:
    return hashed_embedder(64)


def make_engine(tmp_path, tau: Thresholds | None, **opts) -> Carnator:
    eng0 = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "c0", device="cpu", embedder=bag_of_words_embedder())
    path = None
    if tau is not None:
        path = tmp_path / "tau.json"
        tau.save(path, model_id=eng0.model_identity)
    # Masks captured and applied on the CPU too (SparseConfig.apply "auto" would skip them there), unless a test says.
    opts = {"sparse": {"apply": "always"}, **opts}
    cfg = EngineConfig(policy_options={"carnator": {"resume_step": RESUME, "thresholds": None if path is None else str(path), **opts}})
    return Carnator(eng0.pipe, tmp_path / "cache", config=cfg, embedder=bag_of_words_embedder(), adapter=eng0.adapter)


OPEN = Thresholds(context=math.inf, size=math.inf, shape=math.inf, color=math.inf)


@pytest.mark.slow
def test_hit_resumes_and_keeps_cached_latent_outside_active(tmp_path):
    eng = make_engine(tmp_path, OPEN)
    a = eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
    assert not a.stats.hit and a.stats.notes["candidates"] == 0
    entry = eng.store.load(a.stats.entry_id)
    assert any(k.startswith("attn.") for k in entry) and any(k.startswith("evidence.") for k in entry)
    assert set(eng.store.get(a.stats.entry_id).extra["nouns"]) == {"ball", "grass"}

    b = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
    s = b.stats
    assert s.hit and s.source_id == a.stats.entry_id and s.resume_step == RESUME
    # 4 probe steps + the steps from the resume step on, two CFG branches each.
    assert s.dit_forwards == 2 * (4 + STEPS - RESUME)
    assert 0 < s.active_fraction <= 1 and 0 < s.mask_density <= 1
    # Outside the Active region the blend weight is 0: the final latent is the source's, exactly.
    final_b = eng.store.load(s.entry_id)[f"traj.{STEPS - 1}"]
    final_a = entry[f"traj.{STEPS - 1}"]
    same = (final_b == final_a).all(dim=1)[0]  # (T, H, W) latent positions identical in every channel
    assert same.float().mean() >= 1 - s.active_fraction - 1e-6
    assert not same.all()

    # The request's signature is in its stats, equal to the one stored with its entry; with the source entry's it gives
    # back the discrepancies the decision saw (what calibration rows rely on to re-evaluate them offline).
    from carnator.reuse import discrepancies, noun_diff
    from carnator.signature import EarlySignature

    assert a.stats.notes["signature"] == eng.store.get(a.stats.entry_id).extra["signature"]
    assert s.notes["signature"] == eng.store.get(s.entry_id).extra["signature"]
    sig_b, sig_a = EarlySignature.from_dict(s.notes["signature"]), EarlySignature.from_dict(a.stats.notes["signature"])
    assert set(sig_b) == {"box", "grass"}
    d = discrepancies(sig_b, sig_a, noun_diff(["box", "grass"], ["ball", "grass"]))
    got = s.notes["discrepancies"]
    for k in ("context", "size", "shape", "color"):
        assert getattr(d, k) == pytest.approx(got[k])


@pytest.mark.parametrize("dilation, high, windowed", [(0, 0.9, True), (8, 0.1, False)])
def test_the_window_exists_only_when_the_active_region_is_partial(tmp_path, dilation, high, windowed):
    """With the Active region covering every token (8 x 8 token frames, dilation 8, a region in every latent
    frame) the middle-layer window would recompute everything through a gather/scatter: the plan has none,
    and every layer runs in full."""
    from carnator.reuse import ScopeConfig
    from carnator.signature.regions import RegionConfig

    eng = make_engine(tmp_path, OPEN, scope=ScopeConfig(active_dilation=dilation, context_dilation=1),
                      region=RegionConfig(high=high, low=min(0.8, high / 2)))
    eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
    from carnator.attention.state import current

    seen = []
    h = eng.pipe.transformer.register_forward_pre_hook(lambda m, a: seen.append(current().window is not None))
    try:
        b = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
    finally:
        h.remove()
    assert b.stats.hit and (b.stats.active_fraction < 1) == windowed
    # One forward per step (the embedded model batches both CFG branches): the 4 probe steps run without a
    # window; from the resume step on, the plan's.
    assert seen == [False] * 4 + [windowed] * (STEPS - RESUME)


@pytest.mark.slow
def test_noun_filter_and_tight_thresholds_give_misses(tmp_path):
    eng = make_engine(tmp_path, Thresholds(context=-1.0, size=-1.0, shape=-1.0, color=-1.0))
    eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
    # Two nouns differ (ball->box, grass->snow): the noun filter drops the candidate.
    r = eng.generate("a small red box moving left on snow", seed=2, num_inference_steps=STEPS)
    assert not r.stats.hit and r.stats.notes["candidates"] == 0
    # One noun differs: recalled, but no threshold admits it.
    r = eng.generate("a small red box moving left on grass", seed=3, num_inference_steps=STEPS)
    assert not r.stats.hit and r.stats.notes["candidates"] >= 1
    assert r.stats.dit_forwards == 2 * STEPS


def test_threshold_file_of_another_model_is_refused(tmp_path):
    path = tmp_path / "tau.json"
    Thresholds().save(path, model_id="some-other-model")
    with pytest.raises(CarnatorError):
        Thresholds.load(path, model_id="embedded-0000")


def test_threshold_file_read_another_way_is_refused(tmp_path):
    """A file records the reading it was calibrated under; a policy that reads signatures otherwise refuses an explicit
    file, and falls back to the paper's thresholds (with a warning) when the shipped one does not fit."""
    from carnator.policies.carnator import CarnatorPolicy

    eng = make_engine(tmp_path, None)
    path = tmp_path / "tau1.json"
    calibrated = CarnatorPolicy(modifiers=1)
    tau = Thresholds(context=1.0, size=0.5, shape=0.4, color=5.0, text=0.2)
    tau.save(path, model_id=eng.model_identity, reading=calibrated.reading())
    from carnator.policies import ModelInfo

    model = ModelInfo(eng.model_identity, "embedded")
    pol = CarnatorPolicy(modifiers=1, thresholds=str(path))
    pol.prepare(model)
    assert pol.tau == tau and not pol.certified
    with pytest.raises(CarnatorError, match="modifiers: file 1, policy 0"):
        CarnatorPolicy(modifiers=0, thresholds=str(path)).prepare(model)
    with pytest.raises(CarnatorError, match="region"):
        CarnatorPolicy(modifiers=1, region={"high": 0.5}, thresholds=str(path)).prepare(model)
    # the engine builds its policies when it starts: a bad file fails there, before any request
    with pytest.raises(CarnatorError, match="modifiers"):
        Carnator(eng.pipe, tmp_path / "c2", adapter=eng.adapter, embedder=bag_of_words_embedder(),
                 config=EngineConfig(policy_options={"carnator": {"modifiers": 0, "thresholds": str(path)}}))
    with pytest.raises(CarnatorError, match="does not exist"):
        Carnator(eng.pipe, tmp_path / "c3", adapter=eng.adapter, embedder=bag_of_words_embedder(),
                 config=EngineConfig(policy_options={"carnator": {"thresholds": str(tmp_path / "none.json")}}))


def test_policy_option_flags_are_checked():
    from carnator.cli import _policy_options

    assert _policy_options(["carnator.modifiers=1", "carnator.region={\"high\": 0.4}"]) == {
        "carnator": {"modifiers": 1, "region": {"high": 0.4}}}
    with pytest.raises(CarnatorError, match="does not exist"):  # checked when the policy is built, not at the first candidate
        _policy_options(["carnator.thresholds=/no/such/file.json"])
    for bad, msg in (("carnator.modifiers", "POLICY.FIELD=VALUE"), ("modifiers=1", "POLICY.FIELD=VALUE"),
                     ("nope.modifiers=1", "unknown policy 'nope'"), ("carnator.modifier=1", "its fields: top_k"),
                     ("carnator.modifiers=-1", "integer >= 0")):
        with pytest.raises(CarnatorError, match=msg):
            _policy_options([bad])


def test_unknown_policy_is_a_clear_error(tmp_path):
    eng = make_engine(tmp_path, None)
    with pytest.raises(CarnatorError, match="unknown policy"):
        eng.generate("a red ball", seed=0, policy="nope")


def test_wan_signature_decodes_only_the_tail_latent_frame():
    """The Early Signature's one VAE decode covers the last latent frame alone (not the whole clip)."""
    import numpy as np
    import torch

    from carnator.backbones import adapter_for
    from carnator.testing import tiny_wan

    pipe = tiny_wan()
    ad = adapter_for(pipe)
    req = ad.resolve("a red ball", seed=0, num_frames=9, height=32, width=32, num_inference_steps=2)
    lat = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    calls = []
    h = pipe.vae.decoder.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[2]))
    tail = ad.decode_tail(lat, req)
    h.remove()
    assert tail.shape == (32, 32, 3)
    assert calls == [1]  # one latent frame went through the decoder
    np.testing.assert_allclose(tail, ad.decode(lat[:, :, -1:], req)[-1])
    # Wan's VAE is causal: a prefix decodes exactly as in the whole clip (why one tail frame is a faithful stand-in for its content)
    np.testing.assert_allclose(ad.decode(lat[:, :, :1], req)[0], ad.decode(lat, req)[0], atol=1e-6)


def test_a_reused_video_is_an_exact_hit_for_carnator_but_not_for_dense(tmp_path):
    """An identical request may get the stored video back, except that dense never gets a video made by reuse."""
    eng = make_engine(tmp_path, OPEN)
    a = eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
    b = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
    assert b.stats.hit and eng.store.get(b.stats.entry_id).extra["approximate"] is True
    assert eng.store.get(a.stats.entry_id).extra["approximate"] is False
    again = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
    assert again.stats.exact_hit and again.stats.source_id == b.stats.entry_id
    dense = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS, policy="dense")
    assert not dense.stats.exact_hit and not dense.stats.hit
    assert dense.stats.dit_forwards == 2 * STEPS
    # and a dense video of an identical request is served to dense
    dense2 = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS, policy="dense", cache="exact")
    assert dense2.stats.exact_hit and dense2.stats.source_id == dense.stats.entry_id


@pytest.mark.parametrize("steps", [1, 4])
def test_a_schedule_no_longer_than_the_probe_runs_dense(tmp_path, steps):
    eng = make_engine(tmp_path, OPEN)
    r = eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=steps)
    d = eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=steps, policy="dense", store=False)
    assert not r.stats.hit and r.stats.notes["fallback"] == "dense" and r.stats.dit_forwards == 2 * steps
    assert (r.frames == d.frames).all()


def test_prefetch_reads_the_first_candidate_beside_the_probe_and_changes_nothing(tmp_path):
    """CarnatorConfig.prefetch: the first recalled candidate's entry is read in the prefetch thread while the probe
    runs, and the hit built on it is bit-identical to one that reads it after the decision (prefetch off)."""
    import threading

    import numpy as np

    results = {}
    for prefetch in (True, False):
        eng = make_engine(tmp_path / str(prefetch), OPEN, prefetch=prefetch)
        eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
        loads, load = [], eng.store.load
        eng.store.load = lambda entry_id, *a, **k: loads.append(threading.current_thread().name) or load(entry_id, *a, **k)
        b = eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
        assert b.stats.hit
        assert [n.startswith("carnator-prefetch") for n in loads] == [prefetch]
        results[prefetch] = b.frames
    assert np.array_equal(results[True], results[False])


def test_uncertified_reuse_is_refused_when_the_engine_requires_certificates(tmp_path):
    """``EngineConfig(allow_uncertified=False)`` (the service's default): a reuse that only an uncalibrated thresholds
    file accepts is a miss with the reason; with the shipped certified file a re-roll still hits, and exact hits stay."""
    import dataclasses

    eng = make_engine(tmp_path, OPEN)  # a thresholds file without a certificate
    strict = Carnator(eng.pipe, tmp_path / "strict", adapter=eng.adapter, embedder=bag_of_words_embedder(),
                      config=dataclasses.replace(eng.config, allow_uncertified=False))
    strict.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS)
    b = strict.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS)
    assert not b.stats.hit and "no certified thresholds" in b.stats.reason and b.stats.notes["uncertified"]
    assert eng.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS).stats.hit is False
    assert eng.generate("a small red box moving left on grass", seed=2, num_inference_steps=STEPS).stats.certified is False
    assert strict.generate("a small red ball moving left on grass", seed=1, num_inference_steps=STEPS).stats.exact_hit
    shipped = Carnator(eng.pipe, tmp_path / "shipped", adapter=eng.adapter, embedder=bag_of_words_embedder(),
                       config=EngineConfig(allow_uncertified=False, admission_judge=None))  # every source admitted
    assert shipped.policy("carnator").certified
    shipped.generate("a small red ball moving left on grass", seed=1)
    r = shipped.generate("a small red ball moving left on grass", seed=5)
    assert r.stats.hit and r.stats.certified is True, r.stats.reason
