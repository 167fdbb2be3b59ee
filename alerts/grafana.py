"""Grafana-managed alert rules, built with grafanalib and flattened for file provisioning.

grafanalib 0.7.1's AlertRulev9 emits the ruler-API shape (``{uid, for, labels, annotations,
grafana_alert: {title, condition, data, no_data_state, exec_err_state}}``); Grafana's provisioning
reader wants the keys flat and camelCase and errors with "rule has no title set" otherwise.
"""

from __future__ import annotations

import hashlib

from grafanalib import core as g

from alerts.rules import step_group_name
from prefixscope.catalog import CHECKS, STEPS, Check
from prefixscope.thresholds import Thresholds
from prefixscope.wording import description, summary

DATASOURCE_UID = "prometheus"
FOLDER = "prefixscope"
INTERVAL = "1m"
# grafanalib spells the no-data state as shown in Grafana's UI; provisioning wants the enum value.
NO_DATA_STATES = {g.ALERTRULE_STATE_DATA_NODATA: "NoData"}


def rule_uid(alert: str) -> str:
    """Stable, short (Grafana allows 40 chars) and unique per alert."""
    return "pfx-" + hashlib.sha1(alert.encode()).hexdigest()[:12]


def _rule(check: Check, th: Thresholds, dashboard_uid: str, panel_id: int, dashboard_url: str) -> g.AlertRulev9:
    entry = th.checks[check.threshold]
    triggers: list = [g.Target(expr=check.value, refId="A", datasource=DATASOURCE_UID, instant=True),
                      g.AlertExpression(refId="B", expression="A", expressionType=g.EXP_TYPE_REDUCE,
                                        reduceFunction=g.EXP_REDUCER_FUNC_LAST)]
    if check.baseline:
        triggers += [g.Target(expr=check.baseline, refId="D", datasource=DATASOURCE_UID, instant=True),
                     g.AlertExpression(refId="E", expression="D", expressionType=g.EXP_TYPE_REDUCE,
                                       reduceFunction=g.EXP_REDUCER_FUNC_LAST)]
        condition = f"$B {check.op} {entry.value:g} * $E"
    else:
        condition = f"$B {check.op} {entry.value:g}"
    triggers.append(g.AlertExpression(refId="C", expression=condition, expressionType=g.EXP_TYPE_MATH))
    return g.AlertRulev9(
        title=check.alert, uid=rule_uid(check.alert), condition="C", triggers=triggers,
        evaluateFor=entry.for_,
        # A check whose signal has no source yields no series: that is "no data", not OK and not firing.
        noDataAlertState=g.ALERTRULE_STATE_DATA_NODATA, errorAlertState=g.ALERTRULE_STATE_DATA_ERROR,
        labels={"severity": entry.severity, "step": str(check.group)},
        annotations={"summary": summary(check, entry.value), "description": description(check, entry.value),
                     "runbook_url": th.runbook_url(check.alert), "dashboard_url": dashboard_url},
        dashboard_uid=dashboard_uid, panel_id=panel_id,
    )


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
        group = g.AlertGroup(name=step_group_name(step.number), folder=FOLDER, evaluateInterval=INTERVAL,
                             rules=[_rule(c, th, dashboard_uid, panel_ids[c.alert], dashboard_urls[c.alert])
                                    for c in checks])
        api = group.to_json_data()
        rules = [_flatten(r, dashboard_uid, panel_ids[c.alert]) for r, c in zip(api["rules"], checks, strict=True)]
        groups.append({"orgId": 1, "name": api["name"], "folder": api["folder"], "interval": api["interval"],
                       "rules": rules})
    return {"apiVersion": 1, "groups": groups}
