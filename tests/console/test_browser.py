"""A real browser (Debian's Chromium via Playwright) opens every page of a running console.

Each page is opened by its own URL, screenshotted at full height into tests/artifacts/, and
checked for what a reader must never see: a traceback, "Page not found", Streamlit "magic"
output (a bare expression rendered as Streamlit's API documentation), or a page far taller than
its content should make it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import servers
from tests.support import require_tool

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# url path -> text that appears once the page has its data
PAGES = {
    "": "Verdict: step 2 — Affinity.",  # the root: the diagnosis chain
    "diagnosis": "Verdict: step 2 — Affinity.",
    "tree": "What changed",
    "workers": "Effective cache value and safe-to-remove ranking",
    "alerts": "PrefixStickyCollisionsHigh · warning · step 2 · 1 firing",
    "runbook": "Runbooks",
}
# Text that only Streamlit's magic (st.write of an element or a function) or a crash puts on a page.
FORBIDDEN = ("Streamlit's API", "st.write(", "DeltaGenerator", "Traceback (most recent call last)",
             "Page not found")
# The tallest page at 1400 px wide (the diagnosis chain with its six steps) is about 4,000 px;
# magic output made the prefix tree 9,000 px.
MAX_PAGE_HEIGHT_PX = 6000


@pytest.fixture
def console_url(exporter_url: str) -> Iterator[str]:
    with servers.console(exporter_url) as url:
        yield url


def full_height_screenshot(page, path: Path, height: int) -> None:
    """The whole page in one image: Streamlit's app scrolls inside a container, so the viewport is
    grown to the content's height for the shot (full_page alone would cut at the first screen)."""
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": max(height, size["height"])})
    try:
        page.wait_for_timeout(300)  # let the resized layout settle
        page.screenshot(path=str(path), full_page=True)
    finally:
        page.set_viewport_size(size)


def test_every_page_renders_in_chromium(console_url: str) -> None:
    chromium = require_tool(CHROMIUM)
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for path, text in PAGES.items():
                page.goto(f"{console_url}/{path}")
                expect(page.get_by_text(text, exact=False).first).to_be_visible(timeout=30_000)
                page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                       timeout=30_000)
                assert page.get_by_test_id("stException").count() == 0, path
                body = page.inner_text("body")
                assert [f for f in FORBIDDEN if f in body] == [], path
                # Streamlit scrolls inside its main container: measure that, not the window.
                height = page.evaluate("() => Math.max(document.body.scrollHeight, "
                                       "...[...document.querySelectorAll('[data-testid=\"stMain\"], section')]"
                                       ".map(e => e.scrollHeight))")
                assert height <= MAX_PAGE_HEIGHT_PX, f"/{path} is {height} px tall"
                name = f"console-{path or 'root'}.png"
                full_height_screenshot(page, ARTIFACTS / name, height)
            # The diagnosis page walks all six steps in order.
            page.goto(f"{console_url}/")
            expect(page.locator(".st-key-step-5")).to_be_visible(timeout=30_000)
            steps = page.locator("[class*='st-key-step-'] h3").all_inner_texts()
            assert [s.split(" —")[0] for s in steps] == [f"Step {n}" for n in range(6)]
        finally:
            browser.close()
