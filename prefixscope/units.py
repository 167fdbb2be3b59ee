"""Values for people: the one place that knows how each value reads.

Two readings of one unit, from one table (``_FORMATS``):

- a *setting* — a threshold as configured — is printed exactly (``0.85`` reads ``85%``,
  ``0.005`` seconds ``5 ms``), so the person sees the number they wrote; alert summaries,
  descriptions, docs and dashboards use it (through :mod:`prefixscope.wording`);
- a *reading* — a measured value — is rounded for a glance: three significant digits, an SI
  prefix past a thousand (``67.5 k tokens``), ratios as percentages (``84.7%``), short times in
  ms or µs and long ones as people say them (``1 m 40 s``), ``$0.0123``; the console uses it.

Neither ever prints scientific notation. A missing reading is "—", never 0. Unknown units
print the bare number (SI-prefixed when read). Moments read relative to now (``3 m ago``) and
in a named time zone to the second (``14:03:27 CEST``), never to the nanosecond.

The second half of the module ports Prometheus's template functions (Prometheus 2.x
``template.go``): alert descriptions carry the live value through them, and the generated
promtool tests predict the rendered annotations with these ports (promtool then checks the
prediction against the real implementation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, tzinfo
from decimal import Decimal

MISSING = "—"
_SI = ("", "k", "M", "G", "T", "P", "E")


def exact_number(v: float) -> str:
    """A number as configured, every digit and never in scientific notation (``0.00001``)."""
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if float(v).is_integer():
        return f"{int(v)}"
    text = format(Decimal(repr(float(v))).normalize(), "f")
    return text


def significant(v: float, digits: int = 3) -> str:
    """``v`` to ``digits`` significant digits in fixed notation, trailing zeros dropped:
    ``0.00996``, ``12.5``, ``1000`` — never ``9.97e-03``."""
    if v == 0 or math.isnan(v) or math.isinf(v):
        return "0" if v == 0 else str(v)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    text = f"{v:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def format_number(v: float, digits: int = 3) -> str:
    """A count or amount with an SI prefix past a thousand: ``67.5 k``, ``1.2 M``, ``345``, ``0.25``."""
    if math.isnan(v) or math.isinf(v):
        return str(v)
    scaled, i = v, 0
    while abs(scaled) >= 999.5 and i < len(_SI) - 1:
        scaled, i = scaled / 1000, i + 1
    shown = significant(scaled, digits)
    return f"{shown} {_SI[i]}" if i else shown


def _counted(v: float, unit: str) -> str:
    shown = format_number(v)
    return f"{shown} {unit[:-1] if shown == '1' and unit.endswith('s') else unit}"


def _percent(v: float) -> str:
    pct = v * 100
    if pct != 0 and abs(pct) < 0.1:
        return f"{significant(pct, 2)}%"
    return f"{pct:.1f}%"


def _seconds_reading(v: float) -> str:
    if v != 0 and abs(v) < 1e-3:
        return f"{significant(v * 1e6)} µs"
    if abs(v) < 1:
        return f"{significant(v * 1000)} ms"
    if abs(v) < 10:
        return f"{significant(v)} s"
    return format_duration(v)


def _seconds_setting(v: float) -> str:
    if abs(v) < 1:
        return f"{exact_number(round(v * 1000, 9))} ms"
    return f"{exact_number(v)} s"


def _usd(v: float) -> str:
    if abs(v) < 1:
        return f"${significant(v)}"
    if abs(v) < 1000:
        return f"${v:,.2f}"
    return f"${format_number(v)}"


# unit -> (as a setting, as a reading)
_FORMATS: dict[str, tuple[Callable[[float], str], Callable[[float], str]]] = {
    "ratio": (lambda v: f"{exact_number(round(v * 100, 9))}%", _percent),
    "ratio_to_baseline": (lambda v: f"{exact_number(v)} ×", lambda v: f"{significant(v)}× baseline"),
    "ratio_to_budget": (lambda v: f"{exact_number(v)} ×", lambda v: f"{significant(v)}× budget"),
    "ratio_to_peers": (lambda v: f"{exact_number(v)} ×", lambda v: f"{significant(v)}×"),
    "seconds": (_seconds_setting, _seconds_reading),
    "usd": (lambda v: f"{exact_number(v)} USD", _usd),
    "per_minute": (lambda v: f"{exact_number(v)} per minute", lambda v: f"{format_number(v)}/min"),
    "per_second": (lambda v: f"{exact_number(v)} per second", lambda v: f"{format_number(v)}/s"),
    "tokens": (lambda v: f"{exact_number(v)} tokens", lambda v: _counted(v, "tokens")),
    "blocks": (lambda v: f"{exact_number(v)} blocks", lambda v: _counted(v, "blocks")),
    "batches": (lambda v: f"{exact_number(v)} batches", lambda v: _counted(v, "batches")),
    "repairs": (lambda v: f"{exact_number(v)} repairs", lambda v: _counted(v, "repairs")),
    "events": (lambda v: f"{exact_number(v)} events", lambda v: _counted(v, "events")),
    "targets": (lambda v: f"{exact_number(v)} targets", lambda v: _counted(v, "targets")),
    "sessions": (lambda v: f"{exact_number(v)} sessions", lambda v: _counted(v, "sessions")),
    "workers": (lambda v: f"{exact_number(v)} workers", lambda v: _counted(v, "workers")),
    "shards": (lambda v: f"{exact_number(v)} shards", lambda v: _counted(v, "shards")),
    # depth (prefix-tree edges) and unitless counts read as bare numbers
    "depth": (exact_number, significant),
}


def format_setting(value: float, unit: str) -> str:
    """A configured value (a threshold) in its unit, exactly as configured."""
    return _FORMATS.get(unit, (exact_number, format_number))[0](value)


def format_reading(value: float | None, unit: str) -> str:
    """A measured value in its unit, rounded for reading; a missing value is "—" (never 0)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return _FORMATS.get(unit, (exact_number, format_number))[1](value)


_SPANS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def format_duration(seconds: float | None, parts: int = 2) -> str:
    """A span of time as a person says it: ``1 m 40 s``, ``2 h 5 m``, ``45 s``, ``350 ms``.

    At most ``parts`` units, the largest first, rounded to the last one shown; below a second,
    milliseconds. Missing is "—"; a negative span reads with a minus sign.
    """
    if seconds is None or math.isnan(seconds):
        return MISSING
    if math.isinf(seconds):
        return "forever" if seconds > 0 else "-forever"
    sign, v = ("-" if seconds < 0 else ""), abs(seconds)
    if 0 < v < 0.9995:
        return f"{sign}{v * 1000:.0f} ms"
    total = round(v)
    for _ in range(2):  # rounding to the last unit shown can carry into a larger one (59.6 s → 1 m)
        top = next(i for i, (_, size) in enumerate(_SPANS) if total >= size or size == 1)
        step = _SPANS[min(top + parts - 1, len(_SPANS) - 1)][1]
        total = round(v / step) * step
    out = []
    for name, size in _SPANS[top:]:
        n, total = divmod(total, size)
        if n:
            out.append(f"{n} {name}")
        if size == step:
            break
    return sign + (" ".join(out) or "0 s")


# ---- moments --------------------------------------------------------------------------------


def format_ago(at: float | None, now: float) -> str:
    """How long ago a moment was, as people say it: ``3 m ago``, ``just now``, ``in 5 s``."""
    if at is None or math.isnan(at):
        return MISSING
    delta = now - at
    if abs(delta) < 1:
        return "just now"
    return f"{format_duration(delta, parts=1 if abs(delta) >= 3600 else 2)} ago" if delta > 0 else \
        f"in {format_duration(-delta)}"


def zone_label(tz: tzinfo, at: float) -> str:
    """``UTC+02:00 CEST`` style: the offset always, the abbreviation when it says something."""
    moment = datetime.fromtimestamp(at, tz)
    offset = moment.strftime("%z")
    text = f"UTC{offset[:3]}:{offset[3:]}" if offset else "UTC"
    abbr = moment.tzname() or ""
    return text if abbr in ("", "UTC") or abbr.startswith(("+", "-")) else f"{text} {abbr}"


def format_clock(at: float | None, tz: tzinfo, now: float | None = None) -> str:
    """A moment in ``tz`` to the second, 24-hour: ``14:03:27 CEST`` on ``now``'s day, else with
    its date (``2025-05-01 14:03:27 CEST``). Never to the nanosecond."""
    if at is None or math.isnan(at):
        return MISSING
    moment = datetime.fromtimestamp(at, tz)
    same_day = now is not None and datetime.fromtimestamp(now, tz).date() == moment.date()
    abbr = moment.tzname() or ""
    zone = abbr if abbr and not abbr.startswith(("+", "-")) else zone_label(tz, at)
    return f"{moment:%H:%M:%S} {zone}" if same_day else f"{moment:%Y-%m-%d %H:%M:%S} {zone}"


def format_moment(at: float | None, tz: tzinfo, now: float) -> str:
    """A moment relative first, then in ``tz``: ``3 m ago (14:03:27 CEST)``."""
    if at is None or math.isnan(at):
        return MISSING
    return f"{format_ago(at, now)} ({format_clock(at, tz, now)})"


def parse_timestamp(text: object) -> float | None:
    """An RFC 3339 time (Prometheus's ``activeAt``, Alertmanager's ``startsAt``:
    ``2024-05-01T10:00:00.123456789Z``) as Unix seconds; None when it is not one."""
    if not isinstance(text, str) or not text:
        return None
    stamp = text.replace("Z", "+00:00")
    head, dot, rest = stamp.partition(".")
    if dot:  # Python reads at most microseconds
        digits = "".join(ch for ch in rest if ch.isdigit())
        stamp = f"{head}.{digits[:6]}{rest[len(digits):]}"
    try:
        moment = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if moment.year < 1971:  # Go's zero time: "never"
        return None
    return moment.timestamp()


# ---- Prometheus template functions ---------------------------------------------------------


def _g4(v: float) -> str:
    return f"{v:.4g}"


def _scaled_down(v: float) -> str:
    """A value below 1 with an SI prefix (m, u, n, …), as both humanize functions print it."""
    prefix = ""
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    return f"{_g4(v)}{prefix}"


def humanize(v: float) -> str:
    if v == 0 or math.isnan(v) or math.isinf(v):
        return _g4(v)
    if abs(v) >= 1:
        prefix = ""
        for p in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(v) < 1000:
                break
            prefix, v = p, v / 1000
        return f"{_g4(v)}{prefix}"
    return _scaled_down(v)


def humanize_duration(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return _g4(v)
    if v == 0:
        return f"{_g4(v)}s"
    if abs(v) >= 1:
        sign = "-" if v < 0 else ""
        v = abs(v)
        d = int(v)
        seconds, minutes, hours, days = d % 60, (d // 60) % 60, (d // 3600) % 24, d // 86400
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {seconds}s"
        if minutes:
            return f"{sign}{minutes}m {seconds}s"
        return f"{sign}{_g4(v)}s"
    return _scaled_down(v) + "s"


def humanize_percentage(v: float) -> str:
    return f"{v * 100:.4g}%"


def prometheus_value_template(unit: str) -> str:
    """The Prometheus template that prints an alert's ``$value`` in ``unit`` (for descriptions)."""
    if unit == "ratio":
        return "{{ $value | humanizePercentage }}"
    if unit in ("seconds", "ratio_to_baseline"):
        # For baseline checks $value is the left-hand side of `value > k * baseline`: a time.
        return "{{ $value | humanizeDuration }}"
    if unit == "usd":
        return '{{ $value | printf "%.3f" }} USD'
    return "{{ $value | humanize }}"


def render_value_template(template: str, value: float) -> str:
    """Render the placeholders :func:`prometheus_value_template` emits (and nothing else)."""
    return (template
            .replace("{{ $value | humanizePercentage }}", humanize_percentage(value))
            .replace("{{ $value | humanizeDuration }}", humanize_duration(value))
            .replace('{{ $value | printf "%.3f" }}', f"{value:.3f}")
            .replace("{{ $value | humanize }}", humanize(value)))
