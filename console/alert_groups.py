"""Firing alerts grouped as Alertmanager groups them by default, deduplicated (pure).

One group per alert name; inside it, one row per distinct label set (the same alert seen
twice, e.g. from two Prometheus replicas, is one row). Labels every alert of the group shares
are shown once; each row shows only what is its own — the way karma lays out groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prefixscope.catalog import CHECKS_BY_ALERT, WATCHDOG_ALERT
from prefixscope.units import format_reading
from prefixscope.wording import summary as check_summary

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class AlertRow:
    labels: dict[str, str]  # the labels not shared by the whole group
    active_at: str
    value: str
    summary: str


@dataclass(frozen=True)
class AlertGroup:
    alertname: str
    severity: str
    common_labels: dict[str, str]
    rows: tuple[AlertRow, ...]
    step: int | None  # the diagnosis step of the catalogue check behind the alert

    @property
    def known(self) -> bool:
        return self.alertname in CHECKS_BY_ALERT


def group_alerts(alerts: Iterable[Mapping], state: str = "firing") -> list[AlertGroup]:
    by_name: dict[str, dict[tuple, Mapping]] = {}
    for a in alerts:
        if a.get("state") != state:
            continue
        labels = {str(k): str(v) for k, v in (a.get("labels") or {}).items()}
        name = labels.get("alertname", "")
        if name == WATCHDOG_ALERT:  # the pipeline's heartbeat, not a problem of the fleet
            continue
        key = tuple(sorted(labels.items()))
        seen = by_name.setdefault(name, {})
        # Keep the earliest activation of duplicates: it says how long the problem has lasted.
        if key not in seen or str(a.get("activeAt", "")) < str(seen[key].get("activeAt", "")):
            seen[key] = a
    groups = []
    for name, members in by_name.items():
        label_sets = [dict(k) for k in members]
        common = {k: v for k, v in label_sets[0].items() if all(ls.get(k) == v for ls in label_sets)}
        rows = []
        for key, a in sorted(members.items()):
            own = {k: v for k, v in key if k not in common}
            ann = a.get("annotations") or {}
            rows.append(AlertRow(own, str(a.get("activeAt", "")), str(a.get("value", "")),
                                 str(ann.get("summary") or ann.get("description") or "")))
        check = CHECKS_BY_ALERT.get(name)
        groups.append(AlertGroup(name, common.get("severity", "none"), common, tuple(rows),
                                 check.group if check else None))
    groups.sort(key=lambda g: (SEVERITY_ORDER.get(g.severity, 9), g.step if g.step is not None else 9, g.alertname))
    return groups


def value_text(alertname: str, raw: object) -> str:
    """An alert's ``$value`` as what it is, in its unit: ``error ratio 16.0%`` for an SLO burn
    alert, the check's key number otherwise (``1 m 41 s``), never ``9.965754716981131e-03``."""
    try:
        value = float(str(raw))
    except ValueError:
        return str(raw)
    check = CHECKS_BY_ALERT.get(alertname)
    if check is None:
        return format_reading(value, "")
    if check.kind == "slo":
        return f"error ratio {format_reading(value, 'ratio')}"
    if check.baseline:  # the alert compares the window's value itself with k × the baseline's
        return format_reading(value, "seconds")
    return format_reading(value, check.unit)


def alerts_from_chain(steps: Iterable) -> list[dict]:
    """The firing and pending checks of a chain shaped like Prometheus alerts (when Prometheus
    is absent), each with the severity in force, its value described by the check's title and
    the alert's own summary."""
    return [{"labels": {"alertname": c.check.alert, "severity": c.severity or "warning"},
             "state": "firing" if c.status == "firing" else "pending", "activeAt": "",
             "value": f"{c.check.title}: {format_reading(c.value, c.check.unit)}",
             "annotations": {"summary": check_summary(c.check, c.threshold) if c.threshold is not None
                             else c.check.meaning}}
            for step in steps for c in step.checks if c.status == "firing" or c.pending]
