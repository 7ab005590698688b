"""Early Signatures: Evidence Regions from probe attention, CIELAB colour, per-noun signatures.

Pure numpy/scipy/scikit-image maths (no torch import); the attention recorder hands in tensors.
"""

from .colour import ciede2000, mean_lab, srgb_to_lab
from .regions import (
    EvidenceRegion,
    RegionConfig,
    Seeds,
    TokenGrid,
    evidence_region,
    fuse,
    hysteresis,
    select_seeds,
    self_attention_expansion,
)
from .signature import (
    SIGNATURE_FORMAT_VERSION,
    EarlySignature,
    NounSignature,
    early_signature,
    normalize_noun,
    noun_signature,
    upsample_mask,
)

__all__ = [
    "SIGNATURE_FORMAT_VERSION",
    "EarlySignature",
    "EvidenceRegion",
    "NounSignature",
    "RegionConfig",
    "Seeds",
    "TokenGrid",
    "ciede2000",
    "early_signature",
    "evidence_region",
    "fuse",
    "hysteresis",
    "mean_lab",
    "normalize_noun",
    "noun_signature",
    "select_seeds",
    "self_attention_expansion",
    "srgb_to_lab",
    "upsample_mask",
]
