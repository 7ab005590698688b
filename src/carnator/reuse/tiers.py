"""Risk tiers: one certified way to reuse per kind of change.

What changed between a request and a cached one (:func:`carnator.signature.content.change_kind`: re-roll, rewording,
colour, object, size, place, motion, count, several) decides how much of the cached trajectory a reuse may keep. A
re-roll keeps all but the last steps; a colour edit must recompute the object's region from an early step, since the
first steps settle its colour. Each kind gets its own :class:`Tier` (resume step, scope) and its own certificate:
the Clopper-Pearson bound of the unsafe share among that kind's calibration reuses at that step. A kind without a
certified tier is a miss.

:func:`certify_tiers` selects each kind's step on one split of its pairs (the latest step, so the fewest recomputed
steps, whose unsafe share there could still certify at the other split's size) and certifies it on the other, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .calibrate import CalibrationConfig, allowed_unsafe, clopper_pearson_upper, split_pairs

__all__ = ["KINDS", "SAME_CONTENT_KINDS", "Tier", "certify_tiers"]

#: kinds of change whose two prompts ask the same: a hit recomputes the whole frame and reads no probe
SAME_CONTENT_KINDS = frozenset({"re-roll", "rewording"})
#: every kind :func:`~carnator.signature.content.change_kind` names that a tier may reuse
KINDS = ("re-roll", "rewording", "colour", "object", "size", "place", "motion", "count", "several")


@dataclass(frozen=True)
class Tier:
    """How a reuse of one kind of change runs, and its certificate.

    ``step`` of ``of``: the resume step (scaled to the request's steps); ``scope``: "frame" recomputes every token
    from the resume step (same content), "region" recomputes the changed objects' Evidence Regions and keeps the
    cached latent outside them. ``pairs`` / ``accepted`` / ``unsafe`` / ``bound``: the certification split's pairs of
    this kind, those reused at ``step``, the unsafe among them and the one-sided Clopper-Pearson upper bound of the
    unsafe share; ``certified``: ``bound <= delta``."""

    kind: str
    step: int
    of: int
    scope: str = "region"
    pairs: int = 0
    accepted: int = 0
    unsafe: int = 0
    bound: float | None = None
    certified: bool = False

    def __post_init__(self) -> None:
        if self.scope not in ("frame", "region"):
            raise ValueError(f"Tier.scope must be 'frame' or 'region', got {self.scope!r}")
        if not (isinstance(self.step, int) and isinstance(self.of, int) and 1 <= self.step < self.of):
            raise ValueError(f"Tier step must satisfy 1 <= step < of, got {self.step} of {self.of}")

    def resume_at(self, num_steps: int) -> int:
        """The resume step for a request of ``num_steps`` steps (this tier's step scaled)."""
        return int(round(self.step * num_steps / self.of))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tier:
        known = {k: d[k] for k in ("kind", "step", "of", "scope", "pairs", "accepted", "unsafe", "bound", "certified") if k in d}
        return cls(**known)


def _unsafe(rows: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for r in rows if not r["acceptable"])


def certify_tiers(rows: Sequence[Mapping[str, Any]], cfg: CalibrationConfig = CalibrationConfig()) -> dict[str, dict[str, Any]]:
    """Per kind of change, its tier selected and certified from calibration rows of several resume steps.

    ``rows``: one per (pair, resume step) with ``i`` (the pair), ``change`` (its kind), ``resume_step``,
    ``num_steps``, ``hit`` (the forced reuse ran: the source passed the admission gate and a region was found) and
    ``acceptable`` (the judge's label). Each kind's pairs are split as :func:`~carnator.reuse.split_pairs` splits
    (``cfg.selection_fraction``, ``cfg.split_seed``); on the selection split the latest step whose unsafe share among
    the reused would still certify at the size of the certification split's reuses (or, with
    ``cfg.selection_confidence``, whose bound is within ``cfg.delta``) is chosen, then certified once on the
    certification split. Returns, per kind, the :class:`Tier` as a dict with ``selection`` (per step:
    reused, unsafe) beside it; a kind no step passes in selection has ``step`` None."""
    by_kind: dict[str, dict[int, dict[int, Mapping[str, Any]]]] = {}
    of: dict[str, int] = {}
    for r in rows:
        kind = str(r.get("change") or r.get("kind"))
        by_kind.setdefault(kind, {}).setdefault(int(r["i"]), {})[int(r["resume_step"])] = r
        if r.get("num_steps"):
            of[kind] = int(r["num_steps"])
    out: dict[str, dict[str, Any]] = {}
    for kind, pairs in sorted(by_kind.items()):
        ids = sorted(pairs)
        if len(ids) < 2:
            out[kind] = {"kind": kind, "step": None, "of": of.get(kind), "selection": {}, "selection_pairs": 0}
            continue
        sel_idx, cert_idx = split_pairs(len(ids), cfg)
        sel, cert = [ids[j] for j in sel_idx], [ids[j] for j in cert_idx]
        steps = sorted({s for i in ids for s in pairs[i]})
        table, chosen = {}, None
        for s in steps:
            reused = [pairs[i][s] for i in sel if s in pairs[i] and pairs[i][s]["hit"]]
            bad = _unsafe(reused)
            table[str(s)] = {"reused": len(reused), "unsafe": bad}
            if not reused:
                continue
            if cfg.selection_confidence is None:
                # the unsafe share that would still certify at the size of the certification split's reuses at this
                # step (their count, not their labels): a step whose share could not certify is not worth the one test
                n_cert = sum(1 for i in cert if s in pairs[i] and pairs[i][s]["hit"])
                ok = n_cert > 0 and bad / len(reused) <= allowed_unsafe(n_cert, cfg.delta, cfg.confidence)[n_cert] / n_cert
            else:
                ok = clopper_pearson_upper(bad, len(reused), cfg.selection_confidence) <= cfg.delta
            if ok:
                chosen = s   # steps ascend: the latest that passes wins
        entry: dict[str, Any] = {"kind": kind, "step": chosen, "of": of.get(kind), "selection": table,
                                 "selection_pairs": len(sel)}
        if chosen is not None:
            reused = [pairs[i][chosen] for i in cert if chosen in pairs[i] and pairs[i][chosen]["hit"]]
            bad = _unsafe(reused)
            bound = clopper_pearson_upper(bad, len(reused), cfg.confidence) if reused else None
            scope = next((r.get("scope") for r in reused if r.get("scope")), None) or (
                "frame" if kind in SAME_CONTENT_KINDS else "region")   # how the rows' reuses recomputed
            entry.update(scope=scope, pairs=len(cert), accepted=len(reused),
                         unsafe=bad, bound=bound, certified=bool(bound is not None and bound <= cfg.delta))
        out[kind] = entry
    return out
