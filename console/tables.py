"""Rows of the API as a person reads them: titled columns, every cell through the units (pure).

One layer for every table the console shows: the headers are the titles of
:mod:`prefixscope.fields` (never snake_case), numbers read in their unit with SI prefixes and
never in scientific notation, moments relative to now and in the configured zone, and a
missing value is "—", never 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import tzinfo

from prefixscope.fields import field
from prefixscope.units import MISSING, format_duration, format_moment, format_reading


def cell(name: str, value: object, tz: tzinfo, now: float) -> str:
    """One value of field ``name`` as text."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or MISSING
    f = field(name)
    if not isinstance(value, int | float):
        return str(value) if str(value) else MISSING
    if f.kind == "moment":
        return format_moment(float(value), tz, now)
    if f.kind == "age":
        return f"{format_duration(float(value))} ago" if value >= 1 else "just now"
    if f.kind == "text":
        return str(value)
    return format_reading(float(value), f.unit)


def readable(rows: Iterable[Mapping[str, object]], tz: tzinfo, now: float,
             columns: Iterable[str] | None = None) -> list[dict[str, str]]:
    """``rows`` with titled headers and readable cells; ``columns`` picks and orders them."""
    out = []
    for row in rows:
        names = list(columns) if columns is not None else list(row)
        out.append({field(n).title: cell(n, row.get(n), tz, now) for n in names})
    return out


def title(name: str) -> str:
    return field(name).title
