"""End what ``carnator serve --replicas`` started when the server dies without stopping it (``kill -9``, a crash).

The server starts its own local Ray cluster (GCS, raylet, the dashboard and runtime-env agents, the replicas'
workers). Ray ties some of them to the server's life, not all: after a ``kill -9`` its agents lived on. This small
process, started by the server, notes every process descended from the server while the server lives, and when the
server is gone kills those still running (and what they started since). After a clean stop Ray has ended them
already and it finds nothing to do.

``python -m carnator.service.reaper PID``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

#: seconds between two looks at the server's descendants
POLL_S = 1.0


def watch(pid: int, poll_s: float = POLL_S) -> int:
    """Watch process ``pid``; once it has ended, kill its remembered descendants; how many were killed."""
    import psutil

    try:
        server = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
        with contextlib.suppress(psutil.Error):
            for p in server.children(recursive=True):
                if p.pid != me:
                    seen.setdefault(p.pid, p)
        seen = {k: p for k, p in seen.items() if p.is_running()}  # (is_running also tells a reused pid apart)
        time.sleep(poll_s)
    left = [p for p in seen.values() if p.is_running()]
    for p in list(left):
        with contextlib.suppress(psutil.Error):
            left += [c for c in p.children(recursive=True) if c.pid != me]
    killed = 0
    for p in {p.pid: p for p in left}.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
            killed += 1
    return killed


def start(pid: int | None = None):
    """Start the watcher of ``pid`` (default: this process) in a process group of its own (a Ctrl-C to the server's
    terminal does not end it before the server has stopped); its :class:`subprocess.Popen`."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "carnator.service.reaper", str(pid or os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
