"""PromQL built from templates: catalogue names as bases, whitelisted labels, escaped values.

Nothing a user types becomes PromQL syntax. A query base must be a catalogue metric (its
sample name, or a histogram's ``_bucket``/``_sum``/``_count``) or a recording-rule name; label
names must be catalogue label names; label values are escaped inside double quotes, so a value
such as ``x"} or vector(1) #`` stays one string and cannot change the query.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from prefixscope.catalog import (
    CHECKS_BY_KEY,
    METRICS,
    RECORDING_RULES,
    RULES_BY_NAME,
    THRESHOLD_REF,
    Check,
    add_matchers,
    render_expr,
    scope_expr,
)
from prefixscope.diagnosis import SETTLE_S, SETTLE_WINDOW

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _query_bases() -> frozenset[str]:
    names: set[str] = {r.record for r in RECORDING_RULES}
    for m in METRICS:
        names.add(m.sample_name)
        if m.type in ("histogram", "gaugehistogram"):
            names.update(m.name + s for s in _HISTOGRAM_SUFFIXES)
    return frozenset(names)


QUERY_BASES: frozenset[str] = _query_bases()
LABEL_NAMES: frozenset[str] = frozenset(label for m in METRICS for label in m.labels)
_RANGE = re.compile(r"^[1-9][0-9]{0,3}[smhd]$")


class UnsafeQuery(ValueError):
    """A query part that is not in the catalogue or the label whitelist."""


def escape_label_value(value: str) -> str:
    """Escape a value for use inside a double-quoted PromQL label matcher."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(base: str, matchers: Mapping[str, str] | None = None) -> str:
    """``base{label="value", ...}`` with equality matchers only, labels sorted for stable text."""
    if base not in QUERY_BASES:
        raise UnsafeQuery(f"{base!r} is not a catalogue metric or recording rule")
    parts = []
    for name in sorted(matchers or {}):
        if name not in LABEL_NAMES:
            raise UnsafeQuery(f"label {name!r} is not a catalogue label")
        parts.append(f'{name}="{escape_label_value(str((matchers or {})[name]))}"')
    return f"{base}{{{', '.join(parts)}}}" if parts else base


def rate_per_minute_by(base: str, by: str, window: str = "5m",
                       matchers: Mapping[str, str] | None = None) -> str:
    """``sum by (label) (rate(counter[window])) * 60`` for a catalogue counter."""
    if by not in LABEL_NAMES:
        raise UnsafeQuery(f"label {by!r} is not a catalogue label")
    if not _RANGE.match(window):
        raise UnsafeQuery(f"window {window!r} is not a duration")
    return f"sum by ({by}) (rate({selector(base, matchers)}[{window}])) * 60"


def by_label(base: str, by: str, matchers: Mapping[str, str] | None = None) -> str:
    """``sum by (label) (series)`` for a catalogue gauge or recording rule."""
    if by not in LABEL_NAMES:
        raise UnsafeQuery(f"label {by!r} is not a catalogue label")
    return f"sum by ({by}) ({selector(base, matchers)})"


def check_value(key: str) -> str:
    """The key number of a check: its catalogue value expression (trusted, never user text)."""
    return _check(key).value


def check_baseline(key: str) -> str | None:
    """The baseline expression of a relative check (``p99 > 3 × baseline``), or None."""
    return _check(key).baseline


def signal_available() -> str:
    return selector("prefixscope_signal_available")


_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class Scope:
    """The one cluster (or router domain) the console shows: its scope label and value.
    ``value`` None: no such label on the series (a Prometheus watching one cluster)."""

    label: str = "cluster"
    value: str | None = None

    def __post_init__(self) -> None:
        if not _LABEL_NAME.match(self.label):
            raise UnsafeQuery(f"{self.label!r} is not a label name")

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a series or alert with ``labels`` belongs to this scope."""
        return self.value is None or labels.get(self.label, "") == self.value


def scoped(expr: str, scope: Scope | None) -> str:
    """``expr`` as the console runs it against a Prometheus watching several clusters: every
    aggregation keeps the scope label (as the rules do) and every prefixscope series and rule
    selects the chosen value, escaped (a value never changes the query's shape)."""
    if scope is None:
        return expr
    expr = scope_expr(expr, (scope.label,))
    if scope.value is None:
        return expr
    return add_matchers(expr, f'{scope.label}="{escape_label_value(scope.value)}"')


def scope_values(label: str) -> str:
    """The values of a scope label among the exporters Prometheus scrapes."""
    if not _LABEL_NAME.match(label):
        raise UnsafeQuery(f"{label!r} is not a label name")
    return f"count by ({label}) ({selector('prefixscope_exporter_build_info')})"


def _check(key: str) -> Check:
    try:
        return CHECKS_BY_KEY[key]
    except KeyError:
        raise UnsafeQuery(f"{key!r} is not a catalogue check") from None



_NAME = re.compile(r"[A-Za-z_:][\w:]*")
_LONG_RANGE = "[5m]"  # the catalogue's window in rate()/increase() ranges


def _expanded(expr: str, limits: Mapping[str, float]) -> str:
    """``expr`` with every recording-rule name replaced by its expression (recursively), its
    ``threshold(key)`` filled from ``limits`` (threshold key → value) as the rule file is generated;
    a rule that reads a limit not given stays its recorded self."""
    def spell(m: re.Match[str]) -> str:
        rule = RULES_BY_NAME.get(m[0])
        if rule is None or any(k not in limits for k in THRESHOLD_REF.findall(rule.expr)):
            return m[0]
        return f"({_expanded(render_expr(rule.expr, limits), limits)})"
    return _NAME.sub(spell, expr)


def short_window_value(key: str, limits: Mapping[str, float], window: str = SETTLE_WINDOW) -> str:
    """A check's value over the last ``window`` instead of five minutes: its expression with the
    recording rules it reads spelled out and their 5-minute ranges narrowed (gauges are the same).
    ``limits``: threshold key → value, for the rules that compare with one."""
    check = _check(key)
    value = _expanded(check.value, limits).replace(_LONG_RANGE, f"[{window}]")
    if check.baseline:
        return f"({value}) / ({check.baseline})"
    return value


def settle_extreme(key: str, limits: Mapping[str, float], settle_s: float = SETTLE_S, step_s: int = 5) -> str:
    """The worst short-window value of the check over the last ``settle_s`` (the highest for a
    check that fires above its limit, the lowest for one that fires below): within the limit means
    the check has settled (prefixscope.diagnosis)."""
    over = "max_over_time" if _check(key).op == ">" else "min_over_time"
    return f"{over}(({short_window_value(key, limits)})[{int(settle_s)}s:{step_s}s])"
