"""Wan adapter: WanPipeline (Wan2.1-T2V, Wan2.2-TI2V text-to-video, and the embedded model)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request
from .base import BackboneAdapter, Conditioning, GenerationDefaults


class WanAdapter(BackboneAdapter):
    family = "wan"
    pipeline_classes = ("WanPipeline",)
    max_sequence_length = 512
    supports_attention = True
    intra_cache_options = {
        # diffusers' default patterns (``^blocks.*attn``, full match) hook nothing in Wan: name its attention and FFNs.
        "taylorseer": {"cache_identifiers": [r"blocks\.\d+\.(attn1|attn2|ffn)"]},
        "faster": {"tensor_format": "BCFHW"},
    }

    def install_attention(self) -> None:
        from .wan_attention import apply_carnator_attention

        apply_carnator_attention(self.transformer)

    def defaults(self) -> GenerationDefaults:
        # WanPipeline.__call__ defaults.
        return GenerationDefaults(num_inference_steps=50, num_frames=81, height=480, width=832, guidance_scale=5.0)

    # geometry ---------------------------------------------------------------------------------
    @property
    def _patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer.config.patch_size)

    def check_geometry(self, req: Request) -> None:
        p = self.pipe
        ts, ss = p.vae_scale_factor_temporal, p.vae_scale_factor_spatial
        if (req.num_frames - 1) % ts != 0:
            raise InvalidRequestError(f"num_frames must be {ts}*k+1 for this model (e.g. {ts * ((req.num_frames - 1) // ts) + 1}), got {req.num_frames}")
        mh, mw = ss * self._patch[1], ss * self._patch[2]
        mult = max(mh, mw, 16)
        if req.height % mult or req.width % mult:
            raise InvalidRequestError(f"height and width must be multiples of {mult} for this model, got {req.height}x{req.width}")

    def token_grid(self, req: Request) -> tuple[int, int, int]:
        p = self.pipe
        pt, ph, pw = self._patch
        t = (req.num_frames - 1) // p.vae_scale_factor_temporal + 1
        h = req.height // p.vae_scale_factor_spatial
        w = req.width // p.vae_scale_factor_spatial
        return t // pt, h // ph, w // pw

    # text ---------------------------------------------------------------------------------------
    def clean_prompt(self, prompt: str) -> str:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        return prompt_clean(prompt)

    def prompt_token_ids(self, prompt: str) -> list[int]:
        return self.pipe.tokenizer(self.clean_prompt(prompt), add_special_tokens=True)["input_ids"]

    def encode(self, req: Request) -> Conditioning:
        do_cfg = req.guidance_scale > 1.0
        with torch.no_grad():
            pe, ne = self.pipe.encode_prompt(
                prompt=req.prompt,
                negative_prompt=req.negative_prompt,
                do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        dtype = self.transformer.dtype
        return Conditioning(data={"cond": pe.to(dtype), "uncond": None if ne is None else ne.to(dtype)}, do_cfg=do_cfg)

    # latents and schedule -------------------------------------------------------------------------
    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor:
        return self.pipe.prepare_latents(
            1,
            self.transformer.config.in_channels,
            req.height,
            req.width,
            req.num_frames,
            torch.float32,
            self.device,
            generator,
            None,
        )

    def timesteps(self, scheduler, req: Request) -> torch.Tensor:
        s = scheduler
        s.set_timesteps(req.num_inference_steps, device=self.device)
        s.set_begin_index(0)
        return s.timesteps

    def predict(self, latents, t, step, cond, req):
        tr = self.transformer
        x = latents.to(tr.dtype)
        if self.pipe.config.expand_timesteps:
            # Wan2.2 TI2V: one timestep per latent token, built exactly as WanPipeline builds it.
            mask = torch.ones(latents.shape[2:], dtype=torch.float32, device=latents.device)
            timestep = (mask[:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        else:
            timestep = t.expand(latents.shape[0])

        def forward(name: str, hidden, ts, text):
            with self.branch_context(name, step, t, req, cond.do_cfg):
                return tr(hidden_states=hidden, timestep=ts, encoder_hidden_states=text, return_dict=False)[0]

        with torch.no_grad():
            if cond.do_cfg and self._one_forward_cfg():
                # An intra-request cache with one state for every call: both branches in one batch, uncond first.
                self._branches((1, 0), step)
                both = forward("cond_uncond", torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([cond.data["uncond"], cond.data["cond"]]))
                unc, out = both.chunk(2)
                return unc + req.guidance_scale * (out - unc)
            self._branches((0,), step)
            out = forward("cond", x, timestep, cond.data["cond"])
            if cond.do_cfg:
                self._branches((1,), step)
                unc = forward("uncond", x, timestep, cond.data["uncond"])
                out = unc + req.guidance_scale * (out - unc)
        return out

    def decode_tail(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        """The last latent frame decoded alone (the Early Signature's one VAE decode).

        Wan's VAE is causal in time, so a single latent frame decodes as a first frame: the same
        scene content without the temporal context, at 1/T of the cost (Wan2.1-1.3B, 480p: the full
        81-frame decode took 3.4 s of a hit's signature stage on the H200).
        """
        return self.decode(latents[:, :, -1:], req)[-1]

    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(vae.device, dtype=vae.dtype)
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
            z = z / inv_std + mean
            video = vae.decode(z, return_dict=False)[0]
            return self.pipe.video_processor.postprocess_video(video, output_type="np")[0]
