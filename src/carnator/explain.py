"""A request's outcome in words: what was decided (exact hit, hit, miss), why, and what it cost in denoising steps.

Read from what :meth:`Carnator.generate <carnator.engine.Carnator.generate>` returns (``Result.stats``: ``hit``,
``exact_hit``, ``source_id``, ``resume_step``, ``dit_forwards``, ``notes``), the policy's thresholds and the
cache's entry of the source. Used by ``carnator generate``'s summary line and by the demo's page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Check:
    """One discrepancy of a hit against its threshold (``threshold`` None: that dimension is off)."""

    name: str
    value: float
    threshold: float | None

    @property
    def passed(self) -> bool:
        return self.threshold is None or self.value <= self.threshold

    def text(self) -> str:
        v = _num(self.value)
        return f"{self.name} {v}" if self.threshold is None else f"{self.name} {v} {'<=' if self.passed else '>'} {_num(self.threshold)}"


@dataclass
class Outcome:
    """What happened to one request, for people."""

    decision: str  # "exact hit", "hit" or "miss"
    reason: str  # why, with the numbers (generate's line)
    steps: int  # the request's denoising steps
    steps_computed: int  # steps whose DiT forwards ran (a hit: its probe and the steps after its resume step)
    dit_forwards: int
    source_id: str | None = None  # a hit's source entry
    tested_id: str | None = None  # a miss's: the cached candidate its compatibility test tried and refused
    source_prompt: str | None = None  # of the source, or of the tested candidate
    source_seed: int | None = None
    checks: list[Check] = field(default_factory=list)
    risk: tuple[float, float] | None = None  # (risk score, its threshold) of a hit under a risk rule
    headline: str = ""  # the reason without the numbers of ``checks`` and ``risk`` (the page lists them beside it)

    @property
    def steps_saved(self) -> int:
        return self.steps - self.steps_computed

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision, "reason": self.reason, "headline": self.headline or self.reason, "steps": self.steps, "steps_computed": self.steps_computed,
            "steps_saved": self.steps_saved, "dit_forwards": self.dit_forwards, "source_id": self.source_id,
            "tested_id": self.tested_id, "source_prompt": self.source_prompt, "source_seed": self.source_seed,
            "checks": [{"name": c.name, "value": _json_num(c.value), "threshold": _json_num(c.threshold), "passed": c.passed} for c in self.checks],
            "risk": None if self.risk is None else {"value": self.risk[0], "threshold": self.risk[1]},
        }


def _num(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.2f}"


def _json_num(v: float | None) -> float | str | None:
    return "inf" if v is not None and math.isinf(v) else v


def describe(engine, res) -> Outcome:
    """The :class:`Outcome` of ``res`` (a :class:`~carnator.request.Result` of ``engine``), from its stats: the
    decision's reason, and the evidence the policy recorded in the notes (the tested candidates' discrepancies)."""
    s, req = res.stats, res.request
    n = req.num_inference_steps
    per_step = max(1, s.dense_forwards // n) if s.dense_forwards else 1
    computed = min(n, s.dit_forwards // per_step)
    out = Outcome(decision="exact hit" if s.exact_hit else ("hit" if s.hit else "miss"), reason="", steps=n,
                  steps_computed=computed, dit_forwards=s.dit_forwards, source_id=s.source_id)
    if s.source_id is not None:
        meta = engine.store.get(s.source_id)
        if meta is not None:
            out.source_prompt, out.source_seed = meta.prompt, meta.seed
    notes = s.notes or {}
    src = _source_text(out)
    tau = _thresholds(engine, s.policy)
    if s.exact_hit:
        out.reason = f"the same request as {src}: its stored video"
    elif s.hit and isinstance(notes.get("tier"), dict):
        # reused by a risk tier: the kind of change, how much was recomputed, and the tier's certificate
        t = notes["tier"]
        how = "whole frame" if t.get("scope") == "frame" else "region-guided"
        share = "" if s.active_fraction is None else f", {100 * s.active_fraction:.0f} % of tokens recomputed"
        bound = "" if t.get("bound") is None else f"; the {t.get('kind')} tier's unsafe rate <= {100 * t['bound']:.1f} % (certified)"
        change = s.reason.split(": ", 1)[0] if ": " in s.reason else str(t.get("kind"))
        out.headline = f"{change}: {how} from step {s.resume_step} of {n}{share}"
        out.reason = f"{out.headline} (source {src}){bound}"
    elif s.hit:
        out.checks, out.risk = _checks(tau, notes.get("discrepancies"))
        out.headline = f"compatible with {src}; resumed at step {s.resume_step} of {n}"
        if out.risk is not None:
            passed = f"risk {out.risk[0]:.3f} <= {out.risk[1]:.3f}"
            dims = ", ".join(c.text() for c in out.checks)
            out.reason = f"compatible with {src}: {passed} ({dims}); resumed at step {s.resume_step} of {n}"
        elif out.checks:
            out.reason = f"compatible with {src}: {', '.join(c.text() for c in out.checks)}; resumed at step {s.resume_step} of {n}"
        elif "similarity" in notes:
            out.reason = f"similar to {src} (similarity {float(notes['similarity']):.3f}); resumed at step {s.resume_step} of {n}"
        else:
            out.reason = f"reused {src} from step {s.resume_step} of {n}"
        if not out.checks:
            out.headline = out.reason
    elif s.policy == "dense":
        out.reason = "the dense policy reuses nothing"
    elif "fallback" in notes:
        out.reason = "generated densely: " + str(notes.get("reason") or f"the {s.policy} policy cannot run on this model")
    elif "change" in notes:   # a risk tier's miss: the nearest request, what it asks differently, and why no tier serves
        out.reason = s.reason
        near = notes.get("nearest") or {}
        meta = engine.store.get(near["id"]) if near.get("id") else None
        if meta is not None and ": " in s.reason:
            out.tested_id, out.source_prompt, out.source_seed = meta.id, meta.prompt, meta.seed
            what = _source_text(Outcome("", "", 0, 0, 0, source_id=meta.id, source_prompt=meta.prompt, source_seed=meta.seed))
            out.reason = (f"the nearest cached request, {what}, differs in {near.get('what') or 'what it asks'}: "
                          f"{s.reason.split(': ', 1)[1]}")
            out.headline = out.reason   # why no tier serves it is the point: the page and the CLI show it whole
    elif "candidates" in notes:
        k = int(notes["candidates"])
        tested = notes.get("tested") or []
        if k == 0 and notes.get("recall") == "content":
            if notes.get("recalled") == 0:   # nothing asks the same: say what the nearest sentence asks differently
                _nearest_by_sentence(engine, res, tau, out)
            else:                            # some ask the same but cannot be sources: the policy says why
                out.reason = s.reason
        elif k == 0:   # the policy says which: nothing cached at all, or nothing its filter lets through
            out.reason = s.reason or "nothing cached with the same settings"
        elif not tested:
            out.reason = f"{k} cached candidate{'s' if k > 1 else ''} with matching nouns; {s.reason}"
        else:
            first = tested[0]
            meta = engine.store.get(first["id"])
            out.tested_id = first["id"]
            if meta is not None:
                out.source_prompt, out.source_seed = meta.prompt, meta.seed
            out.checks, out.risk = _checks(tau, first.get("discrepancies"))
            what = _source_text(Outcome("", "", 0, 0, 0, source_id=first["id"], source_prompt=out.source_prompt, source_seed=out.source_seed))
            verdict = (f"risk {out.risk[0]:.3f} {'<=' if out.risk[0] <= out.risk[1] else '>'} {out.risk[1]:.3f} ("
                       if out.risk is not None else "(")
            out.headline = f"{k} cached candidate{'s' if k > 1 else ''} with matching nouns; the first, {what}, failed the compatibility test"
            out.reason = f"{out.headline}: {verdict}{', '.join(c.text() for c in out.checks)})"
    elif s.reason:
        out.reason = s.reason
    else:
        out.reason = "nothing cached was reused"
    return out


def _nearest_by_sentence(engine, res, tau, out: Outcome) -> None:
    """A miss of a rule that recalled by content only (nothing cached asks the same): its reason, and the cached request
    nearest by sentence with what it asks differently, so that an edit says what changed. Searched here, when the
    miss is described (the CLI, the demo), never on the request's path."""
    from .signature.content import content_change, content_distance

    s, req = res.stats, res.request
    out.reason = s.reason
    try:
        engine.flush(res)  # this request's own entry, when written behind, is then known and left out
        pol = engine.policy(s.policy)
        found = engine.store.recall(req.tenant, engine.compat_key(req, pol), engine.embed(req.prompt), k=2)
    except Exception:  # noqa: BLE001 - an explanation must never fail the request it explains
        return
    near = next((m for m, _ in found if m.id != s.entry_id), None)
    if near is None:
        return
    mine, theirs = engine.content(req.prompt), near.extra.get("content")
    d = content_distance(mine, theirs)
    if d == 0:  # the nearest asks the same yet was no candidate (e.g. a reuse's own entry): the policy's reason stands
        return
    out.tested_id, out.source_prompt, out.source_seed = near.id, near.prompt, near.seed
    out.checks, out.risk = _checks(tau, {"content": d})
    what = _source_text(Outcome("", "", 0, 0, 0, source_id=near.id, source_prompt=near.prompt, source_seed=near.seed))
    change = f"differs in {content_change(mine, theirs)}" if d <= 2 else "asks another scene"
    out.headline = f"nothing cached asks the same; the nearest cached request, {what}, {change}"
    out.reason = f"{out.headline} ({', '.join(c.text() for c in out.checks)})"


def _source_text(out: Outcome) -> str:
    if out.source_id is None:
        return "a cached entry"
    short = out.source_id[:8]
    if out.source_prompt is None:
        return f"entry {short}"
    return f"entry {short} ({out.source_prompt!r}, seed {out.source_seed})"


def _thresholds(engine, policy: str):
    return getattr(engine.policy(policy), "tau", None)


def _checks(tau, d) -> tuple[list[Check], tuple[float, float] | None]:
    """Each applicable discrepancy (a ``Discrepancies.to_dict``) with its threshold, and the risk score when the
    thresholds have one."""
    if not d or tau is None:
        return [], None
    checks = []
    for name, value in d.items():
        if value is None:
            continue
        t = getattr(tau, name, None)
        if math.isinf(value) and (t is None or math.isinf(t)):
            continue  # neither measured (no probe ran, no noun to compare) nor read: it tells a reader nothing
        checks.append(Check(name, float(value), None if t is None or math.isinf(t) else float(t)))
    # what decided first: a failing check, then those with a threshold, then the measured-only ones (stable)
    checks.sort(key=lambda c: (c.passed, c.threshold is None))
    risk = None
    if tau.risk is not None:
        from .reuse import Discrepancies

        risk = (float(tau.risk.risk(Discrepancies.from_dict(d))), float(tau.risk.threshold))
    return checks, risk
