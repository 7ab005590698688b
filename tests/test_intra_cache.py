"""diffusers' intra-request caches as peers of the policies (EngineConfig.intra_cache), alone and composed.

Known answers: which modules really ran (counted with forward hooks on modules *inside* the hooked
blocks/attention layers, which a skipped call never reaches), exact equality where nothing is skipped,
and fresh-engine equality where the per-request state must have been reset.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from carnator.reuse import ScopeConfig
from carnator import Carnator, EngineConfig
from carnator.cli import main
from carnator.errors import CarnatorError
from carnator.backbones.intra_cache import IntraCacheSpec, supported_kinds
from carnator.reuse import Thresholds
from carnator.testing import TINY_SETTINGS, hashed_embedder, tiny_pipeline

PROMPT = "a small red ball moving left on grass"
STEPS = 6


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    # FasterCache logs an "experimental" warning on every enable; keep test output readable.
    lg = logging.getLogger("diffusers")
    old = lg.level
    lg.setLevel(logging.ERROR)
    yield
    lg.setLevel(old)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    return Carnator.from_pretrained("embedded", cache_dir=tmp_path_factory.mktemp("base"), device="cpu", embedder=hashed_embedder(64))


@pytest.fixture(scope="module")
def tiny():
    return {f: tiny_pipeline(f) for f in ("wan", "hunyuan", "ltx", "cogvideox")}


def engine(base_or_pipe, tmp_path, intra=None, name="c", **cfg) -> Carnator:
    if isinstance(base_or_pipe, Carnator):
        return Carnator(base_or_pipe.pipe, tmp_path / name, adapter=base_or_pipe.adapter, embedder=hashed_embedder(64),
                        config=EngineConfig(intra_cache=intra, **cfg))
    return Carnator(base_or_pipe, tmp_path / name, embedder=hashed_embedder(64), config=EngineConfig(intra_cache=intra, **cfg))


def settings(family: str, steps: int = STEPS) -> dict:
    if family == "embedded":
        return {"num_inference_steps": steps}
    return dict(TINY_SETTINGS[family], num_inference_steps=steps)


def gen(eng: Carnator, family: str = "embedded", steps: int = STEPS, prompt: str = PROMPT, seed: int = 1, **kw):
    return eng.generate(prompt, seed=seed, policy=kw.pop("policy", "dense"), store=kw.pop("store", False), **settings(family, steps), **kw)


@contextmanager
def calls(root: torch.nn.Module, *names: str):
    """Count forwards of the named submodules of ``root``; yields {name: count}."""
    counts = dict.fromkeys(names, 0)
    mods = dict(root.named_modules())
    handles = []
    for n in names:
        def hook(module, args, output, n=n):
            counts[n] += 1
        handles.append(mods[n].register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def batch_sizes(module: torch.nn.Module):
    """A forward pre-hook recording the batch of every call of ``module``; returns (sizes, handle)."""
    sizes: list[int] = []

    def pre(mod, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        sizes.append(int(x.shape[0]))

    return sizes, module.register_forward_pre_hook(pre, with_kwargs=True)


# ---- FirstBlockCache --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["embedded", "wan", "hunyuan"])
def test_first_block_threshold_zero_is_dense_exactly(family, embedded, tiny, tmp_path):
    base = embedded if family == "embedded" else tiny[family]
    dense = gen(engine(base, tmp_path, None, "d"), family)
    fbc = gen(engine(base, tmp_path, "first_block:threshold=0", "f"), family)
    assert np.array_equal(fbc.video, dense.video)
    assert fbc.stats.notes["intra_cache"] == {"kind": "first_block", "options": {"threshold": 0.0}, "resets": 1}
    assert "intra_cache" not in dense.stats.notes


def test_first_block_huge_threshold_runs_later_blocks_on_the_first_step_only(embedded, tmp_path):
    tr = embedded.pipe.transformer
    last = len(tr.blocks) - 1
    eng = engine(embedded, tmp_path, {"kind": "first_block", "threshold": 1e9})
    with calls(tr, "blocks.0.ffn", "blocks.1.ffn", f"blocks.{last}.ffn") as n:
        r = gen(eng)
    # One batched (cond, uncond) forward per step: the first block decides at every step; the rest run at step 0.
    assert n == {"blocks.0.ffn": STEPS, "blocks.1.ffn": 1, f"blocks.{last}.ffn": 1}
    dense = gen(engine(embedded, tmp_path, None, "d"))
    assert float(np.abs(r.video - dense.video).max()) > 1e-3


def test_first_block_keeps_one_state_per_cfg_branch(tiny, tmp_path):
    """Wan runs cond and uncond as two forwards, each in its own cache_context: each branch's first step is full."""
    tr = tiny["wan"].transformer
    eng = engine(tiny["wan"], tmp_path, "first_block:threshold=1e9")
    with calls(tr, "blocks.0.ffn", "blocks.1.ffn") as n:
        gen(eng, "wan")
    assert n == {"blocks.0.ffn": 2 * STEPS, "blocks.1.ffn": 2}


def test_state_is_reset_between_requests(embedded, tmp_path):
    eng = engine(embedded, tmp_path, "first_block:threshold=1e9")
    gen(eng, prompt="a big blue box rising on snow", seed=5)
    with calls(embedded.pipe.transformer, "blocks.1.ffn") as n:
        second = gen(eng)
    fresh = gen(engine(embedded, tmp_path, "first_block:threshold=1e9", "fresh"))
    assert n["blocks.1.ffn"] == 1  # the second request's first step ran in full: nothing of the first one leaked
    assert np.array_equal(second.video, fresh.video)


def test_a_request_that_failed_midway_leaves_no_state(embedded, tmp_path):
    eng = engine(embedded, tmp_path, "first_block:threshold=1e9")

    def stop(done, total):
        if done == 3:
            raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        gen(eng, prompt="a big blue box rising on snow", seed=5, progress=stop)
    fresh = gen(engine(embedded, tmp_path, "first_block:threshold=1e9", "fresh"))
    assert np.array_equal(gen(eng).video, fresh.video)


def test_a_resume_resets_the_state(embedded, tmp_path):
    """After ``adapter.seek`` (a resume from another trajectory's latent) the next forward runs in full."""
    from carnator import denoise

    eng = engine(embedded, tmp_path, "first_block:threshold=1e9")
    ad = eng.adapter
    ad.use_intra_cache(eng.intra_cache_spec).start_request()
    req = ad.resolve(PROMPT, seed=1, num_inference_steps=STEPS)
    cond = ad.encode(req)
    st = denoise.start(ad, req)
    with calls(embedded.pipe.transformer, "blocks.1.ffn") as n:
        denoise.run_steps(ad, st, cond, req, stop=3)
        assert n["blocks.1.ffn"] == 1
        st.latents, st.next_step = torch.randn_like(st.latents), 1
        ad.seek(st.scheduler, 1)
        denoise.run_steps(ad, st, cond, req)
    assert n["blocks.1.ffn"] == 2
    ad.intra_cache.end()


def test_engines_sharing_an_adapter_each_get_their_own_cache(tiny, tmp_path):
    pipe = tiny["wan"]
    plain = Carnator(pipe, tmp_path / "p", embedder=hashed_embedder(64))
    ref = gen(plain, "wan").video
    fbc = engine(pipe, tmp_path, "first_block:threshold=1e9")  # same pipeline, a new adapter on the same transformer
    shared = Carnator(pipe, tmp_path / "s", adapter=fbc.adapter, embedder=hashed_embedder(64))
    skipped = gen(fbc, "wan").video
    assert np.array_equal(gen(shared, "wan").video, ref)  # same adapter, no intra cache: the hooks come off
    assert np.array_equal(gen(fbc, "wan").video, skipped)
    assert np.array_equal(gen(plain, "wan").video, ref)  # another adapter over the same transformer: likewise
    assert not np.array_equal(skipped, ref)


def test_intra_cache_is_part_of_the_cache_keys(embedded, tmp_path):
    plain = Carnator(embedded.pipe, tmp_path / "one", adapter=embedded.adapter, embedder=hashed_embedder(64))
    fbc = Carnator(embedded.pipe, plain.store, adapter=embedded.adapter, embedder=hashed_embedder(64), config=EngineConfig(intra_cache="first_block"))
    gen(plain, steps=2, store=True, cache="exact")
    r = gen(fbc, steps=2, store=True, cache="exact")
    assert not r.stats.exact_hit  # a dense video is never returned as the first_block run's (or vice versa)
    assert gen(fbc, steps=2, cache="exact").stats.exact_hit


# ---- the other kinds ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["wan", "hunyuan"])
def test_pab_puts_every_cfg_branch_in_one_forward_and_reuses_attention(family, tiny, tmp_path):
    """PAB keeps one state per attention layer (not per cache_context): separate cond/uncond forwards would let
    uncond reuse cond's attention, so the adapters batch the branches (uncond first) while it runs."""
    pipe = tiny[family]
    eng = engine(pipe, tmp_path, "pab:spatial=1000,timesteps=-1..2000")
    neg = {}
    if family == "hunyuan":  # true CFG (two branches) only with true_cfg_scale > 1 and a negative prompt
        eng.adapter.true_cfg_scale = 3.0
        neg = {"negative_prompt": "blurry"}
    attn = "blocks.0.attn1" if family == "wan" else "transformer_blocks.0.attn"
    tr = pipe.transformer
    sizes, h = batch_sizes(tr)
    try:
        with calls(tr, f"{attn}.to_q", "blocks.0.attn2.to_q" if family == "wan" else "transformer_blocks.0.ff") as n:
            r = gen(eng, family, **neg)
    finally:
        h.remove()
    assert sizes == [2] * STEPS
    counts = list(n.values())
    assert counts == [1, STEPS]  # self-attention computed once, then broadcast; the rest runs every step
    assert np.isfinite(r.video).all()


def test_faster_cache_derives_the_uncond_branch(embedded, tmp_path):
    eng = engine(embedded, tmp_path, "faster:uncond=5,uncond_timesteps=-1..2000,timesteps=-1..-1")
    sizes, h = batch_sizes(embedded.pipe.transformer.blocks[0])
    try:
        r = gen(eng, steps=10)
    finally:
        h.remove()
    # The uncond half is computed at iterations 0 and 5 only; in between, blocks see the cond row alone.
    assert sizes == [2, 1, 1, 1, 1, 2, 1, 1, 1, 1]
    dense = gen(engine(embedded, tmp_path, None, "d"), steps=10)
    assert 1e-4 < float(np.abs(r.video - dense.video).max())


def test_taylorseer_predicts_between_full_steps(embedded, tmp_path):
    eng = engine(embedded, tmp_path, "taylorseer:interval=5,warmup=3")
    with calls(embedded.pipe.transformer, "blocks.0.attn1.to_q", "blocks.0.norm2") as n:
        gen(eng, steps=10)
    # Full at the warmup steps 0, 1, 2 and at every 5th step after: 4 and 9. Unhooked modules run every step.
    assert n == {"blocks.0.attn1.to_q": 5, "blocks.0.norm2": 10}


def test_mag_cache_calibrates_then_skips(embedded, tmp_path):
    cal = gen(engine(embedded, tmp_path, "mag:calibrate=true", "cal"), steps=10)
    ratios = cal.stats.notes["intra_cache"]["mag_ratios"]
    assert len(ratios) == 10 and ratios[0] == 1.0 and all(r > 0 for r in ratios)
    assert np.array_equal(cal.video, gen(engine(embedded, tmp_path, None, "d"), steps=10).video)  # calibration skips nothing
    # Ratios of exactly 1 accumulate no error: after the retained 20 % (2 steps), skip max_skip=3 steps, compute one, ...
    eng = engine(embedded, tmp_path, {"kind": "mag", "threshold": 0.0, "ratios": [1.0] * 10})
    with calls(embedded.pipe.transformer, "blocks.0.ffn", "blocks.5.ffn") as n:
        gen(eng, steps=10)
    assert n == {"blocks.0.ffn": 4, "blocks.5.ffn": 4}  # steps 0, 1, 5, 9


# ---- errors ---------------------------------------------------------------------------------------
def test_unsupported_kind_for_a_family_is_a_clear_error(tiny, tmp_path):
    with pytest.raises(CarnatorError) as e:
        engine(tiny["ltx"], tmp_path, "faster")
    msg = str(e.value)
    assert "faster" in msg and "ltx" in msg and "kinds that work here: pab, taylorseer, mag" in msg and "\n" not in msg
    # The tiny CogVideoX has one block: nothing after the first block to skip.
    with pytest.raises(CarnatorError, match=r"first_block .*2 transformer blocks.*kinds that work here: pab, faster, taylorseer, mag"):
        engine(tiny["cogvideox"], tmp_path, "first_block")
    assert supported_kinds(engine(tiny["wan"], tmp_path, None, "w").adapter) == ["first_block", "pab", "faster", "taylorseer", "mag"]


@pytest.mark.parametrize("spec, words", [
    ("nope", "unknown intra cache 'nope'; available: first_block, pab, faster, taylorseer, mag"),
    ("first_block:thresh=1", "has no option thresh"),
    ("pab:timesteps=5", "LO..HI"),
    ("taylorseer:interval=x", "must be an integer"),
    ("taylorseer:warmup=0", "warmup must be at least 1"),
    ("pab:spatial=none", "set spatial=N or cross=N"),
    ({"threshold": 1}, "needs a 'kind'"),
])
def test_bad_spec_is_a_clear_error(spec, words):
    with pytest.raises(CarnatorError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        IntraCacheSpec.parse(spec)


def test_mag_without_ratios_says_how_to_get_them():
    with pytest.raises(CarnatorError, match="intra cache mag: it needs the model's magnitude ratios: run one request with calibrate=true"):
        IntraCacheSpec.parse("mag")


def test_cli_generate_with_an_intra_cache(tmp_path, capsys):
    out = tmp_path / "v.gif"
    rc = main(["generate", PROMPT, "--steps", "2", "--policy", "dense", "--cache-dir", str(tmp_path / "c"), "--device", "cpu",
               "--out", str(out), "--json", "-q", "--intra-cache", "first_block:threshold=0.1"])
    assert rc == 0 and out.is_file()
    notes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["notes"]
    assert notes["intra_cache"]["kind"] == "first_block" and notes["intra_cache"]["options"] == {"threshold": 0.1}
    rc = main(["generate", PROMPT, "--out", str(out), "--intra-cache", "first_block:bogus=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("carnator: error: intra cache first_block has no option bogus") and "Traceback" not in err


# ---- composed with carnator -------------------------------------------------------------------------
OPEN = Thresholds(context=math.inf, size=math.inf, shape=math.inf, color=math.inf)


@pytest.mark.parametrize("intra", ["first_block", "taylorseer", "faster"])
def test_composed_with_carnator_a_hit_still_happens(intra, embedded, tmp_path):
    """taylorseer's first predicted step (3) is the probe's recording step: the state is reset before it, so the
    evidence forward runs in full; faster drops the uncond rows, which carnator's processors follow."""
    tau = tmp_path / "tau.json"
    OPEN.save(tau, model_id=embedded.model_identity)
    eng = engine(embedded, tmp_path, intra, policy_options={"carnator": {"resume_step": 5, "thresholds": str(tau)}})
    a = gen(eng, steps=8, policy="carnator", store=True)
    b = gen(eng, steps=8, prompt="a small red box moving left on grass", seed=2, policy="carnator", store=True)
    s = b.stats
    assert not a.stats.hit and s.hit and s.source_id == a.stats.entry_id and s.resume_step == 5
    assert s.dit_forwards == 2 * (4 + 8 - 5)
    # Reset at the request's start, before the probe's recording forward (step 3), and at the resume.
    assert s.notes["intra_cache"]["kind"] == intra and s.notes["intra_cache"]["resets"] == 3
    # Outside the Active region the blend keeps the source's latent exactly, intra cache or not.
    same = (eng.store.load(s.entry_id)["traj.7"] == eng.store.load(a.stats.entry_id)["traj.7"]).all(dim=1)[0]
    assert same.float().mean() >= 1 - s.active_fraction - 1e-6 and not same.all()


def test_composed_with_chorus_the_window_switches_restart_the_state(embedded, tmp_path):
    """chorus recomputes only Active tokens in the middle layers during stage 2 and everything in stage 3: the
    shapes TaylorSeer's hooked layers see change at both switches, so its state restarts there."""
    # A tight region (no dilation, high hysteresis) so that it is partial whatever the shipped weights attend to.
    tight = {"region_high": 0.9, "region_low": 0.8, "scope": ScopeConfig(active_dilation=0, context_dilation=1)}
    eng = engine(embedded, tmp_path, "taylorseer:warmup=1,interval=2", policy_options={"chorus": tight})
    a = gen(eng, steps=8, policy="chorus", store=True)
    b = gen(eng, steps=8, prompt="a small red box moving left on grass", seed=2, policy="chorus", store=True)
    s = b.stats
    assert not a.stats.hit and s.hit and s.notes["stages"] == [2, 6] and 0 < s.active_fraction < 1
    # Reset at the first forward (step 2, after the resume), when the window switches on (3) and off (6).
    assert s.notes["intra_cache"]["resets"] == 3


def test_taylorseer_predicts_the_window_layers_attention_too(embedded, tmp_path):
    """Inside the window the block forward calls its self-attention module (not the processor behind it), so
    diffusers' hooks on that module see the call: a window layer's attention is predicted on exactly the steps
    a layer outside the window is (before, it was computed on every window forward)."""
    tight = {"region_high": 0.9, "region_low": 0.8, "scope": ScopeConfig(active_dilation=0, context_dilation=1)}
    eng = engine(embedded, tmp_path, "taylorseer:warmup=1,interval=3", policy_options={"chorus": tight})
    gen(eng, steps=12, policy="chorus", store=True)
    assert list(eng.policy("chorus").cfg.window) == [0.2, 0.867]  # layers 1-4 of the embedded model's 6
    with calls(embedded.pipe.transformer, "blocks.0.attn1.to_q", "blocks.2.attn1.to_q", "blocks.2.norm2") as n:
        b = gen(eng, steps=12, prompt="a small red box moving left on grass", seed=2, policy="chorus", store=True)
    assert b.stats.hit and 0 < b.stats.active_fraction < 1
    assert n["blocks.2.attn1.to_q"] == n["blocks.0.attn1.to_q"] < n["blocks.2.norm2"]
