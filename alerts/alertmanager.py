"""The Alertmanager configuration: a route for prefixscope's alerts and inhibition rules that
make an incident page once, at the first failing step of the diagnosis chain.

The chain is ordered: a later step's alerts are usually consequences of an earlier step's
failure. So the inhibition rules say what the chain says:

- a firing step-0 (telemetry) alert inhibits every alert of steps 1–5: with blind or stale
  telemetry nothing downstream can be trusted, symptoms and SLO burns included;
- a firing *cause* of step N (N ≥ 1) inhibits the causes of every later step. The cluster hit
  rate is the symptom that starts the walk and the SLO burns measure what users feel; neither
  names a step, so neither inhibits, and only telemetry inhibits them.

Alerts are matched by name (the catalogue's), so alerts of other sources that happen to carry a
``step`` label are left alone. Source and target must agree on the scope labels (``cluster``: an
incident in one cluster does not silence another; alerts without the label match each other).
Pure data in, a plain dict out; :mod:`alerts.generate` writes it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from prefixscope.catalog import CHECKS, STEPS, Check

RECEIVER = "prefixscope"
SCOPE = ("cluster",)
SYMPTOM = "prefix_hit_rate_total"  # the symptom that starts the walk (as exporter/checks.py and console/chain.py)


def is_cause(check: Check) -> bool:
    return check.kind != "slo" and check.key != SYMPTOM


def alerts_of(steps: Sequence[int], causes_only: bool) -> list[str]:
    return [c.alert for c in CHECKS if c.group in steps and (is_cause(c) or not causes_only)]


def _name_matcher(alerts: Sequence[str]) -> str:
    return f'alertname=~"{"|".join(re.escape(a) for a in alerts)}"'


def inhibit_rules(scope: Sequence[str] = SCOPE) -> list[dict]:
    """Step 0 inhibits everything after it; each later step's causes inhibit later steps' causes."""
    numbers = sorted(s.number for s in STEPS)
    rules: list[dict] = []
    for i, step in enumerate(numbers[:-1]):
        later = numbers[i + 1:]
        first = step == numbers[0]
        sources = alerts_of([step], causes_only=True)
        targets = alerts_of(later, causes_only=not first)
        if sources and targets:
            rules.append({
                "source_matchers": [_name_matcher(sources)],
                "target_matchers": [_name_matcher(targets)],
                "equal": list(scope),
            })
    return rules


def config(receiver: str = RECEIVER) -> dict:
    """A complete Alertmanager configuration (a route to one receiver, plus the inhibition rules).

    The receiver has no integration: add yours (a webhook, PagerDuty, …) or lift ``route`` and
    ``inhibit_rules`` into an existing configuration. ``amtool check-config`` accepts it as is.
    """
    return {
        "route": {
            "receiver": receiver,
            "group_by": ["alertname", *SCOPE, "step"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
        },
        "receivers": [{"name": receiver}],
        "inhibit_rules": inhibit_rules(),
    }
