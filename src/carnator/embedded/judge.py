"""The embedded model's judge, ``shapes``: the shapes world's reading of a clip as a :class:`carnator.judges.Judge`.

It is the embedded model's admission gate (``EngineConfig.admission_judge="auto"``) and the judge its shipped
thresholds were calibrated with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ..judges import QualityRule

__all__ = ["ShapesJudge", "shapes_rule", "ATTRIBUTES", "DEFAULT_DELTAS", "READER"]

#: the kinds of attribute a prompt states, each scored on its own (the share of that kind's checks present)
ATTRIBUTES = ("shape", "color", "size", "motion", "background")

#: The shapes-world quality rule's default deltas: fidelity may drop by 0.1, artifact rise by 0.02.
DEFAULT_DELTAS = {"fidelity": 0.1, "artifact": 0.02}
#: the module that reads a clip back; the judge's identity is the hash of its bytes
READER = Path(__file__).resolve().parent / "world" / "judge.py"


class ShapesJudge:
    """Reads a clip of the embedded model back (:func:`carnator.embedded.world.judge.judge`): ``fidelity`` (share of
    the prompt's attributes present, higher is better), ``artifact`` (share of pixels of unexplained foreground, lower
    is better) and, per kind of attribute, the share of the prompt's attributes of that kind present (``shape``,
    ``color``, ``size``, ``motion``, ``background``; NaN where the prompt states none): what an edit's rule reads, since
    an edit that kept the cached colour loses a ``color`` check where ``fidelity`` loses a fraction of one. Its identity is the hash of the reading module's source (:data:`READER`), so a changed judge never reads
    an old thresholds file (and an unchanged one, moved, still does: keep that file's bytes when moving it)."""

    name = "shapes"
    directions = {"fidelity": 1, "artifact": -1, **{a: 1 for a in ATTRIBUTES}}
    default_deltas = DEFAULT_DELTAS

    def __init__(self, arg: str | None = None):
        if arg:
            raise ValueError("the shapes judge takes no argument")
        self.identity = f"shapes-{hashlib.sha256(READER.read_bytes()).hexdigest()[:12]}"

    def score(self, frames: np.ndarray, prompt: str, reference: np.ndarray | None = None) -> dict[str, float]:
        from .world.judge import judge

        j = judge(frames, prompt)
        by: dict[str, list[bool]] = {a: [] for a in ATTRIBUTES}
        for name, ok in j.checks.items():   # "background" or "<object>.<attribute>"
            by[name.rsplit(".", 1)[-1]].append(bool(ok))
        return {"fidelity": j.fidelity, "artifact": j.artifact,
                **{a: float(np.mean(v)) if v else float("nan") for a, v in by.items()}}


def shapes_rule(delta_fidelity: float = DEFAULT_DELTAS["fidelity"], delta_artifact: float = DEFAULT_DELTAS["artifact"]) -> QualityRule:
    """The shapes world's quality rule: fidelity >= dense - delta_fidelity and artifact <= dense + delta_artifact."""
    return QualityRule({"fidelity": delta_fidelity, "artifact": delta_artifact}, ShapesJudge.directions)
