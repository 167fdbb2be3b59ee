"""Sliding windows and Prometheus-compatible quantiles."""

from exporter.core.windows import WindowedBuckets, WindowedSum, bucket_counts, histogram_quantile


def test_windowed_sum_expires_by_input_time():
    w = WindowedSum(300)
    w.add(100.0, "a", 2)
    w.add(350.0, "a", 3)
    w.expire(399.0)
    assert w.get("a") == 5
    w.expire(400.0)  # 100 is now exactly one window old
    assert w.get("a") == 3
    w.expire(1000.0)
    assert w.get("a") is None and w.total() is None


def test_histogram_quantile_matches_prometheus_interpolation():
    bounds = (1.0, 2.0, 4.0)
    # 10 observations: 5 in (0,1], 5 in (1,2]; p50 rank 5 → end of first bucket; p75 → 1.5
    assert histogram_quantile(0.5, bounds, [5, 5, 0, 0]) == 1.0
    assert histogram_quantile(0.75, bounds, [5, 5, 0, 0]) == 1.5
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 3]) == 4.0  # +Inf bucket → highest bound
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_windowed_buckets_and_bucket_counts():
    wb = WindowedBuckets(60, (1.0, 2.0))
    wb.observe(0.0, ("m",), 0.5)
    wb.observe(30.0, ("m",), 1.5)
    assert wb.merged() == [1, 1, 0]
    wb.expire(61.0)
    assert wb.merged() == [0, 1, 0]
    assert bucket_counts((1, 2), [1, 1, 2, 3]) == ([2, 1, 1], 7.0)
