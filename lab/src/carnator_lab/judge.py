"""The shapes-world judge as a :class:`carnator.judges.Judge` (registered as ``shapes``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from carnator.judges import QualityRule

#: The shapes-world quality rule's default deltas: fidelity may drop by 0.1, artifact rise by 0.02.
DEFAULT_DELTAS = {"fidelity": 0.1, "artifact": 0.02}


class ShapesJudge:
    """Reads a clip of the embedded model back (:func:`carnator_lab.world.judge.judge`): ``fidelity`` (share of the
    prompt's attributes present, higher is better) and ``artifact`` (share of pixels of unexplained foreground, lower is
    better). Its identity is the hash of the judge's source, so a changed judge never reads an old thresholds file."""

    name = "shapes"
    directions = {"fidelity": 1, "artifact": -1}
    default_deltas = DEFAULT_DELTAS

    def __init__(self, arg: str | None = None):
        if arg:
            raise ValueError("the shapes judge takes no argument")
        src = (Path(__file__).parent / "world" / "judge.py").read_bytes()
        self.identity = f"shapes-{hashlib.sha256(src).hexdigest()[:12]}"

    def score(self, frames: np.ndarray, prompt: str, reference: np.ndarray | None = None) -> dict[str, float]:
        from .world.judge import judge

        j = judge(frames, prompt)
        return {"fidelity": j.fidelity, "artifact": j.artifact}


def shapes_rule(delta_fidelity: float = DEFAULT_DELTAS["fidelity"], delta_artifact: float = DEFAULT_DELTAS["artifact"]) -> QualityRule:
    """The shapes world's quality rule: fidelity >= dense - delta_fidelity and artifact <= dense + delta_artifact."""
    return QualityRule({"fidelity": delta_fidelity, "artifact": delta_artifact}, ShapesJudge.directions)
