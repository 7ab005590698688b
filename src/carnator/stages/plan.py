"""Plan: the policy's plan for the decision, bound to the source entry's tensors (read from the store, or from the
read started beside the probe); a source that cannot serve its plan turns the request into a miss."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .. import denoise
from ..backbones.base import BackboneAdapter
from ..cache.protocol import CacheStore
from ..plan import Decision, ReusePlan
from ..request import Request
from .state import RequestState


def plan(rs: RequestState, adapter: BackboneAdapter, store: CacheStore) -> tuple[ReusePlan, denoise.Program]:
    """``rs.decision`` planned by the policy and bound to its source (:func:`bind`); when the source cannot serve the
    plan (a tensor missing or damaged) the decision becomes a miss and the miss's plan runs. Sets ``rs.decision``,
    ``rs.plan`` and ``rs.program``."""
    assert rs.decision is not None, "decide runs first"
    dec, pol, inputs = rs.decision, rs.policy, rs.decision_inputs
    p = pol.plan(dec, inputs)
    program = bind(p, adapter, store, rs.req, rs.state, rs.prefetched)
    if program is None:  # the source cannot serve the plan: a miss after all
        dec = Decision.miss(f"{dec.reason}; but entry {str(p.source_id)[:8]} cannot serve the reuse (a tensor is "
                            "missing or damaged)", details=dec.details)
        p = pol.plan(dec, inputs)
        program = bind(p, adapter, store, rs.req, rs.state, None)
        assert program is not None, "a miss's plan reads no source: it always binds"
    rs.decision, rs.plan, rs.program = dec, p, program
    return p, program


def bind(plan: ReusePlan, adapter: BackboneAdapter, store: CacheStore, req: Request, state: denoise.DenoiseState,
         prefetched: tuple[str, Future] | None) -> denoise.Program | None:
    """``plan`` bound to the source tensors it reads (a hit starts from the source's latent at its resume step);
    None when the source cannot serve it."""
    tensors: dict[str, torch.Tensor] = {}
    if plan.hit and plan.source_id is not None:
        got = None
        if prefetched is not None and prefetched[0] == plan.source_id:
            got = prefetched[1].result()  # the store's own errors surface here as they would from load()
        if got is None or not all(k in got for k in plan.source_tensors()):
            got = load_source(store, plan)
        if got is None:
            return None
        tensors = got
    program = denoise.Program.bind(plan, adapter, req, state, tensors)
    if program is not None and plan.hit and plan.init_latent is not None:
        start = tensors[plan.init_latent]
        assert plan.resume_step is not None, "a hit's plan names its resume step"
        if plan.own_sample > 0 and plan.clean_latent is not None and tensors.get(plan.clean_latent) is not None:
            start = denoise.own_sample_latent(adapter, state, req, start, tensors[plan.clean_latent],
                                              plan.resume_step, plan.own_sample)
        denoise.resume(adapter, state, start, plan.resume_step)
    return program


def load_source(store: CacheStore, plan: ReusePlan) -> dict[str, torch.Tensor] | None:
    """The tensors of the plan's source entry that it reads (those the entry has), or None when the entry is gone."""
    if plan.source_id is None:
        return None
    meta = store.get(plan.source_id)
    if meta is None:
        return None
    have = set(getattr(meta, "tensor_names", ()) or ())
    names = [k for k in plan.source_tensors() if k in have]
    if plan.mask_prefix is not None:
        names += [k for k in have if k.startswith(plan.mask_prefix)]
    return store.load(plan.source_id, names)
