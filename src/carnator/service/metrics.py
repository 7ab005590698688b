"""Prometheus metrics of ``carnator serve`` (``GET /metrics``).

Labels never carry a tenant, a prompt or a job id: only statuses, policies, tiers, stages and reasons, so that a
scrape tells the operator how the service does and nothing of what any tenant asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: the engine stages timed as histograms (``Stats.timings`` keys)
STAGES = ("exact_lookup", "recall", "probe", "decision", "dit", "decode", "store", "total")
TIERS = ("exact", "reuse", "miss")
_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_WAIT = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class ServiceMetrics:
    """One registry per service (tests run several services in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("carnator_requests", "Video jobs by status (queued counts submissions) and policy",
                                ["status", "policy"], registry=r)
        self.hits = Counter("carnator_cache_hits", "Finished jobs by cache tier: exact (stored video), reuse "
                            "(approximate: resumed from a cached trajectory) or miss", ["tier"], registry=r)
        self.uncertified = Counter("carnator_uncertified_reuse_hits", "Finished approximate hits whose thresholds no "
                                   "certified file backs (stats certified: false; only with --allow-uncertified)", registry=r)
        self.steps_skipped = Counter("carnator_steps_skipped", "Denoising steps not computed thanks to the cache", registry=r)
        self.seconds_saved = Counter("carnator_compute_seconds_saved", "Estimated device seconds saved by the cache "
                                     "(a dense run's estimate minus the job's time)", ["device"], registry=r)
        self.stage_seconds = Histogram("carnator_stage_seconds", "Seconds per engine stage of finished jobs", ["stage"],
                                       buckets=_LATENCY, registry=r)
        self.queue_wait = Histogram("carnator_queue_wait_seconds", "Seconds from submission to a worker taking the job",
                                    buckets=_WAIT, registry=r)
        self.job_seconds = Histogram("carnator_job_seconds", "Seconds a worker spent on a finished job, by tier", ["tier"],
                                     buckets=_LATENCY, registry=r)
        self.rejections = Counter("carnator_rejections", "Refused requests by reason", ["reason"], registry=r)
        self.evictions = Counter("carnator_cache_evictions", "Cache entries removed to make room (or replaced) when "
                                 "this server stored a result", registry=r)
        self.store_errors = Counter("carnator_cache_store_errors", "Results that could not be stored in the cache", registry=r)
        self.requeued = Counter("carnator_jobs_requeued", "Jobs put back in the queue (restart or shutdown) or started "
                                "over in a new attempt (their replica failed)", registry=r)
        self._lock = threading.Lock()

    def add_gauges(self, job_counts: Callable[[], Mapping[str, int]], cache_stats: Callable[[], Any],
                   running: Callable[[], int], store_unavailable: Callable[[], int] | None = None) -> None:
        """Gauges read at scrape time: queue depth, running jobs, cache entries and bytes; and the counter of cache
        calls served without the store (a shared store's PostgreSQL unreachable)."""
        self.registry.register(_Gauges(job_counts, cache_stats, running, store_unavailable or (lambda: 0)))

    def add_audit(self, report: Callable[[], Mapping[str, Any]]) -> None:
        """The shadow audits' live state, read at scrape time (:meth:`carnator.service.audit.Auditor.report`)."""
        self.registry.register(_Audit(report))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    def __init__(self, job_counts, cache_stats, running, unavailable) -> None:
        self._jobs, self._cache, self._running, self._unavailable = job_counts, cache_stats, running, unavailable

    def describe(self) -> Iterable:  # no call at registration (the store may be slow)
        return []

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        try:
            counts = self._jobs()
        except Exception:  # a scrape never fails for a busy or full disk
            counts = {}
        yield GaugeMetricFamily("carnator_queue_depth", "Jobs waiting for a worker", value=counts.get("queued", 0))
        yield GaugeMetricFamily("carnator_running_jobs", "Jobs a worker is running", value=self._running())
        try:
            st = self._cache()
            entries, nbytes = st.count, st.bytes
        except Exception:
            entries = nbytes = float("nan")
        yield GaugeMetricFamily("carnator_cache_entries", "Entries in the cache (every tenant)", value=entries)
        yield GaugeMetricFamily("carnator_cache_bytes", "Bytes of the cache's entries (every tenant)", value=nbytes)
        try:
            down = float(self._unavailable())
        except Exception:
            down = float("nan")
        yield CounterMetricFamily("carnator_cache_store_unavailable", "Cache calls served as misses because the "
                                  "shared store's PostgreSQL could not be reached (requests ran dense)", value=down)


class _Audit:
    def __init__(self, report) -> None:
        self._report = report

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        try:
            rep = self._report()
        except Exception:  # a scrape never fails for a busy store
            return
        labels = ["kind", "tier"]
        bound = GaugeMetricFamily("carnator_audit_bound", "Live one-sided Clopper-Pearson upper bound of the unsafe "
                                  "share of audited approximate hits, per kind of change and tier (thresholds file's "
                                  "confidence)", labels=labels)
        lower = GaugeMetricFamily("carnator_audit_lower_bound", "Its lower bound: a tier is disabled once this passes "
                                  "the thresholds file's delta", labels=labels)
        verdicts = GaugeMetricFamily("carnator_audit_verdicts", "Audit verdicts under the loaded thresholds file, per "
                                     "kind, tier and verdict (every server sharing the job store)",
                                     labels=[*labels, "verdict"])
        disabled = GaugeMetricFamily("carnator_audit_tier_disabled", "1: the tier is disabled by its live audit "
                                     "(requests of its kind miss until a new thresholds file is loaded)", labels=labels)
        for t in rep.get("tiers", []):
            lv = [str(t["kind"]), str(t["tier"])]
            bound.add_metric(lv, float(t["bound"]))
            lower.add_metric(lv, float(t["lower"]))
            verdicts.add_metric([*lv, "safe"], float(t["n"] - t["unsafe"]))
            verdicts.add_metric([*lv, "unsafe"], float(t["unsafe"]))
            disabled.add_metric(lv, 1.0 if t["disabled"] else 0.0)
        yield from (bound, lower, verdicts, disabled)
        if rep.get("delta") is not None:
            yield GaugeMetricFamily("carnator_audit_delta", "The thresholds file's delta the live bounds are held to",
                                    value=float(rep["delta"]))
        yield GaugeMetricFamily("carnator_audit_pending", "Sampled approximate hits waiting for their audit",
                                value=float(rep.get("pending", 0)))
        yield CounterMetricFamily("carnator_audit_seconds", "Device seconds this server spent on audits (preempted "
                                  "ones included)", value=float(rep.get("seconds", 0.0)))
        runs = CounterMetricFamily("carnator_audits", "This server's audits by outcome: sampled, safe, unsafe, "
                                   "preempted (yielded to a job, run again later), dropped (queue full), failed",
                                   labels=["outcome"])
        for k, v in (rep.get("counts") or {}).items():
            runs.add_metric([k], float(v))
        yield runs
