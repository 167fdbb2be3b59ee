"""ClusterState metrics against hand-computed values on crafted records and KV batches."""

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockRemoved, BlockStored, KvBatch
from prefixscope.thresholds import load_thresholds

P = "prefixscope"
SYS = [1, 2]  # a shared two-block system prompt


def make() -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), window_s=300)


def rec(ts, rid, worker, prompt, **kw):
    return {"ts": ts, "request_id": rid, "worker": worker, "prompt_tokens": prompt, **kw}


def test_followups_collisions_and_session_ratio():
    st = make()
    st.ingest_records([
        rec(100, "a1", "w0", 64, session_key="a", cached_tokens=0),
        rec(101, "b1", "w1", 64, session_key="b", cached_tokens=0),
        rec(110, "a2", "w0", 100, session_key="a", cached_tokens=80),  # sticky
        rec(120, "a3", "w1", 100, session_key="a", cached_tokens=20),  # w0 still healthy: collision
    ], 120)
    c = st.store.cum.counters
    assert c[f"{P}_followup_requests"][("unknown",)] == 2
    assert c[f"{P}_sticky_collisions"][("unknown",)] == 1
    assert c[f"{P}_session_followup_prompt_tokens"][("unknown",)] == 200
    assert c[f"{P}_session_followup_cached_tokens"][("unknown",)] == 100
    assert st.session_hit_ratios() == [0.5]


def test_rekey_detected_beyond_shared_system_prompt():
    st = make()
    st.ingest_records([
        rec(100, "a1", "w0", 64, session_key="a", block_hashes=[*SYS, 10], segment="web"),
        rec(101, "b1", "w0", 64, session_key="b", block_hashes=[*SYS, 20], segment="web"),  # unrelated
        rec(102, "a2", "w0", 96, session_key="a", block_hashes=[*SYS, 10, 11, 12], segment="web"),
        # cookie reset: the conversation of "a" continues under "c"
        rec(103, "c1", "w0", 112, session_key="c", block_hashes=[*SYS, 10, 11, 12, 13], segment="web"),
    ], 103)
    assert st.store.cum.counters[f"{P}_session_rekeys"][("web",)] == 1
    assert st.sessions.shared_depth == 2


def test_reuse_decomposition_and_staleness():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2, 3), None, 16),)), 99.0)
    st.ingest_records([rec(100, "r", "w1", 64, block_hashes=[1, 2, 3, 4], block_size=16,
                           cached_tokens=16, predicted_cached_tokens=40)], 100)
    c = st.store.cum.counters
    assert c[f"{P}_reuse_available_tokens"][("unknown",)] == 48
    assert c[f"{P}_reuse_achieved_tokens"][("unknown",)] == 16
    assert c[f"{P}_index_staleness_tokens"][("unknown",)] == 24


def test_cold_prefill_and_miss_cost():
    st = make()
    st.ingest_records([
        rec(100, "c", "w0", 1000, cached_tokens=50, prefill_s=2.0, queue_s=0.5),  # 5% reused: cold
        rec(101, "w", "w0", 1000, cached_tokens=900, prefill_s=0.1),  # warm
    ], 101)
    assert st.store.cum.counters[f"{P}_cold_requests"][("unknown",)] == 1
    assert st.store.cum.counters[f"{P}_cold_prefill_gpu_seconds"][("unknown",)] == 2.0
    assert f"{P}_cold_prefill_cost_usd" not in st.store.cum.counters  # no topology: no price, no cost
    miss = st.store.cum.histograms[f"{P}_prefix_miss_cost_seconds"][("unknown",)]
    assert miss[-1] == 2.5 and sum(miss[:-1]) == 1


def test_kv_health_counters_and_restart():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2), 7, 16),)), 100.0)
    h = st.health
    assert h.counter_value(f"{P}_kv_event_unknown_parent", ("w0",)) == 1
    assert h.gauges[f"{P}_kv_event_lag_seconds"][("w0",)] == 1.0
    st.worker_restarted("w0")
    assert st.index.resident_blocks("w0") == 0
    assert h.counter_value(f"{P}_worker_restarts", ("w0",)) == 1


def test_signals_absent_until_a_source_carries_them():
    st = make()
    assert not any(st.signals().values())
    st.ingest_records([rec(100, "r", "w0", 10, walk_s=0.001)], 100)
    s = st.signals()
    assert s["records"] and s["walk_latency"] and not s["session_key"] and not s["kv_events"]


def test_migration_signal_from_null_fields_reads_zero_not_missing():
    st = make()
    st.ingest_records([rec(100, "r1", "w0", 64, migrated_from=None, migration_kind=None)], 100)
    assert st.signals()["migrations"] is True
    c = st.store.cum.counters
    assert c[f"{P}_session_migrations"] == {("soft",): 0.0, ("hard",): 0.0}
    # a measurement field written as null has not been measured: still missing
    st.ingest_records([rec(101, "r2", "w0", 64, cached_tokens=None)], 101)
    assert st.signals()["cached_tokens"] is False
    st.ingest_records([rec(102, "r3", "w1", 64, migrated_from="w0", migration_kind="soft")], 102)
    assert c[f"{P}_session_migrations"] == {("soft",): 1.0, ("hard",): 0.0}


def test_records_without_migration_fields_leave_the_signal_missing():
    st = make()
    st.ingest_records([rec(100, "r1", "w0", 64)], 100)
    assert st.signals()["migrations"] is False
    assert f"{P}_session_migrations" not in st.store.cum.counters


def _up(st: ClusterState, target: str, kind: str, value: float) -> None:
    st.health.set(f"{P}_up", (target, kind), value)


def test_a_down_worker_blinds_us_only_while_traffic_still_reaches_it():
    st = make()
    st.ingest_records([rec(100, "r1", "w0", 64), rec(100, "r2", "w1", 64)], 100)
    _up(st, "w0", "worker", 0.0)
    st.ingest_records([rec(110, "r3", "w1", 64)], 110)  # w0 went down at ~110 and gets no traffic
    assert st.worker_pool.blind_targets() == 0  # it left the pool: a fleet event, not blind telemetry
    st.ingest_records([rec(120, "r4", "w0", 64)], 120)  # the router still sends w0 traffic
    assert st.worker_pool.blind_targets() == 1
    assert st.series().gauges[f"{P}_telemetry_blind_targets"] == {(): 1.0}
    _up(st, "w0", "worker", 1.0)  # its metrics endpoint answers again
    st.ingest_records([rec(130, "r5", "w0", 64)], 130)
    assert st.worker_pool.blind_targets() == 0


def test_without_a_traffic_source_every_down_target_counts():
    st = make()
    _up(st, "w0", "worker", 0.0)
    _up(st, "gw", "router", 1.0)
    assert st.series().gauges[f"{P}_telemetry_blind_targets"] == {(): 1.0}
    _up(st, "gw", "router", 0.0)
    assert st.series().gauges[f"{P}_telemetry_blind_targets"] == {(): 2.0}


def test_available_tokens_ignore_the_requests_own_fresh_blocks():
    # The record arrives after its response: w0 already holds the blocks this cold request stored.
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 100.5, (BlockStored((1, 2, 3, 4), None, 16),)), 100.5)
    st.apply_kv_batch(KvBatch("w1", 0, 99.0, (BlockStored((1,), None, 16),)), 99.0)
    st.ingest_records([rec(100, "r", "w0", 64, block_hashes=[1, 2, 3, 4], block_size=16, cached_tokens=0)], 101)
    # what the router faced: w0 had nothing (it reported 0 cached), w1 had one block
    assert st.store.cum.counters[f"{P}_reuse_available_tokens"][("unknown",)] == 16


def test_kv_batches_keep_the_worker_pool_exact():
    # A batch skips the pool update only when it cannot change the pool: these are the moments it must not.
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, health_recency_s=60)

    def kv(worker, ts):
        st.apply_kv_batch(KvBatch(worker, 0, ts, ()), ts)

    kv("w0", 100.0)
    kv("w1", 100.0)
    for ts in (110.0, 150.0, 160.0):
        kv("w0", ts)
    assert st.worker_pool.pool == {"w0", "w1"}  # w1 was seen 60 s ago: still in
    kv("w0", 161.0)
    assert st.worker_pool.pool == {"w0"} and [c.ts for c in st.worker_pool.changes] == [161.0]
    st.health.set(f"{P}_up", ("w0", "worker"), 0.0)  # a failed scrape, outside the state
    kv("w0", 162.0)
    assert st.worker_pool.pool == frozenset() and st.worker_pool.down_since[("w0", "worker")] == 162.0
    st.health.set(f"{P}_up", ("w0", "worker"), 1.0)
    kv("w0", 163.0)
    assert st.worker_pool.pool == {"w0"} and [c.ts for c in st.worker_pool.changes] == [161.0, 162.0]  # from empty: no change


def test_kv_batch_health_series():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.5, (BlockStored((1, 2), None, 16), BlockStored((3,), 2, 16),
                                               BlockRemoved((3, 7)))), 100.0)
    st.apply_kv_batch(KvBatch("w0", 1, 100.0, (BlockStored((9,), 42, 16),)), 101.0)
    c, g = st.health.snapshot()
    w0 = ("w0",)
    assert c[f"{P}_kv_event_batches"] == {w0: 2.0}
    assert c[f"{P}_kv_events_applied"] == {("w0", "BlockStored"): 3.0, ("w0", "BlockRemoved"): 1.0}
    assert c[f"{P}_kv_event_unknown_block_removals"] == {w0: 1.0}
    assert c[f"{P}_kv_event_unknown_parent"] == {w0: 1.0}
    assert c[f"{P}_worker_restarts"] == {w0: 0.0} and c[f"{P}_kv_event_missed_batches"] == {w0: 0.0}
    assert g[f"{P}_kv_event_lag_seconds"] == {w0: 1.0} and g[f"{P}_kv_event_last_timestamp_seconds"] == {w0: 101.0}


def test_a_worker_that_left_the_pool_has_no_kv_freshness_series():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1,), None, 16),)), 99.0)
    st.apply_kv_batch(KvBatch("w1", 0, 99.0, (BlockStored((2,), None, 16),)), 99.0)
    st.ingest_records([rec(100, "r1", "w0", 64), rec(100, "r2", "w1", 64)], 100)
    _up(st, "w0", "worker", 0.0)  # w0 dies; its traffic stops
    st.ingest_records([rec(110, "r3", "w1", 64)], 110)
    last = st.series().gauges[f"{P}_kv_event_last_timestamp_seconds"]
    assert ("w0",) not in last and ("w1",) in last
    st.ingest_records([rec(120, "r4", "w0", 64)], 120)  # traffic reaches w0 again: blind, and stale
    assert ("w0",) in st.series().gauges[f"{P}_kv_event_last_timestamp_seconds"]


def test_a_worker_that_left_the_pool_offers_no_reusable_tokens():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2, 3), None, 16),)), 99.0)
    st.ingest_records([rec(100, "r1", "w0", 64), rec(100, "r2", "w1", 64)], 100)
    _up(st, "w0", "worker", 0.0)  # w0 dies with its cache; traffic goes elsewhere
    st.ingest_records([rec(110, "r3", "w1", 64)], 110)
    st.ingest_records([rec(120, "r4", "w1", 64, block_hashes=[1, 2, 3, 4], block_size=16, cached_tokens=0)], 120)
    assert st.store.cum.counters[f"{P}_reuse_available_tokens"][("unknown",)] == 0


def _scrape(st: ClusterState, worker: str, ts: float, queries: float, running: int = 0) -> None:
    from exporter.model import WorkerSnapshot
    st.observe_worker(WorkerSnapshot(worker, "vllm", model="m", prefix_queried_tokens=queries, prefix_hit_tokens=0.0,
                                     running=running), ts)


def _fresh_at(st: ClusterState, worker: str) -> float:
    return st.series().gauges[f"{P}_kv_event_last_timestamp_seconds"][(worker,)]


def test_an_idle_worker_s_stream_is_current_as_of_its_scrape():
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 100.0, (BlockStored((1,), None, 16),)), 100.0)
    _scrape(st, "w0", 105.0, 64)  # the first scrape after the batch: the count the worker has answered
    _scrape(st, "w0", 110.0, 64)  # no query since: nothing to send, so the stream is current
    assert _fresh_at(st, "w0") == 110.0
    _scrape(st, "w0", 115.0, 64)
    assert _fresh_at(st, "w0") == 115.0


def test_a_lull_between_scrapes_does_not_pass_a_stream_that_owes_events():
    """A worker that served after its last batch owes the events of what it served: two scrapes with
    no query between them (a lull in its traffic) do not make its silent stream current."""
    st = make()
    st.apply_kv_batch(KvBatch("w0", 0, 100.0, (BlockStored((1,), None, 16),)), 100.0)
    _scrape(st, "w0", 105.0, 64)
    _scrape(st, "w0", 110.0, 128, running=1)  # it served; its events never came
    _scrape(st, "w0", 115.0, 128)  # a lull: nothing running, no query since the last scrape
    _scrape(st, "w0", 120.0, 128)
    assert _fresh_at(st, "w0") == 100.0
    st.apply_kv_batch(KvBatch("w0", 1, 121.0, (BlockStored((2,), 1, 16),)), 121.0)  # the stream speaks again
    _scrape(st, "w0", 125.0, 128)
    _scrape(st, "w0", 130.0, 128)
    assert _fresh_at(st, "w0") == 130.0
