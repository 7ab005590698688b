"""Reuse policies: each decides and plans over plain data (:mod:`carnator.plan`), nothing more."""

from . import baselines, carnator, chorus, dense  # noqa: F401  (registration)
from .base import Entry, ModelInfo, Policy, get_policy_class, policy_names, register_policy

__all__ = ["Entry", "ModelInfo", "Policy", "get_policy_class", "policy_names", "register_policy"]
