"""The collector: promtool-clean exposition, every catalogue metric when all inputs are present."""

import math
import subprocess

import msgpack
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter.codecs import kvcodec
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import (
    BlockRemoved,
    BlockStored,
    CumulativeHistogram,
    KvBatch,
    RouterSnapshot,
    WorkerSnapshot,
)
from exporter.web.collector import PrefixscopeCollector
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds
from tests.support import require_tool


class Topo:
    """A two-worker topology with the attributes the state reads."""

    class W:
        def __init__(self, name, node, warm):
            self.name, self.node, self.nvlink_domain, self.gpu_class = name, node, node + "-d0", "H100"
            self.gpus, self.price_per_gpu_hour, self.warm_pool, self.kv_blocks, self.max_concurrency = 2, 3.6, warm, 100, 8

    def __init__(self):
        self.block_size = 16
        self._w = {"w0": self.W("w0", "n0", True), "w1": self.W("w1", "n1", False)}
        self.warm_pool = ("w0",)
        self.workers = tuple(self._w.values())

    def __contains__(self, n):
        return n in self._w

    def worker(self, n):
        return self._w[n]

    def domain_of(self, n):
        return self._w[n].nvlink_domain


def full_state() -> ClusterState:
    h = Health()
    st = ClusterState.build(h, load_thresholds(), topology=Topo(), clock=lambda: 200.0)
    h.set("prefixscope_up", ("w0", "worker"), 1)
    h.set("prefixscope_scrape_duration_seconds", ("w0", "worker"), 0.01)
    h.inc("prefixscope_ingest_errors", ("records", "schema"), 0)
    h.inc("prefixscope_records_ingested", ("http",), 3)
    for name in ("kv_event_sequence_gaps", "kv_event_missed_batches", "kv_event_lost_batches"):
        h.inc(f"prefixscope_{name}", ("w0",), 0)
    h.inc("prefixscope_kv_event_replays", ("w0", "recovered"), 0)
    # service discovery and config reloads (exporter.sources.discovery.manager, exporter.follow)
    h.inc("prefixscope_discovery_refresh_failures", ("fleet",), 0)
    h.set("prefixscope_discovery_targets", ("fleet",), 1.0)
    h.set("prefixscope_discovery_last_success_timestamp_seconds", ("fleet",), 100.0)
    h.set("prefixscope_config_last_reload_successful", (), 1.0)
    h.set("prefixscope_config_last_reload_success_timestamp_seconds", (), 100.0)
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2, 3), None, 16, token_ids=tuple(range(48))),
                                              BlockStored((4,), 2, 16))), 100.0)
    # block 32 (a sampled hash) is evicted and stored again: thrash and an eviction age
    st.apply_kv_batch(KvBatch("w0", 1, 99.5, (BlockStored((32,), None, 16), BlockRemoved((32,)),
                                              BlockStored((32,), None, 16))), 100.5)
    # a tenant's chain on a LoRA adapter (vLLM's lora_name and cache salt), decoded with attribution
    st.apply_kv_batch(kvcodec.decode_batch(msgpack.packb([100.6, [
        {"type": "BlockStored", "block_hashes": [40, 41], "parent_block_hash": None, "token_ids": [1] * 32,
         "block_size": 16, "lora_name": "sql", "extra_keys": [["sql", "acme"], ["sql"]]},
        {"type": "BlockStored", "block_hashes": [40, 41], "parent_block_hash": None, "token_ids": [1] * 32,
         "block_size": 16, "medium": "CPU"}], 0]), "w0", 2,
        attribution=True), 100.6)
    for t, q, hits in ((100, 100, 50), (110, 300, 150)):
        # the engine's histograms (vLLM's sampled residency, LMCache's times): one observation per scrape
        seen = CumulativeHistogram((10.0, math.inf), (q // 100, q // 100), 5.0 * (q // 100), q // 100)
        st.observe_worker(WorkerSnapshot("w0", "vllm", model="m", prefix_queried_tokens=q, prefix_hit_tokens=hits,
                                         kv_usage_ratio=0.5, num_gpu_blocks=100, block_size=16, running=2,
                                         max_running=8, spec_draft_tokens=q, spec_accepted_tokens=hits,
                                         external_queried_tokens=q, external_hit_tokens=hits,
                                         tier_hit_tokens={"device": hits, "host": 0.0},
                                         offload_usage_ratio={"CPU": 0.5},
                                         residency={k: seen for k in ("lifetime", "idle_before_evict", "reuse_gap")},
                                         lmcache_seconds={"retrieve": seen}, lmcache_lookup_tokens=q,
                                         lmcache_lookup_hit_tokens=hits), t)
    for t, n in ((105, 1), (110, 3)):  # a router's predicted match ratio: a baseline, then two more requests
        ratio = CumulativeHistogram((0.5, 1.0, math.inf), (0, n, n), 0.9 * n, n)
        lag = CumulativeHistogram((0.01, math.inf), (n, n), 0.005 * n, n)
        st.observe_router(RouterSnapshot("r", "sglang-router", {"w0": 3}, {"w0": 1}, {"hit": 2, "miss": 1},
                                         predicted_hit_ratio=ratio, kv_event_lag_seconds=lag,
                                         sticky_followups={("manual", "kept"): n, ("manual", "collision"): 0.0},
                                         index_faults={"gap_unrecovered": n}, regret_selections=n,
                                         regret_blocks=4.0 * n, routed_requests=10.0 * n,
                                         largest_tree=1024.0 * n, tree_bound=4096.0,
                                         engine_hit_ratio={"w0": 0.5},
                                         overhead_seconds={"find_matches": lag}), t)
    base = {"model": "m", "block_hashes": [1, 2, 3, 9], "cached_tokens": 0, "predicted_cached_tokens": 32,
            "prefill_s": 0.5, "queue_s": 0.1, "walk_s": 0.001, "async_wait_s": 1.0, "expert_signature": "e1",
            "admitted_by_affinity": True, "fallback_tier": "warm_pool", "segment": "web", "session_key": "s",
            "lora_name": "sql", "tenant": "acme"}
    st.ingest_records([
        {**base, "ts": 111, "request_id": "1", "worker": "w0", "prompt_tokens": 64, "ttft_s": 0.6},
        {**base, "ts": 112, "request_id": "2", "worker": "w1", "prompt_tokens": 64, "cached_tokens": 48,
         "migrated_from": "w0", "migration_kind": "soft"},
        {**base, "ts": 113, "request_id": "3", "worker": "w0", "prompt_tokens": 64, "cached_tokens": 32},
    ], 113)
    st.refresh_tree_stats()  # as the runtime's background refresher does
    return st


def exposition(st: ClusterState) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st, st.health))
    return generate_latest(reg).decode()


def test_every_catalogue_metric_appears_when_all_inputs_are_present():
    text = exposition(full_state())
    # the exporter's own series (source "self") are exporter.web.process_metrics', not the state's
    missing = [m.name for m in catalog.METRICS if m.source != "self" and f"\n{m.sample_name}" not in text
               and f"\n{m.name}_bucket" not in text and f"\n{m.name}{{" not in text]
    # the reshuffle ratio only after a pool change; missed requests are judged only against a
    # cold-prefill baseline, which ends one window ago (none yet)
    assert missing == [f"{catalog.NAMESPACE}_{n}" for n in (
        "session_reshuffle_ratio", "missed_requests", "missed_requests_within_baseline")]


def test_absent_signal_is_not_emitted_and_flagged():
    st = ClusterState.build(Health(), load_thresholds())
    text = exposition(st)
    assert 'prefixscope_signal_available{signal="kv_events"} 0.0' in text
    assert "prefixscope_worker_resident_blocks" not in text


@pytest.mark.slow
def test_promtool_check_metrics_is_clean():
    out = subprocess.run([require_tool("promtool"), "check", "metrics"], input=exposition(full_state()).encode(),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert out.stdout.decode().strip() == "" and out.stderr.decode().strip() == ""
