"""In a real browser, through a real Prometheus, the console shows the limits in force.

The deployment runs its own threshold file (tests/limits_file.py): the exporter is started with it
and Prometheus evaluates rules generated from it over the backfilled cluster (tests/console/
backfill.py: 12 % sticky collisions, a 41 % hit rate). Under the site's 20 % collision limit the
collisions are within their limit, so the page must neither say "alert when > 5.0%" (the packaged
limit) nor mark the check as past it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from alerts import generate
from prefixscope import thresholds
from prefixscope.catalog import SIGNALS
from tests import limits_file, servers
from tests.console import backfill, cluster
from tests.console.conftest import _serve
from tests.console.test_browser import ARTIFACTS, CHROMIUM, full_height_screenshot
from tests.support import require_tool

pytestmark = pytest.mark.slow


@pytest.fixture
def site_console(tmp_path: Path) -> Iterator[str]:
    path = limits_file.write(tmp_path)
    th = thresholds.load(path)
    rule_file = generate.build(th)[generate.ROOT / "alerts" / "generated" / generate.RULES_FILE]
    rules = servers.alerts_at_once(yaml.safe_load(rule_file))
    history = backfill.openmetrics(list(SIGNALS), time.time() - 2)
    with servers.prometheus(tmp_path / "prometheus", rules, history, {"PrefixHitRateLow"}) as prom:
        for exporter in _serve(cluster.build_state(th)):
            with servers.console(exporter, prom) as url:
                yield url


def test_the_diagnosis_page_shows_the_limits_in_force(site_console: str) -> None:
    chromium = require_tool(CHROMIUM)
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{site_console}/diagnosis")
            expect(page.locator(".st-key-step-5")).to_be_visible(timeout=60_000)
            page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                   timeout=60_000)
            body = page.inner_text("body")
            full_height_screenshot(page, ARTIFACTS / "console-site-limits.png",
                                   page.evaluate("() => document.body.scrollHeight"))
        finally:
            browser.close()
    # (Material icons read as their names in the page's text: "check_circle ok", "error FIRING")
    assert "Sticky-session collisions: 12.0% (alert when > 20.0%) — check_circle ok" in body
    assert "Sticky-session collisions: 12.0% (alert when > 5.0%)" not in body  # the packaged limit
    assert "KV-event stream fresh: " in body and "(alert when > 45 s)" in body
    assert "Prefix hit rate (cluster): 41.0% (alert when < 50.0%) — error FIRING" in body
    assert "Verdict: step 2" not in body  # 12 % is within the site's limit: step 2 is not the cause
    assert "critical, fires as soon as it is past its limit" in body  # the site's severity, for 0 s
