"""The Alertmanager configuration: a route for prefixscope's alerts and inhibition rules that
make an incident page once, at the first failing step of the diagnosis chain.

The chain is ordered: a later step's alerts are usually consequences of an earlier step's
failure. So the inhibition rules say what the chain says:

- a firing cluster-wide step-0 (telemetry) alert inhibits the checklist alerts of steps 1–5: with
  blind or stale telemetry nothing downstream can be trusted. SLO alerts are never inhibited: their
  SLIs come from engine counters and request records, and a page must never wait for a warning.
  A per-worker telemetry alert (one worker's KV stream) inhibits nothing; the share of the fleet
  that is blind (PrefixTelemetryFleetBlind) is the cluster-wide alert that does;
- a firing *cause* of step N (N ≥ 1) inhibits the causes and context alerts of every later step.
  The cluster hit rate is the symptom that starts the walk and the SLO burns measure what users
  feel; neither names a step, so neither inhibits, and only telemetry inhibits them. A context
  alert (severity ``info`` in the threshold file) names no step either, so it inhibits nothing.

Which check is a cause is :func:`prefixscope.diagnosis.is_cause`, the rule the verdict uses.

Alerts are matched by name (the catalogue's), so alerts of other sources that happen to carry a
``step`` label are left alone. Source and target must agree on the scope labels (``cluster``: an
incident in one cluster does not silence another; alerts without the label match each other).
Pure data in, a plain dict out; :mod:`alerts.generate` writes it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Literal

from prefixscope.catalog import CHECKS, STEPS, WATCHDOG_ALERT, Check
from prefixscope.diagnosis import context_checks, is_cause
from prefixscope.thresholds import Thresholds

RECEIVER = "prefixscope"
DEADMANS_SWITCH = "prefixscope-deadmansswitch"
WATCHDOG = WATCHDOG_ALERT
Role = Literal["cause", "downstream", "any"]


def alerts_of(steps: Sequence[int], role: Role, context: Collection[str]) -> list[str]:
    """A cause names its step; downstream adds context alerts (a later step's consequences); "any"
    is every checklist alert. An SLO is never a target, a per-worker check never a source."""
    def chosen(check: Check) -> bool:
        if role == "cause":
            return is_cause(check, context) and not check.per
        if check.kind == "slo":
            return False
        return role == "any" or is_cause(check, context) or (role == "downstream" and check.key in context)
    return [c.alert for c in CHECKS if c.group in steps and chosen(c)]


def _name_matcher(alerts: Sequence[str]) -> str:
    return f'alertname=~"{"|".join(re.escape(a) for a in alerts)}"'


def inhibit_rules(thresholds: Thresholds, scope: Sequence[str] | None = None) -> list[dict]:
    """Step 0 inhibits everything after it; each later step's causes inhibit later steps' causes."""
    scope = thresholds.scope_labels if scope is None else scope
    context = context_checks(thresholds.severities)
    numbers = sorted(s.number for s in STEPS)
    rules: list[dict] = []
    for i, step in enumerate(numbers[:-1]):
        later = numbers[i + 1:]
        first = step == numbers[0]
        sources = alerts_of([step], "cause", context)
        targets = alerts_of(later, "any" if first else "downstream", context)
        if sources and targets:
            rules.append({
                "source_matchers": [_name_matcher(sources)],
                "target_matchers": [_name_matcher(targets)],
                "equal": list(scope),
            })
    return rules


def config(thresholds: Thresholds, receiver: str = RECEIVER) -> dict:
    """A complete Alertmanager configuration (a route to one receiver, plus the inhibition rules).

    The receivers have no integration: add yours (a webhook, PagerDuty, …; for the dead-man's
    switch a service that pages when the Watchdog stops arriving, e.g. healthchecks.io or
    PagerDuty's heartbeat) or lift ``route`` and ``inhibit_rules`` into an existing configuration.
    ``amtool check-config`` accepts it as is.
    """
    return {
        "route": {
            "receiver": receiver,
            "group_by": ["alertname", *thresholds.scope_labels, "step"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            # The Watchdog is re-sent every minute so the switch notices its silence within minutes.
            "routes": [{"matchers": [f'alertname="{WATCHDOG}"'], "receiver": DEADMANS_SWITCH,
                        "group_wait": "0s", "group_interval": "1m", "repeat_interval": "1m"}],
        },
        "receivers": [{"name": receiver}, {"name": DEADMANS_SWITCH}],
        "inhibit_rules": inhibit_rules(thresholds),
    }
