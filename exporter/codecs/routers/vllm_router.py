"""vllm-router (vllm-project/router, ``vllm_router_*``).

Names and label sets: the vllm-router 0.1.17 wheel's own /metrics (tests/fixtures) and
vllm-project/router src/metrics.rs.

- decisions per worker: ``vllm_router_policy_decisions_total{policy,worker}`` summed over ``policy``.
- prefix hit/miss: ``vllm_router_prefix_routing_decisions_total{policy,stage,outcome}``
  (``prefix_hit``/``prefix_miss``, 0.1.17); else the unlabelled ``vllm_router_cache_hits_total`` /
  ``vllm_router_cache_misses_total`` of the cache-aware policy (src/metrics.rs).
- health: ``vllm_router_worker_health{worker}``.
- tree size: ``vllm_router_tree_size{worker}`` (src/metrics.rs: each worker's tree, characters,
  bounded by ``--max-tree-size``, 33,554,432 by default; the 0.1.17 wheel registers the name but
  was not seen to set it). The largest tree is read.
vllm-router exports no lookup latency and no predicted match ratio.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import by_label, largest, named, total
from exporter.model import RouterSnapshot

VR_DECISIONS = "vllm_router_policy_decisions_total"
VR_PREFIX = "vllm_router_prefix_routing_decisions_total"
VR_HEALTH = "vllm_router_worker_health"
VR_HITS = "vllm_router_cache_hits_total"
VR_MISSES = "vllm_router_cache_misses_total"
VR_OUTCOMES = {"prefix_hit": "hit", "prefix_miss": "miss"}
VR_TREE_SIZE = "vllm_router_tree_size"
DEFAULT_MAX_TREE_SIZE = 33_554_432  # vllm-router --max-tree-size ("per-worker character budget")


def _outcomes(p: ParseResult) -> dict[str, float]:
    if VR_PREFIX in p.samples:
        return by_label(p.samples[VR_PREFIX], "outcome", VR_OUTCOMES)
    hits, misses = total(p, VR_HITS), total(p, VR_MISSES)
    if hits is None and misses is None:
        return {}
    return {"hit": hits or 0.0, "miss": misses or 0.0}


def build(router: str, p: ParseResult, names: Mapping[str, str] | None) -> RouterSnapshot:
    got = p.samples
    return RouterSnapshot(
        router=router, kind=ADAPTER.kind,
        decisions=named(by_label(got.get(VR_DECISIONS, ()), "worker"), names),
        healthy=named(by_label(got.get(VR_HEALTH, ()), "worker"), names),
        prefix_outcomes=_outcomes(p),
        largest_tree=largest(p, (VR_TREE_SIZE,)),
    )


_COUNTS = frozenset({VR_DECISIONS, VR_PREFIX, VR_HITS, VR_MISSES})
ADAPTER = RouterAdapter(
    kind="vllm-router", prefixes=("vllm_router_",), names=_COUNTS | {VR_HEALTH, VR_TREE_SIZE},
    counts=_COUNTS | {VR_TREE_SIZE}, ratios=frozenset({VR_HEALTH}), build=build, tree_bound=DEFAULT_MAX_TREE_SIZE,
    source="vllm-router 0.1.17 wheel; vllm-project/router src/metrics.rs",
)
