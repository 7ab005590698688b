"""Cross-request baselines in the same engine (PAPER "Baselines"); all share one text gate.

- ``nirvana`` (NIRVANA, NSDI'24, adapted to video): the text-nearest cached request; its similarity
  picks the resume step (s > 0.95 -> 25, > 0.90 -> 20, > 0.85 -> 15, > 0.75 -> 10, > 0.65 -> 5 of
  50, scaled to other step counts), and the request continues from that entry's latent under its
  own prompt. Eviction LCBFU is the bank's ``eviction="lcbfu"``.
- ``chorus2`` (Chorus II for T2V): the text-nearest cached request's block-sparse attention masks
  are reused for every step; the latent trajectory is the request's own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..attention.blockmask import BlockMaskSet
from ..attention.controller import SparseConfig
from .base import Plan, Policy, register_policy

log = logging.getLogger("carnator")

MASK_PREFIX = "attn."


@dataclass(frozen=True)
class TextGate:
    """The shared text-similarity gate: the nearest entry (cosine of recall embeddings) within the
    request's tenant and compatibility key, if its similarity is at least ``min_similarity``."""

    min_similarity: float = 0.65

    def nearest(self, ctx):
        hits = ctx.recall(1)
        if not hits or hits[0][1] < self.min_similarity:
            return None
        return hits[0]


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

    def plan(self, ctx) -> Plan:
        near = self.gate.nearest(ctx)
        if near is None:
            return Plan()
        meta, sim = near
        n = ctx.state.num_steps
        k = self.resume_step(float(sim), n)
        if k is None or k >= n:
            return Plan()
        try:
            tensors = ctx.bank.load(meta.id, [f"traj.{k - 1}"])
        except KeyError:  # the entry did not keep that step
            return Plan()
        if tensors is None or tuple(tensors[f"traj.{k - 1}"].shape) != tuple(ctx.state.latents.shape):
            return Plan()
        return Plan(hit=True, source_id=meta.id, resume_step=k, init_latents=tensors[f"traj.{k - 1}"], notes={"similarity": float(sim)})

    def resume_step(self, similarity: float, num_steps: int) -> int | None:
        """The step a hit of this ``similarity`` resumes at (:func:`nirvana_resume_step`), None: no hit."""
        return nirvana_resume_step(similarity, num_steps)

    def stored_steps(self, num_steps: int) -> set[int]:
        # The latents after the table's steps (5, 10, 15, 20, 25 of 50, scaled): resuming at k reads traj.{k-1}.
        return {_nirvana_step(k, num_steps) - 1 for _, k in NIRVANA_TABLE} & set(range(num_steps))


@register_policy
class Chorus2Policy(Policy):
    name = "chorus2"

    def __init__(self, gate: TextGate | None = None, sparse: SparseConfig | dict | None = None):
        self.gate = gate or TextGate()
        self.sparse = SparseConfig(**sparse) if isinstance(sparse, dict) else (sparse or SparseConfig())

    def plan(self, ctx) -> Plan:
        ad = ctx.adapter
        if not ad.supports_attention:
            return Plan(notes={"fallback": "dense"})
        ctrl = ad.attention()
        n_tokens = int(np.prod(ad.token_grid(ctx.request)))
        sparse = self.sparse.for_tokens(n_tokens)
        if not sparse.applies(ctx.state.latents.device):  # no block-sparse kernel here: masks would only cost time
            return Plan(notes={"fallback": "dense", "reason": "masks do not apply (SparseConfig.apply)"})
        ctrl.sparse = sparse
        near = self.gate.nearest(ctx)
        if near is None:
            return Plan()
        meta, sim = near
        tensors = ctx.bank.load(meta.id)
        if tensors is None:
            return Plan()
        try:
            masks = BlockMaskSet.from_tensors(tensors, MASK_PREFIX)
        except (KeyError, ValueError):
            return Plan()
        if masks.q_len != n_tokens:
            return Plan()
        ctrl.use_masks(masks, ctx.state.latents.device)
        return Plan(hit=True, source_id=meta.id, resume_step=0, mask_density=masks.density, notes={"similarity": float(sim)})

    def entry_tensors(self, ctx):
        if not ctx.adapter.supports_attention:
            return {}
        c = ctx.adapter.attention().captured
        return c.to_tensors(MASK_PREFIX) if c is not None else {}

    def stored_steps(self, num_steps: int) -> set[int]:
        return set()  # reuses only the source's masks, never its latents
