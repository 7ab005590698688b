"""Policies turn a request into a :class:`Plan`. They plan; the denoiser executes; the bank stores."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..denoise import StepHooks

if TYPE_CHECKING:
    from ..engine import RequestContext


@dataclass
class Plan:
    """What the denoiser does for one request after the policy has decided.

    ``resume_step`` = first step still to run. With ``init_latents`` set, the loop starts from that
    latent (a cached request's post-scheduler latent after step ``resume_step - 1``); without it,
    from the request's own state (its noise, or the latent after a probe).
    """

    hit: bool = False
    source_id: str | None = None
    resume_step: int | None = None
    init_latents: torch.Tensor | None = None
    hooks: StepHooks | None = None
    active_fraction: float | None = None
    mask_density: float | None = None
    entry_extra: dict[str, Any] = field(default_factory=dict)  # what the policy wants stored with the new entry
    entry_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


class Policy(ABC):
    """Decides, per request, whether and how to reuse cached work."""

    name: ClassVar[str]
    #: whether an identical earlier request's stored video may be returned when that video was itself
    #: produced by reuse (an approximation of the dense result). The dense baseline says no.
    accepts_approximate_exact: ClassVar[bool] = True

    @abstractmethod
    def plan(self, ctx: "RequestContext") -> Plan: ...

    def entry_tensors(self, ctx: "RequestContext") -> dict[str, torch.Tensor]:
        """Tensors recorded while the request ran (e.g. attention masks) to store with its entry."""
        return {}

    def stored_steps(self, num_steps: int) -> set[int]:
        """The post-scheduler latents (``traj.i``) this policy can resume from in a later request: what an
        entry it stores keeps under ``EngineConfig.capture_steps="auto"``. Default: every step."""
        return set(range(num_steps))


_POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy_class(name: str) -> type[Policy] | None:
    return _POLICIES.get(name)
