"""A bounded run of scripts/fault_suite.py (docs/FAULTS.md has the full run): every fault kind, each a few seconds.

Each trial crashes, damages, fills or shares a real bank (real processes killed with SIGKILL, real SQLite, real
files), then the suite checks that verify reports every loss, that nothing partial, corrupt or wrong is served and
that the store still works. The last test breaks the store on purpose to show the suite notices.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from carnator.cache import _faults

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "fault_suite.py"
_spec = importlib.util.spec_from_file_location("fault_suite", _PATH)
fs = importlib.util.module_from_spec(_spec)
sys.modules["fault_suite"] = fs
_spec.loader.exec_module(fs)


def _ok(t) -> None:
    assert t.tried >= 1
    assert t.survived == t.tried, f"{t.fault}: {t.notes}"
    assert t.lost_silent == 0, f"{t.fault}: {t.notes}"


@pytest.mark.slow
def test_kill_at_every_fault_point_and_at_random(tmp_path):
    rng = random.Random(0)
    rows = fs.kill_at_points(tmp_path, rng, list(_faults.POINTS))
    rows.append(fs.kill_at_random(tmp_path, rng, 1))
    assert [t.fault for t in rows[:-1]] == [f"kill -9 at {p}" for p in _faults.POINTS]
    for t in rows:
        _ok(t)
        assert t.lost_reported == 0  # a crash loses nothing that committed


@pytest.mark.parametrize("kind", ["bit flip", "truncated", "replaced by a directory", "deleted"])
def test_blob_damage_is_reported_never_served(tmp_path, kind):
    t = fs.blob_damage(tmp_path, random.Random(1), kind)
    _ok(t)
    assert t.lost_reported == 1  # the damaged entry, named by verify


@pytest.mark.parametrize("kind,lost", [("schema byte", 4), ("truncated", 4), ("deleted", 4), ("WAL deleted", 3),
                                       ("WAL garbled", 3)])
def test_database_damage_losses_are_all_reported(tmp_path, kind, lost):
    t = fs.database_damage(tmp_path, random.Random(2), kind)
    _ok(t)
    assert t.lost_reported == lost  # every committed entry the database lost, and none silently


@pytest.mark.parametrize("fault", ["disk_full_sqlite", "disk_full_blob", "disk_full_fsize"])
def test_disk_full_fails_no_request_and_loses_nothing(tmp_path, fault):
    t = getattr(fs, fault)(tmp_path, random.Random(3))
    _ok(t)
    assert t.lost_reported == 0


@pytest.mark.slow
def test_concurrent_writers_and_verifier(tmp_path):
    t = fs.concurrent(tmp_path, random.Random(4), writers=2, ops=20, verify_s=3.0)
    _ok(t)
    assert t.lost_reported == 0


def test_the_suite_notices_a_store_that_loses_silently(tmp_path, monkeypatch):
    """If verify stopped reporting entries whose metadata is gone, the suite would count them as silent losses."""
    from carnator.cache.bank import CacheBank

    real = CacheBank._sweep

    def forgetful(self, grace_s, *, remove_lost):
        _, removed = real(self, grace_s, remove_lost=remove_lost)
        return [], removed

    monkeypatch.setattr(CacheBank, "_sweep", forgetful)
    t = fs.database_damage(tmp_path, random.Random(2), "deleted")
    assert t.lost_silent == 4 and t.survived == 0
