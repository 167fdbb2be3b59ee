"""Runbook and dashboard links, and in-app runbooks, all looked up in the catalogue.

A runbook is read from the packaged ``runbooks/`` directory by the alert name the catalogue
declares; a user-supplied string is only ever a dictionary key here, never part of a path.

Links go only where something answers: runbook links open the console's own runbook page unless
a runbook base URL is configured, and Grafana links exist only when a Grafana URL is configured
(:mod:`console.settings`). Limits are not here: they arrive with the exporter's answer
(:mod:`console.limits`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

import yaml

from console.settings import LinkSettings
from prefixscope.catalog import CHECKS_BY_ALERT, STEPS

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNBOOK_DIR = REPO_ROOT / "runbooks"
GENERATED_RULES = REPO_ROOT / "alerts" / "generated" / "prefixscope.rules.yaml"
# The generated Grafana dashboard with one row per diagnosis step (dashboards/diagnosis_chain).
DASHBOARD_UID = "prefixscope-diagnosis-chain"


@lru_cache(maxsize=1)
def _generated_annotations() -> dict[str, dict]:
    """Alert name -> annotations of the generated rule file (it knows each alert's panel id)."""
    try:
        doc = yaml.safe_load(GENERATED_RULES.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {str(r["alert"]): dict(r.get("annotations") or {})
            for g in doc.get("groups") or [] for r in g.get("rules") or [] if "alert" in r}


def dashboard_path(alert: str) -> str:
    """The alert's Grafana panel below ``/d/`` (as the generated rules link it), else its step's
    dashboard row; the Grafana it lives on is the console's setting."""
    url = _generated_annotations().get(alert, {}).get("dashboard_url")
    if url and "/d/" in str(url):
        return str(url).split("/d/", 1)[1]
    check = CHECKS_BY_ALERT.get(alert)
    row = next((s.dashboard_row for s in STEPS if check is not None and s.number == check.group), "")
    return f"{DASHBOARD_UID}?orgId=1#{quote(row)}"


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


def grafana_link(alert: str, settings: LinkSettings) -> str | None:
    """The alert's Grafana panel on the configured Grafana, or None when none is configured.

    The generated rules point at the threshold file's ``dashboard_url_base`` (``…/d/``); the
    same dashboard path is served from the configured Grafana instead.
    """
    if not settings.grafana_url or alert not in CHECKS_BY_ALERT:
        return None
    return f"{settings.grafana_url}/d/{dashboard_path(alert)}"


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
