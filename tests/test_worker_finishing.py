"""A job's fixed cost after its denoising (its videos, the job table's record) runs beside the device's next job."""

from __future__ import annotations

import threading
import time

from carnator import Carnator
from carnator.testing import hashed_embedder
from carnator.request import Params

STEPS = 6


def _wait(cond, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_next_job_runs_while_the_previous_ones_videos_are_encoded(tmp_path, monkeypatch):
    import carnator.service.worker as worker
    from carnator.service.server import ServeConfig, Service

    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / "cache", device="cpu", embedder=hashed_embedder(64))
    svc = Service(ServeConfig(cache_dir=str(tmp_path), audit=0.0), engines=[eng])
    started: dict[str, float] = {}
    publish = svc.hub.publish

    def record(job_id, kind, data):
        if kind == "in_progress":
            started.setdefault(job_id, time.monotonic())
        publish(job_id, kind, data)

    svc.hub.publish = record
    real_write, second_started, encoded = worker.write_video, threading.Event(), []

    def write_video(frames, path, fps):   # the first job's encoding waits until the second job is on the device
        if not encoded:
            second_started.wait(60)
        encoded.append(path)
        return real_write(frames, path, fps=fps)

    monkeypatch.setattr(worker, "write_video", write_video)
    ids = []
    for prompt in ("a big red ball on grass", "a small blue square moving left at night"):
        params = svc.validate(Params(prompt, 1, num_inference_steps=STEPS, cache="reuse"))
        ids.append(svc.store.submit("default", params.to_dict(tenant=False))[0].id)
    svc.start()
    try:
        # without a finishing thread the device would wait out the first job's encoding (60 s) before the second
        _wait(lambda: ids[1] in started, timeout=30, what="the second job on the device while the first one encodes")
        second_started.set()
        done = [_wait(lambda j=j: (r := svc.store.get("default", j)) is not None and r.status == "completed" and r,
                      what=f"job {j}") for j in ids]
    finally:
        svc.stop()
    assert len(encoded) == 4 and done[0].videos and done[1].videos   # mp4 and gif each
    # the job table agrees: the second job started before the first one was recorded complete
    assert done[1].started_at is not None and done[0].completed_at is not None
    assert done[1].started_at <= done[0].completed_at, (done[1].started_at, done[0].completed_at)
