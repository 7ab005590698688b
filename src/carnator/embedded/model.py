"""The embedded default model: a small Wan transformer over the shapes world.

Pieces (all shipped as package data, no hub):
- :class:`PixelCodec`, the "VAE": an exact invertible map between pixels and latents
  (pixel-unshuffle by ``factor`` per frame, pixels scaled to [-1, 1]).
- :class:`WordTokenizer` and :class:`TextEncoder`: a word-level vocabulary of the world's caption
  grammar and a compact transformer trained jointly with the DiT.
- ``diffusers.WanTransformer3DModel``: the class of real Wan, so the Wan attention processors
  and the Wan adapter serve it.
- ``diffusers.UniPCMultistepScheduler`` with flow prediction, as Wan samples.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EmbeddedConfig:
    """Architecture and sampling defaults of the embedded model (stored beside its weights)."""

    frames: int = 16
    size: int = 64
    codec_factor: int = 4
    patch_size: tuple[int, int, int] = (2, 2, 2)
    num_layers: int = 6
    num_heads: int = 4
    head_dim: int = 48
    ffn_dim: int = 512
    text_dim: int = 128
    text_layers: int = 2
    text_heads: int = 4
    max_words: int = 24
    flow_shift: float = 2.0
    #: what the transformer outputs: "x0" (the clean latent; converted to the flow velocity the
    #: scheduler expects) or "velocity". Pixel-space tokens are high-dimensional (2x8x8x3 = 384
    #: values per token), where x0-prediction learns and velocity-prediction does not (Li & He 2025,
    #: "Back to Basics: Let Denoising Generative Models Denoise"; measured: velocity left noise).
    prediction: str = "x0"
    num_inference_steps: int = 50
    guidance_scale: float = 4.0
    vocab: list[str] = field(default_factory=list)

    @property
    def latent_channels(self) -> int:
        return 3 * self.codec_factor**2

    def to_dict(self) -> dict:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EmbeddedConfig":
        d = dict(d)
        d["patch_size"] = tuple(d["patch_size"])
        return cls(**d)


class PixelCodec(nn.Module):
    """Pixels (B, 3, T, H, W) in [0, 1] <-> latents (B, 3 f^2, T, H/f, W/f); exact inverse of each other."""

    def __init__(self, factor: int):
        super().__init__()
        self.factor = factor

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = video.shape
        x = video.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w) * 2 - 1
        x = F.pixel_unshuffle(x, self.factor)
        return x.reshape(b, t, -1, h // self.factor, w // self.factor).permute(0, 2, 1, 3, 4).contiguous()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = z.shape
        x = z.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = F.pixel_shuffle(x, self.factor)
        x = (x + 1) / 2
        return x.reshape(b, t, 3, h * self.factor, w * self.factor).permute(0, 2, 1, 3, 4)


class WordTokenizer:
    """Lower-cased words of a closed vocabulary. Id 0 pads; unknown words are dropped (and reported)."""

    pad_id = 0

    def __init__(self, vocab: list[str], max_words: int):
        self.vocab = list(vocab)
        self.ids = {w: i + 1 for i, w in enumerate(self.vocab)}
        self.max_words = max_words

    @staticmethod
    def words(text: str) -> list[str]:
        return re.findall(r"[a-z0-9]+", text.lower())

    def split(self, text: str) -> tuple[list[str], list[str]]:
        """(known words in order, unknown words)."""
        ws = self.words(text)
        return [w for w in ws if w in self.ids][: self.max_words], [w for w in ws if w not in self.ids]

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character span in ``text`` of each token :meth:`split` keeps (known words, cut at ``max_words``)."""
        spans = [m.span() for m in re.finditer(r"[a-z0-9]+", text.lower()) if m.group(0) in self.ids]
        return spans[: self.max_words]

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(texts), self.max_words, dtype=torch.long)
        for i, t in enumerate(texts):
            known, _ = self.split(t)
            if known:
                ids[i, : len(known)] = torch.tensor([self.ids[w] for w in known])
        return ids, ids != self.pad_id


class TextEncoder(nn.Module):
    """A compact transformer encoder over word ids; padded positions come out as zeros (as Wan's T5 embeds)."""

    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, max_words: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size + 1, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_words, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        # An all-padding row (the empty negative prompt) would give NaNs with a key mask: let it attend everything.
        key_pad = ~mask & mask.any(dim=1, keepdim=True)
        x = self.enc(x, src_key_padding_mask=key_pad)
        return self.norm(x) * mask.unsqueeze(-1).to(x.dtype)


def build_transformer(cfg: EmbeddedConfig):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        text_dim=cfg.text_dim,
        freq_dim=256,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    )


def build_scheduler(cfg: EmbeddedConfig):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=cfg.flow_shift, num_train_timesteps=1000)


class EmbeddedPipeline:
    """The embedded model's components, shaped like a diffusers pipeline (``transformer``,
    ``text_encoder``, ``tokenizer``, ``scheduler``, ``vae``) for :class:`~carnator.backbones.embedded.EmbeddedAdapter`."""

    def __init__(self, cfg: EmbeddedConfig, transformer=None, text_encoder=None, scheduler=None):
        self.cfg = cfg
        self.transformer = transformer if transformer is not None else build_transformer(cfg)
        self.text_encoder = text_encoder if text_encoder is not None else TextEncoder(len(cfg.vocab), cfg.text_dim, cfg.text_layers, cfg.text_heads, cfg.max_words)
        self.tokenizer = WordTokenizer(cfg.vocab, cfg.max_words)
        self.scheduler = scheduler if scheduler is not None else build_scheduler(cfg)
        self.vae = PixelCodec(cfg.codec_factor)
        self.weights_sha256: str | None = None

    @property
    def _execution_device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def to(self, device) -> "EmbeddedPipeline":
        self.transformer.to(device)
        self.text_encoder.to(device)
        return self

    def set_progress_bar_config(self, **kw) -> None:
        pass

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The transformer's output as a flow velocity (noise - x0) for the scheduler.

        For x0-prediction, v = (x_t - x0_hat) / sigma with sigma = t / 1000 (> 0 at every sampling timestep).
        """
        if self.cfg.prediction == "velocity":
            return out
        sigma = (timestep.float() / 1000.0).clamp_min(1e-4).view(-1, *([1] * (out.ndim - 1)))
        return (latents.float() - out.float()) / sigma

    def encode_text(self, texts: list[str]) -> torch.Tensor:
        ids, mask = self.tokenizer(texts)
        dev = self._execution_device
        return self.text_encoder(ids.to(dev), mask.to(dev))
