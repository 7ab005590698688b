"""Reuse decisions and scope: noun filter, compatibility test, risk-aware calibration, reuse regions."""

from .calibrate import (
    CalibrationConfig,
    CalibrationPair,
    CalibrationResult,
    calibrate,
    clopper_pearson_upper,
    evaluate,
    select_thresholds,
    separation,
    split_pairs,
)
from .compat import (
    THRESHOLDS_FORMAT_VERSION,
    CompatConfig,
    Discrepancies,
    NounDiff,
    Thresholds,
    compatible,
    discrepancies,
    first_compatible,
    noun_diff,
    shape_distance,
)
from .regions import ReuseScope, ScopeConfig, blend_weight, reuse_scope, smoothstep, upsample_tokens

__all__ = [
    "THRESHOLDS_FORMAT_VERSION",
    "CalibrationConfig",
    "CalibrationPair",
    "CalibrationResult",
    "CompatConfig",
    "Discrepancies",
    "NounDiff",
    "ReuseScope",
    "ScopeConfig",
    "Thresholds",
    "blend_weight",
    "calibrate",
    "clopper_pearson_upper",
    "compatible",
    "discrepancies",
    "evaluate",
    "first_compatible",
    "noun_diff",
    "reuse_scope",
    "select_thresholds",
    "separation",
    "shape_distance",
    "smoothstep",
    "split_pairs",
    "upsample_tokens",
]
