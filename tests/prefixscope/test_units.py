"""Values for people: one table of units, read as a configured setting or as a measured reading."""

from __future__ import annotations

import pytest

from prefixscope import catalog
from prefixscope.units import (
    MISSING,
    format_ago,
    format_clock,
    format_duration,
    format_moment,
    format_number,
    format_reading,
    format_setting,
    parse_timestamp,
    prometheus_value_template,
    render_value_template,
)
from prefixscope.wording import summary, threshold_text


@pytest.mark.parametrize(("value", "unit", "setting", "reading"), [
    (0.85, "ratio", "85%", "85.0%"),
    (0.4123, "ratio", "41.23%", "41.2%"),
    (0.00012, "ratio", "0.012%", "0.012%"),
    (1.5, "ratio_to_baseline", "1.5 ×", "1.5× baseline"),
    (0.005, "seconds", "5 ms", "5 ms"),
    (0.0125, "seconds", "12.5 ms", "12.5 ms"),
    (0.009965754716981131, "seconds", "9.965754717 ms", "9.97 ms"),
    (0.00035, "seconds", "0.35 ms", "350 µs"),
    (2.5, "seconds", "2.5 s", "2.5 s"),
    (100.66, "seconds", "100.66 s", "1 m 41 s"),
    (0.05, "usd", "0.05 USD", "$0.05"),
    (0.01234, "usd", "0.01234 USD", "$0.0123"),
    (3, "per_minute", "3 per minute", "3/min"),
    (1500, "per_minute", "1500 per minute", "1.5 k/min"),
    (0.5, "per_second", "0.5 per second", "0.5/s"),
    (12345, "tokens", "12345 tokens", "12.3 k tokens"),
    (67454.2368, "tokens", "67454.2368 tokens", "67.5 k tokens"),
    (345, "tokens", "345 tokens", "345 tokens"),
    (24000, "blocks", "24000 blocks", "24 k blocks"),
    (5, "batches", "5 batches", "5 batches"),
    (0, "targets", "0 targets", "0 targets"),
    (32, "depth", "32", "32"),
    (3.96, "depth", "3.96", "3.96"),
    (7, "", "7", "7"),
    (2_500_000, "", "2500000", "2.5 M"),
    (1e-05, "", "0.00001", "0.00001"),
    (7, "a unit nobody declared", "7", "7"),
])
def test_setting_and_reading_per_unit(value: float, unit: str, setting: str, reading: str) -> None:
    assert format_setting(value, unit) == setting
    assert format_reading(value, unit) == reading


def test_a_missing_reading_is_a_dash_never_zero() -> None:
    assert format_reading(None, "ratio") == MISSING == "—"
    assert format_reading(0.0, "ratio") == "0.0%"


def test_every_check_unit_has_a_format() -> None:
    """A new unit in the catalogue must be taught here, or its thresholds would read as bare numbers."""
    from prefixscope.units import _FORMATS

    assert {c.unit for c in catalog.CHECKS} <= set(_FORMATS)


def test_alert_wording_reads_thresholds_through_the_units() -> None:
    hit = catalog.CHECKS_BY_KEY["prefix_hit_rate_total"]
    assert threshold_text(hit, 0.6) == "60%"
    assert summary(hit, 0.6) == "Cluster prefix-cache hit rate is below 60%."
    stale = catalog.CHECKS_BY_KEY["kv_event_staleness"]
    assert summary(stale, 30) == "A worker's KV-event stream has been silent for more than 30 s."


@pytest.mark.parametrize(("unit", "value", "shown"), [
    ("ratio", 0.4567, "45.67%"),
    ("seconds", 0.0123, "12.3ms"),
    ("seconds", 90.0, "1m 30s"),
    ("usd", 0.01234, "0.012 USD"),
    ("per_minute", 1500.0, "1.5k"),
])
def test_prometheus_templates_render_as_prometheus_would(unit: str, value: float, shown: str) -> None:
    assert render_value_template(prometheus_value_template(unit), value) == shown


@pytest.mark.parametrize(("seconds", "shown"), [
    (0, "0 s"), (0.35, "350 ms"), (1, "1 s"), (45, "45 s"), (100, "1 m 40 s"), (99.6, "1 m 40 s"),
    (59.6, "1 m"), (3599.7, "1 h"), (7500, "2 h 5 m"), (90061, "1 d 1 h"), (-100, "-1 m 40 s"),
])
def test_durations_read_as_people_say_them(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_a_missing_duration_is_a_dash() -> None:
    assert format_duration(None) == "—"


@pytest.mark.parametrize(("value", "shown"), [
    (0, "0"), (0.25, "0.25"), (345, "345"), (999.4, "999"), (999.6, "1 k"), (67454.2368, "67.5 k"),
    (1_234_567, "1.23 M"), (-4200, "-4.2 k"), (9.965754716981131e-03, "0.00997"),
])
def test_numbers_read_with_si_prefixes_and_never_in_scientific_notation(value: float, shown: str) -> None:
    assert format_number(value) == shown
    assert "e-" not in format_number(value) and "e+" not in format_number(value)


@pytest.mark.parametrize(("ago", "shown"), [
    (0.2, "just now"), (5, "5 s ago"), (100, "1 m 40 s ago"), (3 * 3600 + 100, "3 h ago"), (-5, "in 5 s"),
])
def test_moments_read_relative_to_now(ago: float, shown: str) -> None:
    assert format_ago(1_000_000 - ago, 1_000_000) == shown


def test_moments_read_in_the_configured_zone_to_the_second() -> None:
    from zoneinfo import ZoneInfo

    at = parse_timestamp("2025-05-01T12:03:27.123456789Z")
    assert at is not None and at == pytest.approx(1746101007.123456)
    berlin = ZoneInfo("Europe/Berlin")
    assert format_clock(at, berlin) == "2025-05-01 14:03:27 CEST"
    assert format_clock(at, berlin, now=at + 60) == "14:03:27 CEST"
    assert format_moment(at, berlin, at + 180) == "3 m ago (14:03:27 CEST)"
    assert format_clock(at, ZoneInfo("UTC"), now=at) == "12:03:27 UTC"
    assert parse_timestamp("0001-01-01T00:00:00Z") is None and parse_timestamp("soon") is None
