"""The Cache tiers page: is offloading paying off — the judgement, and the page over a real exporter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from console.tiers import LMCACHE_COLUMNS, cluster_summary, offload_row, offload_rows, verdict
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from exporter.web.api import ApiBuilders
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.thresholds import load_thresholds
from tests.console.test_pages import run, texts


def test_an_offload_tier_that_serves_a_tenth_of_the_cached_tokens_pays_off() -> None:
    row = offload_row({"worker": "w0", "resident_blocks_by_medium": {"GPU": 900, "CPU": 400},
                       "capacity_blocks_by_medium": {"GPU": 1000, "CPU": 800},
                       "hit_tokens_by_tier": {"device": 600.0, "host": 300.0, "disk": 100.0},
                       "external_queried_tokens": 1000.0, "external_hit_tokens": 400.0}, 100.0)
    assert row["offload_blocks"] == 400 and row["offload_fill"] == 0.5
    assert row["offload_hit_tokens"] == 400.0 and row["offload_share_of_cached"] == 0.4
    assert row["external_hit_ratio"] == 0.4
    assert row["hit_tokens_per_s_per_1k_blocks"] == 10.0  # 400 tokens / 100 s / 0.4k blocks
    assert row["verdict"] == "paying off: 40% of cached tokens come from offload"


def test_verdicts_tell_idle_from_unknown_and_marginal() -> None:
    assert verdict(500, 0.0, 0.0).kind == "idle"  # holds blocks, serves nothing
    assert verdict(500, None, None).kind == "unknown"  # hits not reported: never read as 0
    assert verdict(500, 5.0, 0.01).kind == "marginal"
    assert verdict(None, None, None).kind == "none"
    # without per-tier numbers the external connector's hits stand in
    row = offload_row({"worker": "w1", "resident_blocks_by_medium": {"GPU": 10},
                       "external_queried_tokens": 100.0, "external_hit_tokens": 25.0}, 60.0)
    assert row["offload_hit_tokens"] == 25.0 and row["offload_share_of_cached"] is None
    assert verdict(None, 25.0, None).kind == "paying"
    # a worker without any offload signal is left out
    assert offload_rows([{"worker": "w2", "resident_blocks_by_medium": {"GPU": 10}}], 60.0) == []
    assert cluster_summary([row]) == {"offload_blocks": None, "offload_hit_tokens": 25.0}


def test_lmcache_says_its_lookup_hit_ratio_and_times_where_it_runs() -> None:
    row = offload_row({"worker": "w0", "lmcache_lookup_queried_tokens": 1000.0, "lmcache_lookup_hit_tokens": 400.0,
                       "lmcache_seconds_p50": {"retrieve": 0.012, "lookup": 2e-4},
                       "lmcache_seconds_p99": {"retrieve": 0.2, "store": 0.05, "lookup": 0.004}}, 60.0)
    assert row["lmcache_lookup_hit_ratio"] == 0.4
    assert (row["lmcache_retrieve_p50_s"], row["lmcache_retrieve_p99_s"]) == (0.012, 0.2)
    assert (row["lmcache_store_p99_s"], row["lmcache_lookup_p99_s"]) == (0.05, 0.004)
    # a worker with LMCache alone (no offload tier in its KV events, no tier hits) is still shown
    assert [r["worker"] for r in offload_rows([{"worker": "w0", "lmcache_lookup_queried_tokens": 10.0,
                                                 "lmcache_lookup_hit_tokens": 0.0}], 60.0)] == ["w0"]
    # without LMCache every LMCache column is missing, never zero
    bare = offload_row({"worker": "w1", "external_queried_tokens": 100.0, "external_hit_tokens": 25.0}, 60.0)
    assert all(bare[k] is None for k in LMCACHE_COLUMNS)


def tiered_state() -> ClusterState:
    """w0 offloads to CPU and is served from it; w1 holds CPU blocks that serve nothing."""
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 130.0)
    for w in ("w0", "w1"):
        st.apply_kv_batch(KvBatch(w, 0, 100.0, (BlockStored(tuple(range(1, 101)), None, 16),
                                                BlockStored(tuple(range(1, 51)), None, 16, medium="CPU"))), 100.0)
    for t, served in ((100.0, 0.0), (120.0, 1.0)):
        st.observe_worker(WorkerSnapshot("w0", "vllm", model="m", num_gpu_blocks=200, offload_usage_ratio={"CPU": 0.5},
                                         tier_hit_tokens={"device": 600.0 * served, "host": 400.0 * served}), t)
        st.observe_worker(WorkerSnapshot("w1", "vllm", model="m", num_gpu_blocks=200,
                                         tier_hit_tokens={"device": 500.0 * served, "host": 0.0}), t)
    return st


@pytest.fixture
def tiers_exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    state = tiered_state()
    deps = ServerDeps(registry=CollectorRegistry(), api=ApiBuilders(state).routes(),
                      render_text=lambda: render_state(state))
    server = ExporterServer("127.0.0.1", 0, deps).start()
    monkeypatch.setenv(EXPORTER_ENV, server.url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    try:
        yield server.url
    finally:
        server.stop()


def test_the_cache_tiers_page_says_which_worker_the_offload_tier_pays_off_on(tiers_exporter: str) -> None:
    at = run("tiers")
    m = {x.label: x.value for x in at.metric}
    assert m["Offload blocks held"].startswith("100") and m["Workers paying off"] == "1 of 2"
    [frame] = [d.value for d in at.dataframe]
    rows = frame.set_index("Worker")
    assert rows.loc["w0", "Verdict"] == "paying off: 40% of cached tokens come from offload"
    assert rows.loc["w0", "Offload capacity"] == "100 blocks"  # 50 CPU blocks at 50 % used
    assert rows.loc["w1", "Verdict"] == "serves nothing in the window: not paying off"
    assert "Is offloading paying off?" in texts(at)
