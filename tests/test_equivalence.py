"""Adapters against their own diffusers pipelines, on the offline tiny pipelines.

A dense run through the one loop (``start`` + ``run_steps`` + ``decode``) must equal
``pipe(..., output_type="np")`` for every family and every guidance / scheduler branch; the
adapters' geometry (token grid, bad sizes) and text-token positions are checked against what the
transformer actually receives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carnator.backbones import adapter_for
from carnator.denoise import run_steps, start
from carnator.errors import InvalidRequestError
from carnator.testing import FAMILIES, TINY_SETTINGS, tiny_cogvideox, tiny_hunyuan, tiny_ltx, tiny_pipeline, tiny_wan

PROMPT = "a red ball rolls past a blue cube"
NEGATIVE = "blurry, low quality"
SEED = 3

# Non-default code paths: (family, builder, pipeline options that the adapter exposes under the same names).
VARIANTS = {
    "wan-ti2v": ("wan", lambda: tiny_wan(0, expand_timesteps=True), {}),
    "ltx-rescale-noisy-decode": (
        "ltx",
        lambda: tiny_ltx(0, timestep_conditioning=True),
        dict(guidance_rescale=0.7, decode_timestep=0.05, decode_noise_scale=0.025),
    ),
    "hunyuan-true-cfg": ("hunyuan", tiny_hunyuan, dict(true_cfg_scale=3.0)),
    "cogvideox-1.5-dpm-dynamic-cfg": ("cogvideox", lambda: tiny_cogvideox(0, patch_size_t=2, scheduler="dpm"), dict(use_dynamic_cfg=True)),
}


def _pipeline_video(pipe, settings, options=None, prompt=PROMPT):
    gen = torch.Generator("cpu").manual_seed(SEED)
    return pipe(prompt, negative_prompt=NEGATIVE, generator=gen, output_type="np", **settings, **(options or {})).frames[0]


def _our_video(pipe, settings, options=None, prompt=PROMPT):
    ad = adapter_for(pipe)
    for name, value in (options or {}).items():
        assert hasattr(ad, name), f"{type(ad).__name__} has no option {name}"
        setattr(ad, name, value)
    req = ad.resolve(prompt, seed=SEED, negative_prompt=NEGATIVE, **settings)
    cond = ad.encode(req)
    st = start(ad, req)
    run_steps(ad, st, cond, req)
    return ad.decode(st.latents, req), st, cond


def _assert_same(ours: np.ndarray, ref: np.ndarray, settings: dict) -> None:
    f, h, w = settings["num_frames"], settings["height"], settings["width"]
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (f, h, w, 3)
    # The tiny models must not saturate, or equality would be vacuous.
    assert ((ref > 0) & (ref < 1)).mean() > 0.3 and ref.std() > 0.01
    assert float(np.abs(ours - ref).max()) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_run_equals_pipeline(family):
    settings = TINY_SETTINGS[family]
    ref = _pipeline_video(tiny_pipeline(family, 0), settings)
    ours, st, cond = _our_video(tiny_pipeline(family, 0), settings)
    _assert_same(ours, ref, settings)
    assert st.next_step == settings["num_inference_steps"]
    # Every tiny setting but HunyuanVideo's (distilled guidance, no true CFG) runs both CFG branches.
    assert cond.do_cfg == (family != "hunyuan")
    assert st.dit_forwards == settings["num_inference_steps"] * (2 if cond.do_cfg else 1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_equals_pipeline(variant):
    family, build, options = VARIANTS[variant]
    settings = TINY_SETTINGS[family]
    ref = _pipeline_video(build(), settings, options)
    ours, _, _ = _our_video(build(), settings, options)
    _assert_same(ours, ref, settings)
    if options:  # the options really change the result, so the branch was exercised
        plain, _, _ = _our_video(build(), settings)
        assert float(np.abs(plain - ref).max()) > 1e-4


def test_no_cfg_branch_equals_pipeline():
    settings = dict(TINY_SETTINGS["cogvideox"], guidance_scale=1.0)
    ref = _pipeline_video(tiny_pipeline("cogvideox"), settings)
    ours, st, cond = _our_video(tiny_pipeline("cogvideox"), settings)
    assert not cond.do_cfg and st.dit_forwards == settings["num_inference_steps"]
    _assert_same(ours, ref, settings)


def _keep(store: dict, key: str, value) -> None:
    """Record the first value seen (hooks must return None)."""
    store.setdefault(key, value)


def _grab_text_len(store: dict):
    """A transformer pre-hook recording the length of the text sequence it is given."""

    def hook(module, args, kwargs):
        _keep(store, "text_len", kwargs["encoder_hidden_states"].shape[1])

    return hook


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_from_trajectory_equals_dense(family):
    """Resuming from a captured latent (``seek``) finishes exactly like the dense run (deterministic samplers)."""
    settings, k = TINY_SETTINGS[family], 1
    ad = adapter_for(tiny_pipeline(family))
    req = ad.resolve(PROMPT, seed=SEED, negative_prompt=NEGATIVE, **settings)
    cond = ad.encode(req)
    dense = run_steps(ad, start(ad, req), cond, req, capture={k - 1})
    st = start(ad, req)
    st.latents, st.next_step = dense.trajectory[k - 1].clone(), k
    ad.seek(st.scheduler, k)
    run_steps(ad, st, cond, req)
    assert float((st.latents - dense.latents).abs().max()) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_model_identity_is_stable_and_weight_sensitive(family):
    same = [adapter_for(tiny_pipeline(family, 0)).model_identity() for _ in range(2)]
    other = adapter_for(tiny_pipeline(family, 1)).model_identity()
    assert same[0] == same[1] != other and same[0].startswith(family)


# ---- geometry ---------------------------------------------------------------------------------------
def _visual_tokens(family: str, out, text_len: int) -> int | tuple[int, ...]:
    """Visual tokens made by each transformer's patch embedding (a grid where the output keeps it)."""
    if family == "wan":  # Conv3d output (B, C, T, H, W)
        return tuple(out.shape[2:])
    if family == "cogvideox":  # text tokens first, then the video tokens
        return out.shape[1] - text_len
    return out.shape[1]  # (B, tokens, C)


PATCH_EMBED = {"wan": "patch_embedding", "ltx": "proj_in", "hunyuan": "x_embedder", "cogvideox": "patch_embed"}

GRID_CASES = {  # non-square sizes and frame counts, so swapped axes would show
    "wan": (lambda: tiny_pipeline("wan"), "wan", dict(num_frames=13, height=32, width=48)),
    "ltx": (lambda: tiny_pipeline("ltx"), "ltx", dict(num_frames=13, height=32, width=64)),
    "hunyuan": (lambda: tiny_pipeline("hunyuan"), "hunyuan", dict(num_frames=13, height=32, width=48)),
    "cogvideox": (lambda: tiny_pipeline("cogvideox"), "cogvideox", dict(num_frames=13, height=32, width=48)),
    # 9 frames = 3 latent frames, padded to 4 for patch_size_t=2
    "cogvideox-1.5": (lambda: tiny_cogvideox(0, patch_size_t=2), "cogvideox", dict(num_frames=9, height=32, width=32)),
}


@pytest.mark.parametrize("case", sorted(GRID_CASES))
def test_token_grid_matches_transformer(case):
    build, family, geometry = GRID_CASES[case]
    pipe = build()
    ad = adapter_for(pipe)
    req = ad.resolve(PROMPT, seed=0, num_inference_steps=2, guidance_scale=1.0, **geometry)
    seen = {}
    h1 = getattr(pipe.transformer, PATCH_EMBED[family]).register_forward_hook(lambda m, a, out: _keep(seen, "out", out))
    h2 = pipe.transformer.register_forward_pre_hook(_grab_text_len(seen), with_kwargs=True)
    try:
        cond = ad.encode(req)
        st = start(ad, req)
        run_steps(ad, st, cond, req, stop=1)
    finally:
        h1.remove()
        h2.remove()
    grid = ad.token_grid(req)
    got = _visual_tokens(family, seen["out"], seen["text_len"])
    assert got == (grid if isinstance(got, tuple) else int(np.prod(grid)))
    # And the grid is the latent grid divided by the patch sizes.
    cfg, lat = pipe.transformer.config, st.latents
    if family == "ltx":  # packed (B, tokens, C)
        assert lat.shape[1] == int(np.prod(grid))
    elif family == "cogvideox":  # (B, T, C, H, W)
        assert grid == (lat.shape[1] // (cfg.patch_size_t or 1), lat.shape[3] // cfg.patch_size, lat.shape[4] // cfg.patch_size)
    else:  # (B, C, T, H, W)
        pt, ph, pw = cfg.patch_size if family == "wan" else (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
        assert grid == (lat.shape[2] // pt, lat.shape[3] // ph, lat.shape[4] // pw)


BAD_GEOMETRY = {
    "wan": [dict(num_frames=10), dict(height=40)],
    "ltx": [dict(num_frames=10), dict(height=48)],  # LTXPipeline wants multiples of 32
    "hunyuan": [dict(num_frames=11), dict(width=40)],
    "cogvideox": [dict(num_frames=12), dict(height=40)],  # 40 passes check_inputs (8) but not 2x2 patching
}


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_geometry_is_refused(family):
    ad = adapter_for(tiny_pipeline(family))
    ad.resolve(PROMPT, seed=0, **TINY_SETTINGS[family])  # the tiny settings themselves are fine
    for bad in BAD_GEOMETRY[family]:
        with pytest.raises(InvalidRequestError) as err:
            ad.resolve(PROMPT, seed=0, **{**TINY_SETTINGS[family], **bad})
        msg = str(err.value)
        assert "\n" not in msg and str(next(iter(bad.values()))) in msg


def test_cogvideox_15_refuses_sizes_beyond_its_rotary_table():
    ad = adapter_for(tiny_cogvideox(0, patch_size_t=2))
    with pytest.raises(InvalidRequestError):
        ad.resolve(PROMPT, seed=0, **{**TINY_SETTINGS["cogvideox"], "height": 64, "width": 64})


# ---- text -------------------------------------------------------------------------------------------
def _find(seq: list[int], sub: list[int]) -> int:
    for k in range(len(seq) - len(sub) + 1):
        if seq[k : k + len(sub)] == sub:
            return k
    raise AssertionError("prompt bytes not found in the token ids")


@pytest.mark.parametrize("family", FAMILIES)
def test_word_token_positions(family):
    pipe = tiny_pipeline(family)
    ad = adapter_for(pipe)
    prompt = "A red Ball, then a balloon and a ball"
    ids = ad.prompt_token_ids(prompt)
    pos = ad.word_token_positions(prompt, "ball")
    # Byte tokenizer: id = 3 + byte, so the prompt's bytes sit at a known offset k in the ids.
    k = _find(ids, [3 + b for b in prompt.encode()])
    first, last = prompt.index("Ball"), prompt.rindex("ball")
    assert pos == [k + first + j for j in range(4)] + [k + last + j for j in range(4)]  # not "balloon"
    assert [ids[p] for p in pos] == [3 + b for b in b"Ballball"]
    assert ad.word_token_positions(prompt, "cat") == []
    # with its modifier: "red Ball" (the space between is a token of the span too); the last "ball" has none
    assert ad.word_token_positions(prompt, "ball", 2) == [k + first - 4 + j for j in range(8)] + [k + last + j for j in range(4)]

    # The ids are the ones the transformer's text sequence is made of (after any template crop).
    seen = {}

    def grab_ids(m, args, kw):
        _keep(seen, "ids", (args[0] if args else kw["input_ids"])[0].tolist())

    h1 = pipe.text_encoder.register_forward_pre_hook(grab_ids, with_kwargs=True)
    h2 = pipe.transformer.register_forward_pre_hook(_grab_text_len(seen), with_kwargs=True)
    try:
        req = ad.resolve(prompt, seed=0, **{**TINY_SETTINGS[family], "num_inference_steps": 1, "guidance_scale": 1.0})
        cond = ad.encode(req)
        run_steps(ad, start(ad, req), cond, req)
    finally:
        h1.remove()
        h2.remove()
    crop = len(seen["ids"]) - seen["text_len"]
    assert seen["ids"][crop : crop + len(ids)] == ids


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_reaches_transformer(family):
    ad = adapter_for(tiny_pipeline(family))
    settings = TINY_SETTINGS[family]
    preds = []
    for prompt in (PROMPT, PROMPT.replace("red", "green")):
        req = ad.resolve(prompt, seed=SEED, **settings)
        cond = ad.encode(req)
        st = start(ad, req)
        preds.append(ad.predict(st.latents, st.timesteps[0], 0, cond, req))
    assert float((preds[0] - preds[1]).abs().max()) > 1e-6
