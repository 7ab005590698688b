"""The embedded default backbone (shapes world), shipped inside the package.

``load_pipeline()`` returns the trained :class:`EmbeddedPipeline`; its weights
(``weights.safetensors``) are checked against the SHA-256 in ``weights.json`` before use.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .model import EmbeddedConfig, EmbeddedPipeline, PixelCodec, TextEncoder, WordTokenizer

HERE = Path(__file__).resolve().parent
WEIGHTS = HERE / "weights.safetensors"
MANIFEST = HERE / "weights.json"

__all__ = ["EmbeddedConfig", "EmbeddedPipeline", "PixelCodec", "TextEncoder", "WordTokenizer", "load_pipeline", "save_pipeline"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_pipeline(pipe: EmbeddedPipeline, weights: Path = WEIGHTS, manifest: Path = MANIFEST, *, dtype=torch.float16, info: dict | None = None) -> str:
    """Write the weights (``dtype``) and a manifest with the config and checksum; returns the checksum."""
    from safetensors.torch import save_file

    state = {f"transformer.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in pipe.transformer.state_dict().items()}
    state.update({f"text_encoder.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in pipe.text_encoder.state_dict().items()})
    save_file(state, str(weights))
    digest = _sha256(weights)
    manifest.write_text(json.dumps({"config": pipe.cfg.to_dict(), "sha256": digest, "dtype": str(dtype).replace("torch.", ""), "info": info or {}}, indent=1))
    return digest


def load_pipeline(device: str | torch.device = "cpu", weights: Path = WEIGHTS, manifest: Path = MANIFEST, *, dtype=torch.float32,
                  dit: bool = True) -> EmbeddedPipeline:
    """The trained embedded model, checksum-verified, in ``dtype`` on ``device``. ``dit=False``: its transformer is
    built on the meta device (shapes, no weights, no memory): the model's settings and text, not its generation."""
    from safetensors.torch import load_file

    if not weights.exists() or not manifest.exists():
        raise ModelLoadError(f"the embedded model's weights are missing ({weights}); reinstall carnator")
    meta = json.loads(manifest.read_text())
    digest = _sha256(weights)
    if digest != meta["sha256"]:
        raise ModelLoadError(f"the embedded model's weights fail their checksum ({weights}); reinstall carnator")
    cfg = EmbeddedConfig.from_dict(meta["config"])
    if dit:
        pipe = EmbeddedPipeline(cfg)
    else:
        from .model import build_transformer

        with torch.device("meta"):
            transformer = build_transformer(cfg)
        pipe = EmbeddedPipeline(cfg, transformer=transformer)
    state = load_file(str(weights))
    if dit:
        pipe.transformer.load_state_dict({k[len("transformer."):]: v.float() for k, v in state.items() if k.startswith("transformer.")})
    pipe.text_encoder.load_state_dict({k[len("text_encoder."):]: v.float() for k, v in state.items() if k.startswith("text_encoder.")})
    # (.to(dtype) only when needed: diffusers warns on casting Wan's fp32-pinned modules.)
    for m in (pipe.transformer, pipe.text_encoder) if dit else (pipe.text_encoder,):
        m.to(device) if dtype == torch.float32 else m.to(device, dtype)
        m.eval()
    pipe.weights_sha256 = digest
    return pipe
