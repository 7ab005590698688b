"""Reuse scope (PAPER step 7) and blend weights (PAPER step 8).

Each Evidence Region is dilated per latent frame on the ``H x W`` token grid with a square
structuring element (so "dilation by r tokens" = every token within Chebyshev distance r):

* Active = Evidence dilated by ``active_dilation`` (paper: 2 tokens);
* Context = Active dilated by a further ``context_dilation`` (paper: 3 tokens), i.e. Evidence
  dilated by 5. Evidence is inside Active is inside Context; dilation is clipped at the grid border
  and never crosses latent frames.

Blend weight for ``z = W * z_q + (1 - W) * z_cached`` after every reused step:
``W = 1`` on Evidence; ``W = 1 - smoothstep(d / band_width)`` on the band Active minus Evidence, with
``d`` the Chebyshev distance (in tokens, per frame) to the nearest Evidence token; ``W = 0`` outside
Active. ``smoothstep(x) = 3x^2 - 2x^3`` on ``[0, 1]``.

Convention (documented choice): the paper's "d over the band width" with band width 2 is taken
literally (``band_width=None`` means ``active_dilation``), so at distance 1, ``W = 1 - smoothstep(0.5)
= 0.5`` and at distance 2 (the outer ring of Active), ``W = 1 - smoothstep(1) = 0``: the outer Active
ring is still *recomputed* (it is Active) but its latent is taken from the cache. Set
``band_width=active_dilation + 1`` (= 3) for a ramp that is non-zero on the whole band
(``W = 20/27, 7/27`` at distances 1, 2).

Several nouns: masks are united and ``W`` is the maximum over nouns. Because ``W`` decreases with
the distance to Evidence, this equals ``W`` computed from the union of the Evidence masks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy.ndimage import binary_dilation, distance_transform_cdt

from ..signature.regions import EvidenceRegion

__all__ = ["ReuseScope", "ScopeConfig", "blend_weight", "reuse_scope", "smoothstep", "upsample_tokens"]


@dataclass(frozen=True)
class ScopeConfig:
    """Knobs of the reuse scope and blend ramp."""

    active_dilation: int = 2
    """Active = Evidence dilated by this many tokens per frame (paper, step 7: 2)."""
    context_dilation: int = 3
    """Context = Active dilated by this many further tokens (paper, step 7: 3)."""
    band_width: float | None = None
    """Divisor of the Chebyshev distance in the ramp ``1 - smoothstep(d / band_width)``; ``None`` uses
    ``active_dilation`` (the paper's "over the band width", taken literally; see the module doc)."""

    def __post_init__(self) -> None:
        if self.active_dilation < 0 or self.context_dilation < 0:
            raise ValueError("ScopeConfig: dilations must be >= 0")
        if self.band_width is not None and not self.band_width > 0:
            raise ValueError(f"ScopeConfig: band_width must be > 0, got {self.band_width}")

    @property
    def ramp_width(self) -> float:
        return float(self.active_dilation if self.band_width is None else self.band_width)


@dataclass
class ReuseScope:
    """Regions and blend weights over the latent-token grid ``(T, H, W)``.

    Attributes:
        evidence, active, context: boolean ``(T, H, W)``, nested (evidence <= active <= context).
        weight: float32 ``(T, H, W)`` blend weight ``W`` of the query's own latent.
    """

    evidence: np.ndarray
    active: np.ndarray
    context: np.ndarray
    weight: np.ndarray

    @property
    def active_fraction(self) -> float:
        """Share of tokens recomputed in the middle-layer window."""
        return float(self.active.mean()) if self.active.size else 0.0

    @property
    def context_fraction(self) -> float:
        return float(self.context.mean()) if self.context.size else 0.0


def smoothstep(x: Any) -> np.ndarray:
    """``3x^2 - 2x^3`` with ``x`` clamped to ``[0, 1]``."""
    t = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _as_mask(region: EvidenceRegion | np.ndarray) -> np.ndarray:
    m = region.mask if isinstance(region, EvidenceRegion) else np.asarray(region, dtype=bool)
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3:
        raise ValueError(f"evidence mask must be (T, H, W) or (H, W), got shape {m.shape}")
    return m


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    if r == 0:
        return mask.copy()
    se = np.ones((1, 2 * r + 1, 2 * r + 1), dtype=bool)  # square, per frame
    return binary_dilation(mask, structure=se)


def blend_weight(evidence: np.ndarray, cfg: ScopeConfig = ScopeConfig()) -> np.ndarray:
    """Blend weight ``W`` (float32 ``(T, H, W)``) of one Evidence mask ``(T, H, W)``."""
    ev = _as_mask(evidence)
    w = np.zeros(ev.shape, dtype=np.float32)
    r, width = cfg.active_dilation, cfg.ramp_width
    for t, frame in enumerate(ev):
        if not frame.any():
            continue
        if r == 0 or width == 0:  # no band: W is the Evidence mask itself
            w[t] = frame
            continue
        d = distance_transform_cdt(~frame, metric="chessboard").astype(np.float64)
        ramp = 1.0 - smoothstep(d / width)
        w[t] = np.where(frame, 1.0, np.where(d <= r, ramp, 0.0))
    return w


def reuse_scope(
    evidence: EvidenceRegion | np.ndarray | Mapping[str, EvidenceRegion | np.ndarray] | Iterable[EvidenceRegion | np.ndarray],
    cfg: ScopeConfig = ScopeConfig(),
) -> ReuseScope:
    """The reuse scope of one Evidence Region, or the union over several (a mapping noun -> region
    or an iterable of regions; each an :class:`EvidenceRegion` or a boolean ``(T, H, W)`` mask)."""
    if isinstance(evidence, (EvidenceRegion, np.ndarray)):
        masks = [_as_mask(evidence)]
    elif isinstance(evidence, Mapping):
        masks = [_as_mask(v) for v in evidence.values()]
    else:
        masks = [_as_mask(v) for v in evidence]
    if not masks:
        raise ValueError("reuse_scope needs at least one evidence mask")
    shape = masks[0].shape
    if any(m.shape != shape for m in masks):
        raise ValueError(f"evidence masks differ in shape: {sorted({m.shape for m in masks})}")
    ev = np.zeros(shape, dtype=bool)
    act = np.zeros(shape, dtype=bool)
    ctx = np.zeros(shape, dtype=bool)
    w = np.zeros(shape, dtype=np.float32)
    for m in masks:
        a = _dilate(m, cfg.active_dilation)
        ev |= m
        act |= a
        ctx |= _dilate(a, cfg.context_dilation)
        np.maximum(w, blend_weight(m, cfg), out=w)
    return ReuseScope(evidence=ev, active=act, context=ctx, weight=w)


def upsample_tokens(x: np.ndarray, patch: tuple[int, int, int]) -> np.ndarray:
    """Repeat a token-grid array ``(T, H, W)`` to the latent grid ``(T*pt, H*ph, W*pw)`` (each token
    covers a ``pt x ph x pw`` latent patch), e.g. to blend latents with ``W``."""
    a = np.asarray(x)
    if a.ndim != 3 or len(patch) != 3:
        raise ValueError(f"upsample_tokens expects (T, H, W) and a 3-tuple patch, got {a.shape} and {patch}")
    pt, ph, pw = (int(p) for p in patch)
    return a.repeat(pt, axis=0).repeat(ph, axis=1).repeat(pw, axis=2)


def cross_attention_region(
    response: Any, grid: tuple[int, int, int], high: float = 0.5, low: float = 0.25, connectivity: Literal["volume", "frame"] = "volume"
) -> np.ndarray:
    """Boolean ``(T, H, W)`` region of one word from its cross-attention response ``(N,)``: min-max
    normalised, then hysteresis (tokens above ``high`` seed, regions grow through tokens above
    ``low``). A constant response localises nothing (empty region). (The Chorus baseline's regions.)"""
    import torch

    from ..signature import RegionConfig, hysteresis

    c = torch.as_tensor(response).detach().float().cpu().numpy().reshape(grid)
    lo, hi = float(c.min()), float(c.max())
    if not np.isfinite(c).all() or hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return np.zeros(grid, dtype=bool)
    return hysteresis((c - lo) / (hi - lo), RegionConfig(high=high, low=low, connectivity=connectivity))
