"""Records the bank hands out: one entry's metadata, the store's settings and statistics, verification reports."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

#: The name under which an entry's decoded video (uint8, T x H x W x 3) is stored and loaded.
VIDEO = "video"


@dataclass(eq=False)
class EntryMeta:
    """Metadata of one cached entry (its tensors are read separately with ``CacheBank.load``).

    ``steps_saved`` is what one reuse of this entry saves (in denoising steps); ``use_count`` counts
    :meth:`CacheBank.touch` calls; ``nbytes`` is the size of the entry's blobs on disk (tensors and video), which is
    what counts against the store's capacity. ``embedding`` is the recall embedding as admitted (``float32``, not
    normalized). ``extra`` is free-form JSON (nouns, signature scalars, ...). ``tensor_names`` are the names
    :meth:`CacheBank.load` can read, sorted (:data:`VIDEO` among them when the entry kept its video).
    ``content_key`` names what the prompt asks (:func:`carnator.cache.keys.content_key`), so that a request asking the
    same in other words finds it whatever its recall cosine (None: found by cosine only).
    """

    id: str
    tenant: str
    compat_key: str
    exact_key: str | None
    prompt: str
    negative_prompt: str | None
    seed: int | None
    created: float
    last_used: float
    use_count: int
    steps_saved: float
    nbytes: int
    embedding: np.ndarray = field(repr=False)
    extra: dict[str, Any] = field(default_factory=dict)
    tensor_names: tuple[str, ...] = field(default=(), repr=False)
    content_key: str | None = None

    @property
    def benefit(self) -> float:
        """Computation this entry has saved so far: ``steps_saved * use_count`` (LCBFU's score)."""
        return float(self.steps_saved) * int(self.use_count)

    @property
    def has_video(self) -> bool:
        """Whether the entry kept its decoded video (so it can serve an exact hit)."""
        return VIDEO in self.tensor_names

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EntryMeta):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "embedding":
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable record


@dataclass(frozen=True)
class CacheSettings:
    """The store's own settings, kept in its database: every process that opens the directory uses them.

    ``capacity_bytes``: total blob bytes to keep (None: unbounded); ``eviction``: the registered eviction policy
    that picks victims when an admission needs room; ``tenant_quota_bytes``: blob bytes one tenant may keep (None:
    no quota): an admission past it evicts that tenant's oldest entries first (no other tenant's), so one tenant can
    neither fill the shared capacity nor evict the others' entries beyond its share.
    """

    capacity_bytes: int | None = None
    eviction: str = "lru"
    tenant_quota_bytes: int | None = None


@dataclass(frozen=True)
class TenantStats:
    """Entry count and bytes of one tenant."""

    count: int
    bytes: int


@dataclass(frozen=True)
class BankStats:
    """What :meth:`CacheBank.stats` reports: entries and bytes (of one tenant, when asked for one) and the store's
    settings (which are the whole store's)."""

    count: int
    bytes: int
    capacity_bytes: int | None
    tenants: dict[str, TenantStats]
    eviction: str = "lru"

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
            "eviction": self.eviction,
            "tenants": {t: {"count": s.count, "bytes": s.bytes} for t, s in sorted(self.tenants.items())},
        }


@dataclass
class VerifyReport:
    """What :meth:`CacheBank.verify` found and did.

    ``checked``: entries whose blobs were read and matched their checksums. Problems (each makes ``ok`` False):
    ``quarantined``: entries whose blob failed its checksum or could not be read (moved to ``quarantine/`` and
    dropped); ``missing``: entries whose blob was gone (dropped); ``lost``: entries whose blobs are still on disk but
    whose metadata is gone (the database lost rows: recreated, rolled back, write-ahead log deleted; their blobs are
    removed); ``recoveries``: database recoveries since the last verify, one line each (from the recovery journal,
    which outlives the database). Not problems: ``orphans_removed``, leftovers of admissions that never committed
    and of entries already removed. ``read_only``: nothing was repaired (the lists say what would have been).
    ``tenant``: the tenant checked (None: the whole store; lost entries and recoveries belong to no tenant and are
    only reported for the whole store).
    """

    checked: int = 0
    quarantined: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    recoveries: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    read_only: bool = False
    tenant: str | None = None

    @property
    def problems(self) -> list[str]:
        """One line per problem found, for people."""
        left = " (read-only: left in place)" if self.read_only else ""
        out = [f"corrupt: entry {i} failed its checksum or could not be read{left}" for i in self.quarantined]
        out += [f"missing: entry {i} lost its blob{left}" for i in self.missing]
        if self.lost:
            shown = ", ".join(self.lost[:5]) + (", ..." if len(self.lost) > 5 else "")
            out.append(f"lost: {len(self.lost)} entries whose metadata is gone ({shown}){left}")
        out += [f"recovered: {line}" for line in self.recoveries]
        return out

    @property
    def ok(self) -> bool:
        """True when every entry checked out and nothing was lost, corrupt or recovered."""
        return not self.problems
