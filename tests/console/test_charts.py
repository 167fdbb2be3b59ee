"""Time-series charts: readable height, units on the axis, 24-hour times with the zone, threshold, spans."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import pytest

from console import charts
from console.charts import Span, spans_from_samples, time_series, zone_label

BERLIN = ZoneInfo("Europe/Berlin")
T0 = 1_746_100_800.0  # 2025-05-01 12:00 UTC = 14:00 CEST


def test_a_ratio_chart_reads_in_percent_with_its_threshold_and_zone() -> None:
    # A fall from 100 % to 82 % over an hour, threshold 60 %.
    points = [(T0 + 60 * i, 1.0 if i < 30 else 0.82) for i in range(60)]
    fig = time_series(points, title="Prefix hit rate (percent)", unit="ratio", threshold=0.6, op="<", tz=BERLIN)
    layout = fig.layout
    assert layout.height >= 240
    assert layout.yaxis.title.text == "percent" and layout.yaxis.tickformat == ".0%"
    assert layout.xaxis.tickformat == "%H:%M"  # 24-hour clock
    assert layout.xaxis.title.text == "time (UTC+02:00 CEST)"
    assert layout.title.text == "Prefix hit rate (percent)"
    (line,) = [s for s in layout.shapes if s.type == "line"]
    assert (line.y0, line.y1) == (0.6, 0.6)
    lo, hi = layout.yaxis.range
    # The range fits data and threshold, not [0, 1]: the 18-point drop spans over a third of the height.
    assert 0.5 < lo < 0.6 and 1.0 < hi <= 1.02
    assert (1.0 - 0.82) / (hi - lo) > 1 / 3
    assert fig.data[-1].x[0].hour == 14  # times in the chosen zone


def test_units_name_the_axis() -> None:
    assert charts.axis_for("seconds").title == "seconds" and charts.axis_for("seconds").ticksuffix == " s"
    assert charts.axis_for("usd").tickprefix == "$"
    assert charts.axis_for("tokens").title == "tokens"
    assert charts.axis_for("per_minute").title == "per minute"


def test_alert_spans_are_shaded_and_named() -> None:
    points = [(T0 + 60 * i, 0.1) for i in range(10)]
    spans = [Span(T0 + 120, T0 + 300, "pending"), Span(T0 + 300, T0 + 540, "firing")]
    fig = time_series(points, title="t", unit="ratio", threshold=0.05, spans=spans, tz=BERLIN)
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert [r.fillcolor for r in rects] == [charts.SPAN_COLOURS["pending"], charts.SPAN_COLOURS["firing"]]
    assert {t.name for t in fig.data} >= {"alert pending", "alert firing"}
    assert fig.layout.showlegend
    # The spans' legend entries come first and carry no x values: the axis must still be a time
    # axis (plotly took it for a linear one, with ticks -1…6 and neither line nor spans shown).
    assert fig.layout.xaxis.type == "date"


def test_spans_from_alert_samples_merge_consecutive_steps() -> None:
    firing = [T0 + 60 * i for i in (0, 1, 2, 6, 7)]
    assert spans_from_samples([("firing", firing), ("pending", [])], 60) == [
        Span(T0 - 30, T0 + 150, "firing"), Span(T0 + 330, T0 + 450, "firing")]


def test_zone_label_names_utc_plainly() -> None:
    assert zone_label(ZoneInfo("UTC"), T0) == "UTC+00:00"
    assert charts.timestamp_text(T0, BERLIN) == "2025-05-01 14:00:00 CEST"


def _x_range(fig) -> list[float]:
    return [x.timestamp() for x in fig.layout.xaxis.range]


def _captions(fig) -> list[str]:
    return [a.text for a in fig.layout.annotations if a.name == "history"]


def test_a_chart_without_history_spans_the_selected_range_ending_now() -> None:
    fig = time_series([], title="t", unit="ratio", threshold=0.6, tz=BERLIN, range_s=900, now=T0)
    assert _x_range(fig) == [T0 - 900, T0]
    assert fig.layout.xaxis.title.text == "time (UTC+02:00 CEST)"
    assert _captions(fig) == ["No history yet in the last 15 min"]
    assert fig.layout.yaxis.range is not None  # the threshold still gives the y axis a range


def test_a_single_point_is_a_marker_placed_in_the_range_with_a_caption() -> None:
    fig = time_series([(T0 - 60, 0.7), (T0 - 30, None)], title="t", unit="ratio", tz=BERLIN, range_s=3600, now=T0)
    assert _x_range(fig) == [T0 - 3600, T0]
    assert _captions(fig) == ["History: one point, at 13:59:00, in the last 1 h"]
    assert "markers" in fig.data[-1].mode


def test_a_short_history_says_how_long_and_a_full_one_says_nothing() -> None:
    short = [(T0 - 720 + 60 * i, 0.9) for i in range(13)]  # the last 12 minutes of an hour
    fig = time_series(short, title="t", unit="ratio", tz=BERLIN, range_s=3600, now=T0)
    assert _x_range(fig) == [T0 - 3600, T0]
    assert _captions(fig) == ["History: 12 min (since 13:48) of the last 1 h"]
    assert fig.data[-1].mode == "lines"
    full = [(T0 - 3600 + 30 * i, 0.9) for i in range(121)]
    fig = time_series(full, title="t", unit="ratio", tz=BERLIN, range_s=3600, now=T0)
    assert _captions(fig) == [] and _x_range(fig) == [T0 - 3600, T0]


def test_without_a_selected_range_the_axis_fits_the_data_as_before() -> None:
    fig = time_series([(T0 + 60 * i, 0.5) for i in range(5)], title="t", unit="ratio", tz=BERLIN)
    assert fig.layout.xaxis.range is None and _captions(fig) == []


def test_a_sub_second_series_is_drawn_in_milliseconds_with_its_threshold() -> None:
    points = [(T0 + 60 * i, 0.004 + 0.001 * i) for i in range(5)]
    fig = time_series(points, title="walk", unit="seconds", threshold=0.005, tz=BERLIN)
    assert fig.layout.yaxis.title.text == "milliseconds" and fig.layout.yaxis.ticksuffix == " ms"
    line = next(t for t in fig.data if t.name == "walk")
    assert list(line.y) == pytest.approx([4, 5, 6, 7, 8])
    assert fig.layout.shapes[-1].y0 == pytest.approx(5)  # the threshold, in the same unit
    assert any(t.name == "alert when > this" for t in fig.data)  # named in the legend, not over the plot
    assert not fig.layout.annotations
