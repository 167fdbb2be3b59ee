"""Every metric that any rule, alert or panel uses exists in the catalogue or is a recording rule."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.dashboards.promql_names import metric_names, unknown

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "alerts" / "generated"


def test_the_parser_finds_names_and_ignores_label_values() -> None:
    expr = ('sum by (worker) (rate(prefixscope_x_total{worker=~"$worker", job="prefixscope_y"}[5m])) '
            "/ on () group_left cluster:prefixscope_z:ratio_rate5m")
    assert metric_names(expr) == {"prefixscope_x_total", "cluster:prefixscope_z:ratio_rate5m"}
    assert unknown("prefixscope_not_a_metric_total") == {"prefixscope_not_a_metric_total"}
    assert unknown("prefixscope_up + prefixscope_cold_prefill_seconds_bucket") == set()


def test_rule_files_use_known_metrics() -> None:
    rules = yaml.safe_load((GEN / "prefixscope.rules.yaml").read_text(encoding="utf-8"))
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) > 40
    assert {e: unknown(e) for e in exprs if unknown(e)} == {}


def test_grafana_alert_queries_use_known_metrics() -> None:
    prov = yaml.safe_load((GEN / "grafana-alerting.yaml").read_text(encoding="utf-8"))
    exprs = [d["model"]["expr"] for g in prov["groups"] for r in g["rules"] for d in r["data"]
             if d["datasourceUid"] != "-100"]
    assert exprs and {e: unknown(e) for e in exprs if unknown(e)} == {}


def test_dashboard_queries_use_known_metrics() -> None:
    exprs = []
    for path in sorted((ROOT / "dashboards" / "generated").glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        exprs += [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
        exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 40
    assert all(metric_names(e) for e in exprs)
    assert {e: unknown(e) for e in exprs if unknown(e)} == {}
