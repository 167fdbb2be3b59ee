"""Topology-aware and coupled-optimisation metrics of ClusterState, against hand-computed values.

A real ``fleet.topology.Topology`` (parsed from a four-worker file) and crafted KV batches and
request records; every expected number is worked out in the comments next to it.
"""

from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.scrape_accounting import ScrapeAccounting
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, WorkerSnapshot
from prefixscope.thresholds import load_thresholds
from prefixscope.topology import parse_topology

P = "prefixscope"
MODEL = ("unknown",)

# node-a: domain a/nvl0 = {w0, w1}, domain a/nvl1 = {w2}; node-b: domain b/nvl0 = {w3}
TOPOLOGY = parse_topology({
    "model": "m", "block_size": 16,
    "gpu_classes": {"H100": {"prefill_tps": 20000, "decode_tps": 100, "kv_blocks": 1000, "intra_node_gbps": 450,
                             "inter_node_gbps": 50, "price_per_gpu_hour": 3.6}},
    "workers": [
        {"name": "w0", "node": "node-a", "nvlink_domain": "a/nvl0", "gpu_class": "H100", "warm_pool": True},
        {"name": "w1", "node": "node-a", "nvlink_domain": "a/nvl0", "gpu_class": "H100"},
        {"name": "w2", "node": "node-a", "nvlink_domain": "a/nvl1", "gpu_class": "H100"},
        {"name": "w3", "node": "node-b", "nvlink_domain": "b/nvl0", "gpu_class": "H100"},
    ],
}, "test.yaml")


def make(**kw) -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), topology=TOPOLOGY, window_s=300, **kw)


def rec(ts, rid, worker, prompt, **kw):
    return {"ts": ts, "request_id": rid, "worker": worker, "prompt_tokens": prompt, **kw}


def kv(st, worker, ts, *events):
    st.apply_kv_batch(KvBatch(worker, 0, ts, tuple(events)), ts)


def counter(st, name, labels=MODEL):
    return st.store.cum.counters.get(f"{P}_{name}", {}).get(labels)


def test_placement_inside_and_outside_the_domain_of_the_longest_prefix():
    st = make()
    kv(st, "w0", 90, BlockStored((1, 2, 3), None, 16))  # longest: 3 blocks on w0 (domain a/nvl0)
    kv(st, "w2", 90, BlockStored((1, 2), None, 16))  # a shorter copy in a/nvl1
    st.ingest_records([
        rec(100, "in-domain", "w1", 64, block_hashes=[1, 2, 3, 4]),  # best w0, placed on w1: same domain → hit
        rec(101, "other-node", "w3", 48, block_hashes=[1, 2, 3]),  # best w0, placed in b/nvl0 → miss
        rec(102, "other-domain", "w2", 48, block_hashes=[1, 2, 3]),  # w2 holds only 2 of 3 → miss
        rec(103, "tie", "w2", 48, block_hashes=[1, 2, 9]),  # w0 and w2 both hold 2 → both domains best → hit
        rec(104, "nothing-cached", "w0", 32, block_hashes=[7, 8]),  # no prefix anywhere: not counted
        rec(105, "no-hashes", "w0", 32),  # no chain: not counted
        rec(106, "off-topology", "wx", 48, block_hashes=[1, 2, 3]),  # worker not in the topology: not counted
    ], 106)
    assert counter(st, "placement_decisions") == 4
    assert counter(st, "placement_domain_hits") == 2
    result = evaluate(st, now=106).results["topology_aware_placement_hit_rate"]
    assert result.value == 0.5 and result.status == "firing"  # 2/4 < 90%


def test_placement_without_topology_is_not_instrumented():
    st = ClusterState.build(Health(), load_thresholds(), window_s=300)
    kv(st, "w0", 90, BlockStored((1, 2), None, 16))
    st.ingest_records([rec(100, "r", "w0", 32, block_hashes=[1, 2])], 100)
    assert counter(st, "placement_decisions") is None
    assert evaluate(st, now=100).results["topology_aware_placement_hit_rate"].status == "not_instrumented"


def test_moe_expert_alignment_counts_only_hits_against_a_known_signature():
    st = make()
    kv(st, "w0", 90, BlockStored((1, 2), None, 16))
    st.ingest_records([
        rec(100, "m1", "w1", 32, block_hashes=[1, 2], expert_signature="e1", cached_tokens=0),  # stores e1 for chain 1
        rec(101, "m2", "w1", 32, block_hashes=[1, 2], expert_signature="e1", cached_tokens=16),  # hit, aligned
        rec(102, "m3", "w1", 32, block_hashes=[1, 2], expert_signature="e2", cached_tokens=32),  # hit, misaligned
        rec(103, "m4", "w1", 32, block_hashes=[1, 2], expert_signature="e2", cached_tokens=0),  # miss: not counted
        rec(104, "m5", "w1", 32, block_hashes=[5, 6], expert_signature="e3", cached_tokens=16),  # first of chain 5
        rec(105, "m6", "w1", 32, block_hashes=[1, 2], cached_tokens=32),  # no signature
        rec(106, "m7", "w1", 32, expert_signature="e1", cached_tokens=32),  # no chain
        # no engine count: the hit comes from the index (w0 holds 1, 2) → hit, aligned with e1
        rec(107, "m8", "w0", 32, block_hashes=[1, 2], expert_signature="e1"),
    ], 107)
    assert counter(st, "moe_prefix_hits") == 3  # m2, m3, m8
    assert counter(st, "moe_expert_aligned_hits") == 2  # m2, m8
    result = evaluate(st, now=107).results["moe_expert_alignment_rate"]
    assert abs(result.value - 2 / 3) < 1e-12 and result.status == "firing"  # < 70%


def test_affinity_admissions_count_only_records_that_say():
    st = make()
    st.ingest_records([
        rec(100, "a", "w0", 10, admitted_by_affinity=True),
        rec(101, "b", "w0", 10, admitted_by_affinity=False),
        rec(102, "c", "w1", 10, admitted_by_affinity=True),
        rec(103, "d", "w1", 10),  # field absent: not an admission we know about
    ], 103)
    assert counter(st, "batch_admissions") == 3
    assert counter(st, "batch_affinity_admissions") == 2
    result = evaluate(st, now=103).results["continuous_batching_affinity_admission_rate"]
    assert abs(result.value - 2 / 3) < 1e-12 and result.status == "ok"  # ≥ 50%


def test_affinity_never_admitted_is_zero_not_missing():
    st = make()
    st.ingest_records([rec(100, "a", "w0", 10, admitted_by_affinity=False)], 100)
    assert counter(st, "batch_affinity_admissions") == 0.0
    assert evaluate(st, now=100).results["continuous_batching_affinity_admission_rate"].value == 0.0


def test_fallback_tiers_and_active_state_in_and_out_of_the_window():
    st = make()
    st.ingest_records([
        rec(100, "a", "w0", 10, fallback_tier="re_sticky"),
        rec(100, "b", "w0", 10, fallback_tier="warm_pool"),
        rec(350, "c", "w0", 10, fallback_tier="warm_pool"),
        rec(350, "d", "w0", 10, fallback_tier=None),
    ], 350)
    assert st.store.cum.counters[f"{P}_fallback_requests"] == {("re_sticky",): 1, ("warm_pool",): 2}
    # window (50, 350]: both tiers used inside it
    assert st.accounting.fallback_active() == {"re_sticky": 1.0, "warm_pool": 1.0}
    st.ingest_records([rec(420, "e", "w0", 10)], 420)
    # window (120, 420]: re_sticky last used at 100 → inactive (0, still shown); warm_pool at 350 → active
    assert st.accounting.fallback_active() == {"re_sticky": 0.0, "warm_pool": 1.0}
    assert st.series().gauges[f"{P}_fallback_active"] == {("re_sticky",): 0.0, ("warm_pool",): 1.0}
    # a tier never used is absent, not 0
    assert "model_downgrade" not in st.accounting.fallback_active()


def test_cross_node_migrations_use_the_topology_nodes():
    st = make()
    st.ingest_records([
        rec(100, "same-domain", "w1", 10, migrated_from="w0", migration_kind="soft"),
        rec(101, "other-node", "w3", 10, migrated_from="w0", migration_kind="hard"),
        rec(102, "same-node", "w2", 10, migrated_from="w0", migration_kind="hard"),  # other domain, same node
        rec(103, "default-kind", "w3", 10, migrated_from="w1"),  # kind defaults to hard; node-a → node-b
        rec(104, "unknown-source", "w0", 10, migrated_from="gone", migration_kind="soft"),  # not in topology
    ], 104)
    assert st.store.cum.counters[f"{P}_session_migrations"] == {("soft",): 2, ("hard",): 3}
    # counted only where both ends are in the topology: 4 migrations, 2 of them across nodes (both hard)
    assert st.store.cum.counters[f"{P}_cross_node_migrations"] == {("soft",): 0.0, ("hard",): 2}
    # per minute over the 5-minute window: 2 / 300 s × 60
    result = evaluate(st, now=104).results["cross_node_migration_count_per_minute"]
    assert abs(result.value - 0.4) < 1e-12 and result.status == "ok"


def test_effective_cache_value_and_removal_ranking():
    st = make()
    kv(st, "w0", 90, BlockStored(tuple(range(100, 110)), None, 16))  # 10 blocks
    kv(st, "w1", 90, BlockStored(tuple(range(200, 204)), None, 16))  # 4 blocks
    kv(st, "w2", 90, BlockStored(tuple(range(300, 305)), None, 16))  # 5 blocks, no hit-rate source
    kv(st, "w3", 90, BlockStored((400, 401), None, 16))  # 2 blocks
    for ts, q, h in ((100, 1000, 100), (110, 2000, 700)):  # w0's engine: Δq 1000, Δh 600 → 0.6
        st.observe_worker(WorkerSnapshot("w0", "vllm", prefix_queried_tokens=q, prefix_hit_tokens=h), ts)
    st.ingest_records([
        rec(111, "a", "w1", 100, cached_tokens=50),  # w1 from records: 50 / 200 = 0.25
        rec(112, "b", "w1", 100, cached_tokens=0),
        rec(113, "c", "w3", 64, cached_tokens=64),  # w3: 1.0
        rec(114, "d", "w0", 100, cached_tokens=0),  # ignored for w0: its engine counters win
    ], 114)
    values = st.scrapes.effective_cache_values()
    # resident tokens × hit ratio: w0 10×16×0.6, w1 4×16×0.25, w3 2×16×1; w2 has no ratio → absent
    assert values == {"w0": 96.0, "w1": 16.0, "w3": 32.0}
    # the one pass /metrics reads is the per-worker readings' product
    resident = st.index.resident_by_worker()
    assert values == {w: resident[w] * st.worker_pool.worker_block_size(w) * r for w in resident
                      if (r := st.scrapes.worker_hit_ratio(w)) is not None}
    assert st.scrapes.removal_ranks(values) == {"w1": 1, "w3": 2, "w0": 3}
    g = st.series().gauges
    assert g[f"{P}_worker_removal_rank"] == {("w1",): 1.0, ("w3",): 2.0, ("w0",): 3.0}
    # equal values are ranked by name
    assert ScrapeAccounting.removal_ranks({"b": 5.0, "a": 5.0, "c": 1.0}) == {"c": 1, "a": 2, "b": 3}
    # (200, 500]: w0's scrape deltas and w1's records have left the window; w3 now hits nothing
    st.ingest_records([rec(500, "e", "w3", 10, cached_tokens=0)], 500)
    assert st.scrapes.effective_cache_values() == {"w3": 0.0}


def test_pool_change_after_discovery_and_the_reshuffle_share():
    st = make()
    st.ingest_records([rec(100, "1", "w0", 10, session_key="s1"), rec(100, "2", "w1", 10, session_key="s2"),
                       rec(100, "3", "w0", 10, session_key="s3")], 100)
    st.ingest_records([rec(150, "4", "w0", 10, session_key="s1"), rec(150, "5", "w1", 10, session_key="s2"),
                       rec(150, "6", "w0", 10, session_key="s3")], 150)
    assert st.worker_pool.pool == {"w0", "w1"} and not st.worker_pool.changes  # growing while discovering is no change
    st.ingest_records([rec(170, "7", "w2", 10, session_key="s4")], 170)  # scale-out, 70 s after start
    assert [(c.ts, c.before, c.after, c.epoch) for c in st.worker_pool.changes] == [(170, 2, 3, 1)]
    st.ingest_records([rec(180, "8", "w0", 10, session_key="s1"),  # stayed
                       rec(180, "9", "w2", 10, session_key="s2"),  # moved w1 → w2
                       rec(181, "10", "w2", 10, session_key="s3")], 181)  # moved w0 → w2
    st.ingest_records([rec(185, "11", "w2", 10, session_key="s2")], 185)  # already counted for this change
    change = st.worker_pool.changes[-1]
    assert (change.seen_both, change.moved) == (3, 2)
    s = st.series()
    assert abs(s.gauges[f"{P}_session_reshuffle_ratio"][()] - 2 / 3) < 1e-12
    assert s.gauges[f"{P}_worker_pool_size"] == {(): 3.0}
    assert s.counters[f"{P}_worker_pool_changes"] == {(): 1.0}
    # w1 last seen at 150: at 220 it is more than 60 s silent → it left the pool
    st.ingest_records([rec(220, "12", "w0", 10, session_key="s1")], 220)
    assert [(c.before, c.after) for c in st.worker_pool.changes] == [(2, 3), (3, 2)]
    assert st.worker_pool.pool == {"w0", "w2"}
    s = st.series()
    assert f"{P}_session_reshuffle_ratio" not in s.gauges  # no session seen on both sides of the new change yet
    assert s.counters[f"{P}_worker_pool_changes"] == {(): 2.0}


def test_placement_judged_from_kv_events_lights_the_check_without_records():
    st = make()
    kv(st, "w0", 90, BlockStored((1, 2, 3), None, 16))  # nothing resident before: no placement
    kv(st, "w1", 91, BlockStored((1, 2, 3, 4), None, 16))  # longest on w0, same domain a/nvl0 → hit
    kv(st, "w3", 92, BlockStored((1, 2, 5), None, 16))  # longest on w0 and w1, both in a/nvl0 → miss
    kv(st, "w3", 93, BlockStored((6,), 5, 16))  # the same request's next block a second on: no placement
    kv(st, "wx", 94, BlockStored((1, 2, 7), None, 16))  # not in the topology: not judged
    kv(st, "w2", 95, BlockStored((1, 2, 3), None, 16, medium="CPU"))  # an offload, not a placement
    kv(st, "w3", 99, BlockStored((8,), 6, 16))  # a later turn on its own chain (past the window) → hit
    model = ("m",)  # no scrape names the model: the topology's
    assert counter(st, "kv_placement_decisions", model) == 3
    assert counter(st, "kv_placement_domain_hits", model) == 2
    assert counter(st, "placement_decisions") is None  # the records' series stay missing
    assert st.signals()["placements"] and not st.signals()["block_hashes"]
    result = evaluate(st, now=99).results["topology_aware_placement_hit_rate"]
    assert result.status != "not_instrumented" and result.value == 2 / 3


def test_records_with_block_hashes_take_precedence_over_kv_placements():
    st = make()
    kv(st, "w0", 90, BlockStored((1, 2, 3), None, 16))
    kv(st, "w3", 91, BlockStored((1, 2, 3, 4), None, 16))  # KV: a miss (1 of 1)
    st.ingest_records([rec(100, "r", "w1", 64, block_hashes=[1, 2, 3, 9])], 100)  # best w0 and w3, w0 in domain
    assert counter(st, "kv_placement_decisions", ("m",)) == 1
    assert counter(st, "kv_placement_domain_hits", ("m",)) == 0
    assert evaluate(st, now=100).results["topology_aware_placement_hit_rate"].value == 1.0


def test_kv_placements_ignore_workers_that_left_the_pool():
    st = make()
    kv(st, "w3", 90, BlockStored((1, 2), None, 16))
    st.worker_pool.records_seen = True  # traffic is known (a router or records), so a silent down worker left
    st.health.set(f"{P}_up", ("w3", "worker"), 0.0)
    st.worker_pool.track_down_targets()
    kv(st, "w0", 95, BlockStored((1, 2, 3), None, 16))  # w3's copy is gone with it: nothing resident
    assert counter(st, "kv_placement_decisions", ("m",)) is None


def test_without_topology_kv_events_judge_no_placement():
    st = ClusterState.build(Health(), load_thresholds(), window_s=300)
    kv(st, "w0", 90, BlockStored((1, 2), None, 16))
    kv(st, "w1", 91, BlockStored((1, 2, 3), None, 16))
    assert counter(st, "kv_placement_decisions", ("m",)) is None and not st.signals()["placements"]
    assert evaluate(st, now=91).results["topology_aware_placement_hit_rate"].status == "not_instrumented"
