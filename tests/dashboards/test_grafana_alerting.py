"""Grafana alert provisioning: the flat file-provisioning shape, linked to the dashboard panels."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from alerts import grafana, rules
from prefixscope import thresholds as config
from prefixscope.catalog import BURN_WINDOWS, CHECKS, STEPS

ROOT = Path(__file__).resolve().parents[2]
PROV = yaml.safe_load((ROOT / "alerts" / "generated" / "grafana-alerting.yaml").read_text(encoding="utf-8"))
CHAIN = json.loads((ROOT / "dashboards" / "generated" / "diagnosis_chain.json").read_text(encoding="utf-8"))
RULE_KEYS = {"uid", "title", "condition", "data", "noDataState", "execErrState", "for", "annotations",
             "labels", "dashboardUid", "panelId", "isPaused"}


def _rules() -> list[dict]:
    return [r for g in PROV["groups"] for r in g["rules"]]


def _check(title: str):
    """The catalogue check of a rule title (an SLO's pairs are titled "<alert> (page)")."""
    return next(c for c in CHECKS if title == c.alert or title.startswith(c.alert + " ("))


def test_file_shape() -> None:
    assert PROV["apiVersion"] == 1
    assert [g["name"] for g in PROV["groups"]] == [
        "prefixscope.step0.telemetry", "prefixscope.step1.cache", "prefixscope.step2.affinity",
        "prefixscope.step3.cold-miss-cost", "prefixscope.step4.router-topology",
        "prefixscope.step5.coupled-optimisations"]
    assert len(PROV["groups"]) == len(STEPS)
    for g in PROV["groups"]:
        assert set(g) == {"orgId", "name", "folder", "interval", "rules"}
        assert g["orgId"] == 1 and g["folder"] == "prefixscope" and g["interval"] == "1m"


def test_rules_are_flat_not_ruler_api() -> None:
    rules = _rules()
    assert [r["title"] for r in rules] == [
        f"{c.alert} ({p.pair})" if c.slo else c.alert
        for c in sorted(CHECKS, key=lambda c: c.group) for p in (BURN_WINDOWS if c.slo else BURN_WINDOWS[:1])]
    for r in rules:
        assert set(r) == RULE_KEYS, r["title"]
        assert "grafana_alert" not in r
        assert len(r["uid"]) <= 40
    assert len({r["uid"] for r in rules}) == len(rules)


def test_a_missing_source_never_pages_and_a_data_source_outage_is_one_alert() -> None:
    """No data (a signal without a source) resolves to OK; an execution error (Prometheus cannot be
    queried) fires PrefixExporterDown alone — the chain is blind — and leaves every other rule OK."""
    assert grafana.NO_DATA_STATE == "OK" and grafana.EXEC_ERR_STATE == "OK"
    for r in _rules():
        assert r["noDataState"] == "OK", r["title"]
        assert r["execErrState"] == ("Alerting" if r["title"] == "PrefixExporterDown" else "OK"), r["title"]


def test_slo_pairs_check_both_windows() -> None:
    th = config.load()
    by_title = {r["title"]: r for r in _rules()}
    page = by_title["PrefixSessionHitRateSloBurn (page_1h)"]
    refs = {d["refId"]: d for d in page["data"]}
    assert refs["A"]["model"]["expr"] == "cluster:prefixscope_slo_session_hit_rate_errors:ratio_rate1h"
    assert refs["D"]["model"]["expr"] == "cluster:prefixscope_slo_session_hit_rate_errors:ratio_rate5m"
    assert refs["C"]["model"]["expression"] == "$B > 0.9 && $E > 0.9"
    assert page["labels"]["severity"] == th.checks["slo_session_hit_rate"].severity == "critical"
    assert page["labels"]["burn_tier"] == "page_1h"
    slow = by_title["PrefixSessionHitRateSloBurn (ticket_3d)"]
    assert {d["refId"]: d for d in slow["data"]}["A"]["model"]["expr"] == (
        "cluster:prefixscope_slo_session_hit_rate_errors:ratio_rate3d")
    assert slow["labels"]["severity"] == "warning"


def test_conditions_reference_their_queries_and_thresholds() -> None:
    th = config.load()
    for r in _rules():
        check = _check(r["title"])
        if check.slo is not None:
            continue  # test_slo_pairs_check_both_windows
        refs = {d["refId"]: d for d in r["data"]}
        assert r["condition"] == "C" and set(refs) >= {"A", "B", "C"}
        assert refs["A"]["model"]["expr"] == rules.check_expr(check, th)  # scoped, per worker where it alerts so
        assert refs["A"]["datasourceUid"] == "prometheus"
        math = refs["C"]["model"]["expression"]
        value = th.checks[check.threshold].value
        if check.baseline:
            assert refs["D"]["model"]["expr"] == check.baseline
            assert math == f"$B {check.op} {value:g} * $E"
        else:
            assert math == f"$B {check.op} {value:g}"
        assert r["for"] == th.checks[check.threshold].for_
        assert r["labels"] == {"severity": th.checks[check.threshold].severity, "step": str(check.group)}


def test_rules_point_at_their_dashboard_panel() -> None:
    panels = {p["id"]: p for p in CHAIN["panels"]}
    for r in _rules():
        assert r["dashboardUid"] == CHAIN["uid"]
        assert panels[r["panelId"]]["links"][0]["title"] == f"Runbook: {_check(r['title']).alert}"
        assert r["annotations"]["dashboard_url"].endswith(f"{CHAIN['uid']}?viewPanel={r['panelId']}")
