"""The metric store: each counter and histogram cumulative and windowed, expiring by input time."""

from exporter.core.baseline_window import LaggedBuckets
from exporter.core.metric_store import MetricStore
from prefixscope import catalog

P = catalog.NAMESPACE
PROMPT = f"{P}_request_prompt_tokens"
ACHIEVED = f"{P}_reuse_achieved_tokens"
WALK = f"{P}_router_tree_walk_seconds"
COLD = f"{P}_cold_prefill_seconds"  # recording rules read it as a baseline ([1d] offset 5m)


def test_counter_is_cumulative_and_windowed() -> None:
    s = MetricStore(300)
    s.inc(100.0, PROMPT, ("m",), 64)
    s.inc(350.0, PROMPT, ("m",), 36)
    s.inc(350.0, PROMPT, ("n",), 10)
    s.expire(399.0)
    assert s.window_counter(PROMPT) == 110
    s.expire(400.0)  # the first increment is exactly one window old
    assert s.window_counter(PROMPT) == 46
    assert s.window_counter(PROMPT, where=lambda labels: labels == ("m",)) == 36
    assert s.cum.counter(PROMPT, ("m",)) == 100  # /metrics keeps everything
    s.expire(1000.0)
    assert s.window_counter(PROMPT) is None  # nothing in the window: missing, not 0


def test_zero_creates_the_series_without_windowed_data() -> None:
    s = MetricStore(300)
    s.zero(ACHIEVED, ("m",))
    assert s.cum.counters[ACHIEVED] == {("m",): 0.0}
    assert s.window_counter(ACHIEVED) is None


def test_own_sums_are_not_catalogue_counters() -> None:
    s = MetricStore(300)
    s.add_own(100.0, ("record_prompt", "w0"), 64)
    assert s.own_sum(("record_prompt", "w0")) == 64
    assert s.window_counter("record_prompt") is None
    s.expire(400.0)
    assert s.own_sum(("record_prompt", "w0")) is None


def test_scraped_running_totals() -> None:
    s = MetricStore(300)
    hits = f"{P}_prefix_cache_hit_tokens"
    s.set_total(hits, ("w0", "m"), 500)  # the first scrape: a total, no increase known yet
    assert s.cum.counter(hits, ("w0", "m")) == 500 and s.window_counter(hits) is None
    s.set_total(hits, ("w0", "m"), 800, (115.0, 300))
    assert s.cum.counter(hits, ("w0", "m")) == 800 and s.window_counter(hits) == 300


def test_histogram_window_and_the_baseline_a_rule_reads() -> None:
    s = MetricStore(300, baseline_s=3600)
    bounds = catalog.METRICS_BY_NAME[COLD].buckets
    assert bounds is not None
    assert s.window_buckets(WALK) is None  # never observed: no window
    assert set(s.baselines) == {COLD}  # no rule reads another histogram as a baseline
    s.observe(0.0, COLD, ("m", "H100", "0-1k"), bounds[0] / 2)
    s.observe(1000.0, COLD, ("m", "H100", "1k-4k"), bounds[0] / 2)
    s.expire(1000.0)
    got = s.window_buckets(COLD)
    assert got is not None and got[0] == bounds and sum(got[1]) == 1
    # The baseline ends one window ago: the observation at 1000 s is not in it yet.
    assert s.baseline_rows(COLD) == {("m", "H100", "0-1k"): [1] + [0] * len(bounds)}
    s.expire(1310.0)  # slots are 15 s: the one holding 1000 s ends at 1005 s
    assert set(s.baseline_rows(COLD)) == {("m", "H100", "0-1k"), ("m", "H100", "1k-4k")}
    s.expire(3600.0 + 300.0 + 15.0)  # the first one's slot is one baseline window + one window old
    assert set(s.baseline_rows(COLD)) == {("m", "H100", "1k-4k")}
    row = s.cum.histograms[COLD][("m", "H100", "0-1k")]
    assert row[0] == 1 and row[-1] == bounds[0] / 2  # [bucket counts..., +Inf, sum]


def test_lagged_buckets_take_late_observations_and_keep_slots_in_order() -> None:
    lb = LaggedBuckets(span_s=100, lag_s=30, bounds=(1.0, 2.0), slot_s=10)
    lb.observe(55.0, "k", 0.5)
    lb.observe(12.0, "k", 1.5)  # late: older than the pending slot, still before the lag
    lb.observe(57.0, "j", 5.0)
    lb.advance(60.0)  # window (−70, 30]: only the slot [10, 20)
    assert lb.counts == {"k": [0, 1, 0]}
    lb.advance(90.0)  # (−40, 60]: all three
    assert lb.merged() == [1, 1, 1] and lb.merged(lambda key: key == "j") == [0, 0, 1]
    lb.advance(150.0)  # (20, 120]: the slot [10, 20) has left
    assert lb.counts == {"k": [1, 0, 0], "j": [0, 0, 1]}
