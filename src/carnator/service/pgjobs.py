"""The job table of ``carnator serve`` in PostgreSQL: :class:`PostgresJobStore`, used with ``--store postgresql://...``.

Its tables (``carnator_jobs``, ``carnator_job_events``, ``carnator_jobs_meta``) live in the same database and schema
as the :class:`~carnator.cache.shared.SharedStore` (``?schema=NAME``, default ``carnator``), beside the cache's own
tables. The store itself is :class:`~carnator.service.jobs.SqlJobStore`, with SQLite's rules and code; this module adds
how it connects and fails, and the one-server lock.

Videos of finished jobs are files, as with SQLite: ``<video_dir>/<job>.<variant>``, where ``carnator serve`` passes
its ``--cache-dir``/``videos`` (the ingress's local disk; the job table is shared, the files are not). One
``carnator serve`` uses a database schema at a time (:class:`ServerLock`, a session advisory lock taken again when
PostgreSQL restarts), so ``recover`` at start-up never requeues a live server's jobs; a server that lost the lock to
another one while PostgreSQL restarted stops taking jobs and says so.

PostgreSQL unreachable: calls raise :class:`~carnator.service.jobs.JobStoreUnavailable` (``update_progress`` returns
False), ``healthy`` says why, and the next call reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ..cache.shared import parse_store_url
from ..errors import CacheError, CarnatorError
from .jobs import JobStoreError, JobStoreUnavailable, JobTableLost, SqlJobStore, migrate

log = logging.getLogger("carnator.service")


def _key(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _first_line(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    return (str(inner).strip().splitlines() or [type(inner).__name__])[0]


def sqlalchemy_url(conninfo: str) -> str:
    """A libpq URL as SQLAlchemy's psycopg 3 dialect takes it."""
    scheme, rest = conninfo.split("://", 1)
    return f"postgresql+psycopg://{rest}"


class PostgresJobStore(SqlJobStore):
    """Jobs in PostgreSQL (``url``: the ``--store`` URL), finished videos in ``video_dir``.

    Several stores (processes) may share the tables: claims, attempts and limits stay correct; ``recover`` assumes no
    other server is running (see :func:`hold_jobs`). A server's store takes its ``server_lock``: every call first
    checks that the server still holds its job table (:meth:`ServerLock.check`), and is refused once it has lost it.
    """

    dialect = "postgresql"

    def __init__(self, url: str, video_dir: str | os.PathLike[str], *, connect_timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.time, server_lock: ServerLock | None = None):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise CarnatorError("a postgresql:// job table needs psycopg: pip install 'carnator[scale]'") from None
        try:
            conninfo, self.schema = parse_store_url(url)
        except CacheError as exc:
            raise JobStoreError(str(exc)) from None
        super().__init__(Path(video_dir).expanduser(), clock=clock)
        self.connect_timeout_s = connect_timeout_s
        self._server_lock = server_lock
        self._submit_key = _key(f"carnator-jobs-submit:{self.schema}")
        self._engine = sa.create_engine(sqlalchemy_url(conninfo), poolclass=sa.pool.NullPool,
                                        connect_args={"connect_timeout": max(1, int(connect_timeout_s))})
        self._tx(lambda c: None)  # a wrong URL or a down database fails here, at start-up

    def _open(self) -> sa.Connection:
        try:
            conn = self._engine.connect()
        except sa.exc.DBAPIError as exc:
            raise JobStoreUnavailable(f"cannot connect to the job table's PostgreSQL: {_first_line(exc)}") from None
        try:
            with conn.begin():
                # the SharedStore's schema lock: concurrent CREATE ... IF NOT EXISTS can otherwise collide
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _key(f"carnator:{self.schema}")})
                conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {self.schema}")
                conn.exec_driver_sql(f"SET search_path TO {self.schema}")  # the session's, past this transaction
                migrate(conn, self.tables)
        except BaseException:
            conn.close()
            raise
        return conn

    def _failed(self, exc: BaseException, *, critical: bool, last: bool) -> None:
        conn = self._conn
        state = str(getattr(getattr(exc, "orig", None), "sqlstate", None) or "")
        if isinstance(exc, sa.exc.DBAPIError) and (exc.connection_invalidated or state[:2] in ("", "08")
                                                   or state.startswith("57P")):  # no connection, or the server going
            self._conn = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            raise JobStoreUnavailable(f"lost the job table's PostgreSQL: {_first_line(exc)}") from None
        super()._failed(exc, critical=critical, last=last)

    def _serialise_submit(self, c: sa.Connection) -> None:
        c.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._submit_key})

    def _before(self) -> None:
        if self._server_lock is not None:
            self._server_lock.check()  # no change to the jobs without holding the job table

    def _engine_dispose(self) -> None:
        self._engine.dispose()


class ServerLock:
    """One ``carnator serve`` per database schema (its job table): a session advisory lock on a connection of its own.

    A PostgreSQL restart ends every session, and the lock with it: :meth:`check` (run by the job store before each
    transaction) notices the dead connection, reconnects and takes the lock again. Another server may have taken it
    first (started while this one had not reconnected yet): then this server has lost its job table for good (the other
    one requeued its running jobs at start-up), and every later :meth:`check` raises :class:`JobStoreUnavailable`
    saying so: it takes no more jobs and reports not ready until it is stopped.
    """

    def __init__(self, url: str, *, connect_timeout_s: float = 3.0) -> None:
        self._conninfo, self.schema = parse_store_url(url)
        self.connect_timeout_s = connect_timeout_s
        self._key = _key(f"carnator-serve:{self.schema}")
        self._lock = threading.Lock()
        self._conn: Any = None
        #: why this server no longer holds its job table (None while it does)
        self.lost: str | None = None
        with self._lock:
            self._take(first=True)

    def _take(self, *, first: bool) -> None:
        import psycopg

        try:
            conn = psycopg.connect(self._conninfo, connect_timeout=max(1, int(self.connect_timeout_s)), autocommit=True)
        except psycopg.Error as exc:
            if first:
                raise CarnatorError(f"--store: cannot connect to PostgreSQL for the job table: {_first_line(exc)}") from None
            raise JobStoreUnavailable(f"cannot connect to the job table's PostgreSQL: {_first_line(exc)}") from None
        try:
            conn.execute("SELECT set_config('application_name', %s, false)", (f"carnator serve pid {os.getpid()}",))
            if conn.execute("SELECT pg_try_advisory_lock(%s)", (self._key,)).fetchone()[0]:
                self._conn, conn = conn, None
                if not first:
                    log.warning("PostgreSQL is back: this server holds its job table (schema %s) again", self.schema)
                return
            other = conn.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.objid = %s AND l.granted AND l.database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database()) LIMIT 1", (self._key,)).fetchone()
        except psycopg.Error as exc:
            if first:
                raise CarnatorError(f"--store: the job table's PostgreSQL: {_first_line(exc)}") from None
            raise JobStoreUnavailable(f"the job table's PostgreSQL: {_first_line(exc)}") from None
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        who = other[0].removeprefix("carnator serve ") if other and other[0] else "pid ?"
        if first:
            raise CarnatorError(f"another carnator serve ({who}) uses the job table of this database (schema {self.schema})")
        self.lost = (f"another carnator serve ({who}) took this server's job table (schema {self.schema}) while "
                     "PostgreSQL was restarting: this server takes no more jobs; stop it")
        log.error("%s", self.lost)
        raise JobTableLost(self.lost)

    def check(self) -> None:
        """Return while this server holds its job table (taking the lock again after a lost connection);
        :class:`JobStoreUnavailable` when it cannot tell (PostgreSQL down) or has lost it."""
        import psycopg

        with self._lock:
            if self.lost is not None:
                raise JobTableLost(self.lost)
            if self._conn is not None:
                try:
                    self._conn.execute("SELECT 1")
                    return
                except psycopg.Error:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                    self._conn = None
            self._take(first=False)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None


@contextlib.contextmanager
def hold_jobs(url: str, *, connect_timeout_s: float = 3.0) -> Iterator[ServerLock]:
    """Hold the :class:`ServerLock` of ``url``'s schema while the server runs (released when the process ends,
    however); pass it to the :class:`PostgresJobStore` the server uses. :class:`CarnatorError` in one line when another
    server holds it or the database cannot be reached."""
    held = ServerLock(url, connect_timeout_s=connect_timeout_s)
    try:
        yield held
    finally:
        held.close()
