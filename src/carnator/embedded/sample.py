"""Batched dense sampling of the embedded model (training-time evaluation and benchmarks).

Same arithmetic as the engine's loop with :class:`~carnator.backbones.embedded.EmbeddedAdapter`
(UniPC flow solver, CFG with the empty negative prompt), over many prompts at once.
"""

from __future__ import annotations

import copy

import torch

from .model import EmbeddedPipeline


@torch.no_grad()
def sample_batch(pipe: EmbeddedPipeline, prompts: list[str], seeds: list[int], *, steps: int | None = None, guidance_scale: float | None = None) -> torch.Tensor:
    """Generate one clip per prompt; returns pixels (B, 3, T, H, W) in [0, 1]."""
    from diffusers.utils.torch_utils import randn_tensor

    c = pipe.cfg
    dev = pipe._execution_device
    s = c.size // c.codec_factor
    lat = torch.cat([
        randn_tensor((1, c.latent_channels, c.frames, s, s), generator=torch.Generator("cpu").manual_seed(int(sd)), device=dev, dtype=torch.float32)
        for sd in seeds
    ])
    lat, _ = denoise_batch(pipe, prompts, lat, steps=steps, guidance_scale=guidance_scale)
    return pipe.vae.decode(lat).clamp(0, 1)


@torch.no_grad()
def denoise_batch(pipe: EmbeddedPipeline, prompts: list[str], lat: torch.Tensor, *, steps: int | None = None,
                  guidance_scale: float | None = None, keep_step: int | None = None) -> tuple[torch.Tensor, tuple | None]:
    """Run the sampler from noise ``lat`` (B, C, F, H, W); returns the final latents and, with ``keep_step``, that
    step's (input latents, timestep)."""
    c = pipe.cfg
    steps = steps or c.num_inference_steps
    g = c.guidance_scale if guidance_scale is None else guidance_scale
    dev = pipe._execution_device
    dtype = next(pipe.transformer.parameters()).dtype
    B = len(prompts)
    emb = pipe.encode_text(list(prompts) + [""]).to(dtype)
    cond, unc = emb[:B], emb[B:].expand(B, -1, -1)
    sched = copy.deepcopy(pipe.scheduler)
    sched.set_timesteps(steps, device=dev)
    sched.set_begin_index(0)
    kept = None
    for i, t in enumerate(sched.timesteps):
        if i == keep_step:
            kept = (lat.clone(), t)
        x = lat.to(dtype)
        xx, tt = torch.cat([x, x]), t.expand(2 * B)
        out = pipe.velocity(xx, tt, pipe.transformer(hidden_states=xx, timestep=tt, encoder_hidden_states=torch.cat([cond, unc]), return_dict=False)[0])
        pred = out[B:] + g * (out[:B] - out[B:])
        lat = sched.step(pred, t, lat, return_dict=False)[0]
    return lat, kept
