"""Values for people: the one place that knows how each catalogue unit reads.

Two readings of one unit, from one table (``_FORMATS``):

- a *setting* — a threshold as configured — is printed exactly (``0.85`` reads ``85%``,
  ``0.005`` seconds ``5 ms``), so the person sees the number they wrote; alert summaries,
  descriptions, docs and dashboards use it (through :mod:`prefixscope.wording`);
- a *reading* — a measured value — is rounded for a glance (``84.7%``, ``12.5 ms``,
  ``$0.0123``); the console uses it.

A missing reading is "—", never 0. Unknown units print the bare number.

The second half of the module ports Prometheus's template functions (Prometheus 2.x
``template.go``): alert descriptions carry the live value through them, and the generated
promtool tests predict the rendered annotations with these ports (promtool then checks the
prediction against the real implementation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

MISSING = "—"


def _seconds(v: float, setting: bool) -> str:
    if abs(v) < 1:
        return f"{v * 1000:g} ms" if setting else f"{v * 1000:.1f} ms"
    return f"{v:g} s" if setting else f"{v:.2f} s"


# unit -> (as a setting, as a reading)
_FORMATS: dict[str, tuple[Callable[[float], str], Callable[[float], str]]] = {
    "ratio": (lambda v: f"{v * 100:g}%", lambda v: f"{v:.1%}"),
    "ratio_to_baseline": (lambda v: f"{v:g} ×", lambda v: f"{v:.2f}× baseline"),
    "seconds": (lambda v: _seconds(v, True), lambda v: _seconds(v, False)),
    "usd": (lambda v: f"{v:g} USD", lambda v: f"${v:.4f}"),
    "per_minute": (lambda v: f"{v:g} per minute", lambda v: f"{v:.1f}/min"),
    "per_second": (lambda v: f"{v:g} per second", lambda v: f"{v:.2f}/s"),
    "tokens": (lambda v: f"{v:g} tokens", lambda v: f"{v:,.0f} tokens"),
    "blocks": (lambda v: f"{v:g} blocks", lambda v: f"{v:,.0f} blocks"),
    "batches": (lambda v: f"{v:g} batches", lambda v: f"{v:g} batches"),
    "repairs": (lambda v: f"{v:g} repairs", lambda v: f"{v:g} repairs"),
    "targets": (lambda v: f"{v:g} targets", lambda v: f"{v:g} targets"),
    # depth (prefix-tree edges) and unitless counts read as bare numbers
    "depth": (lambda v: f"{v:g}", lambda v: f"{v:g}"),
}


def _bare(v: float) -> str:
    return f"{v:g}"


def format_setting(value: float, unit: str) -> str:
    """A configured value (a threshold) in its unit, exactly as configured."""
    return _FORMATS.get(unit, (_bare, _bare))[0](value)


def format_reading(value: float | None, unit: str) -> str:
    """A measured value in its unit, rounded for reading; a missing value is "—" (never 0)."""
    if value is None:
        return MISSING
    return _FORMATS.get(unit, (_bare, _bare))[1](value)


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
