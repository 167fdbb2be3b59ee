"""Prometheus rule groups (recording + alerting) built from the catalogue and the thresholds.

Pure data in, plain dicts out; :mod:`alerts.generate` writes them as YAML.
"""

from __future__ import annotations

import re

from prefixscope.catalog import (
    BURN_WINDOWS,
    CHECKS,
    RECORDING_RULES,
    SLO_ERROR_RATIO_RULES,
    STEPS,
    WATCHDOG_ALERT,
    BurnWindows,
    Check,
    RecordingRule,
    configure,
    pools_exported,
    render_expr,
    scope_expr,
    shard_guarded,
)
from prefixscope.thresholds import Thresholds
from prefixscope.wording import description, slo_description, summary

RECORD_NAME_RE = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")
ALERT_NAME_RE = re.compile(r"^Prefix[A-Z][A-Za-z0-9]+$")
AGGREGATIONS = ("sum", "avg", "min", "max", "count")
RECORDING_GROUP = "prefixscope.recording"
META_GROUP = "prefixscope.meta"
WATCHDOG = WATCHDOG_ALERT


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
                # "(sum(...) - sum(...))": a difference of aggregates is aggregated too.
                terms = _top_level_split(side[1:-1], "-") if side.startswith("(") and side.endswith(")") else [side]
                if not all(t.startswith(AGGREGATIONS) for t in terms):
                    problems.append(f"{rule.record}: '{side}' is divided before it is aggregated "
                                    "(sum numerator and denominator first, so shards and workers pool)")
    return problems


def alert_problems() -> list[str]:
    problems = []
    for check in CHECKS:
        if not ALERT_NAME_RE.match(check.alert):
            problems.append(f"{check.alert}: alert names are CamelCase and start with Prefix")
    return problems


def windowed(expr: str, th: Thresholds) -> str:
    """A catalogue expression with the configured rate and baseline windows."""
    return configure(expr, th.window, th.baseline_window)


def scoped(expr: str, th: Thresholds, per: tuple[str, ...] = ()) -> str:
    """A catalogue expression as Prometheus runs it: configured windows, every aggregation keeping
    the scope labels (and ``per``: a per-worker check's ``worker``)."""
    return scope_expr(windowed(expr, th), (*th.scope_labels, *per))


def check_expr(check: Check, th: Thresholds) -> str:
    """A check's value as Prometheus runs it (per scope, and per worker for a per-worker check)."""
    return scoped(check.value, th, check.per)


def recording_rule(rule: RecordingRule, th: Thresholds) -> dict:
    """The rule as Prometheus reads it: configured windows, scope labels, ``threshold(key)`` filled in,
    and, when it pools exported series, withheld while a family shard is missing (``shard_guarded``:
    a rule that reads only other rules inherits their absence) — but for the SLOs' error ratios,
    which the surviving shards still estimate, so a dead shard never silences a page."""
    guarded = pools_exported(rule.expr) and rule.record not in SLO_ERROR_RATIO_RULES
    expr = shard_guarded(rule.expr) if guarded else rule.expr
    expr = scope_expr(expr, th.scope_labels) if rule.fixed_windows else scoped(expr, th)
    return {"record": rule.record, "expr": render_expr(expr, th.values(), th.budgets())}


def alert_expr(check: Check, threshold: float, th: Thresholds | None = None) -> str:
    value = check_expr(check, th) if th is not None else check.value
    if check.baseline:
        baseline = scoped(check.baseline, th) if th is not None else check.baseline
        return f"{value} {check.op} {threshold:g} * {baseline}"
    return f"{value} {check.op} {threshold:g}"


def burn_expr(check: Check, th: Thresholds, pair: BurnWindows) -> str:
    """Both windows of a burn-rate pair above factor × budget (SRE workbook, multiwindow alerts)."""
    assert check.slo is not None
    limit = th.checks[check.threshold].burn_limit(pair.pair)
    return (f"{check.slo.error_ratio_rule(check.key, pair.long)} > {limit:g} and "
            f"{check.slo.error_ratio_rule(check.key, pair.short)} > {limit:g}")


def burn_severity(check: Check, th: Thresholds, pair: BurnWindows) -> str:
    """The page tiers carry the entry's severity, the ticket tiers their own (a warning)."""
    return th.checks[check.threshold].severity if pair.pages else pair.severity


def alert_rules(check: Check, th: Thresholds, dashboard_url: str) -> list[dict]:
    """The check's alerting rules: one, or for an SLO one per burn-rate pair (same alert name,
    told apart by severity, as the workbook's page and ticket)."""
    entry = th.checks[check.threshold]
    annotations = {
        "summary": summary(check, entry.value),
        "runbook_url": th.runbook_url(check.alert),
        "dashboard_url": dashboard_url,
    }
    step = str(check.group)
    if check.slo is None:
        rule = {
            "alert": check.alert,
            "expr": alert_expr(check, entry.value, th),
            "for": entry.for_,
            "labels": {"severity": entry.severity, "step": step},
            "annotations": {**annotations, "description": description(check, entry.value)},
        }
        if entry.keep_firing_for:
            rule["keep_firing_for"] = entry.keep_firing_for
        return [rule]
    return [{
        "alert": check.alert,
        "expr": burn_expr(check, th, pair),
        "for": entry.for_,
        # the tier tells the rules apart (same name and severity otherwise: page_1h and page_6h)
        "labels": {"severity": burn_severity(check, th, pair), "step": step, "burn_tier": pair.pair},
        "annotations": {**annotations, "description": slo_description(
            check, entry.value, entry.burn_rates[pair.pair] if entry.burn_rates else 0.0, pair.long, pair.short)},
    } for pair in BURN_WINDOWS]


def alert_exprs(check: Check, th: Thresholds) -> list[str]:
    """The expression of each of the check's alerting rules (as in the rule file)."""
    if check.slo is None:
        return [alert_expr(check, th.checks[check.threshold].value, th)]
    return [burn_expr(check, th, pair) for pair in BURN_WINDOWS]


def alert_rule(check: Check, th: Thresholds, dashboard_url: str) -> dict:
    """The check's first (for an SLO: its page) alerting rule."""
    return alert_rules(check, th, dashboard_url)[0]


def step_group_name(step: int) -> str:
    title = next(s.title for s in STEPS if s.number == step)
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return f"prefixscope.step{step}.{slug}"


def rule_groups(th: Thresholds, dashboard_urls: dict[str, str]) -> dict:
    """The Prometheus rule file: recording rules first, then one alert group per step."""
    groups: list[dict] = [{
        "name": RECORDING_GROUP,
        "rules": [recording_rule(r, th) for r in RECORDING_RULES],
    }]
    for step in STEPS:
        checks = [c for c in CHECKS if c.group == step.number]
        if checks:
            groups.append({
                "name": step_group_name(step.number),
                "rules": [r for c in checks for r in alert_rules(c, th, dashboard_urls[c.alert])],
            })
    groups.append({"name": META_GROUP, "rules": [watchdog_rule(th)]})
    return {"groups": groups}


def watchdog_rule(th: Thresholds) -> dict:
    """An alert that always fires: its absence at the receiving end (a dead-man's switch) says the
    path Prometheus → Alertmanager → receiver is broken, which no other alert can say."""
    return {
        "alert": WATCHDOG,
        "expr": "vector(1)",
        "labels": {"severity": "none"},
        "annotations": {
            "summary": "Always firing: the alerting pipeline is alive.",
            "description": "PrefixWatchdog fires as long as Prometheus evaluates prefixscope's rules and "
                           "reaches Alertmanager. Route it to a dead-man's switch that pages when it stops.",
            "runbook_url": th.runbook_url(WATCHDOG),
        },
    }


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
