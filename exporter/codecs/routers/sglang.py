"""SGLang's router: the SGLang model gateway / sglang-router ≥ 0.3 (``smg_*``), sglang-router
≤ 0.2.4 and SGLang's in-tree experimental router (``sgl_router_*``).

Names and label sets: the sglang-router 0.3.2 wheel's own /metrics (tests/fixtures); smg-project/smg
model_gateway/src/observability/metrics.rs and its metrics reference (smg 1.11); sgl-project/sglang
sgl-router/src/metrics.rs (≤ 0.2.4) and experimental/sgl-router/src/server/metrics.rs.

- decisions per worker: ``smg_worker_requests_total{worker,model}`` summed over ``model`` (smg ≥ 1.13:
  every send, a worker that got none at 0), else ``smg_worker_cb_outcomes_total{worker,outcome}``
  summed over ``outcome`` (``smg_worker_selection_total`` has no worker label);
  ``sgl_router_policy_decisions_total{policy,worker}``;
  ``sgl_router_worker_requests_total{worker_url,...}``.
- prefix hit/miss: ``smg_cache_aware_policy_branch_total{branch}`` (smg ≥ 1.11: ``tree_match`` is a
  hit, ``spill``/``expected_wait_fallback``/``first_healthy_fallback`` are not routed by a match);
  ``sgl_router_cache_hits_total``/``_misses_total`` (≤ 0.2.4);
  ``sgl_router_cache_aware_decisions_total{decision}`` (``cache_hit``/``cache_miss``). sglang-router
  0.3.0–0.3.2 export none of these: the outcome stays missing.
- predicted reuse: ``smg_cache_aware_match_ratio`` (best match ÷ input length, smg ≥ 1.11).
- lookup latency: ``smg_kv_index_lookup_seconds{index}`` (smg ≥ 1.13, seconds, summed over ``index``
  = ``positional``/``chain``): the event-driven KV index's overlap scoring of a request's block
  hashes, observed when cache-aware routing is fed by the workers' KV events (gRPC workers); the
  HTTP tree mode times nothing.
- health: ``smg_worker_health{worker}``.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import by_label, histogram, histogram_names, named, total
from exporter.model import RouterSnapshot

SMG_SENDS = "smg_worker_requests_total"
SMG_DECISIONS = "smg_worker_cb_outcomes_total"
SMG_HEALTH = "smg_worker_health"
SMG_BRANCH = "smg_cache_aware_policy_branch_total"
SMG_MATCH_RATIO = "smg_cache_aware_match_ratio"
SMG_LOOKUP = "smg_kv_index_lookup_seconds"
SGL_DECISIONS = "sgl_router_policy_decisions_total"
SGL_WORKER_REQUESTS = "sgl_router_worker_requests_total"
SGL_HITS = "sgl_router_cache_hits_total"
SGL_MISSES = "sgl_router_cache_misses_total"
SGL_CACHE_DECISIONS = "sgl_router_cache_aware_decisions_total"
BRANCH_OUTCOMES = {"tree_match": "hit", "spill": "miss", "expected_wait_fallback": "miss",
                   "first_healthy_fallback": "miss"}
DECISION_OUTCOMES = {"cache_hit": "hit", "cache_miss": "miss"}


def _outcomes(p: ParseResult) -> dict[str, float]:
    if SMG_BRANCH in p.samples:
        got = by_label(p.samples[SMG_BRANCH], "branch", BRANCH_OUTCOMES)
        return {k: v for k, v in got.items() if k in ("hit", "miss")}
    if SGL_CACHE_DECISIONS in p.samples:
        got = by_label(p.samples[SGL_CACHE_DECISIONS], "decision", DECISION_OUTCOMES)
        return {k: v for k, v in got.items() if k in ("hit", "miss")}
    hits, misses = total(p, SGL_HITS), total(p, SGL_MISSES)
    if hits is None and misses is None:
        return {}
    return {"hit": hits or 0.0, "miss": misses or 0.0}


def build(router: str, p: ParseResult, names: Mapping[str, str] | None) -> RouterSnapshot:
    got = p.samples
    if SMG_SENDS in got:
        decisions = by_label(got[SMG_SENDS], "worker")
    elif SMG_DECISIONS in got:
        decisions = by_label(got[SMG_DECISIONS], "worker")
    elif SGL_DECISIONS in got:
        decisions = by_label(got[SGL_DECISIONS], "worker")
    else:
        decisions = by_label(got.get(SGL_WORKER_REQUESTS, ()), "worker_url")
    return RouterSnapshot(
        router=router, kind=ADAPTER.kind,
        decisions=named(decisions, names),
        healthy=named(by_label(got.get(SMG_HEALTH, ()), "worker"), names),
        prefix_outcomes=_outcomes(p),
        predicted_hit_ratio=histogram(p, SMG_MATCH_RATIO),
        lookup_seconds=histogram(p, SMG_LOOKUP),
    )


_COUNTS = frozenset({SMG_SENDS, SMG_DECISIONS, SMG_BRANCH, SGL_DECISIONS, SGL_WORKER_REQUESTS, SGL_HITS, SGL_MISSES,
                     SGL_CACHE_DECISIONS, *histogram_names(SMG_MATCH_RATIO),
                     *histogram_names(SMG_LOOKUP)})
ADAPTER = RouterAdapter(
    kind="sglang-router", prefixes=("smg_", "sgl_router_"),
    names=_COUNTS | {SMG_HEALTH}, counts=_COUNTS, ratios=frozenset({SMG_HEALTH}), build=build,
    source="sglang-router 0.3.2 wheel; smg 1.13.0 wheel; smg-project/smg observability/metrics.rs; "
           "sgl-project/sglang sgl-router",
)
