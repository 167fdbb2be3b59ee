"""Router histograms read as histograms: each bucket's observations stay inside the router's own
bucket, placed by the increase's sum, so no bucket layout inflates a quantile.

Bucket layouts are the routers' real ones: Dynamo's routing-overhead histograms
(ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs @c7810b0, ``async_overhead_buckets``:
``exponential_buckets(0.01, 3.0, 17)`` milliseconds, for ``dynamo_router_overhead_indexer_find_matches_ms``)
and smg's match ratio (``smg_cache_aware_match_ratio``, decile buckets: smg-project/smg
model_gateway/src/observability/metrics.rs @f8daa88).
"""

from __future__ import annotations

import math

import pytest

from exporter.codecs import normalize
from exporter.core import checks
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.core.windows import histogram_quantile, increase
from exporter.model import CumulativeHistogram
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds

P = catalog.NAMESPACE
DYNAMO_ASYNC_MS = [0.01 * 3 ** i for i in range(17)]
DECILES = [round(0.1 * i, 10) for i in range(1, 11)]


def _fmt(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(b)


def dynamo_page(values_ms: list[float]) -> str:
    bounds = [*DYNAMO_ASYNC_MS, math.inf]
    lines = ["# TYPE dynamo_component_router_requests_total counter",
             f'dynamo_component_router_requests_total{{dynamo_namespace="ns",dynamo_component="router",router_id="r1"}} {len(values_ms)}',
             "# TYPE dynamo_router_overhead_indexer_find_matches_ms histogram"]
    lines += [f'dynamo_router_overhead_indexer_find_matches_ms_bucket{{router_id="r1",le="{_fmt(b)}"}} '
              f'{sum(v <= b for v in values_ms)}' for b in bounds]
    lines += [f'dynamo_router_overhead_indexer_find_matches_ms_sum{{router_id="r1"}} {sum(values_ms)!r}',
              f'dynamo_router_overhead_indexer_find_matches_ms_count{{router_id="r1"}} {len(values_ms)}']
    return "\n".join(lines) + "\n"


def smg_page(ratios: list[float]) -> str:
    bounds = [*DECILES, math.inf]
    lines = ["# TYPE smg_cache_aware_policy_branch_total counter",
             f'smg_cache_aware_policy_branch_total{{branch="tree_match"}} {len(ratios)}',
             "# TYPE smg_cache_aware_match_ratio histogram"]
    lines += [f'smg_cache_aware_match_ratio_bucket{{le="{_fmt(b)}"}} {sum(v <= b for v in ratios)}' for b in bounds]
    lines += [f"smg_cache_aware_match_ratio_sum {sum(ratios)!r}", f"smg_cache_aware_match_ratio_count {len(ratios)}"]
    return "\n".join(lines) + "\n"


def scraped(pages: list[str]) -> ClusterState:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300.0, clock=lambda: 1000.0)
    for i, page in enumerate(pages):
        snap, errors = normalize.parse_router("r", page)
        assert errors == []
        st.observe_router(snap, 1000.0 + 5 * i)
    return st


def walk_p99(st: ClusterState) -> float:
    bounds, counts = st.store.window_buckets(f"{P}_router_tree_walk_seconds")
    got = histogram_quantile(0.99, bounds, counts)
    assert got is not None
    return got


def catalogue_width_at(value: float) -> float:
    bounds = catalog.WALK_BUCKETS
    i = next(i for i, b in enumerate(bounds) if value <= b)
    return bounds[i] - (bounds[i - 1] if i else 0.0)


def test_every_dynamo_lookup_at_3_5_ms_reads_3_5_ms_and_raises_nothing() -> None:
    """3.5 ms sits in Dynamo's bucket (2.43, 7.29] ms; at that bucket's upper bound the p99 read
    7.5 ms and PrefixRouterTreeWalkSlow (5 ms) fired."""
    st = scraped([dynamo_page([]), dynamo_page([3.5] * 1000)])
    p99 = walk_p99(st)
    assert abs(p99 - 0.0035) <= catalogue_width_at(0.0035)
    result = checks.evaluate(st).results["prefix_tree_walk_latency"]
    assert result.value == pytest.approx(p99) and result.value < 0.005 and result.status != "fail"


def test_two_regimes_keep_their_own_buckets_and_the_sum() -> None:
    """Half the lookups at 0.5 ms, half at 3.5 ms, over two scrape intervals: each observation stays
    in the router bucket it was counted in, and the placed values add up to the router's sum."""
    fast, slow = [0.5] * 500, [3.5] * 500
    st = scraped([dynamo_page([]), dynamo_page(fast), dynamo_page(fast + slow)])
    bounds, counts = st.store.window_buckets(f"{P}_router_tree_walk_seconds")
    le = dict(zip(bounds, [sum(counts[: i + 1]) for i in range(len(bounds))], strict=False))
    assert le[5e-4] == 500 and le[2e-3] == 500 and le[5e-3] == 1000  # 0.5 ms and 3.5 ms, each on its side
    assert abs(walk_p99(st) - 0.0035) <= catalogue_width_at(0.0035)
    placed = increase(CumulativeHistogram((1.0, 10.0, math.inf), (500, 1000, 1000), 2000.0, 1000), None)
    assert sum(v * n for v, n in placed) == pytest.approx(2000.0)  # 500 × 0.5 + 500 × 3.5 in buckets (0,1], (1,10]
    assert all(0 < v <= 1.0 for v, _ in placed[:1]) and all(1.0 < v <= 10.0 for v, _ in placed[1:])


def test_smg_match_ratio_deciles_are_read_inside_the_decile() -> None:
    """0.82 in smg's (0.8, 0.9] decile: inside it, below the catalogue's 0.85 bound; at the upper
    bound it read 0.9."""
    st = scraped([smg_page([]), smg_page([0.82] * 200)])
    bounds, counts = st.store.window_buckets(f"{P}_router_predicted_hit_ratio")
    le = dict(zip(bounds, [sum(counts[: i + 1]) for i in range(len(bounds))], strict=False))
    assert le[0.8] == 0 and le[0.85] == 200


def test_increase_without_a_usable_sum_places_mid_bucket_and_handles_resets() -> None:
    a = CumulativeHistogram((0.005, 0.01, math.inf), (2, 3, 3), 0.006, 3)
    b = CumulativeHistogram((0.005, 0.01, math.inf), (5, 6, 8), math.nan, 8)
    assert increase(b, a) == [(0.0025, 3.0), (0.01, 2.0)]  # 2 above the top bound land on it
    c = CumulativeHistogram((0.005, 0.01, math.inf), (1, 1, 1), 0.004, 1)
    assert increase(c, b) == [(0.004, 1.0)]  # counts went down: a restart, read from zero
