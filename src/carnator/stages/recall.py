"""Recall: the cached entries nearest a request by recall embedding (PAPER step 1, before the noun filter)."""

from __future__ import annotations

import numpy as np

from ..cache.protocol import CacheStore
from ..plan import Candidate


def recall(store: CacheStore, tenant: str, compat_key: str, embedding: np.ndarray, k: int) -> tuple[Candidate, ...]:
    """The ``k`` entries of ``(tenant, compat_key)`` nearest ``embedding``, nearest first (none for ``k <= 0``)."""
    if k <= 0:
        return ()
    return tuple(Candidate(meta, float(sim)) for meta, sim in store.recall(tenant, compat_key, embedding, k=k))
