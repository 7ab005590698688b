"""The Early Signature (PAPER step 4): per noun, its tail-frame mask, area and mean colour.

For each noun ``o`` with Evidence Region ``R_o`` (a boolean ``(T, H, W)`` token mask):

* ``mask_tail``: ``R_o`` on the last latent frame, boolean ``(H, W)``;
* ``area``: ``A_o`` = the fraction of the last latent frame covered by ``mask_tail``;
* ``lab``: ``c_o`` = the mean CIELAB (sRGB -> CIELAB, D65) of the *pixels* inside the region on the
  last frame of one VAE decode of the probe-step prediction. The token mask is upsampled to pixels
  by nearest neighbour (a Kronecker product when the pixel size is a multiple of the token grid).
  ``None`` when the tail mask is empty (the colour is undefined; the compatibility test then treats
  every colour discrepancy involving it as infinite).

Signatures serialize compactly (:meth:`EarlySignature.to_dict`: masks bit-packed with
``np.packbits`` and base64-encoded) so they fit in the cache bank's free-form JSON ``extra`` field.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .colour import mean_lab
from .regions import EvidenceRegion

__all__ = [
    "SIGNATURE_FORMAT_VERSION",
    "EarlySignature",
    "NounSignature",
    "early_signature",
    "normalize_noun",
    "noun_signature",
    "upsample_mask",
]

SIGNATURE_FORMAT_VERSION = 1
"""Version of the serialized form written by :meth:`EarlySignature.to_dict`."""


def normalize_noun(noun: str) -> str:
    """The canonical form of a noun (stripped, lower-cased), used for signature keys and noun diffs."""
    return " ".join(str(noun).split()).lower()


@dataclass(eq=False)
class NounSignature:
    """One noun's entry of an Early Signature.

    Attributes:
        noun: the canonical noun (see :func:`normalize_noun`).
        mask_tail: boolean ``(H, W)`` token mask on the last latent frame.
        area: fraction of the last latent frame covered, in ``[0, 1]``.
        lab: mean CIELAB ``(L*, a*, b*)`` of the region's tail-frame pixels, ``None`` if the region is
            empty there.
    """

    noun: str
    mask_tail: np.ndarray
    area: float
    lab: tuple[float, float, float] | None

    def __post_init__(self) -> None:
        self.mask_tail = np.asarray(self.mask_tail, dtype=bool)
        if self.mask_tail.ndim != 2:
            raise ValueError(f"mask_tail must be (H, W), got shape {self.mask_tail.shape}")
        self.area = float(self.area)
        if self.lab is not None:
            lab = tuple(float(v) for v in np.asarray(self.lab, dtype=np.float64).reshape(-1))
            if len(lab) != 3:
                raise ValueError(f"lab must have 3 components, got {len(lab)}")
            self.lab = lab

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NounSignature):
            return NotImplemented
        return (
            self.noun == other.noun
            and self.mask_tail.shape == other.mask_tail.shape
            and bool(np.array_equal(self.mask_tail, other.mask_tail))
            and self.area == other.area
            and self.lab == other.lab
        )

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``{"hw": [H, W], "mask": base64(packbits), "area": float, "lab": [3] | None}``."""
        h, w = self.mask_tail.shape
        packed = np.packbits(self.mask_tail.reshape(-1)).tobytes()
        return {
            "hw": [int(h), int(w)],
            "mask": base64.b64encode(packed).decode("ascii"),
            "area": self.area,
            "lab": None if self.lab is None else list(self.lab),
        }

    @classmethod
    def from_dict(cls, noun: str, d: Mapping[str, Any]) -> NounSignature:
        h, w = (int(v) for v in d["hw"])
        bits = np.frombuffer(base64.b64decode(d["mask"]), dtype=np.uint8)
        if bits.size != math.ceil(h * w / 8):
            raise ValueError(f"signature mask of noun {noun!r} has {bits.size} bytes, expected {math.ceil(h * w / 8)}")
        mask = np.unpackbits(bits, count=h * w).astype(bool).reshape(h, w)
        lab = d.get("lab")
        return cls(noun=noun, mask_tail=mask, area=float(d["area"]), lab=None if lab is None else tuple(lab))


@dataclass(eq=False)
class EarlySignature:
    """The Early Signature of one request: one :class:`NounSignature` per (canonical) noun."""

    nouns: dict[str, NounSignature] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, sig in self.nouns.items():
            if key != sig.noun or key != normalize_noun(key):
                raise ValueError(f"signature key {key!r} must equal its canonical noun {normalize_noun(sig.noun)!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EarlySignature):
            return NotImplemented
        return self.nouns.keys() == other.nouns.keys() and all(self.nouns[k] == other.nouns[k] for k in self.nouns)

    __hash__ = None  # type: ignore[assignment]

    def __contains__(self, noun: object) -> bool:
        return isinstance(noun, str) and normalize_noun(noun) in self.nouns

    def __getitem__(self, noun: str) -> NounSignature:
        return self.nouns[normalize_noun(noun)]

    def get(self, noun: str) -> NounSignature | None:
        return self.nouns.get(normalize_noun(noun))

    def __iter__(self) -> Iterator[str]:
        return iter(self.nouns)

    def __len__(self) -> int:
        return len(self.nouns)

    def to_dict(self) -> dict[str, Any]:
        """Compact JSON-able form for the cache bank's ``extra`` field (masks bit-packed, base64)."""
        return {"v": SIGNATURE_FORMAT_VERSION, "nouns": {k: s.to_dict() for k, s in self.nouns.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EarlySignature:
        v = d.get("v")
        if v != SIGNATURE_FORMAT_VERSION:
            raise ValueError(f"unsupported Early Signature format version {v!r} (this build reads {SIGNATURE_FORMAT_VERSION})")
        return cls({k: NounSignature.from_dict(k, s) for k, s in d["nouns"].items()})

    def to_json(self) -> str:
        """:meth:`to_dict` as a compact JSON string."""
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, s: str | bytes | Mapping[str, Any]) -> EarlySignature:
        """Inverse of :meth:`to_json`; also accepts the already-parsed dict."""
        return cls.from_dict(s if isinstance(s, Mapping) else json.loads(s))


def upsample_mask(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour upsampling of a token mask ``(H, W)`` to pixels ``(H_px, W_px)``.

    Pixel row ``y`` takes token row ``floor(y * H / H_px)`` (likewise for columns), which equals
    ``np.kron(mask, ones((H_px // H, W_px // W)))`` when the sizes divide.
    """
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 2:
        raise ValueError(f"upsample_mask expects (H, W), got shape {m.shape}")
    h, w = m.shape
    hp, wp = (int(s) for s in size)
    if hp < h or wp < w:
        raise ValueError(f"pixel size {(hp, wp)} is smaller than the token grid {(h, w)}")
    rows = (np.arange(hp) * h) // hp
    cols = (np.arange(wp) * w) // wp
    return m[rows[:, None], cols[None, :]]


def noun_signature(noun: str, region: EvidenceRegion | np.ndarray, tail_rgb: np.ndarray) -> NounSignature:
    """The signature of one noun from its Evidence Region and the decoded tail frame.

    Args:
        noun: the noun (canonicalized with :func:`normalize_noun`).
        region: an :class:`EvidenceRegion` or its boolean mask ``(T, H, W)`` (a ``(H, W)`` mask is taken
            as the tail frame itself).
        tail_rgb: the last decoded frame, float sRGB ``(H_px, W_px, 3)`` in ``[0, 1]``.
    """
    mask = region.mask if isinstance(region, EvidenceRegion) else np.asarray(region, dtype=bool)
    if mask.ndim == 3:
        mask = mask[-1]
    if mask.ndim != 2:
        raise ValueError(f"region mask must be (T, H, W) or (H, W), got shape {mask.shape}")
    rgb = np.asarray(tail_rgb, dtype=np.float64)
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise ValueError(f"tail frame must be (H_px, W_px, 3), got shape {rgb.shape}")
    px = upsample_mask(mask, rgb.shape[:2])
    lab = mean_lab(rgb, px)
    return NounSignature(
        noun=normalize_noun(noun),
        mask_tail=mask.copy(),
        area=float(mask.mean()),
        lab=None if lab is None else (float(lab[0]), float(lab[1]), float(lab[2])),
    )


def early_signature(regions: Mapping[str, EvidenceRegion | np.ndarray], tail_rgb: np.ndarray) -> EarlySignature:
    """The Early Signature of a request from its per-noun Evidence Regions and decoded tail frame.

    Nouns are canonicalized; two nouns with the same canonical form must not both be given.
    """
    out: dict[str, NounSignature] = {}
    for noun, region in regions.items():
        sig = noun_signature(noun, region, tail_rgb)
        if sig.noun in out:
            raise ValueError(f"noun {noun!r} given twice (canonical form {sig.noun!r})")
        out[sig.noun] = sig
    return EarlySignature(out)
