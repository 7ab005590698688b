"""The exact tier: an identical earlier request's stored video, returned without running the model."""

from __future__ import annotations

from ..cache.protocol import VIDEO, CacheStore
from ..policies import Policy
from ..request import Request, Result, Stats


def exact_hit(store: CacheStore, req: Request, policy: Policy, exact_key: str, stats: Stats) -> Result | None:
    """The stored video of ``exact_key`` (reading the video only), or None: none stored, its entry gone, or a video
    made by reuse that ``policy`` does not accept as exact."""
    meta = store.lookup_exact(req.tenant, exact_key)
    if meta is None or (meta.extra.get("approximate") and not policy.accepts_approximate_exact):
        return None
    tensors = store.load(meta.id, [VIDEO])
    if tensors is None:
        return None
    store.touch(meta.id)
    stats.hit = stats.exact_hit = True
    stats.source_id = meta.id
    stats.resume_step = req.num_inference_steps
    stats.reason = f"exact repeat of entry {meta.id[:8]}: its stored video"
    return Result(frames=tensors[VIDEO].numpy(), stats=stats, request=req)
