"""How alerts read: the summary sentence per alert and unit-aware value formatting.

The summary sentence of each alert is the catalogue's ``Check.summary``. Summaries are static
(Alertmanager groups notifications by them); only the threshold, read from alerts/thresholds.yaml,
is filled in at generation time. Descriptions carry the live value through Prometheus's template
functions, chosen per unit.
"""

from __future__ import annotations

from prefixscope.catalog import RULES_BY_NAME, Check
from prefixscope.units import format_setting, prometheus_value_template


def threshold_text(check: Check, value: float) -> str:
    """The threshold as a person reads it, in the check's unit."""
    return format_setting(value, check.unit)


def value_template(check: Check) -> str:
    """A Prometheus template rendering the alert's ``$value`` in the check's unit."""
    return prometheus_value_template(check.unit)


def summary(check: Check, value: float) -> str:
    """The check's one-line summary (``Check.summary``) with its threshold filled in."""
    return check.summary.format(threshold=threshold_text(check, value))


def description(check: Check, value: float) -> str:
    word = "below" if check.op == "<" else "above"
    limit = threshold_text(check, value)
    if check.baseline:
        baseline = RULES_BY_NAME[check.baseline].help.rstrip(".")
        limit = f"{value:g} × the baseline ({baseline[0].lower()}{baseline[1:]})"
    return f"{check.meaning} Now {value_template(check)}; the alert fires {word} {limit}."


def slo_description(check: Check, objective: float, factor: float, long: str, short: str) -> str:
    """An SLO burn-rate alert: the error ratio over the long window, and when the pair fires."""
    budget = 1.0 - objective
    limit = round(factor * budget, 9)
    return (f"{check.meaning} Now {prometheus_value_template('ratio')} over {long}; the alert fires when "
            f"both the {long} and the {short} error ratio exceed {factor:g} × the {format_setting(budget, 'ratio')} "
            f"error budget ({format_setting(limit, 'ratio')}).")
