"""Policies decide and plan; they never run a step, read the store or touch the model.

A policy declares what it needs from the engine (how many recalled candidates, a :class:`~carnator.plan.ProbeSpec`,
which words' token positions, a block-mask capture) and implements two pure functions over plain data:
:meth:`Policy.decide` (``DecisionInputs -> Decision``) and :meth:`Policy.plan` (``Decision -> ReusePlan``). After the
request ran, :meth:`Policy.entry` says what its cache entry keeps. The engine runs the stages, the denoiser executes
the plan, the store stores.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..attention.state import AttentionRecord, SparseConfig
from ..plan import Decision, DecisionInputs, ProbeSpec, ReusePlan


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know of the model it serves (to pick its thresholds file)."""

    identity: str
    family: str
    #: the engine's admission gate (``{"judge": identity, "rule": {...}}``), None when entries are not judged
    admission: dict | None = None


@dataclass(frozen=True, eq=False)
class Entry:
    """What a request's cache entry keeps beside its trajectory and video: ``tensors`` (masks, regions, responses)
    and ``extra`` (JSON-able metadata read at recall)."""

    tensors: Mapping[str, torch.Tensor]
    extra: Mapping[str, Any]


class Policy(ABC):
    """Decides, per request, whether and how to reuse cached work."""

    #: the registry name (a class attribute; an instance may carry its own: engine.use_policy)
    name: str
    #: whether an identical earlier request's stored video may be returned when that video was itself
    #: produced by reuse (an approximation of the dense result). The dense baseline says no.
    accepts_approximate_exact: ClassVar[bool] = True
    #: the cache use a request of this policy gets when it names none: "reuse" (exact and approximate hits),
    #: "exact" (exact hits only) or "off" (generate; still stored unless ``store=False``)
    default_cache: ClassVar[str] = "reuse"
    #: whether the policy needs carnator's attention processors (a family without them then generates densely)
    needs_attention: ClassVar[bool] = False

    def prepare(self, model: ModelInfo) -> None:
        """Called once when the engine builds the policy: load and check what depends on the model (thresholds).
        Raises :class:`~carnator.errors.CarnatorError` on a bad setting, before any request."""

    # ---- what the engine runs for the policy -------------------------------------------------------------
    def recall_k(self) -> int:
        """How many recalled candidates :meth:`decide` sees (0: no recall)."""
        return 0

    def recall_by_content(self) -> bool:
        """Whether recall also returns the entries that ask what the request asks (its content key), beyond the
        :meth:`recall_k` nearest (:meth:`~carnator.cache.CacheStore.recall`)."""
        return False

    def recall_near(self) -> tuple[str, ...]:
        """Kinds of change (:func:`~carnator.signature.content.change_kind`) whose sources recall also returns by
        content: the entries one such change away from the request (when the model's content reader can name them),
        beyond the :meth:`recall_k` nearest sentences. () (default): none."""
        return ()

    def recall_by_sentence(self) -> bool:
        """Whether recall searches the recall embeddings (False: only the entries that ask what the request asks,
        :meth:`~carnator.cache.CacheStore.same_content`, when :meth:`recall_by_content`; no embedding is computed
        before the decision)."""
        return True

    def probe_spec(self) -> ProbeSpec | None:
        """The dense probe this policy reads (None: no probe)."""
        return None

    def probe_needed(self, inputs: DecisionInputs) -> bool:
        """Whether this request's decision reads :meth:`probe_spec`'s probe, given the recalled candidates (False: the
        request runs its steps as dense does, no probe). Default: always."""
        return True

    def plan_reads_probe(self, decision: Decision) -> bool:
        """Whether an injected ``decision`` (a replay) needs the probe for its plan. Default: always."""
        return True

    def sparse_config(self) -> SparseConfig | None:
        """The block-mask capture this policy records (and may apply) where a block-sparse kernel makes it pay."""
        return None

    def words(self, prompt: str, nouns: tuple[str, ...]) -> tuple[str, ...]:
        """Words whose text-token positions :meth:`decide` and :meth:`plan` need (``DecisionInputs.word_positions``)."""
        return ()

    def prefetch(self, inputs: DecisionInputs) -> tuple[str, list[str] | None] | None:
        """A candidate entry worth reading beside the probe, and which of its tensors (None: all), or None. Called
        with the candidates before the probe ran (``inputs.signature`` is None)."""
        return None

    # ---- decide and plan (pure) -------------------------------------------------------------------------
    @abstractmethod
    def decide(self, inputs: DecisionInputs) -> Decision: ...

    def plan(self, decision: Decision, inputs: DecisionInputs) -> ReusePlan:
        """The plan for ``decision`` (the default: a miss that captures what :meth:`sparse_config` records)."""
        return ReusePlan(capture=inputs.sparse)

    # ---- after the run ----------------------------------------------------------------------------------
    def entry(self, inputs: DecisionInputs, plan: ReusePlan, record: AttentionRecord) -> Entry:
        """What the request's cache entry keeps beside its trajectory and video."""
        return Entry({}, {})

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


def captured_masks(record: AttentionRecord, prefix: str) -> dict[str, torch.Tensor]:
    """The block masks a request captured, as named tensors for its entry."""
    return {} if record.captured is None else record.captured.to_tensors(prefix)
