"""PromQL built from templates: catalogue names as bases, whitelisted labels, escaped values.

Nothing a user types becomes PromQL syntax. A query base must be a catalogue metric (its
sample name, or a histogram's ``_bucket``/``_sum``/``_count``) or a recording-rule name; label
names must be catalogue label names; label values are escaped inside double quotes, so a value
such as ``x"} or vector(1) #`` stays one string and cannot change the query.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from prefixscope.catalog import CHECKS_BY_KEY, METRICS, RECORDING_RULES, Check

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


def _check(key: str) -> Check:
    try:
        return CHECKS_BY_KEY[key]
    except KeyError:
        raise UnsafeQuery(f"{key!r} is not a catalogue check") from None
