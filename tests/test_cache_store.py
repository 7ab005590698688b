"""The cache store as the engine uses it: the CacheStore protocol, per-tensor lazy loads, stored settings, and the
hardening an outside fault test asked for (each test reproduces one finding). Real SQLite, real files, real
processes; every expected answer is known in advance."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from carnator.cache import VIDEO, CacheBank, CacheStore, StoreSpec, _faults
from carnator.cache.bank import BLOB_DIR, DB_FILE, QUARANTINE_DIR
from carnator.cache.journal import JOURNAL_FILE
from carnator.cache.store import blob_key
from carnator.cli import main
from carnator.errors import CacheError

VID = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)


def _traj(steps: int = 30, n: int = 64) -> dict[str, torch.Tensor]:
    return {f"traj.{i}": torch.full((n,), float(i)) for i in range(steps)}


def _spec(emb=(1.0, 0.0), *, tenant="t", key="k", exact_key=None, tensors=None, video=VID, **kw) -> StoreSpec:
    return StoreSpec(tenant=tenant, compat_key=key, prompt=kw.pop("prompt", "a red ball"), embedding=np.asarray(emb, np.float32),
                     tensors=_traj() if tensors is None else tensors, video=video, exact_key=exact_key, **kw)


def _blob(bank: CacheBank, entry_id: str, kind: str = "tensors") -> Path:
    return bank.root / BLOB_DIR / blob_key(entry_id, kind)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def bank(tmp_path):
    with CacheBank(tmp_path / "bank") as b:
        yield b


class CountingBlobs:
    """Any blob store, counting the bytes read through it."""

    def __init__(self, inner) -> None:
        self.inner, self.bytes_read, self.reads = inner, 0, []

    def read(self, key, offset=0, length=None):
        data = self.inner.read(key, offset, length)
        self.bytes_read += len(data)
        self.reads.append((key, offset, length))
        return data

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(params=["local", "shared"])
def open_store(request, tmp_path):
    """Opens the store under test (again: another opener of the same store): the local bank, or the shared store
    (a real PostgreSQL schema + a blob directory). Protocol-level tests run against both."""
    opened = []
    if request.param == "local":
        def factory():
            opened.append(CacheBank(tmp_path / "bank"))
            return opened[-1]
    else:
        from carnator.cache.shared import SharedStore

        url = request.getfixturevalue("pg_schema_url")

        def factory():
            opened.append(SharedStore(url, blobs=str(tmp_path / "blobs")))
            return opened[-1]
    yield factory
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store):
    return open_store()


def _blob_path(store, entry_id: str, kind: str = "tensors") -> Path:
    if isinstance(store, CacheBank):
        return _blob(store, entry_id, kind)
    return Path(store.blobs_url) / blob_key(entry_id, kind)


def _quarantine_dir(store) -> Path:
    return store.root / QUARANTINE_DIR if isinstance(store, CacheBank) else Path(store.blobs_url) / "quarantine"


def _put_lease(store, exact_key: str, expires: float) -> None:
    """A lease held by someone on another host (as a peer would leave it)."""
    if isinstance(store, CacheBank):
        with store._db.write() as conn:
            conn.execute("INSERT INTO leases VALUES ('t', ?, 'someone', 'another-host', 1, ?)", (exact_key, expires))
    else:
        with store._tx(write=True) as c:
            c.execute("INSERT INTO leases VALUES ('t', %s, 'someone', 'another-host', 1, %s)", (exact_key, expires))


# -- the protocol ---------------------------------------------------------------------------------


def test_bank_is_a_cache_store_and_keeps_its_word(store):
    assert isinstance(store, CacheStore)
    # admit -> id; lookup_exact finds it by (tenant, exact_key) only
    a = store.admit(_spec([1, 0], exact_key="e1", steps_saved=20, extra={"nouns": ["ball"]}))
    b = store.admit(_spec([0, 1], exact_key="e2"))
    other = store.admit(_spec([1, 0], tenant="u", exact_key="e1"))
    assert len({a, b, other}) == 3
    assert store.lookup_exact("t", "e1").id == a and store.lookup_exact("u", "e1").id == other
    assert store.lookup_exact("t", "nope") is None
    # get: metadata, with the names load can read
    meta = store.get(a)
    assert meta.tensor_names == tuple(sorted([*(f"traj.{i}" for i in range(30)), VIDEO])) and meta.has_video
    assert meta.extra == {"nouns": ["ball"]} and meta.steps_saved == 20 and store.get("nope") is None
    # recall: nearest first, within (tenant, compat_key)
    got = store.recall("t", "k", [1, 0.1], k=10)
    assert [m.id for m, _ in got] == [a, b] and got[0][1] == pytest.approx(1 / np.sqrt(1.01))
    assert store.recall("t", "other-key", [1, 0]) == []
    # load: all, some, the video; KeyError for names never admitted; None for unknown ids
    assert set(store.load(a)) == set(meta.tensor_names)
    np.testing.assert_array_equal(store.load(a, [VIDEO])[VIDEO].numpy(), VID)
    assert torch.equal(store.load(a, ["traj.29"])["traj.29"], torch.full((64,), 29.0))
    with pytest.raises(KeyError, match="no tensors named"):
        store.load(a, ["attn.0"])
    assert store.load("nope") is None
    # touch: recency and use count; False for a gone entry
    assert store.touch(a, steps_saved=25) and store.get(a).use_count == 1 and store.get(a).steps_saved == 25
    assert not store.touch("nope")
    # stats: counts and bytes, the store's settings; of one tenant when asked
    st = store.stats()
    assert (st.count, st.capacity_bytes, st.eviction) == (3, None, "lru")
    assert st.bytes == sum(e.nbytes for e in store.entries())
    assert store.stats("u").count == 1 and set(store.stats("u").tenants) == {"u"}
    # evict: how many existed
    assert store.evict([a, "nope"]) == 1 and store.get(a) is None and store.load(a) is None
    # single_flight: a free key is entered at once, not waited for
    with store.single_flight("t", "e9", timeout_s=5) as waited:
        assert waited is False
    # an entry without video serves no exact hit
    c = store.admit(_spec([1, 1], video=None, exact_key="e3"))
    assert not store.get(c).has_video
    with pytest.raises(KeyError):
        store.load(c, [VIDEO])


def test_video_is_reserved_for_the_video(store):
    with pytest.raises(ValueError, match="reserved"):
        store.admit(_spec(tensors={VIDEO: torch.zeros(3)}))
    with pytest.raises(TypeError, match="StoreSpec"):
        store.admit({"tenant": "t"})


# -- per-tensor lazy loads --------------------------------------------------------------------------


def test_exact_hit_reads_only_the_video_and_a_step_only_its_tensor(store):
    big = {f"traj.{i}": torch.randn(4096) for i in range(30)}  # 30 x 16 KiB of trajectory
    entry = store.admit(_spec(tensors=big, exact_key="e"))
    counter = CountingBlobs(store._blobs)
    store._blobs = counter
    out = store.load(store.lookup_exact("t", "e").id, [VIDEO])
    np.testing.assert_array_equal(out[VIDEO].numpy(), VID)
    assert counter.bytes_read == VID.nbytes  # the video's bytes, not a byte of trajectory
    assert [k for k, _, _ in counter.reads] == [blob_key(entry, "video")]
    counter.bytes_read = 0
    out = store.load(entry, ["traj.29"])
    assert torch.equal(out["traj.29"], big["traj.29"]) and counter.bytes_read == 4096 * 4
    counter.bytes_read = 0
    assert set(store.load(entry)) == {*big, VIDEO}  # everything: each blob read once
    assert counter.bytes_read <= os.path.getsize(_blob_path(store, entry)) + VID.nbytes


def test_the_same_request_under_two_readings_keeps_both_entries(store):
    """One cache used by two policies (a benchmark filling NIRVANA's entries beside carnator's): the second policy's
    admission of the same request (same exact key, another compatibility key) used to replace the first's entry, so
    the carnator policy found nothing to resume from. A re-admission under the same key still replaces."""
    a = store.admit(_spec(exact_key="e", key="carnator-reading"))
    b = store.admit(_spec(exact_key="e", key="nirvana-reading"))
    assert {m.id for m, _ in store.recall("t", "carnator-reading", np.array([1.0, 0.0]))} == {a}
    assert {m.id for m, _ in store.recall("t", "nirvana-reading", np.array([1.0, 0.0]))} == {b}
    assert store.lookup_exact("t", "e").id in (a, b)   # either serves the exact tier: both hold the video
    c = store.admit(_spec(exact_key="e", key="carnator-reading"))
    assert store.get(a) is None and {m.id for m, _ in store.recall("t", "carnator-reading", np.array([1.0, 0.0]))} == {c}
    assert store.get(b) is not None


def test_recall_by_content_finds_what_the_nearest_miss(store):
    """Hand-placed embeddings: the query's nearest two are other scenes; two entries ask what the query asks (content
    key "c") far away. Recall by content returns them after the nearest, best first, each with its own cosine; never an
    entry of another tenant or compatibility key, nor one admitted without a content key."""
    near = [store.admit(_spec((1.0, 0.1 * i), content_key="other")) for i in (1, 2)]
    far = store.admit(_spec((0.0, 1.0), content_key="c"))           # cosine 0 to the query
    mid = store.admit(_spec((1.0, 1.0), content_key="c"))           # cosine 0.7071
    store.admit(_spec((1.0, 0.0), content_key=None))                 # the query itself, but no content key
    store.admit(_spec((0.0, 1.0), content_key="c", tenant="u"))      # another tenant
    store.admit(_spec((0.0, 1.0), content_key="c", key="k2"))        # another compatibility key
    q = np.array([1.0, 0.0])
    plain = store.recall("t", "k", q, k=2)
    assert [m.id for m, _ in plain][1:] == [near[0]]
    found = store.recall("t", "k", q, k=2, content_key="c")
    assert [m.id for m, _ in found][:2] == [m.id for m, _ in plain]
    assert [(m.id, round(s, 4)) for m, s in found[2:]] == [(mid, 0.7071), (far, 0.0)]
    assert {m.content_key for m, _ in found[2:]} == {"c"}
    assert [m.id for m, _ in store.recall("t", "k", q, k=1, content_key="c")][1:] == [mid]   # at most k more
    assert store.recall("t", "k", q, k=2, content_key="none such") == plain


def test_recall_near_keys_adds_the_entries_one_edit_away_after_the_same_content(store):
    """With ``near_keys`` (content keys one edit away), recall returns, after the nearest and the same-content entries,
    the newest k entries admitted under any of those keys, best first by their own cosine; never one already returned,
    nor another tenant's."""
    near = store.admit(_spec((1.0, 0.1), content_key="other"))
    same = store.admit(_spec((0.0, 1.0), content_key="c"))
    e1 = store.admit(_spec((0.0, 1.0), content_key="e1"))           # cosine 0
    e2 = store.admit(_spec((1.0, 1.0), content_key="e2"))           # cosine 0.7071
    store.admit(_spec((1.0, 1.0), content_key="e2", tenant="u"))    # another tenant
    e3 = store.admit(_spec((-1.0, 1.0), content_key="e1"))          # the newest under e1
    q = np.array([1.0, 0.0])
    found = store.recall("t", "k", q, k=1, content_key="c", near_keys=["e1", "e2", "nothing"])
    assert [m.id for m, _ in found] == [near, same, e3]             # at most k = 1 more, the newest
    # the nearest three (a tie at cosine 0 goes to the older, "same"), then e1 and e3 by cosine (e2 is among the nearest)
    found = store.recall("t", "k", q, k=3, content_key="c", near_keys=["e1", "e2"])
    assert [(m.id, round(s, 4)) for m, s in found] == [(near, 0.995), (e2, 0.7071), (same, 0.0), (e1, 0.0), (e3, -0.7071)]
    assert store.recall("t", "k", q, k=3, near_keys=["other"]) == store.recall("t", "k", q, k=3)   # nothing new


def test_same_content_reads_the_entries_that_ask_the_same_without_an_embedding(store):
    """The newest entries admitted under a content key, newest first, at most k; never another tenant's, another
    compatibility key's, or one without that content key; nothing for a key no entry has."""
    a = store.admit(_spec((0.0, 1.0), content_key="c"))
    store.admit(_spec((1.0, 0.0), content_key="other"))
    b = store.admit(_spec((1.0, 1.0), content_key="c"))
    store.admit(_spec((1.0, 0.0), content_key=None))
    store.admit(_spec((0.0, 1.0), content_key="c", tenant="u"))
    store.admit(_spec((0.0, 1.0), content_key="c", key="k2"))
    c = store.admit(_spec((1.0, 0.5), content_key="c"))
    assert [m.id for m in store.same_content("t", "k", "c")] == [c, b, a]
    assert [m.id for m in store.same_content("t", "k", "c", k=2)] == [c, b]
    assert all(m.content_key == "c" and m.tenant == "t" for m in store.same_content("t", "k", "c"))
    assert store.same_content("t", "k", "none such") == [] and store.same_content("t", "k", "c", k=0) == []


def test_a_store_from_before_content_keys_gains_them(open_store):
    """A store written before entries had a content key (the column absent) opens, keeps its entries and indexes new
    ones by content."""
    s = open_store()
    old = s.admit(_spec((1.0, 0.0)))
    if isinstance(s, CacheBank):
        with s._db.write() as conn:
            conn.execute("DROP INDEX entries_content")
            conn.execute("ALTER TABLE entries DROP COLUMN content_key")
    else:
        with s._tx(write=True) as c:
            c.execute("ALTER TABLE entries DROP COLUMN content_key")
    s.close()
    s = open_store()
    assert s.get(old).content_key is None
    new = s.admit(_spec((0.0, 1.0), content_key="c"))
    assert [m.id for m, _ in s.recall("t", "k", np.array([1.0, 0.0]), k=1, content_key="c")] == [old, new]


def test_one_bad_tensor_quarantines_the_entry_and_nothing_corrupt_is_served(store, caplog):
    entry = store.admit(_spec(exact_key="e"))
    path = _blob_path(store, entry)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    lo, _ = header["traj.3"]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[8 + header_len + lo + 1] ^= 0x40  # one bit of traj.3
    path.write_bytes(bytes(raw))
    assert torch.equal(store.load(entry, ["traj.4"])["traj.4"], torch.full((64,), 4.0))  # intact tensors are intact
    np.testing.assert_array_equal(store.load(entry, [VIDEO])[VIDEO].numpy(), VID)  # the video is its own blob
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert store.load(entry, ["traj.3"]) is None
    assert "traj.3" in caplog.text and "failed its checksum" in caplog.text
    assert store.get(entry) is None and store.lookup_exact("t", "e") is None and store.load(entry, [VIDEO]) is None
    assert sorted(p.name.split(".")[1] for p in _quarantine_dir(store).iterdir()) == ["tensors", "video"]


def test_old_format_directory_gets_a_clear_error(tmp_path):
    (tmp_path / "VERSION").write_text("carnator-cache 1\n")
    with pytest.raises(CacheError, match="uses format version 1, this carnator reads version 2"):
        CacheBank(tmp_path)


# -- settings are the store's ---------------------------------------------------------------------


def test_capacity_is_the_stores_not_the_openers(open_store):
    """A CLI generate grew a 40 MB-capped folder to 52.5 MB while `cache stats` said unbounded: the cap was the
    opener's. Now it is stored: another opener (another process) keeps it, and stats tells it."""
    with open_store() as probe:
        size = probe.get(probe.admit(_spec())).nbytes
        probe.clear()
    with open_store() as first:
        assert first.configure(capacity_bytes=3 * size, eviction="lcbfu").capacity_bytes == 3 * size
    with open_store() as second:  # knows nothing of the cap but what the store says
        assert (second.stats().capacity_bytes, second.stats().eviction) == (3 * size, "lcbfu")
        ids = [second.admit(_spec(prompt=f"p{i}")) for i in range(5)]
        assert second.stats().bytes <= 3 * size and second.stats().count == 3
        assert [e.id for e in second.entries()] == ids[2:]
        # lowering the cap evicts at once; raising it keeps everything; None is unbounded
        assert second.configure(capacity_bytes=size).capacity_bytes == size
        assert [e.id for e in second.entries()] == ids[4:]
        second.configure(capacity_bytes=None)
        assert second.stats().capacity_bytes is None and second.stats().eviction == "lcbfu"
        second.admit(_spec())
        second.admit(_spec())
        assert second.stats().count == 3


def test_a_tenant_past_its_quota_evicts_its_own_oldest_entries_first(open_store):
    """With a per-tenant quota of 2 entries' bytes, a tenant's third admission evicts that tenant's oldest entry,
    never another tenant's (even where that one is older and least recently used); the quota is the store's, kept
    for every opener; an entry larger than the quota is not stored."""
    with open_store() as probe:
        size = probe.get(probe.admit(_spec())).nbytes
        probe.clear()
    with open_store() as first:
        assert first.configure(tenant_quota_bytes=2 * size).tenant_quota_bytes == 2 * size
    with open_store() as s:
        other = s.admit(_spec(tenant="b", prompt="b0"))
        mine = [s.admit(_spec(tenant="a", prompt=f"a{i}")) for i in range(4)]
        assert [e.id for e in s.entries("a")] == mine[2:]
        assert [e.id for e in s.entries("b")] == [other]
        s.configure(tenant_quota_bytes=None)
        s.admit(_spec(tenant="a", prompt="a4"))
        assert s.stats("a").count == 3
        s.configure(tenant_quota_bytes=size // 2)
        assert s.admit(_spec(tenant="c", prompt="c0")) is None and s.stats("c").count == 0


# -- hardening: unreadable blobs --------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["directory", "symlink-loop"])
def test_unreadable_blob_is_a_miss_not_a_crash(bank, damage, caplog):
    """A stored tensor file replaced by a directory made IsADirectoryError escape verify and generate: any OSError
    on reading a blob now quarantines the entry (a miss); a missing file stays "missing"."""
    bad = bank.admit(_spec(exact_key="bad"))
    good = bank.admit(_spec(exact_key="good"))
    path = _blob(bank, bad, "video")
    path.unlink()
    if damage == "directory":
        path.mkdir()
        (path / "x").write_bytes(b"1")
    else:
        os.symlink(path.name, path)  # ELOOP: too many levels of symbolic links
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert bank.load(bad, [VIDEO]) is None
    assert "cannot read blob" in caplog.text and bank.get(bad) is None
    assert not os.path.lexists(path)  # moved to quarantine/
    assert bank.load(good, [VIDEO]) is not None
    # verify meets the same damage on another entry: reports it, does not raise
    other = bank.admit(_spec(exact_key="other"))
    _blob(bank, other).unlink()
    _blob(bank, other).mkdir()
    gone = bank.admit(_spec(exact_key="gone"))
    _blob(bank, gone, "video").unlink()
    report = bank.verify()
    assert report.quarantined == [other] and report.missing == [gone] and report.checked == 1 and not report.ok


# -- hardening: the database ------------------------------------------------------------------------


def test_bad_schema_byte_is_recovered_not_a_crash(tmp_path, caplog):
    """One bad byte in the schema text gave UnicodeDecodeError at the journal-mode pragma, so recovery never ran."""
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        ids = [b.admit(_spec(prompt=f"p{i}")) for i in range(3)]
    db = root / DB_FILE
    raw = bytearray(db.read_bytes())
    at = raw.find(b"CREATE TABLE entries")
    assert at > 0
    raw[at + 7] = 0xFF
    db.write_bytes(bytes(raw))
    with sqlite3.connect(db) as probe, pytest.raises(UnicodeDecodeError):  # the finding, as it was
        probe.execute("PRAGMA journal_mode").fetchone()
    probe.close()
    with caplog.at_level(logging.WARNING, logger="carnator.cache"), CacheBank(root) as b:
        assert "corrupt" in caplog.text and b.entries() == []
        report = b.verify()
        assert sorted(report.lost) == sorted(ids) and not report.ok
        (line,) = report.recoveries
        assert "damaged schema text" in line and "3 with blobs on disk" in line
        assert b.load(b.admit(_spec()), [VIDEO]) is not None  # and the store works again
        assert b.verify().ok


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_lost_database_is_reported_by_verify_and_the_cli(tmp_path, capsys, how):
    """bank.sqlite deleted (or truncated to nothing) silently started an empty store and verify said ok. Now the
    recreation is journalled and the blobs without rows are reported as lost; `cache verify` exits 1."""
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        ids = sorted(b.admit(_spec(prompt=f"p{i}")) for i in range(4))
    db = root / DB_FILE
    if how == "deleted":
        db.unlink()
    else:
        db.write_bytes(b"")
    assert main(["cache", "verify", "--cache-dir", str(root)]) == 1
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert f"lost: 4 entries whose metadata is gone ({', '.join(ids)})" in out
    assert any(line.strip().startswith("recovered:") and f"was {'missing' if how == 'deleted' else 'emptied'}" in line
               and "4 with blobs on disk" in line for line in lines)
    assert lines[-1] == "2 problem(s) found; repaired"
    assert main(["cache", "verify", "--cache-dir", str(root)]) == 0  # reported once; the lost blobs are gone
    assert capsys.readouterr().out.strip().endswith("ok") and not list((root / BLOB_DIR).iterdir())
    events = [json.loads(x) for x in (root / JOURNAL_FILE).read_text().splitlines() if x.strip()]
    assert [e.get("event") for e in events if "event" in e] == ["missing" if how == "deleted" else "emptied"]


_COMMIT_AND_DIE = """
    import os, sys
    import numpy as np, torch
    from carnator.cache import CacheBank, StoreSpec
    bank = CacheBank(sys.argv[1])
    bank._db.conn.execute("PRAGMA wal_autocheckpoint = 0")  # keep every commit in the WAL, as a busy store does
    for i in range(int(sys.argv[2])):
        print(bank.admit(StoreSpec(tenant="t", compat_key="k", prompt=f"p{i}", embedding=np.ones(2, np.float32),
                                   tensors={"x": torch.full((64,), float(i))})), flush=True)
    os._exit(0)  # like kill -9 once committed: no checkpoint, the rows live in bank.sqlite-wal only
"""


@pytest.mark.parametrize("damage", ["delete-wal", "garble-wal"])
def test_lost_wal_is_reported_as_lost_entries(tmp_path, damage):
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        kept = b.admit(_spec())  # checkpointed into bank.sqlite when b closes
    done = _python(_COMMIT_AND_DIE, root, 3)
    assert done.returncode == 0, done.stderr
    committed = sorted(done.stdout.split())
    wal = Path(f"{root / DB_FILE}-wal")
    assert wal.stat().st_size > 0
    if damage == "delete-wal":
        wal.unlink()
    else:
        raw = bytearray(wal.read_bytes())
        for i in range(32, len(raw), 97):  # frame headers and pages: checksums no longer match
            raw[i] ^= 0x5A
        wal.write_bytes(bytes(raw))
    with CacheBank(root) as b:
        assert [e.id for e in b.entries()] == [kept]  # SQLite dropped the WAL's commits...
        report = b.verify()
        assert report.lost == committed and not report.ok  # ...and verify says so
        assert b.verify().ok


# -- hardening: disk full ---------------------------------------------------------------------------


def test_disk_full_in_sqlite_fails_admit_cleanly_and_touch_not_at_all(bank, caplog):
    """SQLite's max_page_count makes it report "database or disk is full" for real."""
    first = bank.admit(_spec(exact_key="first"))
    conn = bank._db.conn
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(CacheError, match="full"):
        for i in range(200):  # new rows need new pages soon
            bank.admit(_spec(prompt="p" * 2000 + str(i)))
    staged = [p for p in (bank.root / BLOB_DIR).iterdir() if p.name.endswith(".part")]
    assert staged == []  # the refused admission left nothing behind
    assert all(bank.load(e.id) is not None for e in bank.entries())  # what is there is whole
    assert bank.touch(first) in (True, False)  # never raises
    conn.execute("PRAGMA max_page_count = 1073741823")
    assert bank.load(bank.admit(_spec(prompt="after")), [VIDEO]) is not None


def test_blob_write_enospc_raises_cache_error_and_leaves_nothing(bank, monkeypatch):
    def full(name):
        if name == "blob_write":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_faults, "fault_point", full)
    with pytest.raises(CacheError, match="No space left"):
        bank.admit(_spec())
    assert list((bank.root / BLOB_DIR).iterdir()) == [] and len(bank) == 0


def test_touch_on_a_locked_database_returns_false_with_one_warning(tmp_path, caplog):
    with CacheBank(tmp_path / "bank", busy_timeout_s=0.2) as b:
        entry = b.admit(_spec())
        other = sqlite3.connect(tmp_path / "bank" / DB_FILE, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with caplog.at_level(logging.DEBUG, logger="carnator.cache"):
                t0 = time.monotonic()
                assert b.touch(entry) is False and b.touch(entry) is False
                assert time.monotonic() - t0 < 5
        finally:
            other.execute("ROLLBACK")
            other.close()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "could not record a use" in r.getMessage()]
        assert len(warnings) == 1  # once, then DEBUG
        assert b.touch(entry) and b.get(entry).use_count == 1


# -- hardening: duplicate work --------------------------------------------------------------------


def _flight_worker(root: str, log_path: str, hold_s: float, barrier) -> None:
    with CacheBank(root) as b:
        barrier.wait(60)  # all arrive at once, as the duplicate requests did
        with b.single_flight("t", "same-request", timeout_s=60) as waited:
            _hold(log_path, hold_s, waited)


def _hold(log_path: str, hold_s: float, waited: bool) -> None:
    """The body only one process may run at a time: stands for generating the request."""
    start = time.time()
    time.sleep(hold_s)
    with open(log_path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "start": start, "end": time.time(), "waited": waited}) + "\n")


def _die_holding(root: str) -> None:
    b = CacheBank(root)
    cm = b.single_flight("t", "same-request", timeout_s=600)
    cm.__enter__()
    os._exit(0)  # dies holding the lease


@pytest.mark.slow
def test_single_flight_runs_one_holder_at_a_time_across_processes(tmp_path):
    """The same request arriving at once in several processes was generated by each. With single_flight only one
    holds the right at a time; the others are told they waited (and look the exact key up again)."""
    root = str(tmp_path / "bank")
    CacheBank(root).close()
    log_path = tmp_path / "flights.jsonl"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_flight_worker, args=(root, str(log_path), 0.4, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = sorted((json.loads(x) for x in log_path.read_text().splitlines()), key=lambda r: r["start"])
    assert len(rows) == 3
    for before, after in zip(rows, rows[1:], strict=False):
        assert after["start"] >= before["end"] - 0.01  # never two holders at once
    assert [r["waited"] for r in rows] == [False, True, True]  # the first ran; the other two waited for it
    # A holder that died (its pid is gone) does not block the next caller for the lease's 600 s.
    dead = ctx.Process(target=_die_holding, args=(root,))
    dead.start()
    dead.join(60)
    with CacheBank(root) as b:
        t0 = time.monotonic()
        with b.single_flight("t", "same-request", timeout_s=30) as waited:
            assert time.monotonic() - t0 < 5
        assert waited is False  # taken over at once: nobody was really running it


def test_single_flight_between_threads_and_expired_leases(store):
    import threading

    order: list[str] = []
    entered = threading.Event()

    def holder():
        with store.single_flight("t", "k1", timeout_s=30):
            entered.set()
            time.sleep(0.3)
            order.append("holder done")

    th = threading.Thread(target=holder)
    th.start()
    entered.wait(5)
    with store.single_flight("t", "k1", timeout_s=30) as waited:
        order.append("waiter in")
    th.join()
    assert order == ["holder done", "waiter in"] and waited is True
    # A lease past its expiry (a holder stuck or gone elsewhere) is taken over.
    _put_lease(store, "k2", time.time() - 1)
    with store.single_flight("t", "k2", timeout_s=30) as waited:
        assert waited is False
    # Waiting past timeout_s enters anyway (warning): a stuck peer never blocks a request forever.
    _put_lease(store, "k3", time.time() + 600)
    t0 = time.monotonic()
    with store.single_flight("t", "k3", timeout_s=0.3) as waited:
        assert waited is True and 0.25 <= time.monotonic() - t0 < 5


# -- hardening: tenant scoping --------------------------------------------------------------------


def test_stats_and_verify_are_scoped_to_a_tenant(bank, capsys):
    a = bank.admit(_spec(tenant="a"))
    b = bank.admit(_spec(tenant="b"))
    _blob(bank, a).write_bytes(b"garbage")
    st = bank.stats("b")
    assert (st.count, list(st.tenants)) == (1, ["b"]) and st.bytes == bank.get(b).nbytes
    report = bank.verify(tenant="b")
    assert report.ok and report.checked == 1 and report.tenant == "b"
    assert bank.get(a) is not None  # a's entry was not b's to check or touch
    assert main(["cache", "stats", "--cache-dir", str(bank.root), "--tenant", "b"]) == 0
    out = capsys.readouterr().out
    assert "tenant b: 1 entries" in out and "tenant a" not in out
    assert bank.verify().quarantined == [a]


# -- hardening: read-only directories ---------------------------------------------------------------


def _write_probe_fails(directory: Path) -> bool:
    try:
        (directory / ".probe").write_text("x")
    except OSError:
        return True
    (directory / ".probe").unlink()
    return False


def _filled(root: Path) -> dict[str, str]:
    with CacheBank(root) as b:
        ids = {"good": b.admit(_spec([1, 0], exact_key="e")), "bad": b.admit(_spec([0, 1], exact_key="f"))}
    _blob_path = root / BLOB_DIR / blob_key(ids["bad"], "video")
    raw = bytearray(_blob_path.read_bytes())
    raw[-1] ^= 0xFF
    _blob_path.write_bytes(bytes(raw))
    return ids


def _exercise_read_only(root: Path) -> dict:
    """What a read-only bank does; run in this process and (as a non-root user) in a child."""
    logging.basicConfig(level=logging.WARNING)
    with CacheBank(root) as b:
        hit = b.lookup_exact("t", "e")
        video = b.load(hit.id, [VIDEO])[VIDEO]
        bad = b.lookup_exact("t", "f")
        report = b.verify()
        out = {
            "read_only": b.read_only,
            "entries": len(b.entries()),
            "stats": b.stats().count,
            "video_ok": bool(np.array_equal(video.numpy(), VID)),
            "recall": [m.id for m, _ in b.recall("t", "k", [1, 0])],
            "bad_load": b.load(bad.id, [VIDEO]) is None,
            "bad_still_listed": b.get(bad.id) is not None,
            "verify_quarantined": report.quarantined,
            "verify_read_only": report.read_only,
            "verify_ok": report.ok,
            "admit": b.admit(_spec()),
            "admit_again": b.admit(_spec()),
            "touch": b.touch(hit.id),
        }
        for action in (lambda: b.configure(capacity_bytes=1000), lambda: b.clear(), lambda: b.evict([hit.id])):
            try:
                action()
                out.setdefault("refused", []).append(False)
            except CacheError as exc:
                out.setdefault("refused", []).append("read-only" in str(exc))
    return out


def _check_read_only_outcome(out: dict, ids: dict[str, str]) -> None:
    assert out["read_only"] and out["entries"] == 2 and out["stats"] == 2 and out["video_ok"]
    assert out["recall"] == [ids["good"], ids["bad"]]
    assert out["bad_load"] and out["bad_still_listed"]  # a miss, nothing repaired
    assert out["verify_quarantined"] == [ids["bad"]] and out["verify_read_only"] and not out["verify_ok"]
    assert out["admit"] is None and out["admit_again"] is None and out["touch"] is False
    assert out["refused"] == [True, True, True]


def test_read_only_directory_serves_and_reports_without_repairing(tmp_path, caplog):
    """A read-only cache directory could not even be listed. chmod -R a-w: it opens read-only and serves. As root,
    chmod does not stop writes (the probe shows it), so the bank's own check of the permission bits is what puts it
    in read-only mode there; the child below exercises a real permission denial as an unprivileged user."""
    root = tmp_path / "bank"
    ids = _filled(root)
    before = {p.name: p.stat().st_mtime_ns for p in (root / BLOB_DIR).iterdir()}
    subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
    try:
        assert _write_probe_fails(root) == (os.geteuid() != 0)  # as root, chmod stops nothing: the bank checks the bits
        with caplog.at_level(logging.WARNING, logger="carnator.cache"):
            out = _exercise_read_only(root)
        _check_read_only_outcome(out, ids)
        assert sum("read-only: results are not stored" in r.getMessage() for r in caplog.records) == 1  # one warning
        assert {p.name: p.stat().st_mtime_ns for p in (root / BLOB_DIR).iterdir()} == before  # nothing moved
        assert not list((root / QUARANTINE_DIR).iterdir())
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
    # Explicitly read-only (e.g. a snapshot someone shares) works on a writable directory too.
    with CacheBank(root, read_only=True) as b:
        assert b.read_only and b.admit(_spec()) is None and len(b) == 2


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the child as an unprivileged user (as a normal user, the "
                           "in-process test above already meets real permission denials)")
def test_read_only_directory_for_an_unprivileged_user(tmp_path):
    """As root, chmod does not stop writes; run the same checks as user nobody, for whom it does (SQLite then cannot
    even create its -shm file, so the bank reads the database as immutable)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="carnator-ro-"))  # tmp_path's parents are closed to other users
    try:
        os.chmod(base, 0o755)
        root = base / "bank"
        ids = _filled(root)
        subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
        code = f"""
            import json, sys
            sys.path[:0] = {[str(Path(__file__).resolve().parent), *sys.path]!r}
            from test_cache_store import _exercise_read_only
            from pathlib import Path
            print(json.dumps(_exercise_read_only(Path({str(root)!r}))))
        """
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                             cwd=str(Path(__file__).resolve().parent.parent), env={**_env(), "HOME": str(base)})
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        _check_read_only_outcome(out, ids)
        assert sorted(os.listdir(root)) == sorted(["VERSION", DB_FILE, BLOB_DIR, QUARANTINE_DIR])  # wrote nothing
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(base)], check=True)
        shutil.rmtree(base, ignore_errors=True)


# -- the CLI ----------------------------------------------------------------------------------------


def test_cache_config_cli(tmp_path, capsys):
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        for i in range(3):
            b.admit(_spec(prompt=f"p{i}"))
        size = b.entries()[0].nbytes
    assert main(["cache", "config", "--cache-dir", str(root)]) == 0
    assert "capacity: unbounded  eviction: lru" in capsys.readouterr().out
    assert main(["cache", "config", "--cache-dir", str(root), "--capacity", str(2 * size), "--eviction", "lcbfu"]) == 0
    assert f"capacity: {2 * size} B" in capsys.readouterr().out
    assert main(["cache", "stats", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "entries: 2" in out and f"capacity: {2 * size} B" in out and "eviction: lcbfu" in out  # evicted at once
    assert main(["cache", "config", "--cache-dir", str(root), "--capacity", "2GiB"]) == 0
    assert "capacity: 2147483648 B (2.1 GB)" in capsys.readouterr().out
    assert main(["cache", "config", "--cache-dir", str(root), "--capacity", "40MB"]) == 0
    assert "capacity: 40000000 B (40.0 MB)  eviction: lcbfu" in capsys.readouterr().out
    assert main(["cache", "config", "--cache-dir", str(root), "--capacity", "none"]) == 0
    assert "capacity: unbounded" in capsys.readouterr().out
    for bad in ("lots", "-5MB", "0", "12XB"):
        assert main(["cache", "config", "--cache-dir", str(root), f"--capacity={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("carnator: error: --capacity: expected a size") or "more than 0" in err[0]
    assert main(["cache", "ls", "--cache-dir", str(root), "--capacity", "1MB"]) == 2
    assert "go with `carnator cache config`" in capsys.readouterr().err


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_a_store_written_by_carnator_72f574c_opens_and_migrates_in_place(db, tmp_path, request):
    """``tests/stores/cache-72f574c.*``: stores carnator 72f574c's own code wrote (three entries, one under a content
    key; the bank's capacity set): their metadata dumped as SQL, their blob files (``.blobs``) put back where that
    version kept them (the shared store's directly under ``--blobs``). This release opens them writable: the schema
    version is recorded, every entry verifies against the checksums 72f574c recorded and loads, recall and the exact
    tier find them, the shared store's blobs move into its own directory, and new entries join the old ones."""
    from carnator.cache.schema import SCHEMA_VERSION

    text = (Path(__file__).parent / "stores" / f"cache-72f574c.{db}.sql").read_text()
    if db == "sqlite":
        root = tmp_path / "bank"
        (root / BLOB_DIR).mkdir(parents=True)
        (root / QUARANTINE_DIR).mkdir()
        with sqlite3.connect(root / DB_FILE) as c:
            c.executescript(text)
        (root / "VERSION").write_text("carnator-cache 2\n")
        blob_dir = root / BLOB_DIR

        def open_store():
            return CacheBank(root)

        def version(s):
            return s._db.get_meta("schema_version")
    else:
        from carnator.cache.shared import SharedStore
        from conftest import load_pg_dump

        url = request.getfixturevalue("pg_schema_url")
        load_pg_dump(url, text)
        blob_dir = tmp_path / "blobs"
        (blob_dir / "quarantine").mkdir(parents=True)

        def open_store():
            return SharedStore(url, blobs=str(blob_dir))

        def version(s):
            with s._tx() as c:
                return s._db.get_meta("schema_version", c)

    for blob in (Path(__file__).parent / "stores" / f"cache-72f574c.{db}.blobs").iterdir():
        shutil.copyfile(blob, blob_dir / blob.name)  # where 72f574c kept them
    rows = re.findall(r"'([0-9a-f]{32})',\s*'t',\s*'k',\s*'e(\d)'", text)
    assert len(rows) == 3
    ids = {int(i): entry_id for entry_id, i in rows}
    s = open_store()
    try:
        assert version(s) == str(SCHEMA_VERSION) and len(s) == 3
        assert s.stats().capacity_bytes == (10**7 if db == "sqlite" else None)
        rep = s.verify(orphan_grace_s=0)
        assert rep.ok and rep.checked == 3 and rep.lost == [], rep
        for i, entry_id in ids.items():
            assert torch.equal(s.load(entry_id, ["traj.2"])["traj.2"], torch.full((64,), float(2 + i)))
            assert s.lookup_exact("t", f"e{i}").id == entry_id and s.get(entry_id).seed == i
        assert [m.id for m, _ in s.recall("t", "k", np.array([1.0, 2.0]), k=1)] == [ids[2]]
        assert [m.id for m in s.same_content("t", "k", "c")] == [ids[1]]
        if db == "postgresql":
            assert Path(s.blobs_url).parent == blob_dir and not list(blob_dir.glob("*.safetensors"))
        new = s.admit(_spec((1.0, 5.0), content_key="c"))
        assert [m.id for m in s.same_content("t", "k", "c")] == [new, ids[1]] and len(s) == 4
    finally:
        s.close()
    s = open_store()  # opened again: nothing to do
    try:
        assert version(s) == str(SCHEMA_VERSION) and len(s) == 4 and s.verify().ok
    finally:
        s.close()
