"""``carnator``: compatibility-guided cross-request reuse (PAPER steps 1-10).

The engine recalls the nearest cached requests and runs the dense probe this policy asks for (:meth:`probe_spec`);
the policy then decides over plain data:

- :meth:`decide`: the noun filter over the recalled candidates, then the compatibility test of the request's Early
  Signature against each tested candidate's, the first compatible winning (:func:`~carnator.reuse.first_compatible`);
- :meth:`plan`: resume from the winner's latent at the resume step, blend outside the target region after every step,
  recompute only Active tokens in the middle layers, attend only where the winner's block masks allow.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..attention.state import AttentionRecord, SparseConfig
from ..errors import CarnatorError
from ..plan import Candidate, Decision, DecisionInputs, Phase, ProbeSpec, RegionSpec, ReusePlan
from ..reuse import CompatConfig, ScopeConfig, Thresholds, explain, first_compatible, noun_diff
from ..reuse.compat import NounDiff
from ..reuse.tiers import SAME_CONTENT_KINDS, Tier
from ..signature import EarlySignature, RegionConfig
from ..signature.content import change_kind, content_change, content_distance
from .base import Entry, ModelInfo, Policy, captured_masks, register_policy

log = logging.getLogger("carnator")

MASK_PREFIX = "attn."
EVIDENCE_PREFIX = "evidence."
SHIPPED_THRESHOLDS = Path(__file__).resolve().parent.parent / "embedded" / "thresholds.json"
#: the embedded model's file for an engine without the admission gate the shipped file needs (an engine
#: whose ``admission_judge`` is not ``shapes``, or ``admitted_only`` off): certified on its own, it reuses re-rolls only
SHIPPED_THRESHOLDS_NOGATE = SHIPPED_THRESHOLDS.with_name("thresholds-nogate.json")
#: the resume step when neither the configuration nor the thresholds file names one (of any number of steps)
DEFAULT_RESUME_STEP = 30


@dataclass
class CarnatorConfig:
    """Every knob of the method. Paper values are marked; others are chosen defaults (docs/METHOD.md).

    top_k: recalled candidates (paper: 10).
    content_recall: recall also returns the cached entries that ask what the request asks (the same content key,
        :func:`carnator.cache.keys.content_key`) beyond the ``top_k`` nearest sentences, when the thresholds read
        content: a rewording finds its source however far its sentence embedding lies (default on; not in the paper).
        With edit tiers, also up to ``top_k`` entries one change of a tier's kind away (another object, another place:
        what the content reader names, :meth:`~carnator.signature.content.LexiconContent.neighbours`), so an edit finds
        the request it edits among many nearer sentences.
        Under a content-only file at content 0 (the embedded model's shipped one) those are the only candidates it can
        accept, so recall reads only them and computes no sentence embedding before the decision.
    tested: how many of the recalled candidates that pass the noun filter the compatibility test tries, in recall
        order, the first compatible winning (paper: all; None = all). Default 1: thresholds are certified on one
        (query, cached request) pair at a time, and every further candidate tried is one more chance for an
        incompatible one to pass them.
    probe_steps: dense probe steps (paper: 4).
    probe_layer: layer whose attention is read (paper: not given; None = the middle layer).
    modifiers: each noun's evidence is read from its own tokens plus those of up to this many words modifying it
        ("big red ball": 2; paper: the noun's tokens, 0). Default 1: on the embedded model it localises objects better
        and the shipped thresholds are calibrated with it (docs/METHOD.md).
    resume_step: first step taken from the cached trajectory (paper: not given). None (default): the step the
        thresholds file was certified at (``meta.resume``, e.g. 45 of 50), scaled to the request's
        number of steps (45 of 50 is 29 of 32); a file that names none, or the paper's thresholds: 30. A step the file
        was not certified at (``meta.resume.certified_steps``) makes its reuse uncertified.
    window: fraction of layers [start, end) where only Active tokens are recomputed (paper: 6..25 of 30 layers,
        i.e. (0.2, 0.867)).
    sparse: capture of this request's block masks and reuse of the source's (PAPER step 9); ``sparse.apply`` says
        where ("auto": only where a block-sparse kernel makes them save time).
    region: Evidence Region knobs (eps, gamma, seeds, hysteresis; PAPER step 3). scope: Active and Context dilation
        and the blend ramp (PAPER step 7). compat: discrepancy knobs (PAPER step 5).
    thresholds: a thresholds file from ``carnator calibrate``; None = the shipped certified file for the embedded
        model, else the paper's tau (uncertified).
    judge: the identity of the judge the thresholds file must have been certified by (``meta.judge`` of the file, e.g.
        ``clip:<hash>``, what ``carnator calibrate --judge`` records); None = any. Not in the paper.
    prefetch: read the first recalled candidate's entry in a background thread while the probe runs, so a hit on it
        does not wait for the disk (default on; not in the paper).
    admitted_only: reuse only entries whose own output passed the engine's admission judge
        (``EngineConfig.admission_judge``; entries the engine did not judge are allowed). A re-roll is unsafe mostly
        when the clip it resumes from was itself a failed generation, which no query-side evidence can see.
        Default on; not in the paper.
    own_sample: how much of the request's own sample a hit keeps (not in the paper). 0: resume
        the source's latent trajectory as it is (the paper; with the Active region covering the frame, a re-roll hit
        then returns the source's clip). 1: at the resume step, re-noise the source's final (clean) latent with the
        request's own seed noise (exact flow-matching state ``(1 - s) x0 + s e``), so a new seed gives a new sample
        that keeps the source's layout. Between: the noise is ``a e_request + sqrt(1 - a^2) e_source`` (``e_source``
        the noise implied by the source's latent at that step). Default 0.
    probe: "auto" (default; not in the paper) skips the probe when the thresholds decide by content alone (a
        content threshold and no signature dimension, as the embedded model's shipped file): the request then runs its steps as dense does and a
        hit resumes without probe steps, but its entry carries no signature or evidence, so thresholds that read one
        later cannot reuse it. "always" (the paper): the dense probe runs on every request, so every entry carries its
        signature and evidence whatever later thresholds read.
    """

    top_k: int = 10
    content_recall: bool = True
    tested: int | None = 1
    probe_steps: int = 4
    probe_layer: int | None = None
    modifiers: int = 1
    resume_step: int | None = None
    window: tuple[float, float] = (0.2, 0.867)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    thresholds: str | None = None
    judge: str | None = None
    prefetch: bool = True
    admitted_only: bool = True
    own_sample: float = 0.0
    probe: str = "auto"

    def __post_init__(self) -> None:
        if self.probe not in ("auto", "always"):
            raise ValueError(f'CarnatorConfig.probe must be "auto" or "always", got {self.probe!r}')
        if not 0.0 <= float(self.own_sample) <= 1.0:
            raise ValueError(f"CarnatorConfig.own_sample must lie in [0, 1], got {self.own_sample!r}")
        if not isinstance(self.modifiers, int) or self.modifiers < 0:
            raise ValueError(f"CarnatorConfig.modifiers must be an integer >= 0, got {self.modifiers!r}")
        if self.tested is not None and self.tested < 1:
            raise ValueError(f"CarnatorConfig.tested must be >= 1 or None (all), got {self.tested}")
        if self.probe_steps < 1:
            raise ValueError(f"CarnatorConfig.probe_steps must be >= 1, got {self.probe_steps}")
        if self.resume_step is not None and (not isinstance(self.resume_step, int) or self.resume_step < 1):
            raise ValueError(f"CarnatorConfig.resume_step must be an integer >= 1 or None, got {self.resume_step!r}")
        lo, hi = self.window
        self.window = (float(lo), float(hi))
        # Nested settings may come as plain dicts (EngineConfig.policy_options read from JSON or a CLI).
        for name, klass in (("sparse", SparseConfig), ("region", RegionConfig), ("scope", ScopeConfig), ("compat", CompatConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, klass(**value))


@register_policy
class CarnatorPolicy(Policy):
    name = "carnator"
    needs_attention = True

    def __init__(self, config: CarnatorConfig | None = None, **overrides: Any) -> None:
        self.cfg = config or CarnatorConfig(**overrides)
        self.tau: Thresholds = Thresholds()
        #: whether ``tau`` was certified (``carnator calibrate``) for this model and reading
        self.certified = False
        self.thresholds_source = "the paper's thresholds (uncertified)"
        #: the thresholds file's ``meta.resume`` ({"step", "of", "certified_steps"}); None: the file names none
        self.certified_resume: dict | None = None
        #: the file's certified risk tiers by kind of change ({}: no tiers, the thresholds decide)
        self.tiers: dict[str, Tier] = {}
        #: the thresholds file loaded (None: the paper's thresholds)
        self.thresholds_path: Path | None = None
        #: (kind of change, step) pairs this policy does not reuse by, whatever its thresholds certify: plain data an
        #: operator's live audit sets (:meth:`disable`); step as :meth:`audit_tier` names it
        self.disabled_tiers: frozenset[tuple[str, int]] = frozenset()
        if self.cfg.thresholds is not None and not Path(self.cfg.thresholds).is_file():
            raise CarnatorError(f"thresholds file {self.cfg.thresholds} does not exist")

    # ---- thresholds ---------------------------------------------------------------------------------------
    def reading(self) -> dict:
        """The settings that shape this policy's signatures and so the discrepancies its thresholds apply to; a
        thresholds file records them and loads only for a policy that reads alike."""
        return self.probe_spec().reading()

    def prepare(self, model: ModelInfo) -> None:
        """Load the thresholds: the configured file (refused for another model or reading), else the shipped file for
        the embedded model, else the paper's."""
        self.certified_resume = None
        self.tiers = {}
        self.thresholds_path = None
        if self.cfg.thresholds is not None:
            self._load(self.cfg.thresholds, model)
            return
        if model.family == "embedded" and SHIPPED_THRESHOLDS.exists():
            path = SHIPPED_THRESHOLDS
            if self._gate_missing(Thresholds.file_meta(path), model) and SHIPPED_THRESHOLDS_NOGATE.exists():
                path = SHIPPED_THRESHOLDS_NOGATE   # certified without the gate: re-rolls only
                log.info("no admission gate on this engine: the embedded model's thresholds without one (%s)", path.name)
            try:
                self._load(path, model)
            except CarnatorError as e:  # the shipped file does not fit this configuration: the paper's values
                log.warning("%s; using the paper's thresholds (uncertified)", e)

    def _gate_missing(self, meta: dict, model: ModelInfo) -> dict | None:
        """The admission gate a certified file needs (``meta.admission``) when this engine and policy do not apply it
        (no judge, another judge, a looser bar, or ``admitted_only`` off); None when nothing is missing."""
        needs = meta.get("admission")
        if not meta.get("certified") or not needs:
            return None
        have = model.admission
        if have is None or not self.cfg.admitted_only or have.get("judge") != needs.get("judge"):
            return needs
        for k, bar in needs.get("rule", {}).items():
            if k not in have.get("rule", {}):
                return needs
            mine, higher = have["rule"][k], needs.get("directions", {}).get(k, 1) > 0
            if mine < bar if higher else mine > bar:
                return needs
        return None

    def _load(self, path: str | os.PathLike[str], model: ModelInfo) -> None:
        self.tau = Thresholds.load(path, model_id=model.identity, reading=self.reading(), judge=self.cfg.judge)
        self.thresholds_path = Path(path)
        meta = Thresholds.file_meta(path)
        self.certified = bool(meta.get("certified"))
        self.tiers = {t.kind: t for t in self.tau.tiers if t.certified}
        resume = meta.get("resume")
        self.certified_resume = dict(resume) if isinstance(resume, dict) and resume.get("step") and resume.get("of") else None
        why = ""
        needs = self._gate_missing(meta, model)
        if needs:
            # The certificate holds for sources that passed this gate; without it (or with a looser one) it does not.
            self.certified = False
            why = f"; certified only with the admission gate {needs}, which this engine does not apply"
            log.warning("thresholds %s%s", path, why)
        resume_meta = self.certified_resume
        steps = None if resume_meta is None else resume_meta.get("certified_steps", [resume_meta["step"]])
        if self.certified and self.cfg.resume_step is not None and self.tiers:
            # A tier's certificate holds at its own step: one step for every kind says nothing of theirs.
            self.certified = False
            why += f"; its tiers are certified at their own steps, not {self.cfg.resume_step}"
            log.warning("thresholds %s%s", path, why)
        elif self.certified and self.cfg.resume_step is not None and steps is not None and self.cfg.resume_step not in steps:
            # A later resume step recomputes less: the certificate of one step says nothing of another.
            self.certified = False
            why += f"; certified at resume steps {steps} of {resume_meta['of'] if resume_meta else '?'}, not {self.cfg.resume_step}"
            log.warning("thresholds %s%s", path, why)
        self.thresholds_source = f"{path} ({'certified' if self.certified else 'not certified'}{why})"

    # ---- what the engine runs ----------------------------------------------------------------------------
    def recall_k(self) -> int:
        return self.cfg.top_k

    def recall_by_content(self) -> bool:
        return self.cfg.content_recall and (not math.isinf(self.tau.content) or bool(self.tiers))

    def edit_tiers(self) -> bool:
        """Whether a tier reuses a change of content (an edit), not only re-rolls and rewordings."""
        return any(k not in SAME_CONTENT_KINDS for k in self.tiers)

    def recall_near(self) -> tuple[str, ...]:
        # an edit tier's source is one change of its kind away: found by content however far its sentence lies
        if not self.cfg.content_recall:
            return ()
        return tuple(sorted(k for k, t in self.tiers.items()
                            if k not in SAME_CONTENT_KINDS and (k, t.step) not in self.disabled_tiers))

    def recall_by_sentence(self) -> bool:
        # A content-only rule that accepts only the same content (content 0, no text threshold) can reuse nothing a
        # sentence search adds: the entries asking the same are all its candidates, found without the embedding.
        # An edit tier's candidates ask something else: the sentence search finds them.
        if self.tiers:
            return self.edit_tiers()
        return not (self.recall_by_content() and self.content_only() and self.tau.content == 0
                    and math.isinf(self.tau.text))

    def probe_spec(self) -> ProbeSpec:
        c = self.cfg
        return ProbeSpec(steps=c.probe_steps, layer=c.probe_layer, modifiers=c.modifiers, region=c.region)

    def sparse_config(self) -> SparseConfig:
        return self.cfg.sparse

    def resume_at(self, num_steps: int) -> int:
        """The step a reuse of a ``num_steps``-step request resumes at: the configured step, else the thresholds file's
        certified step scaled to ``num_steps``, else 30; never inside the probe."""
        r = self.cfg.resume_step
        if r is None:
            at = self.certified_resume
            r = DEFAULT_RESUME_STEP if at is None else int(round(at["step"] * num_steps / at["of"]))
        return max(r, self.cfg.probe_steps)

    def tier_resume(self, tier: Tier, num_steps: int) -> int:
        """The step a reuse by ``tier`` resumes at (the configured step overrides every tier's; never inside the probe
        when the tier reads it)."""
        r = self.cfg.resume_step if self.cfg.resume_step is not None else tier.resume_at(num_steps)
        return max(r, self.cfg.probe_steps) if tier.scope == "region" else max(r, 1)

    def stored_steps(self, num_steps: int) -> set[int]:
        # A reuse resumes at r from traj.{r-1}; one that blends (a region) reads the source's latents after every later
        # step too, traj.{r-1} .. traj.{n-1}; a frame tier's blends nothing, so it reads traj.{r-1} alone.
        if not self.tiers:
            steps = set(range(self.resume_at(num_steps) - 1, num_steps))
        else:
            steps = set()
            for t in self.tiers.values():
                r = self.tier_resume(t, num_steps)
                steps |= {r - 1} if t.scope == "frame" else set(range(r - 1, num_steps))
        if self.cfg.own_sample > 0:
            steps.add(num_steps - 1)
        return steps

    def uses_signature(self) -> bool:
        """Whether the thresholds read any Early Signature dimension (else a content-only rule: no probe needed)."""
        t = self.tau
        return t.risk is not None or any(not math.isinf(getattr(t, k)) for k in ("context", "size", "shape", "color"))

    def content_only(self) -> bool:
        """Whether the thresholds decide by content alone (a content threshold, no signature dimension): a hit then asks
        the same as its source and recomputes the whole frame, so neither the decision nor the plan reads the probe."""
        return not self.uses_signature() and not math.isinf(self.tau.content) and not self.edit_tiers()

    def probe_needed(self, inputs: DecisionInputs) -> bool:
        """Whether this request's probe can change the decision or the plan (``CarnatorConfig.probe``); the engine
        asks after recall and skips the probe when not."""
        if self.cfg.probe == "always":
            return True
        if self.tiers:
            # A region tier's plan recomputes the regions the probe reads, and every entry stores them for later edits;
            # a request that will resume by a frame tier (its whole frame recomputed), or any request when no tier
            # reads a region, needs none.
            if not any(t.scope == "region" for t in self.tiers.values()):
                return False
            cands = self.candidates(inputs, need_signature=False)
            first = self.tier_for(inputs, cands[0][0]) if cands else None
            return first is None or first.scope != "frame"
        # With thresholds that read a signature the probe always runs: its signature is stored with the entry, and a
        # later request's test needs it even when this request has no candidate. Without a content threshold either
        # (open thresholds), the plan's target region is the probe's evidence.
        return not self.content_only()

    def plan_reads_probe(self, decision: Decision) -> bool:
        """Whether an injected ``decision`` (a replay) needs the probe: one naming a frame tier (a hit by it, whose plan
        recomputes every token from its step, or a miss decided under frame tiers only) reads none, so its replay runs
        no probe, as the served request does."""
        return (decision.details.get("tier") or {}).get("scope") != "frame"

    def candidates(self, inputs: DecisionInputs, need_signature: bool | None = None) -> list[tuple[Candidate, NounDiff]]:
        """The recalled candidates that pass the noun filter (PAPER step 1) and carry a signature (when the thresholds
        read one), with their noun diffs, in recall order; never an entry that was itself a reuse, nor (with
        ``admitted_only``) one whose own clip failed the admission judge."""
        if need_signature is None:
            need_signature = self.uses_signature()
        out: list[tuple[Candidate, NounDiff]] = []
        for c in inputs.candidates:
            if self.cfg.admitted_only and c.meta.extra.get("admitted") is False:
                continue  # its own output failed the admission judge: never a source
            if c.meta.extra.get("approximate"):
                # A reuse's own entry: its trajectory begins at its resume step (it never computed the latent a reuse
                # resumes from), and no calibration pair resumed from a reuse. It still serves exact hits.
                continue
            theirs = c.meta.extra.get("nouns", [])
            diff = noun_diff(inputs.nouns, theirs)
            if diff is None and inputs.content is not None and (
                    content_distance(inputs.content, c.meta.extra.get("content")) == 0 or self.tier_for(inputs, c) is not None):
                # the same content in other words ("ball" for "circle"), or an edit a tier reuses ("backdrop" for
                # "wall" beside it): the content reader's synonyms decide, not the nouns' spelling
                diff = NounDiff(shared=tuple(sorted(set(inputs.nouns) & set(theirs))), substituted=None)
            if diff is not None and ("signature" in c.meta.extra or not need_signature):
                out.append((c, diff))
        if self.tiers:
            # With tiers, only a candidate whose kind of change has one can be reused: those first, the one that keeps
            # the most of its trajectory (the latest resume step) first among them, recall order otherwise.
            def rank(cd: tuple[Candidate, NounDiff]) -> tuple[bool, float]:
                t = self.tier_for(inputs, cd[0])
                return (t is None, 0 if t is None else -t.step / t.of)
            out.sort(key=rank)
        elif inputs.content is not None and not math.isinf(self.tau.content):
            # A candidate that asks what the request asks is tested before one that does not (recall order otherwise):
            # the content test reads only the two prompts, so this adds no chance for a signature test to err, and a
            # rewording's nearest sentence is often another scene's.
            out.sort(key=lambda cd: content_distance(inputs.content, cd[0].meta.extra.get("content")) > self.tau.content)
        return out

    def change(self, inputs: DecisionInputs, c: Candidate) -> str:
        """What changed from cached candidate ``c`` to the request (:func:`change_kind`: re-roll, rewording, colour, ...)."""
        return change_kind(inputs.request.prompt, c.meta.prompt, inputs.content, c.meta.extra.get("content"))

    def tier_for(self, inputs: DecisionInputs, c: Candidate) -> Tier | None:
        """The certified tier that reuses candidate ``c`` for this request (None: its kind of change has none)."""
        if not self.tiers:
            return None
        tier = self.tiers.get(self.change(inputs, c))
        return None if tier is None or (tier.kind, tier.step) in self.disabled_tiers else tier

    # ---- live audits -------------------------------------------------------------------------------------
    def audit_tier(self, kind: str) -> tuple[int, int | None]:
        """The tier a reuse of ``kind`` runs by, as a live audit names it: ``(step, of)``, the resume step on the
        thresholds file's own scale (a tier's, else the file's certified resume step, else the configured one)."""
        tier = self.tiers.get(kind) if self.tiers else None
        if tier is not None:
            return tier.step, tier.of
        if self.cfg.resume_step is None and self.certified_resume is not None:
            return int(self.certified_resume["step"]), int(self.certified_resume["of"])
        return (self.cfg.resume_step or DEFAULT_RESUME_STEP), None

    def disable(self, tiers: Iterable[tuple[str, int]]) -> None:
        """Stop reusing by these ``(kind, step)`` tiers (plain data; an empty set enables every tier again). A
        request of such a kind then runs as it would without the tier: a miss that says so."""
        self.disabled_tiers = frozenset((str(k), int(s)) for k, s in tiers)

    def with_disabled(self, tiers: Iterable[tuple[str, int]]) -> CarnatorPolicy:
        """A copy of this policy with exactly these ``(kind, step)`` tiers disabled; this one is left as it is. What
        one job runs by when its disabled set travels with it (``carnator serve --replicas``: the ingress's live audit
        decides the set, each job carries it to its replica), so jobs running at once never see each other's set. The
        copy shares everything else (config, thresholds, tiers), which a run only reads."""
        out = copy.copy(self)
        out.disable(tiers)
        return out

    def _disabled(self, kind: str) -> str | None:
        """Why a reuse of ``kind`` is off (its tier disabled by a live audit), or None."""
        if not self.disabled_tiers:
            return None
        step, of = self.audit_tier(kind)
        if (kind, step) not in self.disabled_tiers:
            return None
        return (f"the {kind} tier (step {step}{'' if of is None else f' of {of}'}) is disabled: the live audit of its "
                "hits bounds their unsafe share above the certificate's delta (it resumes when a new thresholds file is "
                "loaded)")

    def prefetch(self, inputs: DecisionInputs) -> tuple[str, list[str] | None] | None:
        cands = self.candidates(inputs)
        sim = None if not cands else cands[0][0].similarity
        if not cands or not self.cfg.prefetch or (sim is not None and 1.0 - sim > self.tau.text):
            return None  # its text distance alone already fails the test
        c = cands[0][0]
        if not self.tiers and inputs.content is not None and content_distance(inputs.content, c.meta.extra.get("content")) > self.tau.content:
            return None  # it asks for something else: it fails the test
        n = inputs.num_steps
        tier = self.tier_for(inputs, c)
        if self.tiers and tier is None:
            return None
        r = self.resume_at(n) if tier is None else self.tier_resume(tier, n)
        names = [f"traj.{i}" for i in range(r - 1, n)] + [EVIDENCE_PREFIX + w for w in c.meta.extra.get("nouns", [])]
        if inputs.sparse is not None:
            names += [k for k in getattr(c.meta, "tensor_names", ()) if k.startswith(MASK_PREFIX)]
        return c.meta.id, names

    # ---- decide and plan ---------------------------------------------------------------------------------
    def decide(self, inputs: DecisionInputs) -> Decision:
        sig = inputs.signature
        if sig is None and self.uses_signature():
            return Decision.miss("no probe signature")
        if sig is None:
            sig = EarlySignature()   # a content-only rule reads no signature dimension
        cands = self.candidates(inputs)
        notes = {"candidates": len(cands), "signature": sig.to_dict()}
        if not self.recall_by_sentence():
            notes["recall"], notes["recalled"] = "content", len(inputs.candidates)
        if not cands and not self.recall_by_sentence():
            if not inputs.candidates:
                why = ("nothing cached asks the same (this rule reuses only a request with the same objects, sizes, "
                       "colours, motions and place: content 0)")
            else:  # (a reuse's own entry is never found by content: it is stored without a content key)
                n = len(inputs.candidates)
                why = (f"{n} cached request{'s ask' if n > 1 else ' asks'} the same, but {'their' if n > 1 else 'its'} "
                       "own clip failed the admission judge: never a reuse source")
            return Decision.miss(why, details=notes)
        if not cands:
            why = "no cached request passes the noun filter" if inputs.candidates else "nothing cached to reuse"
            if self.cfg.admitted_only and any(c.meta.extra.get("admitted") is False for c in inputs.candidates):
                why += " among those whose own clip passed the admission judge"
            return Decision.miss(why, details=notes)
        if self.tiers:
            return self._decide_tier(inputs, cands[0], notes)
        r = self.resume_at(inputs.num_steps)
        if r >= inputs.num_steps:
            return Decision.miss(f"the resume step {r} is not inside the {inputs.num_steps} steps", details=notes)
        tested = []
        for c, diff in cands[: self.cfg.tested]:
            try:
                theirs = c.meta.extra.get("signature")
                if theirs is None and not self.uses_signature():
                    tested.append((c, diff, EarlySignature()))
                elif isinstance(theirs, dict):
                    tested.append((c, diff, EarlySignature.from_dict(theirs)))
                # else: no signature to test (a null one read as an AttributeError before)
            except (ValueError, KeyError, TypeError):
                continue
        contents = [None if inputs.content is None else content_distance(inputs.content, c.meta.extra.get("content"))
                    for c, _, _ in tested]
        won = first_compatible(sig, [(s, diff, c.similarity, k) for (c, diff, s), k in zip(tested, contents)], self.tau,
                               self.cfg.compat)
        results = won.tested
        if inputs.signature is None:  # no probe ran: context was not measured (not the paper's 0 for no shared noun)
            results = tuple(replace(d, context=math.inf) for d in results)
        notes["tested"] = [{"id": c.meta.id, "similarity": c.similarity, "discrepancies": d.to_dict(),
                            "risk": None if self.tau.risk is None else self.tau.risk.risk(d)}
                           for (c, _, _), d in zip(tested, results)]
        if won.index is None:
            if not tested:
                return Decision.miss("no tested candidate carries a readable signature", details=notes)
            c, _, _ = tested[0]
            change = "" if inputs.content is None else f" ({content_change(inputs.content, c.meta.extra.get('content'))})"
            return Decision.miss(f"{c.meta.id[:8]} fails the compatibility test{change}: {explain(results[0], self.tau)}",
                                 details=notes, similarity=c.similarity, discrepancies=results[0])
        c, diff, _ = tested[won.index]
        d = results[won.index]
        kind = self.change(inputs, c)
        off = self._disabled(kind)
        if off is not None:
            step, of = self.audit_tier(kind)
            notes.update(change=kind, disabled_tier={"kind": kind, "step": step, "of": of})
            return Decision.miss(f"{c.meta.id[:8]} is compatible, but {off}", details=notes, similarity=c.similarity)
        step, of = self.audit_tier(kind)
        notes.update(change=kind, audit={"kind": kind, "step": step, "of": of})
        notes["discrepancies"] = {k: (None if v is None else float(v)) for k, v in vars(d).items()}
        return Decision(
            reuse=True, source_id=c.meta.id, similarity=c.similarity, discrepancies=d, certified=self.certified,
            reason=f"compatible with {c.meta.id[:8]}"
                   + ("" if inputs.content is None else f" ({content_change(inputs.content, c.meta.extra.get('content'))})")
                   + f": {explain(d, self.tau)}",
            details={**notes, "substituted": diff.substituted, "source_nouns": list(c.meta.extra.get("nouns", []))},
        )

    def _decide_tier(self, inputs: DecisionInputs, cand: tuple[Candidate, NounDiff], notes: dict) -> Decision:
        """The decision under risk tiers: the first candidate (ranked by :meth:`candidates`) is reused by its kind of
        change's tier, or the request misses naming the kind."""
        c, diff = cand
        kind = self.change(inputs, c)
        what = "" if inputs.content is None else content_change(inputs.content, c.meta.extra.get("content"))
        notes["change"] = kind
        notes["nearest"] = {"id": c.meta.id, "what": what}
        tier = self.tiers.get(kind)
        off = None if tier is None else self._disabled(kind)
        if tier is not None and off is not None:
            notes["disabled_tier"] = {"kind": kind, "step": tier.step, "of": tier.of}
            return Decision.miss(f"nearest cached request {c.meta.id[:8]} {what or 'differs'}: {off}", details=notes,
                                 similarity=c.similarity)
        if tier is None:
            kinds = ", ".join(sorted(self.tiers))
            return Decision.miss(f"nearest cached request {c.meta.id[:8]} {what or 'differs'}: no certified tier reuses "
                                 f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} change on this model (tiers: {kinds})", details=notes, similarity=c.similarity)
        n = inputs.num_steps
        r = self.tier_resume(tier, n)
        if r >= n:
            return Decision.miss(f"the {kind} tier's resume step {r} is not inside the {n} steps", details=notes)
        if tier.scope == "region" and inputs.signature is None:
            return Decision.miss(f"the {kind} tier recomputes the probe's regions, and no probe ran", details=notes)
        bound = "" if tier.bound is None else f", unsafe <= {100 * tier.bound:.1f} %"
        how = "whole frame" if tier.scope == "frame" else "region-guided"
        return Decision(
            reuse=True, source_id=c.meta.id, similarity=c.similarity, certified=self.certified and tier.certified,
            resume_step=r, reason=f"{kind} of {c.meta.id[:8]}{f' ({what})' if what else ''}: {how} from step {r} of {n} "
                                  f"(tier certified on {tier.accepted} pairs{bound})",
            details={**notes, "tier": {"kind": kind, "step": r, "scope": tier.scope, "bound": tier.bound},
                     "audit": {"kind": kind, "step": tier.step, "of": tier.of}, "substituted": diff.substituted, "source_nouns": list(c.meta.extra.get("nouns", []))},
        )

    def plan(self, decision: Decision, inputs: DecisionInputs) -> ReusePlan:
        if not decision.reuse:
            return ReusePlan(capture=inputs.sparse)
        cfg, n = self.cfg, inputs.num_steps
        r = decision.resume_step or self.resume_at(n)
        # Target region: the query's region of the substituted noun and the source's region of its noun (so the old
        # object is recomputed, not kept as a ghost); with no substitution, every noun's.
        sub = decision.details.get("substituted")
        source_nouns = decision.details.get("source_nouns", [])
        masks: list[np.ndarray | None]
        if sub is not None:
            oq, oj = sub
            masks = [inputs.regions.get(oq)]
            source = [EVIDENCE_PREFIX + oj]
        else:
            masks = list(inputs.regions.values())
            source = [EVIDENCE_PREFIX + w for w in source_nouns]
        if decision.regions is not None:  # an injected decision's own target (a replay)
            masks = list(decision.regions) if sub is None else [decision.regions[0]]
        found = tuple(m for m in masks if m is not None)
        frame = (decision.details.get("tier") or {}).get("scope") == "frame"
        if frame:
            found, source = (), []   # a frame tier recomputes every token from its step: nothing of the source is blended in
        # no probe ran (a content-only rule) or a frame tier: no region, the whole frame is recomputed (Active 1.0)
        region = RegionSpec(scope=cfg.scope, masks=found, source_masks=tuple(source) if found else (),
                            everywhere_if_empty=inputs.signature is None or frame)
        masks_apply = inputs.sparse is not None
        return ReusePlan(
            hit=True, source_id=decision.source_id, resume_step=r, init_latent=f"traj.{r - 1}",
            own_sample=float(cfg.own_sample), clean_latent=f"traj.{n - 1}" if cfg.own_sample > 0 else None,
            phases=(Phase(r, n, blend=not frame, window=True, masks=masks_apply),), region=region, window_layers=cfg.window,
            mask_prefix=MASK_PREFIX if masks_apply else None, capture=inputs.sparse,
        )

    # ---- the entry --------------------------------------------------------------------------------------
    def entry(self, inputs: DecisionInputs, plan: ReusePlan, record: AttentionRecord) -> Entry:
        if inputs.signature is None:
            return Entry(captured_masks(record, MASK_PREFIX), {})
        tensors = {EVIDENCE_PREFIX + w: torch.from_numpy(m.astype(np.uint8)) for w, m in inputs.regions.items()}
        tensors.update(captured_masks(record, MASK_PREFIX))
        return Entry(tensors, {"nouns": list(inputs.nouns), "signature": inputs.signature.to_dict()})
