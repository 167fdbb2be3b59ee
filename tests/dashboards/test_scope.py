"""Every dashboard keeps the clusters one Prometheus watches apart: a variable per scope label
(``$cluster``), every series and recording rule narrowed to it, every aggregation keeping it; and
every query, with the variables filled in, runs on a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from dashboards.queries import scoped
from prefixscope.thresholds import load_thresholds
from tests.runbooks.test_runbook_promql import prometheus  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards" / "generated").glob("*.json"))
SERIES = re.compile(r'(?<![\w:"])((?:[a-z_]+:)?prefixscope_[A-Za-z0-9_]+(?::[A-Za-z0-9_]+)?)(?![\w:])(\{[^}]*\})?')
AGGREGATION = re.compile(r"\b(sum|max|min|avg|count|quantile)\b\s*(by \(([^)]*)\))?\s*\(")


def _targets(path: Path) -> list[str]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def _variables(path: Path) -> dict[str, str]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    return {v["name"]: v.get("query", "") for v in doc["templating"]["list"]}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_dashboard_has_the_scope_variables_and_narrows_every_query_by_them(path: Path) -> None:
    scope = load_thresholds().scope_labels
    assert scope == ("cluster",)
    variables = _variables(path)
    assert variables["cluster"] == "label_values(prefixscope_exporter_build_info, cluster)"
    for name in ("model", "node", "worker"):
        assert 'cluster=~"$cluster"' in variables[name], name
    for expr in _targets(path):
        for m in SERIES.finditer(expr):
            assert m[2] and 'cluster=~"$cluster"' in m[2], (m[1], expr)
        for m in AGGREGATION.finditer(expr):
            assert m[3] is not None and "cluster" in m[3].split(", "), expr


def test_scoping_a_query_keeps_its_own_matchers_and_groupings() -> None:
    assert scoped('sum by (worker) (rate(prefixscope_kv_blocks_stored_total{worker=~"$worker"}[5m]))',
                  ("cluster",)) == ('sum by (cluster, worker) (rate(prefixscope_kv_blocks_stored_total'
                                    '{cluster=~"$cluster", worker=~"$worker"}[5m]))')
    assert scoped("max(cluster:prefixscope_kv_event_stale_workers:ratio)", ()) == (
        "max(cluster:prefixscope_kv_event_stale_workers:ratio)")


@pytest.mark.slow
def test_every_dashboard_query_runs_on_a_real_prometheus(prometheus: str) -> None:  # noqa: F811
    filled = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
    failed = []
    queries = [e for p in DASHBOARDS for e in _targets(p)]
    queries += [re.sub(r"^label_values\((.*), \w+\)$", r"\1", q) for p in DASHBOARDS
                for n, q in _variables(p).items() if q.startswith("label_values(")]
    assert len(queries) > 60
    for query in queries:
        for var, value in filled.items():
            query = query.replace(var, value)
        query = re.sub(r"\$\w+", ".*", query)
        answer = requests.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=10).json()
        if answer.get("status") != "success":
            failed.append(f"{query}: {answer.get('error')}")
    assert not failed, "\n".join(failed)
