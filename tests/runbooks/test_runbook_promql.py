"""Every PromQL expression a runbook shows is run against a real Prometheus (loaded with the
generated rules): a runbook whose query does not parse sends on-call to a red error box mid-incident.

An expression is a backticked span that reads a prefixscope series or recording rule and calls a
function or compares; prose such as `prefixscope_kv_event_lag_seconds` alone is queried too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from tests import servers

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "runbooks"
SPAN = re.compile(r"`([^`\n]+)`")
# a prefixscope series or recording rule, or a Prometheus self-metric the Watchdog's runbook reads
NAMES = re.compile(r"\b(prefixscope_\w+|\w+:prefixscope_\w+:\w+|prometheus_\w+|alertmanager_\w+|up\{)")


def _queries() -> list[tuple[str, str]]:
    out = []
    for path in sorted(RUNBOOKS.glob("*.md")):
        for span in SPAN.findall(path.read_text(encoding="utf-8")):
            if NAMES.search(span) and not span.startswith(("prefixscope ", "alerts/", "--")) and "/" not in span[:1]:
                out.append((path.name, span))
    return out


QUERIES = _queries()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    rules = yaml.safe_load((ROOT / "alerts" / "generated" / "prefixscope.rules.yaml").read_text(encoding="utf-8"))
    with servers.prometheus(tmp_path_factory.mktemp("prometheus"), rules) as url:
        yield url


def test_the_runbooks_show_promql() -> None:
    assert len(QUERIES) > 40
    assert not [q for _, q in QUERIES if "−" in q], "a Unicode minus is no PromQL operator"


@pytest.mark.slow
def test_every_runbook_query_runs_on_a_real_prometheus(prometheus: str) -> None:
    failed = []
    for name, query in QUERIES:
        answer = requests.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=10).json()
        if answer.get("status") != "success":
            failed.append(f"{name}: {query}: {answer.get('error')}")
    assert not failed, "\n".join(failed)


def test_a_runbook_that_names_its_severity_names_the_thresholds_one() -> None:
    from prefixscope.catalog import CHECKS
    from prefixscope.thresholds import load_thresholds

    severities = load_thresholds().severities
    for check in CHECKS:
        text = (RUNBOOKS / f"{check.alert}.md").read_text(encoding="utf-8")
        stated = set(re.findall(r"`(info|warning|critical)`(?::|\.)", text))  # "`warning`: a … cause."
        if stated:
            assert stated == {severities[check.threshold]}, (check.alert, stated)
