"""Thresholds, runbook and dashboard links, and in-app runbooks, all looked up in the catalogue.

A runbook is read from the packaged ``runbooks/`` directory by the alert name the catalogue
declares; a user-supplied string is only ever a dictionary key here, never part of a path.

Links go only where something answers: runbook links open the console's own runbook page unless
a runbook base URL is configured, and Grafana links exist only when a Grafana URL is configured
(:mod:`console.settings`); the threshold file's URL bases are what the generated alert rules use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

import yaml

from console.settings import LinkSettings
from prefixscope import thresholds as alerts_config
from prefixscope.catalog import CHECKS_BY_ALERT, STEPS

REPO_ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS_FILE = alerts_config.DEFAULT_PATH
RUNBOOK_DIR = REPO_ROOT / "runbooks"
GENERATED_RULES = REPO_ROOT / "alerts" / "generated" / "prefixscope.rules.yaml"
# The generated Grafana dashboard with one row per diagnosis step (dashboards/diagnosis_chain).
DASHBOARD_UID = "prefixscope-diagnosis-chain"


@dataclass(frozen=True)
class Thresholds:
    values: dict[str, float]  # threshold key -> value
    severities: dict[str, str]
    runbook_url_base: str
    dashboard_url_base: str


@lru_cache(maxsize=4)
def load_thresholds(path: Path = THRESHOLDS_FILE) -> Thresholds:
    """The validated threshold file (prefixscope.thresholds), flattened to what the console shows."""
    th = alerts_config.load(path)
    return Thresholds(
        values={k: c.value for k, c in th.checks.items()},
        severities={k: c.severity for k, c in th.checks.items()},
        runbook_url_base=th.runbook_url_base,
        dashboard_url_base=th.dashboard_url_base,
    )


def runbook_url(alert: str, thresholds: Thresholds | None = None) -> str | None:
    check = CHECKS_BY_ALERT.get(alert)
    if check is None:
        return None
    return (thresholds or load_thresholds()).runbook_url_base + f"{check.alert}.md"


@lru_cache(maxsize=1)
def _generated_annotations() -> dict[str, dict]:
    """Alert name -> annotations of the generated rule file (it knows each alert's panel id)."""
    try:
        doc = yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {str(r["alert"]): dict(r.get("annotations") or {})
            for g in doc.get("groups") or [] for r in g.get("rules") or [] if "alert" in r}


def dashboard_url(alert: str, thresholds: Thresholds | None = None) -> str:
    """The alert's Grafana panel (as the generated rules link it), else its step's dashboard row."""
    url = _generated_annotations().get(alert, {}).get("dashboard_url")
    if url:
        return str(url)
    check = CHECKS_BY_ALERT.get(alert)
    row = next((s.dashboard_row for s in STEPS if check is not None and s.number == check.group), "")
    base = (thresholds or load_thresholds()).dashboard_url_base
    return f"{base}{DASHBOARD_UID}?orgId=1#{quote(row)}"


def in_app_runbook_url(alert: str) -> str:
    """The console's runbook page for the alert (relative: it works behind any host name)."""
    return f"./runbook?alert={quote(alert)}"


def runbook_link(alert: str, settings: LinkSettings) -> str | None:
    """Where a runbook link goes: the configured base URL, else the in-app runbook page."""
    check = CHECKS_BY_ALERT.get(alert)
    if check is None:
        return None
    if settings.runbook_url_base:
        return f"{settings.runbook_url_base}{check.alert}.md"
    return in_app_runbook_url(check.alert)


def grafana_link(alert: str, settings: LinkSettings, thresholds: Thresholds | None = None) -> str | None:
    """The alert's Grafana panel on the configured Grafana, or None when none is configured.

    The generated rules point at the threshold file's ``dashboard_url_base`` (``…/d/``); the
    same dashboard path is served from the configured Grafana instead.
    """
    if not settings.grafana_url or alert not in CHECKS_BY_ALERT:
        return None
    url = dashboard_url(alert, thresholds)
    base = (thresholds or load_thresholds()).dashboard_url_base
    path = url[len(base):] if url.startswith(base) else url.split("/d/", 1)[-1]
    return f"{settings.grafana_url}/d/{path}"


_MD_LINK = re.compile(r"\]\(([A-Za-z][A-Za-z0-9-]*)\.md\)")


def in_app_markdown(text: str) -> str:
    """A runbook's links to sibling files, pointed at console pages so they work in the app.

    ``[X](PrefixFoo.md)`` opens that alert's runbook page; ``(diagnosis-chain.md)`` opens the
    Diagnosis chain page, which walks the same steps live. Other links are left alone.
    """
    def target(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in CHECKS_BY_ALERT:
            return f"]({in_app_runbook_url(name)})"
        if name == "diagnosis-chain":
            return "](./diagnosis)"
        return m.group(0)
    return _MD_LINK.sub(target, text)


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
