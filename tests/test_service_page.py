"""The service's web page in a real headless Chromium (Debian's ``chromium``, driven by Playwright) against a real
server with API keys: enter the key, submit a prompt, watch its progress live, see the finished video play in the
gallery with its hit or miss and speedup, and the hit-rate plot; a second tenant's page shows none of it. A
screenshot is left in the test's folder (``service-page.png``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.server import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
KEYS = {"page-key-alpha": "alpha", "page-key-bravo": "bravo"}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # the test extra; Chromium from apt (.ci/run installs both)

    assert Path(CHROMIUM).exists(), "needs Debian's chromium: apt-get install -y chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def submit(page, prompt: str, seed: int, steps: int) -> None:
    page.fill("#prompt", prompt)
    page.fill("#seed", str(seed))
    page.fill("#steps", str(steps))
    page.click("#submit")


def test_submit_watch_and_gallery_in_chromium(browser, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with ServerProcess(tmp_path / "cache", ["--keys", str(keys)]) as srv:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(srv.url + "/")
        # first load, no key yet: the page asks for one, in its own words, not as an error in red
        assert page.locator("#key-hint").inner_text() == "this server needs an API key: enter yours to see your videos"
        page.wait_for_timeout(500)
        assert page.locator("#error").inner_text() == ""
        page.fill("#key", "page-key-alpha")
        page.click("#save-key")
        # nothing made yet: the gallery says so
        page.wait_for_function("document.getElementById('job-count').textContent === '0 job(s)'", timeout=15_000)
        assert page.locator("#gallery-empty").inner_text() == "No videos yet: the ones you generate appear here."

        submit(page, "a small red ball moving left on grass", 3, 32)
        # live progress: the bar moves while the job runs, and the job's tile in the gallery says the same step
        page.wait_for_function("document.getElementById('live-progress').value > 0", timeout=60_000)
        page.wait_for_function("(() => { const pct = document.getElementById('live-pct').textContent; "
                               "const tile = document.querySelector('#gallery .card .placeholder'); "
                               "return pct.startsWith('step ') && tile && tile.textContent === 'in progress, ' + pct; })()",
                               timeout=60_000)
        assert not page.locator("#gallery-empty").is_visible()
        page.wait_for_function("document.getElementById('live-status').textContent === 'completed'", timeout=60_000)
        assert page.locator("#live-log li").filter(has_text="miss: nothing cached to reuse").count() == 1
        # the finished video in the gallery, decoded by the browser
        video = page.locator("#gallery .card video")
        video.first.wait_for(timeout=30_000)
        page.wait_for_function("(() => { const v = document.querySelector('#gallery video'); return v && v.readyState >= 2 "
                               "&& v.videoWidth === 64; })()", timeout=30_000)
        card = page.locator("#gallery .card").first
        assert card.locator(".tier").inner_text() == "miss" and card.locator(".prompt").inner_text().startswith("a small red")

        submit(page, "a small red ball moving left on grass", 4, 32)  # a re-roll: reuses the first
        page.wait_for_function("document.querySelectorAll('#gallery video').length === 2", timeout=60_000)
        newest = page.locator("#gallery .card").first
        assert newest.locator(".tier").inner_text() == "hit"
        assert newest.locator(".speedup").inner_text().startswith("x")
        assert page.locator("#hit-rate").inner_text().startswith("50 % (1 of 2)")
        assert page.locator("#time-saved").inner_text().endswith(" s")
        assert len(page.locator("#plot .hitrate").get_attribute("points").split()) == 2
        submit(page, "a small red ball moving left on grass", 3, 32)  # an exact repeat: served from the cache
        page.wait_for_function("document.querySelectorAll('#gallery video').length === 3", timeout=60_000)
        newest = page.locator("#gallery .card").first
        assert newest.locator(".tier").inner_text() == "exact hit"
        assert newest.locator(".speedup").inner_text() == "from the cache"  # no speedup over a near-zero time
        page.screenshot(path=str(tmp_path / "service-page.png"), full_page=True)
        print(tmp_path / "service-page.png")

        other = browser.new_page()  # another tenant sees none of alpha's videos
        other.goto(srv.url + "/")
        other.fill("#key", "page-key-bravo")
        other.click("#save-key")
        other.wait_for_function("document.getElementById('job-count').textContent === '0 job(s)'", timeout=15_000)
        assert other.locator("#gallery .card").count() == 0 and other.locator("#gallery-empty").is_visible()
        assert srv.stop() == 0
