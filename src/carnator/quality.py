"""The quality rule that labels a reuse acceptable or unsafe against dense on the same request.

One definition serves ``carnator calibrate`` (labels for threshold selection and certification) and
``carnator bench`` (the unsafe-hit rate). It has no heavy imports, so the CLI can read its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["QualityRule"]


@dataclass(frozen=True)
class QualityRule:
    """A reuse is acceptable iff fidelity >= dense - delta_fidelity and artifact <= dense + delta_artifact
    (judge scores of the reuse and of dense on the same request; PAPER's Delta and Delta')."""

    delta_fidelity: float = 0.1
    delta_artifact: float = 0.02

    def acceptable(self, fidelity, artifact, dense_fidelity, dense_artifact):
        """The rule on one reuse (floats -> bool) or elementwise on arrays (-> bool array)."""
        return (fidelity >= dense_fidelity - self.delta_fidelity) & (artifact <= dense_artifact + self.delta_artifact)

    def label(self, row: dict) -> bool:
        """The rule on a stored calibration row (its ``dense`` and ``reuse`` judge scores)."""
        d, r = row["dense"], row["reuse"]
        return bool(self.acceptable(r["fidelity"], r["artifact"], d["fidelity"], d["artifact"]))
