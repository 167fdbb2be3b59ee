"""Durations, one grammar for every file and flag: Prometheus's.

A duration is one or more ``<integer><unit>`` pairs, units from largest to smallest, each at
most once: ``500ms``, ``30s``, ``5m``, ``1h30m``, ``1d``, ``2w``, ``1y`` (``y`` = 365 days,
``w`` = 7 days, as Prometheus counts them). The threshold file, the exporter's config, the
scenario files and the generated rules all read durations through :func:`parse_duration`,
so a value one of them accepts the others accept too. Configs that hold a plain number of
seconds (``scrape_interval: 2.5``) pass it through :func:`seconds`.
"""

from __future__ import annotations

import re

UNITS: tuple[tuple[str, float], ...] = (
    ("y", 365 * 86400.0), ("w", 7 * 86400.0), ("d", 86400.0), ("h", 3600.0),
    ("m", 60.0), ("s", 1.0), ("ms", 0.001),
)
_SECONDS = dict(UNITS)
_PAIR = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")
_WHOLE = re.compile(r"^(?:\d+(?:ms|y|w|d|h|m|s))+$")


class DurationError(ValueError):
    """Not a Prometheus duration; the message says what is accepted."""


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration string (``1h30m`` → 5400.0)."""
    if not isinstance(text, str) or not _WHOLE.match(text):
        raise DurationError(f"not a duration: {_show(text)} (use e.g. 500ms, 30s, 5m, 1h30m, 1d)")
    order = [u for u, _ in UNITS]
    last = -1
    total = 0.0
    for number, unit in _PAIR.findall(text):
        at = order.index(unit)
        if at <= last:
            raise DurationError(f"not a duration: {_show(text)} (units go from largest to smallest, each once)")
        last = at
        total += int(number) * _SECONDS[unit]
    return total


def _show(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def is_duration(text: object) -> bool:
    try:
        parse_duration(text)  # type: ignore[arg-type]
    except DurationError:
        return False
    return True


def seconds(value: object, *, positive: bool = True) -> float:
    """Seconds from a number of seconds or a duration string; for config fields and flags."""
    if isinstance(value, bool):
        raise DurationError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value)
        except ValueError:
            out = parse_duration(value.strip())
    else:
        raise DurationError(f"not a duration: {value!r}")
    if out != out or out in (float("inf"), float("-inf")):
        raise DurationError(f"not a duration: {value!r}")
    if positive and out <= 0:
        raise DurationError(f"must be positive: {value!r}")
    return out


def format_duration(value: float) -> str:
    """The shortest Prometheus duration for a whole number of milliseconds (5400 → ``1h30m``)."""
    ms = round(value * 1000)
    if ms <= 0:
        return "0s"
    out = []
    for unit, size in UNITS:
        n, ms = divmod(ms, round(size * 1000))
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
