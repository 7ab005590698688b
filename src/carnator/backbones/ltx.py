"""LTX-Video adapter: LTXPipeline (text-to-video, LTX-Video 0.9.x).

LTX keeps its latents *packed*: (B, tokens, C * p_t * p * p), one row per visual token, and the
scheduler steps on that layout. Text enters through cross-attention (T5 embeddings plus a padding
mask), so text token positions are plain indices into the prompt's T5 tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request
from .base import BackboneAdapter, Conditioning, GenerationDefaults


class LTXAdapter(BackboneAdapter):
    family = "ltx"
    pipeline_classes = ("LTXPipeline",)
    supports_attention = True
    intra_cache_options = {
        # LTXAttention has no is_cross_attention flag, so by name: attn1 is self-attention, attn2 cross-attention.
        "pab": {"spatial_attention_block_identifiers": (r"transformer_blocks\.\d+\.attn1$",)},
        "taylorseer": {"cache_identifiers": [r"transformer_blocks\.\d+\.(attn1|attn2|ff)"]},
    }
    intra_cache_unsupported = {
        "faster": "diffusers' FasterCache splits frequencies of (B, C, F, H, W) or (B, F, C, H, W) outputs, and LTX's are packed tokens (B, S, C)",
    }

    # LTXPipeline.__call__ options a request does not carry; these are the pipeline's defaults.
    max_sequence_length: int = 128
    frame_rate: int = 25
    guidance_rescale: float = 0.0
    decode_timestep: float = 0.0
    decode_noise_scale: float | None = None

    def install_attention(self) -> None:
        from .ltx_attention import apply_carnator_attention

        apply_carnator_attention(self.transformer)

    def num_layers(self) -> int:
        return len(self.transformer.transformer_blocks)

    def defaults(self) -> GenerationDefaults:
        return GenerationDefaults(num_inference_steps=50, num_frames=161, height=512, width=704, guidance_scale=3.0)

    # geometry ---------------------------------------------------------------------------------
    def _latent_grid(self, req: Request) -> tuple[int, int, int]:
        p = self.pipe
        t = (req.num_frames - 1) // p.vae_temporal_compression_ratio + 1
        return t, req.height // p.vae_spatial_compression_ratio, req.width // p.vae_spatial_compression_ratio

    def check_geometry(self, req: Request) -> None:
        p = self.pipe
        ts, pt = p.vae_temporal_compression_ratio, p.transformer_temporal_patch_size
        if (req.num_frames - 1) % ts != 0:
            raise InvalidRequestError(f"num_frames must be {ts}*k+1 for this model (e.g. {ts * ((req.num_frames - 1) // ts) + 1}), got {req.num_frames}")
        if self._latent_grid(req)[0] % pt:
            raise InvalidRequestError(f"num_frames must give a multiple of {pt} latent frames for this model, got {req.num_frames}")
        # LTXPipeline.check_inputs wants multiples of 32; the VAE and patching may want more.
        mult = int(np.lcm(32, p.vae_spatial_compression_ratio * p.transformer_spatial_patch_size))
        if req.height % mult or req.width % mult:
            raise InvalidRequestError(f"height and width must be multiples of {mult} for this model, got {req.height}x{req.width}")

    def token_grid(self, req: Request) -> tuple[int, int, int]:
        t, h, w = self._latent_grid(req)
        p = self.pipe
        ps, pt = p.transformer_spatial_patch_size, p.transformer_temporal_patch_size
        return t // pt, h // ps, w // ps

    def latent_weight(self, weight: np.ndarray, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents (B, tokens, C * p_t * p * p) hold one row per visual token, in (T, H, W) order."""
        return torch.from_numpy(np.asarray(weight, dtype=np.float32).reshape(1, -1, 1)).to(latents.device)

    # text ---------------------------------------------------------------------------------------
    def prompt_token_ids(self, prompt: str) -> list[int]:
        return self.pipe.tokenizer(prompt, add_special_tokens=True, truncation=True, max_length=self.max_sequence_length)["input_ids"]

    def word_token_positions(self, prompt: str, word: str, modifiers: int = 0) -> list[int]:
        return [i for i in super().word_token_positions(prompt, word, modifiers) if i < self.max_sequence_length]

    def encode(self, req: Request) -> Conditioning:
        do_cfg = req.guidance_scale > 1.0
        with torch.no_grad():
            pe, pm, ne, nm = self.pipe.encode_prompt(
                prompt=req.prompt,
                negative_prompt=req.negative_prompt,
                do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        if do_cfg:  # one batched forward, uncond first, exactly as LTXPipeline does
            pe, pm = torch.cat([ne, pe], dim=0), torch.cat([nm, pm], dim=0)
        return Conditioning(data={"embeds": pe, "mask": pm}, do_cfg=do_cfg)

    # latents and schedule -------------------------------------------------------------------------
    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor:
        """Packed initial noise (1, tokens, C)."""
        return self.pipe.prepare_latents(
            1, self.transformer.config.in_channels, req.height, req.width, req.num_frames,
            torch.float32, self.device, generator, None,
        )

    def timesteps(self, scheduler, req: Request) -> torch.Tensor:
        from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

        s = scheduler
        n = req.num_inference_steps
        t, h, w = self._latent_grid(req)
        mu = calculate_shift(
            t * h * w,
            s.config.get("base_image_seq_len", 256),
            s.config.get("max_image_seq_len", 4096),
            s.config.get("base_shift", 0.5),
            s.config.get("max_shift", 1.15),
        )
        ts, _ = retrieve_timesteps(s, n, self.device, None, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        s.set_begin_index(0)
        return ts

    def predict(self, latents, t, step, cond, req):
        p, tr = self.pipe, self.transformer
        emb, mask = cond.data["embeds"], cond.data["mask"]
        x = torch.cat([latents] * 2) if cond.do_cfg else latents
        x = x.to(emb.dtype)
        lt, lh, lw = self._latent_grid(req)
        rope_scale = (p.vae_temporal_compression_ratio / self.frame_rate, p.vae_spatial_compression_ratio, p.vae_spatial_compression_ratio)
        self._branches((1, 0) if cond.do_cfg else (0,), step)  # uncond rows first
        with torch.no_grad(), self.branch_context("cond_uncond" if cond.do_cfg else "cond", step, t, req, cond.do_cfg):
            out = tr(
                hidden_states=x,
                encoder_hidden_states=emb,
                timestep=t.expand(x.shape[0]),
                encoder_attention_mask=mask,
                num_frames=lt,
                height=lh,
                width=lw,
                rope_interpolation_scale=rope_scale,
                return_dict=False,
            )[0]
        out = out.float()
        if cond.do_cfg:
            unc, txt = out.chunk(2)
            out = unc + req.guidance_scale * (txt - unc)
            if self.guidance_rescale > 0:
                from diffusers.pipelines.ltx.pipeline_ltx import rescale_noise_cfg

                out = rescale_noise_cfg(out, txt, guidance_rescale=self.guidance_rescale)
        return out

    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        p, vae = self.pipe, self.pipe.vae
        lt, lh, lw = self._latent_grid(req)
        with torch.no_grad():
            z = p._unpack_latents(latents, lt, lh, lw, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size)
            z = p._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            z = z.to(p.text_encoder.dtype)
            timestep = None
            if vae.config.timestep_conditioning:
                # LTXPipeline draws the decode noise from the request's generator right after the initial
                # noise (nothing in between uses it), so replay that draw.
                gen = self.make_generator(req)
                self.prepare_latents(req, gen)
                from diffusers.utils.torch_utils import randn_tensor

                noise = randn_tensor(z.shape, generator=gen, device=self.device, dtype=z.dtype)
                scale = self.decode_timestep if self.decode_noise_scale is None else self.decode_noise_scale
                timestep = torch.tensor([self.decode_timestep], device=self.device, dtype=z.dtype)
                scale = torch.tensor([scale], device=self.device, dtype=z.dtype)[:, None, None, None, None]
                z = (1 - scale) * z + scale * noise
            video = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
            return p.video_processor.postprocess_video(video, output_type="np")[0]
