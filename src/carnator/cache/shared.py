"""The shared cache store: metadata in PostgreSQL, blobs on shared storage (fsspec), a recall index per replica.

    store = SharedStore("postgresql://user@db:5432/carnator", blobs="/mnt/nfs/carnator-blobs")   # or s3://bucket/dir

What lives where:

* PostgreSQL (psycopg 3): entry rows (metadata, recall embedding as float32 bytes, per-tensor checksums, tenant,
  keys), per-scope embedding sizes, the removal log, single-flight leases and the store's settings (capacity,
  eviction policy). Tables live in one schema (``?schema=NAME`` in the URL, default ``carnator``).
* Shared storage (fsspec): immutable checksummed safetensors blobs, written exactly as :class:`CacheBank` writes them
  (stage, commit the row, publish), so a crash anywhere leaves a staged blob without a row (swept after the grace
  period) or a row whose blob is staged (published by its first reader). Each store writes under a directory of its
  own (recorded in its meta table), so stores sharing one ``blobs`` never sweep each other's blobs; a published blob
  without a row or a logged removal is an entry the database lost, reported by :meth:`SharedStore.verify`.
* Each replica: a FAISS index per ``(tenant, compat_key)`` scope, brought up to date before every search from the
  entry sequence and removal log (the bank's sequence/epoch design), and a bounded read-through cache of blob bytes.

Every write transaction takes one PostgreSQL advisory lock first, so writers are serialised: the entry sequence is
assigned in commit order (a replica that has read up to ``seq`` never misses a smaller one committed later), and
eviction is one policy over the whole store, decided inside the admitting transaction. Two replicas admitting the same
exact request leave one entry (the later replaces the earlier, whose blobs are removed).

When PostgreSQL cannot be reached, the store degrades instead of failing requests: lookups and recall are misses,
loads return None, admissions store nothing (None) and touches return False, each counted in :attr:`unavailable` and
warned about once per outage; after a failure it waits ``retry_s`` before trying to connect again. Administrative
calls (configure, evict, clear, verify, stats) raise :class:`CacheError`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import secrets
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import CacheError
from . import policy
from .policy import Scope, StorePolicy
from .blobfs import FsspecBlobStore, ReadThroughBlobs
from .entry import BankStats, CacheSettings, EntryMeta, TenantStats, VerifyReport
from .eviction import LCBFU, LRU, get_eviction
from .index import ScopeIndex, resolve_backend
from .metadb import FORMAT_VERSION, MetaQueries, Lease, SyncState
from .schema import migrate
from .store import STAGED_SUFFIX

log = logging.getLogger("carnator.cache")

#: The built-in eviction policies' order (``eviction.LRU`` / ``LCBFU`` sort keys) in SQL.
_SQL_ORDER = {"lru": 'last_used, created, id COLLATE "C"',
              "lcbfu": 'steps_saved * use_count, last_used, created, id COLLATE "C"'}
_BUILTIN = {"lru": LRU, "lcbfu": LCBFU}

#: How long ``touch`` waits for a lock (statement timeout) before giving up: it is only bookkeeping.
TOUCH_TIMEOUT_MS = 2000


class StoreUnavailable(CacheError):
    """PostgreSQL cannot be reached (down, refused, connection lost)."""


def parse_store_url(url: str) -> tuple[str, str]:
    """``postgresql://...[?schema=NAME]`` -> (connection URL without ``schema``, schema name)."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    schema = next((v for k, v in query if k == "schema"), "carnator")
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
        raise CacheError(f"store URL: schema must be a lowercase SQL name ([a-z_][a-z0-9_]*), got {schema!r}")
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "schema"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), schema


def _available(default: Any) -> Callable:
    """Public read/bookkeeping calls: PostgreSQL unreachable -> ``default`` (a miss), counted and warned about."""

    def deco(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self: SharedStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except StoreUnavailable as exc:
                self._note_unavailable(method.__name__, exc)
                return default() if callable(default) else default

        return wrapper

    return deco


class PgMeta(MetaQueries):
    """The metadata queries over PostgreSQL (psycopg's ``%s`` placeholders). The byte total is kept in a ``meta`` row
    by the writers (summing 10^6 rows per admission is not an option)."""

    placeholder = "%s"

    def total_bytes(self, conn: Any) -> int:
        return int(conn.execute("SELECT value FROM meta WHERE key = 'total_bytes'").fetchone()[0])

    def sync_state(self, c: Any) -> SyncState:
        epoch = c.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
        eseq = c.execute("SELECT coalesce(max(seq), 0) FROM entries").fetchone()[0]
        rmin, rmax = c.execute("SELECT min(seq), coalesce(max(seq), 0) FROM removals").fetchone()
        return SyncState(epoch=epoch[0] if epoch else "", entry_seq=int(eseq), removal_seq=int(rmax),
                         oldest_logged_removal=None if rmin is None else int(rmin))

    def _bytes_changed(self, conn: Any, n: int) -> None:
        if n:
            conn.execute("UPDATE meta SET value = (value::bigint + %s)::text WHERE key = 'total_bytes'", (int(n),))


class SharedStore(StorePolicy):
    """A cache store shared by processes on many hosts; implements :class:`~carnator.cache.CacheStore`.

    Args:
        url: ``postgresql://user[:password]@host[:port]/database[?schema=NAME]`` (libpq URL; ``schema`` picks the
            schema its tables live in, default ``carnator``).
        blobs: where blobs live: a path (local or NFS) or an fsspec URL (``s3://bucket/prefix`` with s3fs installed);
            this store's are in its own directory under it, :attr:`blobs_url`.
        read_only: serve lookups, loads and recall; store nothing.
        index_backend: ``"auto"``, ``"faiss"`` or ``"numpy"`` (same results, different speed).
        local_cache_bytes: bound of this process's read-through cache of blob bytes.
        orphan_grace_s: blobs without a row younger than this are left alone by the sweep (an admission may be between
            staging them and committing its row).
        connect_timeout_s: how long to wait for PostgreSQL when (re)connecting.
        retry_s: after PostgreSQL failed, serve degraded (misses) for this long before trying again.
    """

    def __init__(self, url: str, blobs: str | os.PathLike[str], *, read_only: bool = False, index_backend: str = "auto",
                 local_cache_bytes: int = 256 << 20, orphan_grace_s: float = 600.0, connect_timeout_s: float = 3.0,
                 retry_s: float = 2.0, clock: Callable[[], float] = time.time) -> None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise CacheError("a postgresql:// store needs psycopg: pip install 'carnator[scale]'") from None
        self.url = url
        self._conninfo, self.schema = parse_store_url(url)
        #: where blobs of every store live; this store's are in its own directory under it, :attr:`blobs_url`
        self.blobs_root = str(blobs).rstrip("/") or "/"
        self.blobs_url = self.blobs_root
        self._blob_dir: str | None = None
        self.read_only = bool(read_only)
        self.orphan_grace_s = float(orphan_grace_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_s = float(retry_s)
        self._clock = clock
        self._backend = resolve_backend(index_backend)
        self._lock = threading.RLock()
        self._scopes: dict[tuple[str, str], Scope] = {}
        self._db = PgMeta()
        self._conn: Any = None
        self._pid = -1
        self._down_until = 0.0
        self._outage = False
        self._closed = False
        self._warned: set[str] = set()
        self._lock_key = zlib.crc32(f"carnator:{self.schema}".encode()) & 0x7FFFFFFF
        #: calls served degraded because PostgreSQL could not be reached (a metric: carnator_cache_store_unavailable)
        self.unavailable = 0
        try:
            import fsspec

            self._root_fs, self._root_path = fsspec.core.url_to_fs(self.blobs_root)
        except (OSError, ValueError, ImportError) as exc:
            raise CacheError(f"--blobs {self.blobs_root}: not usable ({exc})") from None
        with self._lock:
            self._connect()  # a wrong URL fails here, at start-up; an outage later degrades
        if self._blob_dir is not None:
            self.blobs_url = f"{self.blobs_root.rstrip('/')}/{self._blob_dir}"
        try:
            self.remote = FsspecBlobStore(self.blobs_url, read_only=self.read_only)
        except (OSError, ValueError, ImportError) as exc:
            raise CacheError(f"--blobs {self.blobs_root}: not usable ({exc})") from None
        self._blobs = ReadThroughBlobs(self.remote, local_cache_bytes)

    # -- connection --------------------------------------------------------------------------------

    def _connect(self) -> Any:
        import psycopg

        if self._closed:
            raise CacheError("the cache store is closed")
        if self._conn is not None and not self._conn.closed and self._pid == os.getpid():
            return self._conn
        if time.monotonic() < self._down_until:
            raise StoreUnavailable("PostgreSQL is unavailable (retrying shortly)")
        try:
            conn = psycopg.connect(self._conninfo, connect_timeout=max(1, int(self.connect_timeout_s)), autocommit=True)
        except psycopg.OperationalError as exc:
            self._down_until = time.monotonic() + self.retry_s
            raise StoreUnavailable(f"cannot connect to PostgreSQL: {_first_line(exc)}") from None
        except psycopg.Error as exc:
            raise CacheError(f"store URL {_redact(self.url)}: {_first_line(exc)}") from None
        try:
            self._init_schema(conn)
        except BaseException:
            conn.close()
            raise
        self._conn, self._pid = conn, os.getpid()
        if self._outage:
            self._outage = False
            log.warning("PostgreSQL is reachable again: the shared cache store serves hits again")
        return conn

    def _init_schema(self, conn: Any) -> None:
        import psycopg

        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
                if not self.read_only:
                    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self.schema}")
                conn.execute(f"SET search_path TO {self.schema}")
                if not self.read_only:
                    found = None
                    if conn.execute("SELECT to_regclass('meta')").fetchone()[0] is not None:
                        found = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                    migrate(conn.execute, "postgresql", found[0] if found else None)
                    conn.execute("INSERT INTO meta VALUES ('format_version', %s) ON CONFLICT DO NOTHING", (str(FORMAT_VERSION),))
                    conn.execute("INSERT INTO meta VALUES ('epoch', %s) ON CONFLICT DO NOTHING", (secrets.token_hex(8),))
                    # the sum of every entry's bytes, kept by the writers (a sum over 10^6 rows per admission is not)
                    conn.execute("INSERT INTO meta SELECT 'total_bytes', coalesce(sum(nbytes), 0)::text FROM entries "
                                 "ON CONFLICT DO NOTHING")
                    self._own_blob_dir(conn)
                row = conn.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()
                blob_dir = conn.execute("SELECT value FROM meta WHERE key = 'blob_dir'").fetchone()
            conn.execute(f"SET search_path TO {self.schema}")  # a session setting, outside the transaction too
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL: {_first_line(exc)}") from None
        except psycopg.Error as exc:
            raise CacheError(f"store {_redact(self.url)}: {_first_line(exc)}") from None
        if row is None or row[0] != str(FORMAT_VERSION):
            raise CacheError(f"store {_redact(self.url)} (schema {self.schema}) uses format version "
                             f"{row[0] if row else '?'}, this carnator reads version {FORMAT_VERSION}")
        self._blob_dir = None if blob_dir is None else str(blob_dir[0])

    def _own_blob_dir(self, conn: Any) -> None:
        """Give the store a blob directory of its own (``<schema>-<random>`` under ``--blobs``), recorded in its meta
        table: stores of several schemas may share one ``--blobs`` and never sweep each other's blobs. A store made
        before blob directories existed (its blobs directly under ``--blobs``) has its entries' blobs moved into its
        directory, once, in the writers' transaction that records it (moves are idempotent: a crash midway resumes)."""
        if conn.execute("SELECT 1 FROM meta WHERE key = 'blob_dir'").fetchone() is not None:
            return
        name = f"{self.schema}-{secrets.token_hex(6)}"
        fs, root = self._root_fs, self._root_path.rstrip("/")
        fs.makedirs(f"{root}/{name}", exist_ok=True)
        moved = 0
        for (layout,) in conn.execute("SELECT layout FROM entries"):
            for key in json.loads(layout)["blobs"]:
                for src, dest in ((f"{root}/{key}", f"{root}/{name}/{key}"),
                                  (f"{root}/.{key}{STAGED_SUFFIX}", f"{root}/{name}/.{key}{STAGED_SUFFIX}")):
                    if fs.exists(src):
                        fs.mv(src, dest)
                        moved += 1
        conn.execute("INSERT INTO meta VALUES ('blob_dir', %s)", (name,))
        if moved:
            log.warning("moved %d blob(s) of the cache store in schema %s into its own directory %s/%s",
                        moved, self.schema, self.blobs_root, name)

    @contextmanager
    def _tx(self, *, write: bool = False, snapshot: bool = False, timeout_ms: int | None = None) -> Iterator[Any]:
        """One transaction. ``write``: serialised with every other writer (advisory lock); ``snapshot``: every query
        sees one snapshot (REPEATABLE READ). PostgreSQL unreachable -> :class:`StoreUnavailable`."""
        import psycopg

        with self._lock:
            conn = self._connect()
            try:
                with conn.transaction():
                    if snapshot:
                        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    if timeout_ms is not None:
                        conn.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
                    if write:
                        if self.read_only:
                            raise CacheError(f"cache store {_redact(self.url)} is read-only")
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
                    yield conn
            except psycopg.OperationalError as exc:
                if conn.closed or conn.broken:
                    self._drop_connection()
                    raise StoreUnavailable(f"lost PostgreSQL: {_first_line(exc)}") from None
                raise CacheError(f"cache store: {_first_line(exc)}") from None
            except psycopg.Error as exc:
                raise CacheError(f"cache store: {_first_line(exc)}") from None

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._down_until = time.monotonic() + self.retry_s
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def _note_unavailable(self, what: str, exc: BaseException) -> None:
        self.unavailable += 1
        if not self._outage:
            self._outage = True
            log.warning("shared cache store unavailable (%s); requests run without the cache until it is back", exc)
        else:
            log.debug("shared cache store unavailable in %s: %s", what, exc)

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._scopes.clear()

    def __repr__(self) -> str:
        return f"SharedStore({_redact(self.url)!r}, blobs={self.blobs_url!r})"

    def _origin(self) -> FsspecBlobStore:
        return self.remote

    # -- writing ----------------------------------------------------------------------------------------

    def _label(self) -> str:
        return f"store {_redact(self.url)}"

    def _blob_words(self) -> str:
        return f"blob storage {self.blobs_url}"

    def _scope_state(self, tenant: str, compat_key: str) -> tuple[int | None, CacheSettings]:
        with self._tx() as c:
            return self._db.scope_dim(tenant, compat_key, c), self._db.settings(c)

    _admit = _available(None)(StorePolicy._admit)  # PostgreSQL unreachable: nothing stored (None), counted

    def _writing(self) -> contextlib.AbstractContextManager[Any]:
        return self._tx(write=True)

    def _blob_place(self) -> str:
        return self.blobs_url

    def _victims(self, c: Any, need: int, settings: CacheSettings) -> tuple[list[str], bool]:
        if need <= 0:
            return [], True
        order = _SQL_ORDER.get(settings.eviction)
        if order is not None and type(get_eviction(settings.eviction)) is _BUILTIN[settings.eviction]:
            # The built-in policies' order, computed by PostgreSQL: read victims a batch at a time instead of every row.
            chosen: list[str] = []
            freed, offset = 0, 0
            while True:
                rows = c.execute(f"SELECT id, nbytes FROM entries ORDER BY {order} LIMIT 256 OFFSET %s", (offset,)).fetchall()
                if not rows:
                    return chosen, False
                for entry_id, nbytes in rows:
                    chosen.append(entry_id)
                    freed += int(nbytes)
                    if freed >= need:
                        return chosen, True
                offset += len(rows)
        return policy.choose_victims(self._db.all(c), need, settings.eviction)

    @_available(False)
    def touch(self, entry_id: str, *, steps_saved: float | None = None) -> bool:
        """Record one use; False when the entry is gone or the write could not be made (never raises)."""
        if self.read_only:
            self._warn_once("touch", "cache store is read-only: uses are not recorded")
            return False
        try:
            with self._tx(timeout_ms=TOUCH_TIMEOUT_MS) as c:
                return self._db.touch(entry_id, self._clock(), steps_saved, c)
        except StoreUnavailable:
            raise
        except CacheError as exc:
            self._warn_once("touch", "could not record a use of cache entry %s (%s); carrying on", entry_id, exc)
            return False

    def evict(self, entry_ids: Iterable[str]) -> int:
        """Remove these entries; how many existed."""
        if isinstance(entry_ids, str):
            raise TypeError("evict takes a collection of entry ids, not one string")
        with self._tx(write=True) as c:
            removed = self._db.delete(c, list(entry_ids))
        self._delete_blobs(removed)
        return len(removed)

    def clear(self, tenant: str | None = None) -> int:
        """Delete every entry (of ``tenant``); how many were deleted."""
        with self._tx(write=True) as c:
            removed = self._db.delete_all(c, tenant)
        self._delete_blobs(removed)
        return len(removed)

    # -- single flight ----------------------------------------------------------------------------------

    def _lease_unavailable(self, exc: Exception) -> None:
        if isinstance(exc, StoreUnavailable):  # PostgreSQL unreachable: enter at once, uncoordinated
            self._note_unavailable("single_flight", exc)
        else:
            super()._lease_unavailable(exc)

    def _drop_lease(self, tenant: str, exact_key: str, holder: str) -> None:
        with self._tx() as c:
            self._db.drop_lease(c, tenant, exact_key, holder)

    def _take_lease(self, tenant: str, exact_key: str, me: Lease, ttl_s: float) -> bool:
        with self._tx() as c:
            row = c.execute("SELECT holder, host, pid, expires FROM leases WHERE tenant = %s AND exact_key = %s FOR UPDATE",
                            (tenant, exact_key)).fetchone()
            now = time.time()
            if row is not None:
                cur = Lease(str(row[0]), str(row[1]), int(row[2]), float(row[3]))
                if policy.lease_held(cur, now):
                    return False
            # ON CONFLICT: another replica inserted the first lease at the same moment; the row lock decides
            got = c.execute(
                "INSERT INTO leases VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (tenant, exact_key) DO UPDATE SET "
                "holder = EXCLUDED.holder, host = EXCLUDED.host, pid = EXCLUDED.pid, expires = EXCLUDED.expires "
                "WHERE leases.holder = %s OR leases.expires <= %s OR %s RETURNING holder",
                (tenant, exact_key, me.holder, me.host, me.pid, now + ttl_s, row[0] if row else "", now, row is not None),
            ).fetchone()
            return got is not None

    # -- reading ---------------------------------------------------------------------------------------

    load = _available(None)(StorePolicy.load)

    def _layout(self, entry_id: str) -> dict[str, Any] | None:
        with self._tx() as c:
            return self._db.layout(entry_id, c)

    @staticmethod
    def _safe(fn: Callable[[str], str | None], key: str) -> str | None:
        try:
            return fn(key)
        except OSError as exc:
            log.warning("could not move cache blob %s aside: %s", key, exc)
            return None

    recall = _available(list)(StorePolicy.recall)
    same_content = _available(list)(StorePolicy.same_content)

    def _reading(self) -> contextlib.AbstractContextManager[Any]:
        return self._tx(snapshot=True)

    def sync(self, tenant: str, compat_key: str) -> int:
        """Bring this replica's index of one scope up to date now; how many entries it holds (for benchmarks)."""
        with self._tx(snapshot=True) as c:
            dim = self._db.scope_dim(tenant, compat_key, c)
            return 0 if dim is None else len(self._scope_index(c, tenant, compat_key, dim))

    @staticmethod
    def _add_rows(c: Any, index: ScopeIndex, tenant: str, compat_key: str, after: int, chunk: int = 20000) -> None:
        """Add the scope's rows after sequence ``after`` to ``index``, ``chunk`` rows at a time (a cold start of 10^6
        entries never holds them all as Python objects at once)."""
        cur = c.cursor(name=f"scope_{uuid.uuid4().hex[:8]}")  # server-side: rows arrive in batches
        cur.execute("SELECT id, embedding FROM entries WHERE tenant = %s AND compat_key = %s AND seq > %s ORDER BY seq",
                    (tenant, compat_key, after))
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                break
            vecs = np.frombuffer(b"".join(bytes(e) for _, e in rows), dtype="<f4").reshape(len(rows), -1)
            index.add([str(i) for i, _ in rows], vecs.astype(np.float32))
        cur.close()

    @_available(None)
    def lookup_exact(self, tenant: str, exact_key: str, compat_key: str | None = None) -> EntryMeta | None:
        """The entry admitted with ``exact_key`` for ``tenant`` (and ``compat_key``, if given), or None."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("tenant must be a non-empty string")
        with self._tx() as c:
            return self._db.by_exact_key(tenant, exact_key, compat_key, c)

    @_available(None)
    def get(self, entry_id: str) -> EntryMeta | None:
        with self._tx() as c:
            return self._db.get(entry_id, c)

    def entries(self, tenant: str | None = None) -> list[EntryMeta]:
        """All entries (of ``tenant``), oldest admission first."""
        with self._tx() as c:
            return self._db.all(c, tenant)

    def stats(self, tenant: str | None = None) -> BankStats:
        with self._tx() as c:
            per = {t: TenantStats(count=n, bytes=b) for t, n, b in self._db.per_tenant(tenant, c)}
            settings = self._db.settings(c)
        return BankStats(count=sum(s.count for s in per.values()), bytes=sum(s.bytes for s in per.values()),
                         capacity_bytes=settings.capacity_bytes, tenants=per, eviction=settings.eviction)

    # -- maintenance ------------------------------------------------------------------------------------

    def verify(self, *, tenant: str | None = None, orphan_grace_s: float | None = None) -> VerifyReport:
        """Read every blob of every entry (of ``tenant``) whole and check it; quarantine bad ones, drop entries whose
        blob is gone. For the whole store also report entries whose row is gone while their blobs remain (*lost*:
        the database lost them; their blobs are removed), and sweep leftovers (blobs of removed entries, staged blobs of
        admissions that never committed, older than the grace period). Only this store's blob directory is read."""
        report = VerifyReport(read_only=self.read_only, tenant=tenant)
        with self._tx() as c:
            where, args = ("", ()) if tenant is None else (" WHERE tenant = %s", (tenant,))
            layouts = [(str(i), json.loads(lay)) for i, lay in c.execute(f"SELECT id, layout FROM entries{where} ORDER BY seq", args)]
        self._check_entries(report, layouts)  # the shared copy itself, not this replica's cached ranges
        if tenant is None:
            grace = self.orphan_grace_s if orphan_grace_s is None else float(orphan_grace_s)
            report.lost, report.orphans_removed = self._sweep(grace, remove_lost=True)
        return report

    def sweep(self, grace_s: float | None = None) -> list[str]:
        """Remove leftovers older than ``grace_s`` (default: the store's grace period): blobs of removed entries
        whose deletion failed, staged blobs of admissions that never committed; publish staged blobs of committed
        rows. Blobs of lost entries stay (for :meth:`verify` to report). Returns the names removed."""
        return self._sweep(self.orphan_grace_s if grace_s is None else float(grace_s), remove_lost=False)[1]

    def _sweep(self, grace_s: float, *, remove_lost: bool) -> tuple[list[str], list[str]]:
        """Sort out this store's blobs without a row: published blobs of logged removals and staged blobs are leftovers,
        removed once older than ``grace_s``; published blobs of entries never removed are *lost* (returned, removed
        when ``remove_lost``). Runs under the writers' lock, so no admission commits a row for a blob being removed (an
        admission re-checks its staged blobs inside its own write transaction). Returns (lost ids, leftovers
        removed); read-only: removes nothing."""
        files = self._blobs.scan()
        if not files:
            return [], []
        cutoff = time.time() - grace_s
        lost: set[str] = set()
        removed: list[str] = []
        with self._tx(write=not self.read_only) as c:
            known = {r[0] for r in c.execute("SELECT id FROM entries")}  # read after listing: see _sweep's docstring
            logged = {r[0] for r in c.execute("SELECT id FROM removals")}
            for f in files:
                if f.entry_id in known:
                    if f.staged and not self.read_only:
                        self._safe(lambda k: str(self._blobs.publish(k)), f.key)
                    continue
                if not f.staged and f.entry_id not in logged:
                    lost.add(f.entry_id)
                    if not remove_lost:
                        continue
                elif f.mtime > cutoff:
                    continue
                if self.read_only:
                    continue
                try:
                    if self._blobs.remove(f) and f.entry_id not in lost:
                        removed.append(f.name)
                except OSError as exc:
                    log.warning("could not delete orphan cache blob %s: %s", f.name, exc)
        if removed:
            log.info("removed %d leftover blob(s) from %s", len(removed), self.blobs_url)
        return sorted(lost), sorted(removed)


def _redact(url: str) -> str:
    """The URL without its password (for messages)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<store URL>"
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return url


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
