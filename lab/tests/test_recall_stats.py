"""lab/scripts/recall_stats.py: recall statistics of a prompt set (hand-made embeddings, exact counts)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest


# ---- recall statistics ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "recall_stats.py"
    spec = importlib.util.spec_from_file_location("recall_stats", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["recall_stats"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_recall_stats_known_counts():
    rs = _script()
    # hand-made unit vectors: cosines are exact
    vec = {
        "w-cat-sofa": [1, 0, 0], "w-dog-park": [0, 1, 0], "w-car-road": [0, 0, 1],
        "t-cat-bed": [0.8, 0.6, 0],         # best: cat-sofa 0.8 (gate), one substitution sofa -> bed
        "t-dog-park-ball": [0.6, 0.8, 0],   # best: dog-park 0.8 (gate), nouns differ by an addition (fail)
        "t-car-road": [0, 0.5, np.sqrt(0.75)],  # best: car-road 0.866, identical nouns
        "t-cat-sofa-far": [0.5, np.sqrt(0.75), 0],  # best: dog-park 0.866 (fails nouns); 2nd cat-sofa 0.5 passes
    }
    nouns = {
        "w-cat-sofa": ["cat", "sofa"], "w-dog-park": ["dog", "park"], "w-car-road": ["car", "road"],
        "t-cat-bed": ["cat", "bed"], "t-dog-park-ball": ["dog", "park", "ball"], "t-car-road": ["Car", "road", "car"],
        "t-cat-sofa-far": ["cat", "sofa"],
    }

    def embed(texts):
        return np.asarray([vec[t] for t in texts], dtype=np.float64)

    warm = ["w-cat-sofa", "w-dog-park", "w-car-road"]
    test = ["t-cat-bed", "t-dog-park-ball", "t-car-road", "t-cat-sofa-far"]
    s = rs.recall_stats(warm, test, embed, nouns.__getitem__, k=2)
    assert s["n"] == 4 and s["k"] == 2
    assert json.loads(json.dumps(s))["gate_pass"] == 4  # plain Python numbers, JSON-ready
    assert s["gate_pass"] == 4
    assert s["top1_noun_pass"] == 2 and s["top1_noun_identical"] == 1 and s["top1_noun_substitution"] == 1
    assert s["gate_and_top1_noun"] == 2
    assert s["topk_any_noun_pass"] == 3 and s["topk_any_noun_pass_gated"] == 2
    assert s["topk_candidates_passing"] == 3 and s["topk_candidates"] == 8
    assert s["best_cos_quantiles"][100] == pytest.approx(np.sqrt(0.75))
    assert sum(s["best_cos_hist"].values()) == 4 and s["best_cos_hist"]["[0.75,0.85)"] == 2 and s["best_cos_hist"]["[0.85,0.90)"] == 2
    # a higher gate: only the two 0.866 prompts pass
    assert rs.recall_stats(warm, test, embed, nouns.__getitem__, k=2, gate=0.85)["gate_pass"] == 2
    assert "| text gate passes (top-1 cosine >= 0.65) | 100.0 % | 100.0 % |" in rs.markdown({0: s}, s)


def test_recall_traces_are_disjoint(tmp_path):
    rs = _script()
    f = tmp_path / "p.tsv"
    f.write_text("uuid\ttopic\tprompt\n" + "".join(f"u{i}\tt{i % 3}\tprompt number {i % 40}\n" for i in range(50)))
    prompts, topics = rs.dedupe(*rs.read_prompts(f))
    assert len(prompts) == 40 and topics[:3] == ["t0", "t1", "t2"]
    w, t = rs.split(len(prompts), 30, 10, seed=1)
    assert len(set(w) | set(t)) == 40 and not set(w) & set(t)
    with pytest.raises(ValueError, match="distinct prompts"):
        rs.split(len(prompts), 30, 11, seed=1)


