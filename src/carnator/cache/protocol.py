"""What the engine asks of a cache store: the :class:`CacheStore` protocol and the :class:`StoreSpec` it admits.

The engine never touches files, databases or indices; it calls these methods only. :class:`~carnator.cache.CacheBank`
is the local implementation (SQLite WAL + checksummed safetensors + FAISS, one host); a shared implementation
(PostgreSQL + blobs on shared storage) implements the same protocol.

Rules every implementation keeps:

* A read never returns corrupt or partial data: a bad entry is quarantined and reads as a miss (``None``).
* Bookkeeping writes (:meth:`touch`) never fail a request: on a full disk or a locked database they return False.
* Entries are scoped by tenant and keyed by ``compat_key`` (model, scheduler, settings, recall embedder, policy
  reading) and, for the exact tier, ``exact_key``; nothing crosses tenants or keys.
* ``load(id, names)`` reads only the tensors named (an exact hit reads the video, not the trajectory).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .entry import VIDEO, BankStats, EntryMeta

__all__ = ["CacheStore", "StoreSpec", "VIDEO"]


@dataclass(frozen=True)
class StoreSpec:
    """One completed request, as the engine hands it to :meth:`CacheStore.admit`.

    ``tensors``: what later requests may reuse (``traj.<step>`` latents, ``attn.*`` block masks, ``evidence.*``
    regions, ...). ``video``: the decoded clip (uint8), kept apart from the tensors so that an exact hit reads it
    alone; None stores no video (the entry then serves no exact hit). ``extra``: JSON-able metadata the policies
    read at recall (nouns, Early Signature, ...). ``steps_saved``: what one reuse of the entry saves (denoising
    steps; LCBFU's benefit). ``content_key``: what the prompt asks (:func:`carnator.cache.keys.content_key`), for
    :meth:`CacheStore.recall`'s lookup by content; None keeps the entry out of it.
    """

    tenant: str
    compat_key: str
    prompt: str
    embedding: np.ndarray = field(repr=False)
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    video: np.ndarray | None = field(default=None, repr=False)
    exact_key: str | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    steps_saved: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    content_key: str | None = None


@runtime_checkable
class CacheStore(Protocol):
    """A store of completed requests that later requests reuse."""

    def lookup_exact(self, tenant: str, exact_key: str) -> EntryMeta | None:
        """The entry admitted with ``exact_key`` in ``tenant`` (serves an exact hit), or None."""

    def recall(self, tenant: str, compat_key: str, embedding: np.ndarray, k: int = 10,
               content_key: str | None = None, near_keys: Sequence[str] = ()) -> list[tuple[EntryMeta, float]]:
        """The ``k`` entries of ``(tenant, compat_key)`` nearest ``embedding`` by cosine, nearest first; with
        ``content_key``, then the newest ``k`` entries admitted under that content key that are not among them (by
        cosine, nearest first): a request that asks the same in other words finds them however far its sentence; with
        ``near_keys`` (content keys one edit away), then the newest ``k`` entries admitted under any of them that are not
        among those (by cosine): an edit finds its source however far its sentence."""

    def same_content(self, tenant: str, compat_key: str, content_key: str, k: int = 10) -> list[EntryMeta]:
        """The newest ``k`` entries of ``(tenant, compat_key)`` admitted under ``content_key``, newest first: the only
        candidates of a rule that reuses nothing but a request asking the same, found without a recall embedding."""

    def get(self, entry_id: str) -> EntryMeta | None:
        """Metadata of one entry, or None."""

    def load(self, entry_id: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor] | None:
        """The entry's tensors (all, or only ``names``; :data:`VIDEO` for its video), each checked against its
        checksum; None when the entry is gone or fails a check (it is then quarantined). ``KeyError`` when
        ``names`` asks for tensors the entry never had."""

    def admit(self, spec: StoreSpec) -> str | None:
        """Store one completed request; its id, or None when it cannot fit the store's capacity or the store is
        read-only (both logged as a WARNING). ``CacheError`` when the write fails (full disk, locked database, an
        embedding of another size in the same scope): the caller still has its result."""

    def touch(self, entry_id: str, *, steps_saved: float | None = None) -> bool:
        """Record one use (recency, use count); False when the entry is gone or the write could not be made."""

    def evict(self, entry_ids: Iterable[str]) -> int:
        """Remove these entries; how many existed."""

    def stats(self, tenant: str | None = None) -> BankStats:
        """Entry counts and bytes (of ``tenant`` alone, if given), with the store's capacity and eviction policy."""

    def single_flight(self, tenant: str, exact_key: str, timeout_s: float = 600.0) -> AbstractContextManager[bool]:
        """Hold the right to generate the request ``exact_key`` while the block runs. When another process or
        thread already holds it, wait until it finishes (or ``timeout_s`` passes) before entering; the value is
        True when this caller waited, so it should look the exact key up again. Bookkeeping trouble (a read-only
        or full store) never blocks the caller: it then enters at once, uncoordinated."""
