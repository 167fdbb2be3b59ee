"""Load and validate alerts/thresholds.yaml, the one place threshold values live.

Every problem is reported with the file and the dotted path of the entry, e.g.
``alerts/thresholds.yaml: checks.prefix_hit_rate_total.value: expected a number, got "high"``,
and all problems are collected before failing, so one run shows everything to fix. The shape
of the file is ``prefixscope/schemas/thresholds.v1.json``; the code adds what a schema cannot
know: every catalogue check has an entry, no entry lacks a check, each alert has a runbook.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixscope.catalog import CHECKS, Check, rule_threshold_refs
from prefixscope.durations import parse_duration
from prefixscope.validation import InvalidFile, Problems, read_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = REPO_ROOT / "alerts" / "thresholds.yaml"
RUNBOOKS_DIR = REPO_ROOT / "runbooks"
SCHEMA = "prefixscope.thresholds/v1"
SEVERITIES = ("critical", "warning", "info")

SCHEMA_FILE = "thresholds.v1.json"


class ConfigError(InvalidFile):
    """The threshold config is invalid; ``problems`` holds one line per bad entry."""


@dataclass(frozen=True)
class CheckThreshold:
    value: float
    for_: str
    severity: str


@dataclass(frozen=True)
class Thresholds:
    window: str
    cold_reuse_share: float
    runbook_url_base: str
    dashboard_url_base: str
    checks: dict[str, CheckThreshold]

    def runbook_url(self, alert: str) -> str:
        return f"{self.runbook_url_base}{alert}.md"

    @property
    def window_s(self) -> float:
        """The rate window in seconds (the exporter's windows and every generated rule)."""
        return parse_duration(self.window)

    def value(self, check: Check) -> float:
        return self.checks[check.threshold].value

    def values(self) -> dict[str, float]:
        """Every threshold value by key (what ``catalog.render_expr`` fills in)."""
        return {key: entry.value for key, entry in self.checks.items()}

    def for_s(self, check: Check) -> float:
        return parse_duration(self.checks[check.threshold].for_)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def parse(data: Any, source: str = "alerts/thresholds.yaml", runbooks_dir: Path | None = None) -> Thresholds:
    """Validate parsed YAML against ``schemas/thresholds.v1.json`` and the catalogue; with
    ``runbooks_dir``, also require ``<Alert>.md`` for every check."""
    problems = Problems(source)
    problems.check_schema(data, SCHEMA_FILE)
    raw_checks = data.get("checks") if isinstance(data, dict) else None
    raw_checks = raw_checks if isinstance(raw_checks, dict) else {}
    rule_refs = rule_threshold_refs()
    known = {c.threshold for c in CHECKS} | set(rule_refs)
    for key in raw_checks:
        if key not in known:
            problems.add(f"checks.{key}", "unknown key: no check or recording rule in prefixscope/catalog.py uses this threshold")
    for key, record in rule_refs.items():
        if isinstance(data, dict) and isinstance(data.get("checks"), dict) and key not in raw_checks:
            problems.add(f"checks.{key}", f"missing: the recording rule {record} needs it")
    for check in CHECKS:
        where = f"checks.{check.threshold}"
        if isinstance(data, dict) and isinstance(data.get("checks"), dict) and check.threshold not in raw_checks:
            problems.add(where, f"missing: the catalogue check {check.key} ({check.alert}) needs it")
        if runbooks_dir is not None and not (runbooks_dir / f"{check.alert}.md").is_file():
            problems.add(where, f"runbook {_display(runbooks_dir / (check.alert + '.md'))} for {check.alert} is missing")
    problems.raise_if_any(ConfigError)
    checks = {key: CheckThreshold(float(e["value"]), e["for"], e["severity"]) for key, e in raw_checks.items()}
    return Thresholds(data["window"], float(data["cold_reuse_share"]), data["runbook_url_base"],
                      data["dashboard_url_base"], checks)


def load(path: Path = DEFAULT_PATH, runbooks_dir: Path | None = None) -> Thresholds:
    """Read and validate the threshold file (see :func:`parse`)."""
    source = _display(path)
    return parse(read_yaml(path, source, ConfigError), source, runbooks_dir)


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Read and validate the threshold file (alerts/thresholds.yaml by default)."""
    return load(Path(path) if path is not None else DEFAULT_PATH)


def window_seconds(thresholds: Thresholds) -> float:
    return thresholds.window_s


def threshold_value(thresholds: Thresholds, check: Check) -> float:
    return thresholds.value(check)
