"""What the windows hold grows with the keys in use, not with the record rate.

Each record adds to some twenty windowed counters and histograms; held one entry per event, a
window of a busy cluster's records cost ~2 KB a record. Coalesced per second, a record costs a
small fraction of that once more than a handful arrive each second.
"""

from __future__ import annotations

import tracemalloc

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.core.windows import WindowedBuckets, WindowedSum
from prefixscope.thresholds import load_thresholds


def _record(i: int, ts: float) -> dict:
    return {"ts": ts, "request_id": f"r{i}", "worker": f"w{i % 8}", "model": "m", "prompt_tokens": 2048,
            "cached_tokens": 1024, "predicted_cached_tokens": 1536, "session_id": f"s{i % 500}",
            "queue_s": 0.01, "prefill_s": 0.2, "ttft_s": 0.25, "segment": "web"}


def test_a_window_of_records_holds_well_under_a_kilobyte_each() -> None:
    now = 10_000.0
    state = ClusterState.build(Health(), load_thresholds(), clock=lambda: now)
    n = 30_000  # 100 records a second over the 300 s window
    records = [_record(i, now - 300 + i / 100) for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, n, 500):
            state.ingest_records(records[i:i + 500], records[i + 499]["ts"])
        store = state.store
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store.win) <= 301  # one slot a second
    per_record = held / n
    assert per_record < 1024, f"{per_record:.0f} B a record"


def test_coalesced_windows_keep_sums_and_counts_exact_and_expire_whole_slots() -> None:
    w = WindowedSum(10.0)
    for i in range(100):
        w.add(100.0 + i / 100, "a", 1.0)  # 100 events within one second: one slot
    w.add(100.995, "b", 0.0)  # a zero keeps its key
    assert w.get("a") == 100.0 and w.get("b") == 0.0 and len(w) == 1
    w.add(105.0, "a", 2.0)
    w.expire(110.9)  # the slot's oldest event is out of the window, its newest (100.995) not yet
    assert w.get("a") == 102.0
    w.expire(111.0)  # now its newest is: the slot goes whole
    assert w.get("a") == 2.0 and w.get("b") is None
    wb = WindowedBuckets(10.0, (1.0, 2.0))
    for v in (0.5, 1.5, 1.5, 9.0):
        wb.observe(50.0, "k", v)
    wb.observe(49.0, "k", 0.5)  # out of order: its own second's slot, which leaves first
    assert wb.merged("k") == [2, 2, 1]
    wb.expire(59.5)
    assert wb.merged("k") == [1, 2, 1]
    wb.expire(60.0)
    assert wb.merged() == [0, 0, 0] and "k" not in wb.counts


def _small(i: int, ts: float) -> dict:
    return {"ts": ts, "request_id": f"r{i}", "worker": "w0", "prompt_tokens": 10}


def test_records_out_of_order_join_their_seconds_slots() -> None:
    """Timestamps alternating between now and 200 s ago opened a slot per record (60,000 slots
    instead of 300); each joins its own second's slot, so the window holds what it covers."""
    now = 10_000.0
    state = ClusterState.build(Health(), load_thresholds(), clock=lambda: now)
    for i in range(0, 60_000, 500):
        t = now + i / 200  # 100 records a second of input time, half of them 200 s late
        batch = [_small(i + j, t + j / 200 - (200 if j % 2 else 0)) for j in range(500)]
        state.ingest_records(batch, t + 2.5)
    assert len(state.store.win) <= 302
    assert state.store.window_counter("prefixscope_request_prompt_tokens") <= 10 * 60_000


def test_a_record_ahead_of_the_clock_does_not_hold_the_window_back() -> None:
    """A record 899 s ahead (inside the intakes' tolerance) sat at the head of the slots and kept
    every later slot from expiring for a quarter of an hour; the window summed 600 records of 300."""
    now = 10_000.0
    state = ClusterState.build(Health(), load_thresholds(), clock=lambda: now)
    state.ingest_records([_small(0, now + 899)], now)
    for i in range(1, 601):
        state.ingest_records([_small(i, now + i)], now + i)
    window = state.store.window_s
    in_window = sum(1 for i in range(1, 601) if now + i > now + 600 - window)
    assert state.store.window_counter("prefixscope_request_prompt_tokens") == 10 * (in_window + 1)  # + the one ahead
