"""The persistent cache bank: metadata in SQLite, tensors in checksummed files, recall by cosine.

Layout of a bank directory::

    VERSION                    format marker ("carnator-cache 1")
    bank.sqlite (+ -wal, -shm) metadata, embeddings (SQLite, WAL mode)
    tensors/<id>.safetensors   one immutable file per entry
    quarantine/                corrupt tensor files and broken databases, kept for inspection

Invariants: a row exists only for a complete, fsynced tensor file (files are written first, rows
inserted after); rows are removed before their files. A crash therefore leaves at worst an orphan
file, which is deleted later. Every read checks the file's sha256 against its row, and a mismatch
is quarantined and reported as a miss; corrupt data is never returned.

Several processes (and threads) may use one directory at a time. All shared state lives in
SQLite; each process's in-memory vector indices re-check SQLite's counters before every search.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from ..errors import CacheError, CorruptEntryError
from . import _faults
from .entry import BankStats, EntryMeta, TenantStats, VerifyReport
from .eviction import EvictionPolicy, get_eviction
from .index import ScopeIndex, resolve_backend
from .metadb import FORMAT_VERSION, MetaDB, SyncState, dump_extra, is_corruption
from .store import TensorStore, deserialize_tensors, serialize_tensors, sha256

log = logging.getLogger("carnator.cache")

VERSION_FILE = "VERSION"
DB_FILE = "bank.sqlite"
TENSOR_DIR = "tensors"
QUARANTINE_DIR = "quarantine"
_MARKER_NAME = "carnator-cache"

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[Concatenate[CacheBank, P], R]) -> Callable[Concatenate[CacheBank, P], R]:
    """Run a public method under the bank's lock, recovering once from a corrupt database.

    If SQLite reports corruption mid-call, the database is quarantined, an empty one is started and
    the call is retried against it (so a read becomes a miss and a write lands in the fresh bank).
    Other SQLite failures (locked past the timeout, read-only, disk full) become :class:`CacheError`.
    """

    @functools.wraps(method)
    def wrapper(self: CacheBank, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            with _sqlite_errors_as_cache_errors(self._db.path):
                self._ensure_connection()
                try:
                    return method(self, *args, **kwargs)
                except sqlite3.DatabaseError as exc:
                    if not is_corruption(exc):
                        raise
                    self._recover_database(exc)
                return method(self, *args, **kwargs)

    return wrapper


@contextmanager
def _sqlite_errors_as_cache_errors(path: Path) -> Iterator[None]:
    """Turn SQLite's environmental failures (locked, read-only, full, I/O, corrupt) into CacheError."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) or is_corruption(exc):
            raise CacheError(f"cache database {path}: {exc}") from exc
        raise


class _NoRoom(Exception):
    """Internal: the eviction policy could not free enough room; roll the admission back."""


@dataclass
class _Scope:
    index: ScopeIndex
    epoch: str
    entry_seq: int
    removal_seq: int


class CacheBank:
    """A directory of cached entries shared by every request (and process) that opens it.

    Args:
        root: the bank directory (created if missing).
        capacity_bytes: total size of tensor files to keep; ``None`` for unbounded. Admissions evict
            entries (chosen by ``eviction``) until the new entry fits. This is a property of the
            opener, not stored on disk: processes sharing a directory should pass the same value.
        eviction: a registered policy name (``"lru"``, ``"lcbfu"``) or an :class:`EvictionPolicy`.
        embed_dim: expected embedding size. Recorded on first use; opening a bank recorded with
            another size raises :class:`CacheError`. ``None`` takes it from the first admission.
        index_backend: ``"auto"`` (FAISS if importable), ``"faiss"`` or ``"numpy"``; results are
            identical, only speed differs.
        orphan_grace_s: orphan files (no row) younger than this are left alone, since another process
            may be between writing a file and inserting its row.
        busy_timeout_s: how long to wait for another process's write lock.
        clock: source of timestamps (``time.time``); tests may inject their own.

    Raises:
        CacheError: the directory cannot be created or written, was written by an incompatible
            format version, or holds embeddings of another size.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        eviction: str | EvictionPolicy = "lru",
        embed_dim: int | None = None,
        index_backend: str = "auto",
        orphan_grace_s: float = 600.0,
        busy_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes <= 0):
            raise CacheError(f"cache capacity must be a positive number of bytes, got {capacity_bytes!r}")
        if embed_dim is not None and (not isinstance(embed_dim, int) or embed_dim <= 0):
            raise CacheError(f"embedding size must be a positive integer, got {embed_dim!r}")
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self.eviction = get_eviction(eviction)
        self.orphan_grace_s = float(orphan_grace_s)
        self._clock = clock
        self._backend = resolve_backend(index_backend)
        self._lock = threading.RLock()
        self._scopes: dict[tuple[str, str], _Scope] = {}
        self._requested_dim = embed_dim
        self._dim: int | None = None
        self._closed = False

        self._prepare_directory()
        self._check_version_marker()
        self._files = TensorStore(self.root / TENSOR_DIR, self.root / QUARANTINE_DIR)
        self._db = MetaDB(self.root / DB_FILE, busy_timeout_s=busy_timeout_s)
        with self._lock, _sqlite_errors_as_cache_errors(self._db.path):
            try:
                self._open_database()
                self._remove_orphans(self.orphan_grace_s)
            except BaseException:
                self._db.close()
                raise

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database connection; the bank cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._db.close()
            self._scopes.clear()

    def __enter__(self) -> CacheBank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CacheBank({str(self.root)!r}, capacity_bytes={self.capacity_bytes}, eviction={self.eviction!r})"

    @property
    def embed_dim(self) -> int | None:
        """The bank's embedding size, or None while it is still unknown (no admissions yet)."""
        return self._current_dim()

    @property
    def index_backend(self) -> str:
        return self._backend

    # -- writing ---------------------------------------------------------------------------------

    @_guarded
    def admit(
        self,
        *,
        tenant: str,
        compat_key: str,
        prompt: str,
        embedding: np.ndarray,
        tensors: Mapping[str, torch.Tensor],
        exact_key: str | None = None,
        negative_prompt: str | None = None,
        seed: int | None = None,
        steps_saved: float = 0.0,
        extra: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Store a new entry; returns its id, or None if it cannot fit in the bank's capacity.

        An entry with the same ``(tenant, exact_key)`` is replaced. When over capacity, entries are
        evicted in the eviction policy's order until the new one fits. The tensor file is durable
        before the row that makes it visible is committed.
        """
        _check_scope(tenant, compat_key)
        if not isinstance(prompt, str):
            raise TypeError("prompt must be a string")
        if not _finite(steps_saved):
            raise ValueError(f"steps_saved must be a finite number, got {steps_saved!r}")
        extra_dict = dict(extra or {})
        dump_extra(extra_dict)  # fail on unserializable extras before writing anything
        vec = self._as_embedding(embedding, establish=True)
        entry_id = uuid.uuid4().hex
        data = serialize_tensors(tensors, {"carnator_cache_format": str(FORMAT_VERSION), "entry_id": entry_id})
        nbytes = len(data)
        if self.capacity_bytes is not None and nbytes > self.capacity_bytes:
            log.info("not caching a %d-byte entry in a bank of capacity %d bytes", nbytes, self.capacity_bytes)
            return None
        now = self._clock()
        meta = EntryMeta(
            id=entry_id,
            tenant=tenant,
            compat_key=compat_key,
            exact_key=exact_key,
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=None if seed is None else int(seed),
            created=now,
            last_used=now,
            use_count=0,
            steps_saved=float(steps_saved),
            nbytes=nbytes,
            embedding=vec,
            extra=extra_dict,
            checksum=sha256(data),
        )
        try:
            self._files.write(entry_id, data)
        except OSError as exc:
            raise CacheError(f"cannot write to cache directory {self.root}: {exc.strerror or exc}") from exc
        del data
        committed = False
        try:
            with self._db.write() as conn:
                if not self._files.path(entry_id).exists():
                    # Orphan cleanup (which runs under the write lock) took it: we stalled past the grace period.
                    raise CacheError(f"cache file for a new entry vanished from {self._files.directory}")
                replaced = self._db.exact_key_ids(conn, tenant, exact_key) if exact_key is not None else []
                removed = self._db.delete(conn, replaced)
                victims = self._choose_victims(conn, nbytes)
                if victims is None:
                    raise _NoRoom
                removed += self._db.delete(conn, victims)
                self._db.insert(conn, meta)
                _faults.fault_point("before_commit")
            committed = True
        except _NoRoom:
            log.info("not caching a %d-byte entry: the eviction policy freed too little room", nbytes)
            return None
        finally:
            if not committed:
                self._files.delete(entry_id)
        for gone in removed:  # rows are gone for good: now their files may go too
            self._files.delete(gone)
        return entry_id

    def _choose_victims(self, conn: sqlite3.Connection, nbytes: int) -> list[str] | None:
        """Ids to evict so ``nbytes`` more fit (``[]`` if they already do, None if they cannot)."""
        if self.capacity_bytes is None:
            return []
        need = self._db.total_bytes(conn) + nbytes - self.capacity_bytes
        if need <= 0:
            return []
        candidates = {e.id: e for e in self._db.all(conn)}
        chosen: list[str] = []
        freed = 0
        for victim in self.eviction.victims(list(candidates.values()), need):
            entry = candidates.pop(victim, None)
            if entry is None:
                continue
            chosen.append(victim)
            freed += entry.nbytes
            if freed >= need:
                return chosen
        return None

    @_guarded
    def touch(self, entry_id: str, *, steps_saved: float | None = None) -> bool:
        """Record a use: ``last_used = now``, ``use_count += 1`` (and update ``steps_saved`` if given).

        Returns False if the entry no longer exists.
        """
        return self._db.touch(entry_id, self._clock(), steps_saved)

    @_guarded
    def remove(self, entry_id: str) -> bool:
        """Delete one entry; returns whether it existed."""
        with self._db.write() as conn:
            removed = self._db.delete(conn, [entry_id])
        for victim in removed:
            self._files.delete(victim)
        return bool(removed)

    @_guarded
    def clear(self, tenant: str | None = None) -> int:
        """Delete every entry (of ``tenant``, if given); returns how many were deleted."""
        with self._db.write() as conn:
            removed = self._db.delete_all(conn, tenant)
        for victim in removed:
            self._files.delete(victim)
        return len(removed)

    # -- reading ---------------------------------------------------------------------------------

    @_guarded
    def load(self, entry_id: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor] | None:
        """The entry's tensors (all, or only ``names``), or None if it is gone or fails its checksum.

        A file that fails its checksum (or cannot be parsed) is moved to ``quarantine/`` and its row
        deleted, with a warning. Raises ``KeyError`` if ``names`` asks for tensors the entry lacks.
        """
        checksum = self._db.checksum(entry_id)
        if checksum is None:
            return None
        try:
            tensors = deserialize_tensors(self._files.read(entry_id, checksum))
        except FileNotFoundError:
            self._drop_missing(entry_id)
            return None
        except CorruptEntryError as exc:
            self._quarantine(entry_id, str(exc))
            return None
        if names is None:
            return tensors
        wanted = list(names)
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise KeyError(f"cache entry {entry_id} has no tensors named {missing}; it has {sorted(tensors)}")
        return {n: tensors[n] for n in wanted}

    @_guarded
    def recall(
        self, tenant: str, compat_key: str, embedding: np.ndarray, k: int = 10
    ) -> list[tuple[EntryMeta, float]]:
        """The ``k`` entries of ``(tenant, compat_key)`` most cosine-similar to ``embedding``, best first.

        Ties are broken by admission order (older first). Entries of other tenants or compatibility
        keys are never returned.
        """
        _check_scope(tenant, compat_key)
        if k <= 0:
            return []
        dim = self._current_dim()
        if dim is None:
            return []
        query = self._as_embedding(embedding, establish=False)
        with self._db.read() as conn:
            index = self._scope_index(conn, tenant, compat_key, dim)
            hits = index.search(query, k)
            metas = self._db.get_many(conn, [h[0] for h in hits])
        return [(metas[i], score) for i, score in hits if i in metas]

    @_guarded
    def lookup_exact(self, tenant: str, exact_key: str, compat_key: str | None = None) -> EntryMeta | None:
        """The entry admitted with ``exact_key`` for ``tenant`` (and ``compat_key``, if given), or None."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("tenant must be a non-empty string")
        return self._db.by_exact_key(tenant, exact_key, compat_key)

    @_guarded
    def get(self, entry_id: str) -> EntryMeta | None:
        """Metadata of one entry, or None."""
        return self._db.get(entry_id)

    @_guarded
    def entries(self, tenant: str | None = None) -> list[EntryMeta]:
        """All entries (of ``tenant``), oldest admission first."""
        return self._db.all(tenant=tenant)

    @_guarded
    def stats(self) -> BankStats:
        """Entry count and bytes, in total and per tenant."""
        per = {t: TenantStats(count=c, bytes=b) for t, c, b in self._db.per_tenant()}
        return BankStats(
            count=sum(s.count for s in per.values()),
            bytes=sum(s.bytes for s in per.values()),
            capacity_bytes=self.capacity_bytes,
            tenants=per,
        )

    def __len__(self) -> int:
        return self.stats().count

    def __contains__(self, entry_id: object) -> bool:
        return isinstance(entry_id, str) and self.get(entry_id) is not None

    # -- maintenance -----------------------------------------------------------------------------

    @_guarded
    def verify(self, *, orphan_grace_s: float | None = None) -> VerifyReport:
        """Check every entry's checksum, quarantine bad files, drop rows whose file is gone, and delete
        orphan files older than ``orphan_grace_s`` (default: the bank's ``orphan_grace_s``)."""
        report = VerifyReport()
        for entry_id, checksum in self._db.checksums():
            try:
                deserialize_tensors(self._files.read(entry_id, checksum))
            except FileNotFoundError:
                if self._drop_missing(entry_id):
                    report.missing.append(entry_id)
                continue
            except CorruptEntryError as exc:
                if self._quarantine(entry_id, str(exc)):
                    report.quarantined.append(entry_id)
                continue
            report.checked += 1
        grace = self.orphan_grace_s if orphan_grace_s is None else float(orphan_grace_s)
        report.orphans_removed = self._remove_orphans(grace)
        return report

    # -- internals: setup ------------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for sub in (TENSOR_DIR, QUARANTINE_DIR):
                (self.root / sub).mkdir(exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.root / TENSOR_DIR)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CacheError(f"cache directory {self.root} is not usable: {exc.strerror or exc}") from None

    def _check_version_marker(self) -> None:
        marker = self.root / VERSION_FILE
        expected = f"{_MARKER_NAME} {FORMAT_VERSION}\n"
        try:
            text = marker.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            tmp = marker.with_name(f".{VERSION_FILE}.{os.getpid()}.tmp")
            try:
                tmp.write_text(expected, encoding="utf-8")
                os.replace(tmp, marker)
            except OSError as exc:
                raise CacheError(f"cache directory {self.root} is not usable: {exc.strerror or exc}") from None
            return
        except OSError as exc:
            raise CacheError(f"cannot read {marker}: {exc.strerror or exc}") from None
        parts = text.split()
        if len(parts) != 2 or parts[0] != _MARKER_NAME or not parts[1].isdigit():
            raise CacheError(f"{marker} is not a carnator cache marker; use another cache directory")
        if int(parts[1]) != FORMAT_VERSION:
            raise CacheError(
                f"cache at {self.root} uses format version {parts[1]}, this carnator reads version "
                f"{FORMAT_VERSION}; use another cache directory or delete this one"
            )

    def _open_database(self) -> None:
        """Connect (recovering from a corrupt file) and check the recorded embedding size."""
        self._scopes.clear()
        self._dim = None
        try:
            self._db.open()
        except sqlite3.DatabaseError as exc:
            if not is_corruption(exc):
                raise
            self._recover_database(exc)
            return
        self._dim = self._reconcile_embed_dim(self._requested_dim)

    def _ensure_connection(self) -> None:
        """Reconnect after a fork or after another process replaced a corrupt ``bank.sqlite``."""
        if self._closed:
            raise CacheError("the cache bank is closed")
        if self._db.is_stale():
            self._open_database()

    def _recover_database(self, exc: BaseException) -> None:
        """Move the broken database aside and start an empty one (entries are lost, nothing bad served)."""
        self._db.close()
        self._scopes.clear()
        self._dim = None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = self.root / QUARANTINE_DIR / f"bank.{stamp}.{uuid.uuid4().hex[:6]}.sqlite"
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{self._db.path}{suffix}", f"{dest}{suffix}")
            except FileNotFoundError:
                pass
            except OSError as err:
                raise CacheError(f"cache database {self._db.path} is corrupt and cannot be moved aside: {err}") from err
        log.warning(
            "cache database %s is corrupt (%s); moved it to %s and started an empty cache (cached entries are lost)",
            self._db.path,
            exc,
            dest,
        )
        self._db.open()
        self._dim = self._reconcile_embed_dim(self._requested_dim)

    def _reconcile_embed_dim(self, embed_dim: int | None) -> int | None:
        stored = self._db.get_meta("embed_dim")
        if embed_dim is None:
            return None if stored is None else int(stored)
        recorded = self._db.ensure_embed_dim(embed_dim)
        if recorded != embed_dim:
            raise CacheError(
                f"cache at {self.root} holds {recorded}-d embeddings, not {embed_dim}-d; "
                "use another cache directory or delete this one"
            )
        return recorded

    # -- internals: entries ----------------------------------------------------------------------

    def _current_dim(self) -> int | None:
        if self._dim is None:
            stored = self._db.get_meta("embed_dim")
            self._dim = None if stored is None else int(stored)
        return self._dim

    def _as_embedding(self, embedding: Any, *, establish: bool) -> np.ndarray:
        if isinstance(embedding, torch.Tensor):
            embedding = embedding.detach().to("cpu", torch.float32).numpy()
        vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vec.size == 0 or not np.all(np.isfinite(vec)):
            raise ValueError("embedding must be a non-empty vector of finite numbers")
        dim = self._current_dim()
        if dim is None and establish:
            dim = self._dim = self._db.ensure_embed_dim(vec.size)
        if dim is not None and vec.size != dim:
            raise ValueError(f"embedding has {vec.size} dimensions; this cache holds {dim}-d embeddings")
        return vec.copy()

    def _scope_index(self, conn: sqlite3.Connection, tenant: str, compat_key: str, dim: int) -> ScopeIndex:
        """This process's index of one scope, brought up to date with the database snapshot ``conn`` sees."""
        state: SyncState = self._db.sync_state(conn)
        key = (tenant, compat_key)
        scope = self._scopes.get(key)
        log_covers = state.oldest_logged_removal is not None and (
            scope is not None and state.oldest_logged_removal <= scope.removal_seq + 1
        )
        if (
            scope is None
            or scope.epoch != state.epoch
            or scope.index.dim != dim
            or (state.removal_seq > scope.removal_seq and not log_covers)
        ):
            index = ScopeIndex(dim, self._backend)
            rows = self._db.scope_rows(conn, tenant, compat_key)
            if rows:
                index.add([r.id for r in rows], np.stack([r.embedding for r in rows]))
            scope = self._scopes[key] = _Scope(index, state.epoch, state.entry_seq, state.removal_seq)
            return index
        if state.removal_seq > scope.removal_seq:
            scope.index.remove(self._db.scope_removals(conn, tenant, compat_key, scope.removal_seq))
            scope.removal_seq = state.removal_seq
        if state.entry_seq > scope.entry_seq:
            rows = self._db.scope_rows(conn, tenant, compat_key, scope.entry_seq)
            if rows:
                scope.index.add([r.id for r in rows], np.stack([r.embedding for r in rows]))
            scope.entry_seq = state.entry_seq
        return scope.index

    def _quarantine(self, entry_id: str, reason: str) -> bool:
        """Move a bad tensor file aside and delete its row; returns whether the row existed."""
        dest = self._files.quarantine(entry_id)
        with self._db.write() as conn:
            existed = bool(self._db.delete(conn, [entry_id]))
        log.warning(
            "cache entry %s is corrupt (%s); %s and dropped it from the cache",
            entry_id,
            reason,
            f"moved its file to {dest}" if dest else "its file was already gone",
        )
        return existed

    def _drop_missing(self, entry_id: str) -> bool:
        """Delete the row of an entry whose file vanished (unless another process already removed it)."""
        with self._db.write() as conn:
            existed = bool(self._db.delete(conn, [entry_id]))
        if existed:
            log.warning("cache entry %s lost its tensor file; dropped it from the cache", entry_id)
        return existed

    def _remove_orphans(self, grace_s: float) -> list[str]:
        """Delete tensor/temp files older than ``grace_s`` that no row refers to; returns their names."""
        cutoff = time.time() - grace_s
        files = self._files.scan()
        known = self._db.ids()  # read after listing, so a file whose row is being inserted is kept
        if not any(f.mtime <= cutoff and (f.entry_id is None or f.entry_id not in known) for f in files):
            return []
        removed: list[str] = []
        # Under the write lock, so no admission can insert a row for a file we are deleting: an
        # admission re-checks that its file exists inside its own write transaction.
        with self._db.write():
            known = self._db.ids()
            for f in self._files.scan():
                if (f.entry_id is not None and f.entry_id in known) or f.mtime > cutoff:
                    continue
                try:
                    os.unlink(f.path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("could not delete orphan cache file %s: %s", f.path, exc)
                    continue
                removed.append(f.path.name)
        if removed:
            log.info("removed %d orphan file(s) from %s", len(removed), self._files.directory)
        return removed


def _check_scope(tenant: str, compat_key: str) -> None:
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    if not isinstance(compat_key, str) or not compat_key:
        raise ValueError("compat_key must be a non-empty string")


def _finite(x: object) -> bool:
    try:
        return not isinstance(x, bool) and math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
