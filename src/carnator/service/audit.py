"""Shadow audits: a live bound on the unsafe share of the service's approximate hits, per kind of change and tier.

A thresholds file's certificate (docs/CALIBRATION.md) is computed offline on calibration pairs; production traffic may
differ from them, and nothing would say so. ``carnator serve`` therefore re-runs a sample of its approximate hits
(never exact hits: those are the request's own stored video) densely, with the same request and seed, on idle
device time, judges the pair with the thresholds file's own judge and quality rule (as ``carnator calibrate`` labels
its rows: the reuse's scores against the dense clip's, the dense clip the reference of both; a tier certified in excess
of a fresh sample, ``calibrate --risk excess``, also against another dense sample where the hit fails), and records the verdict
in the job store (:meth:`~carnator.service.jobs.SqlJobStore.record_audit`: SQLite beside the job table, or
PostgreSQL, where every server sharing the job store counts towards one bound).

Per ``(kind of change, tier)`` of a thresholds file the verdicts give two one-sided Clopper-Pearson bounds at the
file's confidence: the upper ``bound`` (what the live traffic itself certifies: at most ``delta`` once enough safe
verdicts came in, the same arithmetic as the certificate's) and the ``lower`` one. A tier is **disabled** when its
lower bound passes the file's ``delta``: the audits then show, at the file's confidence, that the tier's unsafe share
exceeds what its certificate claims (the one-sided binomial test of ``p <= delta`` rejects). The upper bound cannot be
the trigger: with few verdicts it is above ``delta`` for lack of evidence alone (0 unsafe of 10 bound 20.6 % at 90 %),
which would stop every tier on its first audit. A disabled tier stays off (its verdicts are durable) until a thresholds
file of another content is loaded: verdicts count per file (``thresholds``: a hash of its bytes). The unsafe hit's own
cache entry is evicted (it would serve its clip again to an exact repeat).

An audit is the lowest priority work: a worker runs one only when no job is queued and the time budget allows
(``budget``: the share of device time audits may take, a token bucket over ``window_s``), and it yields at the next
denoising step boundary when a job is queued (the audit goes back to the front of its queue and restarts later).
Hits waiting for an audit are kept in memory (at most ``max_pending``, the oldest dropped): a restart loses them, not
the verdicts.

With ``carnator serve --replicas N`` the auditor runs at the ingress, whose worker slots hand jobs to the replicas
(:mod:`carnator.service.scale`): a replica's hit comes back with its frames and ``stats.notes["audit"]`` (its kind
and tier) and is sampled like a local one; an audit's dense run goes to a replica through the same slot, as the
lowest priority job (it yields at a step boundary when a job is queued, the ingress posting its cancel to the
replica); its verdict is recorded at the ingress; a tier is disabled on the ingress's policy, and every job then
carries that policy's disabled set to its replica, which decides the job by exactly that set.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Cancelled, CarnatorError
from ..judges import Judge, QualityRule, get_judge
from ..request import Params
from ..calibrate.certify import clopper_pearson_lower, clopper_pearson_upper
from ..calibrate.run import RISKS, label, resample_seed
from ..reuse.compat import Thresholds

log = logging.getLogger("carnator.service")

#: the share of approximate hits audited by default (``carnator serve --audit RATE``)
DEFAULT_RATE = 0.1
#: the share of device time audits may take by default (``--audit-budget``)
DEFAULT_BUDGET = 0.1
#: the event hub channel audits publish their steps on (never a job id: those start with ``video_``)
CHANNEL = "audit"


@dataclass(frozen=True)
class AuditConfig:
    """``rate``: share of approximate hits audited (0: off); ``budget``: share of device time audits may take (1: no
    limit); ``judge``: a judge spec (``NAME[=ARG]``) when the thresholds file's judge needs an argument (e.g.
    ``clip=DIR``); ``seed``: of the sampling (None: random)."""

    rate: float = DEFAULT_RATE
    budget: float = DEFAULT_BUDGET
    judge: str | None = None
    max_pending: int = 64
    window_s: float = 600.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.rate) <= 1.0:
            raise ValueError(f"the audit rate must lie in [0, 1], got {self.rate!r}")
        if not 0.0 < float(self.budget) <= 1.0:
            raise ValueError(f"the audit budget must lie in (0, 1], got {self.budget!r}")


@dataclass(frozen=True)
class Certificate:
    """What the audits test, from the thresholds file: its identity (a hash of its bytes), ``delta``, ``confidence``,
    the quality rule (and a tier's own, where its kind was certified under one: an edit's rule reads the attribute it
    asks) and the judge's identity (None: the file names none)."""

    path: str
    identity: str
    delta: float
    confidence: float
    rule: QualityRule
    judge: str | None
    admission_judge: str | None = None
    tier_rules: Mapping[str, QualityRule] = field(default_factory=dict)
    #: a kind whose tier was certified in excess of a fresh sample (``calibrate --risk excess``) -> "excess"
    tier_risks: Mapping[str, str] = field(default_factory=dict)

    def rule_for(self, kind: str) -> QualityRule:
        """The rule a hit of this kind of change is judged by."""
        return self.tier_rules.get(kind, self.rule)

    def risk_for(self, kind: str) -> str:
        """How a hit of this kind is labelled, as its tier was certified: "pair" or "excess"."""
        return self.tier_risks.get(kind, "pair")


def thresholds_identity(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def certificate_of(path: str | Path) -> Certificate:
    """The certificate a thresholds file states; CarnatorError when it names no quality rule."""
    meta = Thresholds.file_meta(path)
    # `carnator calibrate` writes the rule as meta.rule; the embedded model's file as meta.quality_rule (its meta.rule
    # says in words what its thresholds accept)
    rule = next((r for r in (meta.get("rule"), meta.get("quality_rule")) if isinstance(r, Mapping)), None)
    if rule is None:
        raise CarnatorError(f"thresholds file {path} names no quality rule (meta.rule): its hits cannot be audited")
    adm = meta.get("admission") if isinstance(meta.get("admission"), Mapping) else {}
    tiers: Mapping[str, Any] = meta["tiers"] if isinstance(meta.get("tiers"), Mapping) else {}
    own = {str(k): QualityRule.from_dict(t["rule"]) for k, t in tiers.items() if isinstance(t, Mapping) and isinstance(t.get("rule"), Mapping)}
    risks = {str(k): str(t["risk"]) for k, t in tiers.items() if isinstance(t, Mapping) and t.get("risk") in RISKS}
    return Certificate(path=str(path), identity=thresholds_identity(path), delta=float(meta.get("delta", 0.05)),
                       confidence=float(meta.get("confidence", 0.9)), rule=QualityRule.from_dict(rule),
                       judge=meta.get("judge"), admission_judge=(adm or {}).get("judge"), tier_rules=own, tier_risks=risks)


def judge_for(cert: Certificate, spec: str | None = None) -> Judge:
    """The judge the file was certified with: ``spec`` when given (it must be the file's judge), else the one named by
    the file's judge identity (``shapes-<hash>`` -> ``shapes``), else its admission gate's judge; it must score every
    score the rule names. CarnatorError saying what to pass otherwise."""
    if spec is not None:
        judge = get_judge(spec)
    elif cert.judge:
        name = str(cert.judge).replace(":", "-").split("-")[0]
        try:
            judge = get_judge(name)
        except Exception as e:  # noqa: BLE001 - e.g. clip needs its directory
            raise CarnatorError(f"the thresholds were certified by judge {cert.judge}; pass it as --audit-judge "
                                f"{name}=ARG ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    elif cert.admission_judge:
        judge = get_judge(cert.admission_judge)
    else:
        raise CarnatorError("the thresholds file names no judge: pass --audit-judge NAME[=ARG]")
    if cert.judge and judge.identity != cert.judge:
        raise CarnatorError(f"--audit-judge {judge.identity} is not the judge the thresholds were certified by "
                            f"({cert.judge})")
    missing = sorted((set(cert.rule.deltas) | set(cert.rule.floors)) - set(judge.directions))
    if missing:
        raise CarnatorError(f"judge {judge.name} has no score {', '.join(missing)}, which the thresholds' rule checks")
    return judge


def tier_state(n: int, unsafe: int, delta: float, confidence: float) -> dict[str, Any]:
    """The live state of a tier after ``n`` verdicts, ``unsafe`` of them unsafe: ``bound`` (upper), ``lower`` and
    ``disabled`` (lower > delta)."""
    lower = clopper_pearson_lower(unsafe, n, confidence) if n else 0.0
    return {"bound": clopper_pearson_upper(unsafe, n, confidence), "lower": lower, "disabled": lower > delta}


def verdicts_to_disable(delta: float, confidence: float, limit: int = 10_000) -> int | None:
    """The fewest verdicts, all unsafe, after which a tier is disabled: the smallest n with ``(1 - confidence)**(1/n) >
    delta`` (the lower bound of n unsafe of n)."""
    return next((n for n in range(1, limit + 1) if clopper_pearson_lower(n, n, confidence) > delta), None)


def live_bounds(verdicts: Iterable[Mapping[str, Any]], delta: float, confidence: float) -> list[dict[str, Any]]:
    """Per (kind, step, of) of ``verdicts`` (oldest first): the verdicts, the unsafe among them, the bounds, whether
    the tier is disabled and after which verdict it first was (``disabled_after``: its count then)."""
    out: dict[tuple, dict[str, Any]] = {}
    for v in verdicts:
        key = (v["kind"], int(v["step"]), v.get("of"))
        t = out.setdefault(key, {"kind": key[0], "step": key[1], "of": key[2], "n": 0, "unsafe": 0,
                                 "disabled_after": None})
        t["n"] += 1
        t["unsafe"] += 0 if v["acceptable"] else 1
        if t["disabled_after"] is None and tier_state(t["n"], t["unsafe"], delta, confidence)["disabled"]:
            t["disabled_after"] = t["n"]
    rows = []
    for t in out.values():
        st = tier_state(t["n"], t["unsafe"], delta, confidence)
        rows.append({**t, **st, "disabled": t["disabled_after"] is not None})
    return sorted(rows, key=lambda r: (r["kind"], r["step"]))


def tier_label(step: int, of: int | None) -> str:
    return f"{step}/{of}" if of else str(step)


@dataclass
class Pending:
    """An approximate hit waiting for its audit."""

    job_id: str
    tenant: str
    params: Params
    frames: np.ndarray
    kind: str
    step: int
    of: int | None
    entry_id: str | None
    source_id: str | None
    preempted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Auditor:
    """Samples a service's approximate hits, audits them on idle device time and keeps its tiers' live state.

    ``store``: the job store (verdicts); ``engines``: every engine whose ``carnator`` policy a disabled tier applies
    to (with replicas: the ingress's, whose disabled set each job carries to its replica). ``enabled`` is False (``off`` says why) when the rate is 0, the policy's thresholds are no file, or the file's
    judge cannot be had."""

    def __init__(self, store, engines: Sequence[Any], config: AuditConfig, metrics=None, hub=None,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.engines, self.config, self.metrics, self.hub = store, list(engines), config, metrics, hub
        self._clock = clock
        self._rng = random.Random(config.seed)
        self._pending: deque[Pending] = deque()
        self._lock = threading.Lock()
        self._credit = 0.0
        self._last = clock()
        self.seconds = 0.0          # device seconds spent on audits (preempted ones included)
        self.counts = {"sampled": 0, "safe": 0, "unsafe": 0, "preempted": 0, "dropped": 0, "failed": 0}
        self.disabled: set[tuple[str, int]] = set()
        self.cert: Certificate | None = None
        self.judge: Judge | None = None
        self.off: str | None = None
        if config.rate <= 0:
            self.off = "off (--audit 0)"
            return
        try:
            pol = self._policy(self.engines[0])
            if pol is None or getattr(pol, "thresholds_path", None) is None:
                raise CarnatorError("the carnator policy runs on no thresholds file (the paper's thresholds): nothing "
                                    "certified to audit")
            self.cert = certificate_of(pol.thresholds_path)
            self.judge = judge_for(self.cert, config.judge)
        except CarnatorError as e:
            self.off = f"off: {e}"
            log.warning("shadow audits are %s", self.off)
            return
        self.refresh()

    @property
    def enabled(self) -> bool:
        return self.off is None

    @staticmethod
    def _policy(engine) -> Any:
        try:
            return engine.policy("carnator")
        except Exception:  # noqa: BLE001 - an engine without the carnator policy has nothing to disable
            return None

    # ---- the tiers' state -----------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the verdicts of this thresholds file (every server's) and apply the disabled tiers to the policies."""
        if self.cert is None:
            return
        try:
            rows = self.store.audit_verdicts(self.cert.identity)
        except Exception as e:  # noqa: BLE001 - the job store down: keep what we have
            log.warning("could not read the audit verdicts: %s", e)
            return
        bounds = live_bounds(rows, self.cert.delta, self.cert.confidence)
        self._apply({(t["kind"], t["step"]) for t in bounds if t["disabled"]})

    def _apply(self, disabled: set[tuple[str, int]]) -> None:
        new = disabled - self.disabled
        self.disabled = set(disabled)
        for eng in self.engines:
            pol = self._policy(eng)
            if pol is not None and hasattr(pol, "disable"):
                pol.disable(self.disabled)
        for kind, step in sorted(new):
            log.warning("live audit: the %s tier (step %s) is disabled: its audited hits bound the unsafe share above "
                        "delta %.3g at %.3g confidence; requests of that kind miss until a new thresholds file is loaded",
                        kind, step, self.cert.delta if self.cert else float("nan"),
                        self.cert.confidence if self.cert else float("nan"))

    def report(self) -> dict[str, Any]:
        """The live state for the page, ``/metrics`` and the log: per tier its verdicts and bounds (no tenant data)."""
        out: dict[str, Any] = {"enabled": self.enabled, "off": self.off, "rate": self.config.rate,
                               "budget": self.config.budget, "pending": len(self._pending), "seconds": round(self.seconds, 3),
                               "counts": dict(self.counts), "tiers": []}
        if self.cert is None:
            return out
        out.update(thresholds=self.cert.identity, delta=self.cert.delta, confidence=self.cert.confidence,
                   judge=self.judge.identity if self.judge else None, rule=self.cert.rule.describe(),
                   verdicts_to_disable=verdicts_to_disable(self.cert.delta, self.cert.confidence))
        try:
            rows = self.store.audit_verdicts(self.cert.identity)
        except Exception:  # noqa: BLE001
            return out
        out["tiers"] = [{**t, "tier": tier_label(t["step"], t["of"])} for t in
                        live_bounds(rows, self.cert.delta, self.cert.confidence)]
        return out

    # ---- sampling ----------------------------------------------------------------------------
    def offer(self, job, res, summary: Mapping[str, Any]) -> bool:
        """A finished job: sample it for an audit when it is an approximate hit of the carnator policy. Whether it was."""
        if not self.enabled or summary.get("tier") != "reuse" or job.policy != "carnator":
            return False
        audit = (res.stats.notes or {}).get("audit")
        if not isinstance(audit, Mapping) or self._rng.random() >= self.config.rate:
            return False
        p = Pending(job_id=job.id, tenant=job.tenant, params=Params.from_dict(job.params, tenant=job.tenant), frames=np.asarray(res.frames),
                    kind=str(audit["kind"]), step=int(audit["step"]), of=audit.get("of"),
                    entry_id=summary.get("entry_id"), source_id=summary.get("source_id"))
        with self._lock:
            self._pending.append(p)
            self.counts["sampled"] += 1
            while len(self._pending) > self.config.max_pending:
                self._pending.popleft()
                self.counts["dropped"] += 1
        return True

    def _refill(self) -> None:
        now = self._clock()
        cap = self.config.budget * self.config.window_s
        self._credit = min(cap, self._credit + self.config.budget * (now - self._last))
        self._last = now

    def ready(self) -> bool:
        """Whether an audit waits and the budget allows one now."""
        if not self._pending:
            return False
        if self.config.budget >= 1.0:
            return True
        with self._lock:
            self._refill()
            return self._credit > 0

    # ---- running one -------------------------------------------------------------------------
    def run_one(self, engine, preempt: Callable[[], bool]) -> str | None:
        """Audit the oldest waiting hit on ``engine``: its dense run (same request, same seed, no cache read or
        written), yielding at the next step boundary when ``preempt()`` says a job waits (the hit goes back to the
        front of the queue). Returns "safe", "unsafe", "preempted", "failed" or None (nothing to audit)."""
        with self._lock:
            if not self._pending:
                return None
            p = self._pending.popleft()
        judge, cert = self.judge, self.cert
        assert judge is not None and cert is not None   # enabled only with a certificate and its judge
        prompt = p.params.prompt
        t0 = self._clock()
        self._publish("start", {"job": p.job_id, "kind": p.kind, "tier": tier_label(p.step, p.of)})

        def progress(done: int, total: int) -> None:
            self._publish("progress", {"job": p.job_id, "step": done, "total": total})

        def dense_run(seed: int):   # the request densely at ``seed``, reading and writing nothing of the cache
            return engine.run(replace(p.params, seed=seed, policy="dense", cache="off", store=False), progress=progress, cancel=preempt)

        rule, jo = cert.rule_for(p.kind), None
        try:
            dense = dense_run(p.params.seed)   # the same request and seed
            jd = judge.score(dense.frames, prompt, reference=dense.frames)
            jr = judge.score(p.frames, prompt, reference=dense.frames)
            if cert.risk_for(p.kind) == "excess" and not rule.acceptable(jr, jd):
                # the tier bounds failures in excess of a fresh sample (calibrate --risk excess): another dense sample
                # of the request, judged against the same dense run; the hit is unsafe only where it passes
                other = dense_run(resample_seed(p.params.seed))
                jo = judge.score(other.frames, prompt, reference=dense.frames)
        except Cancelled:
            self._spent(t0)
            p.preempted += 1
            with self._lock:
                self._pending.appendleft(p)
                self.counts["preempted"] += 1
            self._publish("preempted", {"job": p.job_id})
            return "preempted"
        except Exception:  # noqa: BLE001 - an audit never takes a worker down
            self._spent(t0)
            log.exception("the audit of job %s failed", p.job_id)
            self.counts["failed"] += 1
            return "failed"
        # labelled as calibration labels its rows (an excess tier's failing hit: against the fresh sample too)
        ok = label({"reuse": jr, "dense": jd, "dense_other": jo}, rule, "excess" if jo is not None else "pair")
        seconds = self._spent(t0)
        verdict = {"job_id": p.job_id, "tenant": p.tenant, "thresholds": cert.identity, "kind": p.kind, "step": p.step,
                   "of": p.of, "acceptable": ok,
                   "scores": {"reuse": _plain(jr), "dense": _plain(jd), **({"dense_other": _plain(jo)} if jo is not None else {})},
                   "request": p.params.to_dict(tenant=False), "entry_id": p.entry_id, "source_id": p.source_id, "seconds": round(seconds, 4)}
        try:
            row = self.store.record_audit(verdict, lambda n, k: tier_state(n, k, cert.delta, cert.confidence))
        except Exception as e:  # noqa: BLE001 - the verdict is lost, the service goes on
            log.warning("could not record the audit of job %s: %s", p.job_id, e)
            self.counts["failed"] += 1
            return "failed"
        self.counts["safe" if ok else "unsafe"] += 1
        if not ok and p.entry_id:
            # its clip would be served again to an exact repeat: the entry goes (the repeat then runs afresh)
            try:
                engine.store.evict([p.entry_id])
            except Exception as e:  # noqa: BLE001
                log.warning("could not evict the unsafe hit's entry %s: %s", p.entry_id, e)
        log.info("audit of job %s (%s, tier %s): %s; %d verdict(s), %d unsafe, bound %.3f, lower %.3f",
                 p.job_id, p.kind, tier_label(p.step, p.of), "safe" if ok else "UNSAFE", row["n"], row["unsafe"],
                 row["bound"], row["lower"])
        self._publish("verdict", {"job": p.job_id, "kind": p.kind, "tier": tier_label(p.step, p.of), "acceptable": ok,
                                  "n": row["n"], "unsafe": row["unsafe"], "disabled": row["disabled"]})
        if row["disabled"] and (p.kind, p.step) not in self.disabled:
            self._apply(self.disabled | {(p.kind, p.step)})
        else:
            self.refresh()   # other servers' verdicts too
        return "safe" if ok else "unsafe"

    def _spent(self, t0: float) -> float:
        s = self._clock() - t0
        with self._lock:
            self.seconds += s
            self._refill()
            self._credit -= s
        return s

    def _publish(self, kind: str, data: dict[str, Any]) -> None:
        if self.hub is not None:
            self.hub.publish(CHANNEL, kind, data)


def _plain(scores: Mapping[str, Any]) -> dict[str, float | None]:
    out = {}
    for k, v in scores.items():
        v = float(v)
        out[k] = None if v != v else v
    return out


def format_report(rep: Mapping[str, Any]) -> list[str]:
    """``carnator audit``'s lines: per tier its verdicts, bounds and state."""
    lines = []
    if not rep.get("tiers"):
        lines.append("no audit verdicts" + (f" for thresholds {rep['thresholds']}" if rep.get("thresholds") else ""))
    for t in rep.get("tiers", []):
        state = f"DISABLED after verdict {t['disabled_after']}" if t["disabled"] else "enabled"
        lines.append(f"{t['kind']:9s} tier {tier_label(t['step'], t['of']):7s} {t['n']:5d} verdicts {t['unsafe']:4d} unsafe"
                     f"  bound {100 * t['bound']:6.2f} %  lower {100 * t['lower']:6.2f} %  {state}")
    return lines
