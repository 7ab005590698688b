"""carnator demo on the embedded model (few steps): the stream runs, the repeat is an exact hit, the page is written."""

from __future__ import annotations

import json

from carnator import Carnator
from carnator.demo import STREAM, run_demo
from carnator.testing import hashed_embedder


def test_demo_stream(tmp_path):
    eng = Carnator.from_pretrained("embedded", tmp_path / "cache", device="cpu", embedder=hashed_embedder(64))
    lines = []
    rows = run_demo(eng, tmp_path / "out", steps=3, progress=lines.append)
    assert len(rows) == len(STREAM) and lines[0].startswith("dense reference:")
    # request 6 repeats request 0 exactly (prompt and seed): served from the exact tier, from request 0's entry
    assert STREAM[6] == STREAM[0]
    assert rows[6]["exact"] and rows[6]["hit"]
    assert rows[0]["hit"] is False
    # the dense reference (seed 0) was not stored, so it is never anyone's source
    sources = {r["source"] for r in rows if r["source"]}
    assert all(e.seed != 0 for e in eng.bank.entries())
    assert sources <= {e.id for e in eng.bank.entries()}
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert [r["prompt"] for r in saved] == [p for p, _ in STREAM]
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.count("<img") == len(STREAM)
    assert all((tmp_path / "out" / r["gif"]).exists() for r in rows)
