"""The console against a real Prometheus: generated rules over a backfilled cluster."""

from __future__ import annotations

import json
import re

import pytest
from streamlit.testing.v1 import AppTest

from console import promql
from console.prom import PrometheusClient
from console.settings import EXPORTER_ENV, GRAFANA_ENV, PROMETHEUS_ENV
from tests.console import backfill
from tests.console.test_pages import APP, metrics, texts

pytestmark = pytest.mark.slow


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch, exporter_url: str, prometheus_url: str) -> str:
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.setenv(PROMETHEUS_ENV, prometheus_url)
    return prometheus_url


def run(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60).run()
    if page is not None:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def test_hostile_label_values_do_not_change_the_query(prometheus_url: str) -> None:
    prom = PrometheusClient(prometheus_url)
    assert [s.value for s in prom.query(promql.selector("prefixscope_up", {"target": "w0"}))] == [1.0]
    # Unescaped, this value would end the matcher and append `or vector(1)`: one sample of 1.
    assert prom.query(promql.selector("prefixscope_up", {"target": 'x"} or vector(1) #'})) == []
    assert prom.query(promql.selector("prefixscope_up", {"target": 'w0"}) or prefixscope_up{target="w0'})) == []
    # A real label value with a quote, a backslash and a newline is matched exactly.
    weird = prom.query(promql.selector("prefixscope_up", {"target": backfill.WEIRD_TARGET}))
    assert [s.labels["target"] for s in weird] == [backfill.WEIRD_TARGET]


def test_diagnosis_from_recording_rules_and_firing_alerts(monkeypatch: pytest.MonkeyPatch, both: str) -> None:
    monkeypatch.setenv(GRAFANA_ENV, "http://grafana.test:3000")
    at = run()
    assert not any("Prometheus" in w.value for w in at.warning)  # no fallback banner
    assert at.error[0].value.startswith("**FIRING** · Verdict: step 2 — Affinity.")
    body = texts(at)
    assert "Symptom that starts the walk — **Prefix hit rate (cluster)**: 41.0% (alert when < 60.0%) — :red[:material/error: FIRING]" in body
    assert "**Sticky-session collisions**: 12.0% (alert when > 5.0%) — :red[:material/error: FIRING]" in body
    assert "**Session hit rate (follow-up turns)**: 86.0% (alert when < 80.0%) — :green[:material/check_circle: ok]" in body
    # a full cache is normal: what counts is its thrash (3%)
    assert "**Cache pressure (full and thrashing)**: 3.0% (alert when > 10.0%) — :green[:material/check_circle: ok]" in body
    assert "**Prefix-tree depth p99**: 3.96 (alert when > 32) — :green[:material/check_circle: ok]" in body
    # a rate: read later than the backfill's end on a loaded machine, Prometheus extrapolates it less
    moved = re.search(r"\*\*Session migrations per minute\*\*: ([0-9.]+)/min \(alert when > 100/min\) — "
                      r":green\[:material/check_circle: ok\]", body)
    assert moved and float(moved.group(1)) == pytest.approx(4.0, rel=0.1)
    assert "**Topology-aware placement**: 95.0% (alert when < 90.0%) — :green[:material/check_circle: ok]" in body
    assert "### Step 3 — Cold-miss cost · :gray[:material/help: not instrumented]" in body
    assert "**Router tree-walk p99**: — (alert when > 5 ms) — :gray[:material/help: not instrumented] · missing signal: walk_latency" in body
    assert "**MoE expert alignment**: — (alert when < 70.0%) — :gray[:material/help: not instrumented] · missing signal: expert_signature" in body
    # Panel links come from the generated rules, on the configured Grafana.
    assert "[Grafana panel](http://grafana.test:3000/d/prefixscope-diagnosis-chain?viewPanel=" in body
    assert metrics(at) == {"Available": "80.0%", "Predicted": "42.0%", "Achieved": "40.0%",
                           "Routing regret": "40.0%", "Index staleness": "2.0%",
                           # no router in the backfill says what it predicted: missing, not zero
                           "Router predicted": "—", "Router regret": "—"}
    assert at.info[0].value.startswith("Routing: 80% was reusable somewhere but only 40% was achieved")


def test_firing_checks_get_a_readable_chart(both: str) -> None:
    at = run()
    charts = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
              for c in at.get("plotly_chart")}
    spec = charts["Sticky-session collisions"]
    layout = spec["layout"]
    assert layout["height"] >= 240
    assert layout["yaxis"]["title"]["text"] == "percent" and layout["yaxis"]["tickformat"] == ".0%"
    assert layout["xaxis"]["tickformat"] == "%H:%M" and layout["xaxis"]["title"]["text"].startswith("time (UTC")
    assert any(s["type"] == "line" and s["y0"] == 0.05 for s in layout["shapes"])  # the threshold
    # The alert fires in Prometheus (for: 0s): its span is shaded.
    assert any(s["type"] == "rect" for s in layout["shapes"])


def test_alerts_page_groups_prometheus_alerts(both: str) -> None:
    at = run("alerts")
    assert not at.warning
    headings = [m.value for m in at.markdown if m.value.startswith("### ")]
    # The fixture's low hit rate also burns the engines' hit-rate SLO (two tiers); the always-firing
    # Watchdog is the pipeline's heartbeat and no group of its own.
    assert metrics(at)["Firing alert groups"] == "3", headings
    assert headings == ["### PrefixHitRateLow · warning · step 1 · 1 firing",
                        "### PrefixHitRateSloBurn · warning · step 1 · 2 firing",
                        "### PrefixStickyCollisionsHigh · warning · step 2 · 1 firing"]
    assert "Shared labels: `severity=warning`, `step=2`" in texts(at)


def test_workers_page_shows_migrations_by_kind(both: str) -> None:
    # The backfill ends when the fixture starts; a test that runs later on a loaded machine reads
    # rates over windows that reach past the last sample, which Prometheus extrapolates less (4.0
    # reads 3.87 some twenty seconds on): rates are compared within 10 %.
    at = run("workers")
    shown = metrics(at)["Session migrations per minute"]
    assert shown.endswith("/min") and float(shown.removesuffix("/min")) == pytest.approx(4.0, rel=0.1)
    # Beside Prometheus, liveness comes from the exporter's series (its /metrics), as before.
    liveness = next(d.value for d in at.dataframe if "Liveness" in d.value.columns)
    assert list(liveness.columns) == ["Worker", "Liveness", "Node", "Resident blocks"]
    assert liveness["Liveness"].tolist() == ["up", "up"]
    moves = at.dataframe[-1].value
    rows = moves.set_index("Kind")
    soft = [float(v.removesuffix("/min")) for v in rows.loc["soft"].tolist()]
    assert soft == pytest.approx([4.0, 1.0], rel=0.1)
    assert rows.loc["hard", "Session migrations"] == "0/min"
    assert rows.loc["hard", "Cross-node migrations"] == "—"  # no cross-node hard series: missing, not 0
