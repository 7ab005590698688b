"""carnator demo on the embedded model (few steps): every request is compared with a dense run of itself, the repeat
is an exact hit of request 0, the numbers add up, a second run replays and says so, and the CLI's demo starts from
its own empty cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

import carnator.recall.embedder
from carnator import Carnator
from carnator.cli import main
from carnator.demo import STREAM, run_demo
from carnator.testing import hashed_embedder
from carnator.video import read_video

STEPS = 3  # fewer than the carnator policy's 4-step probe: every miss is generated densely, request 9 is an exact hit


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    eng = Carnator.from_pretrained("embedded", tmp / "cache", device="cpu", embedder=hashed_embedder(64))
    lines: list[str] = []
    rows = run_demo(eng, tmp / "out", steps=STEPS, progress=lines.append)
    return eng, tmp, rows, lines


def test_demo_stream(demo):
    eng, tmp, rows, lines = demo
    out = tmp / "out"
    assert len(rows) == len(STREAM)
    assert lines[0] == f"cache: {eng.store.root} (empty: a fresh start)"
    assert lines[2] == "warming up (not timed): the model's kernels and the recall embedder ..."  # said before the wait
    # request 9 repeats request 0 exactly (prompt and seed): served from the exact tier, from request 0's entry
    assert STREAM[9] == STREAM[0]
    r0, r6 = rows[0], rows[9]
    assert r6["decision"] == "exact hit" and r6["exact"] and r6["source"] == r0["entry"] and r6["source_request"] == 0
    assert r6["reason"] == f"the same request as entry {r0['entry'][:8]} ({STREAM[0][0]!r}, seed 1): its stored video"
    assert r6["source_gif"] == r0["gif"] and (read_video(out / r6["gif"]) == read_video(out / r0["gif"])).all()
    assert r6["steps_computed"] == 0 and r6["dit_forwards"] == 0 and r6["steps_saved"] == STEPS
    # an exact hit is what it is: the same request (not a re-roll), served from the cache, its time and no speedup
    assert r6["change"] == "exact repeat" and r6["speedup"] is None
    line = next(x for x in lines if x.startswith(" 9 "))
    assert line.startswith(f" 9 exact hit {r6['seconds']:.3f}s, served from the cache,   0 of {STEPS} steps ")
    assert line.split("\n")[0].endswith("[exact repeat]")
    for r in rows:
        # every request has its own dense run: the embedded model guides (scale 4), two DiT forwards a step
        assert r["dense_dit_forwards"] == 2 * STEPS and (out / r["dense_gif"]).exists() and (out / r["gif"]).exists()
        assert r["speedup"] is None  # a miss does dense's work (its ratio would be the load's), an exact hit none
        if r["i"] != 9:
            assert r["decision"] == "miss" and r["steps_computed"] == STEPS and r["dit_forwards"] == 2 * STEPS
            assert f"s, dense {r['dense_seconds']:6.2f}s (a miss: dense's work), " in lines[3 + r["i"]]
            assert r["reason"] == f"generated densely: {STEPS} steps <= the 4-step probe"
    # the warm-up (seed 0) and the dense runs were not stored: only the stream's own entries are anyone's source
    assert all(e.seed != 0 for e in eng.store.entries()) and len(eng.store.entries()) == len(STREAM) - 1
    doc = json.loads((out / "demo.json").read_text())
    assert doc["requests"] == rows and doc["steps"] == STEPS and doc["cache"]["replaying"] is False
    t = doc["totals"]
    assert (t["requests"], t["hits"], t["exact_hits"]) == (12, 1, 1)
    assert t["steps"] == 12 * STEPS and t["steps_computed"] == 11 * STEPS and t["dense_dit_forwards"] == 24 * STEPS
    assert t["seconds"] == pytest.approx(sum(r["seconds"] for r in rows), abs=1e-6)
    assert lines[-1].startswith("total: 1 of 12 requests reused cached work (1 exact); ")


def test_a_second_run_on_the_same_cache_says_it_replays(demo, tmp_path):
    eng, *_ = demo
    lines: list[str] = []
    rows = run_demo(eng, tmp_path / "again", steps=STEPS, progress=lines.append)
    assert lines[0].startswith(f"cache: {eng.store.root} holds 11 entries from an earlier run: replaying")
    assert all(r["decision"] == "exact hit" for r in rows)  # what issue 28 saw: the story is gone, and now it says so
    assert all(r["source_request"] is None and r["source_gif"] for r in rows)  # the sources' clips come from the cache
    assert "replays" in (tmp_path / "again" / "index.html").read_text()


def test_cli_demo_uses_its_own_fresh_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(carnator.recall.embedder, "default_embedder", lambda: hashed_embedder(64))
    out = tmp_path / "d"
    argv = ["demo", "--out", str(out), "--steps", str(STEPS), "--device", "cpu"]
    for _ in range(2):  # a second run starts from an empty cache again
        assert main(argv) == 0
        printed = capsys.readouterr().out
        # it says what it does while it loads, before the first request's line
        assert printed.splitlines()[:2] == ["loading the model (embedded) ...", f"cache: {out / 'cache'} (empty: a fresh start)"]
        assert printed.rstrip().endswith(f"1 of 12 requests reused cached work; the page: {out / 'index.html'}")
    assert main([*argv, "--keep-cache"]) == 0
    printed = capsys.readouterr().out
    assert "holds 11 entries from an earlier run: replaying" in printed.splitlines()[1]
    doc = json.loads((out / "demo.json").read_text())
    assert doc["totals"]["exact_hits"] == 12 and doc["cache"]["entries_at_start"] == 11


def test_page_plot_is_the_cumulative_times(demo):
    from carnator.demo import cumulative_plot

    _, _, rows, _ = demo
    svg = cumulative_plot(rows)
    pts = [tuple(map(float, p.split(","))) for p in svg.split("class='dense' points='")[1].split("'")[0].split()]
    assert len(pts) == len(rows) + 1 and pts[0][1] == max(p[1] for p in pts)  # starts at 0 s (the bottom), rises
    assert all(b[1] <= a[1] for a, b in zip(pts, pts[1:]))
    assert svg.count("<circle") == len(rows) and svg.count("class='dot exact-hit'") == 1
    # the last point is the total dense time on the axis that reaches 5 % above the larger total (280 px high, 40 px
    # below the axis, 14 above it)
    dense, policy = sum(r["dense_seconds"] for r in rows), sum(r["seconds"] for r in rows)
    assert np.isclose((280 - 40 - pts[-1][1]) / (280 - 40 - 14), dense / (1.05 * max(dense, policy)), atol=1e-3)
