"""The workers of ``carnator serve``: one thread per device, taking jobs in turn from the job store.

:class:`FairQueue` picks the next job round-robin over the tenants with queued jobs (each tenant's own jobs in
submission order), so one tenant's burst does not starve another. :class:`WorkerPool` runs each job through
``Carnator.generate`` with ``cancel`` (a per-job flag: ``DELETE /v1/videos/{id}``, or the server draining for
shutdown), ``progress`` and ``events`` (published to the job's event streams; progress written to the store at most
twice a second). The job's fixed cost after its denoising (encoding the videos, waiting for the cache entry stored
behind it, the miss's explanation, the job table's write) runs on the device's finishing thread while the device
already runs the next job; a job waits for its finishing at most one job behind, so a slow disk slows the queue
instead of holding videos in memory. Nothing here speaks HTTP or SQL.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tenacity

from ..errors import CacheError, Cancelled, CarnatorError, InvalidRequestError
from ..request import Params
from ..video import write_video
from .events import DONE, EventHub
from .jobs import CANCELLED, COMPLETED, FAILED, Job, JobStore, JobStoreError, JobStoreUnavailable, JobTableLost
from .metrics import STAGES, ServiceMetrics

log = logging.getLogger("carnator.service")

#: seconds between progress writes to the job store (events go out at every step)
PROGRESS_WRITE_S = 0.5
#: longest wait between two tries to record a finished job while its job table is unreachable (seconds)
FINISH_RETRY_MAX_S = 5.0


class MeteredStore:
    """The engine's cache store, counting what each admission removed (evicted to make room, or an entry of the same
    exact key replaced) for ``/metrics``. Everything else passes through."""

    def __init__(self, inner, metrics: ServiceMetrics):
        self._inner, self._metrics = inner, metrics
        self._lock = threading.Lock()

    def admit(self, spec):
        with self._lock:
            try:
                before = self._inner.stats().count
            except CacheError:
                before = None
            entry_id = self._inner.admit(spec)
            if entry_id is None:
                self._metrics.store_errors.inc()
            if before is not None:
                with contextlib.suppress(CacheError):
                    removed = before + (1 if entry_id else 0) - self._inner.stats().count
                    if removed > 0:
                        self._metrics.evictions.inc(removed)
            return entry_id

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class FairQueue:
    """Round-robin over tenants with queued jobs: after serving tenant T, the next tenant (in name order) after T that
    has a queued job goes first."""

    def __init__(self, store: JobStore):
        self.store = store
        self._last: str | None = None
        self._lock = threading.Lock()

    def next(self, worker: str) -> Job | None:
        with self._lock:
            tenants = self.store.queued_tenants()
            if self._last is not None:
                k = next((i for i, t in enumerate(tenants) if t > self._last), len(tenants))
                tenants = tenants[k:] + tenants[:k]
            for t in tenants:
                job = self.store.claim(t, worker)
                if job is not None:
                    self._last = t
                    return job
        return None


class DenseEstimate:
    """Per tenant and settings, the mean seconds of its recent misses on this server: what a job would have taken
    without the cache (for ``speedup`` and the seconds saved). Never mixes tenants."""

    def __init__(self, size: int = 4096):
        self._ema: OrderedDict[tuple, float] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    @staticmethod
    def key(tenant: str, params: dict[str, Any], req) -> tuple:
        return (tenant, params.get("policy"), req.num_inference_steps, req.num_frames, req.height, req.width,
                req.guidance_scale)

    def add(self, key: tuple, seconds: float) -> None:
        with self._lock:
            old = self._ema.pop(key, None)
            self._ema[key] = seconds if old is None else 0.7 * old + 0.3 * seconds
            while len(self._ema) > self._size:
                self._ema.popitem(last=False)

    def get(self, key: tuple) -> float | None:
        with self._lock:
            return self._ema.get(key)


#: the settings a cached request must share to be reused (``Request.settings``), in words
_SETTINGS = (("num_inference_steps", "steps"), ("num_frames", "frames"), ("height", "height"), ("width", "width"),
             ("guidance_scale", "guidance"))


def miss_reason(engine, res, params: dict[str, Any], recent: Sequence[Job]) -> str | None:
    """What a miss's reason says beyond the policy's (None: the policy's stands). ``cache: off``: that. A miss that
    found nothing asking the same: when one of the tenant's ``recent`` jobs asked the same prompt with other settings,
    that job and the settings (a cached request is reused only with the same ones); else what
    :func:`carnator.explain.describe` says (the nearest cached request of the tenant and what it asks differently, as
    ``carnator generate`` and the demo say). A risk tier's miss: the nearest request, what differs and why no tier
    serves it (none certified for that kind, or disabled by the live audit)."""
    from ..explain import describe

    s = res.stats
    if params.get("cache") == "off":
        stored = "" if params.get("store", True) else " or stored (store: false)"
        return f"the cache was off for this request (cache: off): nothing was read from it{stored}"
    notes = s.notes or {}
    if s.hit:
        return None
    req, mine = res.request, " ".join(res.request.prompt.lower().split())
    for job in recent:
        if (job.status != COMPLETED or not (job.stats or {}).get("stored")
                or " ".join(str(job.params.get("prompt", "")).lower().split()) != mine):
            continue
        changed = [(k, word) for k, word in _SETTINGS if job.params.get(k) is not None and job.params[k] != getattr(req, k)]
        if changed:
            theirs = ", ".join(f"{job.params[k]} {word}" for k, word in changed)
            now = ", ".join(f"{getattr(req, k)} {word}" for k, word in changed)
            return (f"{s.reason}; your job {job.id} asked the same prompt with {theirs} (this one: {now}), and a cached "
                    "request is reused only with the same steps, frames, size and guidance")
    # a risk tier's miss (the nearest request and why no tier serves it), or nothing cached asks the same
    if "change" not in notes and (notes.get("recall") != "content" or notes.get("recalled") != 0):
        return None
    try:
        out = describe(engine, res)
    except Exception:  # noqa: BLE001 - an explanation must never fail the job it explains
        log.exception("describing a miss failed")
        return None
    return out.reason if out.tested_id is not None else None


def summarize(stats, req, dense_seconds: float | None) -> dict[str, Any]:
    """The job's ``stats``: the engine's decision and timings, with steps computed, speedup and seconds saved. Only
    this job's own data (its cache entries are the tenant's own)."""
    n = req.num_inference_steps
    tier = "exact" if stats.exact_hit else "reuse" if stats.hit else "miss"
    per_step = stats.dense_forwards / n if stats.dense_forwards else 0
    computed = 0 if stats.exact_hit else (round(stats.dit_forwards / per_step) if per_step else n)
    seconds = float(stats.timings.get("total", 0.0))
    if tier == "miss":
        dense_seconds = seconds
    elif dense_seconds is None and stats.dit_forwards:  # before any miss: this job's own seconds per forward
        dit = stats.timings.get("dit", 0.0)
        dense_seconds = seconds - dit + dit / stats.dit_forwards * stats.dense_forwards
    # an exact hit is served from the cache: over its near-zero time any dense estimate is a ratio of noise, so none
    speedup = round(dense_seconds / seconds, 2) if dense_seconds and seconds > 0 and tier != "exact" else None
    return {
        "tier": tier, "hit": bool(stats.hit), "exact_hit": bool(stats.exact_hit), "resume_step": stats.resume_step,
        "steps": n, "steps_computed": int(computed), "speedup": speedup, "seconds": round(seconds, 4),
        "seconds_saved": round(max(0.0, dense_seconds - seconds), 4) if dense_seconds and tier != "miss" else 0.0,
        "reason": stats.reason, "certified": stats.certified, "source_id": stats.source_id, "entry_id": stats.entry_id,
        "stored": stats.entry_id is not None or bool(stats.exact_hit), "replica": stats.notes.get("replica"),
        "timings": {k: round(float(v), 4) for k, v in stats.timings.items() if math.isfinite(v)},
    }


@dataclass
class Device:
    """One device and its engine (every worker of a device shares it; we run one per device)."""

    name: str
    engine: Any


class WorkerPool:
    """The worker threads and what they share: the job store, the fair queue, event hub and metrics."""

    def __init__(self, store: JobStore, devices: Sequence[Device], hub: EventHub, metrics: ServiceMetrics, *,
                 fps: int = 8, poll_s: float = 0.5, auditor: Any = None):
        self.store, self.devices, self.hub, self.metrics = store, list(devices), hub, metrics
        self.queue = FairQueue(store)
        self.fps = fps
        self.poll_s = poll_s
        self.estimate = DenseEstimate()
        self._cancel: set[str] = set()
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._wake = threading.Condition()
        self._running: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        #: per device, its finishing thread's hand-off: at most one finished job waits (None ends the thread)
        self._finishing: dict[int, queue.Queue] = {}
        self._finishers: list[threading.Thread] = []
        self.job_seconds_ema: float | None = None
        self.drained: list[str] = []
        self._down_since: float | None = None  # when the job table stopped answering the workers' polls
        self._down_lock = threading.Lock()
        #: shadow audits (:class:`carnator.service.audit.Auditor`), run when no job waits; None: none
        self.auditor = auditor
        self._queued_seq = 0   # bumped by every notify: an audit yields when it changes

    # ---- control -----------------------------------------------------------------------------
    def start(self) -> None:
        for dev in self.devices:
            q: queue.Queue = queue.Queue(maxsize=1)
            self._finishing[id(dev)] = q
            f = threading.Thread(target=self._finish_loop, args=(dev, q), name=f"carnator-finish-{dev.name}", daemon=True)
            f.start()
            self._finishers.append(f)
            t = threading.Thread(target=self._loop, args=(dev,), name=f"carnator-worker-{dev.name}", daemon=True)
            t.start()
            self._threads.append(t)

    def notify(self) -> None:
        """A job was queued."""
        self._queued_seq += 1
        with self._wake:
            self._wake.notify_all()

    def cancel(self, job_id: str) -> None:
        """Stop the job at its next step boundary if a worker runs it."""
        self._cancel.add(job_id)

    def drain(self) -> None:
        """Shutdown, first half: running jobs stop at their next step and go back to the queue; no new job starts."""
        self._draining.set()
        self.notify()

    def stop(self, timeout: float = 30.0) -> bool:
        """Shutdown, second half: wait for the workers, then for the jobs they finished to be recorded; whether they
        all ended."""
        self.drain()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for q in self._finishing.values():
            with contextlib.suppress(queue.Full):
                q.put(None, timeout=max(0.0, deadline - time.monotonic()))
        for f in self._finishers:
            f.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()
        return not any(t.is_alive() for t in (*self._threads, *self._finishers))

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def alive(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def running(self) -> int:
        return len(self._running)

    def retry_after(self) -> int:
        """Seconds until a full queue has room again: a worker finishing its job takes the next queued one, so one
        mean job time (5 s before any job finished) over the workers; at least 1. Not the whole queue's time: a
        queued job leaves the queue when it starts, not when it ends."""
        per_job = self.job_seconds_ema or 5.0
        return max(1, min(3600, math.ceil(per_job / max(1, len(self.devices)))))

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self, dev: Device) -> None:
        worker = f"{dev.name}@{threading.get_ident()}"
        while not self._draining.is_set():
            try:
                job = self.queue.next(worker)
            except Exception as exc:  # a busy, full or unreachable store: wait and try again
                self._poll_failed(dev, exc)
                job = None
            else:
                self._poll_worked()
            if job is None and self.auditor is not None and self.auditor.ready():
                self._audit(dev)
                continue
            if job is None:
                with self._wake:
                    if not self._draining.is_set():
                        self._wake.wait(self.poll_s)
                continue
            with self._lock:
                self._running[job.id] = job
            handed = False
            try:
                handed = self._run(dev, job)
            except Exception:  # never lose the worker: the job fails with a reason, the details go to the log
                self._failed_unexpectedly(job)
            finally:
                if not handed:
                    self._done_with(job)

    def _finish_loop(self, dev: Device, q: queue.Queue) -> None:
        """The device's finishing thread: :meth:`_complete` each job its worker hands over, in order."""
        while (item := q.get()) is not None:
            job, res, wall = item
            try:
                self._complete(dev, job, res, wall)
            except Exception:  # never lose the finisher
                self._failed_unexpectedly(job)
            finally:
                self._done_with(job)

    def _failed_unexpectedly(self, job: Job) -> None:
        log.exception("job %s failed unexpectedly", job.id)
        self._finish(job, FAILED, error={"type": "server_error", "message": "internal error while running the job; "
                                                                            "the server's log has the details"})

    def _done_with(self, job: Job) -> None:
        with self._lock:
            self._running.pop(job.id, None)
        self._cancel.discard(job.id)

    def _poll_failed(self, dev: Device, exc: BaseException) -> None:
        """Said once per outage (the workers poll twice a second), not at every poll."""
        with self._down_lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        log.warning("worker %s could not take a job: %s (the workers keep trying; said once until it works again)",
                    dev.name, exc)

    def _poll_worked(self) -> None:
        with self._down_lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.warning("the workers take jobs again: the job table answers (it did not for %.0f s)",
                        time.monotonic() - since)
    def _audit(self, dev: Device) -> None:
        """One shadow audit on this device, yielding at its next step boundary once a job waits."""
        seen = [self._queued_seq]
        last = [float("-inf")]   # the first step asks the store (a job queued before this audit began)

        def preempt() -> bool:
            if self._draining.is_set():
                return True
            now = time.monotonic()
            if self._queued_seq == seen[0] and now - last[0] < self.poll_s:
                return False
            seen[0], last[0] = self._queued_seq, now
            try:
                return bool(self.store.queued_tenants())
            except Exception:  # noqa: BLE001 - a store that cannot say: let the worker look
                return True

        try:
            self.auditor.run_one(dev.engine, preempt)
        except Exception:  # never lose the worker
            log.exception("a shadow audit failed unexpectedly")

    def _run(self, dev: Device, job: Job) -> bool:
        """The job's device part; True when its finishing was handed to the device's finishing thread (which then ends
        the job), False when it ended here (stopped, failed)."""
        eng, p = dev.engine, job.params
        started = time.time()
        self.metrics.queue_wait.observe(max(0.0, (job.started_at or started) - job.created_at))
        self.hub.publish(job.id, "in_progress", {"id": job.id, "status": "in_progress", "attempt": job.attempts})
        last_write = [0.0]
        shown = [job.attempts, -1]  # the attempt and its highest progress: it never goes back within an attempt

        def progress(done: int, total: int) -> None:
            pct = min(99, int(100 * done / max(1, total)))
            if shown[0] != job.attempts:
                shown[:] = [job.attempts, -1]
            if pct < shown[1]:
                return
            shown[1] = pct
            self.hub.publish(job.id, "progress", {"progress": pct, "step": done, "total": total})
            now = time.monotonic()
            if now - last_write[0] >= PROGRESS_WRITE_S:
                last_write[0] = now
                if self.store.update_progress(job.id, job.attempts, pct):  # asked elsewhere (another replica)
                    self._cancel.add(job.id)

        def cancel() -> bool:
            return job.id in self._cancel or self._draining.is_set()

        def events(kind: str, data: dict) -> None:
            if kind == "decision":
                self.hub.publish(job.id, "decision", {"reuse": bool(data.get("reuse")), "exact": False,
                                                      "reason": str(data.get("reason", ""))})
            elif kind == "retry":  # the engine starts the job over (its replica died): a new attempt
                self._retry(dev, job, str(data.get("reason") or "its engine failed"))

        if cancel():
            self._stopped_job(job)
            return False
        t0 = time.perf_counter()
        try:
            params = Params.from_dict({"cache": "reuse", **p}, tenant=job.tenant)
            res = eng.run(params, progress=progress, cancel=cancel, events=events)
        except Cancelled:
            self._stopped_job(job)
            return False
        except InvalidRequestError as e:
            self._finish(job, FAILED, error={"type": "invalid_request", "message": str(e)})
            return False
        except CarnatorError as e:
            self._finish(job, FAILED, error={"type": "generation_error", "message": str(e)})
            return False
        wall = time.perf_counter() - t0
        if res.stats.exact_hit:
            self.hub.publish(job.id, "decision", {"reuse": True, "exact": True, "reason": res.stats.reason})
        self._finishing[id(dev)].put((job, res, wall))
        return True

    def _complete(self, dev: Device, job: Job, res: Any, wall: float) -> None:
        """A denoised job's fixed cost, on the device's finishing thread: its videos, its cache entry's id, its
        reason, and the job table's record."""
        eng, p, st = dev.engine, job.params, res.stats
        videos = {}
        try:
            for variant in ("mp4", "gif"):
                path = self.store.staging_path(job.id, variant)
                write_video(res.frames, path, fps=self.fps)
                videos[variant] = path
        except OSError as e:  # the store removes what was staged
            full = " (the disk is full)" if getattr(e, "errno", None) in (28, 122) else ""
            return self._finish(job, FAILED, videos=videos, error={
                "type": "storage_error", "message": f"could not save the video{full}: {e.strerror or e}"})
        if getattr(eng, "write_behind", False):  # the entry was stored while the videos were encoded: its id goes
            try:                                 # into the job's stats
                eng.flush(res)
            except Exception:  # noqa: BLE001 - the video is made; a failed store costs only the entry
                log.exception("job %s: storing its cache entry failed", job.id)
        key = DenseEstimate.key(job.tenant, p, res.request)
        summary = summarize(st, res.request, self.estimate.get(key))
        if summary["tier"] == "miss":
            try:
                recent = self.store.list(job.tenant, limit=50)[0]
            except JobStoreError:
                recent = []
            summary["reason"] = miss_reason(eng, res, p, recent) or summary["reason"]
        if summary["tier"] == "miss":
            self.estimate.add(key, summary["seconds"])
        self._finish(job, COMPLETED, stats=summary, videos=videos, wall=wall, dev=dev)
        if self.auditor is not None:
            self.auditor.offer(job, res, summary)

    def _retry(self, dev: Device, job: Job, reason: str) -> None:
        """Record the engine's retry of ``job`` as its next attempt (counted, logged, ``requeued`` in the metrics);
        a job whose cancellation was asked meanwhile stops instead. Should the job table be unreachable, the retry
        runs under the attempt it had."""
        try:
            attempt = self.store.retry(job.id, job.attempts, job.worker or dev.name, reason)
        except JobStoreError as exc:
            log.error("job %s: could not record its retry (%s); it goes on as attempt %d", job.id, exc, job.attempts)
            return
        if attempt is None:
            self._cancel.add(job.id)
            return
        log.warning("job %s: attempt %d ended (%s); attempt %d starts", job.id, job.attempts, reason, attempt)
        job.attempts = attempt
        self.metrics.requeued.inc()
        self.hub.publish(job.id, "in_progress", {"id": job.id, "status": "in_progress", "attempt": attempt,
                                                 "reason": reason})

    def _stopped_job(self, job: Job) -> None:
        if job.id in self._cancel:
            self._finish(job, CANCELLED, error=None)
        else:  # draining: back to the queue, this attempt not counted
            try:
                if self.store.requeue(job.id, job.attempts, count_attempt=False):
                    self.metrics.requeued.inc()
                    self.drained.append(job.id)
            except JobStoreError as exc:
                log.error("could not requeue job %s (%s); the next start requeues it", job.id, exc)
            self.hub.publish(job.id, "queued", {"id": job.id, "status": "queued", "reason": "the server is restarting"})

    def _record(self, job: Job, status: str, **finish: Any) -> bool:
        """``store.finish``, tried again with backoff while the job table is unreachable (PostgreSQL down or
        restarting): a job that ends during an outage is recorded when the database is back, in this attempt and
        this process. Gives up (raises) when the server stops first or has lost its job table."""
        def unreachable(exc: BaseException) -> bool:
            return isinstance(exc, JobStoreUnavailable) and not isinstance(exc, JobTableLost) and not self.draining

        def waiting(state: tenacity.RetryCallState) -> None:
            if state.attempt_number == 1:
                log.warning("job %s ended (%s) while its job table is unreachable (%s); it is recorded when the "
                            "database is back", job.id, status, state.outcome.exception() if state.outcome else "?")

        tries = [0]

        def finish_once() -> bool:
            tries[0] += 1
            return self.store.finish(job.id, job.attempts, status, **finish)

        ok = tenacity.Retrying(retry=tenacity.retry_if_exception(unreachable), before_sleep=waiting, reraise=True,
                               wait=tenacity.wait_exponential(multiplier=0.25, max=FINISH_RETRY_MAX_S),
                               sleep=self._sleep_unless_draining)(finish_once)
        if tries[0] > 1:
            log.warning("job %s recorded as %s now that its job table is back", job.id, status)
        return ok

    def _sleep_unless_draining(self, seconds: float) -> None:
        self._draining.wait(seconds)

    def _finish(self, job: Job, status: str, *, stats=None, error=None, videos=None, wall: float | None = None,
                dev: Device | None = None) -> None:
        try:
            ok = self._record(job, status, stats=stats, error=error, videos=videos)
        except JobStoreError as exc:
            log.error("could not record job %s as %s (%s); the next start requeues it", job.id, status, exc)
            ok = False
        if ok:
            m = self.metrics
            m.requests.labels(status=status, policy=job.policy).inc()
            if status == COMPLETED and stats is not None:
                tier = stats["tier"]
                m.hits.labels(tier=tier).inc()
                if tier == "reuse" and stats.get("certified") is False:
                    m.uncertified.inc()
                m.steps_skipped.inc(max(0, stats["steps"] - stats["steps_computed"]))
                if stats["seconds_saved"]:
                    device = "cuda" if "cuda" in str(getattr(dev, "name", "")) else "cpu"
                    m.seconds_saved.labels(device=device).inc(stats["seconds_saved"])
                for stage in STAGES:
                    if stage in stats["timings"]:
                        m.stage_seconds.labels(stage=stage).observe(stats["timings"][stage])
                if wall is not None:
                    m.job_seconds.labels(tier=tier).observe(wall)
                    self.job_seconds_ema = wall if self.job_seconds_ema is None else 0.8 * self.job_seconds_ema + 0.2 * wall
        try:
            final = self.store.get(job.tenant, job.id)
        except JobStoreError:
            final = None
        self.hub.publish(job.id, DONE, {"id": job.id, "status": final.status if final else status})
