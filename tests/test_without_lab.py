"""The library alone behaves as the README's install: with carnator-lab unimportable, the embedded model's engine
judges its clips with its own ``shapes`` judge, loads the gated ``thresholds.json`` and reuses a rewording of a cached
request; only an engine with no judge at all falls back to ``thresholds-nogate.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import carnator

# Run in a process of its own where any import of carnator_lab fails (as where it is not installed).
SCRIPT = r"""
import importlib.abc, json, sys

class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "carnator_lab" or name.startswith("carnator_lab."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoLab())
try:
    import carnator_lab  # noqa: F401
    lab = True
except ModuleNotFoundError:
    lab = False

from carnator import Carnator
from carnator.engine import EngineConfig
from carnator.judges import get_judge

cache = sys.argv[1]
eng = Carnator.from_pretrained("embedded", cache, device="cpu")
a = eng.generate("a big red ball on grass", seed=1, num_inference_steps=10)
b = eng.generate("a big red ball on grass, cinematic, 4k", seed=2, num_inference_steps=10)
bare = Carnator(eng.pipe, cache + "-bare", adapter=eng.adapter, config=EngineConfig(admission_judge=None))
print(json.dumps({
    "lab_importable": lab, "lab_loaded": sorted(m for m in sys.modules if m.startswith("carnator_lab")),
    "judge": get_judge("shapes").identity, "admitted": a.stats.notes.get("admitted"),
    "quality": eng.store.get(a.stats.entry_id).extra.get("quality"),
    "first_hit": a.stats.hit, "hit": b.stats.hit, "source": b.stats.source_id, "first": a.stats.entry_id,
    "thresholds": eng.policy("carnator").thresholds_source, "bare": bare.policy("carnator").thresholds_source,
}))
"""


@pytest.mark.slow
def test_without_the_lab_a_rewording_reuses_under_the_gated_thresholds(tmp_path):
    src = Path(carnator.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cache")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["lab_importable"] is False and got["lab_loaded"] == []
    assert got["judge"] == "shapes-17fbf9e8578d"
    # the first request was generated, judged by the shapes judge and admitted as a source
    assert got["first_hit"] is False and got["admitted"] is True
    assert got["quality"]["fidelity"] >= 0.75 and got["quality"]["artifact"] <= 0.1
    # its rewording (another seed) resumed from it, under the shipped gated file, not the no-gate one
    assert got["hit"] is True and got["source"] == got["first"]
    shipped = src / "carnator" / "embedded"
    assert got["thresholds"] == f"{shipped / 'thresholds.json'} (certified)"
    assert got["bare"] == f"{shipped / 'thresholds-nogate.json'} (certified)"
