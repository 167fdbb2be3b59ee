"""Worker liveness from the exporter's series (pure): up, down, left the pool, unknown."""

from __future__ import annotations

from console.liveness import LEFT, PoolView, classify, largest_sample, pool_view_from_text
from console.tree_view import hot_branch_rows, removal_ranking

METRICS = """# HELP prefixscope_up 1 if the last scrape of the target succeeded, 0 if it failed.
# TYPE prefixscope_up gauge
prefixscope_up{kind="worker",target="w0"} 1.0
prefixscope_up{kind="worker",target="w1"} 0.0
prefixscope_up{kind="router",target="r0"} 1.0
# TYPE prefixscope_router_worker_healthy gauge
prefixscope_router_worker_healthy{router="r0",worker="w2"} 0.0
prefixscope_telemetry_blind_targets 0.0
prefixscope_kv_event_last_timestamp_seconds{worker="w0"} 940.0
prefixscope_worker_pool_size 1.0
prefixscope_worker_resident_blocks{worker="w0"} 4.0
"""


def test_the_view_reads_only_the_health_series() -> None:
    assert pool_view_from_text(METRICS) == PoolView({"w0": 1.0, "w1": 0.0}, {"w2": 0.0}, frozenset({"w0"}), 0.0, 1.0)


def test_down_workers_that_no_longer_blind_us_have_left() -> None:
    view = pool_view_from_text(METRICS)
    assert classify(["w0", "w1", "w2"], view) == {"w0": "up", "w1": LEFT, "w2": LEFT}
    # A down target still counted as blind, and still streaming KV events: down, not gone.
    blind = PoolView({"w0": 1.0, "w1": 0.0}, {}, frozenset({"w0", "w1"}), 1.0, 1.0)
    assert classify(["w0", "w1"], blind) == {"w0": "up", "w1": "down"}


def test_without_per_worker_health_the_pool_size_decides_what_it_can() -> None:
    assert classify(["a", "b"], PoolView(pool_size=2.0)) == {"a": "up", "b": "up"}
    assert classify(["a", "b", "c"], PoolView(pool_size=2.0), served=["a", "c"]) == {"a": "up", "b": LEFT, "c": "up"}
    assert classify(["a", "b", "c"], PoolView(pool_size=2.0), served=["a"]) == {"a": "unknown", "b": "unknown", "c": "unknown"}
    assert classify(["a"], PoolView()) == {"a": "unknown"}


def test_workers_that_left_are_neither_ranked_nor_holders() -> None:
    workers = [{"worker": w, "removal_rank": r, "effective_cache_value_tokens": v}
               for w, r, v in (("w0", 2, 20.0), ("w1", 1, 10.0), ("w2", 3, 30.0))]
    live = {"w0": "up", "w1": LEFT, "w2": "down"}
    ranked = removal_ranking(workers, live)
    assert [(r["worker"], r["removal_rank"]) for r in ranked] == [("w0", 1), ("w2", 2)]
    rows = hot_branch_rows([{"branch": "b", "workers": ["w0", "w1", "w2"]}], live)
    assert [(r["branch"], r["prefix"], r["workers"]) for r in rows] == [("b", "—", "w0, w2")]


def test_the_largest_sample_of_one_family() -> None:
    text = ('# TYPE prefixscope_router_tree_fill_ratio gauge\nprefixscope_router_tree_fill_ratio{router="a"} 0.25\n'
            'prefixscope_router_tree_fill_ratio{router="b"} 0.75\nprefixscope_router_tree_fill_ratio_other 9\n')
    assert largest_sample(text, "prefixscope_router_tree_fill_ratio") == 0.75
    assert largest_sample(text, "prefixscope_up") is None
