"""Cross-request baselines in the same engine (PAPER "Baselines"); all share one text gate.

- ``nirvana`` (NIRVANA, NSDI'24, adapted to video): the text-nearest cached request; its similarity
  picks the resume step (s > 0.95 -> 25, > 0.90 -> 20, > 0.85 -> 15, > 0.75 -> 10, > 0.65 -> 5 of
  50, scaled to other step counts), and the request continues from that entry's latent under its
  own prompt. Eviction LCBFU is the bank's ``eviction="lcbfu"``.
- ``chorus2`` (Chorus II for T2V): the text-nearest cached request's block-sparse attention masks
  are reused for every step; the latent trajectory is the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.state import AttentionRecord, SparseConfig
from ..plan import Candidate, Decision, DecisionInputs, Phase, ReusePlan
from .base import Entry, Policy, captured_masks, register_policy

MASK_PREFIX = "attn."


@dataclass(frozen=True)
class TextGate:
    """The shared text-similarity gate: the nearest recalled entry (cosine of recall embeddings; recall keeps the
    request's tenant and compatibility key), if its similarity is at least ``min_similarity``."""

    min_similarity: float = 0.65

    def nearest(self, candidates: tuple[Candidate, ...]) -> Candidate | None:
        sim = candidates[0].similarity if candidates else None
        if sim is None or sim < self.min_similarity:  # (recall by content measures no similarity: no gate passes)
            return None
        return candidates[0]

    def miss(self, candidates: tuple[Candidate, ...]) -> Decision:
        if not candidates:
            return Decision.miss("nothing cached to reuse")
        c = candidates[0]
        return Decision.miss(f"the nearest cached request {c.meta.id[:8]} is too far (similarity {c.similarity:.3f} < "
                             f"{self.min_similarity})", similarity=c.similarity, details={"similarity": c.similarity})


NIRVANA_TABLE: tuple[tuple[float, int], ...] = ((0.95, 25), (0.90, 20), (0.85, 15), (0.75, 10), (0.65, 5))


def _nirvana_step(k: int, num_steps: int) -> int:
    """A table step (given for 50 steps) scaled to ``num_steps``."""
    return max(1, round(k * num_steps / 50))


def nirvana_resume_step(similarity: float, num_steps: int) -> int | None:
    """NIRVANA's similarity-to-resume-step table (given for 50 steps), scaled to ``num_steps``."""
    for thr, k in NIRVANA_TABLE:
        if similarity > thr:
            return _nirvana_step(k, num_steps)
    return None


@register_policy
class NirvanaPolicy(Policy):
    name = "nirvana"

    def __init__(self, gate: TextGate | None = None):
        self.gate = gate or TextGate()

    def recall_k(self) -> int:
        return 1

    def decide(self, inputs: DecisionInputs) -> Decision:
        near = self.gate.nearest(inputs.candidates)
        if near is None:
            return self.gate.miss(inputs.candidates)
        n = inputs.num_steps
        assert near.similarity is not None  # the gate passes only a measured similarity
        k = nirvana_resume_step(near.similarity, n)
        if k is None or k >= n:
            return Decision.miss(f"similarity {near.similarity:.3f} picks no resume step inside the {n} steps",
                                 similarity=near.similarity, details={"similarity": near.similarity})
        return Decision(reuse=True, source_id=near.meta.id, similarity=near.similarity, resume_step=k,
                        reason=f"similar to {near.meta.id[:8]} (similarity {near.similarity:.3f}): resumes at step {k}",
                        details={"similarity": near.similarity})

    def plan(self, decision: Decision, inputs: DecisionInputs) -> ReusePlan:
        if not decision.reuse:
            return ReusePlan()
        k = decision.resume_step
        if k is None:
            raise ValueError("a NIRVANA reuse decision names its resume step")
        return ReusePlan(hit=True, source_id=decision.source_id, resume_step=k, init_latent=f"traj.{k - 1}")

    def stored_steps(self, num_steps: int) -> set[int]:
        # The latents after the table's steps (5, 10, 15, 20, 25 of 50, scaled): resuming at k reads traj.{k-1}.
        return {_nirvana_step(k, num_steps) - 1 for _, k in NIRVANA_TABLE} & set(range(num_steps))


@register_policy
class Chorus2Policy(Policy):
    name = "chorus2"
    needs_attention = True

    def __init__(self, gate: TextGate | None = None, sparse: SparseConfig | dict | None = None):
        self.gate = gate or TextGate()
        self.sparse = SparseConfig(**sparse) if isinstance(sparse, dict) else (sparse or SparseConfig())

    def recall_k(self) -> int:
        return 1

    def sparse_config(self) -> SparseConfig:
        return self.sparse

    def decide(self, inputs: DecisionInputs) -> Decision:
        if inputs.sparse is None:  # no block-sparse kernel here: masks would only cost time
            return Decision.miss("masks do not apply on this device (SparseConfig.apply)",
                                 details={"fallback": "dense", "reason": "masks do not apply (SparseConfig.apply)"})
        near = self.gate.nearest(inputs.candidates)
        if near is None:
            return self.gate.miss(inputs.candidates)
        return Decision(reuse=True, source_id=near.meta.id, similarity=near.similarity,
                        reason=f"reuses the block masks of {near.meta.id[:8]} (similarity {near.similarity:.3f})",
                        details={"similarity": near.similarity})

    def plan(self, decision: Decision, inputs: DecisionInputs) -> ReusePlan:
        if not decision.reuse:
            return ReusePlan(capture=inputs.sparse)
        return ReusePlan(hit=True, source_id=decision.source_id, resume_step=0, phases=(Phase(0, inputs.num_steps, masks=True),),
                         mask_prefix=MASK_PREFIX, require_masks=True, capture=inputs.sparse)

    def entry(self, inputs: DecisionInputs, plan: ReusePlan, record: AttentionRecord) -> Entry:
        return Entry(captured_masks(record, MASK_PREFIX), {})

    def stored_steps(self, num_steps: int) -> set[int]:
        return set()  # reuses only the source's masks, never its latents
