"""A real browser (Debian's Chromium via Playwright) opens every page of a running console."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from tests.support import free_port, require_tool, wait_for

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# url path -> text that appears once the page has its data
PAGES = {
    "": "Verdict: step 2 — Affinity.",  # the default page: the diagnosis chain
    "tree": "Hot branches",
    "workers": "Effective cache value and safe-to-remove ranking",
    "alerts": "PrefixStickyCollisionsHigh · warning · step 2 · 1 firing",
    "runbook": "Runbooks",
}


@pytest.fixture
def console_url(exporter_url: str) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (EXPORTER_ENV, PROMETHEUS_ENV)}
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "console", "--exporter-url", exporter_url,
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "console exited"
            return requests.get(f"{url}/_stcore/health", timeout=5).text == "ok"

        wait_for(healthy, "the console to answer /_stcore/health", timeout=120, every=0.2,
                 ignore=(requests.RequestException,))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
                assert page.get_by_test_id("stException").count() == 0
                assert page.get_by_text("Page not found").count() == 0
                page.screenshot(path=str(ARTIFACTS / f"console-{path or 'diagnosis'}.png"), full_page=True)
            # The diagnosis page walks all six steps in order.
            page.goto(f"{console_url}/")
            expect(page.locator(".st-key-step-5")).to_be_visible(timeout=30_000)
            steps = page.locator("[class*='st-key-step-'] h3").all_inner_texts()
            assert [s.split(" —")[0] for s in steps] == [f"Step {n}" for n in range(6)]
        finally:
            browser.close()
