"""The bench's HTML report (plots, every number, side-by-side clips) and the recall statistics script.

``run_bench`` runs here on a fake engine (scripted hits, tiny frames) and a fake judge, so the
test checks the bench's bookkeeping, clip keeping and report without generating video.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from carnator.bench.report import (
    PLOT_TITLES,
    clip_requests,
    fmt,
    metrics,
    render_html,
    to_markdown,
    write_html,
)
from carnator.bench.run import run_bench, thumbnail
from carnator.bench.traces import Trace, TraceRequest
from carnator.cli import main
from carnator.judges import QualityRule

EVIL = "a red ball <script>alert('x')</script> & a \"blue\" box"
TEST_PROMPTS = ["a red ball on grass", "a red ball on snow", EVIL, "a blue box at night", "a red box on grass", "a green star"]
#: Which test requests each policy hits (by index), scripted.
HITS = {"nirvana": {1, 2, 4, 5}, "carnator": {3}, "dense": set()}


class FakeEngine:
    #: per cache directory, the (prompt, seed) of every request stored in it; and every generate call made
    stored: dict[Path, set] = {}
    calls: list[tuple] = []

    def __init__(self, cache_dir: Path):
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.dir = cache_dir
        self.stored.setdefault(cache_dir, set())
        self.store = SimpleNamespace(stats=lambda: SimpleNamespace(bytes=3_000_000, count=2),
                                    get=lambda eid: SimpleNamespace(prompt=f"source of {eid}"))

    def is_cached(self, prompt, *, seed, num_inference_steps=None):
        return (prompt, seed) in self.stored[self.dir]

    def generate(self, prompt, *, seed, policy, num_inference_steps=None, store=True, cache=None):
        self.calls.append((policy, prompt, seed, cache != "off"))
        if store:
            self.stored[self.dir].add((prompt, seed))
        i = TEST_PROMPTS.index(prompt) if prompt in TEST_PROMPTS else None
        hit = i is not None and i in HITS[policy]
        frames = np.zeros((4, 8, 8, 3), np.uint8)
        for t in range(4):  # a moving square, so the GIF keeps 4 distinct frames
            frames[t, 2:6, t:t + 4] = (40 * (i or 0), 200, 17 * len(policy))
        stats = SimpleNamespace(hit=hit, exact_hit=False, resume_step=20 if hit else None, mask_density=None, active_fraction=None,
                                timings={"total": 1.0 if hit else 2.0, "dit": 0.5 if hit else 1.5},
                                source_id=f"e{i}" if hit else None, notes={"similarity": 0.5 + i / 10} if hit else {})
        return SimpleNamespace(frames=frames, stats=stats)


class FakeJudge:
    """Reads the planted pixel: fidelity from its red channel, artifact from its blue one."""

    name, identity = "fake", "fake-judge-1"
    directions = {"fidelity": 1, "artifact": -1}

    def score(self, frames, prompt, reference=None):
        return {"fidelity": float(frames[0, 3, 3, 0]) / 255, "artifact": float(frames[0, 3, 3, 2]) / 2550}


JUDGE = FakeJudge()
RULE = QualityRule({"fidelity": 0.1, "artifact": 0.02}, FakeJudge.directions)


@pytest.fixture
def bench(tmp_path, monkeypatch):
    trace = Trace([TraceRequest("a red ball on grass", 1, "warm"), TraceRequest("a blue box", 2, "warm")],
                  [TraceRequest(p, 10 + k, "noun") for k, p in enumerate(TEST_PROMPTS)])
    out = tmp_path / "bench"
    rep = run_bench(FakeEngine, trace, ["dense", "nirvana", "carnator"], out, judge=JUDGE, rule=RULE, keep_clips=2, progress=lambda *_: None)
    return out, rep


def test_warm_fill_is_misses_and_resumes_after_an_interruption(tmp_path, monkeypatch):
    """Warm requests run with cache="off" (misses that store), the test stream with reuse; a fill cut short resumes
    without generating again what it stored; shards fill disjoint parts; dense has no warm cache."""
    warm = [TraceRequest(f"warm {k}", k, "warm") for k in range(5)]
    trace = Trace(warm, [TraceRequest(TEST_PROMPTS[0], 10, "noun")])
    out = tmp_path / "b"
    FakeEngine.calls.clear()
    run_bench(FakeEngine, trace, ["nirvana"], out, judge=JUDGE, rule=RULE, only=True, report=False, warm_shard=(1, 2), progress=lambda *_: None)
    assert FakeEngine.calls == [("nirvana", "warm 1", 1, False), ("nirvana", "warm 3", 3, False)]
    assert not (out / "caches" / "nirvana" / ".warm").exists() and not (out / "requests.jsonl").read_text()

    FakeEngine.calls.clear()
    run_bench(FakeEngine, trace, ["dense", "nirvana"], out, judge=JUDGE, rule=RULE, progress=lambda *_: None)
    assert FakeEngine.calls == [("dense", TEST_PROMPTS[0], 10, True),
                                ("nirvana", "warm 0", 0, False), ("nirvana", "warm 2", 2, False), ("nirvana", "warm 4", 4, False),
                                ("nirvana", TEST_PROMPTS[0], 10, True)]
    assert (out / "caches" / "nirvana" / ".warm").exists()


def _table(page: str, table_id: str) -> str:
    m = re.search(f"<table id={table_id}>(.*?)</table>", page, re.DOTALL)
    assert m, table_id
    return m.group(1)


def test_bench_writes_one_page_with_plots_numbers_and_clips(bench):
    out, rep = bench
    page = (out / "report.html").read_text()
    assert rep["policies"]["nirvana"]["hit_rate"] == pytest.approx(4 / 6)
    assert rep["policies"]["nirvana"]["hit_e2e_speedup"] == pytest.approx(2.0)

    # one PNG per plot, each a real image
    pngs = re.findall(r"<img alt='([^']*)' title='[^']*' src='data:image/png;base64,([A-Za-z0-9+/=]+)'>", page)
    assert [t for t, _ in pngs] == list(PLOT_TITLES)
    for _, b64 in pngs:
        im = Image.open(io.BytesIO(base64.b64decode(b64)))
        assert im.format == "PNG" and im.size[0] > 200

    # every number of report.json in the table, formatted the table's way, one row per policy
    table = _table(page, "numbers")
    saved = json.loads((out / "report.json").read_text())
    assert saved == rep
    for pol, m in rep["policies"].items():
        row = re.search(f"<tr><td class=l>{pol}</td>(.*?)</tr>", table).group(1)
        cells = re.findall(r"<td>(.*?)</td>", row)
        cols = metrics(rep)  # the run's own columns, then the judge's scores the rule names, after the speedups
        assert [k for k, _ in cols[5:11]] == ["fidelity_all", "fidelity_hits", "dense_fidelity_on_hits",
                                               "artifact_all", "artifact_hits", "dense_artifact_on_hits"]
        assert cells[: len(cols)] == [html.escape(fmt(m[k])) for k, _ in cols]
    assert "<td>0.6667</td>" in table and "<td>1.5e+06</td>" in table

    # the prompt with markup is escaped everywhere; the page runs no script at all
    assert "<script" not in page
    assert html.escape(EVIL) in page

    # clips: first 2 hits of nirvana (1, 2) and of carnator (3); dense and every policy for each
    assert clip_requests([r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())],
                         ["dense", "nirvana", "carnator"], 2) == [1, 2, 3]
    for pol in ("dense", "nirvana", "carnator"):
        assert sorted(p.name for p in (out / "clips" / pol).glob("*.gif")) == ["0001.gif", "0002.gif", "0003.gif"]
    gifs = re.findall(r"src='data:image/gif;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(gifs) == 9
    im = Image.open(io.BytesIO(base64.b64decode(gifs[0])))
    assert im.format == "GIF" and getattr(im, "n_frames", 1) == 4
    assert page.count("<div class=clips>") == 3
    assert "hit, resume step 20" in page and "miss (ran dense)" in page


def test_report_rewritten_from_disk_and_markdown_unchanged(bench):
    out, rep = bench
    first = (out / "report.html").read_text()
    (out / "report.html").unlink()
    write_html(out)
    assert (out / "report.html").read_text() == first
    md = (out / "report.md").read_text()
    assert md == to_markdown(rep) and "| nirvana | 67% |" in md


def test_policies_run_apart_then_reported_together_give_the_same_report(bench, tmp_path, monkeypatch):
    """``carnator bench --jobs``' bookkeeping: each worker runs one policy (dense too) into the shared folder,
    with no report; the final run finds every row done and writes the same report as one process."""
    out1, rep1 = bench
    trace = Trace.load(out1 / "trace.json")
    out = tmp_path / "apart"
    for pol in ("carnator", "dense", "nirvana"):  # any order
        assert run_bench(FakeEngine, trace, [pol], out, judge=JUDGE, rule=RULE, keep_clips=2, progress=lambda *_: None, only=True, report=False) is None
        assert not (out / "report.json").exists()
    assert sorted(json.loads(line)["policy"] for line in (out / "requests.jsonl").read_text().splitlines()) == sorted(
        ["carnator"] * 6 + ["dense"] * 6 + ["nirvana"] * 6)
    said = []
    rep = run_bench(FakeEngine, trace, ["dense", "nirvana", "carnator"], out, judge=JUDGE, rule=RULE, keep_clips=2, progress=said.append)
    assert rep == rep1 and not [m for m in said if "hit=" in m]  # nothing generated again
    assert (out / "report.md").read_text() == (out1 / "report.md").read_text()


def test_no_clips_and_missing_values():
    rep = {"requests": 2, "rule": RULE.to_dict(), "policies": {}}
    rep["policies"] = {
        "dense": {k: None for k, _ in metrics(rep)} | {"hit_rate": 0.0, "fidelity_all": 0.5, "artifact_all": 0.1},
        "carnator": {k: None for k, _ in metrics(rep)} | {"hit_rate": 0.0, "fidelity_all": 0.5, "artifact_all": 0.1},
    }
    page = render_html(rep, [], [], None)
    assert page.count("data:image/png;base64,") == len(PLOT_TITLES)
    assert "No clips were kept" in page and "data:image/gif" not in page
    assert "<td>-</td>" in _table(page, "numbers")


def test_report_of_another_judge_names_its_scores():
    """A clip judge's rule (the paper's Delta on CLIP-T, an SSIM floor): the table, markdown and captions carry those
    scores, and PSNR's inf (dense against itself) is written, not drawn."""
    from carnator.judges import QualityRule

    rule = QualityRule({"clip_t": 0.02}, {"clip_t": 1, "ssim": 1, "psnr": 1}, {"ssim": 0.5, "psnr": 20.0})
    rep = {"requests": 1, "rule": rule.to_dict(), "policies": {}}
    base = {k: None for k, _ in metrics(rep)}
    rep["policies"] = {"dense": base | {"hit_rate": 0.0, "clip_t_all": 0.31, "ssim_all": 1.0, "psnr_all": float("inf")},
                       "carnator": base | {"hit_rate": 1.0, "clip_t_all": 0.3, "clip_t_hits": 0.3, "dense_clip_t_on_hits": 0.31,
                                           "ssim_all": 0.8, "psnr_all": 25.0, "unsafe_hit_rate": 0.0}}
    assert [k for k, _ in metrics(rep)][5:8] == ["clip_t_all", "clip_t_hits", "dense_clip_t_on_hits"]
    md = to_markdown(rep)
    assert "unless clip_t >= dense - 0.02 and ssim >= 0.5 and psnr >= 20" in md
    assert "| carnator | 100% |" in md and "| 0.3 | 0.3 (0.31) |" in md
    rows = [{"policy": "carnator", "i": 0, "kind": "noun", "hit": True, "e2e": 1.0, "clip_t": 0.3, "ssim": 0.8, "psnr": 25.0}]
    page = render_html(rep, rows, ["a cat"], None)
    assert page.count("data:image/png;base64,") == len(PLOT_TITLES) and "fidelity" not in page
    assert "hit / 1.00 / 0.3 / 0.8 / 25" in page and "<td>inf</td>" in page


def test_thumbnail_limits():
    big = np.zeros((100, 704, 1280, 3), np.uint8)
    t = thumbnail(big)
    assert t.shape[0] <= 32 and max(t.shape[1:3]) <= 128 and t.flags.c_contiguous
    small = np.zeros((16, 64, 64, 3), np.uint8)
    assert thumbnail(small).shape == small.shape


def test_cli_report_only(bench, capsys, tmp_path):
    out, _ = bench
    (out / "report.html").unlink()
    assert main(["bench", "--out", str(out), "--report-only"]) == 0
    assert (out / "report.html").exists() and "wrote" in capsys.readouterr().out
    assert main(["bench", "--out", str(tmp_path / "nothing"), "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("carnator: error: --report-only") and "report.json" in err[0]
    assert main(["bench", "--out", str(out), "--keep-clips", "-1"]) == 2
    assert main(["bench", "--out", str(out), "--jobs", "0"]) == 2


def test_hit_rows_name_their_source(bench):
    """Each hit's row records which cached request it reused (its prompt) and the policy's reason (here the
    similarity the fake engine's plan noted); a miss's row has neither."""
    import json

    out, _ = bench
    rows = {(r["policy"], r["i"]): r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}
    for pol, hits in HITS.items():
        for i in range(len(TEST_PROMPTS)):
            r = rows[pol, i]
            if i in hits:
                assert r["source_prompt"] == f"source of e{i}" and r["similarity"] == pytest.approx(0.5 + i / 10)
            else:
                assert "source_prompt" not in r and "similarity" not in r
