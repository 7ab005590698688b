"""The chorus baseline: prompt diff, regions, TGAA and the three stages on the embedded and tiny Wan models."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from carnator import Carnator, EngineConfig, denoise
from carnator.attention.state import Amplification, AttentionPlan, AttentionSession, StepAttention, attention_step
from carnator.policies.baselines import TextGate
from carnator.policies.chorus import (
    XATTN_PREFIX,
    ChorusConfig,
    ChorusPolicy,
    attributes,
    prompt_diff,
    prompt_words,
)
from carnator.reuse import cross_attention_region, reuse_scope, upsample_tokens
from carnator.signature.nouns import extract_nouns
from carnator.testing import TINY_SETTINGS, hashed_embedder, tiny_pipeline

RED = "a small red ball moving left on grass"
BLUE = "a small blue ball moving left on grass"
STEPS = 10  # stages: [0, 3) from the source, [3, 8) region recompute + TGAA, [8, 10) full


# ---- prompt diff --------------------------------------------------------------------------------------


def test_attributes_are_the_adjective_run_before_each_noun():
    assert attributes("a big blue box and a tiny green star on grass", ["box", "star", "grass"]) == {
        "box": {"big", "blue"}, "star": {"tiny", "green"}, "grass": set()}
    assert attributes("on a snowy slope, a ball rises", ["slope", "ball"]) == {"slope": {"snowy"}, "ball": set()}
    assert prompt_words("a big blue box on grass", ["box", "grass"]) == ["big", "blue", "box", "grass"]


@pytest.mark.parametrize(
    "target,source,t_tokens,s_tokens,t_region,s_region",
    [
        # noun substitution: the carried-over attributes do not differ
        (BLUE.replace("blue ball", "red box"), RED, ["box"], ["ball"], ["box"], ["ball"]),
        # attribute change on a shared noun: the noun joins the region
        (BLUE, RED, ["blue"], ["red"], ["blue", "ball"], ["red", "ball"]),
        # everything about the object changes
        ("a big blue box", "a small red ball", ["box", "big", "blue"], ["ball", "red", "small"], ["box", "big", "blue"], ["ball", "red", "small"]),
        # the paper's example: a new object and a new context attribute
        ("a peach on a snowy mountain", "an apple on a mountain", ["peach", "snowy"], ["apple"], ["peach", "snowy", "mountain"], ["apple", "mountain"]),
        # an attribute dropped: the object still gets recomputed on both sides
        ("a ball on grass", "a red ball on grass", [], ["red"], ["ball"], ["red", "ball"]),
        (RED, RED, [], [], [], []),
        # verbs are not part of the diff
        (RED.replace("left", "right"), RED, [], [], [], []),
    ],
)
def test_prompt_diff(target, source, t_tokens, s_tokens, t_region, s_region):
    d = prompt_diff(target, source, extract_nouns(target), extract_nouns(source))
    assert d.target_tokens == t_tokens and d.source_tokens == s_tokens
    assert d.target_region_words == t_region and d.source_region_words == s_region
    assert d.empty == (not t_tokens and not s_tokens)


def test_stages_and_config_checks():
    assert ChorusConfig().stages(50) == (15, 40)
    assert ChorusConfig().stages(STEPS) == (3, 8)
    assert ChorusConfig().stages(1) == (1, 1)
    for bad in ({"stage1_end": 0.9, "stage3_start": 0.5}, {"tgaa_scale": 0.0}, {"region_low": 0.6}):
        with pytest.raises(ValueError):
            ChorusConfig(**bad)


def test_cross_attention_region_known_answer():
    grid = (2, 4, 4)
    c = np.zeros(grid, dtype=np.float32)
    c[0, 1:3, 1:3] = 1.0  # the object
    c[0, 1, 3] = 0.4  # touches it, above low: grows in
    c[1, 3, 3] = 0.4  # above low but not connected to a seed: stays out
    want = np.zeros(grid, dtype=bool)
    want[0, 1:3, 1:3] = True
    want[0, 1, 3] = True
    np.testing.assert_array_equal(cross_attention_region(c.reshape(-1), grid), want)
    assert not cross_attention_region(np.ones(32), grid).any()  # a flat response localises nothing


# ---- TGAA -----------------------------------------------------------------------------------------------


def test_cross_bias_multiplies_the_weights_of_the_amplified_tokens():
    ctrl = StepAttention(AttentionPlan(amplify=Amplification((1, 3), 3.0)), AttentionSession(), 4, branches=(0, 1))
    bias = ctrl.cross_bias(5, "cpu", torch.float32)
    assert bias.shape == (2, 1, 1, 5)
    assert torch.equal(bias[1], torch.zeros(1, 1, 5))  # the uncond branch is untouched
    logits = torch.randn(5)
    p, q = torch.softmax(logits, -1), torch.softmax(logits + bias[0, 0, 0], -1)
    w = p * torch.tensor([1.0, 3.0, 1.0, 3.0, 1.0])
    torch.testing.assert_close(q, w / w.sum())
    plain = StepAttention(AttentionPlan(amplify=Amplification((1, 3), 1.0)), AttentionSession(), 4, branches=(0, 1))
    assert plain.cross_bias(5, "cpu", torch.float32) is None  # scale 1: the plain kernel
    assert StepAttention(AttentionPlan(), AttentionSession(), 4, branches=(0, 1)).cross_bias(5, "cpu", torch.float32) is None


def test_tgaa_scale_one_is_exactly_no_amplification_on_tiny_wan(tmp_path):
    eng = Carnator(tiny_pipeline("wan"), tmp_path, embedder=hashed_embedder(64))
    ad = eng.adapter
    ad.ensure_attention()
    req = ad.resolve("a red ball on grass", seed=0, **TINY_SETTINGS["wan"])
    cond = ad.encode(req)
    st = denoise.start(ad, req)
    pos = ad.word_token_positions(req.prompt, "red")
    assert len(pos) == 3  # byte-level tokens of "red"

    def predict(amp):
        with attention_step(AttentionPlan(amplify=amp), AttentionSession(), 0):
            return ad.predict(st.latents, st.timesteps[0], 0, cond, req)

    plain = predict(None)
    assert torch.equal(predict(Amplification(tuple(pos), 1.0)), plain)
    assert not torch.allclose(predict(Amplification(tuple(pos), 4.0)), plain)


# ---- the policy end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_pipe(tmp_path_factory):
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path_factory.mktemp("c0"), device="cpu", embedder=hashed_embedder(64))
    return eng.pipe, eng.adapter


def _engine(embedded_pipe, root, capture_steps="auto", **opts):
    pipe, adapter = embedded_pipe
    return Carnator(pipe, root, config=EngineConfig(policy_options={"chorus": opts}, capture_steps=capture_steps), embedder=hashed_embedder(64), adapter=adapter)


def test_chorus_three_stages_on_the_embedded_model(embedded_pipe, tmp_path):
    eng = _engine(embedded_pipe, tmp_path / "c", capture_steps="all")  # stage 3's latents are compared below
    a = eng.generate(RED, seed=1, policy="chorus", num_inference_steps=STEPS)
    assert not a.stats.hit and a.stats.dit_forwards == 2 * STEPS
    ea = eng.store.load(a.stats.entry_id)
    assert {k for k in ea if k.startswith(XATTN_PREFIX)} == {XATTN_PREFIX + w for w in ("small", "red", "ball", "grass")}
    assert eng.store.get(a.stats.entry_id).extra["chorus"] == {"record_step": 3, "record_layer": 3}

    b = eng.generate(BLUE, seed=2, policy="chorus", num_inference_steps=STEPS)
    s = b.stats
    assert s.hit and s.source_id == a.stats.entry_id and s.resume_step == 3
    assert s.dit_forwards == 2 * (STEPS - 3)
    assert s.notes["diff"] == {"target": ["blue"], "source": ["red"]} and s.notes["localized"]
    eb = eng.store.load(s.entry_id)

    # The region, recomputed from the stored responses: the target's blue and ball (recorded by this
    # request at step 3) and the source's red and ball (recorded by the source at step 3).
    grid = eng.adapter.token_grid(b.request)
    masks = [cross_attention_region(e[XATTN_PREFIX + w], grid) for e, w in ((eb, "blue"), (eb, "ball"), (ea, "red"), (ea, "ball"))]
    scope = reuse_scope(masks)
    assert s.active_fraction == pytest.approx(scope.active_fraction)
    assert 0 < scope.active_fraction < 1
    patch = tuple(int(x // g) for x, g in zip(ea["traj.0"].shape[2:], grid))
    outside = torch.from_numpy(upsample_tokens(scope.weight, patch) == 0)  # (T, H, W) latent positions with W = 0

    def same(i):
        return (eb[f"traj.{i}"] == ea[f"traj.{i}"]).all(dim=1)[0]

    for i in range(3, 8):  # stage 2: the source's latent outside the region, exactly; recomputed inside
        assert same(i)[outside].all() and not same(i).all()
    assert not same(8)[outside].any()  # stage 3 runs every token


def test_tgaa_scale_changes_the_hit_and_scale_one_does_not_amplify(embedded_pipe, tmp_path):
    outs = {}
    for scale in (1.0, 1.0, 4.0):
        eng = _engine(embedded_pipe, tmp_path / f"c{scale}{len(outs)}", tgaa_scale=scale)
        eng.generate(RED, seed=1, policy="chorus", num_inference_steps=STEPS)
        b = eng.generate(BLUE, seed=2, policy="chorus", num_inference_steps=STEPS)
        assert b.stats.hit and b.stats.notes["amplified_tokens"] == 1
        outs.setdefault(scale, []).append(b.frames)
    assert np.array_equal(*outs[1.0])  # deterministic
    assert not np.array_equal(outs[1.0][0], outs[4.0][0])


def test_identical_nouns_and_attributes_skip_to_stage_three_and_unrelated_prompts_miss(embedded_pipe, tmp_path):
    eng = _engine(embedded_pipe, tmp_path / "c")
    a = eng.generate(RED, seed=1, policy="chorus", num_inference_steps=STEPS)
    b = eng.generate(RED, seed=2, policy="chorus", num_inference_steps=STEPS)  # re-roll: nothing to recompute locally
    assert b.stats.hit and b.stats.resume_step == 8 and b.stats.dit_forwards == 2 * 2
    assert b.stats.source_id == a.stats.entry_id
    c = eng.generate("a big star falling in the snow", seed=3, policy="chorus", num_inference_steps=STEPS)
    assert not c.stats.hit and c.stats.dit_forwards == 2 * STEPS


def test_chorus_hits_on_tiny_wan(tmp_path):
    eng = Carnator(tiny_pipeline("wan"), tmp_path, embedder=hashed_embedder(64))
    st = dict(TINY_SETTINGS["wan"], num_inference_steps=8, height=64, width=64)
    a = eng.generate("a red ball on grass", seed=1, policy="chorus", **st)
    b = eng.generate("a blue ball on grass", seed=2, policy="chorus", **st)
    assert not a.stats.hit and b.stats.hit and b.stats.resume_step == 2
    assert b.stats.dit_forwards == 2 * (8 - 2) and b.stats.notes["amplified_tokens"] == 4  # bytes of "blue"


def test_shares_the_text_gate_and_falls_back_to_dense_without_attention(caplog, tmp_path):
    pol = ChorusPolicy()
    assert type(pol.gate) is TextGate and pol.gate == TextGate() and pol.needs_attention
    assert math.isclose(ChorusPolicy(tgaa_scale=3.0).cfg.tgaa_scale, 3.0)
    eng = Carnator(tiny_pipeline("wan"), tmp_path, embedder=hashed_embedder(64))
    type(eng.adapter).supports_attention = False  # a family without carnator's processors
    try:
        with caplog.at_level(logging.WARNING, logger="carnator"):
            a = eng.generate("a red ball on grass", seed=1, policy="chorus", **TINY_SETTINGS["wan"])
            b = eng.generate("a blue ball on grass", seed=2, policy="chorus", **TINY_SETTINGS["wan"])
    finally:
        type(eng.adapter).supports_attention = True
    assert not a.stats.hit and not b.stats.hit and b.stats.notes["fallback"] == "dense"
    assert sum("chorus" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert not any(k.startswith(XATTN_PREFIX) for k in eng.store.get(a.stats.entry_id).tensor_names)
