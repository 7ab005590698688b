"""The service's job stores (real SQLite in a temp directory and a real PostgreSQL, no model): submission limits and
idempotency, tenant scoping, atomic claims and attempts (a job completes at most once), recovery after a kill, fair
claiming across tenants, cancellation, pagination, and the reserve that lets accepted jobs finish on a full disk (a
real tmpfs). The protocol-level tests run against both stores; PostgreSQL adds claims raced by two processes' stores
and the one-server-per-database lock."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from carnator.service.jobs import (
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    IdempotencyConflict,
    JobStore,
    QueueFull,
    SqliteJobStore,
    StorageFull,
    request_hash,
)
from carnator.service.worker import FairQueue

P = {"prompt": "a red ball", "seed": 1, "policy": "carnator", "cache": "reuse"}


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """A function opening the job store (again: a restarted server) on one location: a directory or a fresh schema."""
    opened = []
    if request.param == "sqlite":
        def make():
            opened.append(SqliteJobStore(tmp_path))
            return opened[-1]
    else:
        from carnator.service.pgjobs import PostgresJobStore

        url = request.getfixturevalue("pg_schema_url")

        def make():
            opened.append(PostgresJobStore(url, tmp_path / "videos"))
            return opened[-1]
    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store):
    return open_store()


def test_store_implements_the_protocol_and_uses_wal(tmp_path):
    store = SqliteJobStore(tmp_path)
    assert isinstance(store, JobStore)
    store.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "jobs.sqlite") as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_lifecycle_tenant_scoping_and_one_completion(store, tmp_path):
    job, created = store.submit("a", P)
    assert created and job.status == QUEUED and job.id.startswith("video_")
    assert store.get("b", job.id) is None and store.cancel("b", job.id) is None  # another tenant's: as if missing
    assert store.claim("b", "w") is None
    got = store.claim("a", "w")
    assert got.id == job.id and got.status == IN_PROGRESS and got.attempts == 1
    assert store.claim("a", "w") is None  # claimed once
    staged = store.staging_path(job.id, "mp4")
    staged.write_bytes(b"video")
    assert store.finish(job.id, 1, COMPLETED, stats={"tier": "miss"}, videos={"mp4": staged})
    assert not store.finish(job.id, 1, COMPLETED, stats={})  # a second completion changes nothing
    done = store.get("a", job.id)
    assert done.status == COMPLETED and done.progress == 100 and done.stats == {"tier": "miss"} and done.videos == ["mp4"]
    assert store.video_path("a", job.id, "mp4").read_bytes() == b"video" and store.video_path("b", job.id, "mp4") is None
    assert [h["kind"] for h in store.history(job.id)] == ["submitted", "claimed", COMPLETED]


def test_retention_deletes_finished_jobs_and_their_videos_only(store):
    """``expire(before)``: jobs that finished before it go with their log and videos; a job that finished later,
    a queued and a running one stay. ``carnator serve --retention`` (7 days by default, 0: forever) says when."""
    import time

    from carnator.service.config import DEFAULT_RETENTION_S, ServeConfig, parse_duration

    old, failed, fresh, running, queued = (store.submit("a", {**P, "seed": i})[0] for i in range(5))
    for job in (old, failed, fresh, running):
        assert store.claim("a", "w").id == job.id
    staged = store.staging_path(old.id, "mp4")
    staged.write_bytes(b"video")
    assert store.finish(old.id, 1, COMPLETED, stats={}, videos={"mp4": staged})
    assert store.finish(failed.id, 1, FAILED, error={"type": "x", "message": "y"})
    cut = time.time() + 0.001
    time.sleep(0.01)
    assert store.finish(fresh.id, 1, CANCELLED)
    video = store.video_path("a", old.id, "mp4")
    assert sorted(store.expire(cut)) == sorted([old.id, failed.id])
    assert store.get("a", old.id) is None and store.get("a", failed.id) is None and not video.exists()
    assert store.history(old.id) == []
    assert [store.get("a", j.id).status for j in (fresh, queued, running)] == [CANCELLED, QUEUED, IN_PROGRESS]
    assert store.expire(cut) == []
    assert ServeConfig().retention_s == DEFAULT_RETENTION_S == 7 * 86400
    assert [parse_duration(t) for t in ("7d", "12h", "30m", "45s", "3600", "0", "1w")] == [
        604800, 43200, 1800, 45, 3600, 0, 604800]


def test_retry_starts_the_next_attempt_in_place(store):
    """An engine that starts a job over (its replica died): the attempt ends, counted and logged, and the same worker
    holds the next one; a stale attempt or a job whose cancellation was asked changes nothing."""
    job = store.submit("a", P)[0]
    store.claim("a", "w")
    store.update_progress(job.id, 1, 40)
    assert store.retry(job.id, 1, "w", "replica r1 failed mid-job") == 2
    got = store.get("a", job.id)
    assert (got.status, got.attempts, got.progress, got.worker) == (IN_PROGRESS, 2, 0, "w")
    assert store.retry(job.id, 1, "w", "stale") is None and not store.finish(job.id, 1, COMPLETED, stats={})
    assert [(h["kind"], h["attempt"]) for h in store.history(job.id)] == [
        ("submitted", 0), ("claimed", 1), ("requeued", 1), ("claimed", 2)]
    assert "replica r1 failed mid-job" in store.history(job.id)[2]["detail"]
    store.cancel("a", job.id)
    assert store.retry(job.id, 2, "w", "again") is None
    assert store.finish(job.id, 2, CANCELLED) and store.get("a", job.id).attempts == 2


def test_idempotency_replays_and_conflicts(store):
    h = request_hash({"prompt": "x"})
    j1, c1 = store.submit("a", P, idempotency_key="k1", request_hash=h)
    j2, c2 = store.submit("a", P, idempotency_key="k1", request_hash=h)
    assert c1 and not c2 and j1.id == j2.id
    with pytest.raises(IdempotencyConflict):
        store.submit("a", P, idempotency_key="k1", request_hash=request_hash({"prompt": "y"}))
    j3, c3 = store.submit("b", P, idempotency_key="k1", request_hash=h)  # keys are per tenant
    assert c3 and j3.id != j1.id


def test_queue_limits_are_atomic_under_concurrent_submissions(store):
    errors: list[Exception] = []
    ok: list[str] = []

    def submit(tenant: str) -> None:
        for _ in range(10):
            try:
                ok.append(store.submit(tenant, P, max_queued=12, max_queued_per_tenant=7)[0].id)
            except QueueFull as e:
                errors.append(e)

    threads = [threading.Thread(target=submit, args=(t,)) for t in ("a", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # which tenant fills the last places depends on the threads' interleaving; the limits never do
    a, b = store.queued_count("a"), store.queued_count("b")
    assert a + b == 12 == len(ok) == len(set(ok)) and a <= 7 and b <= 7, (a, b)
    assert len(errors) == 30 - 12 and "queue_full" in {e.reason for e in errors}
    assert {e.reason for e in errors} <= {"tenant_limit", "queue_full"}


def test_fair_queue_round_robins_over_tenants(store):
    for _ in range(3):
        store.submit("big", P)
    store.submit("small", P)
    store.submit("other", P)
    q = FairQueue(store)
    order = []
    while (job := q.next("w")) is not None:
        order.append(job.tenant)
        store.finish(job.id, job.attempts, COMPLETED)
    assert order == ["big", "other", "small", "big", "big"]


def test_recover_requeues_once_then_fails_and_stale_attempts_change_nothing(open_store):
    s = open_store()
    job, _ = s.submit("a", P)
    queued, _ = s.submit("a", P)
    s.claim("a", "w1")
    s.close()  # "killed" mid-job
    s = open_store()
    assert s.recover(max_attempts=2) == {"requeued": [job.id], "failed": [], "cancelled": []}
    assert s.get("a", queued.id).status == QUEUED  # queued jobs stay queued
    again = s.claim("a", "w2")
    assert again.id == job.id and again.attempts == 2
    assert not s.finish(job.id, 1, COMPLETED)  # the first attempt's worker is gone: it cannot complete the job
    assert not s.update_progress(job.id, 1, 50) and s.get("a", job.id).progress == 0
    assert s.recover(max_attempts=2) == {"requeued": [], "failed": [job.id], "cancelled": []}  # killed again
    failed = s.get("a", job.id)
    assert failed.status == FAILED and failed.error["type"] == "interrupted" and "2 time(s)" in failed.error["message"]
    assert [h["kind"] for h in s.history(job.id)] == ["submitted", "claimed", "requeued", "claimed", FAILED]


def test_drain_requeue_does_not_count_the_attempt(store):
    job, _ = store.submit("a", P)
    j = store.claim("a", "w")
    assert store.requeue(j.id, j.attempts)
    assert store.get("a", job.id).attempts == 0 and store.get("a", job.id).status == QUEUED


def test_cancel_queued_at_once_and_running_by_flag(store):
    q, _ = store.submit("a", P)
    assert store.cancel("a", q.id).status == CANCELLED
    r, _ = store.submit("a", P)
    run = store.claim("a", "w")
    assert run.id == r.id
    asked = store.cancel("a", r.id)
    assert asked.status == IN_PROGRESS and asked.cancel_requested
    assert store.update_progress(r.id, run.attempts, 10)  # the worker learns of it at its next progress write
    assert store.finish(r.id, run.attempts, CANCELLED)
    # a job whose cancellation was asked before a kill is cancelled at recovery, not run again
    k, _ = store.submit("a", P)
    store.claim("a", "w")
    store.cancel("a", k.id)
    assert store.recover(2)["cancelled"] == [k.id]


def test_pagination_is_per_tenant_and_stable(store):
    ids = [store.submit("a", P)[0].id for _ in range(5)]
    store.submit("b", P)
    page, more = store.list("a", limit=2)
    assert [j.id for j in page] == ids[::-1][:2] and more
    page2, more2 = store.list("a", limit=2, after=page[-1].id)
    assert [j.id for j in page2] == ids[::-1][2:4] and more2
    asc, _ = store.list("a", limit=10, order="asc")
    assert [j.id for j in asc] == ids
    assert store.list("b", after=ids[0]) == ([], False)  # another tenant's cursor: nothing


def test_postgres_claims_raced_by_two_servers_stores_take_each_job_once(pg_schema_url, tmp_path):
    from carnator.service.pgjobs import PostgresJobStore

    a, b = PostgresJobStore(pg_schema_url, tmp_path / "va"), PostgresJobStore(pg_schema_url, tmp_path / "vb")
    try:
        for _ in range(5):  # one job, two claimers released together: exactly one wins
            job, _ = a.submit("t", P)
            go = threading.Barrier(2)
            got: list = [None, None]

            def take(i: int, s: PostgresJobStore) -> None:
                go.wait()
                got[i] = s.claim("t", f"w{i}")

            threads = [threading.Thread(target=take, args=(i, s)) for i, s in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            winners = [g for g in got if g is not None]
            assert len(winners) == 1 and winners[0].id == job.id and winners[0].attempts == 1
            loser = b if got[0] is not None else a
            assert not loser.finish(job.id, 0, COMPLETED)  # no attempt of its own: changes nothing
            assert (a if loser is b else b).finish(job.id, 1, COMPLETED)
        ids = {a.submit("t", P)[0].id for _ in range(12)}
        taken: list[str] = []

        def drain(s: PostgresJobStore) -> None:
            while (j := s.claim("t", "w")) is not None:
                taken.append(j.id)

        threads = [threading.Thread(target=drain, args=(s,)) for s in (a, b, a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(taken) == sorted(ids)  # every job once, none twice
        assert b.counts()[IN_PROGRESS] == 12 and a.get("other", taken[0]) is None
    finally:
        a.close()
        b.close()


def test_postgres_one_server_per_database_and_unreachable_database(pg_schema_url, tmp_path):
    from carnator.errors import CarnatorError
    from carnator.service.jobs import JobStoreUnavailable
    from carnator.service.pgjobs import PostgresJobStore, hold_jobs

    with hold_jobs(pg_schema_url):
        with pytest.raises(CarnatorError, match=r"another carnator serve \(pid \d+\) uses the job table"):
            with hold_jobs(pg_schema_url):
                pass
        with hold_jobs(pg_schema_url.replace("schema=", "schema=x")):  # another schema: its own job table
            pass
    with hold_jobs(pg_schema_url):  # released with the first server
        pass
    with pytest.raises(JobStoreUnavailable, match="cannot connect"):
        PostgresJobStore("postgresql://nobody@127.0.0.1:1/none", tmp_path / "v")


def test_postgres_server_lock_is_taken_again_after_a_postgresql_restart(private_postgres, tmp_path):
    """A restart of PostgreSQL ends the session holding the one-server lock. The server takes it again on its next
    call, so a second server started afterwards is refused and the first completes its job in one attempt; a server
    that lost the lock to another (started before it reconnected) refuses every change and says why, and the job is
    completed once, by the other server."""
    from carnator.errors import CarnatorError
    from carnator.service.jobs import JobStoreUnavailable
    from carnator.service.pgjobs import PostgresJobStore, hold_jobs

    pg, url = private_postgres, f"{private_postgres.url}?schema=served"
    with hold_jobs(url) as held:
        a = PostgresJobStore(url, tmp_path / "a", server_lock=held)
        job, _ = a.submit("t", P)
        assert a.claim("t", "wa").attempts == 1
        pg.pause()
        pg.resume()
        a.healthy()  # the server's next call (its workers poll every 0.5 s): takes the lock again
        assert a.healthy() is None
        with pytest.raises(CarnatorError, match=r"another carnator serve \(pid \d+\) uses the job table"):
            with hold_jobs(url):
                pass
        assert a.finish(job.id, 1, COMPLETED) and a.get("t", job.id).attempts == 1

        second, _ = a.submit("t", P)
        assert a.claim("t", "wa").id == second.id
        pg.pause()
        pg.resume()
        with hold_jobs(url) as other:  # started before the first server touched the database again
            b = PostgresJobStore(url, tmp_path / "b", server_lock=other)
            assert b.recover(3)["requeued"] == [second.id]
            assert "took this server's job table" in (a.healthy() or "")
            with pytest.raises(JobStoreUnavailable, match="takes no more jobs"):
                a.claim("t", "wa")
            with pytest.raises(JobStoreUnavailable):
                a.finish(second.id, 1, COMPLETED)
            assert not a.update_progress(second.id, 1, 50)
            assert b.claim("t", "wb").attempts == 2 and b.finish(second.id, 2, COMPLETED)
            assert [h["kind"] for h in b.history(second.id)].count(COMPLETED) == 1
            b.close()
        a.close()


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_a_job_table_written_by_carnator_72f574c_opens_and_migrates_in_place(db, tmp_path, request):
    """``tests/stores/jobs-72f574c.*.sql``: job tables written by carnator 72f574c's own stores (a completed job with
    an idempotency key, one left in progress at 40 %, one queued), dumped as SQL; the PostgreSQL one kept no schema
    version. Opened by this release: the version is recorded, every job reads as it was, the key still replays, and the
    job left in progress is recovered and completes; opened again, nothing changes."""
    import sqlite3

    from carnator.service.jobs import SCHEMA_VERSION, TABLE_NAMES

    text = (Path(__file__).parent / "stores" / f"jobs-72f574c.{db}.sql").read_text()
    meta = TABLE_NAMES[db][2]
    if db == "sqlite":
        with sqlite3.connect(tmp_path / "jobs.sqlite") as c:
            c.executescript(text)

        def open_store():
            return SqliteJobStore(tmp_path)

        def version():
            with sqlite3.connect(tmp_path / "jobs.sqlite") as c:
                return c.execute(f"SELECT value FROM {meta} WHERE key = 'schema'").fetchone()[0]
    else:
        import psycopg

        from carnator.cache.shared import parse_store_url
        from carnator.service.pgjobs import PostgresJobStore
        from conftest import load_pg_dump

        url = request.getfixturevalue("pg_schema_url")
        load_pg_dump(url, text)
        conninfo, schema = parse_store_url(url)

        def open_store():
            return PostgresJobStore(url, tmp_path / "videos")

        def version():
            with psycopg.connect(conninfo) as c:
                return c.execute(f"SELECT value FROM {schema}.{meta} WHERE key = 'schema'").fetchone()[0]

    s = open_store()
    try:
        (done, running), more = s.list("alpha", order="asc")
        assert not more and version() == str(SCHEMA_VERSION)
        assert done.status == COMPLETED and done.videos == ["mp4"] and done.stats == {"tier": "miss"}
        assert done.params == {"prompt": "a red ball", "seed": 1} and done.progress == 100 and done.attempts == 1
        assert running.status == IN_PROGRESS and running.progress == 40 and running.attempts == 1
        assert not running.cancel_requested and running.worker == "w0"
        (queued,), _ = s.list("bravo")
        assert queued.status == QUEUED and s.queued_tenants() == ["bravo"]
        again, created = s.submit("alpha", {}, idempotency_key="k1", request_hash="h1")
        assert not created and again == done
        assert s.recover(3) == {"requeued": [running.id], "failed": [], "cancelled": []}
        assert s.claim("alpha", "w1").attempts == 2 and s.finish(running.id, 2, COMPLETED, stats={"tier": "exact"})
        assert [h["kind"] for h in s.history(running.id)] == ["submitted", "claimed", "requeued", "claimed", COMPLETED]
        assert s.counts() == {QUEUED: 1, IN_PROGRESS: 0, COMPLETED: 2, FAILED: 0, CANCELLED: 0}
        fresh, _ = s.submit("alpha", P)
        assert s.list("alpha")[0][0].id == fresh.id  # new rows follow the old ones
    finally:
        s.close()
    s = open_store()
    try:
        assert version() == str(SCHEMA_VERSION) and s.counts()[COMPLETED] == 2
    finally:
        s.close()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def fill(path: Path) -> Path:
    """Fill the file system of ``path`` to the last byte."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 16, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "8m"):
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_refuses_new_jobs_but_finishes_accepted_ones(small_disk):
    s = SqliteJobStore(small_disk)
    accepted = [s.submit("a", P)[0] for _ in range(3)]
    running = s.claim("a", "w")
    filler = fill(small_disk)
    with pytest.raises(StorageFull):
        for _ in range(200):  # a page or two may still fit
            s.submit("a", {**P, "prompt": "x" * 4000})
    assert s.healthy() is not None
    s.update_progress(running.id, running.attempts, 50)  # bookkeeping: never raises
    assert s.finish(running.id, running.attempts, FAILED, error={"type": "storage_error", "message": "disk full"})
    assert s.cancel("a", accepted[1].id).status == CANCELLED
    assert s.get("a", running.id).status == FAILED
    filler.unlink()
    assert s.healthy() is None  # room again: the reserve is back, new jobs are taken
    assert s.submit("a", P)[1]
    s.close()


def test_serve_command_line_mistakes_are_one_line(tmp_path, capsys):
    from carnator.cli import main

    def err(*argv) -> str:
        assert main(["serve", "--cache-dir", str(tmp_path / "c"), *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("carnator: error: "), lines
        return lines[0]

    assert "loopback only" in err("--host", "0.0.0.0")
    assert "no such file" in err("--keys", str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert "must map API keys to tenants" in err("--keys", str(bad))
    bad.write_text('{"short": "t"}')
    assert "at least 8 characters" in err("--keys", str(bad))
    bad.write_text("{nope")
    assert "is not JSON" in err("--keys", str(bad))
    assert "expected an integer" in err("--port", "70000")
    assert "--retention: expected a duration like 7d" in err("--retention", "soon")
    assert "--tenant-quota: expected a size" in err("--tenant-quota", "lots")


def test_a_late_event_subscriber_still_gets_the_running_attempts_decision():
    """The decision of a request that needs no probe comes milliseconds after its start, often before a client's event
    stream is open: the hub replays it to a later subscriber until the attempt ends (and never a previous attempt's)."""
    import asyncio

    from carnator.service.events import DONE, EventHub

    async def scenario():
        hub = EventHub()
        hub.publish("j", "in_progress", {"status": "in_progress"})
        hub.publish("j", "decision", {"reuse": False, "reason": "nothing cached asks the same"})
        late = hub.subscribe("j")
        first = await late.get(timeout=1)
        hub.publish("j", "progress", {"step": 1})
        await asyncio.sleep(0)
        second = await late.get(timeout=1)
        hub.publish("j", DONE, {"status": "completed"})
        after = hub.subscribe("j")
        replayed = await after.get(timeout=0.05)
        hub.publish("k", "decision", {"reuse": True})
        hub.publish("k", "queued", {"status": "queued"})   # requeued: a new attempt decides anew
        requeued = await hub.subscribe("k").get(timeout=0.05)
        return first, second, replayed, requeued

    first, second, replayed, requeued = asyncio.run(scenario())
    assert first == ("decision", {"reuse": False, "reason": "nothing cached asks the same"})
    assert second == ("progress", {"step": 1})
    assert replayed is None and requeued is None
