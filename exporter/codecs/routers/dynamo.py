"""NVIDIA Dynamo's KV router (ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs,
lib/runtime/src/metrics/prometheus_names.rs).

- predicted reuse: ``dynamo_component_router_kv_hit_rate`` — a histogram (0–1, buckets 0.05
  apart) of the hit share the router predicted for each request at routing time (ai-dynamo/dynamo#6507).
- lookup latency: ``dynamo_router_overhead_indexer_find_matches_ms`` (formerly
  ``dynamo_routing_overhead_indexer_find_matches_ms``), a histogram in **milliseconds**: the
  router's prefix-index lookup. Converted to seconds.
- routing overhead per phase: ``dynamo_router_overhead_{block_hashing,seq_hashing,indexer_find_matches,
  scheduling,total,shared_cache_query}_ms`` (const label ``router_id``; the frontend's registry, not
  the standalone router's), the hashing phases on ``exponential_buckets(0.001, 2, 15)`` and the others
  on ``exponential_buckets(0.01, 3, 17)`` ms (``RoutingOverheadMetrics`` @01690d4). Each in seconds,
  by phase; the find_matches phase is also the lookup latency above (the tree walk of step 4).
- routing regret (ai-dynamo/dynamo#12585): ``dynamo_component_router_non_max_overlap_selections_total``
  counts the scheduler's picks of a worker with less KV overlap than the best eligible one, and
  ``dynamo_component_router_overlap_blocks_lost`` (a histogram, exponential buckets from 0.25
  blocks) what each gave up; both are labelled ``worker_type`` and observed for prefill picks only.
  Summed over their labels; the regret's denominator is ``dynamo_component_router_requests_total``.
- index health: ``dynamo_component_kv_cache_events_applied{event_type,status}`` (a counter without
  ``_total``: Dynamo's name as registered), every ``status`` but ``ok`` an event its indexer
  could not apply (``parent_block_not_found``, ``block_not_found``, ``invalid_block``).
Dynamo exports no per-worker decision counter and no hit/miss outcome (per-decision metrics were
proposed in ai-dynamo/dynamo#11931/#11936/#14776, none merged): those stay missing.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import histogram, histogram_names, total
from exporter.model import CumulativeHistogram, RouterSnapshot

KV_HIT_RATE = "dynamo_component_router_kv_hit_rate"
FIND_MATCHES_MS = "dynamo_router_overhead_indexer_find_matches_ms"
FIND_MATCHES_MS_OLD = "dynamo_routing_overhead_indexer_find_matches_ms"
NON_MAX_OVERLAP = "dynamo_component_router_non_max_overlap_selections_total"
BLOCKS_LOST = "dynamo_component_router_overlap_blocks_lost"
REQUESTS = "dynamo_component_router_requests_total"
EVENTS_APPLIED = "dynamo_component_kv_cache_events_applied"
APPLIED_OK = "ok"
MS = 0.001
PHASES = ("block_hashing", "seq_hashing", "indexer_find_matches", "scheduling", "total", "shared_cache_query")
PHASE_NAMES = {phase: (f"dynamo_router_overhead_{phase}_ms", f"dynamo_routing_overhead_{phase}_ms") for phase in PHASES}


def _overhead(p: ParseResult) -> dict[str, CumulativeHistogram]:
    """Phase -> its overhead histogram in seconds (the current name, else the former one)."""
    out: dict[str, CumulativeHistogram] = {}
    for phase, (name, former) in PHASE_NAMES.items():
        got = histogram(p, name, MS) or histogram(p, former, MS)
        if got is not None:
            out[phase] = got
    return out


def _apply_failures(p: ParseResult) -> dict[str, float]:
    """Events the router's indexer could not apply (every status but ok); {} when not exported."""
    got = p.samples.get(EVENTS_APPLIED)
    if not got:
        return {}
    return {"apply_failed": sum(s.value for s in got if s.labels.get("status", APPLIED_OK) != APPLIED_OK)}


def build(router: str, p: ParseResult, names: Mapping[str, str] | None) -> RouterSnapshot:
    lookup = histogram(p, FIND_MATCHES_MS, MS) or histogram(p, FIND_MATCHES_MS_OLD, MS)
    return RouterSnapshot(router=router, kind=ADAPTER.kind, lookup_seconds=lookup,
                          predicted_hit_ratio=histogram(p, KV_HIT_RATE),
                          index_faults=_apply_failures(p),
                          regret_selections=total(p, NON_MAX_OVERLAP),
                          regret_blocks=total(p, histogram_names(BLOCKS_LOST)[1]),
                          routed_requests=total(p, REQUESTS), overhead_seconds=_overhead(p))


_COUNTS = frozenset({*histogram_names(KV_HIT_RATE), *histogram_names(FIND_MATCHES_MS),
                     *histogram_names(FIND_MATCHES_MS_OLD), *histogram_names(BLOCKS_LOST), NON_MAX_OVERLAP,
                     REQUESTS, EVENTS_APPLIED,
                     *(n for names in PHASE_NAMES.values() for name in names for n in histogram_names(name))})
ADAPTER = RouterAdapter(
    kind="dynamo", prefixes=("dynamo_component_router_", "dynamo_router_", "dynamo_routing_"),
    names=_COUNTS, counts=_COUNTS, ratios=frozenset(), build=build,
    source="ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs, lib/runtime/src/metrics/prometheus_names.rs",
)
