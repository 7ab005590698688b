"""Decide: the policy's decision on the request's inputs (or a dense fallback, or an injected decision), held to the
engine's certification rule."""

from __future__ import annotations

from ..plan import Decision
from .state import RequestState


def decide(rs: RequestState, *, injected: Decision | None, allow_uncertified: bool) -> Decision:
    """The decision for ``rs``: a miss when it runs densely (``rs.fallback``), else ``injected`` (a replay) or the
    policy's; an approximate reuse no certified thresholds back becomes a miss unless ``allow_uncertified``."""
    if rs.fallback is not None:
        dec = Decision.miss(f"generated densely: {rs.fallback}", details={"fallback": "dense", "reason": rs.fallback})
    elif injected is not None:
        dec = injected
    else:
        dec = rs.policy.decide(rs.decision_inputs)
    if dec.reuse and dec.certified is not True and not allow_uncertified:
        dec = Decision.miss(f"not reused: {dec.reason} (no certified thresholds back it; allow_uncertified is off)",
                            details={**dec.details, "uncertified": True})
    rs.decision = dec
    return dec
