"""Prometheus rule groups (recording + alerting) built from the catalogue and the thresholds.

Pure data in, plain dicts out; :mod:`alerts.generate` writes them as YAML.
"""

from __future__ import annotations

import re

from prefixscope.catalog import CHECKS, RECORDING_RULES, STEPS, Check, render_expr
from prefixscope.thresholds import Thresholds
from prefixscope.wording import description, summary

RECORD_NAME_RE = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")
ALERT_NAME_RE = re.compile(r"^Prefix[A-Z][A-Za-z0-9]+$")
AGGREGATIONS = ("sum", "avg", "min", "max", "count")
RECORDING_GROUP = "prefixscope.recording"


def _top_level_split(expr: str, op: str) -> list[str]:
    """Split ``expr`` on ``op`` outside parentheses and braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == op and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def recording_rule_problems() -> list[str]:
    """Names must be ``level:metric:operations``; rate ratios aggregate both sides before dividing."""
    problems = []
    for rule in RECORDING_RULES:
        if not RECORD_NAME_RE.match(rule.record):
            problems.append(f"{rule.record}: not a level:metric:operations name")
        sides = _top_level_split(rule.expr, "/")
        if len(sides) > 1 and "rate(" in rule.expr:
            for side in sides:
                if not side.startswith(AGGREGATIONS):
                    problems.append(f"{rule.record}: '{side}' is divided before it is aggregated "
                                    "(sum numerator and denominator first, so shards and workers pool)")
    return problems


def alert_problems() -> list[str]:
    problems = []
    for check in CHECKS:
        if not ALERT_NAME_RE.match(check.alert):
            problems.append(f"{check.alert}: alert names are CamelCase and start with Prefix")
    return problems


def alert_expr(check: Check, threshold: float) -> str:
    if check.baseline:
        return f"{check.value} {check.op} {threshold:g} * {check.baseline}"
    return f"{check.value} {check.op} {threshold:g}"


def alert_rule(check: Check, th: Thresholds, dashboard_url: str) -> dict:
    entry = th.checks[check.threshold]
    return {
        "alert": check.alert,
        "expr": alert_expr(check, entry.value),
        "for": entry.for_,
        "labels": {"severity": entry.severity, "step": str(check.group)},
        "annotations": {
            "summary": summary(check, entry.value),
            "description": description(check, entry.value),
            "runbook_url": th.runbook_url(check.alert),
            "dashboard_url": dashboard_url,
        },
    }


def step_group_name(step: int) -> str:
    title = next(s.title for s in STEPS if s.number == step)
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return f"prefixscope.step{step}.{slug}"


def rule_groups(th: Thresholds, dashboard_urls: dict[str, str]) -> dict:
    """The Prometheus rule file: recording rules first, then one alert group per step."""
    groups: list[dict] = [{
        "name": RECORDING_GROUP,
        "rules": [{"record": r.record, "expr": render_expr(r.expr, th.values())} for r in RECORDING_RULES],
    }]
    for step in STEPS:
        checks = [c for c in CHECKS if c.group == step.number]
        if checks:
            groups.append({
                "name": step_group_name(step.number),
                "rules": [alert_rule(c, th, dashboard_urls[c.alert]) for c in checks],
            })
    return {"groups": groups}


def prometheus_rule(rules: dict) -> dict:
    """The same groups as a prometheus-operator PrometheusRule manifest."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "prefixscope",
            "labels": {"app.kubernetes.io/name": "prefixscope", "app.kubernetes.io/component": "alerting"},
        },
        "spec": rules,
    }
