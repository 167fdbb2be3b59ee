"""Through a real Prometheus: a fault that ended leaves the headline while its alert still fires.

The backfilled cluster (tests/console/backfill.py) with its sticky collisions stopped two minutes
before the end: over the rule's 5-minute window they read about 12% × 3/5 (past 5%, the alert
fires), over the last minute none. The console reads each firing check over the last minute
(``promql.settle_extreme``), so step 2 no longer holds the headline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from console import promql
from console.links import GENERATED_RULES
from console.prom import PrometheusClient
from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from prefixscope.catalog import SIGNALS
from tests import servers
from tests.console import backfill
from tests.console.test_pages import APP, texts
from tests.support import require_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recovered_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_file(GENERATED_RULES, "the generated rules (run prefixscope generate)")
    rules = servers.alerts_at_once(yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8")))
    history = backfill.openmetrics(list(SIGNALS), time.time() - 2,
                                   stopped={"prefixscope_sticky_collisions_total": 120.0})
    with servers.prometheus(Path(tmp_path_factory.mktemp("prometheus")), rules, history,
                            {"PrefixStickyCollisionsHigh"}) as url:
        yield url


def test_the_short_window_reads_the_fault_as_over(recovered_prometheus: str) -> None:
    prom = PrometheusClient(recovered_prometheus)
    [five] = [s.value for s in prom.query(promql.check_value("sticky_session_collision_rate"))]
    assert five == pytest.approx(0.072, abs=0.01)
    [worst] = [s.value for s in prom.query(promql.settle_extreme("sticky_session_collision_rate", {}))]
    assert worst == 0.0


def test_the_settled_check_leaves_the_headline(monkeypatch: pytest.MonkeyPatch, exporter_url: str,
                                              recovered_prometheus: str) -> None:
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.setenv(PROMETHEUS_ENV, recovered_prometheus)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    body = texts(at)
    assert "Verdict: step 2" not in body
    assert "Settled, no longer the headline: Sticky-session collisions (step 2)" in body
    line = next(x for x in body.splitlines() if "**Sticky-session collisions**" in x)
    assert "(alert when > 5.0%) — :red[:material/error: FIRING] · settled:" in line, line
