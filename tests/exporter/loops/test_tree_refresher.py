"""Tree statistics off the scrape path: explicit refresh, stale-until-refreshed reads, the background thread."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from exporter.config import Config
from exporter.core import checks
from exporter.core import state as state_module
from exporter.core.health import Health
from exporter.core.index.prefix_index import PrefixIndex, ReferencePrefixIndex, compute_stats
from exporter.core.state import ClusterState
from exporter.loops.tree_refresher import TreeStatsRefresher
from exporter.main import Runtime
from exporter.model import BlockRemoved, BlockStored, KvBatch
from exporter.web import api
from exporter.web.exposition import render_state
from prefixscope.thresholds import load_thresholds

P = "prefixscope"


def stored(hashes, parent=None):
    return BlockStored(tuple(hashes), parent, 16)


def fed_state() -> ClusterState:
    # w0: 1-2-3 and 2-4 ; w1: 1-2  → runs [1,2] → [3], [4]: 3 nodes, 4 blocks, 2 of them on both
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 200.0)
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (stored([1, 2, 3]), stored([4], parent=2))), 100.0)
    st.apply_kv_batch(KvBatch("w1", 0, 99.0, (stored([1, 2]),)), 100.0)
    return st


def tree_gauges(st: ClusterState) -> dict[str, float | None]:
    series = st.snapshot_for(lambda s: s.series())
    return {name: series.gauges.get(f"{P}_prefix_tree_{name}", {}).get(()) for name in ("nodes", "blocks", "root_fanout")}


def test_statistics_become_visible_after_an_explicit_refresh_and_stay_until_the_next():
    st = fed_state()
    # Before any pass the tree is missing (no samples), not zero; the KV signal itself is there.
    assert tree_gauges(st) == {"nodes": None, "blocks": None, "root_fanout": None}
    text = render_state(st)
    assert b'prefixscope_signal_available{signal="kv_events"} 1.0' in text
    assert b"\nprefixscope_prefix_tree_nodes " not in text
    assert b"prefixscope_prefix_tree_leaf_depth_bucket" not in text

    first = st.refresh_tree_stats()
    assert tree_gauges(st) == {"nodes": 3.0, "blocks": 4.0, "root_fanout": 1.0}
    assert sorted(first.leaf_depths.elements()) == [2, 2] and first.replicas == {2: 2, 1: 2}
    text = render_state(st)
    assert b"\nprefixscope_prefix_tree_nodes 3.0\n" in text
    assert b'prefixscope_prefix_tree_block_replicas_bucket{le="2.0"} 4.0' in text

    # New blocks: readers keep serving the latest completed pass until the next refresh.
    st.apply_kv_batch(KvBatch("w1", 1, 101.0, (stored([5], parent=2),)), 101.0)
    assert tree_gauges(st) == {"nodes": 3.0, "blocks": 4.0, "root_fanout": 1.0}
    assert st.tree_stats() is first
    second = st.refresh_tree_stats()
    assert second is not first and second.version == st.index.version
    assert tree_gauges(st) == {"nodes": 4.0, "blocks": 5.0, "root_fanout": 1.0}
    assert st.refresh_tree_stats() is second  # unchanged index: no new pass
    timing = st.tree_stats_timing
    assert timing is not None and timing.blocks == 5 and timing.held_s >= 0 and timing.pass_s >= 0


def test_no_reader_ever_runs_a_pass(monkeypatch: pytest.MonkeyPatch):
    st = fed_state()
    st.ingest_records([{"ts": 101, "request_id": "a", "worker": "w0", "prompt_tokens": 64,
                        "block_hashes": [1, 2, 3], "cached_tokens": 48, "session_key": "s"}], 101)
    st.refresh_tree_stats()
    st.apply_kv_batch(KvBatch("w0", 1, 102.0, (stored([6], parent=3),)), 102.0)  # the index moved on
    passes: list[int] = []
    real = state_module.compute_stats

    def counted(tree, depth=0):
        passes.append(tree.version)
        return real(tree, depth)

    monkeypatch.setattr(state_module, "compute_stats", counted)
    routes = api.ApiBuilders(st).routes()
    render_state(st)
    checks.evaluate(st)
    for name in ("groups", "hotspots", "changes"):
        routes[name]({})
    tree = routes["tree"]({})  # the default depth is covered by the background pass's child lists
    assert passes == []
    assert tree["stats"]["blocks"] == 4  # the latest pass, taken before block 6 arrived
    assert routes["hotspots"]({})["duplication"]["blocks_on_2"] == 2


def test_a_deeper_tree_request_gets_a_pass_of_its_own():
    # 1-2-…-8 on w0, and a sibling leaf under each of 1..7 on w1: block 8 sits 8 radix edges deep.
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 200.0)
    chain = list(range(1, 9))
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (stored(chain),)), 100.0)
    st.apply_kv_batch(KvBatch("w1", 0, 99.0, tuple(stored([100 + k], parent=k) for k in range(1, 8))), 100.0)
    st.refresh_tree_stats()

    def deepest(node, level=0):
        return max([level, *(deepest(c, level + 1) for c in node["children"])])

    routes = api.ApiBuilders(st).routes()
    assert deepest(routes["tree"]({"depth": "4"})["root"]) == 4
    assert deepest(routes["tree"]({"depth": "10"})["root"]) == 8
    assert routes["tree"]({"depth": "10"})["stats"]["nodes"] == 15  # 8 on the chain + 7 siblings


def test_tree_request_before_any_pass_reports_missing_statistics():
    out = api.ApiBuilders(fed_state()).routes()["tree"]({})
    assert out["stats"] == {"nodes": None, "blocks": None, "root_fanout": None, "depth_p99": None,
                            "block_depth_p99": None}
    hot = api.ApiBuilders(fed_state()).routes()["hotspots"]({})
    assert hot["duplication"]["duplicated_share"] is None and hot["fanout"]["root_fanout"] is None


def test_a_completed_reading_is_fixed_so_later_ingest_changes_nothing():
    idx = PrefixIndex()
    idx.apply("w0", [stored([1, 2, 3])])
    reading = idx.stats_pass()
    while not reading.step():
        pass
    idx.apply("w0", [stored([4], parent=2), stored([9])])
    s = compute_stats(reading)
    assert (s.version, s.blocks, s.nodes, s.leaf_block_depths) == (1, 3, 1, {3: 1})
    now = idx.stats()
    assert (now.blocks, now.root_fanout, sorted(now.leaf_block_depths.elements())) == (5, 2, [1, 3, 3])


def test_a_reading_is_one_step_with_the_statistics_of_that_moment():
    # The reference copies its dicts in one step; the compiled index settles the depth shifts
    # its ``apply`` left queued (the split at block 20: a few blocks a step here), then reads the
    # statistics it keeps at apply time in one step. Ingest after the last step changes none of
    # the reading's numbers (a reference index fed the same batches says what they are).
    idx, ref = PrefixIndex(), ReferencePrefixIndex()

    def apply(worker, events):
        idx.apply(worker, events)
        ref.apply(worker, events)

    apply("w0", [stored(range(1, 41)), stored([50, 51], parent=20)])
    reading = idx.stats_pass()
    steps = 1
    while not reading.step(8):
        steps += 1
    assert steps == (1 if PrefixIndex is ReferencePrefixIndex else 3)  # 21..40 shift: 20 blocks, 8 a step
    want = ref.stats(2)
    apply("w0", [BlockRemoved((3,)), stored([100, 101], parent=5), stored([102])])
    apply("w1", [stored([1, 2])])
    s = compute_stats(reading, 2)
    fields = ("blocks", "nodes", "root_fanout", "fanouts", "replicas", "leaf_depths", "leaf_block_depths")
    assert [getattr(s, f) for f in fields] == [getattr(want, f) for f in fields]
    assert set(s.branching) == set(want.branching) == {20}
    again = idx.stats(2)
    want = ref.stats(2)
    assert (again.leaf_depths, again.leaf_block_depths, set(again.branching)) == (
        want.leaf_depths, want.leaf_block_depths, set(want.branching))
    assert {k: sorted(v) for k, v in again.children.items()} == {k: sorted(v) for k, v in want.children.items()}


def test_the_refresh_settles_then_reads_in_short_holds(monkeypatch: pytest.MonkeyPatch):
    st = fed_state()
    st.apply_kv_batch(KvBatch("w0", 1, 101.0, (stored(range(1000, 1200)),)), 101.0)
    holds = []
    real = state_module.pass_in_slices

    def small_slices(index, lock, max_blocks=0):
        tree, timing = real(index, lock, 16)
        holds.append(timing)
        return tree, timing

    monkeypatch.setattr(state_module, "pass_in_slices", small_slices)
    s = st.refresh_tree_stats()
    assert s.blocks == 204 and s.version == st.index.version
    timing = st.tree_stats_timing
    assert timing is not None and timing.slices == holds[0].slices and timing.max_hold_s <= timing.held_s
    st.apply_kv_batch(KvBatch("w0", 2, 102.0, (stored([1300]),)), 102.0)  # nothing to settle: one hold
    s = st.refresh_tree_stats()
    assert s.blocks == 205 and st.tree_stats_timing.slices == 1


def test_background_refresher_picks_up_changes_and_stops():
    st = fed_state()
    refresher = TreeStatsRefresher(st, interval=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while st.tree_stats() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.tree_stats() is not None and st.tree_stats().blocks == 4
        st.apply_kv_batch(KvBatch("w1", 1, 101.0, (stored([5], parent=2),)), 101.0)
        while st.tree_stats().blocks != 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.tree_stats().blocks == 5
    finally:
        refresher.close(timeout=5)
    assert not refresher.running
    with pytest.raises(ValueError):
        TreeStatsRefresher(st, interval=0)


def test_runtime_serves_background_statistics_and_its_thread_stops_with_it():
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0", tree_stats_interval=0.05)).start()
    try:
        assert runtime.refresher.running
        runtime.state.apply_kv_batch(KvBatch("w0", 0, time.time(), (stored([1, 2, 3]),)), time.time())
        deadline = time.monotonic() + 10
        body = b""
        while time.monotonic() < deadline:
            body = requests.get(runtime.url + "/metrics", timeout=5).content
            if b"\nprefixscope_prefix_tree_blocks 3.0\n" in body:
                break
            time.sleep(0.02)
        assert b"\nprefixscope_prefix_tree_blocks 3.0\n" in body
    finally:
        runtime.stop()
    assert not runtime.refresher.running
    assert "prefixscope-tree-stats" not in {t.name for t in threading.enumerate()}
