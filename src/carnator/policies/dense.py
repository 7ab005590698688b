"""``dense``: the unmodified pipeline (the baseline every speedup is measured against)."""

from __future__ import annotations

from .base import Plan, Policy, register_policy


@register_policy
class DensePolicy(Policy):
    name = "dense"
    accepts_approximate_exact = False  # dense means dense: never serve a reused (approximate) video

    def plan(self, ctx) -> Plan:
        return Plan(hit=False)
