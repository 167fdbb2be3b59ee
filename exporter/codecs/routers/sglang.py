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
- affinity (smg ≥ 1.13, the wheel's own HELP texts): ``smg_manual_policy_branch_total{branch}`` of
  sticky routing by key (``occupied_hit``: the key's worker got it — kept; ``occupied_miss``: none
  of the key's workers was healthy, a new one was picked — a migration; ``cap_respill``: the key's
  worker was at its key cap, sent elsewhere while healthy — a collision; ``vacant``, ``no_routing_id``
  and ``no_healthy_workers`` are no follow-up) and ``smg_prefix_hash_policy_branch_total{branch}``
  (``ring_hit``: the prompt head's ring worker — kept; ``load_balance_walk``: moved off an overloaded
  ring worker — a collision). A policy whose family is on the page reports all three outcomes, 0
  until counted.
- index health (smg ≥ 1.13, KV-event-fed cache-aware routing over gRPC workers):
  ``smg_kv_event_gaps_total{worker,outcome}`` (``unrecovered_kept``/``unrecovered_cleared``: lost for
  good; ``replay_requested`` is not a fault), ``smg_kv_event_resyncs_total{worker,reason}``
  (``out_of_range``/``data_loss``: the stream was reset; ``publisher_restart``, ``gap_cleared`` —
  already an unrecovered gap — and ``snapshot`` are not counted again), and
  ``smg_kv_event_lag_seconds{worker}`` (histogram, seconds, summed over workers).
- tree size: ``smg_cache_tree_chars{model}`` / ``smg_cache_tree_tokens{model}`` (smg ≥ 1.10.1: each
  model's string tree of HTTP routing in characters, token tree of gRPC routing in tokens, summed
  over its workers; set at each eviction pass, every ``--eviction-interval-secs``), bounded per tree
  by ``--max-tree-size`` (67,108,864 by default); ``sgl_router_tree_size{worker}`` (≤ 0.2.4: each
  worker's tree, characters). The largest tree is read.
- engine hit ratio: ``smg_engine_cache_hit_rate{worker,model,dp_rank}`` (smg ≥ 1.10.1, observability/
  metrics.rs: the hit rate each engine reports when the gateway polls its load; −1 once the worker
  is removed): per worker, the mean over its models and DP ranks of the values in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.codecs.promtext import ParseResult
from exporter.codecs.routers.adapter import RouterAdapter
from exporter.codecs.routers.common import by_label, histogram, histogram_names, largest, named, total
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
SMG_MANUAL = "smg_manual_policy_branch_total"
SMG_PREFIX_HASH = "smg_prefix_hash_policy_branch_total"
SMG_KV_GAPS = "smg_kv_event_gaps_total"
SMG_KV_RESYNCS = "smg_kv_event_resyncs_total"
SMG_KV_LAG = "smg_kv_event_lag_seconds"
SMG_ENGINE_HIT_RATE = "smg_engine_cache_hit_rate"
TREE_SIZES = ("smg_cache_tree_chars", "smg_cache_tree_tokens", "sgl_router_tree_size")
DEFAULT_MAX_TREE_SIZE = 67_108_864  # smg launch / sglang_router.launch_router --max-tree-size
# policy family -> (policy label, branch -> follow-up outcome); other branches are no follow-up
STICKY_BRANCHES: dict[str, tuple[str, dict[str, str]]] = {
    SMG_MANUAL: ("manual", {"occupied_hit": "kept", "occupied_miss": "migration", "cap_respill": "collision"}),
    SMG_PREFIX_HASH: ("prefix_hash", {"ring_hit": "kept", "load_balance_walk": "collision"}),
}
STICKY_OUTCOMES = ("kept", "collision", "migration")
# index-health family -> (label, its values that are faults, the fault kind)
INDEX_FAULTS: dict[str, tuple[str, frozenset[str], str]] = {
    SMG_KV_GAPS: ("outcome", frozenset({"unrecovered_kept", "unrecovered_cleared"}), "gap_unrecovered"),
    SMG_KV_RESYNCS: ("reason", frozenset({"out_of_range", "data_loss"}), "stream_resync"),
}


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


def _sticky(p: ParseResult) -> dict[tuple[str, str], float]:
    """(policy, outcome) -> keyed follow-ups, for each sticky or prefix-hash policy on the page."""
    out: dict[tuple[str, str], float] = {}
    for family, (policy, outcomes) in STICKY_BRANCHES.items():
        got = p.samples.get(family)
        if not got:
            continue
        for o in STICKY_OUTCOMES:
            out[(policy, o)] = 0.0
        for branch, v in by_label(got, "branch").items():
            if branch in outcomes:
                out[(policy, outcomes[branch])] += v
    return out


def _index_faults(p: ParseResult) -> dict[str, float]:
    out: dict[str, float] = {}
    for family, (label, faults, kind) in INDEX_FAULTS.items():
        got = p.samples.get(family)
        if got:
            out[kind] = sum(s.value for s in got if s.labels.get(label) in faults)
    return out


def _engine_hit_ratio(p: ParseResult) -> dict[str, float]:
    """Worker -> mean engine hit ratio over its models and DP ranks; a removed worker's −1 (and
    anything else outside [0, 1]) is no reading."""
    per: dict[str, list[float]] = {}
    for s in p.samples.get(SMG_ENGINE_HIT_RATE, ()):
        worker = s.labels.get("worker")
        if worker is not None and 0.0 <= s.value <= 1.0:
            per.setdefault(worker, []).append(s.value)
    return {w: sum(v) / len(v) for w, v in per.items()}


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
        sticky_followups=_sticky(p),
        index_faults=_index_faults(p),
        kv_event_lag_seconds=histogram(p, SMG_KV_LAG),
        largest_tree=largest(p, TREE_SIZES),
        engine_hit_ratio=named(_engine_hit_ratio(p), names),
    )


_COUNTS = frozenset({SMG_SENDS, SMG_DECISIONS, SMG_BRANCH, SGL_DECISIONS, SGL_WORKER_REQUESTS, SGL_HITS, SGL_MISSES,
                     SGL_CACHE_DECISIONS, *histogram_names(SMG_MATCH_RATIO),
                     *histogram_names(SMG_LOOKUP), SMG_MANUAL, SMG_PREFIX_HASH, SMG_KV_GAPS, SMG_KV_RESYNCS,
                     *histogram_names(SMG_KV_LAG)})
ADAPTER = RouterAdapter(
    kind="sglang-router", prefixes=("smg_", "sgl_router_"),
    names=_COUNTS | {SMG_HEALTH, SMG_ENGINE_HIT_RATE, *TREE_SIZES}, counts=_COUNTS | set(TREE_SIZES), ratios=frozenset({SMG_HEALTH}),
    build=build, tree_bound=DEFAULT_MAX_TREE_SIZE,
    source="sglang-router 0.3.2 wheel; smg 1.13.0 wheel; smg-project/smg observability/metrics.rs; "
           "sgl-project/sglang sgl-router",
)
