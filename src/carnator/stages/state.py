"""One request's state as it passes the engine's stages (:class:`RequestState`): what each stage reads and adds.

The engine creates it once per request and hands it to every stage in turn; nothing in it outlives the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backbones.base import Conditioning
from ..denoise import DenoiseState, Program
from ..plan import Decision, DecisionInputs, ProbeSpec, ReusePlan
from ..policies import Policy
from ..request import Params, Request, Stats


@dataclass
class RequestState:
    """``params`` as asked, ``req`` as resolved, the policy and cache mode it runs under; then, stage by stage: the
    text conditioning and denoising state, why it runs densely (``fallback``), the policy's inputs (candidates,
    signature), the compatibility key and recall embedding, the decision, the plan and the program bound to the
    source's tensors. ``stats`` and its ``timings`` fill as it goes."""

    params: Params
    req: Request
    policy: Policy
    mode: str
    exact_key: str
    stats: Stats
    t_start: float = field(default_factory=time.perf_counter)
    cond: Conditioning | None = None
    denoise: DenoiseState | None = None
    capture: set[int] = field(default_factory=set)
    fallback: str | None = None
    spec: ProbeSpec | None = None
    inputs: DecisionInputs | None = None
    compat_key: str = ""
    embedding: np.ndarray | None = None
    prefetched: tuple[str, Any] | None = None  # (entry id, the Future reading its tensors)
    decision: Decision | None = None
    plan: ReusePlan | None = None
    program: Program | None = None
    progress: Callable[[int], None] | None = None
    cancel: Callable[[], bool] | None = None

    def timed(self, stage: str, since: float) -> None:
        """Record ``stage``'s seconds since ``since`` (a ``time.perf_counter()``)."""
        self.stats.timings[stage] = time.perf_counter() - since

    # the stages after the first fill these; a stage that reads one before it is set is a bug in the order
    @property
    def state(self) -> DenoiseState:
        assert self.denoise is not None, "encode runs first"
        return self.denoise

    @property
    def decision_inputs(self) -> DecisionInputs:
        assert self.inputs is not None, "the inputs are built before recall"
        return self.inputs
