"""The demo's three faults in a real browser: the headline names the right step, every worker it
lists as a culprit is one the fault touched, and the first step fits.

Each fault of the short storyline (dropped KV events, step 0; session-key churn, step 2; a slow
router tree walk, step 4) runs on the virtual clock through a real exporter state
(``lab.harness.Replay``: the fleet's KV events, scrapes and records through the exporter's own
adapters) with the demo's threshold profile, to a minute before its fault ends; the exporter's background
evaluation (``BreachLoop``) runs every 5 s of it, so its alerts are pending, then firing, as they
would be live. The real exporter HTTP server serves that state, ``prefixscope console`` reads it,
and Chromium opens the Diagnosis page. Reduced screenshots of each fault's page (and of every page
for the first) go to docs/screenshots/.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from exporter.core.breaches import BreachClock
from exporter.core.prefix_text import Detokenizer, PrefixNames, PrefixTokens, TokenTee
from exporter.core.state import ClusterState
from exporter.loops.breach_loop import BreachLoop
from fleet.scenarios import Scenario
from fleet.storyline import short
from fleet.tokenizer import decode
from fleet.topology import load_topology
from lab import harness
from lab.demo import alerting_files
from lab.harness import Replay
from tests import servers
from tests.console.conftest import _serve
from tests.console.test_browser import CHROMIUM, FORBIDDEN
from tests.e2e.test_demo import SCREENSHOTS, _reduced_screenshot
from tests.support import require_tool

pytestmark = pytest.mark.slow
BEFORE_END_S = 60.0  # read each fault a minute before it ends, as the demo's alerts have fired by then
# What each fault touches (fleet/scenarios/*.yaml): the workers whose KV events it drops; none for
# a fault of the sessions' keys or of the router.
TOUCHED = {"dropped-kv-events": {"w1", "w2", "w3"}, "session-key-churn": set(), "slow-tree-walk": set()}
# The runbook step the evidence fits, by its number and words it carries: a stream that stopped
# (check the publisher); re-keys behind a consistent-hash router (step 2 — not step 1, replacing
# hash-mod routing, since no pool change reshuffled sessions); a slow walk — the simulated router
# reports no tree size (the SGLang gateway's smg_cache_tree_chars), so nothing rules out the
# runbook's step 1, and the console offers it saying so.
FIRST_STEP = {
    "dropped-kv-events": "step 1): Check the worker runs with KV events enabled",
    "session-key-churn": "step 2): Re-keys: fix the key derivation",
    "slow-tree-walk": "step 1): Tree too large",
}
SCIENTIFIC = re.compile(r"\d\.?\d*e[-+]\d\d")


def replayed(sc: Scenario, thresholds: Path) -> tuple[ClusterState, BreachClock, PrefixNames]:
    end = sc.duration_s - BEFORE_END_S
    # Prefix text on, as in the demo: the KV events' token ids are kept on their way in (from the
    # fleet's first, pre-warming batches on), and the workers' /detokenize (the simulated fleet's
    # tokenizer) names the branches.
    tokens = PrefixTokens()
    subscriber = harness.KvEventSubscriber

    def teeing(endpoints, sink, health, **kw):
        return subscriber(endpoints, TokenTee(sink, tokens), health, **kw)

    harness.KvEventSubscriber = teeing
    try:
        replay = Replay(sc, load_topology(None), thresholds_path=thresholds, duration_s=end)
    finally:
        harness.KvEventSubscriber = subscriber
    workers = list(replay.sim.engines)
    names = PrefixNames(tokens, Detokenizer(lambda _url, _model, ids: decode(ids)).start(),
                        {w: f"http://{w}.sim" for w in workers})
    record = BreachClock()
    loop = BreachLoop(replay.state, record)
    t = sc.fault_at_s - 30
    while t < end:  # the exporter's background evaluation, every 5 s of the run
        replay.pause_before(t)
        loop.evaluate_once()
        t += 5
    run = replay.finish()
    loop.evaluate_once()
    return run.state, record, names


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Fault name → the URL of a console reading an exporter that is two minutes into it."""
    _, thresholds = alerting_files("demo", tmp_path_factory.mktemp("profile"))
    urls: dict[str, str] = {}
    stack = []
    try:
        for sc in short():
            state, record, names = replayed(sc, thresholds)
            serving = _serve(state, record, names)
            exporter = next(serving)
            for _ in range(2):  # ask for the hot branches' names once, and let the workers answer
                requests.get(f"{exporter}/api/v1/tree", timeout=30)
                requests.get(f"{exporter}/api/v1/hotspots", timeout=30)
                time.sleep(1)
            console = servers.console(exporter)
            urls[sc.name] = console.__enter__()
            stack.append((serving, console))
        yield urls
    finally:
        for serving, console in reversed(stack):
            console.__exit__(None, None, None)
            serving.close()


def _listed_workers(headline: str) -> set[str]:
    """The workers the headline lists as culprits ("Workers: w3: 2 m since … · w2: …")."""
    out: set[str] = set()
    for line in headline.splitlines():
        if line.startswith("Workers:"):
            out |= {item.strip().split(":")[0] for item in line.removeprefix("Workers:").split(" · ")}
    return out


def test_each_fault_names_its_step_its_touched_workers_and_a_fitting_first_step(faults: dict[str, str]) -> None:
    chromium = require_tool(CHROMIUM)
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    seen: dict[str, str] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for sc in short():
                page.goto(f"{faults[sc.name]}/diagnosis")
                box = page.locator(".st-key-headline")
                box.wait_for(timeout=60_000)
                page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                       timeout=60_000)
                seen[sc.name] = box.inner_text()
                body = page.inner_text("body")
                assert [f for f in FORBIDDEN if f in body] == [], sc.name
                assert not SCIENTIFIC.search(body), SCIENTIFIC.search(body)
                _reduced_screenshot(page, SCREENSHOTS / f"fault-{sc.name}.png")
                if sc.name == "dropped-kv-events":
                    for path in ("tree", "workers", "alerts"):
                        page.goto(f"{faults[sc.name]}/{path}")
                        page.wait_for_function(
                            "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
                        page.wait_for_timeout(1000)
                        body = page.inner_text("body")
                        assert [f for f in FORBIDDEN if f in body] == [], path
                        assert not SCIENTIFIC.search(body), (path, SCIENTIFIC.search(body))
                        _reduced_screenshot(page, SCREENSHOTS / f"fault-{sc.name}-{path}.png")
        finally:
            browser.close()
    for sc in short():
        headline = seen[sc.name]
        assert headline.startswith("FIRING") or "FIRING ·" in headline, (sc.name, headline)
        assert f"Verdict: step {sc.expected_step} —" in headline, (sc.name, headline)
        listed = _listed_workers(headline)
        assert listed <= TOUCHED[sc.name], (sc.name, listed)
        if TOUCHED[sc.name]:
            assert listed, (sc.name, headline)  # at least one truly faulty worker
        first = next((line for line in headline.splitlines() if line.startswith("First step")), None)
        assert first is not None, (sc.name, headline)
        assert FIRST_STEP[sc.name] in first, (sc.name, first)
