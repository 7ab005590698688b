"""Records the bank hands out: one entry's metadata, bank statistics and verification reports."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(eq=False)
class EntryMeta:
    """Metadata of one cached entry (its tensors are read separately with ``CacheBank.load``).

    ``steps_saved`` is what one reuse of this entry saves (in denoising steps); ``use_count`` counts
    :meth:`CacheBank.touch` calls; ``nbytes`` is the size of the entry's tensor file, which is what
    counts against the bank's capacity. ``embedding`` is the recall embedding as admitted
    (``float32``, not normalized). ``extra`` is free-form JSON (nouns, signature scalars, ...).
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
    checksum: str = field(default="", repr=False)

    @property
    def benefit(self) -> float:
        """Computation this entry has saved so far: ``steps_saved * use_count`` (LCBFU's score)."""
        return float(self.steps_saved) * int(self.use_count)

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
class TenantStats:
    """Entry count and bytes of one tenant."""

    count: int
    bytes: int


@dataclass(frozen=True)
class BankStats:
    """What :meth:`CacheBank.stats` reports."""

    count: int
    bytes: int
    capacity_bytes: int | None
    tenants: dict[str, TenantStats]

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
            "tenants": {t: {"count": s.count, "bytes": s.bytes} for t, s in sorted(self.tenants.items())},
        }


@dataclass
class VerifyReport:
    """What :meth:`CacheBank.verify` found and did.

    ``checked``: entries whose tensor file was read and checksummed; ``quarantined``: ids whose file
    failed its checksum (moved to ``quarantine/``, row deleted); ``missing``: ids whose file was gone
    (row deleted); ``orphans_removed``: tensor or temp files without a row that were deleted.
    """

    checked: int = 0
    quarantined: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every entry checked out and nothing had to be repaired."""
        return not (self.quarantined or self.missing or self.orphans_removed)
