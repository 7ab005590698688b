"""Evidence Regions (PAPER step 3): where a noun lives in the latent-token grid at the probe step.

For one noun ``o`` and one fixed intermediate transformer layer read during the dense probe:

1. ``C[i]``: the cross-attention response of visual token ``i`` to ``o``'s text tokens, already
   aggregated over heads and over the noun's token positions (the recorder does that).
2. Seeds (:func:`select_seeds`): high-response tokens ``I+`` (the object) and low-response tokens
   ``I-`` (the background).
3. Self-attention expansion (:func:`self_attention_expansion`):
   ``S[i] = mean_h( max_{u in I+} A_h[i, u] - max_{u in I-} A_h[i, u] )``, where ``A_h[i, u]`` is the
   post-softmax self-attention probability of query token ``i`` on key token ``u`` in head ``h``.
4. Fusion (:func:`fuse`): ``F = normalize(S * (eps + (1 - eps) * C^gamma))`` with ``C`` min-max
   normalized to ``[0, 1]`` first and ``normalize`` a min-max rescale to ``[0, 1]``.
5. Hysteresis thresholding (:func:`hysteresis`) on the ``(T, H, W)`` grid: tokens with ``F > high``
   seed regions, which grow through connected tokens with ``F > low``.

The API is two-phase so that the recorder only materializes the attention columns it needs::

    seeds = select_seeds(C, grid, cfg)                  # which key tokens u are needed
    cols = recorder.self_attention_columns(seeds.columns)   # (heads, N, n_pos + n_neg)
    region = evidence_region(C, cols, seeds, grid, cfg)

``evidence_region`` also accepts a callable ``f(indices) -> (heads, N, len(indices))`` instead of
the tensor. Token order everywhere is the raster order of the ``(T, H, W)`` grid (frame-major, then
rows, then columns), which is how diffusers' video transformers flatten patches. Inputs may be
numpy arrays or torch tensors (converted to float32 numpy on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from skimage.filters import apply_hysteresis_threshold

__all__ = [
    "AttentionColumns",
    "EvidenceRegion",
    "RegionConfig",
    "Seeds",
    "TokenGrid",
    "evidence_region",
    "fuse",
    "hysteresis",
    "select_seeds",
    "self_attention_expansion",
]

TokenGrid = tuple[int, int, int]
"""``(T, H, W)``: latent frames x token rows x token columns (``BackboneAdapter.token_grid``)."""

AttentionColumns = Any
"""An array ``(heads, N, k)`` of self-attention probabilities ``A_h[:, u]`` for ``k`` key tokens
``u``, or a callable ``f(indices: np.ndarray) -> (heads, N, len(indices))``."""


@dataclass(frozen=True)
class RegionConfig:
    """Knobs of the Evidence Region construction.

    The paper gives none of these values (PAPER step 3: "eps, gamma, the thresholds and the layer
    index are not given"). The fusion and threshold defaults are the best setting of the knob grid of
    ``lab/scripts/measure_probe.py`` at the probe layer (docs/METHOD.md: the same setting won on the shipped
    embedded weights and on their predecessor); the seed-count bounds are chosen defaults (the probe layer index belongs to the
    attention recorder, not to this module).
    """

    pos_fraction: float = 0.05
    """Share of all tokens taken as positive seeds ``I+`` (highest ``C``). Default by measurement
    (docs/METHOD.md, embedded model, probe layer 3: best of 0.01 / 0.02 / 0.05 on two weight versions)."""
    min_pos: int = 1
    """Lower bound on ``|I+|``. Chosen default."""
    max_pos: int = 32
    """Upper bound on ``|I+|``: each seed costs one attention column ``(heads, N)``; at 32k tokens
    and 12 heads, 32 columns are 12 M floats. Chosen default."""
    neg_fraction: float = 0.5
    """Share of all tokens eligible as negative seeds ``I-`` (lowest ``C``). Chosen default: the
    bottom half, i.e. clearly background."""
    min_neg: int = 1
    """Lower bound on ``|I-|``. Chosen default."""
    max_neg: int = 64
    """Upper bound on ``|I-|``. When more tokens are eligible, ``max_neg`` of them are taken evenly
    spaced in raster order, so that the background seeds cover the whole background (its parts
    look different) rather than only its single darkest corner. Chosen default."""
    eps: float = 0.1
    """Floor of the cross-attention gate in the fusion ``S * (eps + (1 - eps) * C^gamma)``: ``eps=1``
    ignores ``C``, ``eps=0`` lets a zero ``C`` veto any self-attention evidence. Default by measurement
    (docs/METHOD.md: best of 0 / 0.1 / 0.3 / 1 with the other defaults)."""
    gamma: float = 0.5
    """Exponent on the normalized cross-attention ``C`` in the fusion (``<1`` flattens, ``>1``
    sharpens the gate). Default by measurement (docs/METHOD.md: best of 0.5 / 1 / 2)."""
    high: float = 0.3
    """Hysteresis high threshold on the fused map ``F`` in ``[0, 1]``: tokens with ``F > high`` seed
    regions. Must be ``< 1`` (the maximum of ``F`` is 1, so at least one token seeds). Default by
    measurement (docs/METHOD.md: with ``low``, best of five (high, low) pairs from (0.3, 0.15) to (0.7, 0.4))."""
    low: float = 0.15
    """Hysteresis low threshold: regions grow through connected tokens with ``F > low``. Default by
    measurement (see ``high``)."""
    connectivity: Literal["volume", "frame"] = "volume"
    """``"volume"``: connected components in 3-D over ``(T, H, W)`` (face neighbours: 6-connected), so
    a region seeded in one latent frame can grow through time; ``"frame"``: each latent frame on its
    own (4-connected on ``H x W``), so every frame needs its own ``F > high`` seed. Chosen default:
    volume (objects persist across frames, and the tail frame, which the signature reads, is often
    the least confident one at the probe step)."""

    def __post_init__(self) -> None:
        if not (0.0 < self.pos_fraction <= 1.0 and 0.0 < self.neg_fraction <= 1.0):
            raise ValueError("RegionConfig: pos_fraction and neg_fraction must lie in (0, 1]")
        if not (1 <= self.min_pos <= self.max_pos and 1 <= self.min_neg <= self.max_neg):
            raise ValueError("RegionConfig: need 1 <= min_pos <= max_pos and 1 <= min_neg <= max_neg")
        if not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"RegionConfig: eps must lie in [0, 1], got {self.eps}")
        if not self.gamma > 0.0:
            raise ValueError(f"RegionConfig: gamma must be > 0, got {self.gamma}")
        if not 0.0 <= self.low <= self.high < 1.0:
            raise ValueError(f"RegionConfig: need 0 <= low <= high < 1, got low={self.low} high={self.high}")
        if self.connectivity not in ("volume", "frame"):
            raise ValueError(f"RegionConfig: connectivity must be 'volume' or 'frame', got {self.connectivity!r}")


@dataclass(frozen=True)
class Seeds:
    """Seed tokens of one noun, as flat indices into the raster-ordered token sequence.

    ``pos`` (``I+``) is sorted by decreasing cross-attention response, ``neg`` (``I-``) by increasing
    token index. The two sets are disjoint.
    """

    pos: np.ndarray
    neg: np.ndarray

    @property
    def columns(self) -> np.ndarray:
        """The key-token indices whose attention columns the caller must supply, in the order
        expected by :func:`evidence_region`: ``concat(pos, neg)``."""
        return np.concatenate([self.pos, self.neg]).astype(np.int64)


@dataclass
class EvidenceRegion:
    """The Evidence Region ``R_o`` of one noun.

    Attributes:
        mask: boolean ``(T, H, W)`` over the latent-token grid.
        fused: float32 ``(T, H, W)``, the fused evidence map ``F`` in ``[0, 1]`` that was thresholded.
        seeds: the seeds it was grown from (``None`` when built from a mask directly).
    """

    mask: np.ndarray
    fused: np.ndarray
    seeds: Seeds | None = field(default=None, repr=False)

    @property
    def grid(self) -> TokenGrid:
        t, h, w = self.mask.shape
        return (int(t), int(h), int(w))

    @property
    def tail(self) -> np.ndarray:
        """The mask of the last latent frame, boolean ``(H, W)``."""
        return self.mask[-1]


# ---- helpers ------------------------------------------------------------------------------------


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _check_grid(grid: TokenGrid) -> tuple[int, int, int]:
    if len(grid) != 3 or any(int(g) < 1 for g in grid):
        raise ValueError(f"token grid must be (T, H, W) of positive ints, got {grid}")
    t, h, w = (int(g) for g in grid)
    return t, h, w


def _flat_response(C: Any, grid: TokenGrid) -> np.ndarray:
    t, h, w = _check_grid(grid)
    c = _to_numpy(C).reshape(-1)
    if c.size != t * h * w:
        raise ValueError(f"cross-attention response has {c.size} tokens, grid {grid} has {t * h * w}")
    if not np.all(np.isfinite(c)):
        raise ValueError("cross-attention response contains NaN or inf")
    return c


def _minmax(x: np.ndarray, constant: float) -> np.ndarray:
    lo, hi = float(np.min(x)), float(np.max(x))
    if hi - lo <= 1e-12 * max(1.0, abs(hi), abs(lo)):
        return np.full_like(x, constant, dtype=np.float32)
    return ((x - lo) / (hi - lo)).astype(np.float32)


# ---- the steps ----------------------------------------------------------------------------------


def select_seeds(C: Any, grid: TokenGrid, cfg: RegionConfig = RegionConfig()) -> Seeds:
    """Choose the positive seeds ``I+`` (highest ``C``) and negative seeds ``I-`` (lowest ``C``).

    ``|I+| = clip(ceil(pos_fraction * N), min_pos, max_pos)``, the highest-response tokens (ties
    broken by lower index). The eligible negatives are the ``clip(ceil(neg_fraction * N), min_neg)``
    lowest-response tokens outside ``I+``; at most ``max_neg`` of them are kept, evenly spaced in
    raster order.

    Args:
        C: cross-attention response, ``(N,)`` or ``(T, H, W)``.
        grid: the token grid ``(T, H, W)`` with ``T * H * W == N``.
        cfg: the knobs.
    """
    c = _flat_response(C, grid)
    n = c.size
    if n < 2:
        raise ValueError("need at least 2 visual tokens to choose positive and negative seeds")
    order = np.argsort(-c, kind="stable")  # decreasing response, ties by index
    n_pos = min(max(math.ceil(cfg.pos_fraction * n), cfg.min_pos), cfg.max_pos, n - 1)
    pos = order[:n_pos].astype(np.int64)
    rest = order[n_pos:][::-1]  # increasing response; ties now by decreasing index (irrelevant)
    n_elig = min(max(math.ceil(cfg.neg_fraction * n), cfg.min_neg), rest.size)
    eligible = np.sort(rest[:n_elig])  # raster order
    if eligible.size > cfg.max_neg:
        pick = np.linspace(0, eligible.size - 1, cfg.max_neg).round().astype(np.int64)
        eligible = eligible[pick]
    return Seeds(pos=pos, neg=eligible.astype(np.int64))


def self_attention_expansion(attn_pos: Any, attn_neg: Any) -> np.ndarray:
    """``S[i] = mean_h( max_{u in I+} A_h[i, u] - max_{u in I-} A_h[i, u] )``.

    Args:
        attn_pos: ``(heads, N, |I+|)`` self-attention columns of the positive seeds.
        attn_neg: ``(heads, N, |I-|)`` self-attention columns of the negative seeds.

    Returns:
        float32 ``(N,)``, in ``[-1, 1]`` for attention probabilities.
    """
    if hasattr(attn_pos, "detach") and hasattr(attn_neg, "detach"):
        # torch tensors: reduce where they live (a GPU at real sizes) and move only the (N,) result.
        if attn_pos.ndim != 3 or attn_neg.ndim != 3 or attn_pos.shape[:2] != attn_neg.shape[:2]:
            raise ValueError(f"attention columns must be (heads, N, k) with equal heads and N, got {tuple(attn_pos.shape)} and {tuple(attn_neg.shape)}")
        if attn_pos.shape[2] == 0 or attn_neg.shape[2] == 0:
            raise ValueError("need at least one positive and one negative seed column")
        return _to_numpy((attn_pos.float().amax(dim=2) - attn_neg.float().amax(dim=2)).mean(dim=0))
    ap, an = _to_numpy(attn_pos), _to_numpy(attn_neg)
    if ap.ndim != 3 or an.ndim != 3 or ap.shape[:2] != an.shape[:2]:
        raise ValueError(f"attention columns must be (heads, N, k) with equal heads and N, got {ap.shape} and {an.shape}")
    if ap.shape[2] == 0 or an.shape[2] == 0:
        raise ValueError("need at least one positive and one negative seed column")
    return (ap.max(axis=2) - an.max(axis=2)).mean(axis=0).astype(np.float32)


def fuse(S: Any, C: Any, cfg: RegionConfig = RegionConfig()) -> np.ndarray:
    """``F = normalize(S * (eps + (1 - eps) * C_n^gamma))`` with ``C_n`` = min-max normalized ``C``.

    ``normalize`` is a min-max rescale to ``[0, 1]``. Degenerate inputs: a constant ``C`` gives
    ``C_n = 1`` (no cross-attention information, so the gate is neutral); a constant product gives
    ``F = 0`` everywhere (no evidence, hence an empty region).

    Returns:
        float32 array of ``S``'s shape.
    """
    s = _to_numpy(S)
    c = _to_numpy(C).reshape(s.shape)
    cn = _minmax(c, constant=1.0)
    gate = cfg.eps + (1.0 - cfg.eps) * np.power(cn, cfg.gamma)
    return _minmax(s * gate, constant=0.0)


def hysteresis(F: np.ndarray, cfg: RegionConfig = RegionConfig()) -> np.ndarray:
    """Hysteresis thresholding of a fused map ``F`` of shape ``(T, H, W)`` into a boolean mask.

    Uses ``skimage.filters.apply_hysteresis_threshold`` (strict ``>`` comparisons, face-neighbour
    connectivity), either on the whole volume or frame by frame (``cfg.connectivity``).
    """
    f = np.asarray(F, dtype=np.float32)
    if f.ndim != 3:
        raise ValueError(f"hysteresis expects a (T, H, W) map, got shape {f.shape}")
    if cfg.connectivity == "volume":
        return np.asarray(apply_hysteresis_threshold(f, cfg.low, cfg.high), dtype=bool)
    return np.stack([np.asarray(apply_hysteresis_threshold(fr, cfg.low, cfg.high), dtype=bool) for fr in f])


def evidence_region(
    C: Any,
    attention: AttentionColumns | Callable[[np.ndarray], Any],
    seeds: Seeds,
    grid: TokenGrid,
    cfg: RegionConfig = RegionConfig(),
) -> EvidenceRegion:
    """Build the Evidence Region of one noun.

    Args:
        C: cross-attention response ``(N,)`` or ``(T, H, W)`` (the one :func:`select_seeds` saw).
        attention: self-attention columns for ``seeds.columns`` (positives first, then
            negatives): an array ``(heads, N, |I+| + |I-|)`` or a callable taking the index array and
            returning it.
        seeds: from :func:`select_seeds`.
        grid: ``(T, H, W)``.
        cfg: the knobs (use the same config as for :func:`select_seeds`).
    """
    t, h, w = _check_grid(grid)
    c = _flat_response(C, grid)
    cols_idx = seeds.columns
    cols = attention(cols_idx) if callable(attention) else attention
    # A torch tensor stays where it is (the expansion reduces it there); anything else becomes numpy.
    a = cols if hasattr(cols, "detach") else _to_numpy(cols)
    if a.ndim != 3 or a.shape[1] != c.size or a.shape[2] != cols_idx.size:
        raise ValueError(f"attention columns must be (heads, {c.size}, {cols_idx.size}) for these seeds, got {tuple(a.shape)}")
    n_pos = seeds.pos.size
    s = self_attention_expansion(a[:, :, :n_pos], a[:, :, n_pos:])
    f = fuse(s, c, cfg).reshape(t, h, w)
    return EvidenceRegion(mask=hysteresis(f, cfg), fused=f, seeds=seeds)
