"""Grafana-managed alert rules, built with grafanalib and flattened for file provisioning.

grafanalib 0.7.1's AlertRulev9 emits the ruler-API shape (``{uid, for, labels, annotations,
grafana_alert: {title, condition, data, no_data_state, exec_err_state}}``); Grafana's provisioning
reader wants the keys flat and camelCase and errors with "rule has no title set" otherwise.
"""

from __future__ import annotations

import hashlib

from grafanalib import core as g

from alerts.rules import burn_severity, check_expr, scoped, step_group_name
from prefixscope.catalog import BURN_WINDOWS, CHECKS, STEPS, BurnWindows, Check
from prefixscope.thresholds import Thresholds
from prefixscope.wording import description, slo_description, summary

DATASOURCE_UID = "prometheus"
FOLDER = "prefixscope"
INTERVAL = "1m"
# grafanalib spells the no-data state as shown in Grafana's UI; provisioning wants the enum value.
NO_DATA_STATES = {g.ALERTRULE_STATE_DATA_NODATA: "NoData"}
# A check whose signal has no source yields no series: it is not instrumented, and may not page.
# A query that fails (the Prometheus data source is down) says nothing about the fleet either, but
# it does say the whole chain is blind: PrefixExporterDown, the alert for exactly that, fires on it
# (Alerting); every other rule resolves to OK, so an outage is one alert, not one per check.
NO_DATA_STATE = g.ALERTRULE_STATE_DATA_OK
EXEC_ERR_STATE = g.ALERTRULE_STATE_DATA_OK
BLIND_CHECK = "exporter_up"
BLIND_EXEC_ERR_STATE = g.ALERTRULE_STATE_DATA_ALERTING


def rule_uid(alert: str) -> str:
    """Stable, short (Grafana allows 40 chars) and unique per alert."""
    return "pfx-" + hashlib.sha1(alert.encode()).hexdigest()[:12]


def rule_title(check: Check, pair: BurnWindows | None = None) -> str:
    """The alert name; an SLO's burn-rate pairs get the pair in the title (Grafana wants titles unique
    per folder; Prometheus tells the pairs apart by their severity label)."""
    return check.alert if pair is None else f"{check.alert} ({pair.pair})"


def _queries(first: str, second: str | None) -> list:
    triggers: list = [g.Target(expr=first, refId="A", datasource=DATASOURCE_UID, instant=True),
                      g.AlertExpression(refId="B", expression="A", expressionType=g.EXP_TYPE_REDUCE,
                                        reduceFunction=g.EXP_REDUCER_FUNC_LAST)]
    if second is not None:
        triggers += [g.Target(expr=second, refId="D", datasource=DATASOURCE_UID, instant=True),
                     g.AlertExpression(refId="E", expression="D", expressionType=g.EXP_TYPE_REDUCE,
                                       reduceFunction=g.EXP_REDUCER_FUNC_LAST)]
    return triggers


def _rules(check: Check, th: Thresholds, dashboard_uid: str, panel_id: int, dashboard_url: str) -> list[g.AlertRulev9]:
    entry = th.checks[check.threshold]
    annotations = {"summary": summary(check, entry.value), "runbook_url": th.runbook_url(check.alert),
                   "dashboard_url": dashboard_url}
    variants: list[tuple[BurnWindows | None, list, str, str, str]] = []
    if check.slo is not None:
        for pair in BURN_WINDOWS:
            limit = entry.burn_limit(pair.pair)
            triggers = _queries(check.slo.error_ratio_rule(check.key, pair.long),
                                check.slo.error_ratio_rule(check.key, pair.short))
            factor = entry.burn_rates[pair.pair] if entry.burn_rates else 0.0
            variants.append((pair, triggers, f"$B > {limit:g} && $E > {limit:g}", burn_severity(check, th, pair),
                             slo_description(check, entry.value, factor, pair.long, pair.short)))
    else:
        baseline = scoped(check.baseline, th) if check.baseline else None
        condition = f"$B {check.op} {entry.value:g}" + (" * $E" if baseline else "")
        variants.append((None, _queries(check_expr(check, th), baseline), condition, entry.severity,
                         description(check, entry.value)))
    out = []
    for pair, triggers, condition, severity, text in variants:
        triggers.append(g.AlertExpression(refId="C", expression=condition, expressionType=g.EXP_TYPE_MATH))
        title = rule_title(check, pair)
        labels = {"severity": severity, "step": str(check.group)} | ({"burn_tier": pair.pair} if pair else {})
        out.append(g.AlertRulev9(
            title=title, uid=rule_uid(title), condition="C", triggers=triggers, evaluateFor=entry.for_,
            noDataAlertState=NO_DATA_STATE,
            errorAlertState=BLIND_EXEC_ERR_STATE if check.key == BLIND_CHECK else EXEC_ERR_STATE,
            labels=labels, annotations={**annotations, "description": text},
            dashboard_uid=dashboard_uid, panel_id=panel_id,
        ))
    return out


def _flatten(api_rule: dict, dashboard_uid: str, panel_id: int) -> dict:
    inner = api_rule["grafana_alert"]
    return {
        "uid": api_rule["uid"],
        "title": inner["title"],
        "condition": inner["condition"],
        "data": inner["data"],
        "noDataState": NO_DATA_STATES.get(inner["no_data_state"], inner["no_data_state"]),
        "execErrState": inner["exec_err_state"],
        "for": api_rule["for"],
        "annotations": api_rule["annotations"],
        "labels": api_rule["labels"],
        # grafanalib accepts these but does not emit them.
        "dashboardUid": dashboard_uid,
        "panelId": panel_id,
        "isPaused": False,
    }


def provisioning(th: Thresholds, dashboard_uid: str, panel_ids: dict[str, int],
                 dashboard_urls: dict[str, str]) -> dict:
    """The alerting provisioning file: one group per diagnosis step."""
    groups = []
    for step in STEPS:
        checks = [c for c in CHECKS if c.group == step.number]
        if not checks:
            continue
        built = [(r, c) for c in checks
                 for r in _rules(c, th, dashboard_uid, panel_ids[c.alert], dashboard_urls[c.alert])]
        group = g.AlertGroup(name=step_group_name(step.number), folder=FOLDER, evaluateInterval=INTERVAL,
                             rules=[r for r, _c in built])
        api = group.to_json_data()
        rules = [_flatten(r, dashboard_uid, panel_ids[c.alert])
                 for r, (_b, c) in zip(api["rules"], built, strict=True)]
        groups.append({"orgId": 1, "name": api["name"], "folder": api["folder"], "interval": api["interval"],
                       "rules": rules})
    return {"apiVersion": 1, "groups": groups}
