"""Exporter API answers in the shapes of docs/api.md, for a cluster whose sticky sessions fail.

Hand-built scenario: the cluster hit rate (41%) is firing — the symptom — and so is step 2's
sticky-session collision rate (12% > 5%). Step 3 has no prefill timing (not instrumented).
The verdict must be step 2, not step 1. Reuse per 1M prompt tokens: 800k available, 700k
predicted, 400k achieved → regret 40%, staleness 30% (> 10%: a stale index).
"""

from exporter.catalog import CHECKS, STEPS

NOW = 1_795_947_861.0
VALUES = {
    "targets_up": 1.0, "kv_event_staleness": 3.2, "kv_event_gaps": 0.0, "index_staleness": 0.03,
    "ingest_errors": 0.0, "prefix_hit_rate_total": 0.41, "prefix_hit_rate_per_session": 0.86,
    "prefix_block_count_per_worker": 0.72, "prefix_tree_depth_p99": 6.0,
    "sticky_session_collision_rate": 0.12, "warm_pool_utilization": 0.35,
    "session_migration_count_per_minute": 4.0, "prefix_tree_walk_latency": 0.0012,
    "topology_aware_placement_hit_rate": 0.95, "cross_node_migration_count_per_minute": 1.0,
    "moe_expert_alignment_rate": 0.9, "speculative_decoding_acceptance_rate": 0.75,
    "continuous_batching_affinity_admission_rate": 0.8, "slo_session_hit_rate": 0.86,
}
FIRING = {"prefix_hit_rate_total", "sticky_session_collision_rate"}
MISSING = {"cold_prefill_time_p99": ["prefill_timing"], "cold_prefill_cost_per_request": ["prefill_timing"],
           "async_prefill_wait_time_p99": ["async_prefill"], "slo_prefix_miss_cost": ["prefill_timing"]}
THRESHOLD = {"sticky_session_collision_rate": 0.05, "prefix_hit_rate_total": 0.6}


def groups(_query=None) -> dict:
    steps = []
    for step in STEPS:
        checks = []
        for c in CHECKS:
            if c.group != step.number:
                continue
            status = "firing" if c.key in FIRING else "not_instrumented" if c.key in MISSING else "ok"
            checks.append({"key": c.key, "title": c.title, "alert": c.alert, "value": VALUES.get(c.key),
                           "op": c.op, "threshold": THRESHOLD.get(c.key), "baseline": None, "unit": c.unit,
                           "status": status, "missing_signals": MISSING.get(c.key, []),
                           "runbook": f"runbooks/{c.alert}.md"})
        status = "firing" if any(ch["status"] == "firing" for ch in checks) else "ok"
        steps.append({"step": step.number, "title": step.title, "question": step.question,
                      "status": status, "checks": checks})
    return {"window_s": 300, "evaluated_at": NOW, "signals": {"kv_events": True, "prefill_timing": False},
            "steps": steps, "verdict": {"step": 2, "title": "Affinity", "checks": ["sticky_session_collision_rate"]},
            "symptom": {"prefix_hit_rate_total": 0.41, "firing": True},
            "reuse": {"prompt_tokens": 1.0e6, "available_tokens": 8.0e5, "predicted_tokens": 7.0e5,
                      "achieved_tokens": 4.0e5, "routing_regret_tokens": 4.0e5, "index_staleness_tokens": 3.0e5}}


def tree(_query=None) -> dict:
    return {"root": {"id": "root", "children": [
        {"id": "3f2a9c0100000000", "label": "3f2a9c01…(12 blocks)", "blocks": 12, "depth_blocks": 12,
         "hit_tokens": 40960, "resident_workers": ["w0", "w3"], "children": [
             {"id": "aa00000000000001", "label": "aa000000…(3 blocks)", "blocks": 3, "depth_blocks": 15,
              "hit_tokens": 8192, "resident_workers": ["w0"], "children": []}]},
        {"id": "77e1000000000000", "label": "77e10000…(5 blocks)", "blocks": 5, "depth_blocks": 5,
         "hit_tokens": 1024, "resident_workers": ["w1"], "children": []}]},
        "stats": {"nodes": 3, "blocks": 20, "root_fanout": 2, "depth_p99": 2, "block_depth_p99": 15}}


WORKERS = [
    {"worker": "w0", "resident_blocks": 9000, "capacity_blocks": 10000, "effective_cache_value_tokens": 1.1e5,
     "removal_rank": 2, "node": "n0", "nvlink_domain": "n0-d0", "gpu_class": "H100", "warm_pool": False},
    {"worker": "w1", "resident_blocks": 2500, "capacity_blocks": 10000, "effective_cache_value_tokens": 2.0e4,
     "removal_rank": 1, "node": "n0", "nvlink_domain": "n0-d0", "gpu_class": "H100", "warm_pool": False},
    {"worker": "w3", "resident_blocks": 7000, "capacity_blocks": 8000, "effective_cache_value_tokens": 9.0e4,
     "removal_rank": 3, "node": "n1", "nvlink_domain": "n1-d0", "gpu_class": "L40S", "warm_pool": True},
]


def hotspots(_query=None) -> dict:
    return {"hot_branches": [{"rank": 1, "branch": "3f2a9c01", "hit_tokens": 40960, "blocks": 12,
                              "workers": ["w0", "w3"], "sessions": 31},
                             {"rank": 2, "branch": "77e10000", "hit_tokens": 1024, "blocks": 5,
                              "workers": ["w1"], "sessions": 2}],
            "fanout": {"buckets": [[1, 10], [2, 4]], "root_fanout": 2},
            "depth": {"buckets": [[1, 3], [2, 9]]},
            "duplication": {"blocks_on_1": 100, "blocks_on_2": 20, "blocks_on_3_plus": 3, "duplicated_share": 0.18},
            "workers": WORKERS}


def changes(query=None) -> dict:
    return {"from": NOW - 300, "to": NOW,
            "lost_hits": [{"branch": "3f2a9c01", "before_hit_tokens": 40960, "after_hit_tokens": 0}],
            "rekeyed_segments": [{"segment": "mobile", "rekeys": 42, "share": 0.31}],
            "pool_changes": [{"ts": NOW - 160, "before": 8, "after": 9, "reshuffled_share": 0.86}]}


API = {"groups": groups, "tree": tree, "hotspots": hotspots, "changes": changes}
