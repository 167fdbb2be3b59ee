"""A hand-computed cluster as OpenMetrics text for ``promtool tsdb create-blocks-from openmetrics``.

The scenario: the hit rate falls (0.41, the symptom) because sticky
sessions fail (12% collisions, step 2). Counters grow linearly, so every 5m rate ratio is
exact: hit 41/100, follow-up cached 86/100, collisions 12/100, placement 95/100, spec 75/100,
affinity 80/100; reuse per 1000 prompt tokens: 800 available, 420 predicted, 400 achieved,
20 stale. w0's cache is full (10000 of 10000 blocks, normal in steady state) and 3 of every 100
blocks it stores it had evicted within the window (thrash 3%, below the alert). Step 3 (prefill timing, async prefill), the walk latency and MoE have no source.
"""

from __future__ import annotations

WEIRD_TARGET = 'we"ird\\name\nx'
MISSING_SIGNALS = {"prefill_timing", "async_prefill", "walk_latency", "expert_signature"}
# counter -> (labels, increase per second)
COUNTERS: dict[str, list[tuple[dict[str, str], float]]] = {
    "prefixscope_prefix_cache_hit_tokens_total": [({"worker": "w0", "model": "m"}, 41.0)],
    "prefixscope_prefix_cache_queried_tokens_total": [({"worker": "w0", "model": "m"}, 100.0)],
    "prefixscope_session_followup_cached_tokens_total": [({"model": "m"}, 86.0)],
    "prefixscope_session_followup_prompt_tokens_total": [({"model": "m"}, 100.0)],
    "prefixscope_followup_requests_total": [({"model": "m"}, 100.0)],
    "prefixscope_sticky_collisions_total": [({"model": "m"}, 12.0)],
    "prefixscope_session_migrations_total": [({"kind": "soft"}, 4 / 60), ({"kind": "hard"}, 0.0)],
    "prefixscope_cross_node_migrations_total": [({"kind": "soft"}, 1 / 60)],
    "prefixscope_placement_decisions_total": [({"model": "m"}, 100.0)],
    "prefixscope_placement_domain_hits_total": [({"model": "m"}, 95.0)],
    "prefixscope_spec_decode_draft_tokens_total": [({"worker": "w0", "model": "m"}, 100.0)],
    "prefixscope_spec_decode_accepted_tokens_total": [({"worker": "w0", "model": "m"}, 75.0)],
    "prefixscope_batch_admissions_total": [({"model": "m"}, 10.0)],
    "prefixscope_batch_affinity_admissions_total": [({"model": "m"}, 8.0)],
    "prefixscope_request_prompt_tokens_total": [({"model": "m"}, 1000.0)],
    "prefixscope_reuse_available_tokens_total": [({"model": "m"}, 800.0)],
    "prefixscope_reuse_predicted_tokens_total": [({"model": "m"}, 420.0)],
    "prefixscope_reuse_achieved_tokens_total": [({"model": "m"}, 400.0)],
    "prefixscope_index_staleness_tokens_total": [({"model": "m"}, 20.0)],
    "prefixscope_kv_event_missed_batches_total": [({"worker": "w0"}, 0.0)],
    "prefixscope_kv_index_repairs_total": [({"worker": "w0", "reason": "lost_batches"}, 0.0)],
    "prefixscope_kv_blocks_stored_total": [({"worker": "w0"}, 100.0)],
    "prefixscope_kv_blocks_restored_after_eviction_total": [({"worker": "w0"}, 3.0)],
    "prefixscope_ingest_errors_total": [({"source": "records", "kind": "schema"}, 0.0)],
}
GAUGES: dict[str, list[tuple[dict[str, str], float]]] = {
    "prefixscope_up": [({"target": "w0", "kind": "worker"}, 1.0), ({"target": WEIRD_TARGET, "kind": "router"}, 1.0)],
    "prefixscope_worker_resident_blocks": [({"worker": "w0"}, 10000.0)],
    "prefixscope_worker_capacity_blocks": [({"worker": "w0"}, 10000.0)],
    "prefixscope_warm_pool_utilization_ratio": [({"worker": "w3"}, 0.35)],
    # p99 over 10 leaves: 5 at depth ≤ 2, 10 at ≤ 4 → 2 + 2 × (9.9 − 5) / 5 = 3.96
    "prefixscope_prefix_tree_leaf_depth_bucket": [({"le": "1"}, 0.0), ({"le": "2"}, 5.0), ({"le": "4"}, 10.0),
                                                  ({"le": "+Inf"}, 10.0)],
}


def _labels(labels: dict[str, str]) -> str:
    esc = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


def openmetrics(signals: list[str], end: float, minutes: int = 20, step: int = 15,
                stopped: dict[str, float] | None = None) -> str:
    """Samples every ``step`` seconds up to ``end``; untyped, so names are stored as written.
    ``stopped``: counter → seconds before ``end`` from which it no longer grows (a fault that ended)."""
    start = int(end) - minutes * 60
    times = list(range(start, int(end) + 1, step))
    lines: list[str] = []
    for name, items in COUNTERS.items():
        stop = int(end) - (stopped or {}).get(name, 0.0)
        for labels, rate in items:
            lines += [f"{name}{_labels(labels)} {rate * (min(t, stop) - start):.6f} {t}" for t in times]
    for name, items in GAUGES.items():
        for labels, value in items:
            lines += [f"{name}{_labels(labels)} {value} {t}" for t in times]
    for t in times:
        lines.append(f'prefixscope_kv_event_last_timestamp_seconds{{worker="w0"}} {t} {t}')
        # the exporter was up and scraped all along (PrefixExporterDown stays quiet)
        lines.append(f'prefixscope_exporter_build_info{{core="compiled",version="0.1.0"}} 1 {t}')
    for s in signals:
        lines += [f'prefixscope_signal_available{{signal="{s}"}} {0 if s in MISSING_SIGNALS else 1} {t}'
                  for t in times]
    return "\n".join(lines) + "\n# EOF\n"
