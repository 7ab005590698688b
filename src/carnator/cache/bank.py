"""The persistent cache bank: metadata in SQLite, tensors and video in checksummed blobs, recall by cosine.

Layout of a bank directory (format 2)::

    VERSION                              format marker ("carnator-cache 2"), written once the database exists
    bank.sqlite (+ -wal, -shm)           metadata, per-tensor checksums, settings, leases (SQLite, WAL mode)
    blobs/<id>.tensors.safetensors       an entry's tensors (trajectory, masks, ...); immutable
    blobs/<id>.video.safetensors         its decoded video, apart, so an exact hit reads only the video
    blobs/.<key>.part                    a blob staged by an admission that has not published it (yet)
    quarantine/                          corrupt blobs and broken databases, kept for inspection
    RECOVERY.jsonl                       every loss of the database (recovered, recreated), which outlives it

Invariants: an admission stages (writes and fsyncs) its blobs, commits the row that makes them an entry, then
publishes them under their names; rows are removed (and the removal logged) before their blobs. So a crash leaves
at worst a staged blob without a row (an admission that never committed, removed after a grace period) or a row
whose blob is still staged (published by the next reader). A *published* blob without a row, whose removal was not
logged, means the database lost the row: ``verify`` reports it as lost. Every tensor read is checked against the
sha256 recorded for that tensor; a mismatch, or a blob that cannot be read, is quarantined and reads as a miss.
Corrupt data is never returned.

Several processes (and threads) may use one directory at a time. All shared state lives in SQLite; each process's
in-memory vector indices re-check SQLite's counters before every search. A directory that cannot be written (or whose
write permission bits are all off) opens read-only: it serves lookups, loads and recall, stores nothing and repairs
nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import sqlite3
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from ..errors import CacheError
from .entry import BankStats, CacheSettings, EntryMeta, TenantStats, VerifyReport
from .index import ScopeIndex, resolve_backend
from .journal import JOURNAL_FILE, RecoveryJournal
from .metadb import FORMAT_VERSION, Lease, MetaDB, count_entries, is_corruption
from .policy import (
    Scope,
    StorePolicy,
    choose_victims,
    lease_held,
)
from .store import LocalBlobStore

log = logging.getLogger("carnator.cache")

VERSION_FILE = "VERSION"
DB_FILE = "bank.sqlite"
BLOB_DIR = "blobs"
QUARANTINE_DIR = "quarantine"
_MARKER_NAME = "carnator-cache"
#: How long :meth:`CacheBank.touch` waits for another writer's lock before giving up (it is only bookkeeping).
TOUCH_BUSY_S = 2.0

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[Concatenate[CacheBank, P], R]) -> Callable[Concatenate[CacheBank, P], R]:
    """Run a method under the bank's lock, recovering once from a corrupt database.

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
                except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
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
    except UnicodeDecodeError as exc:
        raise CacheError(f"cache database {path}: damaged text ({exc.reason})") from exc
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) or is_corruption(exc):
            raise CacheError(f"cache database {path}: {exc}") from exc
        raise


class CacheBank(StorePolicy):
    """A directory of cached entries shared by every request (and process) that opens it; implements
    :class:`~carnator.cache.protocol.CacheStore`.

    The store's capacity and eviction policy live in its database (:meth:`configure`; default unbounded, LRU), so
    every process that opens the directory keeps the same bound.

    Args:
        root: the bank directory (created if missing).
        read_only: open without writing anything. None (default): read-only when the directory (or its database
            or blob folder) cannot be written or has every write permission bit off (``chmod -R a-w``: honoured even
            for root, who could write anyway). A read-only bank serves :meth:`lookup_exact`, :meth:`load`,
            :meth:`recall`, :meth:`entries`, :meth:`stats` and :meth:`verify` (which then repairs nothing);
            :meth:`admit` returns None and :meth:`touch` False, each with one warning; :meth:`configure`,
            :meth:`evict` and :meth:`clear` raise :class:`CacheError`.
        index_backend: ``"auto"`` (FAISS if importable), ``"faiss"`` or ``"numpy"``; results are
            identical, only speed differs.
        orphan_grace_s: staged blobs without a row younger than this are left alone, since another process may be
            between staging them and committing their row.
        busy_timeout_s: how long to wait for another process's write lock.
        clock: source of entry timestamps (``time.time``); tests may inject their own.

    Raises:
        CacheError: the directory cannot be created or used, was written by an incompatible format version, or is
            read-only and holds no cache.
    """

    _db: MetaDB  # (the store policy's hooks, as this store fills them)
    _blobs: LocalBlobStore

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        read_only: bool | None = None,
        index_backend: str = "auto",
        orphan_grace_s: float = 600.0,
        busy_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root).expanduser()
        self.orphan_grace_s = float(orphan_grace_s)
        self._clock = clock
        self._backend = resolve_backend(index_backend)
        self._lock = threading.RLock()
        self._scopes: dict[tuple[str, str], Scope] = {}
        self._warned: set[str] = set()
        self._closed = False

        self.read_only = self._prepare_directory(read_only)
        had_marker = self._check_version_marker()
        self._blobs = LocalBlobStore(self.root / BLOB_DIR, self.root / QUARANTINE_DIR, read_only=self.read_only)
        self._journal = RecoveryJournal(self.root / JOURNAL_FILE)
        self._db = MetaDB(self.root / DB_FILE, busy_timeout_s=busy_timeout_s, read_only=self.read_only)
        with self._lock, _sqlite_errors_as_cache_errors(self._db.path):
            try:
                self._open_database(had_marker)
                if not had_marker:
                    self._write_version_marker()
                if not self.read_only:
                    lost, _ = self._sweep(self.orphan_grace_s, remove_lost=False)
                    if lost:
                        log.warning(
                            "%d cache entries in %s have blobs but no metadata (the database lost them); "
                            "`carnator cache verify` reports and removes them", len(lost), self.root,
                        )
            except BaseException:
                self._db.close()
                raise
        if self.read_only:
            log.info("cache at %s is read-only: it serves what it holds and stores nothing", self.root)

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database connection; the bank cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._db.close()
            self._scopes.clear()

    def __repr__(self) -> str:
        return f"CacheBank({str(self.root)!r}{', read_only=True' if self.read_only else ''})"

    # -- settings --------------------------------------------------------------------------------

    configure = _guarded(StorePolicy.configure)

    # -- writing ---------------------------------------------------------------------------------

    def _label(self) -> str:
        return f"at {self.root}"

    def _blob_words(self) -> str:
        return f"cache directory {self.root}"

    @_guarded
    def _scope_state(self, tenant: str, compat_key: str) -> tuple[int | None, CacheSettings]:
        return self._db.scope_dim(tenant, compat_key), self._db.settings()

    _commit = _guarded(StorePolicy._commit)

    def _writing(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self._db.write()

    def _blob_place(self) -> str:
        return str(self._blobs.directory)

    def _victims(self, conn: sqlite3.Connection, need: int, settings: CacheSettings) -> tuple[list[str], bool]:
        """Ids to evict to free ``need`` bytes (in the policy's order), and whether they free enough."""
        return choose_victims(self._db.all(conn) if need > 0 else [], need, settings.eviction)

    def touch(self, entry_id: str, *, steps_saved: float | None = None) -> bool:
        """Record a use: ``last_used = now``, ``use_count += 1`` (and update ``steps_saved`` if given).

        Bookkeeping never fails a request: returns False when the entry no longer exists, and also when the write
        cannot be made (read-only store, full disk, database locked for more than :data:`TOUCH_BUSY_S`), logging a
        WARNING the first time.
        """
        if self.read_only:
            self._warn_once("touch", "cache at %s is read-only: uses are not recorded", self.root)
            return False
        try:
            with self._lock:
                self._ensure_connection()
                conn = self._db.conn
                conn.execute(f"PRAGMA busy_timeout = {int(min(TOUCH_BUSY_S, self._db.busy_timeout_s) * 1000)}")
                try:
                    return self._db.touch(entry_id, self._clock(), steps_saved)
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {int(self._db.busy_timeout_s * 1000)}")
        except (sqlite3.Error, OSError, CacheError, UnicodeDecodeError) as exc:
            self._warn_once("touch", "could not record a use of cache entry %s (%s); carrying on", entry_id, exc)
            return False

    @_guarded
    def evict(self, entry_ids: Iterable[str]) -> int:
        """Remove these entries; returns how many existed."""
        if isinstance(entry_ids, str):
            raise TypeError("evict takes a collection of entry ids, not one string")
        self._check_writable("evict entries")
        with self._db.write() as conn:
            removed = self._db.delete(conn, list(entry_ids))
        self._delete_blobs(removed)
        return len(removed)

    @_guarded
    def clear(self, tenant: str | None = None) -> int:
        """Delete every entry (of ``tenant``, if given); returns how many were deleted."""
        self._check_writable("clear")
        with self._db.write() as conn:
            removed = self._db.delete_all(conn, tenant)
        self._delete_blobs(removed)
        return len(removed)

    @_guarded
    def _take_lease(self, tenant: str, exact_key: str, me: Lease, ttl_s: float) -> bool:
        with self._db.write() as conn:
            cur = self._db.lease(conn, tenant, exact_key)
            now = time.time()
            if lease_held(cur, now):
                return False
            if cur is not None:
                log.debug("taking over the lease of %s from %s (pid %d, %s)", exact_key, cur.holder, cur.pid,
                          "expired" if cur.expires <= now else "process gone")
            self._db.set_lease(conn, tenant, exact_key, dataclasses.replace(me, expires=now + ttl_s))
        return True

    @_guarded
    def _drop_lease(self, tenant: str, exact_key: str, holder: str) -> None:
        with self._db.write() as conn:
            self._db.drop_lease(conn, tenant, exact_key, holder)

    # -- reading ---------------------------------------------------------------------------------

    @_guarded
    def _layout(self, entry_id: str) -> dict[str, Any] | None:
        return self._db.layout(entry_id)

    recall = _guarded(StorePolicy.recall)
    same_content = _guarded(StorePolicy.same_content)

    def _reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self._db.read()

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
    def stats(self, tenant: str | None = None) -> BankStats:
        """Entry count and bytes, in total and per tenant (only ``tenant``'s, if given), with the store's capacity
        and eviction policy."""
        per = {t: TenantStats(count=c, bytes=b) for t, c, b in self._db.per_tenant(tenant)}
        settings = self._db.settings()
        return BankStats(
            count=sum(s.count for s in per.values()),
            bytes=sum(s.bytes for s in per.values()),
            capacity_bytes=settings.capacity_bytes,
            tenants=per,
            eviction=settings.eviction,
        )

    @_guarded
    def _settings(self) -> CacheSettings:
        return self._db.settings()

    # -- maintenance -----------------------------------------------------------------------------

    def verify(self, *, tenant: str | None = None, orphan_grace_s: float | None = None) -> VerifyReport:
        """Read every blob of every entry (of ``tenant``) whole and check it against its checksum; quarantine bad
        ones, drop entries whose blob is gone. For the whole store (no ``tenant``) also report entries whose metadata
        the database lost (their blobs are removed), database recoveries since the last verify (from the recovery
        journal), and clean up leftovers of admissions that never committed (staged blobs older than
        ``orphan_grace_s``, default: the bank's). A read-only bank reports without repairing anything."""
        report = VerifyReport(read_only=self.read_only, tenant=tenant)
        self._check_entries(report, self._layouts(tenant))
        if tenant is None:
            grace = self.orphan_grace_s if orphan_grace_s is None else float(orphan_grace_s)
            report.lost, report.orphans_removed = self._sweep_guarded(grace)
            events, total = self._journal.unreported()
            report.recoveries = [RecoveryJournal.describe(e) for e in events]
            if events and not self.read_only:
                self._journal.mark_reported(total)
        return report

    @_guarded
    def _layouts(self, tenant: str | None) -> list[tuple[str, dict[str, Any]]]:
        return self._db.layouts(tenant)

    @_guarded
    def _sweep_guarded(self, grace_s: float) -> tuple[list[str], list[str]]:
        return self._sweep(grace_s, remove_lost=True)

    # -- internals: setup ------------------------------------------------------------------------

    def _prepare_directory(self, read_only: bool | None) -> bool:
        """Create the directory (unless read-only); whether to open it read-only."""
        if read_only:
            if not self.root.is_dir():
                raise CacheError(f"cache directory {self.root} does not exist")
            return True
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cache directory {self.root} is not usable: {exc.strerror or exc}") from None
        if read_only is None and any(_write_protected(p) for p in (self.root, self.root / DB_FILE, self.root / BLOB_DIR)):
            if not (self.root / DB_FILE).exists():
                raise CacheError(f"cache directory {self.root} is read-only and holds no cache")
            return True
        try:
            for sub in (BLOB_DIR, QUARANTINE_DIR):
                (self.root / sub).mkdir(exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.root / BLOB_DIR)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            if read_only is None and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and (self.root / DB_FILE).exists():
                return True
            raise CacheError(f"cache directory {self.root} is not usable: {exc.strerror or exc}") from None
        return False

    def _check_version_marker(self) -> bool:
        """Check the format marker; whether it exists (a new directory gets one once its database exists)."""
        marker = self.root / VERSION_FILE
        try:
            text = marker.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return False
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
        return True

    def _write_version_marker(self) -> None:
        if self.read_only:
            return
        marker = self.root / VERSION_FILE
        tmp = marker.with_name(f".{VERSION_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(f"{_MARKER_NAME} {FORMAT_VERSION}\n", encoding="utf-8")
            os.replace(tmp, marker)
        except OSError as exc:
            raise CacheError(f"cache directory {self.root} is not usable: {exc.strerror or exc}") from None

    def _open_database(self, had_marker: bool) -> None:
        """Connect, recovering from a corrupt file, and record in the journal a database that vanished or was emptied
        under an existing cache (its entries are lost)."""
        self._scopes.clear()
        path = self._db.path
        existed = path.exists()
        if self.read_only and not existed:
            raise CacheError(f"cache directory {self.root} is read-only and holds no cache database")
        if had_marker and not existed and not self.read_only:
            self._move_aside_stale_wal()
        try:
            self._db.open()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            if not is_corruption(exc):
                raise
            self._recover_database(exc)
            return
        if had_marker and not self._db.found_schema:
            what = "missing" if not existed else "emptied"
            blobs = len(self._entry_ids_on_disk())
            self._journal.record(what, f"database {path.name} was {what}; started an empty one", rows=None, blobs=blobs)
            log.warning(
                "cache database %s was %s: started an empty cache (%d entries' blobs remain without metadata; "
                "`carnator cache verify` reports them)", path, what, blobs,
            )

    def _move_aside_stale_wal(self) -> None:
        """A -wal/-shm without their database belong to the lost one: SQLite must not replay them onto a new file."""
        for suffix in ("-wal", "-shm"):
            src = Path(f"{self._db.path}{suffix}")
            if src.exists():
                try:
                    os.replace(src, self.root / QUARANTINE_DIR / f"{src.name}.{time.strftime('%Y%m%dT%H%M%S')}.{uuid.uuid4().hex[:6]}")
                except OSError as exc:
                    log.warning("could not move aside %s: %s", src, exc)

    def _ensure_connection(self) -> None:
        """Reconnect after a fork or after another process replaced (or someone deleted) ``bank.sqlite``."""
        if self._closed:
            raise CacheError("the cache bank is closed")
        if self._db.is_stale():
            self._open_database(had_marker=True)

    def _recover_database(self, exc: BaseException) -> None:
        """Move the broken database aside and start an empty one (entries are lost, nothing bad served); record it in
        the recovery journal."""
        if self.read_only:
            raise CacheError(f"cache database {self._db.path} is damaged ({_first_line(exc)}) and the cache is read-only")
        self._db.close()
        self._scopes.clear()
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = self.root / QUARANTINE_DIR / f"bank.{stamp}.{uuid.uuid4().hex[:6]}.sqlite"
        moved = False
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{self._db.path}{suffix}", f"{dest}{suffix}")
                moved = moved or suffix == ""
            except FileNotFoundError:
                pass
            except OSError as err:
                raise CacheError(f"cache database {self._db.path} is corrupt and cannot be moved aside: {err}") from err
        rows = count_entries(dest) if moved else None
        blobs = len(self._entry_ids_on_disk())
        self._journal.record("corrupt", f"database was corrupt ({_first_line(exc)}); started an empty one",
                             rows=rows, blobs=blobs, moved_to=str(dest) if moved else None)
        log.warning(
            "cache database %s is corrupt (%s); moved it to %s and started an empty cache (cached entries are lost)",
            self._db.path, _first_line(exc), dest,
        )
        self._db.open()

    # -- internals: entries ----------------------------------------------------------------------

    def _add_rows(self, conn: sqlite3.Connection, index: ScopeIndex, tenant: str, compat_key: str, after: int) -> None:
        rows = self._db.scope_rows(conn, tenant, compat_key, after)
        if rows:
            index.add([r.id for r in rows], np.stack([r.embedding for r in rows]))

    _quarantine = _guarded(StorePolicy._quarantine)
    _drop_missing = _guarded(StorePolicy._drop_missing)

    def _entry_ids_on_disk(self) -> set[str]:
        try:
            return {b.entry_id for b in self._blobs.scan() if not b.staged}
        except OSError:
            return set()

    def _sweep(self, grace_s: float, *, remove_lost: bool) -> tuple[list[str], list[str]]:
        """Sort out blobs without a row. Published blobs whose removal was logged, and staged blobs older than
        ``grace_s`` (admissions that never committed), are removed; staged blobs of committed rows are published;
        published blobs of entries the database never removed are *lost* entries: returned, and removed too when
        ``remove_lost``. Returns (lost entry ids, names of the files removed as leftovers). Read-only: removes
        nothing."""
        files = self._blobs.scan()
        if not files:
            return [], []
        with self._db.read():
            known = self._db.ids()  # read after listing, so a blob whose row is being committed is seen with its row
            removed_ids = self._db.removed_ids()
        cutoff = time.time() - grace_s
        lost = sorted({f.entry_id for f in files if not f.staged and f.entry_id not in known and f.entry_id not in removed_ids})
        if self.read_only:
            return lost, []
        lost_set = set(lost)
        leftovers = [
            f for f in files
            if f.entry_id not in known
            and ((f.staged and f.mtime <= cutoff) or (not f.staged and (f.entry_id in removed_ids or (remove_lost and f.entry_id in lost_set))))
        ]
        for f in files:
            if f.staged and f.entry_id in known:
                try:
                    self._blobs.publish(f.key)
                except OSError as exc:
                    log.debug("could not publish cache blob %s: %s", f.key, exc)
        removed: list[str] = []
        if not leftovers:
            return lost, removed
        # Under the write lock, so no admission can commit a row for a blob we are removing: an admission re-checks
        # that its staged blobs exist inside its own write transaction.
        with self._db.write():
            known = self._db.ids()
            for f in leftovers:
                if f.entry_id in known:
                    continue
                try:
                    gone = self._blobs.remove(f)
                except OSError as exc:
                    log.warning("could not delete orphan cache blob %s: %s", f.name, exc)
                    continue
                if gone and f.entry_id not in lost_set:
                    removed.append(f.name)
        if removed:
            log.info("removed %d leftover blob(s) from %s", len(removed), self._blobs.directory)
        return lost, sorted(removed)


def _write_protected(path: Path) -> bool:
    """Whether ``path`` exists and cannot be written, or has every write permission bit off (root included)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not os.access(path, os.W_OK) or (stat.S_IMODE(st.st_mode) & 0o222) == 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
