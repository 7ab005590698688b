"""Recall: the cached entries nearest a request by recall embedding (PAPER step 1, before the noun filter)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..cache.keys import content_key
from ..cache.protocol import CacheStore
from ..plan import Candidate


def recall(store: CacheStore, tenant: str, compat_key: str, embedding: np.ndarray, k: int,
           content_key: str | None = None, near_keys: Sequence[str] = ()) -> tuple[Candidate, ...]:
    """The ``k`` entries of ``(tenant, compat_key)`` nearest ``embedding``, nearest first (none for ``k <= 0``); with
    ``content_key``, then up to ``k`` more entries that ask the same, and with ``near_keys`` up to ``k`` more that ask
    what one of them names (:meth:`CacheStore.recall`)."""
    if k <= 0:
        return ()
    extra: dict = {}
    if content_key is not None:
        extra["content_key"] = content_key
    if near_keys:
        extra["near_keys"] = tuple(near_keys)
    found = store.recall(tenant, compat_key, embedding, k=k, **extra)
    return tuple(Candidate(meta, float(sim)) for meta, sim in found)


def recall_content(store: CacheStore, tenant: str, compat_key: str, content_key: str, k: int) -> tuple[Candidate, ...]:
    """The newest ``k`` entries of ``(tenant, compat_key)`` that ask what ``content_key`` names
    (:meth:`CacheStore.same_content`), for a policy that can reuse nothing else: no recall embedding is computed, so
    their similarity is None (not measured)."""
    if k <= 0:
        return ()
    return tuple(Candidate(meta, None) for meta in store.same_content(tenant, compat_key, content_key, k=k))


def near_keys(reader: object, content: Sequence[str], kinds: Sequence[str]) -> list[str]:
    """The content keys one change of ``kinds`` away from ``content``, as the model's content ``reader`` names them
    (``neighbours``; none for a reader without a grammar, or no kinds)."""
    neighbours = getattr(reader, "neighbours", None)
    if not kinds or neighbours is None:
        return []
    return [k for k in (content_key(c) for c in neighbours(content, kinds)) if k is not None]
