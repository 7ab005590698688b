"""Reuse policies: each turns a request into a :class:`Plan`, nothing more."""

from . import baselines, carnator, chorus, dense  # noqa: F401  (registration)
from .base import Plan, Policy, get_policy_class, policy_names, register_policy

__all__ = ["Plan", "Policy", "get_policy_class", "policy_names", "register_policy"]
