"""CogVideoX adapter: CogVideoXPipeline (CogVideoX 1.0 2B/5B and 1.5 text-to-video).

Latents are (B, T, C, H, W) (frames before channels). In the transformer's joint attention the
text tokens (T5, padded to ``max_sequence_length``) come *first*, so a text index is also a joint
index. CogVideoX 1.5 patches time too (``patch_size_t``): the pipeline pads the latent frames up to a
multiple of it and drops the padding before decoding.

Schedulers: CogVideoXDDIMScheduler steps statelessly; CogVideoXDPMScheduler is a stochastic
multistep solver that needs the previous step's x0 prediction and draws noise from the request's
generator. The x0 history is kept per run, keyed by the run's generator (one per DenoiseState).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request
from .base import BackboneAdapter, Conditioning, GenerationDefaults


class CogVideoXAdapter(BackboneAdapter):
    family = "cogvideox"
    pipeline_classes = ("CogVideoXPipeline",)
    supports_attention = True
    intra_cache_options = {
        "taylorseer": {"cache_identifiers": [r"transformer_blocks\.\d+\.(attn1|ff)"]},
        "faster": {"tensor_format": "BFCHW"},
    }

    # CogVideoXPipeline.__call__ options a request does not carry; these are the pipeline's defaults.
    max_sequence_length: int = 226
    use_dynamic_cfg: bool = False
    eta: float = 0.0

    def __init__(self, pipe):
        super().__init__(pipe)
        self._rope_cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def install_attention(self) -> None:
        from .cogvideox_attention import apply_carnator_attention

        apply_carnator_attention(self.transformer)

    def num_layers(self) -> int:
        return len(self.transformer.transformer_blocks)

    def defaults(self) -> GenerationDefaults:
        # CogVideoXPipeline.__call__ falls back to the transformer's sample size.
        cfg, s = self.transformer.config, self.pipe.vae_scale_factor_spatial
        return GenerationDefaults(
            num_inference_steps=50, num_frames=cfg.sample_frames, height=cfg.sample_height * s, width=cfg.sample_width * s, guidance_scale=6.0
        )

    # geometry ---------------------------------------------------------------------------------
    def _latent_frames(self, req: Request) -> tuple[int, int]:
        """(latent frames including padding, padding frames) as CogVideoXPipeline computes them."""
        t = (req.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        pt = self.transformer.config.patch_size_t
        pad = 0 if pt is None or t % pt == 0 else pt - t % pt
        return t + pad, pad

    def check_geometry(self, req: Request) -> None:
        p, cfg = self.pipe, self.transformer.config
        ts = p.vae_scale_factor_temporal
        if (req.num_frames - 1) % ts != 0:
            raise InvalidRequestError(f"num_frames must be {ts}*k+1 for this model (e.g. {ts * ((req.num_frames - 1) // ts) + 1}), got {req.num_frames}")
        mult = int(np.lcm(8, p.vae_scale_factor_spatial * cfg.patch_size))  # check_inputs wants 8; patching wants more
        if req.height % mult or req.width % mult:
            raise InvalidRequestError(f"height and width must be multiples of {mult} for this model, got {req.height}x{req.width}")
        s = p.vae_scale_factor_spatial
        if cfg.use_learned_positional_embeddings and (req.height, req.width) != (cfg.sample_height * s, cfg.sample_width * s):
            raise InvalidRequestError(f"this model only generates {cfg.sample_height * s}x{cfg.sample_width * s} videos, got {req.height}x{req.width}")
        # 1.5's rotary table is sliced from the sample size, so larger grids have no positions.
        sliced_rope = cfg.patch_size_t is not None and cfg.use_rotary_positional_embeddings
        if sliced_rope and (req.height > cfg.sample_height * s or req.width > cfg.sample_width * s):
            raise InvalidRequestError(f"height and width must be at most {cfg.sample_height * s}x{cfg.sample_width * s} for this model, got {req.height}x{req.width}")

    def token_grid(self, req: Request) -> tuple[int, int, int]:
        cfg, s = self.transformer.config, self.pipe.vae_scale_factor_spatial
        t, _ = self._latent_frames(req)
        return t // (cfg.patch_size_t or 1), req.height // (s * cfg.patch_size), req.width // (s * cfg.patch_size)

    def latent_weight(self, weight: np.ndarray, latents: torch.Tensor) -> torch.Tensor:
        """Latents are (B, T, C, H, W): the token-grid weight upsampled to (1, T, 1, H, W)."""
        from ..reuse import upsample_tokens

        t, h, w = latents.shape[1], latents.shape[3], latents.shape[4]
        patch = (t // weight.shape[0], h // weight.shape[1], w // weight.shape[2])
        return torch.from_numpy(upsample_tokens(weight, patch).astype(np.float32))[None, :, None].to(latents.device)

    def predicted_x0(self, scheduler, latents: torch.Tensor, noise_pred: torch.Tensor, step: int) -> torch.Tensor:
        """The clean-latent estimate at ``step`` from the DDIM/DPM scheduler's cumulative alphas (epsilon or v prediction)."""
        s = scheduler
        t = int(s.timesteps[step])
        a = s.alphas_cumprod[t].to(latents.device, torch.float32)
        x, out = latents.float(), noise_pred.float()
        if s.config.prediction_type == "v_prediction":
            return a.sqrt() * x - (1 - a).sqrt() * out
        return (x - (1 - a).sqrt() * out) / a.sqrt()

    # text ---------------------------------------------------------------------------------------
    def prompt_token_ids(self, prompt: str) -> list[int]:
        return self.pipe.tokenizer(prompt, add_special_tokens=True, truncation=True, max_length=self.max_sequence_length)["input_ids"]

    def word_token_positions(self, prompt: str, word: str, modifiers: int = 0) -> list[int]:
        return [i for i in super().word_token_positions(prompt, word, modifiers) if i < self.max_sequence_length]

    def encode(self, req: Request) -> Conditioning:
        do_cfg = req.guidance_scale > 1.0
        with torch.no_grad():
            pe, ne = self.pipe.encode_prompt(
                req.prompt,
                req.negative_prompt,
                do_cfg,
                num_videos_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        if do_cfg:  # one batched forward, uncond first, exactly as CogVideoXPipeline does
            pe = torch.cat([ne, pe], dim=0)
        return Conditioning(data={"embeds": pe}, do_cfg=do_cfg)

    # latents and schedule -------------------------------------------------------------------------
    @property
    def _dtype(self) -> torch.dtype:
        """The pipeline keeps latents in the prompt embeddings' dtype (the text encoder's)."""
        return self.pipe.text_encoder.dtype

    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor:
        t, _ = self._latent_frames(req)
        frames = (t - 1) * self.pipe.vae_scale_factor_temporal + 1
        return self.pipe.prepare_latents(
            1, self.transformer.config.in_channels, frames, req.height, req.width, self._dtype, self.device, generator, None
        )

    def timesteps(self, scheduler, req: Request) -> torch.Tensor:
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import retrieve_timesteps

        ts, _ = retrieve_timesteps(scheduler, req.num_inference_steps, self.device, None)
        return ts

    def _rotary(self, req: Request, latent_frames: int):
        if not self.transformer.config.use_rotary_positional_embeddings:
            return None
        key = (req.height, req.width, latent_frames, str(self.device))
        cached = self._rope_cache  # one read: another request may replace it meanwhile
        if cached is None or cached[0] != key:
            cached = self._rope_cache = (key, self.pipe._prepare_rotary_positional_embeddings(req.height, req.width, latent_frames, self.device))
        return cached[1]

    def predict(self, latents, t, step, cond, req):
        tr = self.transformer
        x = torch.cat([latents] * 2) if cond.do_cfg else latents
        x = self.pipe.scheduler.scale_model_input(x, t)  # stateless for DDIM and CogVideoX's DPM (returns x)
        self._branches((1, 0) if cond.do_cfg else (0,), step)  # uncond rows first
        with torch.no_grad(), self.branch_context("cond_uncond" if cond.do_cfg else "cond", step, t, req, cond.do_cfg):
            out = tr(
                hidden_states=x,
                encoder_hidden_states=cond.data["embeds"],
                timestep=t.expand(x.shape[0]),
                image_rotary_emb=self._rotary(req, latents.size(1)),
                return_dict=False,
            )[0]
        out = out.float()
        g = req.guidance_scale
        if self.use_dynamic_cfg:  # the pipeline's formula, verbatim
            n = req.num_inference_steps
            g = 1 + g * ((1 - math.cos(math.pi * ((n - t.item()) / n) ** 5.0)) / 2)
        if cond.do_cfg:
            unc, txt = out.chunk(2)
            out = unc + g * (txt - unc)
        return out

    def step(self, scheduler, noise_pred, t, latents, generator):
        from diffusers import CogVideoXDPMScheduler

        s = scheduler
        kwargs = self.pipe.prepare_extra_step_kwargs(generator, self.eta)
        if not isinstance(s, CogVideoXDPMScheduler):
            out = s.step(noise_pred, t, latents, **kwargs, return_dict=False)[0]
            return out.to(self._dtype)
        i = int((s.timesteps == t).nonzero()[0, 0])
        prev = getattr(s, "_carnator_x0", None)  # (next step, x0) of this request's run
        old_x0 = prev[1] if prev is not None and prev[0] == i else None  # no history (fresh or resumed run): first order
        back = s.timesteps[i - 1] if i > 0 else None
        out, x0 = s.step(noise_pred, old_x0, t, back, latents, **kwargs, return_dict=False)
        s._carnator_x0 = (i + 1, x0)
        return out.to(self._dtype)

    def seek(self, scheduler, step: int) -> None:
        """Resume at ``step`` with no DPM history: the next DPM step is first order, as at step 0.

        DDIM needs nothing (it is stateless). DPM also draws noise from the run's generator, so a
        resumed DPM run matches a dense one only in distribution, never exactly.
        """
        super().seek(scheduler, step)
        scheduler._carnator_x0 = None

    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        _, pad = self._latent_frames(req)
        with torch.no_grad():
            video = self.pipe.decode_latents(latents[:, pad:])
            return self.pipe.video_processor.postprocess_video(video=video, output_type="np")[0]
