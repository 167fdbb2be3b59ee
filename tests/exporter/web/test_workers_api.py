"""/api/v1/workers: one row per worker the exporter follows, computed by hand from laid-out inputs.

Times in seconds; the exporter's clock stands at 1000, health recency is 60 s, window 300 s.
  900  scrapes of w0, w1, w2 answer (up = 1): 100 GPU blocks each, 16 tokens per block; w0's
       counters start at 0 queried / 0 hit, tiers device 0, host 0
  905  w3 (no scrape target) serves one request: 64 prompt, 16 cached — then says nothing more
  920  KV: each of w0..w3 stores its own 2-block chain on the GPU; w0 also offloads 1 block to CPU;
       w1's stream skipped a batch (1 sequence gap, 2 missed batches, recovered by the replay)
  950  w1, w2 each serve one request: 64 prompt, cached w1 32, w2 8
  960  the scrapes of w1 and w2 fail (up = 0); a request on w0 at 961 (64 prompt, 0 cached by
       the engine's record; w0's hits come from its counters) makes the exporter note it
  970  w1 still serves (64 prompt, 32 cached): down, not gone; w2 serves nothing after: left
  990  w0 scraped again: 200 queried, 150 hit since 900 (tiers: device 120, host 30)

Liveness: w0 up (scraped at 990); w1 down (fails its scrape, traffic at 970); w2 left (fails,
no traffic since 960); w3 left (silent since its KV batch at 920, past the 60 s health recency).
Hit tokens in the window: w0 150 (its counters), w1 64 (records: 32 + 32), w2 8, w3 16 → 238.
Effective cache value = resident blocks × 16 × hit ratio: w0 3 × 16 × 150/200 = 36, w1 2 × 16 ×
64/128 = 16, w2 2 × 16 × 8/64 = 4, w3 2 × 16 × 16/64 = 8. The exporter ranks w2 and w3 lowest,
but they left the pool: only w1 (1) and w0 (2) are ranked.
"""

from __future__ import annotations

import pytest

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, RouterSnapshot, WorkerSnapshot
from exporter.web.api import ApiBuilders
from prefixscope.thresholds import load_thresholds

NOW = 1_000.0


def _scrape(state: ClusterState, health: Health, worker: str, ts: float, queried: float = 0.0, hit: float = 0.0,
            tiers: dict[str, float] | None = None) -> None:
    health.set("prefixscope_up", (worker, "worker"), 1.0)
    state.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=queried,
                                        prefix_hit_tokens=hit, num_gpu_blocks=100, block_size=16,
                                        tier_hit_tokens=tiers), ts)


def _record(ts: float, rid: str, worker: str, cached: int) -> dict:
    return {"ts": ts, "request_id": rid, "worker": worker, "model": "m", "prompt_tokens": 64, "cached_tokens": cached}


def build() -> tuple[ClusterState, Health]:
    health = Health()
    state = ClusterState.build(health, load_thresholds(), clock=lambda: NOW)
    _scrape(state, health, "w0", 900.0, tiers={"device": 0.0, "host": 0.0})
    for w in ("w1", "w2"):
        _scrape(state, health, w, 900.0)
    state.ingest_records([_record(905.0, "a3", "w3", 16)], 905.0)
    for i, w in enumerate(("w0", "w1", "w2", "w3")):
        chain = (0x100 * (i + 1) + 1, 0x100 * (i + 1) + 2)
        events: tuple = (BlockStored(chain, None, 16),)
        if w == "w0":
            events += (BlockStored((0x901,), None, 16, medium="CPU"),)
        state.apply_kv_batch(KvBatch(w, 0, 920.0, events), 920.0)
    health.update([("prefixscope_kv_event_sequence_gaps", ("w1",), 1.0),
                   ("prefixscope_kv_event_missed_batches", ("w1",), 2.0)])
    state.ingest_records([_record(950.0, "b1", "w1", 32), _record(950.0, "b2", "w2", 8)], 950.0)
    for w in ("w1", "w2"):
        health.set("prefixscope_up", (w, "worker"), 0.0)
    state.ingest_records([_record(961.0, "c0", "w0", 0)], 961.0)
    state.ingest_records([_record(970.0, "d1", "w1", 32)], 970.0)
    _scrape(state, health, "w0", 990.0, queried=200.0, hit=150.0, tiers={"device": 120.0, "host": 30.0})
    return state, health


def rows(state: ClusterState) -> tuple[dict, dict[str, dict]]:
    data = ApiBuilders(state).routes()["workers"]({})
    return data, {r["worker"]: r for r in data["workers"]}


def test_each_worker_is_up_down_or_left_with_its_scrape_and_down_times() -> None:
    data, by = rows(build()[0])
    assert (data["evaluated_at"], data["window_s"], data["pool_size"]) == (NOW, 300.0, 1)
    assert {w: r["liveness"] for w, r in by.items()} == {"w0": "up", "w1": "down", "w2": "left", "w3": "left"}
    assert [by[w]["last_scrape_at"] for w in ("w0", "w1", "w2", "w3")] == [990.0, 900.0, 900.0, None]
    assert (by["w0"]["down_since"], by["w1"]["down_since"], by["w2"]["down_since"]) == (None, 961.0, 961.0)
    assert (by["w1"]["last_served"], by["w3"]["last_seen"]) == (970.0, 920.0)  # w3's KV batch is its last sign


def test_cache_per_medium_against_capacity_and_hits_per_tier() -> None:
    _, by = rows(build()[0])
    w0 = by["w0"]
    assert (w0["resident_blocks"], w0["capacity_blocks"]) == (2, 100)  # the GPU's blocks against the GPU's capacity
    assert w0["resident_blocks_by_medium"] == {"GPU": 2, "CPU": 1}
    assert by["w1"]["resident_blocks_by_medium"] == {"GPU": 2, "CPU": 0}
    assert w0["hit_tokens_by_tier"] == {"device": 120.0, "host": 30.0}
    assert by["w1"]["hit_tokens_by_tier"] is None  # the engine reports no tiers: missing, not 0


def test_hit_share_and_a_removal_ranking_without_the_workers_that_left() -> None:
    _, by = rows(build()[0])
    assert {w: r["hit_tokens"] for w, r in by.items()} == {"w0": 150.0, "w1": 64.0, "w2": 8.0, "w3": 16.0}
    assert {w: r["hit_share"] for w, r in by.items()} == pytest.approx(
        {"w0": 150 / 238, "w1": 64 / 238, "w2": 8 / 238, "w3": 16 / 238})
    assert {w: r["effective_cache_value_tokens"] for w, r in by.items()} == pytest.approx(
        {"w0": 36.0, "w1": 16.0, "w2": 4.0, "w3": 8.0})
    assert {w: r["removal_rank"] for w, r in by.items()} == {"w0": 2, "w1": 1, "w2": None, "w3": None}


def test_kv_stream_health_per_worker() -> None:
    _, by = rows(build()[0])
    assert by["w1"]["kv_stream"] == {
        "last_event_at": 920.0, "lag_s": 0.0, "batches": 1.0, "sequence_gaps": 1.0, "missed_batches": 2.0,
        "lost_batches": 0.0, "repairs": 0.0, "restarts": 0.0, "unknown_parent": 0.0, "unknown_block_removals": 0.0,
        "view_unreliable": False}
    assert by["w0"]["kv_stream"]["sequence_gaps"] == 0.0  # a stream with no gap reads 0


def test_a_worker_without_a_kv_stream_has_its_health_missing_not_zero() -> None:
    health = Health()
    state = ClusterState.build(health, load_thresholds(), clock=lambda: NOW)
    state.ingest_records([_record(990.0, "a", "r0", 16)], 990.0)
    _, by = rows(state)
    assert set(by["r0"]["kv_stream"].values()) == {None}
    assert (by["r0"]["liveness"], by["r0"]["resident_blocks"], by["r0"]["capacity_blocks"]) == ("up", None, None)


def test_a_worker_a_router_marks_unhealthy_is_down_while_it_serves_then_left() -> None:
    health = Health()
    state = ClusterState.build(health, load_thresholds(), clock=lambda: NOW)
    state.ingest_records([_record(900.0, "a", "w0", 16), _record(900.0, "b", "w1", 16)], 900.0)
    state.observe_router(RouterSnapshot("r", "vllm-router", decisions={"w0": 1.0, "w1": 1.0},
                                        healthy={"w0": 1.0, "w1": 0.0}), 930.0)
    state.ingest_records([_record(940.0, "c", "w1", 16), _record(940.0, "d", "w0", 16)], 940.0)
    assert {w: r["liveness"] for w, r in rows(state)[1].items()} == {"w0": "up", "w1": "down"}
    state.ingest_records([_record(1_010.0, "e", "w0", 16)], 1_010.0)  # w1: no traffic for 70 s
    assert {w: r["liveness"] for w, r in rows(state)[1].items()} == {"w0": "up", "w1": "left"}
