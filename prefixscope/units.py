"""Python ports of Prometheus's template functions (Prometheus 2.x ``template.go``).

Used to predict the exact rendered annotations in the generated promtool tests; promtool then
checks the prediction against the real implementation.
"""

from __future__ import annotations

import math


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


def render_value_template(template: str, value: float) -> str:
    """Render the value placeholders :mod:`prefixscope.wording` emits (and nothing else)."""
    return (template
            .replace("{{ $value | humanizePercentage }}", humanize_percentage(value))
            .replace("{{ $value | humanizeDuration }}", humanize_duration(value))
            .replace('{{ $value | printf "%.3f" }}', f"{value:.3f}")
            .replace("{{ $value | humanize }}", humanize(value)))
