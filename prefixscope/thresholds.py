"""Load and validate alerts/thresholds.yaml, the one place threshold values live.

Every problem is reported with the file and the dotted path of the entry, e.g.
``alerts/thresholds.yaml: checks.prefix_hit_rate_total.value: expected a number, got "high"``,
and all problems are collected before failing, so one run shows everything to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefixscope.catalog import BURN_WINDOWS, CHECKS, Check
from prefixscope.durations import is_duration, parse_duration

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = REPO_ROOT / "alerts" / "thresholds.yaml"
RUNBOOKS_DIR = REPO_ROOT / "runbooks"
SCHEMA = "prefixscope.thresholds/v1"
SEVERITIES = ("critical", "warning", "info")

TOP_LEVEL = ("schema", "window", "baseline_window", "cold_reuse_share", "runbook_url_base", "dashboard_url_base",
             "checks")
CHECK_FIELDS = ("value", "for", "severity")
# Fields of SLO entries only: the burn-rate factor of each pair of catalog.BURN_WINDOWS, and for an
# SLO whose events are judged against a baseline, the factor of that baseline.
SLO_FIELDS = ("burn_rates", "baseline_factor")
BURN_PAIRS = tuple(b.pair for b in BURN_WINDOWS)


class ConfigError(ValueError):
    """The threshold config is invalid; ``problems`` holds one line per bad entry."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class CheckThreshold:
    value: float
    for_: str
    severity: str
    # SLO entries only: pair ("page", "ticket") -> burn-rate factor; the baseline factor of an SLO
    # judged against a baseline.
    burn_rates: dict[str, float] | None = None
    baseline_factor: float | None = None

    def burn_limit(self, pair: str) -> float:
        """The error ratio a burn-rate pair fires above: factor × the error budget (1 − objective)."""
        assert self.burn_rates is not None
        return round(self.burn_rates[pair] * (1.0 - self.value), 9)


@dataclass(frozen=True)
class Thresholds:
    window: str
    cold_reuse_share: float
    runbook_url_base: str
    dashboard_url_base: str
    checks: dict[str, CheckThreshold]
    baseline_window: str = "1d"

    def runbook_url(self, alert: str) -> str:
        return f"{self.runbook_url_base}{alert}.md"

    @property
    def window_s(self) -> float:
        """The rate window in seconds (the exporter's windows and every generated rule)."""
        return parse_duration(self.window)

    @property
    def baseline_window_s(self) -> float:
        """The long window of the cold-prefill baselines, in seconds."""
        return parse_duration(self.baseline_window)

    def value(self, check: Check) -> float:
        return self.checks[check.threshold].value

    def for_s(self, check: Check) -> float:
        return parse_duration(self.checks[check.threshold].for_)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"


def _number(value: Any) -> bool:
    # bool is an int in Python, but `value: true` is a typo, not a threshold.
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse(data: Any, source: str = "alerts/thresholds.yaml", runbooks_dir: Path | None = None) -> Thresholds:
    """Validate parsed YAML; with ``runbooks_dir``, also require ``<Alert>.md`` for every check."""
    problems: list[str] = []

    def bad(where: str, msg: str) -> None:
        problems.append(f"{source}: {where}: {msg}")

    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level, got {_got(data)}"])
    for key in data:
        if key not in TOP_LEVEL:
            bad(str(key), f"unknown key (allowed: {', '.join(TOP_LEVEL)})")
    for key in TOP_LEVEL:
        if key not in data:
            bad(key, "missing")
    if "schema" in data and data["schema"] != SCHEMA:
        bad("schema", f"expected {SCHEMA}, got {_got(data['schema'])}")
    window = data.get("window")
    if "window" in data and not is_duration(window):
        bad("window", f"expected a duration like 5m or 1h30m, got {_got(window)}")
    baseline_window = data.get("baseline_window")
    if "baseline_window" in data and not is_duration(baseline_window):
        bad("baseline_window", f"expected a duration like 1d, got {_got(baseline_window)}")
    elif is_duration(window) and is_duration(baseline_window) and \
            parse_duration(baseline_window) <= parse_duration(window):
        bad("baseline_window", f"expected a window longer than window ({window}), got {_got(baseline_window)}")
    share = data.get("cold_reuse_share")
    if "cold_reuse_share" in data and not (_number(share) and 0 <= share <= 1):
        bad("cold_reuse_share", f"expected a number between 0 and 1, got {_got(share)}")
    for key in ("runbook_url_base", "dashboard_url_base"):
        if key in data and not (isinstance(data[key], str) and data[key].endswith("/")):
            bad(key, f"expected a URL ending in /, got {_got(data[key])}")

    checks: dict[str, CheckThreshold] = {}
    raw_checks = data.get("checks")
    if "checks" in data and not isinstance(raw_checks, dict):
        bad("checks", f"expected a mapping of threshold entries, got {_got(raw_checks)}")
        raw_checks = {}
    raw_checks = raw_checks or {}
    known = {c.threshold: c for c in CHECKS}
    for key, entry in raw_checks.items():
        where = f"checks.{key}"
        if key not in known:
            bad(where, "unknown key: no check in prefixscope/catalog.py uses this threshold")
            continue
        if not isinstance(entry, dict):
            bad(where, f"expected a mapping with {', '.join(CHECK_FIELDS)}, got {_got(entry)}")
            continue
        slo = known[key].slo
        required = CHECK_FIELDS
        if slo is not None:
            required += ("burn_rates",) + (("baseline_factor",) if slo.judged_against_baseline else ())
        before = len(problems)
        for field in entry:
            if field not in required:
                hint = " (burn_rates and baseline_factor belong to SLO entries)" if field in SLO_FIELDS else ""
                bad(f"{where}.{field}", f"unknown key (allowed: {', '.join(required)}){hint}")
        for field in required:
            if field not in entry:
                bad(f"{where}.{field}", "missing")
        burn = _burn_rates(entry.get("burn_rates"), f"{where}.burn_rates", entry.get("value"), bad) \
            if slo is not None and "burn_rates" in entry else None
        factor = entry.get("baseline_factor")
        if "baseline_factor" in required and "baseline_factor" in entry and not (_number(factor) and factor > 0):
            bad(f"{where}.baseline_factor", f"expected a number above 0, got {_got(factor)}")
        value, for_, severity = entry.get("value"), entry.get("for"), entry.get("severity")
        if "value" in entry and not _number(value):
            bad(f"{where}.value", f"expected a number, got {_got(value)}")
        if "for" in entry and not (is_duration(for_)):
            bad(f"{where}.for", f"expected a duration like 5m, got {_got(for_)}")
        if "severity" in entry and severity not in SEVERITIES:
            bad(f"{where}.severity", f"expected one of {', '.join(SEVERITIES)}, got {_got(severity)}")
        if slo is not None and "value" in entry and _number(value) and not 0 < value < 1:
            bad(f"{where}.value", f"expected an SLO objective between 0 and 1, got {_got(value)}")
        if len(problems) == before:
            checks[key] = CheckThreshold(float(value), for_, severity, burn,
                                         float(factor) if slo is not None and slo.judged_against_baseline else None)
    for check in CHECKS:
        if check.threshold not in raw_checks:
            bad(f"checks.{check.threshold}", f"missing: the catalogue check {check.key} ({check.alert}) needs it")
        if runbooks_dir is not None and not (runbooks_dir / f"{check.alert}.md").is_file():
            bad(f"checks.{check.threshold}", f"runbook {_display(runbooks_dir / (check.alert + '.md'))} for {check.alert} is missing")
    if problems:
        raise ConfigError(problems)
    return Thresholds(window, float(share), data["runbook_url_base"], data["dashboard_url_base"], checks,
                      baseline_window)


def _burn_rates(raw: Any, where: str, objective: Any, bad: Any) -> dict[str, float] | None:
    """``{page: F, ticket: F}``: a factor per pair, each reachable (below 1 / budget: a burn rate
    cannot exceed it, since the error ratio is at most 1), the page's above the ticket's."""
    if not isinstance(raw, dict):
        bad(where, f"expected a mapping of {', '.join(BURN_PAIRS)} to burn-rate factors, got {_got(raw)}")
        return None
    out: dict[str, float] = {}
    for pair in raw:
        if pair not in BURN_PAIRS:
            bad(f"{where}.{pair}", f"unknown key (allowed: {', '.join(BURN_PAIRS)})")
    for pair in BURN_PAIRS:
        factor = raw.get(pair)
        if pair not in raw:
            bad(f"{where}.{pair}", "missing")
        elif not (_number(factor) and factor > 0):
            bad(f"{where}.{pair}", f"expected a number above 0, got {_got(factor)}")
        elif _number(objective) and 0 < objective < 1 and factor * (1 - objective) >= 1:
            bad(f"{where}.{pair}", f"unreachable: with an objective of {objective:g} the burn rate is at most "
                                   f"{1 / (1 - objective):.3g}, got {_got(factor)}")
        else:
            out[pair] = float(factor)
    if len(out) == len(BURN_PAIRS) and not out["page"] > out["ticket"]:
        bad(where, f"expected the page factor above the ticket factor, got page {out['page']:g}, ticket {out['ticket']:g}")
        return None
    return out if len(out) == len(BURN_PAIRS) else None


def load(path: Path = DEFAULT_PATH, runbooks_dir: Path | None = None) -> Thresholds:
    """Read and validate the threshold file (see :func:`parse`)."""
    source = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: not valid YAML: {exc}"]) from exc
    return parse(data, source, runbooks_dir)


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Read and validate the threshold file (alerts/thresholds.yaml by default)."""
    return load(Path(path) if path is not None else DEFAULT_PATH)


def window_seconds(thresholds: Thresholds) -> float:
    return thresholds.window_s


def threshold_value(thresholds: Thresholds, check: Check) -> float:
    return thresholds.value(check)
