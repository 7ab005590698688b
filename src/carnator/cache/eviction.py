"""Eviction policies: which entries to drop when an admission needs room.

A policy sees every entry in the bank and the number of bytes the bank must free, and returns entry
ids in the order they should go. The bank removes them in that order until the new entry fits, so a
policy may return more ids than needed. Register new policies with :func:`register_eviction`.

    >>> get_eviction("lcbfu")
    LCBFU()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from ..errors import CacheError
from .entry import EntryMeta

_REGISTRY: dict[str, type[EvictionPolicy]] = {}

P = TypeVar("P", bound="type[EvictionPolicy]")


def register_eviction(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy available by ``name`` (case-insensitive)."""

    def decorate(cls: P) -> P:
        cls.name = name.lower()
        _REGISTRY[name.lower()] = cls
        return cls

    return decorate


def eviction_policies() -> list[str]:
    """Names of the registered policies."""
    return sorted(_REGISTRY)


def get_eviction(spec: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a registered name or an instance (returned as is)."""
    if isinstance(spec, EvictionPolicy):
        return spec
    if isinstance(spec, str) and spec.lower() in _REGISTRY:
        return _REGISTRY[spec.lower()]()
    raise CacheError(f"unknown eviction policy {spec!r}; available: {', '.join(eviction_policies())}")


class EvictionPolicy(ABC):
    """Chooses victims when the bank is over capacity."""

    name: ClassVar[str] = ""

    @abstractmethod
    def victims(self, entries: Sequence[EntryMeta], bytes_needed: int) -> list[str]:
        """Ids of ``entries`` to evict, first victim first, freeing at least ``bytes_needed`` if possible."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RankedEviction(EvictionPolicy):
    """A policy that ranks entries by a key (lowest goes first) and evicts the shortest prefix that frees enough."""

    @abstractmethod
    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        """Rank of ``entry``; entries with the smallest key are evicted first."""

    def victims(self, entries: Sequence[EntryMeta], bytes_needed: int) -> list[str]:
        if bytes_needed <= 0:
            return []
        out: list[str] = []
        freed = 0
        for entry in sorted(entries, key=self.sort_key):
            if freed >= bytes_needed:
                break
            out.append(entry.id)
            freed += entry.nbytes
        return out


@register_eviction("lru")
class LRU(RankedEviction):
    """Least recently used first (ties: oldest created, then id)."""

    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        return (entry.last_used, entry.created, entry.id)


@register_eviction("lcbfu")
class LCBFU(RankedEviction):
    """NIRVANA's least-computational-benefit-frequently-used: lowest ``steps_saved * use_count`` first.

    Ties (including every never-used entry, whose benefit is 0) fall back to LRU order.
    """

    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        return (entry.benefit, entry.last_used, entry.created, entry.id)
