"""The exporter's own health counters: batched updates, totals and the gauge change marker."""

import pytest

from exporter.core.health import Health

P = "prefixscope"


def test_update_applies_increments_and_sets_in_one_call():
    h = Health()
    h.update([(f"{P}_kv_event_batches", ("w0",), 1.0), (f"{P}_kv_event_batches", ("w0",), 2.0),
              (f"{P}_kv_event_missed_batches", ("w0",), 0)],
             [(f"{P}_kv_event_lag_seconds", ("w0",), 0.25)])
    counters, gauges = h.snapshot()
    assert counters[f"{P}_kv_event_batches"] == {("w0",): 3.0}
    assert counters[f"{P}_kv_event_missed_batches"] == {("w0",): 0.0}  # the series exists at 0
    assert gauges[f"{P}_kv_event_lag_seconds"] == {("w0",): 0.25}


def test_update_with_a_wrong_series_changes_nothing():
    h = Health()
    with pytest.raises(KeyError):
        h.update([(f"{P}_kv_event_batches", ("w0",), 1.0), (f"{P}_kv_event_batches", ("w0", "x"), 1.0)])
    with pytest.raises(KeyError):
        h.update([], [(f"{P}_no_such_gauge", (), 1.0)])
    assert h.snapshot() == ({}, {})


def test_total_over_label_sets_is_missing_until_a_series_exists():
    h = Health()
    assert h.total(f"{P}_ingest_errors") is None
    h.error("records", "schema", "context")
    h.error("kv_events", "decode", "context", n=3)
    h.update([(f"{P}_ingest_errors", ("records", "schema"), 2)])
    assert h.total(f"{P}_ingest_errors") == 6.0
    h.inc(f"{P}_kv_event_missed_batches", ("w0",), 0)
    assert h.total(f"{P}_kv_event_missed_batches") == 0.0  # a series at 0 is data, not missing


def test_gauge_writes_count_changes_and_removals_per_gauge():
    h = Health()
    up = f"{P}_up"
    assert h.gauge_writes(up) == 0
    h.set(up, ("w0", "worker"), 1.0)
    h.update([], [(up, ("w1", "worker"), 0.0)])
    h.set(f"{P}_kv_event_lag_seconds", ("w0",), 1.0)  # another gauge: not counted for up
    assert h.gauge_writes(up) == 2
    h.set(up, ("w0", "worker"), 1.0)  # the same value again (every healthy scrape): no change
    h.update([], [(up, ("w1", "worker"), 0.0)])
    assert h.gauge_writes(up) == 2
    h.remove(up, ("w1", "worker"))
    h.remove(up, ("gone", "worker"))  # nothing to remove: no change
    assert h.gauge_writes(up) == 3
