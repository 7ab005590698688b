"""Real-size speed (``carnator bench-scale``): random-weight backbones at the sizes users run.

One call measures one backbone through the real engine, on a CUDA GPU:

1. **Dense**: the request through ``policy="dense"`` (the unmodified transformer, CFG, 50 steps,
   VAE decode; the spec's family's pipeline: Wan or LTX-Video). Its post-scheduler latents from
   the resume step on are stored as a cache entry.
2. **Hits** (one per mask density): random weights cannot produce real plans, so a hit *replays*
   a plan. The target request (one noun substituted) goes through the whole carnator path for
   real: recall (text index + noun filter), the 4-step dense probe with evidence recording at the
   middle layer, Evidence Regions and the Early Signature with its one VAE decode of the tail
   frame, and the compatibility test. Then the decision is forced to the recalled entry and the
   plan's parameters are replayed: the Evidence Region is a centred box per frame sized so that
   the Active region covers ``active_fraction`` of the tokens, the resume step and the layer
   window are the config's, and the entry's block masks are synthetic at the stated density
   (the diagonal block of every query block plus random blocks; recorded every
   ``mask_stride``-th step as :class:`~carnator.attention.SparseConfig` ``stride`` records them).
   Everything after the decision (entry load, mask upload, region blend after every step,
   Active-only recomputation in the window with gather/scatter, block-sparse attention through
   compiled FlexAttention, capture of the new request's own masks, VAE decode) runs as in
   serving.
3. **Baselines' hits** (``ScaleConfig.baselines``): NIRVANA, Chorus and Chorus II on the same target, each from an entry
   holding only what it reads, with their plans replayed too (:func:`replay_decision`).
4. **Kernels**: block-sparse attention (compiled FlexAttention) at density d against d x the
   cuDNN SDPA dense time (the limit), at the backbone's self-attention shape; and the cost of
   building one BlockMask.

The embedded-world measurements that the replayed parameters should come from are in
lab/notebook/RESULTS.md; the report states the parameters it used.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["SPECS", "replay_decision", "ScaleSpec", "box_for_active_fraction", "build_pipeline", "kernel_bench", "run_scale", "synthetic_masks"]

PROMPT_SOURCE = "a red fox running through a snowy forest at dawn, cinematic"
PROMPT_TARGET = "a red wolf running through a snowy forest at dawn, cinematic"


@dataclass(frozen=True)
class ScaleSpec:
    """A backbone size: diffusers configs of its parts and the generation settings of the paper.

    ``family`` picks the pipeline :func:`build_pipeline` builds ("wan": WanPipeline with a UMT5
    encoder and UniPC; "ltx": LTXPipeline with a T5 encoder and flow-matching Euler). ``flow_shift``
    is the scheduler's (static) flow shift. ``frame_step``: the VAE's temporal compression; a
    request's frame count must be ``frame_step * k + 1``. ``note`` is printed in the report.
    """

    name: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text: dict[str, Any]
    height: int
    width: int
    frames: int
    flow_shift: float
    guidance_scale: float = 5.0
    expand_timesteps: bool = False
    note: str = ""
    family: str = "wan"
    frame_step: int = 4

    def check_frames(self, frames: int) -> None:
        """Raise ValueError unless ``frames`` is a frame count this backbone's VAE accepts."""
        if frames < 1 or (frames - 1) % self.frame_step:
            raise ValueError(f"{self.name} needs {self.frame_step}*k+1 frames (e.g. {self.frames}), got {frames}")


_UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
             "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu"}
_WAN_ATTN = {"cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024, "freq_dim": 256}

_WAN21_13B = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
              "text_dim": 4096, "ffn_dim": 8960, "num_layers": 30, **_WAN_ATTN}
_WAN21_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "temperal_downsample": [False, True, True]}

# LTX-Video 13B 0.9.7/0.9.8 "dev" (diffusers' scripts/convert_ltx_to_diffusers.py, version 0.9.7).
_LTX097_13B = {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
               "attention_head_dim": 128, "cross_attention_dim": 4096, "num_layers": 48, "activation_fn": "gelu-approximate",
               "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096,
               "attention_bias": True, "attention_out_bias": True}
_LTX097_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": (128, 256, 512, 1024, 2048),
               "down_block_types": ("LTXVideo095DownBlock3D",) * 4, "decoder_block_out_channels": (256, 512, 1024),
               "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5),
               "spatio_temporal_scaling": (True, True, True, True), "decoder_spatio_temporal_scaling": (True, True, True),
               "decoder_inject_noise": (False, False, False, False), "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
               "upsample_residual": (True, True, True), "upsample_factor": (2, 2, 2), "timestep_conditioning": True, "patch_size": 4,
               "patch_size_t": 1, "resnet_norm_eps": 1e-6, "scaling_factor": 1.0, "encoder_causal": True, "decoder_causal": False,
               "spatial_compression_ratio": 32, "temporal_compression_ratio": 8}
# T5 v1.1 XXL encoder (LTX-Video's text encoder), as the Wan specs build UMT5-XXL: full size, random weights.
_T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
           "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu"}
_LTX_13B_NOTE = (
    "LTX-Video-13B 0.9.7-dev configs (13.0B transformer: 48 layers, 32 heads x 128; 0.9.7 VAE, 32x spatial / 8x temporal, "
    "128 latent channels; T5-v1.1-XXL encoder; all bf16 as diffusers' LTX examples load them), LTXPipeline text-to-video. "
    "Paper-like full size, not reduced: 1216x704 (LTX-13B's native resolution), 121 frames (the paper's 5 s clip, as for "
    "Wan2.2), 50 steps, CFG on (3.0, LTXPipeline's default; the paper gives none): 16 x 22 x 38 = 13,376 tokens. Estimate: "
    "444 TFLOP per transformer row-forward (counted; Wan2.1-1.3B at 32,760 tokens: 283), 100 row-forwards = 44 PFLOP = ~94 s "
    "at the 472 TFLOP/s the Wan2.1-1.3B dense run sustained on the H200 (28.3 PFLOP in 59.9 s DiT), plus a 131 TFLOP VAE "
    "decode: ~100 s per dense run, under the 4-minute budget. Scheduler: LTX's flow-matching Euler (0.9.7: static shift 1.0) "
    "instead of the paper's UniPC (same per-step cost). The LTX adapter has no tail-only decode: a hit's signature decodes the "
    "whole probe-step clip (Wan's decodes one latent frame)"
)

SPECS: dict[str, ScaleSpec] = {
    "wan2.1-1.3b": ScaleSpec(
        name="wan2.1-1.3b",
        transformer=_WAN21_13B, vae=_WAN21_VAE,
        text=_UMT5_XXL, height=480, width=832, frames=81, flow_shift=3.0,
        note="Wan2.1-T2V-1.3B-Diffusers configs; UMT5-XXL text encoder",
    ),
    "wan2.1-1.3b-720p": ScaleSpec(
        name="wan2.1-1.3b-720p",
        transformer=_WAN21_13B, vae=_WAN21_VAE,
        text=_UMT5_XXL, height=720, width=1280, frames=81, flow_shift=5.0,
        note="Wan2.1-T2V-1.3B at 1280x720 (75,600 tokens), the setting the paper's latencies suggest",
    ),
    "wan2.2-ti2v-5b": ScaleSpec(
        name="wan2.2-ti2v-5b",
        transformer={"patch_size": (1, 2, 2), "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48,
                     "out_channels": 48, "text_dim": 4096, "ffn_dim": 14336, "num_layers": 30, **_WAN_ATTN},
        vae={"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
             "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
             "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
             "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48},
        text=_UMT5_XXL, height=704, width=1280, frames=121, flow_shift=5.0, expand_timesteps=True,
        note="Wan2.2-TI2V-5B-Diffusers configs (text-to-video path); UMT5-XXL text encoder",
    ),
    # LTX-Video 13B (0.9.7/0.9.8 "dev"), see _LTX_13B_NOTE. CFG 3.0 is LTXPipeline's default (the
    # paper gives no LTX guidance; the scale does not change the cost: CFG is on either way).
    "ltx-video-13b": ScaleSpec(
        name="ltx-video-13b", family="ltx", frame_step=8,
        transformer=_LTX097_13B, vae=_LTX097_VAE, text=_T5_XXL,
        height=704, width=1216, frames=121, flow_shift=1.0, guidance_scale=3.0,
        note=_LTX_13B_NOTE,
    ),
    # A CPU-sized stand-in with the same code path, for tests and smoke runs.
    "tiny-wan": ScaleSpec(
        name="tiny-wan",
        transformer={"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
                     "out_channels": 16, "text_dim": 32, "ffn_dim": 64, "num_layers": 5, **_WAN_ATTN},
        vae={"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True]},
        text={"vocab_size": 259, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4,
              "relative_attention_num_buckets": 8},
        height=128, width=128, frames=9, flow_shift=3.0, note="tiny test configuration",
    ),
    # The LTX path at CPU size: the 0.9.7 VAE block layout (32x spatial, 8x temporal, 128 latent
    # channels) with tiny widths; 256x256, 17 frames -> a 3 x 8 x 8 token grid like tiny-wan's.
    "tiny-ltx": ScaleSpec(
        name="tiny-ltx", family="ltx", frame_step=8,
        transformer={**_LTX097_13B, "num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32,
                     "num_layers": 5, "caption_channels": 32},
        vae={**_LTX097_VAE, "block_out_channels": (4, 8, 16, 32, 64), "decoder_block_out_channels": (8, 16, 32),
             "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1)},
        text={"vocab_size": 259, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4,
              "relative_attention_num_buckets": 8},
        height=256, width=256, frames=17, flow_shift=1.0, guidance_scale=3.0, note="tiny test configuration (LTX path)",
    ),
}


def build_pipeline(spec: ScaleSpec, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The diffusers pipeline of ``spec.family`` with random weights, built directly on ``device``."""
    builders = {"wan": _build_wan, "ltx": _build_ltx}
    if spec.family not in builders:
        raise ValueError(f"no bench-scale builder for family {spec.family!r}; have {', '.join(builders)}")
    return builders[spec.family](spec, device, dtype, seed)


def _build_wan(spec: ScaleSpec, device: str | torch.device, dtype: torch.dtype, seed: int):
    """A WanPipeline of ``spec`` with random weights, built directly on ``device``.

    Transformer and text encoder in ``dtype``; the VAE in float32 (as diffusers' Wan examples load
    it); 50-step UniPC with flow sigmas; a byte-level tokenizer (no hub).
    """
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from carnator.testing import byte_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        transformer = WanTransformer3DModel(**spec.transformer).to(dtype).eval()
        vae = AutoencoderKLWan(**spec.vae).to(torch.float32).eval()
        text_encoder = UMT5EncoderModel(UMT5Config(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **spec.text)).to(dtype).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=spec.flow_shift, num_train_timesteps=1000)
    pipe = WanPipeline(tokenizer=byte_tokenizer(512), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=spec.expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _build_ltx(spec: ScaleSpec, device: str | torch.device, dtype: torch.dtype, seed: int):
    """An LTXPipeline of ``spec`` with random weights, built directly on ``device``.

    Transformer, text encoder (T5) and VAE in ``dtype`` (diffusers' LTX examples load the whole
    pipeline in bf16); flow-matching Euler with a static shift (LTX-Video 0.9.7's scheduler); a
    byte-level tokenizer of LTX's 128-token prompt length (no hub).
    """
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from carnator.testing import byte_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        transformer = LTXVideoTransformer3DModel(**spec.transformer).to(dtype).eval()
        vae = AutoencoderKLLTXVideo(**spec.vae).to(dtype).eval()
        text_encoder = T5EncoderModel(T5Config(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **spec.text)).to(dtype).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=False, shift=spec.flow_shift)
    pipe = LTXPipeline(tokenizer=byte_tokenizer(128), text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- replayed plans ------------------------------------------------------------------------------

def box_for_active_fraction(grid: tuple[int, int, int], fraction: float, scope_cfg=None) -> np.ndarray:
    """A centred box per frame (the same in every frame) whose reuse scope's Active region covers
    the share of tokens closest to ``fraction``; bool ``grid``."""
    from carnator.reuse import ScopeConfig, reuse_scope

    scope_cfg = scope_cfg or ScopeConfig()
    t, h, w = grid
    best, best_err = None, math.inf
    for hh in range(1, h + 1):
        ww = max(1, min(w, round(hh * w / h)))
        box = np.zeros(grid, dtype=bool)
        y0, x0 = (h - hh) // 2, (w - ww) // 2
        box[:, y0:y0 + hh, x0:x0 + ww] = True
        err = abs(float(reuse_scope([box], scope_cfg).active.mean()) - fraction)
        if err < best_err:
            best, best_err = box, err
    return best


def synthetic_masks(num_heads: int, q_len: int, block: int, density: float, *, steps, branches=(0, 1), layers, seed: int = 0, device="cpu"):
    """A :class:`BlockMaskSet` of random block masks at ``density``: every query block keeps its
    diagonal key block (local attention) plus random key blocks, one mask per (step, branch, layer)."""
    from carnator.attention.blockmask import BlockMaskSet, num_blocks

    nb = num_blocks(q_len, block)
    ms = BlockMaskSet.empty(num_heads=num_heads, q_len=q_len, kv_len=q_len, block=block)
    g = torch.Generator(device=device).manual_seed(seed)
    eye = torch.eye(nb, dtype=torch.bool, device=device)
    extra = max(0.0, (density * nb - 1) / max(nb - 1, 1))   # so that diagonal + random ~ density
    for s in steps:
        for br in branches:
            for ly in layers:
                m = (torch.rand(num_heads, nb, nb, generator=g, device=device) < extra) | eye
                ms.add(s, br, ly, m)
    return ms


BASELINES = ("nirvana", "chorus", "chorus2")


def baseline_policies(cfg: "ScaleConfig", steps: int) -> dict[str, Any]:
    """The cross-request baselines whose hits are replayed, by name, configured as carnator's replay is (window, scope,
    block masks); each hit is an injected :class:`~carnator.plan.Decision` (:func:`replay_decision`):

    - ``nirvana``: resumes at ``cfg.nirvana_resume_step`` (of 50, scaled to ``steps``) from the entry's latent;
    - ``chorus``: its stages as configured (``ChorusConfig``: stage 2 from 0.3 n, stage 3 from 0.8 n), TGAA on the
      differing word's tokens, its layer window ``cfg.window``; the regions of the differing words replaced by the
      same centred box carnator's replay uses (``cfg.active_fraction`` of the tokens Active);
    - ``chorus2``: every step dense-scheduled under the entry's block masks (``cfg.block``, recorded every
      ``cfg.mask_stride`` steps), the request's own trajectory.
    """
    from carnator.policies.baselines import Chorus2Policy, NirvanaPolicy
    from carnator.policies.chorus import ChorusConfig, ChorusPolicy

    ccfg = _carnator_config(cfg)
    made = {"nirvana": lambda: NirvanaPolicy(),
            "chorus": lambda: ChorusPolicy(config=ChorusConfig(scope=ccfg.scope, window=cfg.window)),
            "chorus2": lambda: Chorus2Policy(sparse=ccfg.sparse)}
    unknown = set(cfg.baselines) - set(made)
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(sorted(unknown))}; have {', '.join(BASELINES)}")
    return {b: made[b]() for b in cfg.baselines}


def replay_decision(policy: str, entry_id: str, cfg: "ScaleConfig", steps: int, grid, *, source_prompt: str, target_prompt: str,
                    source_nouns, target_nouns, source_extra: dict | None = None):
    """The hit a replay executes, injected instead of the policy's decision (random weights decide nothing meaningful):
    carnator and chorus recompute a centred box of ``cfg.active_fraction`` Active tokens; NIRVANA resumes at its table's
    ``cfg.nirvana_resume_step``; Chorus II reuses the entry's masks."""
    from carnator.plan import Decision
    from carnator.policies.baselines import _nirvana_step
    from carnator.policies.chorus import prompt_diff
    from carnator.reuse import noun_diff

    box = box_for_active_fraction(tuple(grid), cfg.active_fraction, _carnator_config(cfg).scope)
    if policy.startswith("frame@"):  # a frame tier's hit: the decision a served one carries (no probe, no region)
        r = int(policy[6:])
        return Decision(reuse=True, source_id=entry_id, reason="replayed", resume_step=r,
                        details={"tier": {"kind": "replayed", "step": r, "scope": "frame", "bound": None},
                                 "substituted": None, "source_nouns": list(source_nouns)})
    if policy == "frame-miss":
        return Decision.miss("replayed", details={"tier": {"kind": "replayed", "scope": "frame"}})
    if policy == "carnator":
        diff = noun_diff(target_nouns, source_nouns)
        return Decision(reuse=True, source_id=entry_id, reason="replayed", regions=(box,),
                        details={"substituted": None if diff is None else diff.substituted, "source_nouns": list(source_nouns)})
    if policy == "nirvana":
        return Decision(reuse=True, source_id=entry_id, reason="replayed", resume_step=min(_nirvana_step(cfg.nirvana_resume_step, steps), steps - 1))
    if policy == "chorus":
        diff = prompt_diff(target_prompt, source_prompt, target_nouns, source_nouns)
        return Decision(reuse=True, source_id=entry_id, reason="replayed", regions=(box,),
                        details={"prompt_diff": diff, "source_record": (source_extra or {}).get("chorus")})
    if policy == "chorus2":
        return Decision(reuse=True, source_id=entry_id, reason="replayed")
    raise ValueError(f"no replay for policy {policy!r}")


def _baseline_entry_steps(policy, cfg: "ScaleConfig", steps: int) -> list[int]:
    """The trajectory steps a replayed baseline's entry holds: those it resumes from (NIRVANA: ``traj.{k-1}``;
    Chorus: ``traj.{r-1}`` to ``traj.{s-1}``; Chorus II: none)."""
    from carnator.policies.baselines import Chorus2Policy, NirvanaPolicy, _nirvana_step
    from carnator.policies.chorus import ChorusPolicy

    if isinstance(policy, NirvanaPolicy):
        return [min(_nirvana_step(cfg.nirvana_resume_step, steps), steps - 1) - 1]
    if isinstance(policy, ChorusPolicy):
        r, s = policy.cfg.stages(steps)
        return list(range(r - 1, s))
    assert isinstance(policy, Chorus2Policy)
    return []


# ---- kernels ---------------------------------------------------------------------------------------

def _time_cuda(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_bench(heads: int, n: int, head_dim: int, densities, *, block: int = 128, reps: int = 10, device="cuda",
                 option_sets: Sequence[dict | None] = (None,), triton_configs: Sequence[dict] = ()) -> dict:
    """Compiled FlexAttention at each block density vs d x cuDNN SDPA dense, at (1, heads, n, head_dim) bf16.

    ``option_sets``: FlexAttention ``kernel_options`` to time (``None``: the process's own, see
    :func:`~carnator.attention.kernels.set_flex_kernel_options`). The first set's numbers are the
    top-level ``rows`` / ``flex_dense_ms``; every set is in ``variants``. A set the kernel cannot
    compile is recorded with its error instead of rows. ``triton_configs``: launch settings of the Triton
    block-sparse kernel to time on the same tables (``triton``: one entry per config).
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from carnator.attention.blockmask import num_blocks
    from carnator.attention.kernels import (
        _flex_attention,
        _flex_kwargs,
        check_flex_against_sdpa,
        compiled_flex_attention,
        flex_block_mask,
    )

    # Each kernel_options set compiles flex once more; past dynamo's recompile limit (8) flex would fall
    # back to eager, which materializes every score (51 GB at the 1.3B shape).
    import torch._dynamo

    dyn = torch._dynamo.config
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 16 + 4 * len(option_sets))
    check = check_flex_against_sdpa(device)  # raises on a mismatch
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    out: dict[str, Any] = {"shape": [1, heads, n, head_dim], "block": block, "flex_check_max_err": max(r.get("err_full", 0.0) for r in check)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out["sdpa_cudnn_ms"] = _time_cuda(lambda: F.scaled_dot_product_attention(q, k, v), reps)
    out["sdpa_default_ms"] = _time_cuda(lambda: F.scaled_dot_product_attention(q, k, v), reps)
    nb = num_blocks(n, block)
    compiled_flex_attention()
    tables = []
    for d in densities:
        ms = synthetic_masks(heads, n, block, d, steps=[0], branches=[0], layers=[0], seed=1, device=device)
        tables.append(ms.get(0, 0, 0, device=device)[None])
    full = torch.ones(1, heads, nb, nb, dtype=torch.bool, device=device)
    fm = flex_block_mask(full, block, n, n)
    variants = []
    for opts in option_sets:
        kw = _flex_kwargs(opts)
        var: dict[str, Any] = {"options": kw.get("kernel_options")}
        try:
            ref = _flex_attention(q, k, v, tables[0], block, None, kernel_options=opts).float()
            if kw:  # checked against flex's own heuristics (a set that is those heuristics needs no check)
                base = _flex_attention(q, k, v, tables[0], block, None, kernel_options={}).float()
                var["max_err_vs_default_options"] = float((ref - base).abs().max())
            else:
                var["max_err_vs_default_options"] = 0.0
            rows = []
            for bm in tables:
                dens = float(bm.float().mean())
                build_ms = _time_cuda(lambda bm=bm: flex_block_mask(bm, block, n, n), reps)
                mask = flex_block_mask(bm, block, n, n)
                flex_ms = _time_cuda(lambda mask=mask: compiled_flex_attention()(q, k, v, block_mask=mask, **kw), reps)
                total_ms = _time_cuda(lambda bm=bm: _flex_attention(q, k, v, bm, block, None, kernel_options=opts), reps)
                limit = dens * out["sdpa_cudnn_ms"]
                rows.append({"density": round(dens, 4), "flex_ms": flex_ms, "mask_build_ms": build_ms, "flex_with_build_ms": total_ms,
                             "limit_ms": limit, "ratio_to_limit": flex_ms / limit, "blocks": nb})
            var["flex_dense_ms"] = _time_cuda(lambda: compiled_flex_attention()(q, k, v, block_mask=fm, **kw), reps)
            var["rows"] = rows
        except Exception as e:  # noqa: BLE001 - a tile configuration the kernel rejects is a result, not a crash
            var["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        variants.append(var)
    first = variants[0]
    if "error" in first:
        raise RuntimeError(f"flex with kernel options {first['options']} failed: {first['error']}")
    out["flex_dense_ms"], out["rows"], out["variants"] = first["flex_dense_ms"], first["rows"], variants
    if triton_configs:
        out["triton"] = _triton_kernel_rows(q, k, v, tables, full, block, out["sdpa_cudnn_ms"], reps, triton_configs, device)
    return out


def _triton_kernel_rows(q, k, v, tables, full, block, cudnn_ms, reps, configs, device) -> list[dict]:
    """The Triton block-sparse kernel (:mod:`carnator.attention.triton_bsa`) at each launch config: checked
    against the masked SDPA reference on a small odd shape and on the first table here, then timed per table."""
    from carnator.attention.kernels import _sdpa_masked
    from carnator.attention.triton_bsa import block_sparse_attention, kv_lists

    g = torch.Generator(device=device).manual_seed(1)
    small = [torch.randn(2, 3, 1000, q.shape[-1], device=device, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    small_table = torch.rand(2, 3, 8, 8, device=device, generator=g) < 0.4
    small_table[:, :, 0] = False
    ref_small = _sdpa_masked(*[t.float() for t in small], small_table, block, None, None)
    ref_big = _sdpa_masked(q, k, v, tables[0], block, None, None).float()
    lists = [kv_lists(t) for t in tables]
    full_lists = kv_lists(full)
    out = []
    for cfg in configs:
        row: dict[str, Any] = {"config": cfg}
        try:
            got = block_sparse_attention(*small, kv_lists(small_table), block, config=cfg).float()
            row["max_err_small"] = float((got - ref_small).abs().max())
            row["max_err_vs_sdpa"] = float((block_sparse_attention(q, k, v, lists[0], block, config=cfg).float() - ref_big).abs().max())
            row["dense_ms"] = _time_cuda(lambda: block_sparse_attention(q, k, v, full_lists, block, config=cfg), reps)
            row["rows"] = []
            for t, li in zip(tables, lists):
                dens = float(t.float().mean())
                ms = _time_cuda(lambda li=li: block_sparse_attention(q, k, v, li, block, config=cfg), reps)
                row["rows"].append({"density": round(dens, 4), "ms": ms, "limit_ms": dens * cudnn_ms, "ratio_to_limit": ms / (dens * cudnn_ms),
                                    "lists_build_ms": _time_cuda(lambda t=t: kv_lists(t), reps)})
        except Exception as e:  # noqa: BLE001 - a launch config the compiler rejects is a result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        out.append(row)
    return out


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class ScaleConfig:
    """What one ``bench-scale`` run does (the replayed plan's parameters included)."""

    model: str = "wan2.1-1.3b"
    frames: int | None = None
    steps: int = 50
    densities: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)
    active_fraction: float = 0.3
    resume_step: int = 30  # CarnatorConfig.resume_step
    window: tuple[float, float] = (0.2, 0.867)
    mask_stride: int = 5
    block: int = 128
    kernels: bool = True
    device: str = "cuda"
    #: a diffusers intra-request cache (``EngineConfig.intra_cache`` spec) to also measure alone
    #: ("dense + cache", the peer) and composed with a carnator hit at the first density. Use a
    #: schedule-driven kind (taylorseer): with random weights a residual-driven one skips arbitrarily.
    intra_cache: str | None = None
    #: cross-request baselines to time as hits too, each replaying its own plan (see :func:`replay_decision`)
    baselines: tuple[str, ...] = ("nirvana", "chorus", "chorus2")
    #: the step (of 50, scaled to ``steps``) NIRVANA's replayed hit resumes at: 25 is its table's most
    #: aggressive row (similarity > 0.95), NIRVANA's best case
    nirvana_resume_step: int = 25
    #: resume steps (of ``steps``) of replayed frame-tier hits: every token recomputed from the step, no probe, the
    #: entry's masks at the first density (a tier as :class:`carnator.reuse.tiers.Tier` with scope "frame" serves it)
    frame_steps: tuple[int, ...] = ()
    #: FlexAttention ``kernel_options`` for every flex call of the run (``None``: flex's heuristics)
    flex_options: dict[str, Any] | None = None
    #: the CUDA block-sparse kernel (:func:`~carnator.attention.kernels.set_block_sparse_kernel`): "auto" (Triton's) or "flex"
    sparse_kernel: str = "auto"
    #: further ``kernel_options`` sets timed in the kernel microbenchmark only
    kernel_sweep: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _carnator_config(cfg: ScaleConfig):
    """The carnator settings of a replayed hit: the plan's resume step and window, and its masks applied wherever
    the run is (``apply="always"``: on CUDA the block-sparse kernel at 128-token blocks, as "auto" would; on a CPU test the masked
    dense path, so the replay is exercised there too)."""
    from carnator.attention.state import SparseConfig
    from carnator.policies.carnator import CarnatorConfig

    return CarnatorConfig(resume_step=cfg.resume_step, window=cfg.window, thresholds=None,
                          sparse=SparseConfig(block=cfg.block, p=0.9, stride=cfg.mask_stride, apply="always"))


def _stage_row(res, peak: int | None) -> dict[str, Any]:
    s, vid = res.stats, res.video
    return {"hit": bool(s.hit), "resume_step": s.resume_step, "active_fraction": s.active_fraction,
            "mask_density": s.mask_density, "dit_forwards": s.dit_forwards, "peak_gpu_bytes": peak,
            "video_shape": None if vid is None else list(vid.shape), "video_finite": None if vid is None else bool(np.isfinite(vid).all()),
            "timings": {k: round(float(v), 4) for k, v in s.timings.items()}}


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_scale(cfg: ScaleConfig, out: Path, progress: Callable[[str], None] = print) -> dict:
    """Run the dense, replayed-hit and kernel measurements of ``cfg``; write ``out``/report.json and report.md."""
    from carnator.attention.kernels import set_block_sparse_kernel, set_flex_kernel_options

    spec = SPECS[cfg.model]
    frames = cfg.frames or spec.frames
    spec.check_frames(frames)
    previous = set_flex_kernel_options(cfg.flex_options)
    previous_kernel = set_block_sparse_kernel(cfg.sparse_kernel)
    try:
        return _run_scale(cfg, spec, frames, out, progress)
    finally:
        set_flex_kernel_options(previous)
        set_block_sparse_kernel(previous_kernel)


def _run_scale(cfg: ScaleConfig, spec: ScaleSpec, frames: int, out: Path, progress: Callable[[str], None]) -> dict:
    from carnator import Carnator, EngineConfig
    from carnator.cache import CacheBank, StoreSpec
    from carnator.policies.carnator import EVIDENCE_PREFIX, MASK_PREFIX
    from carnator.signature import early_signature
    from carnator.policies.carnator import CarnatorPolicy
    from carnator.testing import hashed_embedder

    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    rep: dict[str, Any] = {"config": {**asdict(cfg), "frames": frames}, "spec": asdict(spec),
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "prompts": [PROMPT_SOURCE, PROMPT_TARGET]}

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    pipe = build_pipeline(spec, dev, dtype)
    rep["build_seconds"] = time.perf_counter() - t0
    progress(f"built {spec.name} in {rep['build_seconds']:.0f}s")

    cache_root = Path(tempfile.mkdtemp(prefix="carnator-scale-"))
    ccfg = _carnator_config(cfg)
    steps = cfg.steps
    r = max(cfg.resume_step, ccfg.probe_steps)
    baselines = baseline_policies(cfg, steps)
    base_steps = {b: _baseline_entry_steps(pol, cfg, steps) for b, pol in baselines.items()}
    first = min([r - 1, *(i for st in base_steps.values() for i in st), *(f - 1 for f in cfg.frame_steps)])
    econf = EngineConfig(capture_steps=list(range(first, steps)), latent_dtype="float16", store_video=False)
    eng = Carnator(pipe, CacheBank(cache_root), config=econf, embedder=hashed_embedder(64))
    eng.use_policy(CarnatorPolicy(ccfg))
    for pol in baselines.values():
        eng.use_policy(pol)
    kw = {"num_frames": frames, "height": spec.height, "width": spec.width, "num_inference_steps": steps,
          "guidance_scale": spec.guidance_scale}

    def peak_reset():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak():
        return int(torch.cuda.max_memory_allocated()) if cuda else None

    # Warm-up: kernels, cuDNN/cuBLAS handles, the allocator (2 steps, not measured).
    eng.generate(PROMPT_SOURCE, seed=1, policy="dense", store=False, **{**kw, "num_inference_steps": 2})
    req = eng.adapter.resolve(PROMPT_SOURCE, seed=0, **kw)
    grid = eng.adapter.token_grid(req)
    n_tok = int(np.prod(grid))
    rep["tokens"] = n_tok
    rep["token_grid"] = list(grid)
    progress(f"{n_tok} tokens {tuple(grid)}; dense run ({steps} steps)")

    peak_reset()
    dense = eng.generate(PROMPT_SOURCE, seed=0, policy="dense", store=True, **kw)
    eng.flush()  # its entry (written behind on a GPU) is read below
    rep["dense"] = _stage_row(dense, peak())
    dense_e2e = dense.stats.timings["total"] - dense.stats.timings.get("store", 0.0)
    rep["dense"]["e2e_seconds"] = dense_e2e
    progress(f"dense E2E {dense_e2e:.1f}s (DiT {dense.stats.timings['dit']:.1f}s)")

    base = eng.store.load(dense.stats.entry_id)
    traj = {k: v for k, v in base.items() if k.startswith("traj.") and int(k[5:]) >= r - 1}
    tail_rgb = np.zeros((max(8, spec.height // 8), max(8, spec.width // 8), 3), dtype=np.float32)
    L = eng.adapter.num_layers()
    heads, head_dim = _self_attention_shape(pipe)
    nouns_src = eng.nouns(PROMPT_SOURCE)
    nouns_tgt = eng.nouns(PROMPT_TARGET)
    box = box_for_active_fraction(grid, cfg.active_fraction, ccfg.scope)
    sig = early_signature({n: box for n in nouns_src}, tail_rgb)
    ev = {EVIDENCE_PREFIX + n: torch.from_numpy(box.astype(np.uint8)) for n in nouns_src}

    ev_meta = types.SimpleNamespace(extra={})

    def replay(entry_id: str, policy: str):
        return replay_decision(policy, entry_id, cfg, steps, grid, source_prompt=PROMPT_SOURCE, target_prompt=PROMPT_TARGET,
                               source_nouns=nouns_src, target_nouns=nouns_tgt, source_extra=(eng.store.get(entry_id) or ev_meta).extra)

    if cuda:  # compile flex for this shape once, outside every measured request
        from carnator.attention.kernels import masked_attention

        t1 = time.perf_counter()
        qkv = torch.randn(3, 1, heads, n_tok, head_dim, device=dev, dtype=dtype)
        wm = synthetic_masks(heads, n_tok, cfg.block, 0.3, steps=[0], branches=[0], layers=[0], device=dev).get(0, 0, 0, device=dev)
        masked_attention(qkv[0], qkv[1], qkv[2], wm[None], block=cfg.block)
        torch.cuda.synchronize()
        rep["flex_compile_seconds"] = time.perf_counter() - t1
        del qkv

    hits, prev = [], None
    for d in cfg.densities:
        masks = synthetic_masks(heads, n_tok, cfg.block, d, steps=range(0, steps, cfg.mask_stride), layers=range(L), seed=2, device=dev)
        if prev is not None:
            eng.store.evict([prev])
        prev = eng.store.admit(StoreSpec(tenant="default", compat_key=eng.compat_key(req, "carnator"), prompt=PROMPT_SOURCE, seed=0,
                                        embedding=eng.embedder(PROMPT_SOURCE), steps_saved=float(steps),
                                        tensors={**traj, **masks.to_tensors(MASK_PREFIX), **ev},
                                        extra={"steps": steps, "nouns": nouns_src, "signature": sig.to_dict()}))
        meta = eng.store.get(prev)
        cold = _drop_page_cache()
        t1 = time.perf_counter()
        eng.store.load(prev)
        load_s = time.perf_counter() - t1
        peak_reset()
        hit = eng.generate(PROMPT_TARGET, seed=0, policy="carnator", store=False, decision=replay(prev, "carnator"), **kw)
        row = _stage_row(hit, peak())
        row.update({"density_requested": d, "entry_bytes": meta.nbytes, "mask_bytes": masks.nbytes,
                    "entry_load_seconds": load_s, "entry_load_cold": cold, "e2e_seconds": hit.stats.timings["total"],
                    "speedup_e2e": dense_e2e / hit.stats.timings["total"],
                    "speedup_dit": dense.stats.timings["dit"] / hit.stats.timings["dit"]})
        hits.append(row)
        progress(f"hit d={d}: E2E {row['e2e_seconds']:.1f}s speedup {row['speedup_e2e']:.2f}x (hit={row['hit']}, "
                 f"active {row['active_fraction']}, density {row['mask_density']})")
    rep["hits"] = hits

    d0 = cfg.densities[0]
    tiers = []
    if cfg.frame_steps:  # one set of masks serves every frame tier's entry
        masks = synthetic_masks(heads, n_tok, cfg.block, d0, steps=range(0, steps, cfg.mask_stride), layers=range(L), seed=2, device=dev)
    for f in cfg.frame_steps:  # frame tiers: the source's latent at f - 1 and its masks, nothing else
        if prev is not None:
            eng.store.evict([prev])
        prev = eng.store.admit(StoreSpec(tenant="default", compat_key=eng.compat_key(req, "carnator"), prompt=PROMPT_SOURCE, seed=0,
                                        embedding=eng.embedder(PROMPT_SOURCE), steps_saved=float(f),
                                        tensors={f"traj.{f - 1}": base[f"traj.{f - 1}"], **masks.to_tensors(MASK_PREFIX)},
                                        extra={"steps": steps, "nouns": nouns_src}))
        meta = eng.store.get(prev)
        peak_reset()
        hit = eng.generate(PROMPT_TARGET, seed=0, policy="carnator", store=False, decision=replay(prev, f"frame@{f}"), **kw)
        row = _stage_row(hit, peak())
        row.update({"frame_step": f, "density_requested": d0, "entry_bytes": meta.nbytes, "e2e_seconds": hit.stats.timings["total"],
                    "probe": hit.stats.notes.get("probe"), "speedup_e2e": dense_e2e / hit.stats.timings["total"],
                    "speedup_dit": dense.stats.timings["dit"] / hit.stats.timings["dit"]})
        tiers.append(row)
        progress(f"frame tier from step {f}: E2E {row['e2e_seconds']:.1f}s speedup {row['speedup_e2e']:.2f}x (hit={row['hit']}, "
                 f"density {row['mask_density']})")
    if cfg.frame_steps:  # a miss under frame tiers only (the shipped kind): no probe, this request's masks captured
        peak_reset()
        miss = eng.generate(PROMPT_TARGET, seed=0, policy="carnator", store=False, decision=replay(prev, "frame-miss"), **kw)
        row = _stage_row(miss, peak())
        row.update({"e2e_seconds": miss.stats.timings["total"], "probe": miss.stats.notes.get("probe"),
                    "speedup_e2e": dense_e2e / miss.stats.timings["total"], "speedup_dit": dense.stats.timings["dit"] / miss.stats.timings["dit"]})
        rep["frame_miss"] = row
        progress(f"miss under frame tiers: E2E {row['e2e_seconds']:.1f}s ({row['speedup_e2e']:.2f}x of dense)")
    rep["frame_tiers"] = tiers
    rows = {}
    if baselines:  # the baselines' gate would recall the dense request's own entry (all its latents, no masks)
        eng.store.evict([dense.stats.entry_id])
    for b, pol in baselines.items():
        tensors = {f"traj.{i}": base[f"traj.{i}"] for i in base_steps[b]}
        if b == "chorus2":
            masks = synthetic_masks(heads, n_tok, cfg.block, d0, steps=range(0, steps, cfg.mask_stride), layers=range(L), seed=2, device=dev)
            tensors.update(masks.to_tensors(MASK_PREFIX))
        if prev is not None:
            eng.store.evict([prev])
        prev = eng.store.admit(StoreSpec(tenant="default", compat_key=eng.compat_key(req, b), prompt=PROMPT_SOURCE, seed=0,
                                        embedding=eng.embedder(PROMPT_SOURCE), steps_saved=float(steps), tensors=tensors,
                                        extra={"steps": steps, "nouns": nouns_src}))
        meta = eng.store.get(prev)
        peak_reset()
        hit = eng.generate(PROMPT_TARGET, seed=0, policy=pol.name, store=False, decision=replay(prev, b), **kw)
        row = _stage_row(hit, peak())
        row.update({"policy": b, "entry_bytes": meta.nbytes, "e2e_seconds": hit.stats.timings["total"],
                    "speedup_e2e": dense_e2e / hit.stats.timings["total"], "speedup_dit": dense.stats.timings["dit"] / hit.stats.timings["dit"],
                    "density_requested": d0 if b == "chorus2" else None})
        rows[b] = row
        progress(f"{b} hit: E2E {row['e2e_seconds']:.1f}s speedup {row['speedup_e2e']:.2f}x (hit={row['hit']}, resume {row['resume_step']}, "
                 f"active {row['active_fraction']}, density {row['mask_density']})")
    rep["baselines"] = rows

    if cfg.intra_cache:
        rep["composed"] = _composed(cfg, pipe, req, kw, traj_keys=sorted(traj), ev=ev, sig=sig, nouns=nouns_src, replay=replay, dense_e2e=dense_e2e,
                                    dense_dit=dense.stats.timings["dit"], heads=heads, n_tok=n_tok, layers=L, cache_root=cache_root,
                                    peak_reset=peak_reset, peak=peak, progress=progress)

    if cfg.kernels and cuda:
        rep["kernels"] = kernel_bench(heads, n_tok, head_dim, cfg.densities, block=cfg.block, option_sets=[None, *cfg.kernel_sweep])
        progress("kernels: " + ", ".join(f"d={k['density']:.2f} {k['ratio_to_limit']:.2f}x limit" for k in rep["kernels"]["rows"]))

    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "report.md").write_text(to_markdown(rep))
    return rep


def _self_attention_shape(pipe) -> tuple[int, int]:
    """(heads, head dim) of the transformer's self-attention (Wan's and LTX's configs both name them so)."""
    c = pipe.transformer.config
    return int(c.num_attention_heads), int(c.attention_head_dim)


def _composed(cfg, pipe, req, kw, *, traj_keys, ev, sig, nouns, replay, dense_e2e, dense_dit, heads, n_tok, layers, cache_root,
              peak_reset, peak, progress) -> dict:
    """Dense and a replayed hit with ``cfg.intra_cache`` on (its own engine and cache keys)."""
    from carnator import Carnator, EngineConfig
    from carnator.cache import CacheBank, StoreSpec
    from carnator.policies.carnator import MASK_PREFIX, CarnatorPolicy
    from carnator.testing import hashed_embedder

    steps = cfg.steps
    r = max(cfg.resume_step, 4)
    ccfg = _carnator_config(cfg)
    econf = EngineConfig(capture_steps=list(range(r - 1, steps)), latent_dtype="float16", store_video=False, intra_cache=cfg.intra_cache)
    eng = Carnator(pipe, CacheBank(cache_root / "composed"), config=econf, embedder=hashed_embedder(64))
    eng.use_policy(CarnatorPolicy(ccfg))
    peak_reset()
    dense = eng.generate(PROMPT_SOURCE, seed=0, policy="dense", store=True, **kw)
    eng.flush()  # its entry (written behind on a GPU) is read below
    d_row = _stage_row(dense, peak())
    d_row["e2e_seconds"] = dense.stats.timings["total"] - dense.stats.timings.get("store", 0.0)
    d_row["speedup_e2e"] = dense_e2e / d_row["e2e_seconds"]
    base = eng.store.load(dense.stats.entry_id)
    d0 = cfg.densities[0]
    masks = synthetic_masks(heads, n_tok, cfg.block, d0, steps=range(0, steps, cfg.mask_stride), layers=range(layers), seed=2,
                            device=next(pipe.transformer.parameters()).device)
    eid = eng.store.admit(StoreSpec(tenant="default", compat_key=eng.compat_key(req, "carnator"), prompt=PROMPT_SOURCE, seed=0,
                                   embedding=eng.embedder(PROMPT_SOURCE), steps_saved=float(steps),
                                   tensors={**{k: base[k] for k in traj_keys}, **masks.to_tensors(MASK_PREFIX), **ev},
                                   extra={"steps": steps, "nouns": nouns, "signature": sig.to_dict()}))
    assert eid is not None
    peak_reset()
    hit = eng.generate(PROMPT_TARGET, seed=0, policy="carnator", store=False, decision=replay(eid, "carnator"), **kw)
    h_row = _stage_row(hit, peak())
    h_row.update({"density_requested": d0, "e2e_seconds": hit.stats.timings["total"], "speedup_e2e": dense_e2e / hit.stats.timings["total"],
                  "speedup_dit": dense_dit / hit.stats.timings["dit"], "intra_cache": hit.stats.notes.get("intra_cache")})
    progress(f"{cfg.intra_cache}: dense+cache {d_row['speedup_e2e']:.2f}x, hit+cache {h_row['speedup_e2e']:.2f}x (vs plain dense)")
    return {"intra_cache": cfg.intra_cache, "dense": d_row, "hit": h_row}


def to_markdown(rep: dict) -> str:
    c, d = rep["config"], rep["dense"]
    lines = [f"## {rep['spec']['name']}: {rep['spec']['height']}x{rep['spec']['width']}, {c['frames']} frames, {c['steps']} steps, "
             f"CFG {rep['spec']['guidance_scale']} ({rep['tokens']} tokens)",
             "",
             *([rep["spec"]["note"] + ".", ""] if rep["spec"].get("note") else []),
             f"Device {rep['device']}, torch {rep['torch']}, {rep['date']}. Replayed plan: resume step {c['resume_step']}, "
             f"Active fraction {c['active_fraction']}, layer window {c['window']}, masks every {c['mask_stride']} steps, block {c['block']}.",
             "",
             "| run | E2E s | speedup | DiT s | DiT speedup | recall | probe | signature | decision | plan (entry+masks) | decode | peak GPU GiB | entry MB | entry load s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def t(row, k):
        v = row["timings"].get(k)
        return "-" if v is None else f"{v:.3f}"

    def gib(b):
        return "-" if b is None else f"{b / 2**30:.1f}"

    lines.append(f"| dense | {d['e2e_seconds']:.2f} | 1.00x | {d['timings']['dit']:.2f} | 1.00x | - | - | - | - | - | {t(d, 'decode')} | {gib(d['peak_gpu_bytes'])} | - | - |")
    for h in rep["hits"]:
        lines.append(f"| hit, mask density {h['mask_density']:.2f}, active {h['active_fraction']:.2f} | {h['e2e_seconds']:.2f} | {h['speedup_e2e']:.2f}x | "
                     f"{h['timings']['dit']:.2f} | {h['speedup_dit']:.2f}x | {t(h, 'recall')} | {t(h, 'probe')} | {t(h, 'signature')} | "
                     f"{t(h, 'decision')} | {t(h, 'plan')} | {t(h, 'decode')} | {gib(h['peak_gpu_bytes'])} | {h['entry_bytes'] / 1e6:.1f} | "
                     f"{h['entry_load_seconds']:.2f}{'' if h['entry_load_cold'] else ' (warm)'} |")
    for b, h in rep.get("baselines", {}).items():
        plan = {"nirvana": f"resume step {h['resume_step']}", "chorus": f"stage 2 from step {h['resume_step']}, active {h['active_fraction'] or 0:.2f}",
                "chorus2": f"mask density {h['mask_density'] or 0:.2f}"}.get(b, "")
        lines.append(f"| {b} hit, {plan} | {h['e2e_seconds']:.2f} | {h['speedup_e2e']:.2f}x | {h['timings']['dit']:.2f} | {h['speedup_dit']:.2f}x | "
                     f"{t(h, 'recall')} | - | - | - | {t(h, 'plan')} | {t(h, 'decode')} | {gib(h['peak_gpu_bytes'])} | {h['entry_bytes'] / 1e6:.1f} | - |")
    for h in rep.get("frame_tiers", []):
        lines.append(f"| frame tier from step {h['frame_step']}, mask density {h['mask_density'] or 0:.2f} (no probe) | {h['e2e_seconds']:.2f} | "
                     f"{h['speedup_e2e']:.2f}x | {h['timings']['dit']:.2f} | {h['speedup_dit']:.2f}x | {t(h, 'recall')} | - | - | "
                     f"{t(h, 'decision')} | {t(h, 'plan')} | {t(h, 'decode')} | {gib(h['peak_gpu_bytes'])} | {h['entry_bytes'] / 1e6:.1f} | - |")
    m = rep.get("frame_miss")
    if m:
        lines.append(f"| miss under frame tiers (no probe, masks captured) | {m['e2e_seconds']:.2f} | {m['speedup_e2e']:.2f}x | {m['timings']['dit']:.2f} | "
                     f"{m['speedup_dit']:.2f}x | {t(m, 'recall')} | - | - | {t(m, 'decision')} | - | {t(m, 'decode')} | {gib(m['peak_gpu_bytes'])} | - | - |")
    if rep["hits"]:
        h = rep["hits"][0]
        over = sum(h["timings"].get(k, 0.0) for k in ("recall", "signature", "decision"))
        lines += ["", f"Overheads (recall + signature + decision) on a hit: {over:.3f} s = {100 * over / d['e2e_seconds']:.2f} % of dense E2E."]
    comp = rep.get("composed")
    if comp:
        cd, ch = comp["dense"], comp["hit"]
        lines += ["", f"With diffusers' intra-request cache `{comp['intra_cache']}` (speedups against plain dense above): dense + cache "
                  f"{cd['e2e_seconds']:.2f} s ({cd['speedup_e2e']:.2f}x); carnator hit + cache at density {ch['density_requested']} "
                  f"{ch['e2e_seconds']:.2f} s ({ch['speedup_e2e']:.2f}x E2E, {ch['speedup_dit']:.2f}x DiT)."]
    k = rep.get("kernels")
    if k:
        lines += ["", f"Kernels at {k['shape']} bf16, block {k['block']}: cuDNN SDPA {k['sdpa_cudnn_ms']:.2f} ms, default SDPA "
                  f"{k['sdpa_default_ms']:.2f} ms, compiled flex (all blocks) {k['flex_dense_ms']:.2f} ms; flex vs masked SDPA max error "
                  f"{k['flex_check_max_err']:.1e}.", "",
                  "| density | flex ms | limit = d x cuDNN ms | flex / limit | BlockMask build ms | flex incl. build ms |", "|---|---|---|---|---|---|"]
        for r in k["rows"]:
            lines.append(f"| {r['density']:.3f} | {r['flex_ms']:.2f} | {r['limit_ms']:.2f} | {r['ratio_to_limit']:.2f}x | {r['mask_build_ms']:.2f} | {r['flex_with_build_ms']:.2f} |")
        if len(k.get("variants", [])) > 1:
            lines += ["", "FlexAttention kernel options (the first row set is the one above):", "",
                      "| kernel_options | flex all blocks ms | density | flex ms | flex / limit | max diff vs flex's own |", "|---|---|---|---|---|---|"]
            for var in k["variants"]:
                name = json.dumps(var["options"]) if var["options"] else "(flex's heuristics)"
                if "error" in var:
                    lines.append(f"| {name} | failed: {var['error']} | | | | |")
                    continue
                for i, r in enumerate(var["rows"]):
                    head = (name, f"{var['flex_dense_ms']:.2f}") if i == 0 else ("", "")
                    lines.append(f"| {head[0]} | {head[1]} | {r['density']:.3f} | {r['flex_ms']:.2f} | {r['ratio_to_limit']:.2f}x | {var['max_err_vs_default_options']:.1e} |")
    return "\n".join(lines) + "\n"
