"""``carnator serve --store postgresql://...`` (a real child process, the embedded model on CPU, a real PostgreSQL):
the job table lives in PostgreSQL (no ``jobs.sqlite``), one server per database schema (a second is refused in one
line), and a ``kill -9`` mid-job then a restart requeues the job from the database and completes it once."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from carnator.client import Client
from carnator.service.pgjobs import PostgresJobStore

from harness.server import ServerProcess

PROMPT = "a small red ball moving left on grass"


def submit(url, **body):
    r = httpx.post(f"{url}/v1/videos", json={"prompt": PROMPT, **body}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def test_serve_keeps_its_jobs_in_postgresql_one_server_per_database_and_recovers_after_kill_9(pg_schema_url, tmp_path):
    cache, blobs = tmp_path / "cache", tmp_path / "blobs"
    args = ["--store", pg_schema_url, "--blobs", str(blobs)]
    with ServerProcess(cache, args) as s1:
        done = submit(s1.url, seed=1, num_inference_steps=6)
        with Client(s1.url) as c:
            assert c.wait(done, timeout=60)["status"] == "completed"
            video = c.content(done)
        # another server on the same database (another cache directory): refused in one line
        second = subprocess.run([sys.executable, "-m", "carnator.cli", "serve", "--port", "0", "--cache-dir",
                                 str(tmp_path / "other"), *args], capture_output=True, text=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"carnator: error: another carnator serve (pid {s1.pid}) uses the job table"), lines
        running = submit(s1.url, seed=2, num_inference_steps=100, cache="off")
        with Client(s1.url) as c:
            while c.get(running)["progress"] < 5:
                time.sleep(0.1)
        s1.kill()
    assert not (cache / "jobs.sqlite").exists()
    store = PostgresJobStore(pg_schema_url, cache / "videos")  # what the killed server left, in PostgreSQL
    try:
        assert store.get("default", running).status == "in_progress" and store.get("default", done).status == "completed"
    finally:
        store.close()

    with ServerProcess(cache, args) as s2:  # the lock went with the killed server's connection
        with Client(s2.url) as c:
            assert c.content(done) == video
            finished = c.wait(running, timeout=120)
        assert s2.stop() == 0
    assert finished["status"] == "completed" and finished["attempts"] == 2
    store = PostgresJobStore(pg_schema_url, cache / "videos")
    try:
        assert [h["kind"] for h in store.history(running)] == ["submitted", "claimed", "requeued", "claimed", "completed"]
        assert store.counts()["completed"] == 2 and sum(store.counts().values()) == 2
    finally:
        store.close()


def test_a_restart_of_postgresql_does_not_let_a_second_server_take_the_job_table(private_postgres, tmp_path):
    """PostgreSQL restarts under a running server: the server takes its one-server lock again (its workers poll the
    job table), so a second server started on the same schema afterwards is refused in one line, and the job
    submitted to the first completes there in one attempt, its video served."""
    url = f"{private_postgres.url}?schema=served"
    args = ["--store", url, "--blobs", str(tmp_path / "blobs")]
    with ServerProcess(tmp_path / "a", args) as a:
        private_postgres.pause()
        private_postgres.resume()
        deadline = time.monotonic() + 30
        while True:  # the first call after the restart may find the job table's connection broken: 503, then 202
            r = httpx.post(f"{a.url}/v1/videos", json={"prompt": PROMPT, "seed": 3, "num_inference_steps": 30,
                                                       "cache": "off"}, timeout=30)
            if r.status_code == 202 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        second = subprocess.run([sys.executable, "-m", "carnator.cli", "serve", "--port", "0", "--cache-dir",
                                 str(tmp_path / "b"), *args], capture_output=True, text=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"carnator: error: another carnator serve (pid {a.pid}) uses the job table"), lines
        with Client(a.url) as c:
            finished = c.wait(job, timeout=180)
            assert finished["status"] == "completed" and finished["attempts"] == 1
            assert c.content(job)[4:8] == b"ftyp"
        assert a.stop() == 0


def wait_for_line(server, text, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not any(text in line for line in server.lines):
        assert time.monotonic() < deadline, f"no line with {text!r}:\n{server.output[-3000:]}"
        time.sleep(0.1)


def test_an_outage_of_postgresql_is_said_once_and_a_job_ending_in_it_is_recorded_when_it_is_back(private_postgres,
                                                                                                  tmp_path):
    """PostgreSQL stops under a running server: the idle workers' polls fail, which the log says once (and once
    that they work again), not at every poll; a job that ends during the outage is recorded as completed when the
    database is back, by the same process, in its first attempt, its video served."""
    url = f"{private_postgres.url}?schema=served"
    args = ["--store", url, "--blobs", str(tmp_path / "blobs")]
    with ServerProcess(tmp_path / "a", args) as a:
        private_postgres.pause()
        time.sleep(3)  # six polls of an idle worker
        private_postgres.resume()
        wait_for_line(a, "the workers take jobs again")
        assert sum("could not take a job" in line for line in a.lines) == 1, a.output[-3000:]
        deadline = time.monotonic() + 30
        while True:  # the first call after the restart may find the job table's connection broken: 503, then 202
            r = httpx.post(f"{a.url}/v1/videos", json={"prompt": PROMPT, "seed": 4, "num_inference_steps": 100,
                                                       "cache": "off", "store": False}, timeout=30)
            if r.status_code == 202 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        with Client(a.url) as c:
            while c.get(job)["progress"] < 5:
                time.sleep(0.1)
            private_postgres.pause()
            wait_for_line(a, f"job {job} ended (completed) while its job table is unreachable")
            private_postgres.resume()
            deadline = time.monotonic() + 60
            while True:
                try:
                    finished = c.get(job)
                except Exception:  # noqa: BLE001 - 503 until the job table's connection is back
                    finished = {"status": "?"}
                if finished["status"] == "completed" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert finished["status"] == "completed" and finished["attempts"] == 1, finished
            assert c.content(job)[4:8] == b"ftyp"
        assert a.stop() == 0
    assert sum("could not take a job" in line for line in a.lines) <= 2, a.output[-3000:]
