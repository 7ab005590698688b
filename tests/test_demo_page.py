"""The demo's page in a real headless Chromium (Debian's ``chromium``, driven by Playwright): the table and the totals
show what demo.json says, every clip loads, the plot is drawn; a screenshot is left in the test's folder
(``demo-page.png``, printed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from carnator import Carnator
from carnator.demo import STREAM, run_demo
from carnator.testing import hashed_embedder

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # the test extra; Chromium from apt (.ci/run installs both)

    assert Path(CHROMIUM).exists(), "needs Debian's chromium: apt-get install -y chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


#: a miss, its re-roll and a rewording of it (hits), a colour edit (a miss whose candidate is refused) and an exact
#: repeat, at 32 steps (the carnator policy probes 4 and resumes at 29 with the shipped file, 30 without the gate)
STREAM5 = [STREAM[0], STREAM[1], STREAM[2], STREAM[6], STREAM[9]]


def test_demo_page_in_chromium(browser, tmp_path):
    eng = Carnator.from_pretrained("embedded", tmp_path / "cache", device="cpu", embedder=hashed_embedder(64))
    run_demo(eng, tmp_path / "out", steps=32, progress=lambda line: None, stream=STREAM5)
    doc = json.loads((tmp_path / "out" / "demo.json").read_text())
    reqs = doc["requests"]
    assert [r["decision"] for r in reqs] == ["miss", "hit", "hit", "miss", "exact hit"]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto((tmp_path / "out" / "index.html").as_uri())
    page.wait_for_load_state("load")

    rows = page.locator("#requests tbody tr")
    assert rows.count() == len(STREAM5)
    for k, r in enumerate(reqs):
        row = rows.nth(k)
        assert row.locator(".decision").inner_text() == r["decision"]
        assert r["headline"] in row.locator(".reason").inner_text()
        assert row.locator(".seconds").inner_text() == f"{r['seconds']:.2f}"
        assert row.locator(".dense-seconds").inner_text() == f"{r['dense_seconds']:.2f}"
        # a hit's measured ratio; an exact hit is served from the cache; a miss does dense's work
        speedup = {"hit": f"x{r['speedup']}", "exact hit": "from the cache", "miss": "miss"}[r["decision"]]
        assert row.locator(".speedup").inner_text() == speedup
        assert row.locator(".steps").inner_text() == f"{r['steps_computed']} of {r['steps']}"
    # the hits: the source's clip beside each, and the tier that decided (its kind of change, whole frame, no check
    # list: a tier reads no discrepancy); the edit: the nearest cached request's clip, refused, and why no tier serves it
    hit, reword, edit, exact = rows.nth(1), rows.nth(2), rows.nth(3), rows.nth(4)
    for row, r, kind in ((hit, reqs[1], "re-roll"), (reword, reqs[2], "rewording")):
        assert row.locator("figcaption").all_inner_texts()[-1].startswith("source: request ") and row.locator("img").count() == 3
        assert r["headline"].startswith(f"{kind} of ") and row.locator(".checks").count() == 0 and r["risk"] is None
        # the steps from the re-roll and rewording tiers' step on: 29 of 32 (certified at 45 of 50), no probe
        assert r["steps_computed"] == 3 and row.locator(".steps").inner_text() == "3 of 32"
    assert "no certified tier reuses a colour change" in edit.locator(".reason").inner_text()
    assert edit.locator("figcaption").all_inner_texts()[-1].startswith("refused: request ")
    assert exact.locator("figcaption").all_inner_texts()[-1] == "source: request 0" and exact.locator(".steps").inner_text() == "0 of 32"
    t = doc["totals"]
    total = {page.locator("#totals td:first-child").nth(k).inner_text(): page.locator("#totals td.total").nth(k).inner_text()
             for k in range(page.locator("#totals tr").count())}
    assert total["reused cached work"] == "3 of 5 (60 %), 1 of them exact"
    assert total["time"].startswith(f"{t['seconds']:.2f} s against {t['dense_seconds']:.2f} s dense: x{t['speedup']}")
    computed = 32 + 2 * 3 + 32 + 0   # miss, two hits, the edit (a miss), exact repeat
    assert total["denoising steps computed"] == f"{computed} of {5 * 32} ({5 * 32 - computed} saved)"
    # every clip decoded by the browser (a GIF it cannot read has naturalWidth 0), at the model's 64 pixels
    widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : -1)")
    assert len(widths) == 2 * 5 + 4 and set(widths) == {64}   # each clip and its dense run; a source or refused clip for 4
    # the plot: two curves of 5 + 1 points, one dot per request, drawn with a size
    box = page.locator("#cumulative").bounding_box()
    assert box["width"] > 300 and box["height"] > 150
    assert len(page.locator("#cumulative polyline.policy").get_attribute("points").split()) == len(STREAM5) + 1
    assert page.locator("#cumulative circle").count() == len(STREAM5)
    shot = tmp_path / "demo-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")
    page.close()
