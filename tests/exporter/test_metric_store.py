"""The metric store: each counter and histogram cumulative and windowed, expiring by input time."""

from exporter.metric_store import LONG_WINDOW_S, MetricStore
from prefixscope import catalog

P = catalog.NAMESPACE
PROMPT = f"{P}_request_prompt_tokens"
ACHIEVED = f"{P}_reuse_achieved_tokens"
WALK = f"{P}_router_tree_walk_seconds"
PER_TOKEN = f"{P}_prefill_seconds_per_token"  # a recording rule reads it over [1h]


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


def test_histogram_window_and_the_long_window_a_rule_reads() -> None:
    s = MetricStore(300)
    bounds = catalog.METRICS_BY_NAME[PER_TOKEN].buckets
    assert bounds is not None
    assert s.window_buckets(WALK) is None  # never observed: no window
    s.observe(0.0, PER_TOKEN, ("m", "warm"), bounds[0] / 2)
    s.observe(1000.0, PER_TOKEN, ("m", "cold"), bounds[0] / 2)
    s.expire(1000.0)
    got = s.window_buckets(PER_TOKEN)
    assert got is not None and got[0] == bounds and sum(got[1]) == 1
    long = s.window_buckets(PER_TOKEN, LONG_WINDOW_S)
    assert long is not None and sum(long[1]) == 2 and long[1][0] == 2
    warm = s.window_buckets(PER_TOKEN, LONG_WINDOW_S, where=lambda labels: labels[1] == "warm")
    assert warm is not None and sum(warm[1]) == 1
    assert s.window_buckets(WALK, LONG_WINDOW_S) is None  # no rule reads it over an hour
    s.expire(3600.0)
    assert sum(s.window_buckets(PER_TOKEN, LONG_WINDOW_S)[1]) == 1  # type: ignore[index]
    row = s.cum.histograms[PER_TOKEN][("m", "warm")]
    assert row[0] == 1 and row[-1] == bounds[0] / 2  # [bucket counts..., +Inf, sum]
