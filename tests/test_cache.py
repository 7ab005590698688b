"""Tests of the persistent cache bank (carnator.cache), with hand-computed expected answers."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from carnator.cache import (
    LCBFU,
    LRU,
    VIDEO,
    CacheBank,
    EntryMeta,
    EvictionPolicy,
    StoreSpec,
    available_backends,
    compat_key,
    default_cache_dir,
    eviction_policies,
    get_eviction,
    register_eviction,
)
from carnator.cache._faults import POINTS
from carnator.cache.bank import BLOB_DIR, DB_FILE, QUARANTINE_DIR, VERSION_FILE
from carnator.cache.store import blob_key
from carnator.errors import CacheError, CarnatorError

HAS_FAISS = "faiss" in available_backends()
BACKENDS = ["numpy"] + (["faiss"] if HAS_FAISS else [])


class Clock:
    """A manual clock, so LRU order does not depend on timing."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _spec(emb, *, tenant="t", key="k", n=16, **kw) -> StoreSpec:
    return StoreSpec(
        tenant=tenant,
        compat_key=key,
        prompt=kw.pop("prompt", "a cat"),
        embedding=np.asarray(emb, dtype=np.float32),
        tensors=kw.pop("tensors", {"x": torch.arange(n, dtype=torch.float32)}),
        **kw,
    )


def _admit(bank: CacheBank, emb, **kw) -> str:
    entry_id = bank.admit(_spec(emb, **kw))
    assert entry_id is not None
    return entry_id


def _tensor_blob(bank: CacheBank, entry_id: str) -> Path:
    return bank.root / BLOB_DIR / blob_key(entry_id, "tensors")


def _meta(id_: str, *, last_used: float, use_count: int = 0, steps_saved: float = 0.0, nbytes: int = 10) -> EntryMeta:
    return EntryMeta(
        id=id_, tenant="t", compat_key="k", exact_key=None, prompt="p", negative_prompt=None, seed=0,
        created=0.0, last_used=last_used, use_count=use_count, steps_saved=steps_saved, nbytes=nbytes,
        embedding=np.zeros(2, np.float32),
    )


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def bank(tmp_path):
    with CacheBank(tmp_path / "bank", clock=Clock()) as b:
        yield b


# -- round trip ---------------------------------------------------------------------------------


def test_round_trip_is_bit_exact(bank):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    tensors = {
        "f32": torch.randn(2, 3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(3, 3, generator=g).bfloat16(),
        "i64": torch.tensor([-(2**62), 0, 2**62 + 1]),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "transposed": base.t(),  # non-contiguous
        "alias": base,  # shares storage with "transposed"
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }
    entry_id = _admit(bank, [1, 0], tensors=tensors, seed=2**64 - 1, negative_prompt="blurry",
                      steps_saved=12.5, extra={"nouns": ["cat"], "sig": np.float32(0.25)})
    out = bank.load(entry_id)
    assert out is not None and set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert _bytes(out[name]) == _bytes(t), name
    assert list(bank.load(entry_id, names=["i64"])) == ["i64"]
    with pytest.raises(KeyError):
        bank.load(entry_id, names=["nope"])
    meta = bank.get(entry_id)
    assert (meta.seed, meta.negative_prompt, meta.steps_saved) == (2**64 - 1, "blurry", 12.5)
    assert meta.extra == {"nouns": ["cat"], "sig": 0.25}
    assert meta.nbytes == os.path.getsize(_tensor_blob(bank, entry_id))
    assert meta.tensor_names == tuple(sorted(tensors)) and not meta.has_video
    np.testing.assert_array_equal(meta.embedding, np.array([1, 0], np.float32))
    assert bank.load("no-such-id") is None


def test_entries_survive_reopen(tmp_path):
    with CacheBank(tmp_path) as b:
        entry_id = _admit(b, [0.5, 0.5, 0.0], exact_key="e1")
        before = b.get(entry_id)
    with CacheBank(tmp_path) as b:
        assert b.get(entry_id) == before
        assert b.lookup_exact("t", "e1") == before
        assert torch.equal(b.load(entry_id)["x"], torch.arange(16, dtype=torch.float32))
        assert (tmp_path / VERSION_FILE).read_text() == "carnator-cache 2\n"


# -- recall -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_recall_matches_hand_computed_cosines(tmp_path, backend):
    with CacheBank(tmp_path, index_backend=backend) as b:
        ids = {
            name: _admit(b, vec)
            for name, vec in [("opposite", [-1, 0, 0]), ("orthogonal", [0, 2, 0]), ("same", [5, 0, 0]),
                              ("diag", [1, 1, 0]), ("three_four", [3, 4, 0])]
        }
        got = b.recall("t", "k", np.array([2.0, 0.0, 0.0]), k=10)
        expected = [("same", 1.0), ("diag", 1 / math.sqrt(2)), ("three_four", 0.6), ("orthogonal", 0.0),
                    ("opposite", -1.0)]
        assert [m.id for m, _ in got] == [ids[n] for n, _ in expected]
        for (_, score), (_, want) in zip(got, expected, strict=True):
            assert score == pytest.approx(want, abs=1e-6)
        top2 = b.recall("t", "k", [2.0, 0.0, 0.0], k=2)
        assert [m.id for m, _ in top2] == [ids["same"], ids["diag"]]
        assert b.recall("t", "k", [1, 0, 0], k=0) == []
        with pytest.raises(CacheError, match="3-d recall embeddings, not 2-d"):
            b.recall("t", "k", [1, 0], k=1)  # wrong dimension


def test_recall_ties_break_by_admission_order(bank):
    first = _admit(bank, [1, 1])
    second = _admit(bank, [2, 2])
    third = _admit(bank, [1, 0])
    got = bank.recall("t", "k", [1, 1], k=3)
    assert [m.id for m, _ in got] == [first, second, third]


@pytest.mark.skipif(not HAS_FAISS, reason="faiss is not installed")
def test_faiss_and_numpy_give_identical_results(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "bank"
    with CacheBank(root, index_backend="numpy") as writer:
        for v in rng.standard_normal((150, 32)):
            _admit(writer, v, n=1)
        for _ in range(5):  # exact duplicates create ties at every rank
            _admit(writer, np.ones(32), n=1)
    with CacheBank(root, index_backend="faiss") as fb, CacheBank(root, index_backend="numpy") as nb:
        assert (fb.index_backend, nb.index_backend) == ("faiss", "numpy")
        for q in list(rng.standard_normal((20, 32))) + [np.ones(32)]:
            for k in (1, 3, 10, 50):
                a = [(m.id, s) for m, s in fb.recall("t", "k", q, k=k)]
                b = [(m.id, s) for m, s in nb.recall("t", "k", q, k=k)]
                assert a == b  # same ids, same order, bit-identical scores
                assert len(a) == k


# -- scoping ------------------------------------------------------------------------------------


def test_tenant_and_compat_key_isolation(bank):
    mine = _admit(bank, [1, 0], tenant="alice", key="k1", exact_key="same-exact")
    _admit(bank, [1, 0], tenant="bob", key="k1", exact_key="same-exact")
    _admit(bank, [1, 0], tenant="alice", key="k2")
    got = bank.recall("alice", "k1", [1, 0], k=10)
    assert [m.id for m, _ in got] == [mine]
    assert bank.recall("carol", "k1", [1, 0]) == []
    assert bank.lookup_exact("alice", "same-exact").id == mine
    assert bank.lookup_exact("bob", "same-exact").id != mine
    assert bank.lookup_exact("carol", "same-exact") is None
    st = bank.stats()
    assert (st.count, st.tenants["alice"].count, st.tenants["bob"].count) == (3, 2, 1)
    assert st.bytes == sum(e.nbytes for e in bank.entries())
    assert {e.tenant for e in bank.entries("bob")} == {"bob"}
    assert bank.clear("alice") == 2
    assert bank.recall("alice", "k1", [1, 0]) == [] and len(bank) == 1
    assert len(bank.recall("bob", "k1", [1, 0])) == 1


def test_exact_key_lookup_and_replacement(bank):
    assert bank.lookup_exact("t", "e") is None
    old = _admit(bank, [1, 0], exact_key="e", key="k1", seed=1)
    other = _admit(bank, [0, 1], exact_key="f", key="k1")
    meta = bank.lookup_exact("t", "e")
    assert meta.id == old and meta.seed == 1
    assert bank.lookup_exact("t", "e", compat_key="k1").id == old
    assert bank.lookup_exact("t", "e", compat_key="k2") is None
    new = _admit(bank, [1, 0], exact_key="e", key="k1", seed=2)  # same exact key replaces the old entry
    assert bank.lookup_exact("t", "e").id == new
    assert bank.get(old) is None and bank.load(old) is None
    assert not _tensor_blob(bank, old).exists()
    assert {e.id for e in bank.entries()} == {new, other}


def test_touch_evict_and_clear(bank):
    a = _admit(bank, [1, 0])
    b = _admit(bank, [0, 1])
    before = bank.get(a)
    assert bank.touch(a) and bank.touch(a, steps_saved=7)
    after = bank.get(a)
    assert (after.use_count, after.steps_saved) == (2, 7.0) and after.last_used > before.last_used
    assert not bank.touch("missing")
    assert bank.evict([a]) == 1 and bank.evict([a, "nope"]) == 0
    assert a not in bank and b in bank
    assert [m.id for m, _ in bank.recall("t", "k", [1, 0])] == [b]
    assert bank.clear() == 1 and len(bank) == 0
    assert list((bank.root / BLOB_DIR).iterdir()) == []


def test_second_instance_sees_other_writers(tmp_path):
    """Two banks on one directory (as two processes would be): indices notice inserts and removals."""
    with CacheBank(tmp_path) as a, CacheBank(tmp_path) as b:
        x = _admit(a, [1, 0])
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [x]  # b builds its index
        y = _admit(a, [1, 1])
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [x, y]  # incremental insert
        a.evict([x])
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [y]  # incremental removal
        a.clear()
        assert b.recall("t", "k", [1, 0]) == []
        z = _admit(b, [0, 1])
        assert [m.id for m, _ in a.recall("t", "k", [0, 1])] == [z]


def test_embedding_size_is_per_scope(tmp_path):
    """Each (tenant, compat_key) scope has its own embedding size: two embedders (whose compat keys name them) share
    one directory; feeding one scope two sizes is a clear error, before anything is written."""
    with CacheBank(tmp_path) as b:
        small = _admit(b, [1, 0, 0], key="k-embedder-a")
        big = _admit(b, np.ones(5), key="k-embedder-b")
        with pytest.raises(CacheError, match="3-d recall embeddings, not 2-d") as info:
            _admit(b, [1, 0], key="k-embedder-a")
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError):
            _admit(b, [1, float("nan"), 0], key="k-embedder-a")
        with pytest.raises(CacheError, match="5-d"):
            b.recall("t", "k-embedder-b", [1, 0, 0])
        assert [m.id for m, _ in b.recall("t", "k-embedder-a", [1, 0, 0])] == [small]
        assert [m.id for m, _ in b.recall("t", "k-embedder-b", np.ones(5))] == [big]
        assert len(list((b.root / BLOB_DIR).iterdir())) == 2  # the refused admissions wrote nothing
        b.evict([small])  # an emptied scope takes any size
        _admit(b, [1, 0], key="k-embedder-a")


# -- eviction -----------------------------------------------------------------------------------


def test_lru_victim_order():
    entries = [_meta("a", last_used=30), _meta("b", last_used=10), _meta("c", last_used=20), _meta("d", last_used=40)]
    assert LRU().victims(entries, 25) == ["b", "c", "a"]  # 10 + 10 + 10 >= 25
    assert LRU().victims(entries, 10) == ["b"]
    assert LRU().victims(entries, 0) == []
    assert LRU().victims(entries, 1000) == ["b", "c", "a", "d"]


def test_lcbfu_victim_order():
    entries = [
        _meta("hot", last_used=1, use_count=10, steps_saved=20),  # benefit 200
        _meta("warm", last_used=2, use_count=4, steps_saved=10),  # 40
        _meta("cheap", last_used=3, use_count=20, steps_saved=1),  # 20
        _meta("unused_old", last_used=4),  # 0
        _meta("unused_new", last_used=5, steps_saved=50),  # 0: tie with unused_old, LRU first
        _meta("tie_recent", last_used=9, use_count=2, steps_saved=10),  # 20: tie with cheap, cheap is older
    ]
    assert LCBFU().victims(entries, 10_000) == ["unused_old", "unused_new", "cheap", "tie_recent", "warm", "hot"]
    assert LCBFU().victims(entries, 15) == ["unused_old", "unused_new"]


def test_eviction_registry():
    assert {"lru", "lcbfu"} <= set(eviction_policies())
    assert isinstance(get_eviction("LCBFU"), LCBFU)
    with pytest.raises(CacheError, match="unknown eviction policy"):
        get_eviction("fifo-ish")

    @register_eviction("largest-first-test")
    class LargestFirst(EvictionPolicy):
        def victims(self, entries, bytes_needed):
            return [e.id for e in sorted(entries, key=lambda e: -e.nbytes)]

    assert isinstance(get_eviction("largest-first-test"), LargestFirst)


def test_capacity_enforced_with_lru(tmp_path, caplog):
    with CacheBank(tmp_path / "probe") as probe:
        size = probe.get(_admit(probe, [1, 0])).nbytes  # every test entry has the same size
    with CacheBank(tmp_path / "bank", clock=Clock()) as b:
        b.configure(capacity_bytes=3 * size)
        a, b_, c = (_admit(b, [1, 0]) for _ in range(3))
        assert b.stats().bytes == 3 * size
        b.touch(a)  # a is now more recent than b_ and c
        d = _admit(b, [0, 1])
        assert {e.id for e in b.entries()} == {a, c, d}  # b_ was least recently used
        e = _admit(b, [0, 1])
        assert {e_.id for e_ in b.entries()} == {a, d, e}  # then c
        assert b.stats().bytes <= 3 * size
        assert not _tensor_blob(b, b_).exists()
        with caplog.at_level(logging.WARNING, logger="carnator.cache"):
            too_big = b.admit(_spec([1, 0], tensors={"x": torch.zeros(1000)}))
        assert too_big is None and len(b) == 3
        (rec,) = [r for r in caplog.records if "larger than" in r.getMessage()]
        assert rec.levelno == logging.WARNING  # it used to be INFO: invisible
        msg = rec.getMessage()
        assert f"capacity of {3 * size} bytes" in msg
        assert int(msg.split("a ", 1)[1].split("-byte")[0]) > 3 * size  # names the entry's size too


def test_capacity_enforced_with_lcbfu(tmp_path):
    with CacheBank(tmp_path / "probe") as probe:
        size = probe.get(_admit(probe, [1, 0])).nbytes
    with CacheBank(tmp_path / "bank", clock=Clock()) as b:
        b.configure(capacity_bytes=3 * size, eviction="lcbfu")
        big = _admit(b, [1, 0], steps_saved=20)
        small = _admit(b, [1, 0], steps_saved=2)
        fresh = _admit(b, [1, 0], steps_saved=30)  # benefit stays 0
        b.touch(big)  # benefit 20
        b.touch(small)
        b.touch(small)  # benefit 4; fresh is 0 but most recent
        d = _admit(b, [0, 1])
        assert {e.id for e in b.entries()} == {big, small, d} and fresh not in b  # lowest benefit
        _admit(b, [0, 1])
        assert big in b and small in b and d not in b  # d's benefit (0) < small's (4) < big's (20)


def test_policy_that_frees_too_little_rolls_back(tmp_path):
    @register_eviction("stingy-test")
    class Stingy(EvictionPolicy):
        def victims(self, entries, bytes_needed):
            return []

    with CacheBank(tmp_path / "probe") as probe:
        size = probe.get(_admit(probe, [1, 0])).nbytes
    with CacheBank(tmp_path / "bank") as b:
        assert b.configure(capacity_bytes=2 * size, eviction=Stingy()).eviction == "stingy-test"
        old = _admit(b, [1, 0], exact_key="e")
        other = _admit(b, [1, 0])
        # Replacing "e" frees `size` bytes, but the new entry is 64 bytes larger and Stingy evicts nothing.
        assert b.admit(_spec([1, 0], exact_key="e", tensors={"x": torch.zeros(32)})) is None
        assert b.lookup_exact("t", "e").id == old  # the replacement was rolled back too
        assert sorted(p.name for p in (b.root / BLOB_DIR).iterdir()) == sorted(
            blob_key(i, "tensors") for i in (old, other))

        class Unregistered(EvictionPolicy):
            def victims(self, entries, bytes_needed):
                return []

        with pytest.raises(CacheError, match="not registered"):
            b.configure(eviction=Unregistered())


def test_closed_bank_raises(tmp_path):
    b = CacheBank(tmp_path)
    b.close()
    with pytest.raises(CacheError, match="closed"):
        b.entries()


def test_capacity_must_be_positive(tmp_path):
    with CacheBank(tmp_path) as b:
        for bad in (0, -5, 1.5, True, "40MB"):
            with pytest.raises(CacheError, match="positive number of bytes"):
                b.configure(capacity_bytes=bad)
        with pytest.raises(CacheError, match="unknown eviction policy"):
            b.configure(eviction="fifo-ish")
        assert b.stats().capacity_bytes is None and b.stats().eviction == "lru"  # nothing half-applied


# -- corruption and crashes ---------------------------------------------------------------------


def test_flipped_bytes_are_quarantined(bank, caplog):
    good = _admit(bank, [1, 0])
    bad = _admit(bank, [1, 0])
    path = _tensor_blob(bank, bad)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # inside the tensor data: still parses, only the checksum catches it
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert bank.load(bad) is None
    assert "corrupt" in caplog.text
    assert bank.get(bad) is None and not path.exists()
    assert [p.name.split(".")[0] for p in (bank.root / QUARANTINE_DIR).iterdir()] == [bad]
    assert [m.id for m, _ in bank.recall("t", "k", [1, 0])] == [good]
    assert torch.equal(bank.load(good)["x"], torch.arange(16, dtype=torch.float32))
    new = _admit(bank, [0, 1])
    assert bank.load(new) is not None


def test_verify_quarantines_reports_lost_and_removes_leftovers(bank):
    ok = _admit(bank, [1, 0])
    bad = _admit(bank, [1, 0])
    gone = _admit(bank, [1, 0])
    evicted = _admit(bank, [1, 0])
    tdir = bank.root / BLOB_DIR
    _tensor_blob(bank, bad).write_bytes(b"garbage")
    _tensor_blob(bank, gone).unlink()
    keep = _tensor_blob(bank, evicted).read_bytes()
    bank.evict([evicted])
    _tensor_blob(bank, evicted).write_bytes(keep)  # as if the evicting process died between row and blob
    (tdir / blob_key("deadbeef", "tensors")).write_bytes(b"a published blob whose row the database lost")
    (tdir / f".{blob_key('cafe', 'tensors')}.part").write_bytes(b"an admission that never committed")
    report = bank.verify(orphan_grace_s=0)
    assert report.checked == 1 and not report.ok
    assert report.quarantined == [bad] and report.missing == [gone] and report.lost == ["deadbeef"]
    assert sorted(report.orphans_removed) == [f".{blob_key('cafe', 'tensors')}.part", blob_key(evicted, "tensors")]
    assert report.problems == [
        f"corrupt: entry {bad} failed its checksum or could not be read",
        f"missing: entry {gone} lost its blob",
        "lost: 1 entries whose metadata is gone (deadbeef)",
    ]
    assert [e.id for e in bank.entries()] == [ok]
    assert sorted(p.name for p in tdir.iterdir()) == [blob_key(ok, "tensors")]
    again = bank.verify(orphan_grace_s=0)
    assert again.ok and again.checked == 1 and again.problems == []


def test_recent_staged_blobs_are_left_for_their_writer(bank):
    staged = bank.root / BLOB_DIR / f".{blob_key('cafe', 'tensors')}.part"
    staged.write_bytes(b"maybe being committed by another process")
    report = bank.verify()
    assert report.orphans_removed == [] and report.ok  # default grace period: young staged blobs are kept
    assert staged.exists()


def test_corruption_detected_mid_session_recovers(bank, caplog, monkeypatch):
    import sqlite3

    from carnator.cache.metadb import MetaDB

    entry_id = _admit(bank, [1, 0])
    real = MetaDB.layout
    calls = []

    def broken(self, *args):
        calls.append(1)
        if len(calls) == 1:
            exc = sqlite3.DatabaseError("database disk image is malformed")
            exc.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
            raise exc
        return real(self, *args)

    monkeypatch.setattr(MetaDB, "layout", broken)
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        assert bank.load(entry_id) is None  # a miss on the fresh database, not an exception
    assert "corrupt" in caplog.text and len(calls) == 2
    assert len(bank) == 0
    new = _admit(bank, [1, 0])
    assert bank.load(new) is not None and [m.id for m, _ in bank.recall("t", "k", [1, 0])] == [new]


def test_bad_extra_is_rejected_before_writing(bank):
    with pytest.raises(TypeError):
        bank.admit(_spec([1, 0], tensors={}, extra={"x": object()}))
    assert list((bank.root / BLOB_DIR).iterdir()) == [] and len(bank) == 0


@pytest.mark.parametrize("keep", [100, "half"])
def test_truncated_database_starts_fresh(tmp_path, caplog, keep):
    with CacheBank(tmp_path) as b:
        for i in range(60):
            _admit(b, [1, i], prompt="p" * 3000)
    db = tmp_path / DB_FILE
    assert not (tmp_path / f"{DB_FILE}-wal").exists() or (tmp_path / f"{DB_FILE}-wal").stat().st_size == 0
    size = db.stat().st_size
    with open(db, "r+b") as f:
        f.truncate(size // 2 if keep == "half" else keep)
    with caplog.at_level(logging.WARNING, logger="carnator.cache"):
        b = CacheBank(tmp_path)
    with b:
        assert "corrupt" in caplog.text
        assert len(b) == 0 and b.recall("t", "k", [1, 0]) == []
        assert any(p.name.startswith("bank.") for p in (tmp_path / QUARANTINE_DIR).iterdir())
        new = _admit(b, [1, 0])
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [new]
        assert b.load(new) is not None
        report = b.verify(orphan_grace_s=0)
        assert len(report.lost) == 60 and not report.ok  # the lost entries: blobs without rows
        (line,) = report.recoveries
        assert "database was corrupt" in line and "60 with blobs on disk" in line
        assert b.verify().ok  # reported once
    with CacheBank(tmp_path) as again:
        assert [e.id for e in again.entries()] == [new]


def test_incompatible_version_marker(tmp_path):
    CacheBank(tmp_path).close()
    (tmp_path / VERSION_FILE).write_text("carnator-cache 999\n")
    with pytest.raises(CacheError) as info:
        CacheBank(tmp_path)
    assert "version 999" in str(info.value) and "\n" not in str(info.value)
    (tmp_path / VERSION_FILE).write_text("something else entirely")
    with pytest.raises(CacheError, match="not a carnator cache marker"):
        CacheBank(tmp_path)


def test_incompatible_database_format(tmp_path):
    import sqlite3

    CacheBank(tmp_path).close()
    with sqlite3.connect(tmp_path / DB_FILE) as conn:
        conn.execute("UPDATE meta SET value = '999' WHERE key = 'format_version'")
    conn.close()
    with pytest.raises(CacheError, match="format version 999"):
        CacheBank(tmp_path)


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="not usable") as info:
        CacheBank(blocker / "bank")  # parent is a regular file: unwritable even for root
    assert isinstance(info.value, CarnatorError) and "\n" not in str(info.value)
    with pytest.raises(CacheError):
        CacheBank(blocker)  # the root itself is a file


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np, torch
    from carnator.cache import CacheBank, StoreSpec, _faults

    root, point, marker = sys.argv[1:4]

    def hang(name):
        if name == point:
            open(marker, "w").close()
            time.sleep(120)

    _faults.fault_point = hang
    bank = CacheBank(root)
    entry = bank.admit(StoreSpec(tenant="t", compat_key="k", prompt="child", embedding=np.ones(2, np.float32),
                                 tensors={"x": torch.full((256,), 7.0)}, video=np.full((2, 4, 4, 3), 9, np.uint8)))
    print(entry)
    """
)


def _run_child(root: Path, point: str, marker: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(root), point, str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _kill_child_at(root: Path, point: str, tmp_path: Path) -> None:
    marker = tmp_path / f"reached-{point}"
    child = _run_child(root, point, marker)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline, "child never reached the fault point"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS[: POINTS.index("before_commit") + 1])
def test_sigkill_before_commit_leaves_no_partial_entry(tmp_path, point):
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        good = _admit(b, [1, 0])
        assert len(b.recall("t", "k", [1, 0])) == 1  # this instance has a built index
        _kill_child_at(root, point, tmp_path)
        # The already-open bank and a freshly opened one both see only the good entry.
        assert [e.id for e in b.entries()] == [good]
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [good]
    with CacheBank(root) as b:
        assert [e.id for e in b.entries()] == [good]
        assert [m.id for m, _ in b.recall("t", "k", [1, 0])] == [good]
        leftovers = {p.name for p in (root / BLOB_DIR).iterdir()} - {blob_key(good, "tensors")}
        assert leftovers and all(n.endswith(".part") for n in leftovers)  # the dead child's staged blobs...
        report = b.verify(orphan_grace_s=0)
        assert report.orphans_removed == sorted(leftovers) and report.ok  # ...cleaned by verify: nothing was lost
        new = _admit(b, [0, 1])
        assert torch.equal(b.load(new)["x"], torch.arange(16, dtype=torch.float32))
        assert torch.equal(b.load(good)["x"], torch.arange(16, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS[POINTS.index("before_commit") + 1 :])
def test_sigkill_after_commit_keeps_the_whole_entry(tmp_path, point):
    """Killed once its row committed: the entry is whole; blobs the child never published are published by the next
    reader (or verify), never lost or served partial."""
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        good = _admit(b, [1, 0])
        _kill_child_at(root, point, tmp_path)
        (child,) = [e for e in b.entries() if e.id != good]
        assert child.has_video and child.tensor_names == ("video", "x")
        staged = sorted(p.name for p in (root / BLOB_DIR).iterdir() if p.name.endswith(".part"))
        assert len(staged) == (2 if point == "after_commit" else 0)
        assert torch.equal(b.load(child.id, [VIDEO])[VIDEO], torch.full((2, 4, 4, 3), 9, dtype=torch.uint8))
        assert torch.equal(b.load(child.id)["x"], torch.full((256,), 7.0))
        report = b.verify(orphan_grace_s=0)
        assert report.ok and report.checked == 2 and report.orphans_removed == []
        assert sorted(p.name for p in (root / BLOB_DIR).iterdir()) == sorted(
            [blob_key(good, "tensors"), blob_key(child.id, "tensors"), blob_key(child.id, "video")])


@pytest.mark.slow
def test_other_process_admissions_are_recalled(tmp_path):
    root = tmp_path / "bank"
    with CacheBank(root) as b:
        mine = _admit(b, [1, 0])
        assert len(b.recall("t", "k", [1, 1])) == 1
        child = _run_child(root, "none", tmp_path / "unused")
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        theirs = out.decode().strip()
        assert [m.id for m, _ in b.recall("t", "k", [1, 1])] == [theirs, mine]  # cosine 1.0, then 0.707
        assert torch.equal(b.load(theirs)["x"], torch.full((256,), 7.0))


# -- helpers ------------------------------------------------------------------------------------


def test_compat_key_is_canonical():
    settings = {"num_inference_steps": 50, "num_frames": 49, "height": 480, "width": 832, "guidance_scale": 5.0}
    k = compat_key("wan-1.3b@abc", "UniPCMultistepScheduler", settings)
    assert len(k) == 64 and int(k, 16) >= 0
    reordered = dict(reversed(list(settings.items())))
    assert compat_key("wan-1.3b@abc", "UniPCMultistepScheduler", reordered) == k
    assert compat_key("wan-1.3b@abc", "UniPCMultistepScheduler", {**settings, "num_inference_steps": 50.0}) == k
    assert compat_key("wan-1.3b@abc", "UniPCMultistepScheduler", {**settings, "num_frames": np.int64(49)}) == k
    assert compat_key("wan-1.3b@abc", "UniPCMultistepScheduler", {**settings, "guidance_scale": 6.0}) != k
    assert compat_key("wan-14b@abc", "UniPCMultistepScheduler", settings) != k
    assert compat_key("wan-1.3b@abc", "FlowMatchEulerDiscreteScheduler", settings) != k

    class FakeScheduler:
        def __init__(self, shift):
            self.config = {"shift": shift, "_diffusers_version": "0.42.0"}

    s1 = compat_key("m", FakeScheduler(3.0), settings)
    assert s1 == compat_key("m", FakeScheduler(3), settings)
    assert s1 != compat_key("m", FakeScheduler(5.0), settings)
    assert s1 == compat_key("m", type("FakeScheduler", (), {"config": {"shift": 3, "_diffusers_version": "9"}})(),
                            settings)


def test_compat_key_extra_names_embedder_and_reading():
    """``extra`` (embedder identity, the policy's reading) is folded into the hash canonically; no extra (None or
    {}) gives the key as before, so existing keys stay valid."""
    settings = {"num_inference_steps": 50, "guidance_scale": 5.0}
    base = compat_key("m", "S", settings)
    assert compat_key("m", "S", settings, extra=None) == base == compat_key("m", "S", settings, extra={})
    a = compat_key("m", "S", settings, extra={"embedder": "minilm@1", "reading": {"probe_steps": 4, "modifiers": 1.0}})
    assert a != base and len(a) == 64
    assert a == compat_key("m", "S", settings, extra={"reading": {"modifiers": 1, "probe_steps": 4}, "embedder": "minilm@1"})
    assert a != compat_key("m", "S", settings, extra={"embedder": "hashed-64", "reading": {"probe_steps": 4, "modifiers": 1}})
    assert a != compat_key("m", "S", settings, extra={"embedder": "minilm@1", "reading": {"probe_steps": 5, "modifiers": 1}})
    with pytest.raises(TypeError):
        compat_key("m", "S", settings, extra=["embedder"])


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CARNATOR_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CARNATOR_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "carnator"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "carnator"


def _fresh_db_held_by_a_reader(root: Path):
    """A new rollback-journal bank.sqlite in ``root`` with an open read transaction on it (a shared lock)."""
    import sqlite3

    root.mkdir()
    holder = sqlite3.connect(root / DB_FILE, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    assert holder.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    holder.execute("BEGIN")
    holder.execute("SELECT * FROM t").fetchall()
    return holder


def test_opening_waits_for_another_process_to_release_a_fresh_database(tmp_path):
    """Converting a fresh bank.sqlite to WAL needs exclusive access, and SQLite runs no busy handler for it:
    two processes opening a new cache together used to fail at once with "database is locked" (a calibrate
    worker died so). A reader holding the file for 0.3 s must only delay the open; one holding it past the
    busy timeout gives a clear CacheError."""
    import threading

    holder = _fresh_db_held_by_a_reader(tmp_path / "a")
    threading.Timer(0.3, lambda: holder.execute("COMMIT")).start()
    t0 = time.monotonic()
    with CacheBank(tmp_path / "a", busy_timeout_s=10.0) as b:
        assert time.monotonic() - t0 >= 0.25  # it did wait for the holder
        assert b._db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    holder.close()

    holder = _fresh_db_held_by_a_reader(tmp_path / "b")
    with pytest.raises(CacheError, match="cannot use WAL mode"):
        CacheBank(tmp_path / "b", busy_timeout_s=0.2)
    holder.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_removal_is_a_tombstone_not_a_rebuild(backend):
    """Removing ids (an eviction, synced by every replica) marks their rows dead: no copy of the scope's vectors, no
    new FAISS index; searches leave them out and equal a fresh index of the live rows, id for id and score for
    score; once a quarter of the rows are dead they are compacted away."""
    from carnator.cache.index import ScopeIndex

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((400, 16)).astype(np.float32)
    ids = [f"e{i}" for i in range(400)]
    index = ScopeIndex(16, backend)
    index.add(ids, vecs)
    queries = rng.standard_normal((5, 16)).astype(np.float32)
    index.search(queries[0], 3)  # (FAISS: its index is built at the first search)
    flat, buf = index._flat, index._vecs
    gone = set(ids[::7])  # 58 of 400: below the compaction share
    assert index.remove([*gone, "unknown"]) == len(gone)
    assert index._flat is flat and np.shares_memory(index._vecs, buf) and index.tombstones == len(gone)
    assert len(index) == 400 - len(gone)
    fresh = ScopeIndex(16, backend)
    fresh.add([e for e in ids if e not in gone], vecs[[i for i, e in enumerate(ids) if e not in gone]])
    for q in queries:
        for k in (1, 5, 50, 400):
            assert index.search(q, k) == fresh.search(q, k)
    assert index.score(list(gone)[:3] + ids[1:3], queries[0]) == fresh.score(ids[1:3], queries[0])
    index.add(["new"], vecs[:1])
    fresh.add(["new"], vecs[:1])
    assert index.search(queries[1], 10) == fresh.search(queries[1], 10)
    index.remove(ids[1:60])  # past a quarter dead: compacted
    assert index.tombstones == 0 and len(index) == len(index.ids)
    fresh.remove(ids[1:60])
    assert index.search(queries[2], 20) == fresh.search(queries[2], 20)
