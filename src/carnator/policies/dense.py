"""``dense``: the unmodified pipeline (the baseline every speedup is measured against)."""

from __future__ import annotations

from ..plan import Decision, DecisionInputs
from .base import Policy, register_policy


@register_policy
class DensePolicy(Policy):
    name = "dense"
    accepts_approximate_exact = False  # dense means dense: never serve a reused (approximate) video
    default_cache = "off"  # a dense request runs densely unless it asks for exact hits (cache="exact")

    def decide(self, inputs: DecisionInputs) -> Decision:
        return Decision.miss("dense: every step computed")
