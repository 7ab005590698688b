"""Store: admit the finished request as a cache entry (its trajectory, video and the policy's entry), scored by the
admission judge when the engine has one. A cache that cannot take it, or a failing embedder, costs the entry, never
the video."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..cache.keys import content_key
from ..cache.protocol import CacheStore, StoreSpec
from ..errors import CacheError
from .state import RequestState

log = logging.getLogger("carnator")


def store(rs: RequestState, frames: np.ndarray, *, cache: CacheStore, embed: Callable[[str], np.ndarray],
          judge: Any | None, admission_rule: Mapping[str, float], latent_dtype: str, store_video: bool) -> None:
    """Embed the prompt for recall (unless recall already did) and admit the entry; ``rs.stats.entry_id`` its id."""
    embedding, stats = rs.embedding, rs.stats
    if embedding is None:
        try:
            embedding = embed(rs.req.prompt)
        except Exception as e:  # noqa: BLE001 - the user's embedder: whatever it raises, the video is made
            log.warning("could not store the result in the cache: the recall embedder failed: %s", first_line(e))
            stats.notes["store_error"] = f"the recall embedder failed: {first_line(e)}"
            return
    stats.entry_id = admit(rs, frames, embedding, cache=cache, judge=judge, admission_rule=admission_rule,
                           latent_dtype=latent_dtype, store_video=store_video)


def admit(rs: RequestState, frames: np.ndarray, embedding: np.ndarray, *, cache: CacheStore, judge: Any | None,
          admission_rule: Mapping[str, float], latent_dtype: str, store_video: bool) -> str | None:
    """Store the request's trajectory, video and the policy's entry; the entry's id, or None when the cache could not
    take it. With an admission ``judge``, its scores of the output and whether they pass ``admission_rule`` go into
    the entry (``quality``, ``admitted``)."""
    req, stats, inputs, plan, state = rs.req, rs.stats, rs.decision_inputs, rs.plan, rs.state
    assert plan is not None, "plan runs first"
    quality: dict[str, Any] = {}
    if judge is not None:
        t0 = time.perf_counter()
        scores = judge.score(frames, req.prompt)
        ok = True
        for k, bar in admission_rule.items():
            v = float(scores.get(k, float("nan")))
            ok = ok and (v >= bar if judge.directions[k] > 0 else v <= bar)  # NaN fails
        quality = {"quality": {k: float(v) for k, v in scores.items()}, "admitted": bool(ok)}
        stats.timings["admission_judge"] = time.perf_counter() - t0
        stats.notes["admitted"] = bool(ok)
    dtype = getattr(torch, latent_dtype)
    tensors: dict[str, torch.Tensor] = {f"traj.{i}": z.to(dtype) for i, z in state.trajectory.items()}
    entry = rs.policy.entry(inputs, plan, state.attention.record)
    tensors.update(entry.tensors)
    # "approximate": the video came from reuse, not from every step of this request's own trajectory.
    extra = {"steps": req.num_inference_steps, "approximate": bool(plan.hit), "nouns": list(inputs.nouns),
             "content": None if inputs.content is None else list(inputs.content), **quality, **entry.extra}
    try:
        return cache.admit(StoreSpec(
            tenant=req.tenant, compat_key=rs.compat_key, exact_key=rs.exact_key if store_video else None,
            prompt=req.prompt, negative_prompt=req.negative_prompt, seed=req.seed,
            steps_saved=float(req.num_inference_steps), embedding=embedding, tensors=tensors, extra=extra,
            # found by content only where its own trajectory is whole (a reuse's begins at its resume step)
            content_key=None if plan.hit or inputs.content is None else content_key(inputs.content),
            video=np.ascontiguousarray(frames) if store_video else None,
        ))
    except (CacheError, OSError) as e:  # unwritable or full disk, locked database, another embedder's cache
        log.warning("could not store the result in the cache: %s", first_line(e))
        stats.notes["store_error"] = first_line(e)
        return None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
