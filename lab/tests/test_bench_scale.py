"""bench-scale on the CPU-sized tiny-wan spec: the replayed plan is what was asked for, end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from carnator.attention.kernels import _flex_kwargs, set_flex_kernel_options
from carnator_lab.scale import ScaleConfig, box_for_active_fraction, run_scale, synthetic_masks
from carnator_lab.cli import main
from carnator.reuse import ScopeConfig, reuse_scope


def test_box_hits_the_requested_active_fraction():
    grid = (4, 30, 52)
    for frac in (0.1, 0.3, 0.6):
        box = box_for_active_fraction(grid, frac)
        active = reuse_scope([box], ScopeConfig()).active.mean()
        assert abs(active - frac) < 0.03
        assert (box == box[:1]).all()  # the same box in every frame


def test_synthetic_masks_density_and_diagonal():
    ms = synthetic_masks(3, 1000, 50, 0.3, steps=[0, 5], branches=(0, 1), layers=range(2), seed=0)
    assert len(ms) == 2 * 2 * 2
    assert abs(ms.density - 0.3) < 0.03
    m = ms.get(5, 1, 1)
    assert m[:, torch.arange(20), torch.arange(20)].all()  # every query block sees its own key block


@pytest.mark.slow
def test_replayed_hit_on_tiny_wan(tmp_path):
    cfg = ScaleConfig(model="tiny-wan", steps=8, densities=(0.5,), active_fraction=0.4, resume_step=4, mask_stride=2, block=32,
                      kernels=False, device="cpu", intra_cache="taylorseer", flex_options={"num_warps": 4}, frame_steps=(2, 6))
    rep = run_scale(cfg, tmp_path, progress=lambda s: None)
    assert set_flex_kernel_options(None) is None  # the run's kernel options do not outlive it
    d, (h,) = rep["dense"], rep["hits"]
    assert d["hit"] is False and d["dit_forwards"] == 2 * 8
    assert h["hit"] is True and h["resume_step"] == 4
    # probe (4 steps) + the steps from the resume step on, both CFG branches
    assert h["dit_forwards"] == 2 * (4 + 8 - 4)
    assert abs(h["active_fraction"] - 0.4) < 0.1
    assert abs(h["mask_density"] - 0.5) < 0.1
    for k in ("recall", "probe", "signature", "decision", "plan", "dit", "decode", "total"):
        assert k in h["timings"]
    # composed with diffusers' TaylorSeer: the hit still replays the plan, and the cache ran on both
    comp = rep["composed"]
    assert comp["hit"]["hit"] is True and comp["hit"]["resume_step"] == 4
    assert comp["dense"]["timings"]["dit"] > 0 and comp["hit"]["intra_cache"]["kind"] == "taylorseer"
    # the baselines' replayed hits: NIRVANA resumes at 25 of 50 scaled to 8 steps (4); Chorus's stage 2 starts at
    # round(0.3 * 8) = 2 over the replayed box; Chorus II runs all 8 steps under the entry's masks
    b = rep["baselines"]
    assert set(b) == {"nirvana", "chorus", "chorus2"} and all(row["hit"] for row in b.values())
    assert (b["nirvana"]["resume_step"], b["nirvana"]["dit_forwards"]) == (4, 2 * 4)
    assert (b["chorus"]["resume_step"], b["chorus"]["dit_forwards"]) == (2, 2 * 6)
    assert abs(b["chorus"]["active_fraction"] - 0.4) < 0.1
    assert (b["chorus2"]["resume_step"], b["chorus2"]["dit_forwards"]) == (0, 2 * 8)
    assert abs(b["chorus2"]["mask_density"] - 0.5) < 0.1
    assert b["nirvana"]["entry_bytes"] < b["chorus"]["entry_bytes"]  # one latent against stage 2's range
    # frame tiers: no probe, every token from the step on under the entry's masks (8 - 2 and 8 - 6 steps, CFG)
    f2, f6 = rep["frame_tiers"]
    assert (f2["hit"], f2["resume_step"], f2["dit_forwards"], f2["probe"]) == (True, 2, 2 * 6, "skipped")
    assert (f6["hit"], f6["resume_step"], f6["dit_forwards"]) == (True, 6, 2 * 2)
    assert f2["active_fraction"] == 1.0 and abs(f2["mask_density"] - 0.5) < 0.1 and "probe" not in f2["timings"]
    m = rep["frame_miss"]  # every step computed, no probe, masks captured for later hits
    assert (m["hit"], m["dit_forwards"], m["probe"]) == (False, 2 * 8, "skipped") and "probe" not in m["timings"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["tokens"] == int(np.prod(saved["token_grid"]))
    assert "| dense |" in (tmp_path / "report.md").read_text() and "| frame tier from step 6, " in (tmp_path / "report.md").read_text()


def test_cli_bench_scale_needs_cuda_or_a_known_size(capsys):
    assert main(["bench-scale", "no-such-model"]) == 2
    assert "unknown size" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench-scale", "tiny-wan"]) == 2
        assert "CUDA" in capsys.readouterr().err
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--densities", "0.5,x"]) == 2
    capsys.readouterr()
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--baselines", "nirvana,chorus3"]) == 2
    assert "unknown chorus3" in capsys.readouterr().err
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--nirvana-resume-step", "50"]) == 2
    assert "--nirvana-resume-step" in capsys.readouterr().err


@pytest.mark.slow
def test_replayed_hit_on_tiny_ltx(tmp_path):
    """The LTX path (packed tokens, 0.9.7 VAE layout with 32x/8x compression, CFG batched in one forward) replays a hit."""
    from carnator_lab.scale import SPECS

    spec = SPECS["tiny-ltx"]
    cfg = ScaleConfig(model="tiny-ltx", steps=8, densities=(0.3,), active_fraction=0.4, resume_step=5, mask_stride=2, block=32,
                      kernels=False, device="cpu", intra_cache="taylorseer")
    rep = run_scale(cfg, tmp_path, progress=lambda s: None)
    d, (h,) = rep["dense"], rep["hits"]
    # 17 frames at 256x256 through 8x temporal / 32x spatial compression and patch 1: a 3 x 8 x 8 token grid
    assert rep["token_grid"] == [3, 8, 8] and rep["tokens"] == 192
    assert d["hit"] is False and d["dit_forwards"] == 2 * 8
    assert h["hit"] is True and h["resume_step"] == 5
    assert h["dit_forwards"] == 2 * (4 + 8 - 5)  # probe (4 steps) + the steps from the resume step on, both CFG branches
    assert abs(h["active_fraction"] - 0.4) < 0.1
    assert abs(h["mask_density"] - 0.3) < 0.1
    for k in ("recall", "probe", "signature", "decision", "plan", "dit", "decode", "total"):
        assert k in h["timings"]
    # dense and the hit both decode the whole clip at the requested size
    for row in (d, h):
        assert row["video_shape"] == [spec.frames, spec.height, spec.width, 3] and row["video_finite"] is True
    comp = rep["composed"]
    assert comp["hit"]["hit"] is True and comp["hit"]["resume_step"] == 5
    assert comp["hit"]["intra_cache"]["kind"] == "taylorseer"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("## tiny-ltx: 256x256, 17 frames, 8 steps") and "tiny test configuration (LTX path)" in md


def test_ltx_13b_spec_is_the_0_9_7_dev_model():
    """The real-size LTX spec builds LTX-Video-13B's transformer and a VAE of its compression (checked on the meta device)."""
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    from carnator_lab.scale import SPECS

    spec = SPECS["ltx-video-13b"]
    with torch.device("meta"):
        tr = LTXVideoTransformer3DModel(**spec.transformer)
        vae = AutoencoderKLLTXVideo(**spec.vae)
    assert 12.9e9 < sum(p.numel() for p in tr.parameters()) < 13.2e9 and len(tr.transformer_blocks) == 48
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio, vae.config.latent_channels) == (32, 8, 128)
    assert spec.text["d_model"] == spec.transformer["caption_channels"] == 4096
    spec.check_frames(spec.frames)
    assert spec.height % 32 == 0 and spec.width % 32 == 0
    with pytest.raises(ValueError, match="8\\*k\\+1"):
        spec.check_frames(120)


def test_cli_bench_scale_lists_and_checks_ltx(capsys):
    assert main(["bench-scale", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "ltx-video-13b" in err and "tiny-ltx" in err
    assert main(["bench-scale", "ltx-video-13b", "--frames", "85"]) == 2  # 85 = 4*21+1 is a Wan length, not an LTX one (8*k+1)
    assert "8*k+1" in capsys.readouterr().err
    assert main(["bench-scale", "ltx-video-13b", "--resume-step", "50"]) == 2
    assert "--resume-step" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench-scale", "ltx-video-13b", "--frames", "97"]) == 2
        assert "CUDA" in capsys.readouterr().err
    assert main(["bench-scale", "--help"]) == 0  # main returns argparse's status (help: 0) instead of raising SystemExit
    assert "ltx-video-13b" in capsys.readouterr().out


def test_flex_kernel_options_are_checked_and_explicit_ones_win():
    with pytest.raises(ValueError, match="BLOK_M"):
        set_flex_kernel_options({"BLOK_M": 64})
    assert _flex_kwargs(None) == {}  # nothing set: flex's own heuristics, no kernel_options argument
    assert set_flex_kernel_options({"BLOCK_M": 64, "USE_TMA": True}) is None
    try:
        assert _flex_kwargs(None) == {"kernel_options": {"BLOCK_M": 64, "USE_TMA": True}}
        assert _flex_kwargs({"num_warps": 4}) == {"kernel_options": {"num_warps": 4}}
        assert _flex_kwargs({}) == {}  # an explicit empty set means flex's heuristics
    finally:
        assert set_flex_kernel_options(None) == {"BLOCK_M": 64, "USE_TMA": True}


def test_cli_bench_scale_checks_kernel_options(capsys):
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--flex-options", "{bad"]) == 2
    assert "--flex-options must be JSON" in capsys.readouterr().err
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--kernel-sweep", '{"USE_TMA": true}']) == 2
    assert "JSON list" in capsys.readouterr().err
    assert main(["bench-scale", "tiny-wan", "--device", "cpu", "--kernel-sweep", '[{"BLOK_N": 64}]']) == 2
    assert "unknown FlexAttention kernel option(s) BLOK_N" in capsys.readouterr().err


def test_kernel_bench_times_every_kernel_option_set(monkeypatch):
    """The sweep's bookkeeping on the CPU (eager flex, unit timings): one variant per option set, the first on top."""
    import contextlib

    import torch._dynamo  # noqa: F401 - imported before sdpa_kernel is replaced below (dynamo reads its __wrapped__)
    import torch.nn.attention
    from torch.nn.attention.flex_attention import flex_attention

    import carnator.attention.kernels as kernels
    import carnator_lab.scale as scale

    monkeypatch.setattr(scale, "_time_cuda", lambda fn, reps: (fn(), 2.0)[1])
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a, **k: contextlib.nullcontext())  # cuDNN is CUDA-only
    monkeypatch.setattr(kernels, "compiled_flex_attention", lambda: flex_attention)
    monkeypatch.setattr(kernels, "check_flex_against_sdpa", lambda device: [{"err_full": 0.0}])
    with torch._dynamo.config.patch(recompile_limit=8):  # (restored on exit; monkeypatch would delete the config key)
        out = scale.kernel_bench(2, 300, 32, (0.3, 0.6), block=128, reps=1, device="cpu", option_sets=[None, {"num_warps": 4}])
        assert torch._dynamo.config.recompile_limit >= 16 + 4 * 2  # every option set compiles once more: never fall back to eager
    assert [v["options"] for v in out["variants"]] == [None, {"num_warps": 4}]
    assert out["rows"] == out["variants"][0]["rows"] and out["flex_dense_ms"] == 2.0
    for var in out["variants"]:
        assert [r["blocks"] for r in var["rows"]] == [3, 3]  # ceil(300 / 128)
        assert var["max_err_vs_default_options"] == 0.0     # eager flex ignores kernel options
        for r in var["rows"]:
            assert r["ratio_to_limit"] == pytest.approx(2.0 / (r["density"] * 2.0), rel=1e-3)
