"""Load and validate alerts/thresholds.yaml, the one place threshold values live.

Every problem is reported with the file and the dotted path of the entry, e.g.
``alerts/thresholds.yaml: checks.prefix_hit_rate_total.value: expected a number, got "high"``,
and all problems are collected before failing, so one run shows everything to fix. The shape
of the file is ``prefixscope/schemas/thresholds.v1.json``; the code adds what a schema cannot
know: every catalogue check has an entry, no entry lacks a check, each alert has a runbook.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from prefixscope.catalog import (
    BUDGET_REF,
    BURN_WINDOWS,
    CHECKS,
    DEFAULT_BASELINE_WINDOW,
    PROMPT_CLASSES,
    RECORDING_RULES,
    Check,
    rule_threshold_refs,
)
from prefixscope.durations import format_duration, is_duration, parse_duration
from prefixscope.validation import InvalidFile, Problems, read_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = REPO_ROOT / "alerts" / "thresholds.yaml"
RUNBOOKS_DIR = REPO_ROOT / "runbooks"
SCHEMA = "prefixscope.thresholds/v1"
SEVERITIES = ("critical", "warning", "info")

SCHEMA_FILE = "thresholds.v1.json"
# Fields of SLO entries only: the burn-rate factor of each pair of catalog.BURN_WINDOWS, and for an
# SLO whose events are judged against a baseline, the factor of that baseline.
SLO_FIELDS = ("burn_rates", "baseline_factor")
BURN_PAIRS = tuple(b.pair for b in BURN_WINDOWS)
DEFAULT_SCOPE_LABELS = ("cluster",)


class ConfigError(InvalidFile):
    """The threshold config is invalid; ``problems`` holds one line per bad entry."""


@dataclass(frozen=True)
class CheckThreshold:
    value: float
    for_: str
    severity: str
    # SLO entries only: tier (catalog.BURN_WINDOWS: page_1h, page_6h, ticket_1d, ticket_3d) -> factor; the baseline factor of an SLO
    # judged against a baseline.
    burn_rates: dict[str, float] | None = None
    baseline_factor: float | None = None
    # Hysteresis: a firing alert keeps firing this long after its condition clears (None: not at all).
    keep_firing_for: str | None = None
    # Entries a rule reads per prompt class (catalog.BUDGET_REF): prompt class -> budget.
    budgets: dict[str, float] | None = None

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
    # Labels that tell apart the clusters one Prometheus watches (catalog.scope_expr).
    scope_labels: tuple[str, ...] = DEFAULT_SCOPE_LABELS

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

    def values(self) -> dict[str, float]:
        """Every threshold value by key (what ``catalog.render_expr`` fills in)."""
        return {key: entry.value for key, entry in self.checks.items()}

    def budgets(self) -> dict[str, dict[str, float]]:
        """The per-prompt-class budgets by threshold key (what ``catalog.render_expr`` fills in)."""
        return {key: dict(entry.budgets) for key, entry in self.checks.items() if entry.budgets}

    def for_s(self, check: Check) -> float:
        return parse_duration(self.checks[check.threshold].for_)

    @property
    def severities(self) -> dict[str, str]:
        """Every entry's severity by threshold key (``diagnosis.context_checks`` reads it)."""
        return {key: entry.severity for key, entry in self.checks.items()}


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
    d: dict = data if isinstance(data, dict) else {}
    raw_checks = d.get("checks") if isinstance(d.get("checks"), dict) else {}
    window, baseline_window = d.get("window"), d.get("baseline_window")
    if baseline_window is None:  # the default day, or twice a window of a day or more
        long = is_duration(window) and parse_duration(window) >= parse_duration(DEFAULT_BASELINE_WINDOW)
        baseline_window = format_duration(2 * parse_duration(window)) if long else DEFAULT_BASELINE_WINDOW
    if is_duration(window) and is_duration(baseline_window) and \
            parse_duration(baseline_window) <= parse_duration(window):
        problems.add("baseline_window", f'expected a window longer than window ({window}), got "{baseline_window}"')
    rule_refs = rule_threshold_refs()
    by_threshold = {c.threshold: c for c in CHECKS}
    known = set(by_threshold) | set(rule_refs)
    for key in raw_checks:
        if key not in known:
            problems.add(f"checks.{key}", "unknown key: no check or recording rule in prefixscope/catalog.py uses this threshold")
    for key, record in rule_refs.items():
        if isinstance(d.get("checks"), dict) and key not in raw_checks:
            problems.add(f"checks.{key}", f"missing: the recording rule {record} needs it")
    burn: dict[str, dict[str, float] | None] = {}
    for key, entry in raw_checks.items():
        check = by_threshold.get(key)
        if check is None or not isinstance(entry, dict):
            continue
        burn[key] = _slo_fields(problems, f"checks.{key}", entry, check)
    for check in CHECKS:
        where = f"checks.{check.threshold}"
        if isinstance(d.get("checks"), dict) and check.threshold not in raw_checks:
            problems.add(where, f"missing: the catalogue check {check.key} ({check.alert}) needs it")
        if runbooks_dir is not None and not (runbooks_dir / f"{check.alert}.md").is_file():
            problems.add(where, f"runbook {_display(runbooks_dir / (check.alert + '.md'))} for {check.alert} is missing")
    budget_keys = {m[2] for r in RECORDING_RULES for m in BUDGET_REF.finditer(r.expr)}
    classes = {label for _bound, label in PROMPT_CLASSES}
    for key, entry in raw_checks.items():
        if not isinstance(entry, dict):
            continue
        if key in budget_keys and "budgets" not in entry:
            problems.add(f"checks.{key}.budgets", "missing: a budget per prompt class (" + ", ".join(sorted(classes)) + ")")
        elif key not in budget_keys and "budgets" in entry:
            problems.add(f"checks.{key}.budgets", "unknown key: no recording rule reads budgets of this entry")
        elif isinstance(entry.get("budgets"), dict):
            for label in sorted(set(entry["budgets"]) ^ classes):
                what = "missing" if label in classes else "unknown prompt class"
                problems.add(f"checks.{key}.budgets.{label}", what)
    problems.raise_if_any(ConfigError)
    checks = {key: CheckThreshold(float(e["value"]), e["for"], e["severity"], burn.get(key),
                                  float(e["baseline_factor"]) if e.get("baseline_factor") is not None else None,
                                  e.get("keep_firing_for"),
                                  {k: float(v) for k, v in e["budgets"].items()} if e.get("budgets") else None)
              for key, e in raw_checks.items()}
    scope = tuple(d["scope_labels"]) if "scope_labels" in d else DEFAULT_SCOPE_LABELS
    return Thresholds(window, float(d["cold_reuse_share"]), d["runbook_url_base"], d["dashboard_url_base"],
                      checks, baseline_window, scope)


def _slo_fields(problems: Problems, where: str, entry: dict, check: Check) -> dict[str, float] | None:
    """SLO entries carry a burn-rate factor per pair of catalog.BURN_WINDOWS (and, judged against a
    baseline, its factor); other entries carry neither."""
    slo = check.slo
    if slo is None:
        for fld in SLO_FIELDS:
            if fld in entry:
                problems.add(f"{where}.{fld}", "unknown key (burn_rates and baseline_factor belong to SLO entries)")
        return None
    objective = entry.get("value")
    if isinstance(objective, int | float) and not isinstance(objective, bool) and not 0 < objective < 1:
        problems.add(f"{where}.value", f"expected an SLO objective between 0 and 1, got {objective!r}")
    if slo.judged_against_baseline and "baseline_factor" not in entry:
        problems.add(f"{where}.baseline_factor", "missing")
    raw = entry.get("burn_rates")
    if raw is None:
        problems.add(f"{where}.burn_rates", "missing")
        return None
    if not isinstance(raw, dict):
        return None  # the schema said what is wrong
    out: dict[str, float] = {}
    for pair in BURN_PAIRS:
        factor = raw.get(pair)
        if pair not in raw:
            problems.add(f"{where}.burn_rates.{pair}", "missing")
        elif isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            continue  # the schema said what is wrong
        elif isinstance(objective, int | float) and 0 < objective < 1 and factor * (1 - objective) >= 1:
            problems.add(f"{where}.burn_rates.{pair}", f"unreachable: with an objective of {objective:g} the burn "
                                                       f"rate is at most {1 / (1 - objective):.3g}, got {factor!r}")
        else:
            out[pair] = float(factor)
    factors = [out[p] for p in BURN_PAIRS if p in out]
    if len(out) == len(BURN_PAIRS) and any(a <= b for a, b in pairwise(factors)):
        # a longer tier watches a slower burn: its factor is lower, or it would never fire first
        problems.add(f"{where}.burn_rates", "expected factors falling from tier to tier (" + ", ".join(BURN_PAIRS)
                     + "), got " + ", ".join(f"{p} {out[p]:g}" for p in BURN_PAIRS))
        return None
    return out if len(out) == len(BURN_PAIRS) else None


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
