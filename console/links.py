"""Thresholds, runbook and dashboard links, and in-app runbooks, all looked up in the catalogue.

A runbook is read from the packaged ``runbooks/`` directory by the alert name the catalogue
declares; a user-supplied string is only ever a dictionary key here, never part of a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

import yaml

from exporter.catalog import CHECKS_BY_ALERT, STEPS

REPO_ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS_FILE = REPO_ROOT / "alerts" / "thresholds.yaml"
RUNBOOK_DIR = REPO_ROOT / "runbooks"
# The generated Grafana dashboard that holds one row per diagnosis step.
DASHBOARD_UID = "prefixscope-diagnosis-chain"


@dataclass(frozen=True)
class Thresholds:
    values: dict[str, float]  # threshold key -> value
    severities: dict[str, str]
    runbook_url_base: str
    dashboard_url_base: str


@lru_cache(maxsize=4)
def load_thresholds(path: Path = THRESHOLDS_FILE) -> Thresholds:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    checks = doc.get("checks", {})
    return Thresholds(
        values={k: float(v["value"]) for k, v in checks.items()},
        severities={k: str(v.get("severity", "warning")) for k, v in checks.items()},
        runbook_url_base=str(doc.get("runbook_url_base", "")),
        dashboard_url_base=str(doc.get("dashboard_url_base", "")),
    )


def runbook_url(alert: str, thresholds: Thresholds | None = None) -> str | None:
    check = CHECKS_BY_ALERT.get(alert)
    if check is None:
        return None
    return (thresholds or load_thresholds()).runbook_url_base + f"{check.alert}.md"


def dashboard_url(step: int, thresholds: Thresholds | None = None) -> str:
    """The diagnosis dashboard, scrolled to the step's row (Grafana's ``#<row title>`` anchor)."""
    row = next((s.dashboard_row for s in STEPS if s.number == step), "")
    base = (thresholds or load_thresholds()).dashboard_url_base
    return f"{base}{DASHBOARD_UID}?orgId=1#{quote(row)}"


def runbook_markdown(alert: str) -> str | None:
    """The runbook of a catalogue alert, or None when the alert or its file does not exist."""
    check = CHECKS_BY_ALERT.get(alert)
    if check is None:
        return None
    path = RUNBOOK_DIR / f"{check.alert}.md"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None
