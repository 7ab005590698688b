"""The shared cache store (PostgreSQL + blobs through fsspec) as several replicas see it: index sync, one eviction
policy for the whole store, racing admissions, orphan blobs, damaged blobs, and PostgreSQL going down. Real
PostgreSQL (conftest's ``postgres_url``), real files; protocol-level behaviour is in test_cache_store.py, run against
both stores."""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from carnator.cache import VIDEO, StoreSpec, open_store
from carnator.cache.eviction import get_eviction
from carnator.cache.shared import SharedStore, parse_store_url
from carnator.cache.store import blob_key
from carnator.errors import CacheError

VID = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)


def _spec(emb=(1.0, 0.0), *, tenant="t", key="k", exact_key=None, prompt="a red ball", **kw) -> StoreSpec:
    return StoreSpec(tenant=tenant, compat_key=key, prompt=prompt, embedding=np.asarray(emb, np.float32),
                     tensors={f"traj.{i}": torch.full((64,), float(i)) for i in range(4)}, video=VID,
                     exact_key=exact_key, **kw)


@pytest.fixture
def two(pg_schema_url, tmp_path):
    """Two replicas of one shared store: separate connections, indices and read-through caches."""
    a = SharedStore(pg_schema_url, blobs=str(tmp_path / "blobs"))
    b = SharedStore(pg_schema_url, blobs=str(tmp_path / "blobs"))
    yield a, b
    a.close()
    b.close()


def _blob_files(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_file()}


def _expected_blobs(store: SharedStore) -> set[str]:
    return {blob_key(e.id, kind) for e in store.entries() for kind in ("tensors", "video")}


def test_store_urls_pick_the_store(tmp_path, pg_schema_url):
    assert type(open_store(f"sqlite:///{tmp_path}/a")).__name__ == "CacheBank"
    assert type(open_store(str(tmp_path / "b"))).__name__ == "CacheBank"
    with open_store(pg_schema_url, blobs=str(tmp_path / "blobs")) as s:
        assert isinstance(s, SharedStore) and s.schema.startswith("t_")
    with pytest.raises(CacheError, match="needs --blobs"):
        open_store(pg_schema_url)
    with pytest.raises(CacheError, match="only for a postgresql"):
        open_store(str(tmp_path / "c"), blobs=str(tmp_path))
    with pytest.raises(CacheError, match="unknown scheme 'redis'"):
        open_store("redis://localhost/0")
    with pytest.raises(CacheError, match="schema must be"):
        parse_store_url("postgresql://h/db?schema=Robert'); DROP")
    assert parse_store_url("postgresql://u@h:5/db?sslmode=disable&schema=s1") == ("postgresql://u@h:5/db?sslmode=disable", "s1")


def test_replicas_see_each_others_admissions_and_removals(two):
    a, b = two
    assert b.recall("t", "k", [1, 0]) == []
    x = a.admit(_spec([1, 0], exact_key="x"))
    y = a.admit(_spec([0.6, 0.8], exact_key="y"))
    assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [x, y]  # b's index synced from PostgreSQL
    z = b.admit(_spec([0.8, 0.6]))
    assert [m.id for m, _ in a.recall("t", "k", [1, 0])] == [x, z, y]
    assert a.evict([x]) == 1
    assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [z, y]  # the removal log reached b's index
    assert b.lookup_exact("t", "x") is None and b.load(x) is None
    np.testing.assert_array_equal(b.load(y, [VIDEO])[VIDEO].numpy(), VID)
    a.clear()  # a new epoch: every index rebuilds
    assert b.recall("t", "k", [1, 0]) == [] and len(b) == 0


def test_read_through_cache_serves_repeated_reads_locally(two):
    a, b = two
    e = a.admit(_spec(exact_key="e"))
    before = b.bytes_read
    for _ in range(3):
        np.testing.assert_array_equal(b.load(e, [VIDEO])[VIDEO].numpy(), VID)
    assert b.bytes_read - before == VID.nbytes  # shared storage read once, then the local cache
    assert b._blobs.hits == 2


def test_one_eviction_policy_for_the_whole_store(two, tmp_path):
    a, b = two
    size = a.get(a.admit(_spec())).nbytes
    a.clear()
    a.configure(capacity_bytes=3 * size, eviction="lru")
    assert b.stats().capacity_bytes == 3 * size  # b knows the bound from PostgreSQL
    ids = []
    for i in range(8):
        ids.append((a if i % 2 else b).admit(_spec([1, i], prompt=f"p{i}")))
    assert [e.id for e in a.entries()] == ids[-3:]  # LRU over both replicas' admissions
    assert _blob_files(Path(a.blobs_url)) == _expected_blobs(a)  # no blob of an evicted entry remains
    # LCBFU, decided in SQL, picks what the Python policy picks: the least benefit (steps_saved x uses) first
    b.configure(eviction="lcbfu")
    keep, low, high = ids[-3:]
    assert a.touch(low, steps_saved=1) and a.touch(high, steps_saved=30) and a.touch(high)
    expected = get_eviction("lcbfu").victims(a.entries(), 1)
    assert expected == [keep]  # never used: benefit 0
    b.admit(_spec([0, 1], prompt="new"))
    assert {e.id for e in a.entries()} == {low, high} | {e.id for e in a.entries() if e.prompt == "new"}
    with a._tx() as c:  # the kept byte total is the rows' sum
        assert a._db.total_bytes(c) == a.stats().bytes == 3 * size
    a.clear()
    with a._tx() as c:
        assert a._db.total_bytes(c) == 0


def test_racing_admissions_of_one_exact_request_leave_one_entry(two, tmp_path):
    """Two replicas finishing the same request at the same moment: one entry, and no blob without a row."""
    a, b = two
    for round_ in range(4):
        barrier = threading.Barrier(2)
        got: dict[str, str | None] = {}

        def admit(store, name, barrier=barrier, got=got, round_=round_):
            barrier.wait()
            got[name] = store.admit(_spec(exact_key=f"same-{round_}", prompt="the same request"))

        threads = [threading.Thread(target=admit, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got["a"] and got["b"] and got["a"] != got["b"]
        rows = [e for e in a.entries() if e.exact_key == f"same-{round_}"]
        assert len(rows) == 1 and rows[0].id in got.values()
        assert b.lookup_exact("t", f"same-{round_}").id == rows[0].id
    assert len(a) == 4
    assert _blob_files(Path(a.blobs_url)) == _expected_blobs(a)


def test_orphan_blobs_are_swept_only_after_the_grace_period(two, tmp_path):
    a, _ = two
    keep = a.admit(_spec())
    gone = a.admit(_spec((0.0, 1.0), exact_key="gone"))
    assert a.evict([gone]) == 1
    root = Path(a.blobs_url)
    staged = root / f".{blob_key('d' * 32, 'tensors')}.part"  # an admission that died before committing its row
    published = root / blob_key(gone, "video")  # a removed entry whose blob deletion failed
    staged.write_bytes(b"x")
    published.write_bytes(b"y")
    assert a.sweep() == [] and staged.exists() and published.exists()  # young: an admission may still commit
    old = time.time() - 3600
    for p in (staged, published):
        os.utime(p, (old, old))
    assert a.sweep() == sorted([staged.name, published.name])
    assert _blob_files(root) == _expected_blobs(a) and a.load(keep, [VIDEO]) is not None


def _drop_row(url: str, entry_id: str) -> None:
    """The database loses an entry's row behind the store's back (an operator's DELETE, a restored backup)."""
    import psycopg

    conninfo, schema = parse_store_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        assert conn.execute(f"DELETE FROM {schema}.entries WHERE id = %s", (entry_id,)).rowcount == 1


def test_verify_reports_entries_whose_row_the_database_lost(two, pg_schema_url, tmp_path, capsys):
    """An entry's row deleted while its blobs remain: ``verify`` names it as lost (the CLI exits 1), removes its
    blobs, and keeps the other entries; a second ``verify`` is clean."""
    from carnator.cli import main

    a, _ = two
    keep, lost = a.admit(_spec()), a.admit(_spec((0.0, 1.0), exact_key="lost"))
    _drop_row(pg_schema_url, lost)
    rc = main(["cache", "verify", "--store", pg_schema_url, "--blobs", str(tmp_path / "blobs")])
    out = capsys.readouterr().out
    assert rc == 1 and "lost: 1 " in out and lost in out and "\nok\n" not in out, out
    assert _blob_files(Path(a.blobs_url)) == _expected_blobs(a) == {blob_key(keep, k) for k in ("tensors", "video")}
    again = a.verify()
    assert again.ok and again.lost == [] and again.checked == 1 and a.load(keep, [VIDEO]) is not None


def test_stores_of_two_schemas_sharing_one_blobs_directory_keep_their_own_blobs(postgres_url, tmp_path):
    """Two schemas, one ``--blobs``: each store has a directory of its own under it, and ``verify`` of one (no grace
    period) neither reports nor removes the other's blobs."""
    sep = "&" if "?" in postgres_url else "?"
    with SharedStore(f"{postgres_url}{sep}schema=s_{uuid.uuid4().hex[:12]}", blobs=str(tmp_path / "blobs")) as one, \
            SharedStore(f"{postgres_url}{sep}schema=s_{uuid.uuid4().hex[:12]}", blobs=str(tmp_path / "blobs")) as two:
        ids = [two.admit(_spec((1.0, float(i)), exact_key=f"e{i}")) for i in range(4)]
        one.admit(_spec())
        rep = one.verify(orphan_grace_s=0)
        assert rep.ok and rep.lost == [] and rep.orphans_removed == [] and rep.checked == 1
        assert two.verify(orphan_grace_s=0).checked == 4 and all(two.load(i, [VIDEO]) is not None for i in ids)
        assert _blob_files(Path(two.blobs_url)) == _expected_blobs(two) and len(_expected_blobs(two)) == 8
        assert Path(one.blobs_url).parent == Path(two.blobs_url).parent == tmp_path / "blobs"
        assert one.blobs_url != two.blobs_url


def test_a_store_whose_blobs_lie_directly_under_blobs_moves_them_into_its_own_directory(pg_schema_url, tmp_path):
    """A store written before stores had blob directories (its blobs directly under ``--blobs``, no ``blob_dir`` in
    its meta table): opened writable, its entries' blobs move into its directory, and its entries load; blobs of
    other stores lying beside them are left where they are."""
    import psycopg

    root = tmp_path / "blobs"
    with SharedStore(pg_schema_url, blobs=str(root)) as s:
        ids = [s.admit(_spec((1.0, float(i)), exact_key=f"e{i}")) for i in range(3)]
        own = Path(s.blobs_url)
    for p in own.iterdir():  # the layout of a store made before blob directories
        if p.is_file():
            p.rename(root / p.name)
    shutil.rmtree(own)
    conninfo, schema = parse_store_url(pg_schema_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"DELETE FROM {schema}.meta WHERE key = 'blob_dir'")
    stranger = root / blob_key("f" * 32, "video")
    stranger.write_bytes(b"another store's blob")
    with SharedStore(pg_schema_url, blobs=str(root)) as s:
        assert Path(s.blobs_url) != root and _blob_files(Path(s.blobs_url)) == _expected_blobs(s)
        assert all(s.load(i, [VIDEO]) is not None for i in ids)
        assert s.verify(orphan_grace_s=0).ok and _blob_files(root) == {stranger.name}


@pytest.mark.parametrize("damage", ["bit flip", "deleted"])
def test_damaged_or_missing_blob_is_a_miss_and_quarantined(two, tmp_path, damage, caplog):
    a, b = two
    e = a.admit(_spec(exact_key="e"))
    path = Path(a.blobs_url) / blob_key(e, "video")
    if damage == "deleted":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert b.load(e, [VIDEO]) is None  # never the damaged bytes
    assert a.get(e) is None and a.lookup_exact("t", "e") is None  # gone for every replica
    assert ("lost a blob" if damage == "deleted" else "failed its checksum") in caplog.text
    quarantined = list((Path(a.blobs_url) / "quarantine").iterdir())
    assert (damage == "bit flip") == any(q.name.startswith(blob_key(e, "video")) for q in quarantined)
    assert _blob_files(Path(a.blobs_url)) == set()


def test_postgresql_down_degrades_to_misses_and_recovers(tmp_path, caplog, private_postgres):
    """PostgreSQL stops: no call raises; reads are misses, admissions store nothing, counted in ``unavailable``;
    once it is back the store serves hits again."""
    pg = private_postgres
    s = SharedStore(pg.url, blobs=str(tmp_path / "blobs"), retry_s=0.2)
    e = s.admit(_spec(exact_key="e"))
    pg.pause()
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert s.lookup_exact("t", "e") is None
        assert s.recall("t", "k", [1, 0]) == []
        assert s.get(e) is None and s.load(e) is None
        assert s.admit(_spec(exact_key="f")) is None
        assert s.touch(e) is False
        with s.single_flight("t", "f", timeout_s=5) as waited:
            assert waited is False
    assert s.unavailable >= 6
    assert caplog.text.count("shared cache store unavailable") == 1  # one warning per outage
    with pytest.raises(CacheError):
        s.stats()  # administrative calls say so
    pg.resume()
    time.sleep(0.3)
    assert s.lookup_exact("t", "e").id == e
    np.testing.assert_array_equal(s.load(e, [VIDEO])[VIDEO].numpy(), VID)
    s.close()


def test_cli_takes_a_store_url_and_says_what_is_wrong_in_one_line(pg_schema_url, tmp_path, capsys):
    from carnator.cli import main

    blobs = str(tmp_path / "blobs")
    with SharedStore(pg_schema_url, blobs=blobs) as s:
        s.admit(_spec(tenant="a"))
        s.admit(_spec(tenant="b"))
    assert main(["cache", "stats", "--store", pg_schema_url, "--blobs", blobs]) == 0
    out = capsys.readouterr().out
    assert "entries: 2" in out and "tenant a: 1 entries" in out and "SharedStore(" in out
    assert main(["cache", "verify", "--store", pg_schema_url, "--blobs", blobs]) == 0
    assert "checked: 2" in capsys.readouterr().out
    for argv, msg in [
        (["cache", "stats", "--store", pg_schema_url], "needs --blobs"),
        (["cache", "stats", "--store", "redis://h/0"], "unknown scheme"),
        (["cache", "stats", "--store", f"sqlite:///{tmp_path}/x", "--cache-dir", str(tmp_path)], "not both"),
        (["cache", "stats", "--blobs", blobs], "--blobs goes with --store"),
        (["cache", "stats", "--store", "postgresql://nobody@127.0.0.1:1/none", "--blobs", blobs], "cannot connect"),
        (["serve", "--store", "postgresql://nobody@127.0.0.1:1/none", "--blobs", blobs, "--cache-dir", str(tmp_path)],
         "cannot connect"),
        (["serve", "--ray-address", "auto", "--cache-dir", str(tmp_path)], "--ray-address goes with --replicas"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("carnator: error: ") and msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_server_on_a_shared_store_serves_dense_while_postgresql_is_down(tmp_path, private_postgres):
    """PostgreSQL stops under a running server whose job table is local: jobs still complete (misses, nothing stored),
    /metrics counts the calls served without the store, and once it is back the cache works again. A job table in that
    PostgreSQL (what ``carnator serve --store postgresql://`` uses) refuses new jobs meanwhile, says why in
    ``healthy``, and reconnects when it is back."""
    from carnator.service.jobs import JobStoreUnavailable, SqliteJobStore
    from carnator.service.pgjobs import PostgresJobStore
    from carnator.service.server import ServeConfig, Service

    pg = private_postgres
    svc = None
    try:
        svc = Service(ServeConfig(cache_dir=str(tmp_path / "ingress"), store=pg.url, blobs=str(tmp_path / "blobs"),
                                  allow_uncertified=True), store=SqliteJobStore(tmp_path / "ingress"))
        jobs = PostgresJobStore(pg.url, tmp_path / "videos")
        svc.engine.store._inner.retry_s = 0.2
        svc.start()

        def run(prompt):
            job, _ = svc.store.submit("default", {"prompt": prompt, "seed": 1, "num_inference_steps": 8})
            svc.pool.notify()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                j = svc.store.get("default", job.id)
                if j.status in ("completed", "failed", "cancelled"):
                    return j
                time.sleep(0.1)
            raise AssertionError("job did not finish")

        first = run("a red ball moving left on grass")
        assert first.status == "completed" and first.stats["stored"]
        pg.pause()
        down = run("a red ball moving left on grass")  # would be an exact hit
        assert down.status == "completed" and down.stats["tier"] == "miss" and not down.stats["stored"], down.stats
        m = re.search(rb"^carnator_cache_store_unavailable_total (\S+)$", svc.metrics.render(), re.MULTILINE)
        assert m and float(m.group(1)) >= 2
        assert "PostgreSQL" in (jobs.healthy() or "")
        with pytest.raises(JobStoreUnavailable):
            jobs.submit("default", {"prompt": "x"})
        assert not jobs.update_progress("video_x", 1, 5)  # bookkeeping: never raises
        # reads through the HTTP API meanwhile: a JSON 503 with Retry-After, not a 500
        from fastapi.testclient import TestClient

        from carnator.service.app import create_app

        local, svc.store = svc.store, jobs
        try:
            r = TestClient(create_app(svc)).get("/v1/videos/video_x")
        finally:
            svc.store = local
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert r.json()["error"]["type"] == "unavailable" and "PostgreSQL" in r.json()["error"]["message"]
        pg.resume()
        time.sleep(0.3)
        assert jobs.healthy() is None and jobs.submit("default", {"prompt": "x"})[1]
        jobs.close()
        again = run("a red ball moving left on grass")
        assert again.status == "completed" and again.stats["tier"] == "exact"
    finally:
        if svc is not None:
            svc.stop()
