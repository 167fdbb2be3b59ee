"""Miss cost of every request that missed part of its available prefix, the SLO's judgement of
it against the long-window cold-prefill baseline, and the cold-prefill check against that baseline."""

import pytest

from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from prefixscope.thresholds import load_thresholds

P = "prefixscope"
M = ("unknown",)


def make(clock: float = 0.0) -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), window_s=300, clock=lambda: clock)


def rec(ts, rid, worker, prompt, **kw):
    return {"ts": ts, "request_id": rid, "worker": worker, "prompt_tokens": prompt, **kw}


def counter(st: ClusterState, name: str) -> float | None:
    return st.store.cum.counters.get(f"{P}_{name}", {}).get(M)


def test_a_soft_migration_counts_its_transfer_time_as_miss_cost():
    st = make()
    # warm (not cold) but migrated: its KV moved, and the move is part of what the miss cost
    st.ingest_records([rec(100, "m", "w1", 1000, cached_tokens=900, prefill_s=0.1, queue_s=0.05,
                           migrated_from="w0", migration_kind="soft", migrate_s=0.4)], 100)
    miss = st.store.cum.histograms[f"{P}_prefix_miss_cost_seconds"][M]
    assert sum(miss[:-1]) == 1 and abs(miss[-1] - 0.55) < 1e-9
    assert counter(st, "cold_requests") is None  # not a cold request


def test_a_request_that_reused_all_that_was_available_did_not_miss():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2), None, 16),)), 99.0)
    st.apply_kv_batch(KvBatch("w1", 0, 99.0, (BlockStored((1, 2, 3, 4), None, 16),)), 99.0)
    st.ingest_records([
        # w0 held 2 blocks and reused them, but w1 held 4: it missed half of what was available
        rec(100, "a", "w0", 64, block_hashes=[1, 2, 3, 4], cached_tokens=32, prefill_s=0.2),
        # on w1 it reused all 4 available blocks: a hit, no miss cost
        rec(101, "b", "w1", 64, block_hashes=[1, 2, 3, 4], cached_tokens=64, prefill_s=0.01),
        # nothing available anywhere: a compulsory (cold) miss, not a miss of the available prefix
        rec(102, "c", "w1", 64, block_hashes=[7, 8, 9, 10], cached_tokens=0, prefill_s=0.3),
    ], 102)
    miss = st.store.cum.histograms[f"{P}_prefix_miss_cost_seconds"][M]
    assert sum(miss[:-1]) == 1 and abs(miss[-1] - 0.2) < 1e-9


def test_misses_are_judged_against_the_cold_baseline_of_their_prompt_class_ending_one_window_ago():
    st = make()
    # the baseline: cold 1k-4k prompts taking 0.9 s (p95 of the layout's (0.6, 1] bucket: 0.98 s)
    st.ingest_records([rec(10 + i, f"c{i}", "w0", 2000, cached_tokens=0, prefill_s=0.9) for i in range(20)], 30)
    # a miss right away: the baseline ends one window (300 s) ago, so nothing judges it
    st.ingest_records([rec(40, "early", "w1", 2000, cached_tokens=0, prefill_s=5.0)], 40)
    assert counter(st, "missed_requests") is None
    st.ingest_records([
        rec(400, "ok", "w1", 2000, cached_tokens=0, prefill_s=1.0, queue_s=0.4),  # 1.4 s ≤ 1.5 × 0.98
        rec(401, "slow", "w1", 2000, cached_tokens=0, prefill_s=1.0, queue_s=0.6),  # 1.6 s > 1.47 s
        rec(402, "other-class", "w1", 200, cached_tokens=0, prefill_s=9.0),  # 0-1k: no baseline yet
    ], 402)
    assert counter(st, "missed_requests") == 2
    assert counter(st, "missed_requests_within_baseline") == 1
    ev = evaluate(st, now=402)
    slo = ev.results["slo_prefix_miss_cost"]
    assert slo.value == 0.5 and slo.threshold == 0.95 and slo.status == "firing"
    assert slo.severity == "critical"


def test_cold_prefill_check_compares_the_window_p99_with_the_baseline_p99_of_the_same_class():
    st = make()
    # baseline: 1k-4k cold prompts at 0.9 s, 16k+ at 9 s (a long prompt is not a slow one)
    st.ingest_records([rec(10 + i, f"a{i}", "w0", 2000, cached_tokens=0, prefill_s=0.9) for i in range(20)]
                      + [rec(40 + i, f"b{i}", "w0", 20000, cached_tokens=0, prefill_s=9.0) for i in range(20)], 60)
    # the window: the same per class: ratio 1, healthy
    st.ingest_records([rec(400, "x", "w0", 2000, cached_tokens=0, prefill_s=0.9),
                       rec(401, "y", "w0", 20000, cached_tokens=0, prefill_s=9.0)], 401)
    r = evaluate(st, now=401).results["cold_prefill_time_p99"]
    assert r.value == 1.0 and r.status == "ok" and r.baseline is None
    # the 1k-4k class alone slows 5×: its p99 moves from the (0.6, 1] bucket to the (4, 6] one
    st.ingest_records([rec(402 + i, f"s{i}", "w0", 2000, cached_tokens=0, prefill_s=4.5) for i in range(5)], 410)
    r = evaluate(st, now=410).results["cold_prefill_time_p99"]
    assert 5.0 < r.value <= 6.0 and r.status == "firing"


def test_severity_is_on_every_check_result_and_the_exporter_sees_itself_up():
    st = make(clock=100.0)
    ev = evaluate(st)
    th = load_thresholds()
    assert {k: r.severity for k, r in ev.results.items()} == {
        c.key: th.checks[c.threshold].severity for c in (r.check for r in ev.results.values())}
    assert ev.results["prefix_tree_depth_p99"].severity == "info"
    up = ev.results["exporter_up"]
    assert up.value == 0.0 and up.status == "ok"


def _cold_minutes(st: ClusterState, start_min: int, minutes: int, prefill_s: float) -> None:
    """Ten cold 1k-4k requests a minute, each taking ``prefill_s``, received as they happen."""
    for minute in range(start_min, start_min + minutes):
        t = minute * 60.0
        st.ingest_records([rec(t + 6 * i, f"r{minute}-{i}", "w0", 2000, cached_tokens=0, prefill_s=prefill_s)
                           for i in range(10)], t + 59)


def test_a_two_hour_slowdown_is_never_its_own_baseline():
    """As the rule (tests/alerts/test_promtool.py, same input): a 5 × slowdown (0.45 s → 2.25 s)
    after three healthy hours still reads 2.49 s / 0.598 s at +1 h and +2 h, and the miss-cost SLO
    keeps judging the slow misses against the healthy p95, where a plain day-long baseline had
    absorbed the slowdown within the half hour."""
    now = [0.0]
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, clock=lambda: now[0])
    _cold_minutes(st, 0, 180, 0.45)
    now[0] = 180 * 60.0
    before = evaluate(st).results["cold_prefill_time_p99"]
    assert before.value == 1.0 and before.status == "ok"
    for hours in (1, 2):
        _cold_minutes(st, 180 + (hours - 1) * 60, 60, 2.25)
        now[0] = (180 + hours * 60) * 60.0
        ev = evaluate(st)
        slow = ev.results["cold_prefill_time_p99"]
        assert slow.value == pytest.approx((1.5 + 0.99) / (0.4 + 0.2 * 0.99)) and slow.status == "firing", hours
        assert ev.results["cold_prefill_budget"].status == "ok"  # 2.49 s is under the class's 2.5 s
        assert ev.results["slo_prefix_miss_cost"].value == 0.0, hours  # every slow miss is over 1.5 × 0.59 s
