"""NVIDIA Dynamo's KV router (ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs).

- predicted reuse: ``dynamo_component_router_kv_hit_rate`` — a histogram (0–1, buckets 0.05
  apart) of the hit share the router predicted for each request at routing time (ai-dynamo/dynamo#6507).
- lookup latency: ``dynamo_router_overhead_indexer_find_matches_ms`` (formerly
  ``dynamo_routing_overhead_indexer_find_matches_ms``), a histogram in **milliseconds**: the
  router's prefix-index lookup. Converted to seconds.
Dynamo exports no per-worker decision counter and no hit/miss outcome (per-decision metrics were
proposed in ai-dynamo/dynamo#11931/#11936/#14776, none merged): those stay missing.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import histogram, histogram_names
from exporter.model import RouterSnapshot

KV_HIT_RATE = "dynamo_component_router_kv_hit_rate"
FIND_MATCHES_MS = "dynamo_router_overhead_indexer_find_matches_ms"
FIND_MATCHES_MS_OLD = "dynamo_routing_overhead_indexer_find_matches_ms"
MS = 0.001


def build(router: str, p: ParseResult, names: Mapping[str, str] | None) -> RouterSnapshot:
    lookup = histogram(p, FIND_MATCHES_MS, MS) or histogram(p, FIND_MATCHES_MS_OLD, MS)
    return RouterSnapshot(router=router, kind=ADAPTER.kind, lookup_seconds=lookup,
                          predicted_hit_ratio=histogram(p, KV_HIT_RATE))


_COUNTS = frozenset({*histogram_names(KV_HIT_RATE), *histogram_names(FIND_MATCHES_MS),
                     *histogram_names(FIND_MATCHES_MS_OLD)})
ADAPTER = RouterAdapter(
    kind="dynamo", prefixes=("dynamo_component_router_", "dynamo_router_", "dynamo_routing_"),
    names=_COUNTS, counts=_COUNTS, ratios=frozenset(), build=build,
    source="ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs",
)
