"""The plain data one request passes between stages: what a policy asks for, decides and plans.

``Request -> recall -> Candidate* -> probe (ProbeSpec) -> Evidence -> EarlySignature -> DecisionInputs
-> Policy.decide -> Decision -> Policy.plan -> ReusePlan -> denoise -> store``

Everything here is a frozen dataclass without closures: a plan can be logged, compared, replayed (an injected
:class:`Decision`) and executed by the one denoising loop (:mod:`carnator.denoise`) without any policy code running.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .attention.state import Amplification, SparseConfig
from .cache.entry import EntryMeta
from .request import Request
from .reuse import Discrepancies, ScopeConfig
from .signature import EarlySignature, RegionConfig

__all__ = [
    "Candidate",
    "Decision",
    "DecisionInputs",
    "Phase",
    "ProbeSpec",
    "RecordedRegions",
    "RegionSpec",
    "ReusePlan",
]


@dataclass(frozen=True)
class ProbeSpec:
    """What a policy reads in the dense probe (PAPER steps 2-4): the first ``steps`` denoising steps of the request
    run densely (they are part of its own trajectory), and at the last of them the attention of ``layer`` (None: the
    middle layer) is recorded for each noun's tokens plus up to ``modifiers`` words modifying it; ``region`` turns the
    record into Evidence Regions. Together these are the policy's *reading* (what a thresholds file is bound to)."""

    steps: int = 4
    layer: int | None = None
    modifiers: int = 0
    region: RegionConfig = field(default_factory=RegionConfig)

    def reading(self) -> dict[str, Any]:
        """The settings that shape the signatures, as JSON-able data (recorded in thresholds files and cache keys)."""
        from dataclasses import asdict

        return {"probe_steps": self.steps, "probe_layer": self.layer, "modifiers": self.modifiers, "region": asdict(self.region)}


@dataclass(frozen=True, eq=False)
class Candidate:
    """One cached entry recall found for a request: its metadata and the cosine of the two recall embeddings (None
    when recall found it by content alone and computed no embedding)."""

    meta: EntryMeta
    similarity: float | None


@dataclass(frozen=True, eq=False)
class DecisionInputs:
    """Everything a policy may look at to decide and plan one request (no model, no store, no I/O).

    ``nouns``: the request's nouns (the engine's noun extractor); ``signature`` / ``regions``: its Early Signature and
    Evidence Regions (token-grid bool masks per noun) when the policy probed; ``grid``: the (T, H, W) token grid;
    ``num_layers``: the transformer's layers; ``word_positions``: text-token positions of each word the policy asked
    for (:meth:`~carnator.policies.base.Policy.words`); ``sparse``: the block-mask capture that applies on this
    device (None: masks are neither captured nor applied here); ``content``: what the prompt asks
    (:mod:`carnator.signature.content`; None: not read).
    """

    request: Request
    num_steps: int
    grid: tuple[int, int, int]
    num_layers: int
    candidates: tuple[Candidate, ...] = ()
    nouns: tuple[str, ...] = ()
    signature: EarlySignature | None = None
    regions: Mapping[str, np.ndarray] = field(default_factory=dict)
    word_positions: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    sparse: SparseConfig | None = None
    reuse: bool = True
    content: tuple[str, ...] | None = None


@dataclass(frozen=True, eq=False)
class Decision:
    """Whether and what to reuse for one request, and why.

    ``source_id``: the cached entry reused; ``reason``: one human line; ``similarity`` and ``discrepancies``: the
    evidence the decision rested on; ``resume_step``: overrides the policy's own resume step; ``regions``: overrides
    the target token masks the reuse recomputes (a replay injects a box); ``details``: policy-specific facts the plan
    needs (the substituted noun pair, a prompt diff, ...); ``certified``: whether the thresholds that accepted it were
    certified (None: not a thresholded decision).
    """

    reuse: bool = False
    source_id: str | None = None
    reason: str = ""
    similarity: float | None = None
    discrepancies: Discrepancies | None = None
    resume_step: int | None = None
    regions: tuple[np.ndarray, ...] | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    certified: bool | None = None

    @classmethod
    def miss(cls, reason: str, **kw: Any) -> Decision:
        return cls(reuse=False, reason=reason, **kw)


@dataclass(frozen=True, eq=False)
class RecordedRegions:
    """Regions read from cross-attention recorded *during* the reuse (the Chorus baseline): each position group's
    response (mean over heads and its positions) at the plan's record step, and the source entry's stored responses
    ``source_responses`` (tensor names, (N,) each), min-max normalised and hysteresis-thresholded."""

    positions: tuple[tuple[int, ...], ...] = ()
    source_responses: tuple[str, ...] = ()
    high: float = 0.5
    low: float = 0.25
    connectivity: Literal["volume", "frame"] = "volume"


@dataclass(frozen=True, eq=False)
class RegionSpec:
    """Where a reuse recomputes: the union of ``masks`` (token-grid bool masks known when planning),
    ``source_masks`` (names of the source entry's stored token masks) and ``recorded`` (read at the record step),
    dilated into Active and Context regions by ``scope`` (PAPER step 7). With ``everywhere_if_empty`` an empty union
    recomputes every token; otherwise it makes the plan unusable (the request misses)."""

    scope: ScopeConfig = field(default_factory=ScopeConfig)
    masks: tuple[np.ndarray, ...] = ()
    source_masks: tuple[str, ...] = ()
    recorded: RecordedRegions | None = None
    everywhere_if_empty: bool = False


@dataclass(frozen=True)
class Phase:
    """Steps ``[start, stop)`` of a reuse and what applies there: ``blend`` the latent with the source's
    (``z = W z + (1 - W) z_source``, W from the plan's region, PAPER step 8); ``window`` recompute only Active tokens
    in the plan's window layers; ``masks`` attend only where the source's block masks allow (PAPER step 9);
    ``amplify`` TGAA (Chorus)."""

    start: int
    stop: int
    blend: bool = False
    window: bool = False
    masks: bool = False
    amplify: Amplification | None = None


@dataclass(frozen=True, eq=False)
class ReusePlan:
    """What the denoiser does for one request after the decision. The one loop executes any plan.

    ``resume_step`` / ``init_latent``: the first step still to run and the source tensor (``traj.<resume_step - 1>``)
    the loop starts from; None: the request's own state (its noise, or the latent after the probe). ``phases``: what
    applies in which steps (no phase: plain steps). ``region``: where blend and window apply. ``window_layers``: the
    layer fraction of the window. ``mask_prefix``: the source's block masks (tensor name prefix); with ``require_masks`` a source without usable
    masks cannot serve the plan. ``record``: cross-
    attention to record at one step, as (step, layer, positions) (Chorus reads its regions from it, and every request
    stores it). ``capture``: this request's block masks to capture (every step its stride allows).
    ``own_sample`` / ``clean_latent``: with ``own_sample`` > 0 the start latent is re-noised from the source's final
    latent (``clean_latent``) with the request's own seed noise mixed in by ``own_sample``
    (:func:`carnator.denoise.own_sample_latent`).
    """

    hit: bool = False
    source_id: str | None = None
    resume_step: int | None = None
    init_latent: str | None = None
    own_sample: float = 0.0
    clean_latent: str | None = None
    phases: tuple[Phase, ...] = ()
    region: RegionSpec | None = None
    window_layers: tuple[float, float] | None = None
    mask_prefix: str | None = None
    require_masks: bool = False
    record: tuple[int, int, tuple[int, ...]] | None = None
    capture: SparseConfig | None = None

    def blend_steps(self) -> list[int]:
        """The steps after which the latent is blended with the source's (their ``traj.<step>`` is read)."""
        return sorted({i for p in self.phases if p.blend for i in range(p.start, p.stop)})

    def source_tensors(self) -> list[str]:
        """Names of the source tensors this plan reads (block masks aside: they are found by prefix)."""
        names = [] if self.init_latent is None else [self.init_latent]
        if self.clean_latent is not None and self.clean_latent not in names:
            names.append(self.clean_latent)
        names += [f"traj.{i}" for i in self.blend_steps() if f"traj.{i}" not in names]
        if self.region is not None:
            names += list(self.region.source_masks)
            if self.region.recorded is not None:
                names += list(self.region.recorded.source_responses)
        return list(dict.fromkeys(names))
