"""One threshold file, the same limits everywhere: the exporter, the generated rules as Prometheus
loads them, and the console reading Prometheus.

The file is not the packaged one (tests/limits_file.py changes values, ``for`` and severities),
so a part that reads alerts/thresholds.yaml behind the deployment's back shows other limits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import requests
import yaml
from streamlit.testing.v1 import AppTest

from alerts import generate
from console.readings import alert_terms
from console.settings import EXPORTER_ENV, PROMETHEUS_ENV, THRESHOLDS_ENV
from console.ui import fmt
from prefixscope import thresholds
from prefixscope.catalog import CHECKS
from tests import limits_file, servers
from tests.console import cluster
from tests.console.conftest import _serve
from tests.console.test_pages import APP, texts

pytestmark = pytest.mark.slow
_LIMIT = re.compile(r"\s*([<>])\s*([0-9.e+-]+)\s*$")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> thresholds.Thresholds:
    return thresholds.load(limits_file.write(tmp_path_factory.mktemp("site")))


@pytest.fixture(scope="module")
def rules(site: thresholds.Thresholds) -> dict:
    """The rule file ``prefixscope generate --thresholds <site file>`` writes."""
    files = generate.build(site)
    return yaml.safe_load(files[generate.ROOT / "alerts" / "generated" / generate.RULES_FILE])


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory: pytest.TempPathFactory, rules: dict) -> Iterator[str]:
    with servers.prometheus(tmp_path_factory.mktemp("prometheus"), rules) as url:
        yield url


@pytest.fixture(scope="module")
def exporter_url(site: thresholds.Thresholds) -> Iterator[str]:
    yield from _serve(cluster.build_state(site))


def exporter_limits(url: str) -> dict[str, tuple[float, float, str]]:
    """Check key → (threshold, for in seconds, severity) as ``/api/v1/groups`` reports them."""
    groups = requests.get(f"{url}/api/v1/groups", timeout=30).json()["data"]
    return {c["key"]: (c["threshold"], c["for_s"], c["severity"]) for s in groups["steps"] for c in s["checks"]}


def prometheus_limits(url: str) -> dict[str, tuple[float | None, float, str]]:
    """Alert name → (the number its query compares with, its ``for``, its severity) as loaded.

    An SLO's burn-rate rules compare against the burn limits, not the objective: None there."""
    groups = requests.get(f"{url}/api/v1/rules", params={"type": "alert"}, timeout=30).json()["data"]["groups"]
    out: dict[str, tuple[float | None, float, str]] = {}
    for g in groups:
        for r in g["rules"]:
            m = _LIMIT.search(r["query"])
            limit = float(m.group(2)) if m and " and " not in r["query"] else None
            out.setdefault(r["name"], (limit, float(r["duration"]), r["labels"]["severity"]))
    return out


def test_the_file_is_not_the_packaged_one(site: thresholds.Thresholds) -> None:
    packaged = thresholds.load()
    for key in limits_file.CHANGES:
        assert site.checks[key] != packaged.checks[key], key


def test_exporter_rules_and_console_show_the_same_limits(
        site: thresholds.Thresholds, exporter_url: str, prometheus_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    th = site
    exported = exporter_limits(exporter_url)
    loaded = prometheus_limits(prometheus_url)
    for check in CHECKS:
        threshold, for_s, severity = exported[check.key]
        assert (threshold, for_s, severity) == (th.value(check), th.for_s(check),
                                                th.checks[check.threshold].severity), check.key
        rule_limit, rule_for, rule_severity = loaded[check.alert]
        assert rule_for == for_s and rule_severity == severity, check.alert
        if check.kind != "slo":
            assert rule_limit == pytest.approx(threshold), check.alert

    # The console, reading values from Prometheus, shows the same limits, `for` and severities;
    # the packaged file it could find on disk is pointed at too, and must not be what it shows.
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.setenv(PROMETHEUS_ENV, prometheus_url)
    monkeypatch.setenv(THRESHOLDS_ENV, str(thresholds.DEFAULT_PATH))
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception, at.exception
    body = texts(at)
    assert not any("Prometheus" in w.value for w in at.warning)  # read from Prometheus, no fallback
    for check in CHECKS:
        threshold, for_s, severity = exported[check.key]
        limit = f"(alert when {check.op} {fmt(threshold, check.unit)})"
        lines = re.findall(rf"^\*\*{re.escape(check.title)}\*\*: .*$", body, re.M)
        assert lines and all(limit in line for line in lines), (check.key, limit, lines)
        terms = f"_{alert_terms(for_s, severity)}_"
        assert any(terms in line for line in lines), (check.key, terms, lines)
