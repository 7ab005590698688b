"""The bank's metadata database: SQLite in WAL mode, safe to share between processes; and :class:`MetaQueries`, the
metadata queries both cache stores run (the shared store's :class:`~carnator.cache.shared.PgMeta` over PostgreSQL).
The tables themselves are defined once in :mod:`carnator.cache.schema`.

Every process keeps its own connection (reopened after ``fork`` or when ``bank.sqlite`` is replaced
by another process's recovery). Writers use ``BEGIN IMMEDIATE`` and wait up to ``busy_timeout``
for each other. Nothing read from the database is trusted across calls without re-checking: the
bank's vector indices compare the counters in :meth:`MetaDB.sync_state` before every search.

Tables:

``meta``
    ``format_version``, ``epoch`` (a token that changes on ``clear``), ``capacity_bytes`` and ``eviction`` (the
    store's settings).
``entries``
    one row per entry; ``seq`` is an AUTOINCREMENT rowid, so later inserts always get larger ones. ``layout`` is
    JSON: per blob its size and sha256, per tensor its blob, byte range, dtype, shape and sha256.
``scopes``
    the embedding size of each ``(tenant, compat_key)`` scope (the recall index is per scope).
``removals``
    a log of removed entries (the last :data:`REMOVAL_LOG_KEEP`), so other processes' indices can
    drop them without a full rebuild, and so that a removed entry's blobs are not mistaken for a lost entry's.
``leases``
    single-flight leases: who is generating which exact request, until when.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tenacity

from ..errors import CacheError
from .entry import CacheSettings, EntryMeta
from .schema import migrate

#: Version of the on-disk layout (``VERSION`` marker, schema, blob naming). Bump on incompatible change.
#: 1: one tensor file per entry, one checksum per file. 2: tensors and video in separate blobs, a checksum per
#: tensor, blobs published after their row commits, settings and per-scope embedding sizes in the database.
FORMAT_VERSION = 2
#: How many removals the log keeps; an index further behind than this rebuilds from scratch.
REMOVAL_LOG_KEEP = 4096

_COLUMNS = (
    "id, tenant, compat_key, exact_key, prompt, negative_prompt, seed, created, last_used, "
    "use_count, steps_saved, nbytes, embedding, extra, layout, content_key"
)

_CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


class DatabaseCorrupt(sqlite3.DatabaseError):
    """Damage SQLite did not raise as such: ``PRAGMA quick_check`` findings, schema text that is not UTF-8."""


def is_corruption(exc: BaseException) -> bool:
    """Whether ``exc`` means the database file is damaged (as opposed to busy, read-only, full, ...).

    A ``UnicodeDecodeError`` out of sqlite3 counts: a damaged byte in the schema text makes SQLite's error message
    (which quotes the schema) undecodable, so Python raises that instead of "malformed database schema".
    """
    if isinstance(exc, (DatabaseCorrupt, UnicodeDecodeError)):
        return True
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and (code & 0xFF) in _CORRUPT_CODES:
        return True
    msg = str(exc).lower()
    return "malformed" in msg or "not a database" in msg or "could not decode to utf-8" in msg


@dataclass(frozen=True)
class SyncState:
    """Counters that tell an in-memory index whether (and how) the table changed under it."""

    epoch: str
    entry_seq: int
    removal_seq: int
    oldest_logged_removal: int | None


@dataclass(frozen=True)
class ScopeRow:
    seq: int
    id: str
    embedding: np.ndarray


@dataclass(frozen=True)
class Lease:
    holder: str
    host: str
    pid: int
    expires: float


class MetaQueries:
    """The metadata queries of both cache stores, written once in the SQL that SQLite and PostgreSQL both take, with
    ``?`` placeholders (turned into ``%s`` for psycopg). ``conn``: the transaction's connection (default: the
    store's own, where it keeps one)."""

    placeholder = "?"

    def _x(self, conn: Any, sql: str, args: Sequence[Any] = ()) -> Any:
        return conn.execute(sql if self.placeholder == "?" else sql.replace("?", self.placeholder), args)

    def _c(self, conn: Any) -> Any:
        if conn is None:
            raise CacheError("no connection to the cache's metadata")
        return conn

    def _bytes_changed(self, conn: Any, n: int) -> None:
        """A store that keeps its byte total in a row adds ``n`` to it (inside the write)."""

    def sync_state(self, conn: Any) -> SyncState:
        """The counters a process's vector indices compare before every search (each store keeps them its way)."""
        raise NotImplementedError

    # -- meta and settings -----------------------------------------------------------------------

    def get_meta(self, key: str, conn: Any = None) -> str | None:
        row = self._x(self._c(conn), "SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, conn: Any, key: str, value: str) -> None:
        self._x(conn, "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def settings(self, conn: Any = None) -> CacheSettings:
        cap = self.get_meta("capacity_bytes", conn)
        quota = self.get_meta("tenant_quota_bytes", conn)
        return CacheSettings(
            capacity_bytes=None if cap in (None, "none") else int(cap),
            eviction=self.get_meta("eviction", conn) or "lru",
            tenant_quota_bytes=None if quota in (None, "none") else int(quota),
        )

    def set_settings(self, conn: Any, settings: CacheSettings) -> None:
        cap, quota = settings.capacity_bytes, settings.tenant_quota_bytes
        self.set_meta(conn, "capacity_bytes", "none" if cap is None else str(int(cap)))
        self.set_meta(conn, "eviction", settings.eviction)
        self.set_meta(conn, "tenant_quota_bytes", "none" if quota is None else str(int(quota)))

    # -- scopes ----------------------------------------------------------------------------------

    def scope_dim(self, tenant: str, compat_key: str, conn: Any = None) -> int | None:
        """The embedding size of a scope, or None while it holds no entry (an emptied scope takes any size)."""
        c = self._c(conn)
        row = self._x(c, "SELECT dim FROM scopes WHERE tenant = ? AND compat_key = ?", (tenant, compat_key)).fetchone()
        if row is None:
            return None
        if self._x(c, "SELECT 1 FROM entries WHERE tenant = ? AND compat_key = ? LIMIT 1", (tenant, compat_key)).fetchone() is None:
            return None
        return int(row[0])

    def set_scope_dim(self, conn: Any, tenant: str, compat_key: str, dim: int) -> None:
        self._x(conn,
            "INSERT INTO scopes (tenant, compat_key, dim) VALUES (?, ?, ?) "
            "ON CONFLICT (tenant, compat_key) DO UPDATE SET dim = excluded.dim", (tenant, compat_key, int(dim))
        )

    # -- entries ---------------------------------------------------------------------------------

    def insert(self, conn: Any, meta: EntryMeta, layout: dict[str, Any]) -> None:
        self._x(conn, f"INSERT INTO entries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (
            meta.id, meta.tenant, meta.compat_key, meta.exact_key, meta.prompt, meta.negative_prompt,
            None if meta.seed is None else str(int(meta.seed)), meta.created, meta.last_used, int(meta.use_count),
            float(meta.steps_saved), int(meta.nbytes), np.ascontiguousarray(meta.embedding, dtype="<f4").tobytes(),
            dump_extra(meta.extra), json.dumps(layout, sort_keys=True, separators=(",", ":")), meta.content_key))
        self._bytes_changed(conn, int(meta.nbytes))

    def delete(self, conn: Any, ids: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
        """Delete rows by id and log the removals; returns ``(id, layout)`` of those that existed."""
        removed: list[tuple[str, dict[str, Any]]] = []
        freed = 0
        for entry_id in ids:
            row = self._x(conn, "SELECT tenant, compat_key, layout, nbytes FROM entries WHERE id = ?", (entry_id,)).fetchone()
            if row is None:
                continue
            self._x(conn, "DELETE FROM entries WHERE id = ?", (entry_id,))
            self._x(conn, "INSERT INTO removals (id, tenant, compat_key) VALUES (?, ?, ?)", (entry_id, row[0], row[1]))
            removed.append((entry_id, _layout(row[2])))
            freed += int(row[3])
        if removed:
            self._trim_removals(conn)
            self._bytes_changed(conn, -freed)
        return removed

    def delete_all(self, conn: Any, tenant: str | None) -> list[tuple[str, dict[str, Any]]]:
        """Delete every row (of ``tenant``) and log the removals; changes the epoch so every index rebuilds."""
        where, args = ("", ()) if tenant is None else (" WHERE tenant = ?", (tenant,))
        found = self._x(conn, f"SELECT id, layout, nbytes FROM entries{where}", args).fetchall()
        rows = [(str(i), _layout(lay)) for i, lay, _ in found]
        if rows:
            self._bytes_changed(conn, -sum(int(n) for _, _, n in found))
            self._x(conn, f"INSERT INTO removals (id, tenant, compat_key) SELECT id, tenant, compat_key FROM entries{where}", args)
            self._x(conn, f"DELETE FROM entries{where}", args)
            self._x(conn, f"DELETE FROM scopes{where}", args)
            self._trim_removals(conn)
            self.set_meta(conn, "epoch", secrets.token_hex(8))
        return rows

    def _trim_removals(self, conn: Any) -> None:
        self._x(conn, "DELETE FROM removals WHERE seq <= (SELECT max(seq) FROM removals) - ?", (REMOVAL_LOG_KEEP,))

    def get(self, entry_id: str, conn: Any = None) -> EntryMeta | None:
        row = self._x(self._c(conn), f"SELECT {_COLUMNS} FROM entries WHERE id = ?", (entry_id,)).fetchone()
        return None if row is None else _to_meta(row)

    def get_many(self, conn: Any, ids: Sequence[str]) -> dict[str, EntryMeta]:
        out: dict[str, EntryMeta] = {}
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            marks = ",".join("?" * len(chunk))
            for row in self._x(conn, f"SELECT {_COLUMNS} FROM entries WHERE id IN ({marks})", chunk):
                meta = _to_meta(row)
                out[meta.id] = meta
        return out

    def layout(self, entry_id: str, conn: Any = None) -> dict[str, Any] | None:
        row = self._x(self._c(conn), "SELECT layout FROM entries WHERE id = ?", (entry_id,)).fetchone()
        return None if row is None else _layout(row[0])

    def layouts(self, tenant: str | None = None, conn: Any = None) -> list[tuple[str, dict[str, Any]]]:
        where, args = ("", ()) if tenant is None else (" WHERE tenant = ?", (tenant,))
        return [(str(i), _layout(lay)) for i, lay in self._x(self._c(conn), f"SELECT id, layout FROM entries{where} ORDER BY seq", args)]

    def ids(self, conn: Any = None) -> set[str]:
        return {r[0] for r in self._x(self._c(conn), "SELECT id FROM entries")}

    def removed_ids(self, conn: Any = None) -> set[str]:
        return {r[0] for r in self._x(self._c(conn), "SELECT id FROM removals")}

    def by_exact_key(self, tenant: str, exact_key: str, compat_key: str | None = None, conn: Any = None) -> EntryMeta | None:
        sql = f"SELECT {_COLUMNS} FROM entries WHERE tenant = ? AND exact_key = ?"
        args: list[Any] = [tenant, exact_key]
        if compat_key is not None:
            sql += " AND compat_key = ?"
            args.append(compat_key)
        row = self._x(self._c(conn), sql + " ORDER BY seq DESC LIMIT 1", args).fetchone()
        return None if row is None else _to_meta(row)

    def content_ids(self, conn: Any, tenant: str, compat_key: str, content_keys: Sequence[str], limit: int) -> list[str]:
        """The newest ``limit`` entries of the scope admitted under any of ``content_keys``, newest first."""
        keys = sorted(set(content_keys))
        if not keys or limit <= 0:
            return []
        rows = self._x(conn, "SELECT id FROM entries WHERE tenant = ? AND compat_key = ? AND content_key IN "
                             f"({', '.join('?' * len(keys))}) ORDER BY seq DESC LIMIT ?", (tenant, compat_key, *keys, int(limit)))
        return [r[0] for r in rows]

    def exact_key_ids(self, conn: Any, tenant: str, exact_key: str, compat_key: str) -> list[str]:
        rows = self._x(conn, "SELECT id FROM entries WHERE tenant = ? AND exact_key = ? AND compat_key = ?",
                            (tenant, exact_key, compat_key))
        return [r[0] for r in rows]

    def all(self, conn: Any = None, tenant: str | None = None) -> list[EntryMeta]:
        c = self._c(conn)
        if tenant is None:
            rows = self._x(c, f"SELECT {_COLUMNS} FROM entries ORDER BY seq")
        else:
            rows = self._x(c, f"SELECT {_COLUMNS} FROM entries WHERE tenant = ? ORDER BY seq", (tenant,))
        return [_to_meta(r) for r in rows]

    def total_bytes(self, conn: Any) -> int:
        return int(self._x(conn, "SELECT coalesce(sum(nbytes), 0) FROM entries").fetchone()[0])

    def tenant_bytes(self, conn: Any, tenant: str) -> int:
        return int(self._x(conn, "SELECT coalesce(sum(nbytes), 0) FROM entries WHERE tenant = ?", (tenant,)).fetchone()[0])

    def tenant_oldest(self, conn: Any, tenant: str, need: int, batch: int = 256) -> tuple[list[str], bool]:
        """The tenant's oldest entries (admission order) that free ``need`` bytes, and whether they do."""
        out: list[str] = []
        freed, after = 0, -1
        while freed < need:
            rows = self._x(conn, "SELECT seq, id, nbytes FROM entries WHERE tenant = ? AND seq > ? ORDER BY seq LIMIT ?",
                           (tenant, after, batch)).fetchall()
            if not rows:
                return out, False
            for seq, entry_id, nbytes in rows:
                after = seq
                out.append(str(entry_id))
                freed += int(nbytes)
                if freed >= need:
                    break
        return out, True

    def per_tenant(self, tenant: str | None = None, conn: Any = None) -> list[tuple[str, int, int]]:
        where, args = ("", ()) if tenant is None else (" WHERE tenant = ?", (tenant,))
        return [
            (str(t), int(c), int(b))
            for t, c, b in self._x(self._c(conn),
                f"SELECT tenant, count(*), coalesce(sum(nbytes), 0) FROM entries{where} GROUP BY tenant ORDER BY tenant", args
            )
        ]

    def touch(self, entry_id: str, now: float, steps_saved: float | None, conn: Any = None) -> bool:
        if steps_saved is None:
            cur = self._x(self._c(conn),
                "UPDATE entries SET last_used = ?, use_count = use_count + 1 WHERE id = ?", (now, entry_id)
            )
        else:
            cur = self._x(self._c(conn),
                "UPDATE entries SET last_used = ?, use_count = use_count + 1, steps_saved = ? WHERE id = ?",
                (now, float(steps_saved), entry_id),
            )
        return cur.rowcount > 0

    def scope_rows(self, conn: Any, tenant: str, compat_key: str, after_seq: int = 0) -> list[ScopeRow]:
        rows = self._x(conn,
            "SELECT seq, id, embedding FROM entries WHERE tenant = ? AND compat_key = ? AND seq > ? ORDER BY seq",
            (tenant, compat_key, after_seq),
        )
        return [ScopeRow(int(s), str(i), np.frombuffer(e, dtype="<f4").astype(np.float32)) for s, i, e in rows]

    def scope_removals(self, conn: Any, tenant: str, compat_key: str, after_seq: int) -> list[str]:
        rows = self._x(conn,
            "SELECT id FROM removals WHERE tenant = ? AND compat_key = ? AND seq > ?", (tenant, compat_key, after_seq)
        )
        return [r[0] for r in rows]

    # -- leases ----------------------------------------------------------------------------------

    def lease(self, conn: Any, tenant: str, exact_key: str) -> Lease | None:
        row = self._x(conn,
            "SELECT holder, host, pid, expires FROM leases WHERE tenant = ? AND exact_key = ?", (tenant, exact_key)
        ).fetchone()
        return None if row is None else Lease(str(row[0]), str(row[1]), int(row[2]), float(row[3]))

    def set_lease(self, conn: Any, tenant: str, exact_key: str, lease: Lease) -> None:
        self._x(conn,
            "INSERT OR REPLACE INTO leases (tenant, exact_key, holder, host, pid, expires) VALUES (?, ?, ?, ?, ?, ?)",
            (tenant, exact_key, lease.holder, lease.host, lease.pid, lease.expires),
        )

    def drop_lease(self, conn: Any, tenant: str, exact_key: str, holder: str) -> None:
        self._x(conn, "DELETE FROM leases WHERE tenant = ? AND exact_key = ? AND holder = ?", (tenant, exact_key, holder))


class MetaDB(MetaQueries):
    """One process's connection to ``bank.sqlite``.

    ``read_only``: open with SQLite's ``mode=ro`` (falling back to ``immutable=1`` where SQLite cannot even create
    its shared-memory file next to a read-only database); every write then fails with ``SQLITE_READONLY``.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0, read_only: bool = False) -> None:
        self.path = path
        self.busy_timeout_s = float(busy_timeout_s)
        self.read_only = read_only
        self.found_schema = True
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._inode: tuple[int, int] | None = None

    # -- connection ------------------------------------------------------------------------------

    def open(self, *, check: bool = True) -> None:
        """Connect, create the schema if needed (``found_schema`` tells whether it was there) and check the format
        version.

        With ``check``, runs ``PRAGMA quick_check`` and raises :class:`DatabaseCorrupt` on damage. Raises
        :class:`CacheError` if the database was written by another format version; lets corruption errors (see
        :func:`is_corruption`) through for the bank to recover from.
        """
        self.close()
        conn = self._connect()
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            if not self.read_only:
                self._use_wal(conn)
                conn.execute("PRAGMA synchronous = NORMAL")
            if check:
                result = [r[0] for r in conn.execute("PRAGMA quick_check(5)")]
                if result != ["ok"]:
                    raise DatabaseCorrupt("; ".join(map(str, result)))
            self.found_schema = _has_table(conn, "meta")
            if self.read_only:
                if not self.found_schema or not _has_table(conn, "entries"):
                    raise CacheError(f"cache database {self.path} is empty and the cache directory is read-only")
                version = self.get_meta("format_version", conn)
                if str(version) == str(FORMAT_VERSION) and not _has_column(conn, "entries", "content_key"):
                    raise CacheError(f"cache database {self.path} was written by an older carnator and the cache "
                                     "directory is read-only: open it once writable to bring it up to date")
            else:
                version = self._init_schema(conn)
        except UnicodeDecodeError as exc:
            conn.close()
            raise DatabaseCorrupt(f"damaged schema text ({exc.reason} at byte {exc.start})") from None
        except BaseException:
            conn.close()
            raise
        if str(version) != str(FORMAT_VERSION):
            conn.close()
            raise CacheError(
                f"cache database {self.path} uses format version {version}, this carnator reads version "
                f"{FORMAT_VERSION}; use another cache directory or delete this one"
            )
        self._conn = conn
        self._pid = os.getpid()
        self._inode = self._stat_inode()

    def _connect(self) -> sqlite3.Connection:
        kw: dict[str, Any] = {"timeout": self.busy_timeout_s, "isolation_level": None, "check_same_thread": False}
        if not self.read_only:
            return sqlite3.connect(self.path, **kw)
        uri = "file:" + urllib.parse.quote(str(self.path))
        conn = sqlite3.connect(uri + "?mode=ro", uri=True, **kw)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            # A WAL database in a directory we cannot write: SQLite cannot create its -shm file. Nobody can be
            # writing it either, so read the file as it stands (a -wal left behind by a crash is not read).
            conn.close()
            return sqlite3.connect(uri + "?immutable=1", uri=True, **kw)

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """Put the database in WAL mode (a property of the file, so only its first opener converts it).

        The conversion needs exclusive access and SQLite does not run the busy handler for it: processes
        opening a fresh cache together get "database is locked" at once. So read the mode first (no lock
        once the file is WAL) and retry the conversion with backoff within ``busy_timeout_s``.
        """
        def convert() -> str:
            mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
            if mode != "wal":
                try:
                    mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) and "busy" not in str(exc):
                        raise
            return mode

        mode = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda got: got != "wal"), stop=tenacity.stop_after_delay(self.busy_timeout_s),
            wait=tenacity.wait_exponential(multiplier=0.005, max=0.2),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome is not None else None)(convert)
        if mode != "wal":
            raise CacheError(f"cache database {self.path} cannot use WAL mode (got {mode!r}; another process holds it)")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise CacheError("the cache bank is closed")
        return self._conn

    def is_stale(self) -> bool:
        """True after a fork, or when ``bank.sqlite`` is no longer the file this connection opened."""
        return self._conn is None or self._pid != os.getpid() or self._stat_inode() != self._inode

    def _stat_inode(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino)

    def _init_schema(self, conn: sqlite3.Connection) -> str:
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = None
            if _has_table(conn, "meta"):  # another format's database is left exactly as it is
                version = self.get_meta("format_version", conn)
                if version != str(FORMAT_VERSION):
                    conn.execute("ROLLBACK")
                    return str(version)
                found = self.get_meta("schema_version", conn)
            migrate(conn.execute, "sqlite", found)
            conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('format_version', ?)", (str(FORMAT_VERSION),)
            )
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', ?)", (secrets.token_hex(8),))
            version = conn.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0]
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return str(version)

    # -- transactions ----------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``): committed on success, rolled back on error."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every query inside sees one consistent snapshot."""
        conn = self.conn
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def _c(self, conn: Any) -> Any:
        return self.conn if conn is None else conn

    def sync_state(self, conn: sqlite3.Connection) -> SyncState:
        seqs = dict(conn.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
        oldest = conn.execute("SELECT min(seq) FROM removals").fetchone()[0]
        return SyncState(
            epoch=self.get_meta("epoch", conn) or "",
            entry_seq=int(seqs.get("entries", 0)),
            removal_seq=int(seqs.get("removals", 0)),
            oldest_logged_removal=None if oldest is None else int(oldest),
        )


def count_entries(path: Path) -> int | None:
    """How many rows the (possibly damaged) database at ``path`` still shows, or None when it cannot be read."""
    try:
        uri = "file:" + urllib.parse.quote(str(path)) + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=0.5)
        try:
            return int(conn.execute("SELECT count(*) FROM entries").fetchone()[0])
        finally:
            conn.close()
    except Exception:  # noqa: BLE001 - a damaged file may fail in any way; "unknown" is the answer
        return None


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(r[1] == column for r in conn.execute(f"PRAGMA table_info({table})"))


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def _layout(text: str) -> dict[str, Any]:
    return json.loads(text)


def _to_meta(row: Sequence[Any]) -> EntryMeta:
    (id_, tenant, ck, ek, prompt, neg, seed, created, last_used, use_count, steps_saved, nbytes, emb, extra, lay, content) = row
    return EntryMeta(
        id=str(id_),
        tenant=str(tenant),
        compat_key=str(ck),
        exact_key=ek,
        prompt=str(prompt),
        negative_prompt=neg,
        seed=None if seed is None else int(seed),
        created=float(created),
        last_used=float(last_used),
        use_count=int(use_count),
        steps_saved=float(steps_saved),
        nbytes=int(nbytes),
        embedding=np.frombuffer(emb, dtype="<f4").astype(np.float32),
        extra=json.loads(extra) if extra else {},
        tensor_names=tuple(sorted(_layout(lay)["tensors"])),
        content_key=content,
    )


def dump_extra(extra: Any) -> str:
    """``extra`` as the JSON stored in its row (numpy / torch values become plain numbers and lists)."""
    return json.dumps(extra, sort_keys=True, default=_json_default)


def _json_default(value: Any) -> Any:
    """Let numpy / torch scalars and arrays through ``json.dumps`` in ``extra``."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"extra holds a {type(value).__name__}, which is not JSON-serializable")
