"""Risk tiers: one certified way to reuse per kind of change.

What changed between a request and a cached one (:func:`carnator.signature.content.change_kind`: re-roll, rewording,
colour, object, small-object, size, place, place-added, place-removed, motion, count, several) decides how much of the
cached trajectory a reuse may keep. A re-roll keeps all but the last steps; a colour edit must recompute the object's
region from an early step, since the first steps settle its colour. Each kind gets its own :class:`Tier` (resume
step, scope) and its own certificate: the Clopper-Pearson bound of the unsafe share among that kind's calibration
reuses at that step. A kind without a certified tier is a miss.

:func:`carnator.calibrate.certify.certify_tiers` selects each kind's step on one split of its pairs (the latest step, so the fewest recomputed
steps, whose unsafe share there could still certify at the other split's size) and certifies it on the other, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


__all__ = ["KINDS", "SAME_CONTENT_KINDS", "Tier"]

#: kinds of change whose two prompts ask the same: a hit recomputes the whole frame and reads no probe
SAME_CONTENT_KINDS = frozenset({"re-roll", "rewording"})
#: every kind :func:`~carnator.signature.content.change_kind` names that a tier may reuse
KINDS = ("re-roll", "rewording", "colour", "object", "small-object", "size", "place", "place-added", "place-removed",
         "motion", "count", "several")


@dataclass(frozen=True)
class Tier:
    """How a reuse of one kind of change runs, and its certificate.

    ``step`` of ``of``: the resume step (scaled to the request's steps); ``scope``: "frame" recomputes every token
    from the resume step (same content), "region" recomputes the changed objects' Evidence Regions and keeps the
    cached latent outside them. ``pairs`` / ``accepted`` / ``unsafe`` / ``bound``: the certification split's pairs of
    this kind, those reused at ``step``, the unsafe among them and the one-sided Clopper-Pearson upper bound of the
    unsafe share; ``certified``: ``bound <= delta``."""

    kind: str
    step: int
    of: int
    scope: str = "region"
    pairs: int = 0
    accepted: int = 0
    unsafe: int = 0
    bound: float | None = None
    certified: bool = False

    def __post_init__(self) -> None:
        if self.scope not in ("frame", "region"):
            raise ValueError(f"Tier.scope must be 'frame' or 'region', got {self.scope!r}")
        if not (isinstance(self.step, int) and isinstance(self.of, int) and 1 <= self.step < self.of):
            raise ValueError(f"Tier step must satisfy 1 <= step < of, got {self.step} of {self.of}")

    def resume_at(self, num_steps: int) -> int:
        """The resume step for a request of ``num_steps`` steps (this tier's step scaled)."""
        return int(round(self.step * num_steps / self.of))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tier:
        known = {k: d[k] for k in ("kind", "step", "of", "scope", "pairs", "accepted", "unsafe", "bound", "certified") if k in d}
        return cls(**known)
