"""The job table of ``carnator serve``: the :class:`JobStore` protocol and :class:`SqliteJobStore`, its local
implementation (SQLite in WAL mode beside the cache, videos of finished jobs in ``videos/``); the PostgreSQL one,
used with ``--store postgresql://...``, is :class:`carnator.service.pgjobs.PostgresJobStore`.

Nothing else in the service touches the database or the video files: the worker and the HTTP layer call these
methods only, so a shared implementation (PostgreSQL + object storage, for several replicas) can take its place.

A job moves ``queued -> in_progress -> completed | failed | cancelled``. Rules every implementation keeps:

* Every read and change is scoped by tenant: a job of another tenant reads as missing.
* ``claim`` is atomic: two workers never claim one job. Each claim starts a new *attempt* (``attempts + 1``), and
  ``finish``, ``requeue`` and ``update_progress`` name the attempt they belong to: a stale attempt (one that a
  restart requeued) changes nothing, so a job completes at most once.
* ``recover`` (at start-up, when no worker of the previous run is alive) requeues jobs left ``in_progress`` while
  they have attempts left, and fails the others with a reason; a job whose cancellation was asked is cancelled.
* Videos are published (durably) before the row that says the job completed is committed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

log = logging.getLogger("carnator.service")
R = TypeVar("R")

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
TERMINAL = (COMPLETED, FAILED, CANCELLED)
#: the video variants a finished job keeps
VARIANTS = {"mp4": "video/mp4", "gif": "image/gif"}

DB_FILE = "jobs.sqlite"
VIDEO_DIR = "videos"
RESERVE_FILE = "jobs.reserve"
#: bytes held back on the job table's disk, released when a full disk would stop a job's state change
RESERVE_BYTES = 1 << 20
SCHEMA_VERSION = "1"


class JobStoreError(Exception):
    """Base of the job store's errors."""


class QueueFull(JobStoreError):
    """The queue (``reason="queue_full"``) or the tenant's share of it (``"tenant_limit"``) is full."""

    def __init__(self, reason: str, message: str, queued: int):
        super().__init__(message)
        self.reason, self.queued = reason, queued


class IdempotencyConflict(JobStoreError):
    """An ``Idempotency-Key`` reused with a different request."""


class StorageFull(JobStoreError):
    """The job table's disk is full: nothing new is accepted until room is made."""


class JobStoreUnavailable(JobStoreError):
    """The job table's database cannot be reached (PostgreSQL down): nothing is accepted until it is back."""


@dataclass
class Job:
    """One video job, as the store keeps it."""

    id: str
    tenant: str
    status: str
    params: dict[str, Any]
    created_at: float
    progress: int = 0
    attempts: int = 0
    cancel_requested: bool = False
    started_at: float | None = None
    completed_at: float | None = None
    error: dict[str, str] | None = None
    stats: dict[str, Any] | None = None
    videos: list[str] = field(default_factory=list)
    idempotency_key: str | None = None
    worker: str | None = None

    @property
    def policy(self) -> str:
        return str(self.params.get("policy", "carnator"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class JobStore(Protocol):
    """Where jobs live between submission and download (see the module's rules)."""

    def submit(self, tenant: str, params: Mapping[str, Any], *, idempotency_key: str | None = None,
               request_hash: str | None = None, max_queued: int | None = None,
               max_queued_per_tenant: int | None = None) -> tuple[Job, bool]:
        """Queue a job; ``(job, created)``. With an ``idempotency_key`` already used by ``tenant``: the earlier job and
        False when ``request_hash`` matches, :class:`IdempotencyConflict` otherwise. :class:`QueueFull` past either
        limit (checked and inserted atomically); :class:`StorageFull` when the disk is full."""

    def get(self, tenant: str, job_id: str) -> Job | None:
        """The tenant's job, or None (also for another tenant's)."""

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None, order: str = "desc") -> tuple[list[Job], bool]:
        """The tenant's jobs by submission order (``desc``: newest first), starting after the job ``after``; the page
        and whether more follow."""

    def queued_tenants(self) -> list[str]:
        """Tenants with queued jobs, sorted."""

    def claim(self, tenant: str, worker: str) -> Job | None:
        """Atomically take the tenant's oldest queued job (``in_progress``, a new attempt), or None."""

    def update_progress(self, job_id: str, attempt: int, progress: int) -> bool:
        """Record progress (0-100) of an attempt (bookkeeping: never raises); whether a cancellation was asked."""

    def finish(self, job_id: str, attempt: int, status: str, *, stats: Mapping[str, Any] | None = None,
               error: Mapping[str, str] | None = None, videos: Mapping[str, Path] | None = None) -> bool:
        """End an attempt: ``completed`` (publishing ``videos``: variant -> a staged file, see :meth:`staging_path`),
        ``failed`` or ``cancelled``. False (and nothing changed) when the attempt is stale."""

    def requeue(self, job_id: str, attempt: int, *, count_attempt: bool = False) -> bool:
        """Put an attempt's job back in the queue (a server draining for shutdown: the attempt is not counted)."""

    def cancel(self, tenant: str, job_id: str) -> Job | None:
        """Cancel a queued job at once, or ask an in-progress one to stop; the job after that, None when missing."""

    def recover(self, max_attempts: int) -> dict[str, list[str]]:
        """Start-up: jobs left in progress are requeued, failed (attempts used up) or cancelled (asked); their ids."""

    def counts(self) -> dict[str, int]:
        """Jobs per status, over every tenant (for the operator's metrics; never shown to a tenant)."""

    def queued_count(self, tenant: str) -> int:
        """The tenant's queued jobs."""

    def staging_path(self, job_id: str, variant: str) -> Path:
        """A path to write a finished job's video to before :meth:`finish` publishes it."""

    def video_path(self, tenant: str, job_id: str, variant: str) -> Path | None:
        """The published video of the tenant's completed job, or None."""

    def history(self, job_id: str) -> list[dict[str, Any]]:
        """The job's audit log: submitted, claimed (attempt), progress never, requeued, finished (status)."""

    def healthy(self) -> str | None:
        """None when the store can take new jobs; else why not (one line)."""

    def close(self) -> None:
        """Release the store."""


_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT UNIQUE NOT NULL,
        tenant TEXT NOT NULL,
        status TEXT NOT NULL,
        params TEXT NOT NULL,
        idempotency_key TEXT,
        request_hash TEXT,
        progress INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        worker TEXT,
        created_at REAL NOT NULL,
        started_at REAL,
        completed_at REAL,
        error TEXT,
        stats TEXT,
        videos TEXT
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (status, tenant, seq)",
    "CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, seq)",
    """CREATE TABLE IF NOT EXISTS job_log (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        at REAL NOT NULL,
        detail TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS job_log_job ON job_log (job_id, seq)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
]

_COLUMNS = ("id, tenant, status, params, progress, attempts, cancel_requested, started_at, completed_at, error, stats, "
            "videos, idempotency_key, worker, created_at")


def request_hash(body: Mapping[str, Any]) -> str:
    """The hash an idempotent replay must match: the request as the caller sent it."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def new_job_id() -> str:
    return f"video_{uuid.uuid4().hex}"


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.OperationalError) and ("full" in str(exc).lower())


class VideoFiles:
    """Finished videos as files in ``video_dir``: ``<job>.<variant>``, staged as ``.<job>.<rand>.part.<variant>`` and
    published by an fsynced rename before the row saying the job completed commits (both job stores)."""

    video_dir: Path

    def staging_path(self, job_id: str, variant: str) -> Path:
        if variant not in VARIANTS:
            raise ValueError(f"unknown video variant {variant!r}")
        return self.video_dir / f".{job_id}.{uuid.uuid4().hex[:8]}.part.{variant}"

    def video_path(self, tenant: str, job_id: str, variant: str) -> Path | None:
        job = self.get(tenant, job_id)  # type: ignore[attr-defined]
        if job is None or job.status != COMPLETED or variant not in job.videos:
            return None
        path = self.video_dir / f"{job_id}.{variant}"
        return path if path.is_file() else None

    @staticmethod
    def _publish(staged: Path, final: Path) -> None:
        with open(staged, "rb") as f:
            os.fsync(f.fileno())
        staged.replace(final)

    def _discard(self, videos: Mapping[str, Path] | None, job_id: str | None = None) -> None:
        """Remove staged videos (and, for ``job_id``, whatever its encoders left half-written)."""
        paths = [Path(p) for p in (videos or {}).values()]
        if job_id is not None:
            paths += list(self.video_dir.glob(f".{job_id}.*")) + list(self.video_dir.glob(f"..{job_id}.*"))
        for p in paths:
            with contextlib.suppress(OSError):
                p.unlink()

    def _sweep_staging(self) -> None:
        """Staged videos of attempts that never finished (a killed server)."""
        for p in self.video_dir.glob(".*.part.*"):
            with contextlib.suppress(OSError):
                p.unlink()


class SqliteJobStore(VideoFiles):
    """Jobs in ``<root>/jobs.sqlite`` (WAL), finished videos in ``<root>/videos/<job>.<variant>``.

    ``root`` is the cache directory. One process serves a root at a time (``carnator serve`` holds a lock); within it
    every thread may call every method. A small reserve file (:data:`RESERVE_BYTES`) is kept beside the database: when
    the disk fills, it is released so that jobs already accepted can still be finished (failed, cancelled, requeued),
    while new submissions are refused (:class:`StorageFull`) until there is room again.
    """

    def __init__(self, root: str | os.PathLike[str], *, busy_timeout_s: float = 10.0, clock=time.time):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.video_dir = self.root / VIDEO_DIR
        self.video_dir.mkdir(exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._reserve = self.root / RESERVE_FILE
        self._low_space = False
        self.path = self.root / DB_FILE
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = FULL")  # a job said completed stays completed across a power loss
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        def create(c: sqlite3.Connection) -> None:
            for stmt in _SCHEMA:
                c.execute(stmt)
            c.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))

        self._tx(create, critical=True)
        self._ensure_reserve()

    # ---- plumbing ----------------------------------------------------------------------------
    def _tx(self, fn: Callable[[sqlite3.Connection], R], *, critical: bool = False) -> R:
        """``fn(conn)`` in one write transaction (BEGIN IMMEDIATE). On a full disk a ``critical`` write (a state change of
        an accepted job) releases the reserve and runs once more; others raise :class:`StorageFull`."""
        with self._lock:
            for last in (False, True):
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                    try:
                        out = fn(self._conn)
                        self._conn.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(sqlite3.Error):
                            self._conn.execute("ROLLBACK")
                        raise
                    if self._low_space:
                        self._ensure_reserve()
                    return out
                except (sqlite3.OperationalError, OSError) as exc:
                    if not _is_full(exc):
                        raise
                    self._low_space = True
                    if last or not critical or not self._release_reserve():
                        raise StorageFull(f"the disk of {self.root} is full") from exc
                    log.error("the disk of %s is full: released the job table's reserve to finish a job", self.root)
            raise AssertionError("unreachable")

    def _release_reserve(self) -> bool:
        try:
            self._reserve.unlink()
            return True
        except FileNotFoundError:
            return False

    def _ensure_reserve(self) -> None:
        """(Re)create the reserve when the disk has room for it; the store is low on space (refusing new jobs) while
        less than the reserve's size is free besides it."""
        try:
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        have = self._reserve.exists() and self._reserve.stat().st_size >= RESERVE_BYTES
        if not have:
            if free < 4 * RESERVE_BYTES:
                self._low_space = True
                return
            try:
                tmp = self._reserve.with_name(RESERVE_FILE + ".part")
                with open(tmp, "wb") as f:
                    f.write(b"\0" * RESERVE_BYTES)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(self._reserve)
            except OSError:
                self._low_space = True
                return
            free -= RESERVE_BYTES
        self._low_space = free < RESERVE_BYTES

    def _log(self, c: sqlite3.Connection, job_id: str, kind: str, attempt: int, detail: str | None = None) -> None:
        c.execute("INSERT INTO job_log (job_id, kind, attempt, at, detail) VALUES (?, ?, ?, ?, ?)",
                  (job_id, kind, attempt, self._clock(), detail))

    @staticmethod
    def _job(row) -> Job:
        (jid, tenant, status, params, progress, attempts, cancel, started, completed, error, stats, videos, key, worker,
         created) = row
        return Job(id=jid, tenant=tenant, status=status, params=json.loads(params), progress=int(progress),
                   attempts=int(attempts), cancel_requested=bool(cancel), started_at=started, completed_at=completed,
                   error=json.loads(error) if error else None, stats=json.loads(stats) if stats else None,
                   videos=json.loads(videos) if videos else [], idempotency_key=key, worker=worker, created_at=created)

    def _get(self, c: sqlite3.Connection, job_id: str) -> Job | None:
        row = c.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._job(row)

    # ---- the protocol ------------------------------------------------------------------------
    def submit(self, tenant: str, params: Mapping[str, Any], *, idempotency_key: str | None = None,
               request_hash: str | None = None, max_queued: int | None = None,
               max_queued_per_tenant: int | None = None) -> tuple[Job, bool]:
        if self._low_space:
            self._ensure_reserve()
            if self._low_space:
                raise StorageFull(f"the disk of {self.root} is full")
        def insert(c: sqlite3.Connection) -> tuple[Job, bool]:
            if idempotency_key is not None:
                row = c.execute(f"SELECT {_COLUMNS}, request_hash FROM jobs WHERE tenant = ? AND idempotency_key = ?",
                                (tenant, idempotency_key)).fetchone()
                if row is not None:
                    if row[-1] != request_hash:
                        raise IdempotencyConflict("this Idempotency-Key was used with a different request")
                    return self._job(row[:-1]), False
            if max_queued is not None:
                n = c.execute("SELECT count(*) FROM jobs WHERE status = ?", (QUEUED,)).fetchone()[0]
                if n >= max_queued:
                    raise QueueFull("queue_full", f"the queue is full ({max_queued} jobs waiting)", n)
            if max_queued_per_tenant is not None:
                n = c.execute("SELECT count(*) FROM jobs WHERE status = ? AND tenant = ?", (QUEUED, tenant)).fetchone()[0]
                if n >= max_queued_per_tenant:
                    raise QueueFull("tenant_limit", f"you have {n} jobs waiting, the most one caller may queue", n)
            job = Job(id=new_job_id(), tenant=tenant, status=QUEUED, params=dict(params), created_at=self._clock(),
                      idempotency_key=idempotency_key)
            c.execute("INSERT INTO jobs (id, tenant, status, params, idempotency_key, request_hash, created_at) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (job.id, tenant, QUEUED, json.dumps(job.params), idempotency_key, request_hash, job.created_at))
            self._log(c, job.id, "submitted", 0)
            return job, True

        return self._tx(insert)

    def get(self, tenant: str, job_id: str) -> Job | None:
        with self._lock:
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
        return None if row is None else self._job(row)

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None, order: str = "desc") -> tuple[list[Job], bool]:
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        with self._lock:
            args: list[Any] = [tenant]
            where = "tenant = ?"
            if after is not None:
                row = self._conn.execute("SELECT seq FROM jobs WHERE id = ? AND tenant = ?", (after, tenant)).fetchone()
                if row is None:
                    return [], False
                where += f" AND seq {op} ?"
                args.append(row[0])
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE {where} ORDER BY seq {direction} LIMIT ?",
                                      (*args, limit + 1)).fetchall()
        return [self._job(r) for r in rows[:limit]], len(rows) > limit

    def queued_tenants(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._conn.execute("SELECT DISTINCT tenant FROM jobs WHERE status = ? ORDER BY tenant", (QUEUED,))]

    def claim(self, tenant: str, worker: str) -> Job | None:
        def take(c: sqlite3.Connection) -> Job | None:
            row = c.execute("SELECT id FROM jobs WHERE status = ? AND tenant = ? ORDER BY seq LIMIT 1", (QUEUED, tenant)).fetchone()
            if row is None:
                return None
            c.execute("UPDATE jobs SET status = ?, attempts = attempts + 1, worker = ?, started_at = ?, progress = 0 "
                      "WHERE id = ?", (IN_PROGRESS, worker, self._clock(), row[0]))
            job = self._get(c, row[0])
            self._log(c, job.id, "claimed", job.attempts, worker)
            return job

        return self._tx(take, critical=True)

    def update_progress(self, job_id: str, attempt: int, progress: int) -> bool:
        try:
            def update(c: sqlite3.Connection):
                c.execute("UPDATE jobs SET progress = ? WHERE id = ? AND status = ? AND attempts = ?",
                          (int(progress), job_id, IN_PROGRESS, attempt))
                return c.execute("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()

            row = self._tx(update)
            return bool(row and row[0])
        except (JobStoreError, sqlite3.Error, OSError) as exc:  # bookkeeping never stops a job
            log.debug("could not record the progress of %s: %s", job_id, exc)
            return False

    def finish(self, job_id: str, attempt: int, status: str, *, stats: Mapping[str, Any] | None = None,
               error: Mapping[str, str] | None = None, videos: Mapping[str, Path] | None = None) -> bool:
        if status not in TERMINAL:
            raise ValueError(f"finish takes one of {TERMINAL}, not {status!r}")
        with self._lock:
            row = self._conn.execute("SELECT status, attempts FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row[0] != IN_PROGRESS or row[1] != attempt:
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
            def end(c: sqlite3.Connection) -> bool:
                cur = c.execute(
                    "UPDATE jobs SET status = ?, progress = ?, completed_at = ?, stats = ?, error = ?, videos = ? "
                    "WHERE id = ? AND status = ? AND attempts = ?",
                    (status, 100 if status == COMPLETED else _progress_of(c, job_id), self._clock(),
                     json.dumps(dict(stats)) if stats is not None else None, json.dumps(dict(error)) if error else None,
                     json.dumps(published), job_id, IN_PROGRESS, attempt))
                if cur.rowcount:
                    self._log(c, job_id, status, attempt)
                return bool(cur.rowcount)

            return self._tx(end, critical=True)

    def requeue(self, job_id: str, attempt: int, *, count_attempt: bool = False) -> bool:
        def back(c: sqlite3.Connection) -> bool:
            cur = c.execute("UPDATE jobs SET status = ?, progress = 0, worker = NULL, started_at = NULL, "
                            "attempts = attempts - ? WHERE id = ? AND status = ? AND attempts = ?",
                            (QUEUED, 0 if count_attempt else 1, job_id, IN_PROGRESS, attempt))
            if cur.rowcount:
                self._log(c, job_id, "requeued", attempt, "attempt counted" if count_attempt else "drained")
            return bool(cur.rowcount)

        return self._tx(back, critical=True)

    def cancel(self, tenant: str, job_id: str) -> Job | None:
        def stop(c: sqlite3.Connection) -> Job | None:
            job = self._get(c, job_id)
            if job is None or job.tenant != tenant:
                return None
            if job.status == QUEUED:
                c.execute("UPDATE jobs SET status = ?, completed_at = ?, cancel_requested = 1 WHERE id = ?",
                          (CANCELLED, self._clock(), job_id))
                self._log(c, job_id, CANCELLED, job.attempts, "while queued")
            elif job.status == IN_PROGRESS and not job.cancel_requested:
                c.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
                self._log(c, job_id, "cancel_requested", job.attempts)
            return self._get(c, job_id)

        return self._tx(stop, critical=True)

    def recover(self, max_attempts: int) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"requeued": [], "failed": [], "cancelled": []}
        def sweep(c: sqlite3.Connection) -> None:
            rows = c.execute("SELECT id, attempts, cancel_requested FROM jobs WHERE status = ? ORDER BY seq", (IN_PROGRESS,)).fetchall()
            now = self._clock()
            for jid, attempts, cancel in rows:
                if cancel:
                    c.execute("UPDATE jobs SET status = ?, completed_at = ? WHERE id = ?", (CANCELLED, now, jid))
                    self._log(c, jid, CANCELLED, attempts, "cancellation asked before the server stopped")
                    out["cancelled"].append(jid)
                elif attempts >= max_attempts:
                    err = {"type": "interrupted", "message": f"the server stopped during this job {attempts} time(s); "
                                                             "it is not tried again"}
                    c.execute("UPDATE jobs SET status = ?, completed_at = ?, error = ? WHERE id = ?",
                              (FAILED, now, json.dumps(err), jid))
                    self._log(c, jid, FAILED, attempts, "attempts used up")
                    out["failed"].append(jid)
                else:
                    c.execute("UPDATE jobs SET status = ?, progress = 0, worker = NULL, started_at = NULL WHERE id = ?",
                              (QUEUED, jid))
                    self._log(c, jid, "requeued", attempts, "the server stopped during this attempt")
                    out["requeued"].append(jid)

        self._tx(sweep, critical=True)
        self._sweep_staging()
        return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            got = dict(self._conn.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        return {s: int(got.get(s, 0)) for s in STATUSES}

    def queued_count(self, tenant: str) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM jobs WHERE status = ? AND tenant = ?", (QUEUED, tenant)).fetchone()[0])

    def history(self, job_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute("SELECT kind, attempt, at, detail FROM job_log WHERE job_id = ? ORDER BY seq", (job_id,)).fetchall()
        return [{"kind": k, "attempt": a, "at": t, "detail": d} for k, a, t, d in rows]

    def healthy(self) -> str | None:
        if self._low_space:
            self._ensure_reserve()
        return f"the disk of {self.root} is full" if self._low_space else None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

def _progress_of(c: sqlite3.Connection, job_id: str) -> int:
    row = c.execute("SELECT progress FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return int(row[0]) if row else 0


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
