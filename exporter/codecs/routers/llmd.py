"""llm-d's inference scheduler (EPP) and its KV-cache indexer (llm-d/llm-d-router docs/metrics.md,
pkg/kvcache/metrics/collector.go); canonical prefix ``llm_d_epp_``.

- lookup latency: ``llm_d_epp_kv_cache_index_lookup_latency_seconds`` (histogram, seconds; needs
  ``kvBlockIndexConfig.enableMetrics=true``).
- hit/miss: ``llm_d_epp_kv_cache_index_lookup_hits_total`` against
  ``llm_d_epp_kv_cache_index_lookup_requests_total`` (a hit counts the best candidate pod, not the
  pod the scheduler then selected).
The EPP exports no per-worker decision counter here; those stay missing.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import histogram, histogram_names, total
from exporter.model import RouterSnapshot

LOOKUP_LATENCY = "llm_d_epp_kv_cache_index_lookup_latency_seconds"
LOOKUP_REQUESTS = "llm_d_epp_kv_cache_index_lookup_requests_total"
LOOKUP_HITS = "llm_d_epp_kv_cache_index_lookup_hits_total"


def build(router: str, p: ParseResult, names: Mapping[str, str] | None) -> RouterSnapshot:
    requests, hits = total(p, LOOKUP_REQUESTS), total(p, LOOKUP_HITS)
    outcomes = {} if requests is None or hits is None else {"hit": hits, "miss": max(0.0, requests - hits)}
    return RouterSnapshot(router=router, kind=ADAPTER.kind, prefix_outcomes=outcomes,
                          lookup_seconds=histogram(p, LOOKUP_LATENCY))


_COUNTS = frozenset({LOOKUP_REQUESTS, LOOKUP_HITS, *histogram_names(LOOKUP_LATENCY)})
ADAPTER = RouterAdapter(
    kind="llm-d", prefixes=("llm_d_epp_",), names=_COUNTS, counts=_COUNTS, ratios=frozenset(), build=build,
    source="llm-d/llm-d-router docs/metrics.md, pkg/kvcache/metrics/collector.go",
)
