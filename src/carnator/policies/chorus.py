"""``chorus``: the Chorus baseline (arXiv 2604.04451) in the same engine, cache and text gate.

Chorus takes the text-nearest cached request as its source (the shared :class:`TextGate` of the
baselines) and generates the target request in three stages over ``n`` steps:

1. steps ``[0, r)`` are not run: the target resumes from the source's post-scheduler latent after
   step ``r - 1`` (``r = round(stage1_end * n)``);
2. steps ``[r, s)`` recompute only the regions where the two prompts differ, under the target's
   own prompt, with Token-Guided Attention Amplification (TGAA) of the target's differing tokens;
   outside those regions the latent is the source's (``s = round(stage3_start * n)``);
3. steps ``[s, n)`` run in full, without amplification.

Substitutions relative to the original (which uses an LLM for the prompt diff and a segmentation
model for the regions), each a documented rule here:

- **Prompt diff** (:func:`prompt_diff`), lexical instead of an LLM: the nouns of each prompt
  (:func:`carnator.signature.nouns.extract_nouns`: spaCy if an English pipeline is installed, else
  the fallback that is exact on the shapes world; canonicalised with ``normalize_noun``) and their
  *attributes*: the run of attribute words (``ATTRIBUTE_WORDS``: the adjective lexicon of
  ``signature.nouns``, which holds colour and size words, plus the shapes world's colour and size
  words) directly before an occurrence of the noun ("a small red ball" gives ball: {small, red}).
  The target differs in its nouns the source lacks, in attributes of a shared noun the source's
  copy lacks, and in attributes of a new noun that none of the source's removed nouns had (so
  "a small red ball" -> "a small red box" differs in box/ball only). The paper's one-substitution
  noun filter (``reuse.noun_diff``) does not apply: Chorus takes any number of differing nouns.
  Words that are neither nouns nor attributes (verbs, motion, counts) are not part of the diff.
- **Regions** (:func:`cross_attention_region`), cross-attention instead of segmentation: at the first
  stage-2 step, which therefore runs in full, the attention processors record (the same
  :class:`~carnator.attention.controller.AttentionController` recording as carnator's probe) the
  cond-branch cross-attention of every visual token to the target's nouns and attributes at one
  layer (``record_layer``, default the middle one). A word's response (mean over heads and its token
  positions) is min-max normalised and hysteresis-thresholded (``region_high`` / ``region_low``;
  no self-attention expansion, which is carnator's, not Chorus's). The region words are the
  differing words plus the nouns whose attributes differ. The source-side words (e.g. the
  replaced noun) are read from the source entry: every chorus request stores its words' responses
  at step ``r`` (``chorus.xattn.<word>`` tensors), on the very latent the target resumes from. A diff
  that cannot be localised (no token positions, no stored response) is recomputed everywhere.
- **Region-only recomputation** uses the engine's region-guided machinery (as carnator's PAPER
  step 8): after every stage-2 step ``z = W z_target + (1 - W) z_source`` with ``W`` from the
  dilated regions (``ScopeConfig``: Active 2 tokens, Context +3, smoothstep band), and in the
  middle-layer ``window`` only Active tokens are recomputed, attending to Context tokens.
- **TGAA**: in every layer's cross-attention of the cond branch, ``log(tgaa_scale)`` is added to
  the logits of the target's differing tokens (their weights are multiplied by ``tgaa_scale`` and
  each row renormalised), at stage-2 steps only. ``tgaa_scale = 1`` is no amplification, bit for bit.
- **Stage boundaries and scale** are not given by our sources: ``stage1_end = 0.3``,
  ``stage3_start = 0.8`` and ``tgaa_scale = 2.0`` are chosen knobs.
- An empty diff (the same nouns and attributes) has nothing to recompute: stage 2 is skipped and
  the target resumes at ``s`` from the source's latent.
- Adapters without attention processors fall back to dense generation with a warning, as carnator
  does (every shipped family has them; for the joint-attention families, CogVideoX and HunyuanVideo,
  TGAA biases the video queries' logits of the text tokens in the joint attention).

Limitations: the diff is lexical (synonyms such as ball / circle count as differences; a changed
motion does not); a hit's entry lacks the trajectory before its resume step, so (as with the other
policies) it cannot be a later request's source; the first stage-2 step runs inside :meth:`plan`
(timed as ``region`` and counted in ``dit``), so the engine's progress callback does not see it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..attention.state import Amplification, AttentionRecord, EvidenceRecord
from ..plan import Decision, DecisionInputs, Phase, RecordedRegions, RegionSpec, ReusePlan
from ..reuse import ScopeConfig
from ..signature import RegionConfig, normalize_noun
from ..signature.nouns import _ADJ
from .base import Entry, Policy, register_policy
from .baselines import TextGate

log = logging.getLogger("carnator")

XATTN_PREFIX = "chorus.xattn."

#: Words that count as attributes when they directly precede a noun (colour, size and other adjectives; the
#: embedded model's colour and size words are all among them).
ATTRIBUTE_WORDS: frozenset[str] = frozenset(_ADJ)

_WORD = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)?")


# ---- the prompt diff ---------------------------------------------------------------------------------


def canonical_nouns(nouns: Iterable[str]) -> list[str]:
    """Canonical nouns (:func:`normalize_noun`), in order, duplicates merged."""
    return [n for n in dict.fromkeys(normalize_noun(n) for n in nouns) if n]


def attributes(prompt: str, nouns: Iterable[str]) -> dict[str, set[str]]:
    """noun -> its attribute words: the run of :data:`ATTRIBUTE_WORDS` directly before each occurrence
    of the noun ("a big blue box" -> box: {big, blue}); ``nouns`` canonical."""
    ns = list(dict.fromkeys(nouns))
    out: dict[str, set[str]] = {n: set() for n in ns}
    words = _WORD.findall(prompt.lower())
    for i, w in enumerate(words):
        if w not in out:
            continue
        j = i - 1
        while j >= 0 and words[j] in ATTRIBUTE_WORDS and words[j] not in out:
            out[w].add(words[j])
            j -= 1
    return out


def prompt_words(prompt: str, nouns: Iterable[str]) -> list[str]:
    """Every noun of ``prompt`` (``nouns``, from the engine's noun extractor) and its attribute words (attributes
    first), in order, duplicates merged."""
    attrs = attributes(prompt, canonical_nouns(nouns))
    return list(dict.fromkeys(w for n, a in attrs.items() for w in [*sorted(a), n]))


@dataclass(frozen=True)
class PromptDiff:
    """Where a target prompt differs from a source prompt, in nouns and attributes.

    ``target_nouns`` / ``source_nouns``: nouns only the target / only the source has.
    ``target_attributes`` / ``source_attributes``: (attribute, noun) pairs of that side the other
    side lacks (see the module doc for new nouns).
    """

    target_nouns: tuple[str, ...] = ()
    source_nouns: tuple[str, ...] = ()
    target_attributes: tuple[tuple[str, str], ...] = ()
    source_attributes: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.target_nouns or self.source_nouns or self.target_attributes or self.source_attributes)

    @property
    def target_tokens(self) -> list[str]:
        """The target's differing words (what TGAA amplifies)."""
        return list(dict.fromkeys([*self.target_nouns, *(a for a, _ in self.target_attributes)]))

    @property
    def source_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.source_nouns, *(a for a, _ in self.source_attributes)]))

    @property
    def target_region_words(self) -> list[str]:
        """Words of the target whose cross-attention regions are recomputed: its differing words and
        the nouns whose attributes differ."""
        return list(dict.fromkeys([*self.target_tokens, *(n for _, n in self.target_attributes), *(n for _, n in self.source_attributes if n not in self.source_nouns)]))

    @property
    def source_region_words(self) -> list[str]:
        return list(dict.fromkeys([*self.source_tokens, *(n for _, n in self.source_attributes), *(n for _, n in self.target_attributes if n not in self.target_nouns)]))

    def to_dict(self) -> dict[str, list]:
        return {"target": self.target_tokens, "source": self.source_tokens}


def prompt_diff(target: str, source: str, target_nouns: Iterable[str], source_nouns: Iterable[str]) -> PromptDiff:
    """The noun-and-attribute diff of ``target`` against ``source`` (Chorus's prompt diff, lexical), given each
    prompt's nouns."""
    nt, ns = canonical_nouns(target_nouns), canonical_nouns(source_nouns)
    at, as_ = attributes(target, nt), attributes(source, ns)
    added = tuple(n for n in nt if n not in as_)
    removed = tuple(n for n in ns if n not in at)

    def attr_diff(mine: dict[str, set[str]], other: dict[str, set[str]], others_removed: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        carried = set().union(*(other[m] for m in others_removed))
        return tuple((a, n) for n, attrs in mine.items() for a in sorted(attrs - other.get(n, carried)))

    return PromptDiff(added, removed, attr_diff(at, as_, removed), attr_diff(as_, at, added))


def _response(ev: EvidenceRecord | None, positions: Iterable[int]) -> torch.Tensor | None:
    """A word's cross-attention response (N,): mean over heads and its token positions."""
    if ev is None or ev.cross is None:
        return None
    cols = [ev.positions.index(p) for p in positions if p in ev.positions]
    if not cols:
        return None
    return ev.cross[:, :, cols].float().mean(dim=(0, 2))


# ---- the policy ------------------------------------------------------------------------------------------


@dataclass
class ChorusConfig:
    """Knobs of the Chorus baseline (all chosen: our sources give none; docs/METHOD.md).

    stage1_end: stage 1 = steps [0, round(stage1_end * n)), taken from the source's trajectory.
    stage3_start: stage 3 = steps [round(stage3_start * n), n), run in full.
    tgaa_scale: multiplier of the target's differing tokens' cross-attention weights in stage 2
        (1 = no amplification).
    record_layer: layer whose cross-attention gives the regions (None = num_layers // 2).
    region_high, region_low, connectivity: hysteresis of the normalised cross-attention response.
    scope: dilation and blend ramp of the regions; window: fraction of layers [start, end) where only
        Active tokens are recomputed in stage 2 (as carnator's).
    """

    stage1_end: float = 0.3
    stage3_start: float = 0.8
    tgaa_scale: float = 2.0
    record_layer: int | None = None
    region_high: float = 0.5
    region_low: float = 0.25
    connectivity: Literal["volume", "frame"] = "volume"
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    window: tuple[float, float] = (0.2, 0.867)

    def __post_init__(self) -> None:
        if not 0.0 < self.stage1_end <= self.stage3_start <= 1.0:
            raise ValueError(f"ChorusConfig: need 0 < stage1_end <= stage3_start <= 1, got {self.stage1_end}, {self.stage3_start}")
        if not self.tgaa_scale > 0.0:
            raise ValueError(f"ChorusConfig: tgaa_scale must be > 0, got {self.tgaa_scale}")
        RegionConfig(high=self.region_high, low=self.region_low, connectivity=self.connectivity)  # validates

    def stages(self, num_steps: int) -> tuple[int, int]:
        """(r, s): the first step of stage 2 and of stage 3."""
        r = max(1, round(self.stage1_end * num_steps))
        return r, max(r, round(self.stage3_start * num_steps))


@register_policy
class ChorusPolicy(Policy):
    name = "chorus"
    needs_attention = True

    def __init__(self, gate: TextGate | None = None, config: ChorusConfig | None = None, **overrides: Any) -> None:
        self.gate = gate or TextGate()
        self.cfg = config or ChorusConfig(**overrides)

    def recall_k(self) -> int:
        return 1

    def words(self, prompt: str, nouns: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(prompt_words(prompt, nouns))

    def stored_steps(self, num_steps: int) -> set[int]:
        # Stage 2 resumes at r and blends with the source until s; with no regional difference the
        # request resumes straight at min(s, n - 1).
        r, s = self.cfg.stages(num_steps)
        return (set(range(r - 1, s)) | {min(s, num_steps - 1) - 1}) & set(range(num_steps))

    def _record(self, inputs: DecisionInputs) -> tuple[int, int]:
        """(step, layer) at which every request records its words' cross-attention."""
        r, _ = self.cfg.stages(inputs.num_steps)
        layer = self.cfg.record_layer if self.cfg.record_layer is not None else inputs.num_layers // 2
        return r, layer

    def decide(self, inputs: DecisionInputs) -> Decision:
        n = inputs.num_steps
        r, s = self.cfg.stages(n)
        near = self.gate.nearest(inputs.candidates)
        if near is None:
            return self.gate.miss(inputs.candidates)
        if r >= n:
            return Decision.miss(f"stage 2 would start at step {r} of {n}")
        meta = near.meta
        diff = prompt_diff(inputs.request.prompt, meta.prompt, inputs.nouns, meta.extra.get("nouns") or ())
        notes = {"similarity": near.similarity, "diff": diff.to_dict(), "stages": [r, s]}
        if not diff.empty and s > r:
            notes["amplified_tokens"] = len({p for w in diff.target_tokens for p in inputs.word_positions.get(w, ())})
        what = "no regional difference" if diff.empty else f"recomputes {', '.join(diff.target_tokens + diff.source_tokens)}"
        return Decision(reuse=True, source_id=meta.id, similarity=near.similarity,
                        reason=f"similar to {meta.id[:8]} (similarity {near.similarity:.3f}): {what}",
                        details={**notes, "prompt_diff": diff, "source_record": meta.extra.get("chorus")})

    def plan(self, decision: Decision, inputs: DecisionInputs) -> ReusePlan:
        cfg, n = self.cfg, inputs.num_steps
        r, s = cfg.stages(n)
        step, layer = self._record(inputs)
        positions = inputs.word_positions
        all_pos = tuple(sorted({p for ps in positions.values() for p in ps}))
        record = (step, layer, all_pos) if all_pos else None
        if not decision.reuse:
            return ReusePlan(record=record)
        diff: PromptDiff = decision.details["prompt_diff"]
        if diff.empty or s <= r:  # nothing to recompute locally: straight to stage 3
            start = min(s, n - 1)
            return ReusePlan(hit=True, source_id=decision.source_id, resume_step=start, init_latent=f"traj.{start - 1}", record=record)
        amp = Amplification(tuple(sorted({p for w in diff.target_tokens for p in positions.get(w, ())})), cfg.tgaa_scale)
        if decision.regions is not None:  # an injected decision's own target (a replay)
            region = RegionSpec(scope=cfg.scope, masks=tuple(decision.regions), everywhere_if_empty=True)
        else:
            src_ok = decision.details.get("source_record") == {"record_step": step, "record_layer": layer}
            recorded = RecordedRegions(
                positions=tuple(tuple(positions.get(w, ())) for w in diff.target_region_words),
                source_responses=tuple(XATTN_PREFIX + w for w in diff.source_region_words) if src_ok else (),
                high=cfg.region_high, low=cfg.region_low, connectivity=cfg.connectivity)
            region = RegionSpec(scope=cfg.scope, recorded=recorded, everywhere_if_empty=True)
        # Stage 2's first step runs in full (it records the regions), then only Active tokens in the window; stage 3 in full.
        phases = (Phase(r, r + 1, blend=True, amplify=amp), Phase(r + 1, s, blend=True, window=True, amplify=amp), Phase(s, n))
        return ReusePlan(hit=True, source_id=decision.source_id, resume_step=r, init_latent=f"traj.{r - 1}", phases=phases,
                         region=region, window_layers=cfg.window, record=record)

    def entry(self, inputs: DecisionInputs, plan: ReusePlan, record: AttentionRecord) -> Entry:
        """This request's cross-attention response per noun and attribute at step r (float32, (N,)), and the nouns."""
        step, layer = self._record(inputs)
        extra = {"chorus": {"record_step": step, "record_layer": layer}}
        ev = record.evidence.get((step, layer))
        tensors = {}
        if ev is not None and ev.cross is not None:
            for w, pos in inputs.word_positions.items():
                resp = _response(ev, pos)
                if resp is not None:
                    tensors[XATTN_PREFIX + w] = resp.to("cpu", torch.float32)
        return Entry(tensors, extra)
