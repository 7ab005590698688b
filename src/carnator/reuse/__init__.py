"""Reuse decisions and scope: noun filter, compatibility test, risk tiers, reuse regions (the thresholds' calibration:
:mod:`carnator.calibrate`)."""

from .compat import (
    THRESHOLDS_FORMAT_VERSION,
    CompatConfig,
    CompatResult,
    Discrepancies,
    NounDiff,
    RiskScore,
    Thresholds,
    compatible,
    discrepancies,
    explain,
    first_compatible,
    noun_diff,
    risk_features,
    shape_distance,
)
from .regions import ReuseScope, ScopeConfig, blend_weight, cross_attention_region, reuse_scope, smoothstep, upsample_tokens

__all__ = [
    "THRESHOLDS_FORMAT_VERSION",
    "CompatConfig",
    "CompatResult",
    "Discrepancies",
    "NounDiff",
    "ReuseScope",
    "RiskScore",
    "ScopeConfig",
    "Thresholds",
    "blend_weight",
    "compatible",
    "cross_attention_region",
    "discrepancies",
    "explain",
    "first_compatible",
    "noun_diff",
    "reuse_scope",
    "risk_features",
    "shape_distance",
    "smoothstep",
    "upsample_tokens",
]
