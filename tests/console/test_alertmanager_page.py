"""The Alerts page shows what Alertmanager holds back and why: silences and its inhibition rules.

Against Debian's real ``prometheus-alertmanager`` running the generated config (its inhibition
rules: an incident pages once, at its first failing step) with one silence made through its API.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import requests
from streamlit.testing.v1 import AppTest

from console.alertmanager import parse_inhibit_rules, parse_silences, rule_rows
from console.settings import ALERTMANAGER_ENV, EXPORTER_ENV, PROMETHEUS_ENV
from tests.alerts.test_alertmanager import running_alertmanager  # noqa: F401 - a fixture
from tests.console.test_pages import APP, texts


def test_silences_and_rules_read_as_a_person_reads_them() -> None:
    silences = parse_silences([
        {"id": "old", "status": {"state": "expired"}, "matchers": [{"name": "alertname", "value": "X",
                                                                   "isRegex": False, "isEqual": True}],
         "createdBy": "a", "comment": "c", "endsAt": "2024-01-01T00:00:00Z"},
        {"id": "now", "status": {"state": "active"}, "matchers": [{"name": "cluster", "value": "a|b",
                                                                  "isRegex": True, "isEqual": True}],
         "createdBy": "b", "comment": "maintenance", "endsAt": "2024-01-02T00:00:00Z"}])
    assert [(s.id, s.matchers) for s in silences] == [("now", 'cluster=~"a|b"'), ("old", 'alertname="X"')]
    rules = parse_inhibit_rules({"config": {"original": (
        'inhibit_rules:\n- source_matchers: [alertname=~"PrefixExporterDown|PrefixTelemetryKvEventGaps"]\n'
        '  target_matchers: [alertname=~"PrefixStickyCollisionsHigh"]\n  equal: [cluster]\n')}})
    assert rule_rows(rules) == [{"while firing": "PrefixExporterDown (step 0), PrefixTelemetryKvEventGaps (step 0)",
                                 "holds back": "PrefixStickyCollisionsHigh (step 2)", "on the same": "cluster"}]


@pytest.mark.slow
def test_the_alerts_page_lists_silences_and_who_inhibits_whom(
        monkeypatch: pytest.MonkeyPatch, running_alertmanager: str, exporter_url: str) -> None:  # noqa: F811
    now = datetime.now(UTC)
    r = requests.post(f"{running_alertmanager}/api/v2/silences", timeout=10, json={
        "matchers": [{"name": "alertname", "value": "PrefixTreeTooDeep", "isRegex": False, "isEqual": True}],
        "startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=2)).isoformat(),
        "createdBy": "on-call", "comment": "known deep tree during the migration"})
    assert r.status_code == 200, r.text
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    monkeypatch.setenv(ALERTMANAGER_ENV, running_alertmanager)
    at = AppTest.from_file(APP, default_timeout=30).run()
    at.switch_page("app_pages/alerts.py").run()
    assert not at.exception, at.exception
    body = texts(at)
    assert "#### Silences" in body and "#### Inhibition rules" in body
    tables = [t.value for t in at.table]
    silence = next(t for t in tables if "Matchers" in t.columns)
    assert silence.iloc[0]["Matchers"] == 'alertname="PrefixTreeTooDeep"'
    assert silence.iloc[0]["Comment"] == "known deep tree during the migration"
    rules = next(t for t in tables if "Holds back" in t.columns)
    assert "PrefixExporterDown (step 0)" in rules.iloc[0]["While firing"]
    assert "PrefixStickyCollisionsHigh (step 2)" in rules.iloc[0]["Holds back"]
