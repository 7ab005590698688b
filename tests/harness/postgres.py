"""A throwaway PostgreSQL cluster on 127.0.0.1 (the tests, the scale benchmarks, trying ``--store postgresql://`` out).

    with LocalPostgres() as pg:
        store = SharedStore(pg.url, blobs="/tmp/blobs")

``initdb`` in a fresh temporary directory, ``postgres`` on a free port of 127.0.0.1 (trust authentication: local,
loopback only), stopped and removed on exit. As root the cluster runs as the ``postgres`` user (PostgreSQL refuses
root). The binaries come from ``$PG_BIN``, ``PATH`` or Debian's ``/usr/lib/postgresql/<version>/bin``. A test harness,
not part of the library: the library only connects to a PostgreSQL it is given a URL of.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """PostgreSQL's programs are missing, or the cluster did not start."""


def pg_bindir() -> Path | None:
    """Where ``initdb`` and ``pg_ctl`` are, or None."""
    env = os.environ.get("PG_BIN")
    if env and (Path(env) / "initdb").exists():
        return Path(env)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """One PostgreSQL cluster in a temporary directory; ``url`` once started. :class:`PostgresUnavailable` when the
    binaries are missing or the cluster does not start."""

    def __init__(self) -> None:
        self.url = ""
        self._dir: str | None = None
        self._user: str | None = None
        self._bindir = pg_bindir()

    def _run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        if self._bindir is None:
            raise PostgresUnavailable("PostgreSQL's programs (initdb, pg_ctl) were not found: install postgresql or set PG_BIN")
        full = [str(self._bindir / cmd[0]), *cmd[1:]]
        if self._user:
            full = ["runuser", "-u", self._user, "--", *full]
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout)

    def start(self) -> LocalPostgres:
        if self._bindir is None:
            raise PostgresUnavailable("PostgreSQL is not installed (no initdb; Debian: apt-get install postgresql)")
        self._dir = tempfile.mkdtemp(prefix="carnator-pg-")
        data = os.path.join(self._dir, "data")
        if os.geteuid() == 0:
            self._user = "postgres"
            try:
                pw = pwd.getpwnam(self._user)
            except KeyError:
                raise PostgresUnavailable("running as root, but there is no postgres user to run PostgreSQL as") from None
            os.chown(self._dir, pw.pw_uid, pw.pw_gid)
        port = _free_port()
        r = self._run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        if r.returncode != 0:
            self.stop()
            raise PostgresUnavailable(f"initdb failed: {r.stderr.strip()[-500:]}")
        opts = f"-p {port} -k {self._dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        r = self._run("pg_ctl", "-D", data, "-o", opts, "-w", "-t", "60", "-l", os.path.join(self._dir, "log"), "start")
        if r.returncode != 0:
            log = Path(self._dir, "log").read_text(errors="replace")[-800:] if Path(self._dir, "log").exists() else ""
            self.stop()
            raise PostgresUnavailable(f"PostgreSQL did not start: {r.stderr.strip()[-300:]} {log}")
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        return self

    def stop(self) -> None:
        if self._dir is None:
            return
        data = os.path.join(self._dir, "data")
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            self._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def pause(self) -> None:
        """Stop the server, keeping its data (a PostgreSQL outage); :meth:`resume` starts it again."""
        assert self._dir is not None
        self._run("pg_ctl", "-D", os.path.join(self._dir, "data"), "-m", "fast", "-w", "stop", timeout=60)

    def resume(self) -> None:
        assert self._dir is not None
        port = self.url.rsplit(":", 1)[1].split("/")[0]
        opts = f"-p {port} -k {self._dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        r = self._run("pg_ctl", "-D", os.path.join(self._dir, "data"), "-o", opts, "-w", "-l",
                      os.path.join(self._dir, "log"), "start")
        if r.returncode != 0:
            raise PostgresUnavailable(f"PostgreSQL did not restart: {r.stderr.strip()[-300:]}")

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
