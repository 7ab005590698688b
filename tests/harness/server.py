"""Run ``carnator serve`` in a child process and learn its URL (the service's tests, ``scripts/load_test.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_URL = re.compile(r"at (http://\S+?)/? \(")


class ServerProcess:
    """``carnator serve --port 0 --cache-dir DIR ARGS...`` in a child process; ``url`` once it listens.

    Its output (stdout and stderr) is kept in ``lines``. ``stop()`` sends SIGINT (Ctrl-C) and waits; ``kill()`` sends
    SIGKILL. Shadow audits are off (``--audit 0``) unless ``args`` name ``--audit``: their sampling is random, and what
    such a server is used to measure (the tests, the load and scale benchmarks) predates them."""

    def __init__(self, cache_dir: str | os.PathLike[str], args: Sequence[str] = (), *, timeout: float = 180.0,
                 env: dict[str, str] | None = None):
        audit = [] if any(str(a).split("=")[0] == "--audit" for a in args) else ["--audit", "0"]
        cmd = [sys.executable, "-m", "carnator.cli", "serve", "--port", "0", "--cache-dir", str(cache_dir), *audit, *args]
        self.cache_dir = Path(cache_dir)
        self.lines: list[str] = []
        self._url_seen = threading.Event()
        self.url: str | None = None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._url_seen.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(2)
                self.kill()
                raise RuntimeError(f"carnator serve did not start (exit {self.proc.returncode}):\n{self.output}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _URL.search(line)
            if m and self.url is None:
                self.url = m.group(1).rstrip("/")
                self._url_seen.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 60.0) -> int:
        """Ctrl-C, then wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        """kill -9 (the server only: it is its own process group's leader)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            try:
                self.stop(30)
            except subprocess.TimeoutExpired:
                pass
