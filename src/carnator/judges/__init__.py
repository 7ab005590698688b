"""Quality judges and the rule that labels a reuse acceptable or unsafe against dense on the same request.

A :class:`Judge` scores a clip against its prompt (and, for reference metrics, against the dense clip of the same
request) with named scores, each with a direction (higher or lower is better). A :class:`QualityRule` names the scores
it checks and how much each may lose against dense (the paper's Delta). One rule serves ``carnator calibrate``
(labels for threshold selection and certification) and ``carnator bench`` (the unsafe-hit rate), and every thresholds
file records the rule and the judge's identity.

Judges are found by name (:func:`get_judge`): the ones shipped here (``clip``, ``reference``, and ``shapes``, the
embedded model's own judge, :mod:`carnator.embedded.judge`), and any a package registers under the entry-point group
``carnator.judges``: ``NAME`` or ``NAME=ARG`` (e.g. a model directory).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import CarnatorError

__all__ = ["Judge", "QualityRule", "available_judges", "get_judge", "register_judge"]

HIGHER, LOWER = 1, -1


@runtime_checkable
class Judge(Protocol):
    """Scores clips. ``name``: its registry name; ``identity``: what a thresholds file is bound to (the judge and, for a
    model-based judge, a hash of its weights); ``directions``: each score's better direction (+1 higher, -1 lower)."""

    name: str
    identity: str
    directions: Mapping[str, int]

    def score(self, frames: np.ndarray, prompt: str, reference: np.ndarray | None = None) -> dict[str, float]:
        """Named scores of ``frames`` (uint8, T x H x W x 3) for ``prompt``; ``reference`` is the dense clip of the same
        request (reference scores need it; others ignore it)."""


@dataclass(frozen=True)
class QualityRule:
    """A reuse is acceptable iff, for every score named in ``deltas``, it loses at most that much against dense on the
    same request: ``reuse >= dense - delta`` where higher is better, ``reuse <= dense + delta`` where lower is (the
    direction from ``directions``, default higher), and every score named in ``floors`` reaches its floor: ``reuse >=
    floor`` where higher is better, ``reuse <= floor`` where lower is. Floors are for reference scores, measured
    against the dense clip itself (SSIM, PSNR: dense against itself is 1 or inf, so a delta means nothing there).
    NaN scores (a prompt the judge cannot read) compare as equal under a delta and fail a floor."""

    deltas: Mapping[str, float]
    directions: Mapping[str, int] = field(default_factory=dict)
    floors: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.deltas and not self.floors:
            raise ValueError("QualityRule needs at least one score with its delta or floor")
        for k, v in self.deltas.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"QualityRule: the delta of {k!r} must be a finite number >= 0, got {v!r}")
        for k, v in self.floors.items():
            if not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"QualityRule: the floor of {k!r} must be a number, got {v!r}")
        object.__setattr__(self, "deltas", dict(self.deltas))
        object.__setattr__(self, "floors", {k: float(v) for k, v in self.floors.items()})
        object.__setattr__(self, "directions", {k: int(self.directions.get(k, HIGHER)) for k in (*self.deltas, *self.floors)})

    @classmethod
    def for_judge(cls, judge: Judge, floors: Mapping[str, float] | None = None, **deltas: float) -> QualityRule:
        """A rule over ``deltas`` (score name -> delta) and ``floors`` (score name -> floor) with ``judge``'s directions;
        unknown score names are an error."""
        floors = dict(floors or {})
        unknown = sorted((set(deltas) | set(floors)) - set(judge.directions))
        if unknown:
            raise CarnatorError(f"judge {judge.name} has no score {', '.join(unknown)}; it has {', '.join(judge.directions)}")
        return cls(deltas, {k: judge.directions[k] for k in (*deltas, *floors)}, floors)

    def acceptable(self, reuse: Mapping[str, Any], dense: Mapping[str, Any]):
        """The rule on one reuse (floats -> bool) or elementwise on arrays (-> bool array)."""
        ok: bool | np.ndarray = True
        for k, delta in self.deltas.items():
            r, d = np.asarray(reuse[k], dtype=float), np.asarray(dense[k], dtype=float)
            fine = (r >= d - delta) if self.directions[k] > 0 else (r <= d + delta)
            ok = ok & (fine | np.isnan(r) & np.isnan(d))
        for k, floor in self.floors.items():
            r = np.asarray(reuse[k], dtype=float)
            ok = ok & ((r >= floor) if self.directions[k] > 0 else (r <= floor))
        return bool(ok) if np.ndim(ok) == 0 else ok

    def label(self, row: Mapping[str, Any]) -> bool:
        """The rule on a stored calibration row (its ``dense`` and ``reuse`` scores)."""
        return bool(self.acceptable(row["reuse"], row["dense"]))

    def describe(self) -> str:
        return " and ".join([f"{k} {'>=' if self.directions[k] > 0 else '<='} dense {'-' if self.directions[k] > 0 else '+'} {d:g}"
                             for k, d in self.deltas.items()]
                            + [f"{k} {'>=' if self.directions[k] > 0 else '<='} {f:g}" for k, f in self.floors.items()])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"deltas": dict(self.deltas), "directions": dict(self.directions)}
        if self.floors:
            out["floors"] = dict(self.floors)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QualityRule:
        return cls(d.get("deltas", {}), d.get("directions", {}), d.get("floors", {}))


_JUDGES: dict[str, Callable[[str | None], Judge]] = {}


def register_judge(name: str, factory: Callable[[str | None], Judge]) -> None:
    """Make ``factory(arg)`` available as ``get_judge("NAME[=ARG]")``."""
    _JUDGES[name] = factory


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group="carnator.judges")}


def available_judges() -> list[str]:
    return sorted(set(_JUDGES) | set(_entry_points()))


def get_judge(spec: str, *, device: str | None = None) -> Judge:
    """The judge named by ``spec`` ("NAME" or "NAME=ARG"); CarnatorError naming the ones available otherwise.
    ``device``: where a model-based judge runs (passed to factories that take a ``device`` keyword)."""
    name, _, arg = str(spec).partition("=")
    factory: Callable[..., Judge] | None = _JUDGES.get(name)
    if factory is None:
        ep = _entry_points().get(name)
        if ep is None:
            raise CarnatorError(f"unknown judge {name!r}; available: {', '.join(available_judges()) or 'none'}")
        factory = ep.load()
    import inspect

    try:
        takes_device = "device" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_device = False
    return factory(arg or None, device=device) if takes_device else factory(arg or None)


# The built-in judges' modules import this one (the protocol, the rule); they are loaded by name on first use.
def _clip_factory(arg: str | None = None, *, device: str | None = None) -> Judge:
    return importlib.import_module(f"{__name__}.clip").clip_judge(arg, device=device)


def _reference_factory(arg: str | None = None) -> Judge:
    return importlib.import_module(f"{__name__}.reference").reference_judge(arg)


def _shapes_factory(arg: str | None = None) -> Judge:
    return importlib.import_module("carnator.embedded.judge").ShapesJudge(arg)


register_judge("clip", _clip_factory)
register_judge("reference", _reference_factory)
register_judge("shapes", _shapes_factory)
