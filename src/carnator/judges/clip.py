"""CLIP-T: how well each sampled frame matches the prompt (the paper's text-alignment metric), from a local CLIP.

``clip_t`` is the mean, over up to ``frames`` evenly sampled frames, of the cosine between the frame's CLIP image
embedding and the prompt's CLIP text embedding (``CLIPModel.get_image_features`` / ``get_text_features`` on
``CLIPProcessor`` inputs; the prompt truncated to the model's text length). Frames are embedded in batches on the
judge's device. The judge also gives the reference scores (:mod:`carnator.judges.reference`: ``ssim``, ``psnr``
against the dense clip, ``flicker``).

Identity: ``clip:`` + a hash of the directory's config and weight files, so that a thresholds file is bound to these
exact weights, wherever they lie.

Default rule: ``clip_t`` at least dense's - 0.02 (the paper's Delta) and ``ssim`` against dense at least 0.5 (a floor;
ours).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ..errors import CarnatorError
from . import HIGHER
from .reference import REFERENCE_DIRECTIONS, reference_scores

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".txt")


def directory_hash(path: Path) -> str:
    """sha256 over the names and bytes of the model files in ``path`` (weights, configs, vocabulary), 16 hex digits."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


class ClipJudge:
    name = "clip"
    default_deltas = {"clip_t": 0.02}
    default_floors = {"ssim": 0.5}

    def __init__(self, path: str | Path, *, device: str | torch.device | None = None, frames: int = 8, batch: int = 32):
        from transformers import CLIPModel, CLIPProcessor
        from transformers.utils import logging as hf_logging

        p = Path(path).expanduser()
        if not (p / "config.json").is_file():
            raise CarnatorError(f"--judge clip={path}: not a CLIP model directory (no config.json)")
        self.path, self.frames, self.batch = p, int(frames), int(batch)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # the "torchvision not installed, PIL backend" notice is not the user's concern
        hf_logging.disable_progress_bar()  # nor a bar for loading a judge
        try:
            self.model = CLIPModel.from_pretrained(str(p), local_files_only=True).eval().to(self.device)
            self.processor = CLIPProcessor.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as e:
            raise CarnatorError(f"--judge clip={path}: cannot load CLIPModel/CLIPProcessor: {str(e).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.identity = f"clip:{directory_hash(p)}"
        self.directions = {"clip_t": HIGHER, **REFERENCE_DIRECTIONS}
        self._text: dict[str, torch.Tensor] = {}

    def sample(self, frames: np.ndarray) -> np.ndarray:
        """Indices of the frames scored: up to ``self.frames``, evenly spaced, first and last included."""
        n = len(frames)
        return np.unique(np.linspace(0, n - 1, min(n, self.frames)).round().astype(int))

    @staticmethod
    def _features(out) -> torch.Tensor:  # transformers 5 returns an output whose pooler_output is projected; 4.x a tensor
        return getattr(out, "pooler_output", out)

    @torch.no_grad()
    def text_embedding(self, prompt: str) -> torch.Tensor:
        if prompt not in self._text:
            tok = self.processor(text=[prompt], return_tensors="pt", padding=True, truncation=True)
            tok = {k: v.to(self.device) for k, v in tok.items()}
            t = self._features(self.model.get_text_features(**tok)).float()
            self._text[prompt] = torch.nn.functional.normalize(t, dim=-1)[0]
        return self._text[prompt]

    @torch.no_grad()
    def image_embeddings(self, images: np.ndarray) -> torch.Tensor:
        out = []
        for k in range(0, len(images), self.batch):
            px = self.processor(images=list(images[k: k + self.batch]), return_tensors="pt")["pixel_values"]
            f = self._features(self.model.get_image_features(pixel_values=px.to(self.device, self.model.dtype))).float()
            out.append(torch.nn.functional.normalize(f, dim=-1))
        return torch.cat(out)

    def clip_t(self, frames: np.ndarray, prompt: str) -> float:
        frames = np.asarray(frames)
        img = self.image_embeddings(frames[self.sample(frames)])
        return float((img @ self.text_embedding(prompt)).mean())

    def score(self, frames, prompt: str, reference=None) -> dict[str, float]:
        return {"clip_t": self.clip_t(frames, prompt), **reference_scores(frames, reference)}


def clip_judge(arg: str | None = None, *, device=None) -> ClipJudge:
    if not arg:
        raise ValueError("give the CLIP model directory: --judge clip=DIR")
    return ClipJudge(arg, device=device)
