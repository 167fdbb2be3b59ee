"""Where the console's data comes from and where its links point: environment names and defaults.

No Streamlit here. Links only point where something is known to answer: a Grafana link is shown
only when a Grafana URL is configured, and a runbook link opens the in-app runbook page unless a
runbook base URL is configured. Limits (thresholds, ``for``, severities) come from the exporter;
the threshold file named here is read only when no exporter answers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prefixscope import thresholds

PROMETHEUS_ENV = "PREFIXSCOPE_PROMETHEUS_URL"
EXPORTER_ENV = "PREFIXSCOPE_EXPORTER_URL"
ALERTMANAGER_ENV = "PREFIXSCOPE_ALERTMANAGER_URL"
GRAFANA_ENV = "PREFIXSCOPE_GRAFANA_URL"
RUNBOOK_BASE_ENV = "PREFIXSCOPE_RUNBOOK_URL_BASE"
TIMEZONE_ENV = "PREFIXSCOPE_CONSOLE_TZ"
THRESHOLDS_ENV = "PREFIXSCOPE_THRESHOLDS"
ANNOUNCE_ENV = "PREFIXSCOPE_CONSOLE_ANNOUNCE"  # a fleet's announcements file (the demo's storyline)
CLUSTER_ENV = "PREFIXSCOPE_CONSOLE_CLUSTER"
SCOPE_LABEL_ENV = "PREFIXSCOPE_CONSOLE_SCOPE_LABEL"
DEFAULT_EXPORTER_URL = "http://127.0.0.1:9400"
DEFAULT_SCOPE_LABEL = "cluster"  # the threshold file's default scope label (scope_labels)


@dataclass(frozen=True)
class ScopeSetting:
    """Which cluster the console shows when one Prometheus watches several: the scope label and its
    value (None: the only value Prometheus has)."""

    label: str
    value: str | None


def scope_setting(env: Mapping[str, str] | None = None) -> ScopeSetting:
    env = os.environ if env is None else env
    label = (env.get(SCOPE_LABEL_ENV) or "").strip() or DEFAULT_SCOPE_LABEL
    return ScopeSetting(label, (env.get(CLUSTER_ENV) or "").strip() or None)


@dataclass(frozen=True)
class LinkSettings:
    grafana_url: str | None  # Grafana's base URL (``http://grafana:3000``); None: no Grafana links
    runbook_url_base: str | None  # prefix of ``<Alert>.md``; None: the console's own runbook page


def link_settings(env: Mapping[str, str] | None = None) -> LinkSettings:
    env = os.environ if env is None else env
    grafana = (env.get(GRAFANA_ENV) or "").strip().rstrip("/") or None
    runbooks = (env.get(RUNBOOK_BASE_ENV) or "").strip() or None
    if runbooks is not None and not runbooks.endswith("/"):
        runbooks += "/"
    return LinkSettings(grafana, runbooks)


def timezone_name(env: Mapping[str, str] | None = None) -> str | None:
    """The IANA time zone charts use (``Europe/Berlin``); None: the console host's local zone."""
    env = os.environ if env is None else env
    return (env.get(TIMEZONE_ENV) or "").strip() or None


def thresholds_path(env: Mapping[str, str] | None = None) -> Path:
    """The threshold file the console reads when no exporter answers (the exporter reports the
    limits it runs with, which the console prefers); default: the packaged one."""
    env = os.environ if env is None else env
    raw = (env.get(THRESHOLDS_ENV) or "").strip()
    return Path(raw) if raw else thresholds.DEFAULT_PATH


def announce_path(env: Mapping[str, str] | None = None) -> Path | None:
    """The announcements file a running fleet writes (``prefixscope sim --announce``); None: none."""
    env = os.environ if env is None else env
    raw = (env.get(ANNOUNCE_ENV) or "").strip()
    return Path(raw) if raw else None
