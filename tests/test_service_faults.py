"""Faults of a real ``carnator serve`` (a child process, the embedded model on CPU): ``kill -9`` mid-job then a
restart (nothing lost, nothing completed twice, finished videos still served), Ctrl-C mid-job (the running job goes
back to the queue, open event streams end, exit status 0), and a full disk under the cache directory (a real tmpfs:
the job fails with a reason, the store stays consistent, new jobs are refused until there is room, then served)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from carnator.cache import CacheBank
from carnator.client import Client
from carnator.service.jobs import SqliteJobStore

from harness.server import ServerProcess

PROMPT = "a small red ball moving left on grass"


def submit(url, **body):
    r = httpx.post(f"{url}/v1/videos", json={"prompt": PROMPT, **body}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def job(url, job_id):
    return httpx.get(f"{url}/v1/videos/{job_id}", timeout=30).json()


def wait_progress(url, job_id, at_least=5, timeout=60):
    deadline = time.monotonic() + timeout
    while (j := job(url, job_id))["progress"] < at_least:
        assert j["status"] in ("queued", "in_progress"), j
        assert time.monotonic() < deadline, j
        time.sleep(0.1)


def test_kill_9_mid_job_then_restart_loses_nothing_and_completes_each_job_once(tmp_path):
    cache = tmp_path / "cache"
    with ServerProcess(cache) as s1:
        done = submit(s1.url, seed=1, num_inference_steps=6)
        with Client(s1.url) as c:
            assert c.wait(done, timeout=60)["status"] == "completed"
            video = c.content(done)
        running = submit(s1.url, seed=2, num_inference_steps=100, cache="off")
        queued = [submit(s1.url, seed=3, num_inference_steps=6), submit(s1.url, seed=4, num_inference_steps=6)]
        wait_progress(s1.url, running)
        s1.kill()
    store = SqliteJobStore(cache)  # what the killed server left
    assert store.get("default", running).status == "in_progress"
    assert [store.get("default", q).status for q in queued] == ["queued", "queued"]
    store.close()

    with ServerProcess(cache) as s2:
        with Client(s2.url) as c:
            assert c.get(done)["status"] == "completed" and c.content(done) == video  # still downloadable
            finished = {j: c.wait(j, timeout=120) for j in [running, *queued]}
        assert s2.stop() == 0
    assert all(f["status"] == "completed" for f in finished.values()), finished
    assert finished[running]["attempts"] == 2 and all(finished[q]["attempts"] == 1 for q in queued)
    store = SqliteJobStore(cache)
    kinds = [h["kind"] for h in store.history(running)]
    assert kinds == ["submitted", "claimed", "requeued", "claimed", "completed"], kinds
    for j in [done, running, *queued]:  # none lost, none completed twice
        assert [h["kind"] for h in store.history(j)].count("completed") == 1
    assert store.counts()["completed"] == 4 and sum(store.counts().values()) == 4
    store.close()


def test_ctrl_c_requeues_the_running_job_ends_streams_and_exits_0(tmp_path):
    cache = tmp_path / "cache"
    srv = ServerProcess(cache)
    try:
        running = submit(srv.url, seed=2, num_inference_steps=400, cache="off")
        # one server per cache directory: a second is refused in one line
        second = subprocess.run([sys.executable, "-m", "carnator.cli", "serve", "--port", "0", "--cache-dir", str(cache)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stderr.strip() == (
            f"carnator: error: another carnator serve (pid {srv.pid}) uses the cache directory {cache}"), second.stderr
        port = srv.url.rsplit(":", 1)[1]
        third = subprocess.run([sys.executable, "-m", "carnator.cli", "serve", "--port", port, "--cache-dir",
                                str(tmp_path / "other")], capture_output=True, text=True, timeout=120)
        assert third.returncode == 2 and third.stderr.strip() == (
            f"carnator: error: could not listen on 127.0.0.1:{port} (in use, or not an address of this host)"), third.stderr
        wait_progress(srv.url, running)
        events: list[str] = []

        def follow():
            with Client(srv.url) as c:
                events.extend(name for name, _ in c.events(running, timeout=60))

        t = threading.Thread(target=follow)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        rc = srv.stop(timeout=60)
        t.join(30)
        assert rc == 0 and time.monotonic() - t0 < 30
        assert "closed" in events, events  # the open stream ended with the server
        assert "carnator: stopped; 1 running job(s) requeued for the next start" in srv.output, srv.output
        assert "Traceback" not in srv.output, srv.output
    finally:
        srv.kill()
    store = SqliteJobStore(cache)
    j = store.get("default", running)
    assert j.status == "queued" and j.attempts == 0  # the drained attempt does not count
    store.close()


def _mount_tmpfs(path, size):
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "32m"):
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path):
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


def test_a_full_disk_fails_the_job_cleanly_and_keeps_the_store_consistent(small_disk):
    cache = small_disk / "cache"
    with ServerProcess(cache) as srv:
        first = submit(srv.url, seed=1, num_inference_steps=6)
        with Client(srv.url) as c:
            assert c.wait(first, timeout=60)["status"] == "completed"
        running = submit(srv.url, seed=2, num_inference_steps=100)
        wait_progress(srv.url, running)
        filler = fill(small_disk)
        with Client(srv.url) as c:
            failed = c.wait(running, timeout=120)
        assert failed["status"] == "failed", failed
        assert failed["error"]["type"] == "storage_error" and "disk is full" in failed["error"]["message"], failed["error"]
        r = httpx.get(f"{srv.url}/readyz")
        assert r.status_code == 503 and "full" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/videos", json={"prompt": PROMPT})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable" and "Retry-After" in r.headers
        assert job(srv.url, first)["status"] == "completed"  # what finished is still served
        assert httpx.get(f"{srv.url}/v1/videos/{first}/content").status_code == 200
        filler.unlink()
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        after = submit(srv.url, seed=3, num_inference_steps=6)
        with Client(srv.url) as c:
            assert c.wait(after, timeout=60)["status"] == "completed"
        assert srv.stop() == 0
    assert "Traceback" not in srv.output, srv.output
    bank = CacheBank(cache)
    report = bank.verify()
    assert report.ok, report.problems
    assert bank.stats().count == 2  # the two jobs that completed; nothing of the failed one
    bank.close()
    assert not list((cache / "videos").glob(".*")), "staged videos left behind"
