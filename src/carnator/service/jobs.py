"""The job table of ``carnator serve``: the :class:`JobStore` protocol and :class:`SqlJobStore`, its one
implementation over SQLAlchemy Core: :class:`SqliteJobStore` (SQLite in WAL mode beside the cache, videos of finished
jobs in ``videos/``) and, with ``--store postgresql://...``, :class:`carnator.service.pgjobs.PostgresJobStore`. The
tables are written once (:func:`job_tables`); each database adds only how it connects, serialises a submission and
fails (a full disk for SQLite, an unreachable server for PostgreSQL). The schema carries a version, and
:data:`MIGRATIONS` upgrade an older table in place when it is opened.

Nothing else in the service touches the database or the video files: the worker and the HTTP layer call these
methods only.

A job moves ``queued -> in_progress -> completed | failed | cancelled``. Rules every implementation keeps:

* Every read and change is scoped by tenant: a job of another tenant reads as missing.
* ``claim`` is atomic: two workers never claim one job. Each claim starts a new *attempt* (``attempts + 1``), and
  ``finish``, ``requeue`` and ``update_progress`` name the attempt they belong to: a stale attempt (one that a
  restart requeued) changes nothing, so a job completes at most once.
* ``recover`` (at start-up, when no worker of the previous run is alive) requeues jobs left ``in_progress`` while
  they have attempts left, and fails the others with a reason; a job whose cancellation was asked is cancelled.
* Videos are published (durably) before the row that says the job completed is committed.

How the two databases keep them: SQLite takes its write lock at the start of every transaction (``BEGIN
IMMEDIATE``), so claims, limits and keys are checked and changed by one writer at a time; PostgreSQL claims with
``SELECT ... FOR UPDATE SKIP LOCKED`` (two claimers never take one job, neither waits on the other's row), ``finish``
and ``cancel`` lock the job's row, and a submission takes a transaction-scoped advisory lock (limits hold across
processes).
"""

from __future__ import annotations

import builtins
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

import sqlalchemy as sa

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


class JobTableLost(JobStoreUnavailable):
    """Another server took this server's job table (while PostgreSQL restarted): it will not be back for this one."""


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

    def queued_tenants(self) -> builtins.list[str]:
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

    def retry(self, job_id: str, attempt: int, worker: str, reason: str) -> int | None:
        """The worker running an attempt starts the job over at once (its engine failed under it, e.g. a replica
        died): the attempt ends (logged ``requeued`` with ``reason``, counted) and the same worker claims the next one
        in the same transaction. The new attempt's number, or None (nothing changed) when ``attempt`` is stale."""

    def cancel(self, tenant: str, job_id: str) -> Job | None:
        """Cancel a queued job at once, or ask an in-progress one to stop; the job after that, None when missing."""

    def recover(self, max_attempts: int) -> dict[str, builtins.list[str]]:
        """Start-up: jobs left in progress are requeued, failed (attempts used up) or cancelled (asked); their ids."""

    def expire(self, before: float) -> builtins.list[str]:
        """Retention: delete the jobs that finished (completed, failed, cancelled) before ``before`` (Unix seconds),
        their log and their videos; their ids. Queued and running jobs are never touched."""

    def counts(self) -> dict[str, int]:
        """Jobs per status, over every tenant (for the operator's metrics; never shown to a tenant)."""

    def queued_count(self, tenant: str) -> int:
        """The tenant's queued jobs."""

    def staging_path(self, job_id: str, variant: str) -> Path:
        """A path to write a finished job's video to before :meth:`finish` publishes it."""

    def video_path(self, tenant: str, job_id: str, variant: str) -> Path | None:
        """The published video of the tenant's completed job, or None."""

    def history(self, job_id: str) -> builtins.list[dict[str, Any]]:
        """The job's audit log: submitted, claimed (attempt), progress never, requeued, finished (status)."""

    def record_audit(self, verdict: Mapping[str, Any], state: Callable[[int, int], Mapping[str, Any]]) -> dict[str, Any]:
        """Append one audit verdict with the live state of its tier after it (carnator.service.audit)."""

    def audit_verdicts(self, thresholds: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every audit verdict (of one thresholds file's identity, or all), oldest first."""

    def healthy(self) -> str | None:
        """None when the store can take new jobs; else why not (one line)."""

    def close(self) -> None:
        """Release the store."""


#: Table names per database. The PostgreSQL tables share a schema with the cache store's, hence the prefix.
TABLE_NAMES = {"sqlite": ("jobs", "job_log", "meta", "audits"),
               "postgresql": ("carnator_jobs", "carnator_job_events", "carnator_jobs_meta", "carnator_audits")}


@dataclass(frozen=True)
class JobTables:
    metadata: sa.MetaData
    jobs: sa.Table
    events: sa.Table
    meta: sa.Table
    audits: sa.Table


def job_tables(dialect: str) -> JobTables:
    """The job table's schema, for both databases (only the names differ, see :data:`TABLE_NAMES`)."""
    jobs_name, events_name, meta_name, audits_name = TABLE_NAMES[dialect]
    md = sa.MetaData()
    seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite: INTEGER PRIMARY KEY is the rowid
    jobs = sa.Table(
        jobs_name, md,
        sa.Column("seq", seq, primary_key=True, autoincrement=True),
        sa.Column("id", sa.Text, unique=True, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("request_hash", sa.Text),
        sa.Column("progress", sa.Integer, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cancel_requested", sa.Boolean(create_constraint=False), nullable=False, server_default=sa.false()),
        sa.Column("worker", sa.Text),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double),
        sa.Column("completed_at", sa.Double),
        sa.Column("error", sa.Text),
        sa.Column("stats", sa.Text),
        sa.Column("videos", sa.Text),
        sqlite_autoincrement=True,
    )
    with_key = jobs.c.idempotency_key.isnot(None)
    sa.Index(f"{jobs_name}_idempotency", jobs.c.tenant, jobs.c.idempotency_key, unique=True,
             sqlite_where=with_key, postgresql_where=with_key)
    sa.Index(f"{jobs_name}_queue", jobs.c.status, jobs.c.tenant, jobs.c.seq)
    sa.Index(f"{jobs_name}_tenant", jobs.c.tenant, jobs.c.seq)
    events = sa.Table(
        events_name, md,
        sa.Column("seq", seq, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("detail", sa.Text),
        sqlite_autoincrement=True,
    )
    sa.Index(f"{events_name}_job", events.c.job_id, events.c.seq)
    meta = sa.Table(meta_name, md, sa.Column("key", sa.Text, primary_key=True), sa.Column("value", sa.Text, nullable=False))
    # Shadow audits' verdicts (carnator.service.audit): one row per audited approximate hit, with the live bound of its
    # (thresholds file, kind, step) after it.
    audits = sa.Table(
        audits_name, md,
        sa.Column("seq", seq, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("thresholds", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("of", sa.Integer),
        sa.Column("acceptable", sa.Boolean(create_constraint=False), nullable=False),
        sa.Column("scores", sa.Text, nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("entry_id", sa.Text),
        sa.Column("source_id", sa.Text),
        sa.Column("seconds", sa.Double),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("unsafe", sa.Integer, nullable=False),
        sa.Column("bound", sa.Double, nullable=False),
        sa.Column("lower", sa.Double, nullable=False),
        sa.Column("disabled", sa.Boolean(create_constraint=False), nullable=False),
        sqlite_autoincrement=True,
    )
    sa.Index(f"{audits_name}_tier", audits.c.thresholds, audits.c.kind, audits.c.step, audits.c.seq)
    return JobTables(md, jobs, events, meta, audits)


def _create(c: sa.Connection, t: JobTables) -> None:
    t.metadata.create_all(c, tables=[t.jobs, t.events, t.meta], checkfirst=True)


def _add_audits(c: sa.Connection, t: JobTables) -> None:
    """Version 2: the shadow audits' verdicts."""
    t.audits.create(c, checkfirst=True)


#: The schema's versions: step N upgrades a table of version N-1 (0: none yet, or a PostgreSQL table of a release
#: that kept no version; its tables are those of version 1) in place, inside the transaction that records N.
MIGRATIONS: tuple[Callable[[sa.Connection, JobTables], None], ...] = (_create, _add_audits)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(c: sa.Connection, t: JobTables) -> int:
    """Bring the tables to :data:`SCHEMA_VERSION` (inside the caller's write transaction); the version found."""
    t.meta.create(c, checkfirst=True)
    found = c.execute(sa.select(t.meta.c.value).where(t.meta.c.key == "schema")).scalar()
    version = int(found or 0)
    if version > SCHEMA_VERSION:
        raise JobStoreError(f"the job table was written by a newer carnator (schema {version}; this one knows "
                            f"{SCHEMA_VERSION})")
    for step in MIGRATIONS[version:]:
        step(c, t)
    if version < SCHEMA_VERSION:
        if found is None:
            c.execute(sa.insert(t.meta).values(key="schema", value=str(SCHEMA_VERSION)))
        else:
            c.execute(sa.update(t.meta).where(t.meta.c.key == "schema").values(value=str(SCHEMA_VERSION)))
    return version


_COLUMNS = ("id", "tenant", "status", "params", "progress", "attempts", "cancel_requested", "started_at", "completed_at",
            "error", "stats", "videos", "idempotency_key", "worker", "created_at")


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
        if not staged.exists() and final.exists():  # published by a transaction that then failed, run once more
            return
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


def _first_line(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    return (str(inner).strip().splitlines() or [type(inner).__name__])[0]


class SqlJobStore(VideoFiles):
    """The job store over one database (SQLAlchemy Core). Every thread may call every method: one connection, used
    under a lock. Subclasses say how to connect (:meth:`_open`) and what a failure means (:meth:`_failed`)."""

    dialect = ""

    def __init__(self, video_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.video_dir = video_dir
        self.video_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._conn: sa.Connection | None = None
        self._closed = False
        self.tables = job_tables(self.dialect)

    # ---- what a database adds ----------------------------------------------------------------
    def _open(self) -> sa.Connection:
        """A new connection, its tables migrated."""
        raise NotImplementedError

    def _failed(self, exc: BaseException, *, critical: bool, last: bool) -> None:
        """A transaction failed with a database error or an OSError: raise (a :class:`JobStoreError`), or return to
        run it once more."""
        raise JobStoreError(f"job table: {_first_line(exc)}") from None

    def _serialise_submit(self, c: sa.Connection) -> None:
        """Make the submission's checks and insert one at a time (SQLite's write lock already does)."""

    def _before(self) -> None:
        """Runs before every transaction."""

    def _after(self) -> None:
        """Runs after every committed transaction."""

    # ---- plumbing ----------------------------------------------------------------------------
    def _tx(self, fn: Callable[[sa.Connection], R], *, critical: bool = False) -> R:
        """``fn(conn)`` in one transaction. ``critical``: a state change of an accepted job (see :meth:`_failed`)."""
        with self._lock:
            if self._closed:
                raise JobStoreError("the job store is closed")
            self._before()
            for last in (False, True):
                try:
                    if self._conn is None or self._conn.closed or self._conn.invalidated:
                        self._conn = self._open()
                    with self._conn.begin():
                        out = fn(self._conn)
                    self._after()
                    return out
                except (sa.exc.DBAPIError, OSError) as exc:
                    self._failed(exc, critical=critical, last=last)
            raise AssertionError("unreachable")

    def _log(self, c: sa.Connection, job_id: str, kind: str, attempt: int, detail: str | None = None) -> None:
        c.execute(sa.insert(self.tables.events).values(job_id=job_id, kind=kind, attempt=attempt, at=self._clock(),
                                                      detail=detail))

    @staticmethod
    def _job(row: Any) -> Job:
        m = row._mapping
        return Job(id=m["id"], tenant=m["tenant"], status=m["status"], params=json.loads(m["params"]),
                   progress=int(m["progress"]), attempts=int(m["attempts"]), cancel_requested=bool(m["cancel_requested"]),
                   started_at=m["started_at"], completed_at=m["completed_at"],
                   error=json.loads(m["error"]) if m["error"] else None, stats=json.loads(m["stats"]) if m["stats"] else None,
                   videos=json.loads(m["videos"]) if m["videos"] else [], idempotency_key=m["idempotency_key"],
                   worker=m["worker"], created_at=m["created_at"])

    def _select(self, *extra: Any) -> sa.Select:
        j = self.tables.jobs
        return sa.select(*(j.c[n] for n in _COLUMNS), *extra)

    def _get(self, c: sa.Connection, job_id: str, tenant: str | None = None, *, lock: bool = False) -> Job | None:
        j = self.tables.jobs
        q = self._select().where(j.c.id == job_id)
        if tenant is not None:
            q = q.where(j.c.tenant == tenant)
        row = c.execute(q.with_for_update() if lock else q).first()
        return None if row is None else self._job(row)

    def _set(self, c: sa.Connection, job_id: str, **values: Any) -> None:
        c.execute(sa.update(self.tables.jobs).where(self.tables.jobs.c.id == job_id).values(**values))

    # ---- the protocol ------------------------------------------------------------------------
    def submit(self, tenant: str, params: Mapping[str, Any], *, idempotency_key: str | None = None,
               request_hash: str | None = None, max_queued: int | None = None,
               max_queued_per_tenant: int | None = None) -> tuple[Job, bool]:
        j = self.tables.jobs
        queued = sa.select(sa.func.count()).select_from(j).where(j.c.status == QUEUED)

        def insert(c: sa.Connection) -> tuple[Job, bool]:
            self._serialise_submit(c)
            if idempotency_key is not None:
                row = c.execute(self._select(j.c.request_hash).where(j.c.tenant == tenant,
                                                                     j.c.idempotency_key == idempotency_key)).first()
                if row is not None:
                    if row.request_hash != request_hash:
                        raise IdempotencyConflict("this Idempotency-Key was used with a different request")
                    return self._job(row), False
            if max_queued is not None:
                n = c.execute(queued).scalar_one()
                if n >= max_queued:
                    raise QueueFull("queue_full", f"the queue is full ({max_queued} jobs waiting)", n)
            if max_queued_per_tenant is not None:
                n = c.execute(queued.where(j.c.tenant == tenant)).scalar_one()
                if n >= max_queued_per_tenant:
                    raise QueueFull("tenant_limit", f"you have {n} jobs waiting, the most one caller may queue", n)
            job = Job(id=new_job_id(), tenant=tenant, status=QUEUED, params=dict(params), created_at=self._clock(),
                      idempotency_key=idempotency_key)
            c.execute(sa.insert(j).values(id=job.id, tenant=tenant, status=QUEUED, params=json.dumps(job.params),
                                          idempotency_key=idempotency_key, request_hash=request_hash,
                                          created_at=job.created_at))
            self._log(c, job.id, "submitted", 0)
            return job, True

        return self._tx(insert)

    def get(self, tenant: str, job_id: str) -> Job | None:
        return self._tx(lambda c: self._get(c, job_id, tenant))

    def list(self, tenant: str, *, limit: int = 20, after: str | None = None, order: str = "desc") -> tuple[list[Job], bool]:
        j = self.tables.jobs

        def page(c: sa.Connection) -> tuple[list[Job], bool]:
            q = self._select().where(j.c.tenant == tenant)
            if after is not None:
                seq = c.execute(sa.select(j.c.seq).where(j.c.id == after, j.c.tenant == tenant)).scalar()
                if seq is None:
                    return [], False
                q = q.where(j.c.seq < seq if order == "desc" else j.c.seq > seq)
            rows = c.execute(q.order_by(j.c.seq.desc() if order == "desc" else j.c.seq).limit(limit + 1)).all()
            return [self._job(r) for r in rows[:limit]], len(rows) > limit

        return self._tx(page)

    def queued_tenants(self) -> builtins.list[str]:
        j = self.tables.jobs
        q = sa.select(j.c.tenant).where(j.c.status == QUEUED).distinct().order_by(j.c.tenant)
        return self._tx(lambda c: list(c.execute(q).scalars()))

    def claim(self, tenant: str, worker: str) -> Job | None:
        j = self.tables.jobs

        def take(c: sa.Connection) -> Job | None:
            jid = c.execute(sa.select(j.c.id).where(j.c.status == QUEUED, j.c.tenant == tenant).order_by(j.c.seq).limit(1)
                            .with_for_update(skip_locked=True)).scalar()
            if jid is None:
                return None
            self._set(c, jid, status=IN_PROGRESS, attempts=j.c.attempts + 1, worker=worker, started_at=self._clock(),
                      progress=0)
            job = self._get(c, jid)
            assert job is not None
            self._log(c, job.id, "claimed", job.attempts, worker)
            return job

        return self._tx(take, critical=True)

    def update_progress(self, job_id: str, attempt: int, progress: int) -> bool:
        j = self.tables.jobs

        def update(c: sa.Connection) -> bool:
            c.execute(sa.update(j).where(j.c.id == job_id, j.c.status == IN_PROGRESS, j.c.attempts == attempt)
                      .values(progress=int(progress)))
            return bool(c.execute(sa.select(j.c.cancel_requested).where(j.c.id == job_id)).scalar())

        try:
            return self._tx(update)
        except JobStoreError as exc:  # bookkeeping never stops a job
            log.debug("could not record the progress of %s: %s", job_id, exc)
            return False

    def finish(self, job_id: str, attempt: int, status: str, *, stats: Mapping[str, Any] | None = None,
               error: Mapping[str, str] | None = None, videos: Mapping[str, Path] | None = None) -> bool:
        if status not in TERMINAL:
            raise ValueError(f"finish takes one of {TERMINAL}, not {status!r}")

        def end(c: sa.Connection) -> bool:
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
            self._set(c, job_id, status=status, progress=100 if status == COMPLETED else job.progress,
                      completed_at=self._clock(), stats=json.dumps(dict(stats)) if stats is not None else None,
                      error=json.dumps(dict(error)) if error else None, videos=json.dumps(published))
            self._log(c, job_id, status, attempt)
            return True

        try:
            return self._tx(end, critical=True)
        except JobStoreUnavailable as exc:  # the caller may finish again once the database is back: keep what was
            if isinstance(exc, JobTableLost):  # staged (a later start sweeps what is never published)
                self._discard(videos)
            raise
        except JobStoreError:
            self._discard(videos)
            raise

    def requeue(self, job_id: str, attempt: int, *, count_attempt: bool = False) -> bool:
        j = self.tables.jobs

        def back(c: sa.Connection) -> bool:
            n = c.execute(sa.update(j).where(j.c.id == job_id, j.c.status == IN_PROGRESS, j.c.attempts == attempt)
                          .values(status=QUEUED, progress=0, worker=None, started_at=None,
                                  attempts=j.c.attempts - (0 if count_attempt else 1))).rowcount
            if n:
                self._log(c, job_id, "requeued", attempt, "attempt counted" if count_attempt else "drained")
            return bool(n)

        return self._tx(back, critical=True)

    def retry(self, job_id: str, attempt: int, worker: str, reason: str) -> int | None:
        j = self.tables.jobs

        def again(c: sa.Connection) -> int | None:
            n = c.execute(sa.update(j).where(j.c.id == job_id, j.c.status == IN_PROGRESS, j.c.attempts == attempt,
                                             j.c.cancel_requested == sa.false())
                          .values(attempts=attempt + 1, progress=0, worker=worker, started_at=self._clock())).rowcount
            if not n:
                return None
            self._log(c, job_id, "requeued", attempt, f"attempt counted: {reason}")
            self._log(c, job_id, "claimed", attempt + 1, worker)
            return attempt + 1

        return self._tx(again, critical=True)

    def cancel(self, tenant: str, job_id: str) -> Job | None:
        def stop(c: sa.Connection) -> Job | None:
            job = self._get(c, job_id, tenant, lock=True)
            if job is None:
                return None
            if job.status == QUEUED:
                self._set(c, job_id, status=CANCELLED, completed_at=self._clock(), cancel_requested=True)
                self._log(c, job_id, CANCELLED, job.attempts, "while queued")
            elif job.status == IN_PROGRESS and not job.cancel_requested:
                self._set(c, job_id, cancel_requested=True)
                self._log(c, job_id, "cancel_requested", job.attempts)
            return self._get(c, job_id)

        return self._tx(stop, critical=True)

    def recover(self, max_attempts: int) -> dict[str, builtins.list[str]]:
        j = self.tables.jobs
        out: dict[str, list[str]] = {"requeued": [], "failed": [], "cancelled": []}

        def sweep(c: sa.Connection) -> None:
            rows = c.execute(sa.select(j.c.id, j.c.attempts, j.c.cancel_requested).where(j.c.status == IN_PROGRESS)
                             .order_by(j.c.seq).with_for_update()).all()
            now = self._clock()
            for jid, attempts, cancel in rows:
                if cancel:
                    self._set(c, jid, status=CANCELLED, completed_at=now)
                    self._log(c, jid, CANCELLED, attempts, "cancellation asked before the server stopped")
                    out["cancelled"].append(jid)
                elif attempts >= max_attempts:
                    err = {"type": "interrupted", "message": f"the server stopped during this job {attempts} time(s); "
                                                             "it is not tried again"}
                    self._set(c, jid, status=FAILED, completed_at=now, error=json.dumps(err))
                    self._log(c, jid, FAILED, attempts, "attempts used up")
                    out["failed"].append(jid)
                else:
                    self._set(c, jid, status=QUEUED, progress=0, worker=None, started_at=None)
                    self._log(c, jid, "requeued", attempts, "the server stopped during this attempt")
                    out["requeued"].append(jid)

        self._tx(sweep, critical=True)
        self._sweep_staging()
        return out

    def expire(self, before: float, *, batch: int = 500) -> builtins.list[str]:
        j, e = self.tables.jobs, self.tables.events
        q = (sa.select(j.c.id).where(j.c.status.in_(TERMINAL), j.c.completed_at < float(before)).order_by(j.c.seq)
             .limit(batch))

        def sweep(c: sa.Connection) -> builtins.list[str]:
            ids = builtins.list(c.execute(q).scalars())
            if ids:
                c.execute(sa.delete(e).where(e.c.job_id.in_(ids)))
                c.execute(sa.delete(j).where(j.c.id.in_(ids)))
            return ids

        out: builtins.list[str] = []
        while True:
            ids = self._tx(sweep)  # the rows first: a crash between leaves only video files nothing names
            for jid in ids:
                for variant in VARIANTS:
                    with contextlib.suppress(OSError):
                        (self.video_dir / f"{jid}.{variant}").unlink()
            out += ids
            if len(ids) < batch:
                return out

    def counts(self) -> dict[str, int]:
        j = self.tables.jobs
        got = dict(self._tx(lambda c: c.execute(sa.select(j.c.status, sa.func.count()).group_by(j.c.status)).all()))
        return {s: int(got.get(s, 0)) for s in STATUSES}

    def queued_count(self, tenant: str) -> int:
        j = self.tables.jobs
        q = sa.select(sa.func.count()).select_from(j).where(j.c.status == QUEUED, j.c.tenant == tenant)
        return int(self._tx(lambda c: c.execute(q).scalar_one()))

    def history(self, job_id: str) -> builtins.list[dict[str, Any]]:
        e = self.tables.events
        q = sa.select(e.c.kind, e.c.attempt, e.c.at, e.c.detail).where(e.c.job_id == job_id).order_by(e.c.seq)
        return [{"kind": k, "attempt": a, "at": t, "detail": d} for k, a, t, d in self._tx(lambda c: c.execute(q).all())]

    # ---- shadow audits' verdicts (carnator.service.audit) ------------------------------------------
    def record_audit(self, verdict: Mapping[str, Any], state: Callable[[int, int], Mapping[str, Any]]) -> dict[str, Any]:
        """Append one audit verdict (``job_id``, ``tenant``, ``thresholds``, ``kind``, ``step``, ``of``, ``acceptable``,
        ``scores``, ``request``, ``entry_id``, ``source_id``, ``seconds``) with the live state of its tier after it:
        ``state(n, unsafe)`` over every verdict of the same thresholds, kind and step (this one included) gives
        ``bound``, ``lower`` and ``disabled``. Serialised with submissions (one count per tier across servers)."""
        a = self.tables.audits

        def add(c: sa.Connection) -> dict[str, Any]:
            self._serialise_submit(c)
            same = (a.c.thresholds == verdict["thresholds"], a.c.kind == verdict["kind"], a.c.step == int(verdict["step"]))
            n, bad, was = c.execute(sa.select(sa.func.count(), sa.func.sum(sa.case((a.c.acceptable, 0), else_=1)),
                                              sa.func.max(sa.case((a.c.disabled, 1), else_=0))).where(*same)).one()
            n, bad = int(n or 0) + 1, int(bad or 0) + (0 if verdict["acceptable"] else 1)
            st = dict(state(n, bad))
            st["disabled"] = bool(st["disabled"]) or bool(was)   # a disabled tier stays so for this thresholds file
            row = {"job_id": verdict["job_id"], "tenant": verdict["tenant"], "thresholds": verdict["thresholds"],
                   "kind": verdict["kind"], "step": int(verdict["step"]), "of": verdict.get("of"),
                   "acceptable": bool(verdict["acceptable"]), "scores": json.dumps(verdict.get("scores") or {}),
                   "request": json.dumps(verdict.get("request") or {}, default=str), "entry_id": verdict.get("entry_id"),
                   "source_id": verdict.get("source_id"), "seconds": verdict.get("seconds"), "at": self._clock(),
                   "n": n, "unsafe": bad, "bound": float(st["bound"]), "lower": float(st["lower"]),
                   "disabled": bool(st["disabled"])}
            c.execute(sa.insert(a).values(**row))
            return {**row, "scores": verdict.get("scores") or {}, "request": verdict.get("request") or {}}

        return self._tx(add)

    def audit_verdicts(self, thresholds: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every audit verdict (of one thresholds file's identity, or all), oldest first."""
        a = self.tables.audits
        q = sa.select(a).order_by(a.c.seq)
        if thresholds is not None:
            q = q.where(a.c.thresholds == thresholds)
        rows = self._tx(lambda c: c.execute(q).all())
        out = []
        for r in rows:
            m = dict(r._mapping)
            m["scores"], m["request"] = json.loads(m["scores"]), json.loads(m["request"])
            m["acceptable"], m["disabled"] = bool(m["acceptable"]), bool(m["disabled"])
            out.append(m)
        return out

    def healthy(self) -> str | None:
        try:
            self._tx(lambda c: c.execute(sa.select(1)))
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
            self._engine_dispose()

    def _engine_dispose(self) -> None:
        """Release the engine's pool (subclasses that keep one)."""


class SqliteJobStore(SqlJobStore):
    """Jobs in ``<root>/jobs.sqlite`` (WAL), finished videos in ``<root>/videos/<job>.<variant>``.

    ``root`` is the cache directory. One process serves a root at a time (``carnator serve`` holds a lock). A small
    reserve file (:data:`RESERVE_BYTES`) is kept beside the database: when the disk fills, it is released so that
    jobs already accepted can still be finished (failed, cancelled, requeued), while new submissions are refused
    (:class:`StorageFull`) until there is room again.
    """

    dialect = "sqlite"

    def __init__(self, root: str | os.PathLike[str], *, busy_timeout_s: float = 10.0, clock=time.time):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        super().__init__(self.root / VIDEO_DIR, clock=clock)
        self._reserve = self.root / RESERVE_FILE
        self._low_space = False
        self.path = self.root / DB_FILE
        self._engine = sa.create_engine(f"sqlite:///{self.path}", poolclass=sa.pool.NullPool,
                                        connect_args={"timeout": busy_timeout_s, "check_same_thread": False})

        @sa.event.listens_for(self._engine, "connect")
        def _connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # transactions are begun below, not by the driver
            dbapi_conn.execute("PRAGMA journal_mode = WAL")
            dbapi_conn.execute("PRAGMA synchronous = FULL")  # a job said completed stays completed across a power loss
            dbapi_conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")

        @sa.event.listens_for(self._engine, "begin")
        def _begin(conn: sa.Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")  # the write lock first: one writer, no upgrade deadlock

        with self._lock:
            self._tx(lambda c: None, critical=True)
        self._ensure_reserve()

    def _open(self) -> sa.Connection:
        conn = self._engine.connect()
        with conn.begin():
            migrate(conn, self.tables)
        return conn

    def _failed(self, exc: BaseException, *, critical: bool, last: bool) -> None:
        if not _is_full(getattr(exc, "orig", None) or exc):
            super()._failed(exc, critical=critical, last=last)
        self._low_space = True
        if last or not critical or not self._release_reserve():
            raise StorageFull(f"the disk of {self.root} is full") from None
        log.error("the disk of %s is full: released the job table's reserve to finish a job", self.root)

    def _after(self) -> None:
        if self._low_space:
            self._ensure_reserve()

    def _engine_dispose(self) -> None:
        self._engine.dispose()

    def submit(self, tenant: str, params: Mapping[str, Any], **kw: Any) -> tuple[Job, bool]:
        if self._low_space:
            self._ensure_reserve()
            if self._low_space:
                raise StorageFull(f"the disk of {self.root} is full")
        return super().submit(tenant, params, **kw)

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

    def healthy(self) -> str | None:
        if self._low_space:
            self._ensure_reserve()
        return f"the disk of {self.root} is full" if self._low_space else None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
