"""``carnator serve`` over real HTTP: one real server (a child process on a free loopback port, the embedded model on
CPU, API keys of three tenants) shared by this module's tests, driven with httpx and :class:`carnator.client.Client`.

Auth and errors (JSON, one line, the right status), a job's life with its event stream and videos, idempotency,
tenant isolation (another tenant's prompt is a miss, exact or approximate; another tenant's job is a 404), cancelling
mid-step (nothing stored, the worker freed), the queue's per-tenant limit (429 + Retry-After), a corrupt cache entry
(a miss, quarantined), metrics without tenant data, the Python client and ``carnator generate --server``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from carnator.cache import CacheBank
from carnator.cli import main
from carnator.client import Client, ServerError
from carnator.video import read_video

from harness.server import ServerProcess

KEYS = {"key-alpha-0001": "alpha", "key-bravo-0001": "bravo", "key-charlie-01": "charlie"}
A, B, C = (f"Bearer {k}" for k in KEYS)
PROMPT = "a small red ball moving left on grass"
#: the carnator policy probes 4 steps and resumes at step 29 (the shipped file's 45 of 50): 32 steps make approximate
#: hits possible
STEPS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    keys = root / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with ServerProcess(root / "cache", ["--keys", str(keys), "--max-queue", "8", "--max-queue-per-tenant", "3",
                                         "--max-steps", "400"]) as srv:
        yield srv
        rc = srv.stop()
        assert rc == 0, srv.output
    assert "Traceback" not in srv.output, srv.output


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(http, auth, body, **headers):
    return http.post("/v1/videos", json=body, headers={"Authorization": auth, **headers})


def wait(server, key, job_id, timeout=120):
    with Client(server.url, key) as c:
        return c.wait(job_id, timeout=timeout)


def error_of(r, status, type_):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["type"] == type_, body
    assert "\n" not in body["error"]["message"] and "Traceback" not in r.text
    return body["error"]["message"]


def test_auth_and_request_errors_are_one_line_json(server, http):
    r = http.post("/v1/videos", json={"prompt": PROMPT})
    error_of(r, 401, "unauthorized")
    assert r.headers["WWW-Authenticate"] == "Bearer"
    error_of(http.get("/v1/videos", headers={"Authorization": "Bearer nope-nope-nope"}), 401, "unauthorized")
    error_of(http.get("/v1/nothing"), 404, "not_found")
    error_of(http.post("/v1/videos", content=b"{nope", headers={"Authorization": A, "Content-Type": "application/json"}),
             400, "bad_request")
    assert "prompt" in error_of(post(http, A, {"seed": 1}), 422, "invalid_request")
    # valid JSON sent as something else (curl -d sends a form): named, with the header to send
    body = json.dumps({"prompt": PROMPT}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Authorization": A, **({"Content-Type": ctype} if ctype else {})}
        msg = error_of(http.post("/v1/videos", content=body, headers=headers), 415, "unsupported_media_type")
        assert msg == f"send the body as JSON with the header Content-Type: application/json (this request's: {ctype or 'none'})"
    nan = b'{"prompt": "a red ball", "guidance_scale": NaN}'
    assert error_of(http.post("/v1/videos", content=nan, headers={"Authorization": A, "Content-Type": "application/json"}),
                    422, "invalid_request") == "guidance_scale: Input should be a finite number"
    # a Content-Length that is no number never reaches the app: the server's HTTP layer answers, in JSON too
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: ten\r\n\r\n{}")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), raw
    assert json.loads(payload)["error"]["type"] == "bad_request", raw
    error_of(post(http, A, {"prompt": PROMPT, "colour": "red"}), 422, "invalid_request")
    error_of(post(http, A, {"prompt": PROMPT, "seed": True}), 422, "invalid_request")
    error_of(post(http, A, {"prompt": PROMPT, "policy": "magic"}), 422, "invalid_request")
    msg = error_of(post(http, A, {"prompt": PROMPT, "num_frames": 17}), 422, "invalid_request")  # the engine's own check
    assert "frames" in msg
    assert "less than or equal to 400" in error_of(post(http, A, {"prompt": PROMPT, "num_inference_steps": 401}), 422, "invalid_request")
    error_of(post(http, A, {"prompt": "x" * 300_000}), 413, "too_large")
    schema = http.get("/openapi.json").json()
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content", "/v1/videos/{video_id}/events",
            "/metrics", "/healthz", "/readyz"} <= set(schema["paths"])
    assert http.get("/healthz").json() == {"status": "ok"} and http.get("/readyz").json() == {"status": "ready"}


def test_retry_after_is_the_time_until_a_queue_slot_frees(server, http):
    """Before any job has finished the server's estimate of a job's time is 5 s (one worker): a tenant whose share is
    full (one running, three queued) gets a slot back when the running job ends, so Retry-After is 5, not the four
    jobs' 20."""
    long = {"prompt": "a big blue square moving right on sand", "num_inference_steps": 400}
    ids = [post(http, C, {**long, "seed": 100 + i}).json()["id"] for i in range(4)]
    deadline = time.monotonic() + 30
    while http.get(f"/v1/videos/{ids[0]}", headers={"Authorization": C}).json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = post(http, C, {**long, "seed": 199})
    error_of(r, 429, "rate_limited")
    assert r.headers["Retry-After"] == "5"
    for i in reversed(ids):  # (a cancelled job's time is no job time: the estimate stays unset)
        assert http.delete(f"/v1/videos/{i}", headers={"Authorization": C}).json()["status"] == "cancelled"


def test_a_job_from_submission_to_download_with_its_events(server, http):
    body = {"prompt": PROMPT, "seed": 3, "num_inference_steps": STEPS}
    r = post(http, A, body, **{"Idempotency-Key": "job-one"})
    assert r.status_code == 202 and r.headers["Location"] == f"/v1/videos/{r.json()['id']}"
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["request"]["seed"] == 3
    # the request as run: the model's defaults filled in (the embedded model: 16 frames of 64x64, guidance 4)
    assert {k: job["request"][k] for k in ("num_inference_steps", "num_frames", "height", "width", "guidance_scale")} == {
        "num_inference_steps": STEPS, "num_frames": 16, "height": 64, "width": 64, "guidance_scale": 4.0}, job["request"]
    with Client(server.url, "key-alpha-0001") as c:
        events = list(c.events(job["id"], timeout=120))
    names = [n for n, _ in events]
    assert names[0] in ("queued", "in_progress") and names[-1] == "done", names
    assert "decision" in names and names.index("decision") < names.index("done")
    steps = [d["step"] for n, d in events if n == "progress"]
    assert steps == sorted(steps) and steps[-1] == STEPS
    done = events[-1][1]
    assert done["status"] == "completed" and done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    st = done["stats"]
    assert st["tier"] == "miss" and st["steps_computed"] == STEPS and st["stored"] and st["speedup"] == 1.0
    # the shipped file decides by content alone: no probe runs (CarnatorConfig.probe "auto")
    assert {"dit", "decode", "store", "total"} <= set(st["timings"]) and "probe" not in st["timings"]

    replay = post(http, A, body, **{"Idempotency-Key": "job-one"})  # the same key and body: the same job
    assert replay.status_code == 200 and replay.json()["id"] == job["id"] and replay.headers["Idempotent-Replayed"] == "true"
    error_of(post(http, A, {**body, "seed": 4}, **{"Idempotency-Key": "job-one"}), 409, "conflict")

    mp4 = http.get(f"/v1/videos/{job['id']}/content", headers={"Authorization": A})
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    path = server.cache_dir.parent / "one.mp4"
    path.write_bytes(mp4.content)
    assert read_video(path).shape == (16, 64, 64, 3)
    gif = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "gif"}, headers={"Authorization": A})
    assert gif.headers["content-type"] == "image/gif" and gif.content[:6] == b"GIF89a"
    listed = http.get("/v1/videos", headers={"Authorization": A}).json()
    assert listed["object"] == "list" and job["id"] in [j["id"] for j in listed["data"]]
    error_of(http.delete(f"/v1/videos/{job['id']}", headers={"Authorization": A}), 409, "conflict")


def test_another_tenants_prompt_is_a_miss_and_its_jobs_are_404(server, http):
    """Bravo probes with a re-roll of alpha's request (the approximate tier), then with alpha's exact request (the
    exact tier alone, so that bravo's own first probe cannot serve it): both misses, with nothing of alpha's in the
    stats; the same requests by alpha hit (reuse, exact)."""
    alpha = {"prompt": PROMPT, "seed": 3, "num_inference_steps": STEPS}
    first = post(http, A, {**alpha, "seed": 5}).json()  # alpha has two entries of the prompt now (seeds 3 and 5)
    assert wait(server, "key-alpha-0001", first["id"])["status"] == "completed"
    approx = wait(server, "key-bravo-0001", post(http, B, {**alpha, "seed": 6}).json()["id"])["stats"]
    assert approx["tier"] == "miss" and not approx["hit"] and approx["source_id"] is None, approx
    assert approx["reason"] == "nothing cached to reuse"  # bravo's recall found no candidate at all
    exact = wait(server, "key-bravo-0001", post(http, B, {**alpha, "cache": "exact"}).json()["id"])["stats"]
    assert exact["tier"] == "miss" and not exact["exact_hit"] and exact["source_id"] is None, exact
    # another tenant's job reads as missing, everywhere
    for method, path in (("GET", ""), ("GET", "/content"), ("GET", "/events"), ("DELETE", "")):
        error_of(http.request(method, f"/v1/videos/{first['id']}{path}", headers={"Authorization": B}), 404, "not_found")
    assert first["id"] not in [j["id"] for j in http.get("/v1/videos", headers={"Authorization": B}).json()["data"]]
    # the control: alpha's repeat is an exact hit, its re-roll reuses alpha's entries
    exact = wait(server, "key-alpha-0001", post(http, A, alpha).json()["id"])["stats"]
    reroll = wait(server, "key-alpha-0001", post(http, A, {**alpha, "seed": 6}).json()["id"])["stats"]
    assert exact["tier"] == "exact" and exact["steps_computed"] == 0
    assert exact["speedup"] is None  # served from the cache: no ratio over its near-zero time
    assert reroll["tier"] == "reuse" and reroll["resume_step"] == 29 and reroll["steps_computed"] < STEPS, reroll
    assert reroll["speedup"] > 1 and reroll["seconds_saved"] > 0


def test_cancel_mid_step_stores_nothing_and_frees_the_worker(server, http):
    bank = CacheBank(server.cache_dir)
    before = bank.stats("charlie").count
    job = post(http, C, {"prompt": "a big blue square moving right on sand", "seed": 1, "num_inference_steps": 400}).json()
    seen = []
    with Client(server.url, "key-charlie-01") as c:
        for name, data in c.events(job["id"], timeout=120):
            seen.append(name)
            if name == "progress" and data["step"] >= 6:
                t0 = time.monotonic()
                r = http.delete(f"/v1/videos/{job['id']}", headers={"Authorization": C})
                assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
                assert time.monotonic() - t0 < 5
            if name == "done":
                assert data["status"] == "cancelled" and data["progress"] < 100
    assert seen[-1] == "done"
    assert bank.stats("charlie").count == before  # nothing partial stored
    msg = error_of(http.get(f"/v1/videos/{job['id']}/content", headers={"Authorization": C}), 409, "conflict")
    assert msg == f"job {job['id']} was cancelled: it has no video", msg
    assert http.delete(f"/v1/videos/{job['id']}", headers={"Authorization": C}).json()["status"] == "cancelled"
    # the worker is free: a short job runs right away
    short = post(http, C, {"prompt": "a small red ball moving left on grass", "seed": 9, "num_inference_steps": 6}).json()
    assert wait(server, "key-charlie-01", short["id"], timeout=60)["status"] == "completed"
    bank.close()


def test_per_tenant_queue_limit_answers_429_with_retry_after(server, http):
    long = {"prompt": "a big blue square moving right on sand", "num_inference_steps": 400}
    ids = [post(http, C, {**long, "seed": i}).json()["id"] for i in range(4)]  # one runs, three wait
    deadline = time.monotonic() + 30
    while http.get(f"/v1/videos/{ids[0]}", headers={"Authorization": C}).json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = post(http, C, {**long, "seed": 99})
    assert "jobs waiting" in error_of(r, 429, "rate_limited")
    assert int(r.headers["Retry-After"]) >= 1
    other = post(http, B, {**long, "seed": 1, "num_inference_steps": 6})  # another tenant still gets in
    assert other.status_code == 202
    for i in reversed(ids):  # queued ones are cancelled at once, the running one at its next step
        assert http.delete(f"/v1/videos/{i}", headers={"Authorization": C}).json()["status"] == "cancelled"
    assert wait(server, "key-bravo-0001", other.json()["id"])["status"] == "completed"


def _blob(server, entry_id: str, kind: str) -> Path:
    return server.cache_dir / "blobs" / f"{entry_id}.{kind}.safetensors"


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_cache_entry_is_a_miss_and_quarantined(server, http):
    req = {"prompt": "a small green triangle moving up on snow", "seed": 1, "num_inference_steps": STEPS}
    first = wait(server, "key-charlie-01", post(http, C, req).json()["id"])
    entry = first["stats"]["entry_id"]
    _corrupt(_blob(server, entry, "video"))  # the exact tier's video
    again = wait(server, "key-charlie-01", post(http, C, req).json()["id"])
    assert again["status"] == "completed" and again["stats"]["tier"] == "miss", again["stats"]
    quarantined = [p.name for p in (server.cache_dir / "quarantine").iterdir()]
    assert any(entry in name for name in quarantined), quarantined
    # the approximate tier: the trajectory of the entry a re-roll would resume from is damaged
    entry2 = again["stats"]["entry_id"]
    _corrupt(_blob(server, entry2, "tensors"))
    reroll = wait(server, "key-charlie-01", post(http, C, {**req, "seed": 2}).json()["id"])
    assert reroll["status"] == "completed" and reroll["stats"]["tier"] == "miss", reroll["stats"]
    assert "cannot serve the reuse" in reroll["stats"]["reason"], reroll["stats"]["reason"]
    assert any(entry2 in p.name for p in (server.cache_dir / "quarantine").iterdir())
    assert wait(server, "key-charlie-01", post(http, C, req).json()["id"])["stats"]["tier"] != "exact"


def test_metrics_count_jobs_and_reveal_no_tenant_data(server, http):
    text = http.get("/metrics").text
    for name in ("carnator_requests_total", "carnator_cache_hits_total", "carnator_steps_skipped_total",
                 "carnator_compute_seconds_saved_total", "carnator_queue_depth", "carnator_running_jobs",
                 "carnator_stage_seconds_bucket", "carnator_rejections_total", "carnator_cache_bytes",
                 "carnator_cache_evictions_total", "carnator_queue_wait_seconds_bucket"):
        assert name in text, name
    assert re.search(r'carnator_cache_hits_total\{tier="exact"\} [1-9]', text)
    assert re.search(r'carnator_cache_hits_total\{tier="reuse"\} [1-9]', text)
    assert re.search(r'carnator_rejections_total\{reason="tenant_limit"\} [1-9]', text)
    assert re.search(r'carnator_stage_seconds_count\{stage="dit"\} [1-9]', text)
    labels = set(re.findall(r'="([^"]*)"', text))
    assert not labels & {"alpha", "bravo", "charlie", *KEYS}
    assert not any(w in v for v in labels for w in ("ball", "square", "triangle", "video_"))


def test_generate_server_that_cannot_be_reached_is_one_line_after_a_short_wait(tmp_path):
    """The real CLI in its own process against a loopback port nothing listens on: one line naming the URL and the
    wait, status 2, well within the test's 120 s (it kept retrying for an hour)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # free once closed; nothing listens on it
    p = subprocess.run([sys.executable, "-m", "carnator.cli", "generate", "x", "--server", url, "--out",
                        str(tmp_path / "x.mp4")], capture_output=True, text=True, timeout=120, check=False,
                       env={k: v for k, v in os.environ.items() if k != "CARNATOR_API_KEY"})
    assert p.returncode == 2 and p.stdout == "", p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"carnator: error: cannot reach {url}: "), p.stderr
    assert lines[0].endswith(" (tried for 10 s)"), p.stderr


def test_python_client_and_generate_server(server, tmp_path, capsys, monkeypatch):
    with Client(server.url, "key-bravo-0001") as c:
        job = c.generate("a small red ball moving left on grass", seed=11, num_inference_steps=6, out=tmp_path / "c.mp4")
        assert job["status"] == "completed" and read_video(tmp_path / "c.mp4").shape == (16, 64, 64, 3)
        assert job["id"] in [j["id"] for j in c.jobs()]
        with pytest.raises(ServerError) as e:
            c.get("video_nothing")
        assert e.value.status == 404
    out = tmp_path / "cli.gif"
    rc = main(["generate", "a small red ball moving left on grass", "--seed", "11", "--steps", "6", "--server", server.url,
               "--api-key", "key-bravo-0001", "--out", str(out), "-q"])
    line = capsys.readouterr().out.strip()
    assert rc == 0 and line.startswith("exact hit: ") and line.endswith(f"wrote {out}"), line
    assert out.read_bytes()[:6] == b"GIF89a"
    assert main(["generate", "x", "--server", server.url, "--api-key", "wrong-key-123", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "carnator: error: server: unknown API key (HTTP 401, unauthorized)", err
    assert main(["generate", "x", "--server", server.url, "--tenant", "alpha", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().startswith("carnator: error: --tenant: with --server")
    monkeypatch.delenv("CARNATOR_API_KEY", raising=False)  # no key at all: the CLI's own ways to give one
    assert main(["generate", "x", "--server", server.url, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"carnator: error: the server at {server.url} needs an API key: pass --api-key KEY or set CARNATOR_API_KEY", err


def test_a_miss_says_what_differs_and_cache_off_says_so(server, http):
    """Bravo's misses: another colour names the cached request it differs from and how; the same prompt with other
    steps names the job that asked it with which steps; an exact repeat sent with cache off says the cache was off."""
    first = {"prompt": "a big green box moving up on sand", "seed": 1, "num_inference_steps": 8}
    done = wait(server, "key-bravo-0001", post(http, B, first).json()["id"])
    assert done["stats"]["tier"] == "miss" and done["stats"]["stored"], done["stats"]
    entry = done["stats"]["entry_id"]
    colour = wait(server, "key-bravo-0001", post(http, B, {**first, "prompt": "a big red box moving up on sand"}).json()["id"])
    assert colour["stats"]["tier"] == "miss", colour["stats"]
    assert colour["stats"]["reason"] == (
        f"the nearest cached request, entry {entry[:8]} ('a big green box moving up on sand', seed 1), differs in "
        "color green -> red: no certified tier reuses a colour change on this model (tiers: object, place, re-roll, rewording)"
    ), colour["stats"]["reason"]
    steps = wait(server, "key-bravo-0001", post(http, B, {**first, "seed": 2, "num_inference_steps": 6}).json()["id"])
    assert steps["stats"]["tier"] == "miss", steps["stats"]
    assert steps["stats"]["reason"].endswith(
        f"; your job {done['id']} asked the same prompt with 8 steps (this one: 6 steps), and a cached request is reused "
        "only with the same steps, frames, size and guidance"), steps["stats"]["reason"]
    off = wait(server, "key-bravo-0001", post(http, B, {**first, "cache": "off"}).json()["id"])
    assert off["stats"]["tier"] == "miss", off["stats"]
    assert off["stats"]["reason"] == "the cache was off for this request (cache: off): nothing was read from it", off["stats"]


def test_cache_says_what_a_job_reads_and_store_whether_it_writes(server, http):
    """``"cache": "off"`` reads nothing; ``"store": false`` writes nothing: two such jobs leave no entry (the same
    request then is a miss), while ``"cache": "off"`` alone runs in full and stores its result (the same request then
    is an exact hit), as the engine's ``cache``/``store`` and the CLI's ``--cache off``/``--no-store`` do."""
    key = list(KEYS)[2]
    body = {"prompt": PROMPT, "seed": 9001, "num_inference_steps": 8}

    def run(extra):
        r = post(http, C, {**body, **extra})
        assert r.status_code == 202, r.text
        done = wait(server, key, r.json()["id"])
        assert done["status"] == "completed", done
        return done["stats"]

    for _ in range(2):
        st = run({"cache": "off", "store": False})
        assert st["tier"] == "miss" and not st["stored"] and st["entry_id"] is None, st
    st = run({})
    assert st["tier"] == "miss" and st["stored"], st  # nothing was written by the two jobs before
    body["seed"] = 9002
    st = run({"cache": "off"})
    assert st["tier"] == "miss" and st["stored"], st
    assert run({})["tier"] == "exact"
    assert error_of(post(http, C, {**body, "store": "no"}), 422, "invalid_request")
