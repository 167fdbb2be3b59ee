"""Time-series charts an engineer can read at a glance: plotly figures built from plain points.

Pure (no Streamlit, no I/O). A chart is tall enough to read, names its unit on the y axis
(percent for ratios, seconds, tokens, USD), shows 24-hour times in a named time zone, draws the
alert threshold, and shades the spans in which the alert was pending or firing. The y range
fits the data and the threshold rather than starting at zero, so a fall from 100 % to 82 % is
a visible drop. Given the selected range, the x axis spans that range ending now, so a fresh
series (no point, one point, a few minutes of a day) is placed in time rather than stretched
across the axis or left without one, and a caption says how much history there is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from zoneinfo import ZoneInfo

import plotly.graph_objects as go

from prefixscope.units import format_clock, zone_label

CHART_HEIGHT = 260
Point = tuple[float, float | None]  # (Unix seconds, value or None for a gap)


@dataclass(frozen=True)
class Axis:
    """How a unit is labelled and ticked on the y axis."""

    title: str
    tickformat: str = ""
    tickprefix: str = ""
    ticksuffix: str = ""


AXES: dict[str, Axis] = {
    "ratio": Axis("percent", tickformat=".0%"),
    "ratio_to_baseline": Axis("× baseline", tickformat=".2f", ticksuffix="×"),
    "ratio_to_budget": Axis("× budget", tickformat=".2f", ticksuffix="×"),
    "ratio_to_peers": Axis("× peers' median", tickformat=".2f", ticksuffix="×"),
    "seconds": Axis("seconds", tickformat=",.3~g", ticksuffix=" s"),
    "usd": Axis("USD", tickformat=",.4~f", tickprefix="$"),
    "tokens": Axis("tokens", tickformat=",.3~s"),
    "per_minute": Axis("per minute", tickformat=",.3~f"),
    "per_second": Axis("per second", tickformat=",.3~f"),
    "depth": Axis("radix edges", tickformat=",.3~f"),
    "targets": Axis("targets", tickformat=",d"),
    "batches": Axis("batches", tickformat=",.3~f"),
    "repairs": Axis("repairs", tickformat=",.3~f"),
}


@dataclass(frozen=True)
class Span:
    """An interval in which an alert was in ``state`` (pending or firing)."""

    start: float
    end: float
    state: str


SPAN_COLOURS = {"firing": "rgba(214, 39, 40, 0.16)", "pending": "rgba(255, 160, 0, 0.16)"}
LINE_COLOUR = "#1f77b4"
THRESHOLD_COLOUR = "#d62728"


def axis_for(unit: str) -> Axis:
    return AXES.get(unit, Axis(unit or "value"))


def zone(name: str | None) -> tzinfo:
    """The named IANA zone, else this host's local zone."""
    if name:
        return ZoneInfo(name)
    local = datetime.now().astimezone().tzinfo
    assert local is not None  # astimezone() always attaches a zone
    return local


def timestamp_text(at: float, tz: tzinfo) -> str:
    """A moment as 24-hour local time with its zone, to the second: ``2025-05-01 14:03:27 CEST``."""
    return format_clock(at, tz)


def scaled_axis(unit: str, values: Sequence[float], threshold: float | None) -> tuple[float, Axis]:
    """The factor to multiply values by and the axis that reads them in their own unit: a
    seconds series that stays under a second is drawn in milliseconds (a 5 ms lookup on a
    ``0.005 s`` axis reads as nothing), under a millisecond in microseconds."""
    axis = axis_for(unit)
    if unit != "seconds":
        return 1.0, axis
    top = max([abs(v) for v in values] + ([abs(threshold)] if threshold is not None else []), default=0.0)
    if 0 < top < 1e-3:
        return 1e6, Axis("microseconds", tickformat=",.3~g", ticksuffix=" µs")
    if 0 < top < 1:
        return 1e3, Axis("milliseconds", tickformat=",.3~g", ticksuffix=" ms")
    return 1.0, axis


def spans_from_samples(samples: Iterable[tuple[str, Sequence[float]]], step_s: float) -> list[Span]:
    """Alert states sampled over time (``ALERTS`` over a range) as contiguous spans.

    ``samples`` holds, per alert state, the times the state was seen. Times no more than 1.5
    steps apart belong to the same span; each span extends half a step either side so that a
    single sample is still a visible band.
    """
    out: list[Span] = []
    half = step_s / 2
    for state, times in samples:
        ordered = sorted(times)
        if not ordered:
            continue
        start = prev = ordered[0]
        for t in ordered[1:]:
            if t - prev > 1.5 * step_s:
                out.append(Span(start - half, prev + half, state))
                start = t
            prev = t
        out.append(Span(start - half, prev + half, state))
    return sorted(out, key=lambda s: (s.start, s.state))


def _value_range(values: list[float], threshold: float | None, unit: str) -> list[float] | None:
    """Data and threshold with a margin; a ratio stays within [0, 1] plus room for the line."""
    shown = values + ([threshold] if threshold is not None else [])
    if not shown:
        return None
    lo, hi = min(shown), max(shown)
    pad = (hi - lo) * 0.12 or max(abs(hi) * 0.05, 0.01)
    lo, hi = lo - pad, hi + pad
    if unit == "ratio":
        lo, hi = max(lo, 0.0 - 0.02), min(hi, 1.0 + 0.02)
    elif min(shown) >= 0:
        lo = max(lo, 0.0)
    return [lo, hi]


def duration_text(seconds: float) -> str:
    """A length of time for a caption: ``45 s``, ``12 min``, ``1.5 h``, ``2 d``."""
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.3g} {name}"
    return f"{max(seconds, 0):.0f} s"


def history_caption(points: Sequence[Point], start: float, end: float, tz: tzinfo) -> str | None:
    """How much history the chart holds, when it is less than the range [start, end]; else None.

    The series covers the range when it has values from (about) the range's start: within 5 %
    of the range, a little more than one step of a ~120-point query."""
    shown = sorted(t for t, v in points if v is not None and start <= t <= end)
    whole = f"the last {duration_text(end - start)}"
    if not shown:
        return f"No history yet in {whole}"
    if len(shown) == 1:
        return f"History: one point, at {datetime.fromtimestamp(shown[0], tz):%H:%M:%S}, in {whole}"
    if shown[0] - start <= (end - start) * 0.05:
        return None
    return (f"History: {duration_text(shown[-1] - shown[0])} (since "
            f"{datetime.fromtimestamp(shown[0], tz):%H:%M}) of {whole}")


def time_series(points: Sequence[Point], *, title: str, unit: str, threshold: float | None = None,
                op: str = ">", spans: Sequence[Span] = (), tz: tzinfo | None = None,
                height: int = CHART_HEIGHT, range_s: float | None = None, now: float | None = None) -> go.Figure:
    """One check over time: the line, the threshold, pending/firing spans, labelled axes.

    With ``range_s`` (the selected chart range) the x axis spans ``range_s`` ending at ``now``
    (default: the current time) and a caption in the plot says how much history there is when
    the series is shorter than that; a lone point is drawn as a marker.
    """
    tz = tz or zone(None)
    scale, axis = scaled_axis(unit, [v for _, v in points if v is not None], threshold)
    times = [datetime.fromtimestamp(t, tz) for t, _ in points]
    values = [None if v is None else v * scale for _, v in points]
    threshold = None if threshold is None else threshold * scale
    valued = sum(1 for v in values if v is not None)
    fig = go.Figure()
    for span in spans:
        fig.add_vrect(x0=datetime.fromtimestamp(span.start, tz), x1=datetime.fromtimestamp(span.end, tz),
                      fillcolor=SPAN_COLOURS.get(span.state, SPAN_COLOURS["pending"]), line_width=0, layer="below")
    for state in sorted({s.state for s in spans}):  # legend entries for the shaded states
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"alert {state}",
                                 marker={"symbol": "square", "size": 12,
                                         "color": SPAN_COLOURS.get(state, SPAN_COLOURS["pending"])}))
    if threshold is not None:
        # Named in the legend, not written on the plot: a label there overlapped the line and the title.
        fig.add_hline(y=threshold, line={"color": THRESHOLD_COLOUR, "dash": "dash", "width": 1.5})
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"alert when {op} this",
                                 line={"color": THRESHOLD_COLOUR, "dash": "dash", "width": 1.5}))
    hover_value = f"%{{y:{axis.tickformat or ',.4g'}}}"
    fig.add_trace(go.Scatter(x=times, y=values, mode="lines" if valued > 1 else "lines+markers", name=title,
                             line={"color": LINE_COLOUR, "width": 2}, marker={"color": LINE_COLOUR, "size": 7},
                             connectgaps=False,
                             hovertemplate=f"%{{x|%Y-%m-%d %H:%M:%S}}<br>{axis.tickprefix}{hover_value}"
                                           f"{axis.ticksuffix}<extra></extra>"))
    end = datetime.now().timestamp() if now is None else now
    x_range = [datetime.fromtimestamp(end - range_s, tz), datetime.fromtimestamp(end, tz)] if range_s else None
    start = end - range_s if range_s else (points[0][0] if points else end)
    caption = history_caption(points, start, end, tz) if range_s else None
    if caption is not None:
        # Over the empty part of the plot: the middle without data, else the left side before it.
        fig.add_annotation(text=caption, xref="paper", yref="paper", x=0.5 if not valued else 0.01,
                           xanchor="center" if not valued else "left", y=0.5, yanchor="middle",
                           showarrow=False, font={"size": 12, "color": "#5f6b7a"}, name="history")
    fig.update_layout(
        height=height, margin={"t": 36, "l": 70, "r": 16, "b": 72},
        title={"text": title, "font": {"size": 14}, "x": 0, "xanchor": "left"},
        showlegend=bool(spans) or threshold is not None,
        legend={"orientation": "h", "y": -0.28, "x": 1, "xanchor": "right", "font": {"size": 11}},
        hovermode="x unified", plot_bgcolor="white",
    )
    # type="date" explicitly: the legend entries of shaded spans come first with no x values, and
    # plotly would otherwise take the axis for a linear one (ticks -1…6, the line and spans lost).
    fig.update_xaxes(type="date", title_text=f"time ({zone_label(tz, start)})", tickformat="%H:%M", range=x_range,
                     hoverformat="%Y-%m-%d %H:%M:%S", showgrid=True, gridcolor="#eceff3", nticks=8)
    fig.update_yaxes(title_text=axis.title, tickformat=axis.tickformat, tickprefix=axis.tickprefix,
                     ticksuffix=axis.ticksuffix, range=_value_range([v for v in values if v is not None],
                                                                    threshold, unit),
                     showgrid=True, gridcolor="#eceff3", zeroline=False, nticks=6)
    return fig
