"""HunyuanVideo adapter: HunyuanVideoPipeline (text-to-video, guidance-distilled).

The prompt is wrapped in a chat template, encoded by Llama (a hidden layer, with the first
``crop_start`` template tokens cropped off) and by CLIP (a pooled vector). In the transformer's joint
attention the text tokens sit *after* the video tokens: joint index = video tokens + text index.
``guidance_scale`` is the distilled guidance fed to the transformer as an embedding; real CFG
("true CFG", two forwards) runs only with ``true_cfg_scale > 1`` and a negative prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request
from .base import BackboneAdapter, Conditioning, GenerationDefaults


def _default_template() -> dict[str, Any]:
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return dict(DEFAULT_PROMPT_TEMPLATE)


class HunyuanVideoAdapter(BackboneAdapter):
    family = "hunyuan"
    pipeline_classes = ("HunyuanVideoPipeline",)
    supports_attention = True
    intra_cache_options = {
        "taylorseer": {"cache_identifiers": [r"transformer_blocks\.\d+\.(attn|ff|ff_context)", r"single_transformer_blocks\.\d+\.(attn|proj_mlp)"]},
        # Guidance-distilled: FasterCache's uncond skipping applies only with true CFG (then batched, uncond first).
        "faster": {
            "tensor_format": "BCFHW",
            "_unconditional_conditional_input_kwargs_identifiers": (
                "hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "pooled_projections", "guidance",
            ),
        },
    }

    # HunyuanVideoPipeline.__call__ options a request does not carry; these are the pipeline's defaults.
    max_sequence_length: int = 256
    true_cfg_scale: float = 1.0

    def __init__(self, pipe):
        super().__init__(pipe)
        self.prompt_template: dict[str, Any] = _default_template()

    def install_attention(self) -> None:
        from .hunyuan_attention import apply_carnator_attention

        apply_carnator_attention(self.transformer)

    def num_layers(self) -> int:
        """Dual-stream blocks, then single-stream blocks (carnator's layer numbering)."""
        tr = self.transformer
        return len(tr.transformer_blocks) + len(tr.single_transformer_blocks)

    def defaults(self) -> GenerationDefaults:
        return GenerationDefaults(num_inference_steps=50, num_frames=129, height=720, width=1280, guidance_scale=6.0)

    def limits(self):
        """The shared bounds; the text limit is the Llama sequence the transformer sees: the prompt and the template's
        end after the crop, ``max_sequence_length`` tokens (the CLIP encoder's pooled vector reads fewer, 77)."""
        from ..request import RequestLimits

        tok, template = self.pipe.tokenizer, self.prompt_template["template"]
        # The prompt's tokens and the template's after it (its closing <|eot_id|>); the part before is cropped off.
        around = len(tok(template.format(""))["input_ids"]) - len(tok(template.split("{}")[-1], add_special_tokens=False)["input_ids"])

        def count(text: str) -> int:
            return len(tok(template.format(text))["input_ids"]) - around

        return RequestLimits(max_prompt_tokens=self.max_sequence_length, count_tokens=count)

    # geometry ---------------------------------------------------------------------------------
    @property
    def _patch(self) -> tuple[int, int]:
        cfg = self.transformer.config
        return cfg.patch_size_t, cfg.patch_size

    def _latent_grid(self, req: Request) -> tuple[int, int, int]:
        p = self.pipe
        t = (req.num_frames - 1) // p.vae_scale_factor_temporal + 1
        return t, req.height // p.vae_scale_factor_spatial, req.width // p.vae_scale_factor_spatial

    def check_geometry(self, req: Request) -> None:
        p = self.pipe
        ts = p.vae_scale_factor_temporal
        pt, ps = self._patch
        if (req.num_frames - 1) % ts != 0:
            raise InvalidRequestError(f"num_frames must be {ts}*k+1 for this model (e.g. {ts * ((req.num_frames - 1) // ts) + 1}), got {req.num_frames}")
        if self._latent_grid(req)[0] % pt:
            raise InvalidRequestError(f"num_frames must give a multiple of {pt} latent frames for this model, got {req.num_frames}")
        # HunyuanVideoPipeline.check_inputs wants multiples of 16; the VAE and patching may want more.
        mult = int(np.lcm(16, p.vae_scale_factor_spatial * ps))
        if req.height % mult or req.width % mult:
            raise InvalidRequestError(f"height and width must be multiples of {mult} for this model, got {req.height}x{req.width}")

    def token_grid(self, req: Request) -> tuple[int, int, int]:
        t, h, w = self._latent_grid(req)
        pt, ps = self._patch
        return t // pt, h // ps, w // ps

    # text ---------------------------------------------------------------------------------------
    def _crop_start(self) -> int:
        """Template tokens the pipeline crops off the Llama sequence (computed as the pipeline does when unset)."""
        crop = self.prompt_template.get("crop_start")
        if crop is None:
            ids = self.pipe.tokenizer(self.prompt_template["template"], padding="max_length", return_tensors="pt")["input_ids"]
            crop = ids.shape[-1] - 2
        return int(crop)

    def _llama_encoding(self, prompt: str, **kw):
        """The Llama tokenization of the templated prompt, truncated as the pipeline truncates it (unpadded)."""
        text = self.prompt_template["template"].format(prompt)
        return text, self.pipe.tokenizer(text, max_length=self.max_sequence_length + self._crop_start(), truncation=True, **kw)

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """The Llama token ids the transformer sees for ``prompt``: the templated sequence after the crop."""
        return self._llama_encoding(prompt)[1]["input_ids"][self._crop_start():]

    def word_token_positions(self, prompt: str, word: str, modifiers: int = 0) -> list[int]:
        """Indices into the transformer's text sequence (after the crop) of the tokens spelling ``word`` (with up to
        ``modifiers`` words modifying it, :func:`~carnator.signature.nouns.noun_phrase_spans`).

        Only occurrences inside the prompt count, never inside the template around it.
        """
        from ..signature.nouns import noun_phrase_spans

        _, enc = self._llama_encoding(prompt, return_offsets_mapping=True)
        pre = self.prompt_template["template"].split("{}", 1)[0]
        start = len(pre.replace("{{", "{").replace("}}", "}"))
        spans = [(start + a, start + b) for a, b in noun_phrase_spans(prompt, word, modifiers)]
        crop = self._crop_start()
        return [
            i - crop
            for i, (a, b) in enumerate(enc["offset_mapping"])
            if i >= crop and b > a and any(a < e and b > s for s, e in spans)
        ]

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        pe, pooled, mask = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_template=self.prompt_template,
            num_videos_per_prompt=1,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        dtype = self.transformer.dtype
        return {"embeds": pe.to(dtype), "mask": mask.to(dtype), "pooled": pooled.to(dtype)}

    def encode(self, req: Request) -> Conditioning:
        do_cfg = self.true_cfg_scale > 1 and req.negative_prompt is not None
        with torch.no_grad():
            data = {"cond": self._encode_one(req.prompt), "uncond": self._encode_one(req.negative_prompt) if req.negative_prompt is not None and do_cfg else None}
        return Conditioning(data=data, do_cfg=do_cfg)

    # latents and schedule -------------------------------------------------------------------------
    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor:
        return self.pipe.prepare_latents(
            1, self.transformer.config.in_channels, req.height, req.width, req.num_frames,
            torch.float32, self.device, generator, None,
        )

    def timesteps(self, scheduler, req: Request) -> torch.Tensor:
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import retrieve_timesteps

        n = req.num_inference_steps
        s = scheduler
        ts, _ = retrieve_timesteps(s, n, self.device, sigmas=np.linspace(1.0, 0.0, n + 1)[:-1])
        s.set_begin_index(0)
        return ts

    def predict(self, latents, t, step, cond, req):
        tr = self.transformer
        x = latents.to(tr.dtype)
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        guidance = torch.tensor([req.guidance_scale] * latents.shape[0], dtype=tr.dtype, device=latents.device) * 1000.0

        def forward(name: str, c: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
            n = hidden.shape[0]
            with self.branch_context(name, step, t, req, cond.do_cfg):
                return tr(
                    hidden_states=hidden,
                    timestep=timestep[:1].expand(n),
                    encoder_hidden_states=c["embeds"],
                    encoder_attention_mask=c["mask"],
                    pooled_projections=c["pooled"],
                    guidance=guidance[:1].expand(n),
                    return_dict=False,
                )[0]

        with torch.no_grad():
            if cond.do_cfg and self._one_forward_cfg():
                # An intra-request cache with one state for every call: both branches in one batch, uncond first.
                u, c = cond.data["uncond"], cond.data["cond"]
                self._branches((1, 0), step)
                both = forward("cond_uncond", {k: torch.cat([u[k], c[k]]) for k in c}, torch.cat([x, x]))
                neg, out = both.chunk(2)
                return neg + self.true_cfg_scale * (out - neg)
            self._branches((0,), step)
            out = forward("cond", cond.data["cond"], x)
            if cond.do_cfg:
                self._branches((1,), step)
                neg = forward("uncond", cond.data["uncond"], x)
                out = neg + self.true_cfg_scale * (out - neg)
        return out

    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        vae = self.pipe.vae
        with torch.no_grad():
            z = latents.to(vae.dtype) / vae.config.scaling_factor
            video = vae.decode(z, return_dict=False)[0]
            return self.pipe.video_processor.postprocess_video(video, output_type="np")[0]
