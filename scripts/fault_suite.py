"""Fault suite for the cache store: crash, corrupt, fill and share a bank, then check what it serves and reports.

Runs on a CPU in a minute or two, without any model: it drives :class:`carnator.cache.CacheBank` directly with small
random tensors whose content follows from a seed stored with each entry, so every load can be checked exactly.

    PYTHONPATH=src python scripts/fault_suite.py                 # the full run (docs/FAULTS.md)
    PYTHONPATH=src python scripts/fault_suite.py --kills 2 --quick   # what tests/test_faults.py runs

Faults: kill -9 of a writer process at each built-in fault point of ``carnator.cache._faults`` and at random moments;
blob damage (bit flip, truncation, replaced by a directory, deleted); database damage (a schema byte, truncation,
deletion, the write-ahead log deleted or garbled); disk full (SQLite's max_page_count, ENOSPC at the blob write,
RLIMIT_FSIZE in a child); several processes writing, reading, evicting and verifying one folder at once.

After each trial: ``verify`` runs first (on a fresh bank), then every entry is loaded and compared with the content
its seed gives, the exact-hit path is read, and the store must take and return a new entry. A trial *survived* when no
exception escaped the store, no partial, corrupt or wrong data was served, no leftover was left behind and the store
still works. Losses are committed entries (as the writer saw them commit) that are gone: *reported* when verify names
them (lost, quarantined or missing), *silent* otherwise. Silent must be 0.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from carnator.cache import VIDEO, CacheBank, StoreSpec, _faults
from carnator.cache.bank import BLOB_DIR, DB_FILE
from carnator.errors import CacheError

TENANT, KEY = "t", "k"


# -- entries whose content follows from a seed ----------------------------------------------------


def content(seed: int) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    g = torch.Generator().manual_seed(int(seed))
    tensors = {f"traj.{i}": torch.randn(256, generator=g) for i in range(4)}
    tensors["mask"] = torch.rand(64, generator=g) > 0.5
    video = (torch.rand(2, 8, 8, 3, generator=g) * 255).to(torch.uint8).numpy()
    return tensors, video


def spec(seed: int, prompt: str | None = None) -> StoreSpec:
    tensors, video = content(seed)
    emb = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return StoreSpec(tenant=TENANT, compat_key=KEY, prompt=prompt or f"request {seed}", embedding=emb, tensors=tensors,
                     video=video, exact_key=f"e{seed}", seed=seed, steps_saved=10, extra={"seed": int(seed)})


def matches(seed: int, got: dict[str, torch.Tensor]) -> bool:
    tensors, video = content(seed)
    if set(got) != set(tensors) | {VIDEO}:
        return False
    return all(torch.equal(got[n], t) for n, t in tensors.items()) and np.array_equal(got[VIDEO].numpy(), video)


# -- one trial's outcome ----------------------------------------------------------------------------


@dataclass
class Tally:
    fault: str
    tried: int = 0
    survived: int = 0
    lost_reported: int = 0
    lost_silent: int = 0
    notes: list[str] = field(default_factory=list)

    def row(self) -> list[str]:
        return [self.fault, str(self.tried), str(self.survived), str(self.lost_reported), str(self.lost_silent)]


def check(root: Path, ledger: set[str], tally: Tally, *, expect_loss: bool = False, problems: list[str] | None = None) -> None:
    """Verify first, account for every committed entry, then check what is served and that the store still works.
    ``problems``: what the trial itself already saw go wrong."""
    tally.tried += 1
    problems = list(problems or [])
    try:
        # What is served before anything is repaired (read-only: nothing is quarantined behind verify's back).
        try:
            with CacheBank(root, read_only=True) as ro:
                problems += served_wrongly(ro)
        except CacheError:
            pass  # a damaged database in read-only mode: refused, nothing served
        with CacheBank(root, orphan_grace_s=0) as bank:
            report = bank.verify(orphan_grace_s=0)
            present = {e.id for e in bank.entries()}
            reported = set(report.lost) | set(report.quarantined) | set(report.missing)
            gone = ledger - present
            silent = gone - reported
            tally.lost_reported += len(gone & reported)
            tally.lost_silent += len(silent)
            if silent:
                problems.append(f"{len(silent)} committed entries vanished without a report")
            if gone and not expect_loss:
                problems.append(f"{len(gone)} entries lost where none should be")
            problems += served_wrongly(bank)
            names = {p.name for p in (root / BLOB_DIR).iterdir()}
            owned = {n for n in names if n.split(".", 1)[0] in present}
            if names - owned:
                problems.append(f"leftovers after verify: {sorted(names - owned)[:3]}")
            # still usable
            seed = random.randrange(1 << 30)
            new = bank.admit(spec(seed))
            got = bank.load(new) if new else None
            if got is None or not matches(seed, got):
                problems.append("the store no longer takes and returns an entry")
            if not bank.verify().ok:
                problems.append("a second verify still finds problems")
    except Exception as exc:  # noqa: BLE001 - anything escaping the store is a failure of the trial
        problems.append(f"{type(exc).__name__}: {exc}")
    if problems:
        tally.notes.append("; ".join(problems))
    else:
        tally.survived += 1


def served_wrongly(bank: CacheBank) -> list[str]:
    """Load every entry whole, each step alone and the exact hit's video; any data that is not the entry's own is a
    failure (a miss, None, is fine)."""
    bad: list[str] = []
    for e in bank.entries():
        seed = int(e.extra["seed"])
        got = bank.load(e.id)
        if got is not None and not matches(seed, got):
            bad.append(f"entry {e.id} served wrong data")
        tensors, video = content(seed)
        one = bank.load(e.id, ["traj.2"]) if bank.get(e.id) else None
        if one is not None and not torch.equal(one["traj.2"], tensors["traj.2"]):
            bad.append(f"entry {e.id} served a wrong tensor")
        hit = bank.lookup_exact(TENANT, f"e{seed}")
        if hit is not None:
            v = bank.load(hit.id, [VIDEO])
            if v is not None and not np.array_equal(v[VIDEO].numpy(), video):
                bad.append(f"exact hit {hit.id} served a wrong video")
        bank.recall(TENANT, KEY, np.ones(8, np.float32), k=3)
    return bad


def populate(root: Path, seeds: list[int]) -> set[str]:
    with CacheBank(root) as bank:
        return {bank.admit(spec(s)) for s in seeds}


# -- child processes ------------------------------------------------------------------------------


def _child_cmd(*args: object) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", *map(str, args)]


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


class Writer:
    """A child process admitting, touching and evicting entries; its stdout says what committed."""

    def __init__(self, root: Path, seed0: int, point: str | None = None, at: int = 0, ops: int = 10**9) -> None:
        self.proc = subprocess.Popen(_child_cmd("writer", root, seed0, point or "-", at, ops), env=_child_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.committed: set[str] = set()
        self.maybe_gone: set[str] = set()
        self.bad: list[str] = []

    def wait_for(self, token: str, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                return False
            if self._take(line) == token:
                return True
        return False

    def _take(self, line: str) -> str:
        parts = line.split()
        if not parts:
            return ""
        if parts[0] == "COMMITTED":
            self.committed.add(parts[1])
        elif parts[0] == "EVICTING":
            self.maybe_gone.add(parts[1])
        elif parts[0] == "BAD":
            self.bad.append(line.strip())
        return parts[0]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 300) -> int:
        out, err = self.proc.communicate(timeout=timeout)
        for line in out.splitlines():
            self._take(line)
        self.stderr = err
        return self.proc.returncode

    @property
    def ledger(self) -> set[str]:
        return self.committed - self.maybe_gone


def child_writer(root: str, seed0: int, point: str, at: int, ops: int) -> None:
    count = {"n": 0}

    def stop_here(name: str) -> None:
        if name == point and count["n"] == at:
            print("AT_POINT", flush=True)
            time.sleep(600)

    _faults.fault_point = stop_here
    rng = random.Random(seed0)
    mine: list[str] = []
    admitted = 0
    with CacheBank(root) as bank:
        print("READY", flush=True)
        for i in range(ops):
            r = rng.random()
            if mine and r < 0.2:
                victim = mine.pop(rng.randrange(len(mine)))
                print(f"EVICTING {victim}", flush=True)
                bank.evict([victim])
            elif r < 0.35:
                entries = bank.entries()
                if entries:
                    e = rng.choice(entries)
                    got = bank.load(e.id)
                    if got is not None and not matches(int(e.extra["seed"]), got):
                        print(f"BAD {e.id}", flush=True)
                    bank.touch(e.id)
            else:
                seed = seed0 * 1000 + i
                count["n"] = admitted
                admitted += 1
                entry = bank.admit(spec(seed))
                if entry is not None:
                    mine.append(entry)
                    print(f"COMMITTED {entry} {seed}", flush=True)
    print("DONE", flush=True)


def child_commit_and_die(root: str, seed0: int, count: int) -> None:
    bank = CacheBank(root)
    bank._db.conn.execute("PRAGMA wal_autocheckpoint = 0")  # commits stay in the WAL, as in a busy store
    for i in range(count):
        print(f"COMMITTED {bank.admit(spec(seed0 + i))} {seed0 + i}", flush=True)
    os._exit(0)  # no checkpoint, no close: the rows live in bank.sqlite-wal only


def child_fsize(root: str, seed0: int) -> None:
    """Admit, touch and load with every file write beyond 4 KiB refused by the kernel (EFBIG), as on a full disk."""
    import resource

    out = {"admit_cache_errors": 0, "admitted": [], "touch": [], "loads_ok": 0, "loads_none": 0, "escaped": []}
    with CacheBank(root) as bank:
        entries = bank.entries()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        for i in range(3):
            try:
                got = bank.admit(spec(seed0 + i, prompt="x" * 3000))
                if got:
                    out["admitted"].append(got)
            except CacheError:
                out["admit_cache_errors"] += 1
            except Exception as exc:  # noqa: BLE001
                out["escaped"].append(f"admit: {type(exc).__name__}: {exc}")
        for e in entries:
            try:
                out["touch"].append(bank.touch(e.id))
                got = bank.load(e.id)
                if got is None:
                    out["loads_none"] += 1
                elif matches(int(e.extra["seed"]), got):
                    out["loads_ok"] += 1
                else:
                    out["escaped"].append(f"wrong data for {e.id}")
            except Exception as exc:  # noqa: BLE001
                out["escaped"].append(f"touch/load: {type(exc).__name__}: {exc}")
    print(json.dumps(out), flush=True)


def child_verifier(root: str, seconds: float) -> None:
    """Run verify over and over while writers work: it must never see a problem that is not there."""
    deadline = time.monotonic() + seconds
    runs = 0
    with CacheBank(root) as bank:
        while time.monotonic() < deadline:
            rep = bank.verify()  # default grace: staged blobs of working writers are theirs
            runs += 1
            for line in rep.problems:
                print(f"FALSE_ALARM {line}", flush=True)
            time.sleep(0.05)
    print(f"VERIFIED {runs}", flush=True)


# -- the faults ---------------------------------------------------------------------------------------


def kill_at_points(work: Path, rng: random.Random, points: list[str]) -> list[Tally]:
    out = []
    for point in points:
        tally = Tally(f"kill -9 at {point}")
        root = work / f"kill-{point}"
        ledger = populate(root, [rng.randrange(1 << 30) for _ in range(2)])
        w = Writer(root, rng.randrange(1 << 20), point=point, at=rng.randrange(3), ops=50)
        reached = w.wait_for("AT_POINT")
        w.kill()
        check(root, ledger | w.ledger, tally, problems=[] if reached else [f"writer never reached {point}: {w.stderr.strip()[-200:]}"])
        out.append(tally)
    return out


def kill_at_random(work: Path, rng: random.Random, n: int) -> Tally:
    tally = Tally("kill -9 at a random moment")
    for k in range(n):
        root = work / f"kill-random-{k}"
        ledger = populate(root, [rng.randrange(1 << 30) for _ in range(2)])
        w = Writer(root, rng.randrange(1 << 20))
        w.wait_for("READY")
        time.sleep(rng.uniform(0.0, 1.5))
        w.kill()
        check(root, ledger | w.ledger, tally)
    return tally


def blob_damage(work: Path, rng: random.Random, kind: str) -> Tally:
    tally = Tally(f"blob {kind}")
    root = work / f"blob-{kind}"
    ledger = populate(root, [rng.randrange(1 << 30) for _ in range(4)])
    victim = sorted(ledger)[rng.randrange(len(ledger))]
    path = root / BLOB_DIR / f"{victim}.{rng.choice(['tensors', 'video'])}.safetensors"
    if kind == "bit flip":
        raw = bytearray(path.read_bytes())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
    elif kind == "truncated":
        raw = path.read_bytes()
        path.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind == "replaced by a directory":
        path.unlink()
        path.mkdir()
    elif kind == "deleted":
        path.unlink()
    check(root, ledger, tally, expect_loss=True)
    return tally


def _schema_byte(db: Path, rng: random.Random) -> None:
    raw = bytearray(db.read_bytes())
    at = raw.find(b"CREATE TABLE entries")
    raw[at + rng.randrange(len("CREATE TABLE entries"))] = 0xFF
    db.write_bytes(bytes(raw))


def database_damage(work: Path, rng: random.Random, kind: str) -> Tally:
    tally = Tally(f"database {kind}")
    root = work / f"db-{kind.replace(' ', '-')}"
    db = root / DB_FILE
    wal = Path(f"{db}-wal")
    if kind.startswith("WAL"):
        ledger = populate(root, [rng.randrange(1 << 30)])
        child = subprocess.run(_child_cmd("commit-and-die", root, rng.randrange(1 << 30), 3), env=_child_env(),
                               capture_output=True, text=True, timeout=120)
        committed = {line.split()[1] for line in child.stdout.splitlines() if line.startswith("COMMITTED")}
        ledger |= committed
        if kind == "WAL deleted":
            wal.unlink()
        else:
            raw = bytearray(wal.read_bytes())
            for i in range(32 + rng.randrange(64), len(raw), 61):
                raw[i] ^= 0xA5
            wal.write_bytes(bytes(raw))
    else:
        ledger = populate(root, [rng.randrange(1 << 30) for _ in range(4)])
        if kind == "schema byte":
            _schema_byte(db, rng)
        elif kind == "truncated":
            size = db.stat().st_size
            with open(db, "r+b") as f:
                f.truncate(rng.randrange(size))
        elif kind == "deleted":
            db.unlink()
    check(root, ledger, tally, expect_loss=True)
    return tally


def disk_full_sqlite(work: Path, rng: random.Random) -> Tally:
    tally = Tally("disk full (SQLite: max_page_count)")
    root = work / "full-sqlite"
    ledger = populate(root, [rng.randrange(1 << 30) for _ in range(3)])
    with CacheBank(root) as bank:
        conn = bank._db.conn
        conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
        errors = 0
        for i in range(60):
            try:
                got = bank.admit(spec(rng.randrange(1 << 30), prompt="p" * 3000 + str(i)))
                if got:
                    ledger.add(got)
            except CacheError:
                errors += 1
        for e in bank.entries():
            bank.touch(e.id)  # must not raise
        conn.execute("PRAGMA max_page_count = 1073741823")
    check(root, ledger, tally, problems=[] if errors else ["SQLite never reported a full database"])
    return tally


def disk_full_blob(work: Path, rng: random.Random) -> Tally:
    tally = Tally("disk full (ENOSPC at the blob write)")
    root = work / "full-blob"
    ledger = populate(root, [rng.randrange(1 << 30) for _ in range(2)])
    calls = {"n": 0}

    def enospc(name: str) -> None:
        if name == "blob_write":
            calls["n"] += 1
            if calls["n"] % 2 == 0:
                raise OSError(errno.ENOSPC, "No space left on device")

    real = _faults.fault_point
    _faults.fault_point = enospc
    errors = 0
    try:
        with CacheBank(root) as bank:
            for _ in range(6):
                try:
                    got = bank.admit(spec(rng.randrange(1 << 30)))
                    if got:
                        ledger.add(got)
                except CacheError:
                    errors += 1
    finally:
        _faults.fault_point = real
    check(root, ledger, tally, problems=[] if errors else ["no admission met the full disk"])
    return tally


def disk_full_fsize(work: Path, rng: random.Random) -> Tally:
    tally = Tally("disk full (RLIMIT_FSIZE, real EFBIG)")
    root = work / "full-fsize"
    ledger = populate(root, [rng.randrange(1 << 30) for _ in range(3)])
    child = subprocess.run(_child_cmd("fsize", root, rng.randrange(1 << 30)), env=_child_env(), capture_output=True,
                           text=True, timeout=120)
    try:
        out = json.loads(child.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out = {"escaped": [f"child failed: {child.stderr.strip()[-300:]}"]}
    ledger |= set(out.get("admitted", []))
    bad = list(out.get("escaped", []))
    if out.get("admit_cache_errors", 0) == 0:
        bad.append("no admission met the full disk")
    if out.get("loads_ok", 0) != 3:
        bad.append(f"loads under a full disk: {out.get('loads_ok', 0)} of 3 whole")
    check(root, ledger, tally, problems=bad)
    return tally


def concurrent(work: Path, rng: random.Random, writers: int, ops: int, verify_s: float = 6.0) -> Tally:
    tally = Tally(f"{writers} writers + 1 verifier on one folder")
    root = work / "concurrent"
    ledger = populate(root, [rng.randrange(1 << 30) for _ in range(2)])
    ws = [Writer(root, rng.randrange(1 << 20), ops=ops) for _ in range(writers)]
    verifier = subprocess.Popen(_child_cmd("verifier", root, verify_s), env=_child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    codes = [w.finish() for w in ws]
    vout, verr = verifier.communicate(timeout=300)
    for w in ws:
        ledger |= w.ledger
    bad = [f"writer exited {c}: {w.stderr.strip()[-200:]}" for c, w in zip(codes, ws, strict=True) if c != 0]
    bad += [b for w in ws for b in w.bad]
    bad += [line for line in vout.splitlines() if line.startswith("FALSE_ALARM")]
    if verifier.returncode != 0:
        bad.append(f"verifier exited {verifier.returncode}: {verr.strip()[-200:]}")
    check(root, ledger, tally, problems=bad[:3])
    return tally


# -- running ------------------------------------------------------------------------------------------


def run_suite(work: Path, *, kills: int = 20, seed: int = 0, quick: bool = False,
              progress: Callable[[str], None] | None = None) -> list[Tally]:
    """Every fault once (blob and database damage ``1 if quick else 3`` times each) and ``kills`` random kills."""
    rng = random.Random(seed)
    say = progress or (lambda _m: None)
    reps = 1 if quick else 3
    rows: list[Tally] = []

    def merged(name: str, make: Callable[[int], Tally]) -> None:
        total = Tally(name)
        for r in range(reps):
            t = make(r)
            total.tried += t.tried
            total.survived += t.survived
            total.lost_reported += t.lost_reported
            total.lost_silent += t.lost_silent
            total.notes += t.notes
        rows.append(total)
        say(f"{name}: {total.survived}/{total.tried}")

    for t in kill_at_points(work, rng, list(_faults.POINTS)):
        rows.append(t)
        say(f"{t.fault}: {t.survived}/{t.tried}")
    if kills:
        rows.append(kill_at_random(work, rng, kills))
        say(f"random kills: {rows[-1].survived}/{rows[-1].tried}")
    for kind in ("bit flip", "truncated", "replaced by a directory", "deleted"):
        merged(f"blob {kind}", lambda r, kind=kind: blob_damage(work / f"r{r}", rng, kind))
    for kind in ("schema byte", "truncated", "deleted", "WAL deleted", "WAL garbled"):
        merged(f"database {kind}", lambda r, kind=kind: database_damage(work / f"r{r}", rng, kind))
    for fn in (disk_full_sqlite, disk_full_blob, disk_full_fsize):
        rows.append(fn(work, rng))
        say(f"{rows[-1].fault}: {rows[-1].survived}/{rows[-1].tried}")
    rows.append(concurrent(work, rng, writers=2 if quick else 3, ops=20 if quick else 60, verify_s=3.0 if quick else 6.0))
    say(f"{rows[-1].fault}: {rows[-1].survived}/{rows[-1].tried}")
    return rows


def to_markdown(rows: list[Tally]) -> str:
    head = ["fault", "tried", "survived", "lost (reported)", "lost (silent)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 4) + "|"]
    lines += ["| " + " | ".join(r.row()) + " |" for r in rows]
    tot = Tally("**total**", sum(r.tried for r in rows), sum(r.survived for r in rows),
                sum(r.lost_reported for r in rows), sum(r.lost_silent for r in rows))
    lines.append("| " + " | ".join(tot.row()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        mode, rest = argv[1], argv[2:]
        if mode == "writer":
            child_writer(rest[0], int(rest[1]), rest[2], int(rest[3]), int(rest[4]))
        elif mode == "commit-and-die":
            child_commit_and_die(rest[0], int(rest[1]), int(rest[2]))
        elif mode == "fsize":
            child_fsize(rest[0], int(rest[1]))
        elif mode == "verifier":
            child_verifier(rest[0], float(rest[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="kill -9 of a writer at random moments (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="each damage once, a shorter concurrency run (the CI version)")
    ap.add_argument("--workdir", default=None, help="where the banks go (default: a temporary folder, removed after)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)  # the store's warnings are expected here; the table tells the story
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="carnator-faults-"))
    t0 = time.perf_counter()
    try:
        rows = run_suite(work, kills=args.kills, seed=args.seed, quick=args.quick,
                         progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(to_markdown(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s; seed {args.seed}")
    for r in rows:
        for n in r.notes:
            print(f"- {r.fault}: {n}")
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
    ok = all(r.survived == r.tried and r.lost_silent == 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
