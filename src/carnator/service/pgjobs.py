"""The job table of ``carnator serve`` in PostgreSQL: :class:`PostgresJobStore`, used with ``--store postgresql://...``.

Its tables (``carnator_jobs``, ``carnator_job_events``) live in the same database and schema as the
:class:`~carnator.cache.shared.SharedStore` (``?schema=NAME``, default ``carnator``), beside the cache's own tables.
It keeps every rule of :mod:`carnator.service.jobs`:

* ``claim`` takes the tenant's oldest queued row with ``SELECT ... FOR UPDATE SKIP LOCKED``: two claimers (threads or
  processes) never take one job, and neither waits on the other's row.
* ``finish`` locks the job's row (``FOR UPDATE``), checks the attempt, publishes the videos, then updates and
  commits: a stale attempt changes nothing, and a job completes at most once.
* ``submit`` checks the queue limits and the idempotency key and inserts under one transaction-scoped advisory lock, so
  the limits hold across processes.

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
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..cache.shared import parse_store_url
from ..errors import CacheError, CarnatorError
from .jobs import (
    _COLUMNS,
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    STATUSES,
    TERMINAL,
    IdempotencyConflict,
    Job,
    JobStoreError,
    JobStoreUnavailable,
    QueueFull,
    SqliteJobStore,
    VideoFiles,
    _fsync_dir,
    new_job_id,
)

log = logging.getLogger("carnator.service")
R = TypeVar("R")

JOBS, EVENTS = "carnator_jobs", "carnator_job_events"

_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS {JOBS} (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT UNIQUE NOT NULL,
        tenant TEXT NOT NULL,
        status TEXT NOT NULL,
        params TEXT NOT NULL,
        idempotency_key TEXT,
        request_hash TEXT,
        progress INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
        worker TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        started_at DOUBLE PRECISION,
        completed_at DOUBLE PRECISION,
        error TEXT,
        stats TEXT,
        videos TEXT
    )""",
    f"CREATE UNIQUE INDEX IF NOT EXISTS {JOBS}_idempotency ON {JOBS} (tenant, idempotency_key) "
    "WHERE idempotency_key IS NOT NULL",
    f"CREATE INDEX IF NOT EXISTS {JOBS}_queue ON {JOBS} (status, tenant, seq)",
    f"CREATE INDEX IF NOT EXISTS {JOBS}_tenant ON {JOBS} (tenant, seq)",
    f"""CREATE TABLE IF NOT EXISTS {EVENTS} (
        seq BIGSERIAL PRIMARY KEY,
        job_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        at DOUBLE PRECISION NOT NULL,
        detail TEXT
    )""",
    f"CREATE INDEX IF NOT EXISTS {EVENTS}_job ON {EVENTS} (job_id, seq)",
)


def _key(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class PostgresJobStore(VideoFiles):
    """Jobs in PostgreSQL (``url``: the ``--store`` URL), finished videos in ``video_dir``.

    Every thread may call every method (one connection, used under a lock). Several stores (processes) may share the
    tables: claims, attempts and limits stay correct; ``recover`` assumes no other server is running (see
    :func:`hold_jobs`). A server's store takes its ``server_lock``: every call first checks that the server still
    holds its job table (:meth:`ServerLock.check`), and is refused once it has lost it.
    """

    def __init__(self, url: str, video_dir: str | os.PathLike[str], *, connect_timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.time, server_lock: ServerLock | None = None):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise CarnatorError("a postgresql:// job table needs psycopg: pip install 'carnator[scale]'") from None
        try:
            self._conninfo, self.schema = parse_store_url(url)
        except CacheError as exc:
            raise JobStoreError(str(exc)) from None
        self.video_dir = Path(video_dir).expanduser()
        self.video_dir.mkdir(parents=True, exist_ok=True)
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._conn: Any = None
        self._closed = False
        self._server_lock = server_lock
        self._submit_key = _key(f"carnator-jobs-submit:{self.schema}")
        with self._lock:
            self._connect()  # a wrong URL or a down database fails here, at start-up

    # ---- plumbing ----------------------------------------------------------------------------
    def _connect(self) -> Any:
        import psycopg

        if self._closed:
            raise JobStoreError("the job store is closed")
        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            conn = psycopg.connect(self._conninfo, connect_timeout=max(1, int(self.connect_timeout_s)), autocommit=True)
        except psycopg.Error as exc:
            raise JobStoreUnavailable(f"cannot connect to the job table's PostgreSQL: {_first_line(exc)}") from None
        try:
            with conn.transaction():
                # the SharedStore's schema lock: concurrent CREATE ... IF NOT EXISTS can otherwise collide
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_key(f"carnator:{self.schema}"),))
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self.schema}")
                conn.execute(f"SET search_path TO {self.schema}")
                for stmt in _SCHEMA:
                    conn.execute(stmt)
            conn.execute(f"SET search_path TO {self.schema}")
        except psycopg.Error as exc:
            conn.close()
            raise JobStoreUnavailable(f"the job table's PostgreSQL: {_first_line(exc)}") from None
        self._conn = conn
        return conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction on this store's connection; PostgreSQL unreachable -> :class:`JobStoreUnavailable` (the
        connection is dropped and the next call reconnects)."""
        import psycopg

        with self._lock:
            if self._server_lock is not None:
                self._server_lock.check()  # no change to the jobs without holding the job table
            conn = self._connect()
            try:
                with conn.transaction():
                    yield conn
            except psycopg.OperationalError as exc:
                if conn.closed or conn.broken:
                    self._conn = None
                    with contextlib.suppress(Exception):
                        conn.close()
                    raise JobStoreUnavailable(f"lost the job table's PostgreSQL: {_first_line(exc)}") from None
                raise JobStoreError(f"job table: {_first_line(exc)}") from None
            except psycopg.Error as exc:
                raise JobStoreError(f"job table: {_first_line(exc)}") from None

    def _log(self, c: Any, job_id: str, kind: str, attempt: int, detail: str | None = None) -> None:
        c.execute(f"INSERT INTO {EVENTS} (job_id, kind, attempt, at, detail) VALUES (%s, %s, %s, %s, %s)",
                  (job_id, kind, attempt, self._clock(), detail))

    def _get(self, c: Any, job_id: str, tenant: str | None = None, *, lock: bool = False) -> Job | None:
        where, args = "id = %s", [job_id]
        if tenant is not None:
            where, args = where + " AND tenant = %s", [*args, tenant]
        row = c.execute(f"SELECT {_COLUMNS} FROM {JOBS} WHERE {where}{' FOR UPDATE' if lock else ''}", args).fetchone()
        return None if row is None else SqliteJobStore._job(row)

    # ---- the protocol ------------------------------------------------------------------------
    def submit(self, tenant: str, params: Mapping[str, Any], *, idempotency_key: str | None = None,
               request_hash: str | None = None, max_queued: int | None = None,
               max_queued_per_tenant: int | None = None) -> tuple[Job, bool]:
        with self._tx() as c:
            c.execute("SELECT pg_advisory_xact_lock(%s)", (self._submit_key,))  # limits and keys: one submitter at a time
            if idempotency_key is not None:
                row = c.execute(f"SELECT {_COLUMNS}, request_hash FROM {JOBS} WHERE tenant = %s AND idempotency_key = %s",
                                (tenant, idempotency_key)).fetchone()
                if row is not None:
                    if row[-1] != request_hash:
                        raise IdempotencyConflict("this Idempotency-Key was used with a different request")
                    return SqliteJobStore._job(row[:-1]), False
            if max_queued is not None:
                n = c.execute(f"SELECT count(*) FROM {JOBS} WHERE status = %s", (QUEUED,)).fetchone()[0]
                if n >= max_queued:
                    raise QueueFull("queue_full", f"the queue is full ({max_queued} jobs waiting)", n)
            if max_queued_per_tenant is not None:
                n = c.execute(f"SELECT count(*) FROM {JOBS} WHERE status = %s AND tenant = %s", (QUEUED, tenant)).fetchone()[0]
                if n >= max_queued_per_tenant:
                    raise QueueFull("tenant_limit", f"you have {n} jobs waiting, the most one caller may queue", n)
            job = Job(id=new_job_id(), tenant=tenant, status=QUEUED, params=dict(params), created_at=self._clock(),
                      idempotency_key=idempotency_key)
            c.execute(f"INSERT INTO {JOBS} (id, tenant, status, params, idempotency_key, request_hash, created_at) "
                      "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                      (job.id, tenant, QUEUED, json.dumps(job.params), idempotency_key, request_hash, job.created_at))
            self._log(c, job.id, "submitted", 0)
            return job, True

    def get(self, tenant: str, job_id: str) -> Job | None:
        with self._tx() as c:
            return self._get(c, job_id, tenant)

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None, order: str = "desc") -> tuple[list[Job], bool]:
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        with self._tx() as c:
            args: list[Any] = [tenant]
            where = "tenant = %s"
            if after is not None:
                row = c.execute(f"SELECT seq FROM {JOBS} WHERE id = %s AND tenant = %s", (after, tenant)).fetchone()
                if row is None:
                    return [], False
                where += f" AND seq {op} %s"
                args.append(row[0])
            rows = c.execute(f"SELECT {_COLUMNS} FROM {JOBS} WHERE {where} ORDER BY seq {direction} LIMIT %s",
                             (*args, limit + 1)).fetchall()
        return [SqliteJobStore._job(r) for r in rows[:limit]], len(rows) > limit

    def queued_tenants(self) -> list[str]:
        with self._tx() as c:
            return [r[0] for r in c.execute(f"SELECT DISTINCT tenant FROM {JOBS} WHERE status = %s ORDER BY tenant", (QUEUED,))]

    def claim(self, tenant: str, worker: str) -> Job | None:
        with self._tx() as c:
            row = c.execute(f"SELECT id FROM {JOBS} WHERE status = %s AND tenant = %s ORDER BY seq LIMIT 1 "
                            "FOR UPDATE SKIP LOCKED", (QUEUED, tenant)).fetchone()
            if row is None:
                return None
            c.execute(f"UPDATE {JOBS} SET status = %s, attempts = attempts + 1, worker = %s, started_at = %s, progress = 0 "
                      "WHERE id = %s", (IN_PROGRESS, worker, self._clock(), row[0]))
            job = self._get(c, row[0])
            assert job is not None
            self._log(c, job.id, "claimed", job.attempts, worker)
            return job

    def update_progress(self, job_id: str, attempt: int, progress: int) -> bool:
        try:
            with self._tx() as c:
                row = c.execute(f"UPDATE {JOBS} SET progress = CASE WHEN status = %s AND attempts = %s THEN %s "
                                "ELSE progress END WHERE id = %s RETURNING cancel_requested",
                                (IN_PROGRESS, attempt, int(progress), job_id)).fetchone()
            return bool(row and row[0])
        except JobStoreError as exc:  # bookkeeping never stops a job
            log.debug("could not record the progress of %s: %s", job_id, exc)
            return False

    def finish(self, job_id: str, attempt: int, status: str, *, stats: Mapping[str, Any] | None = None,
               error: Mapping[str, str] | None = None, videos: Mapping[str, Path] | None = None) -> bool:
        if status not in TERMINAL:
            raise ValueError(f"finish takes one of {TERMINAL}, not {status!r}")
        try:
            with self._tx() as c:
                job = self._get(c, job_id, lock=True)  # held until commit: no other finish, requeue or cancel between
                if job is None or job.status != IN_PROGRESS or job.attempts != attempt:
                    self._discard(videos, job_id)
                    return False
                published = []
                if status == COMPLETED:
                    for variant, staged in (videos or {}).items():
                        self._publish(Path(staged), self.video_dir / f"{job_id}.{variant}")
                        published.append(variant)
                    if published:
                        _fsync_dir(self.video_dir)
                else:
                    self._discard(videos, job_id)
                c.execute(f"UPDATE {JOBS} SET status = %s, progress = %s, completed_at = %s, stats = %s, error = %s, "
                          "videos = %s WHERE id = %s",
                          (status, 100 if status == COMPLETED else job.progress, self._clock(),
                           json.dumps(dict(stats)) if stats is not None else None,
                           json.dumps(dict(error)) if error else None, json.dumps(published), job_id))
                self._log(c, job_id, status, attempt)
                return True
        except JobStoreError:
            self._discard(videos)
            raise

    def requeue(self, job_id: str, attempt: int, *, count_attempt: bool = False) -> bool:
        with self._tx() as c:
            cur = c.execute(f"UPDATE {JOBS} SET status = %s, progress = 0, worker = NULL, started_at = NULL, "
                            "attempts = attempts - %s WHERE id = %s AND status = %s AND attempts = %s",
                            (QUEUED, 0 if count_attempt else 1, job_id, IN_PROGRESS, attempt))
            if cur.rowcount:
                self._log(c, job_id, "requeued", attempt, "attempt counted" if count_attempt else "drained")
            return bool(cur.rowcount)

    def cancel(self, tenant: str, job_id: str) -> Job | None:
        with self._tx() as c:
            job = self._get(c, job_id, tenant, lock=True)
            if job is None:
                return None
            if job.status == QUEUED:
                c.execute(f"UPDATE {JOBS} SET status = %s, completed_at = %s, cancel_requested = TRUE WHERE id = %s",
                          (CANCELLED, self._clock(), job_id))
                self._log(c, job_id, CANCELLED, job.attempts, "while queued")
            elif job.status == IN_PROGRESS and not job.cancel_requested:
                c.execute(f"UPDATE {JOBS} SET cancel_requested = TRUE WHERE id = %s", (job_id,))
                self._log(c, job_id, "cancel_requested", job.attempts)
            return self._get(c, job_id)

    def recover(self, max_attempts: int) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"requeued": [], "failed": [], "cancelled": []}
        with self._tx() as c:
            rows = c.execute(f"SELECT id, attempts, cancel_requested FROM {JOBS} WHERE status = %s ORDER BY seq FOR UPDATE",
                             (IN_PROGRESS,)).fetchall()
            now = self._clock()
            for jid, attempts, cancel in rows:
                if cancel:
                    c.execute(f"UPDATE {JOBS} SET status = %s, completed_at = %s WHERE id = %s", (CANCELLED, now, jid))
                    self._log(c, jid, CANCELLED, attempts, "cancellation asked before the server stopped")
                    out["cancelled"].append(jid)
                elif attempts >= max_attempts:
                    err = {"type": "interrupted", "message": f"the server stopped during this job {attempts} time(s); "
                                                             "it is not tried again"}
                    c.execute(f"UPDATE {JOBS} SET status = %s, completed_at = %s, error = %s WHERE id = %s",
                              (FAILED, now, json.dumps(err), jid))
                    self._log(c, jid, FAILED, attempts, "attempts used up")
                    out["failed"].append(jid)
                else:
                    c.execute(f"UPDATE {JOBS} SET status = %s, progress = 0, worker = NULL, started_at = NULL WHERE id = %s",
                              (QUEUED, jid))
                    self._log(c, jid, "requeued", attempts, "the server stopped during this attempt")
                    out["requeued"].append(jid)
        self._sweep_staging()
        return out

    def counts(self) -> dict[str, int]:
        with self._tx() as c:
            got = dict(c.execute(f"SELECT status, count(*) FROM {JOBS} GROUP BY status").fetchall())
        return {s: int(got.get(s, 0)) for s in STATUSES}

    def queued_count(self, tenant: str) -> int:
        with self._tx() as c:
            return int(c.execute(f"SELECT count(*) FROM {JOBS} WHERE status = %s AND tenant = %s", (QUEUED, tenant)).fetchone()[0])

    def history(self, job_id: str) -> list[dict[str, Any]]:
        with self._tx() as c:
            rows = c.execute(f"SELECT kind, attempt, at, detail FROM {EVENTS} WHERE job_id = %s ORDER BY seq", (job_id,)).fetchall()
        return [{"kind": k, "attempt": a, "at": t, "detail": d} for k, a, t, d in rows]

    def healthy(self) -> str | None:
        try:
            with self._tx() as c:
                c.execute("SELECT 1")
        except JobStoreError as exc:
            return str(exc)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None


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
        raise JobStoreUnavailable(self.lost)

    def check(self) -> None:
        """Return while this server holds its job table (taking the lock again after a lost connection);
        :class:`JobStoreUnavailable` when it cannot tell (PostgreSQL down) or has lost it."""
        import psycopg

        with self._lock:
            if self.lost is not None:
                raise JobStoreUnavailable(self.lost)
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
