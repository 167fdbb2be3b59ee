"""The limits the console shows: the exporter's, whatever values are read from (pure)."""

from __future__ import annotations

from console.chain import Reuse, chain_from_prometheus
from console.limits import limits_from_file, limits_from_groups
from console.readings import alert_terms, check_line
from prefixscope.catalog import CHECKS, SIGNALS
from prefixscope.thresholds import load_thresholds

GROUPS = {"steps": [{"checks": [
    {"key": "sticky_session_collision_rate", "threshold": 0.2, "for_s": 45.0, "severity": "critical"},
    {"key": "prefix_tree_depth_p99", "threshold": 48, "for_s": 600.0, "severity": "warning"},
    {"key": "a_check_of_a_newer_exporter", "threshold": 1, "for_s": 1, "severity": "warning"},
]}]}


def test_limits_arrive_with_the_exporters_answer() -> None:
    limits = limits_from_groups(GROUPS, "http://exporter:9400")
    assert (limits.source, limits.where) == ("exporter", "http://exporter:9400")
    got = limits.of("sticky_session_collision_rate")
    assert (got.threshold, got.for_s, got.severity) == (0.2, 45.0, "critical")
    assert limits.threshold("a_check_of_a_newer_exporter") is None  # unknown keys are skipped
    assert limits.threshold("kv_event_staleness") is None  # not reported: unknown, never guessed


def test_severity_in_force_decides_what_is_context() -> None:
    assert "prefix_tree_depth_p99" in limits_from_file(load_thresholds()).context  # packaged: info
    assert "prefix_tree_depth_p99" not in limits_from_groups(GROUPS).context  # this site: warning


def test_prometheus_values_are_judged_against_the_limits_in_force() -> None:
    values = {c.key: None for c in CHECKS} | {"sticky_session_collision_rate": 0.12}
    chain = chain_from_prometheus(values, {}, dict.fromkeys(SIGNALS, True), [], limits_from_groups(GROUPS),
                                  Reuse(None, None, None))
    sticky = chain.checks()["sticky_session_collision_rate"]
    assert (sticky.threshold, sticky.pending, sticky.severity, sticky.for_s) == (0.2, False, "critical", 45.0)
    assert "(alert when > 20.0%)" in check_line(sticky)
    assert "(limit not reported)" in check_line(chain.checks()["kv_event_staleness"])


def test_alert_terms() -> None:
    assert alert_terms(100.0, "warning") == "warning, fires after 1 m 40 s past its limit"
    assert alert_terms(0.0, "critical") == "critical, fires as soon as it is past its limit"
    assert alert_terms(None, None) == "severity not reported"
