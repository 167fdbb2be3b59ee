"""The metric catalogue: every series prefixscope exports, every recording rule, every check.

This module is the single source of truth. The exporter's collector, the generated rule
files, the dashboards, the runbook index, docs/metrics.md and the console all read it; a
metric or threshold that is not declared here does not exist. Threshold *values* live in
``alerts/thresholds.yaml`` (keyed by ``Check.threshold``) and nowhere else.

Groups follow the seed's SRE checklist: 0 is telemetry health (the step added in front of
the diagnosis chain), 1–5 are the five checklist groups, and ``None`` marks the
"beyond the checklist" series (reuse decomposition, hotspots, autoscaling, fallback ladder).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

NAMESPACE = "prefixscope"

MetricType = Literal["counter", "gauge", "histogram", "gaugehistogram", "info"]

# Bucket layouts. Chosen so each checklist threshold falls exactly on a boundary, which keeps
# histogram_quantile's interpolation from moving an alert across its threshold.
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
DEPTH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
FANOUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPLICA_BUCKETS = (1, 2, 3, 4, 8, 16)
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS = (2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 6e-4, 8e-4, 1.2e-3, 2.4e-3, 5e-3)
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
WALK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)


@dataclass(frozen=True)
class Metric:
    """One exported metric family (the name is the family name, without ``_total``)."""

    name: str
    type: MetricType
    unit: str
    help: str
    labels: tuple[str, ...]
    group: int | None
    source: str  # which input feeds it: worker_metrics, kv_events, records, router_metrics, topology, exporter
    buckets: tuple[float, ...] | None = None

    @property
    def sample_name(self) -> str:
        """The name a PromQL query uses for the plain series (``_total`` for counters)."""
        return self.name + "_total" if self.type == "counter" else self.name


@dataclass(frozen=True)
class RecordingRule:
    """A recording rule named ``level:metric:operations``."""

    record: str
    expr: str
    group: int | None
    help: str


@dataclass(frozen=True)
class Check:
    """One line of the seed's checklist (or an SLO, or a telemetry-health check).

    ``value`` is a PromQL expression (usually a recording rule) whose result is compared
    with the threshold ``threshold`` from alerts/thresholds.yaml using ``op``.
    ``signals`` name the ``prefixscope_signal_available{signal=...}`` values this check
    needs: when any is 0 the check is "not instrumented", never "ok" and never "firing".
    """

    key: str  # the seed's checklist name, e.g. prefix_hit_rate_total
    group: int
    title: str
    alert: str  # CamelCase alert name, shared prefix "Prefix"
    value: str  # PromQL for the key number
    op: Literal["<", ">"]
    threshold: str  # key in alerts/thresholds.yaml
    unit: str  # ratio, seconds, blocks, usd, per_minute, depth
    signals: tuple[str, ...]
    meaning: str
    kind: Literal["checklist", "slo", "health"] = "checklist"
    # Multiplier applied to the threshold in the alert expression, for relative thresholds
    # ("p99 > 3 × warm baseline"): the alert compares value > threshold * baseline.
    baseline: str | None = None


@dataclass(frozen=True)
class Step:
    """One step of the ordered diagnosis chain."""

    number: int
    title: str
    question: str
    dashboard_row: str


# --------------------------------------------------------------------------------------
# Signals: each one is a named input that may or may not be instrumented.
# --------------------------------------------------------------------------------------
SIGNALS: dict[str, str] = {
    "worker_metrics": "worker /metrics scraped (vLLM or SGLang)",
    "kv_events": "vLLM KV-cache events over ZMQ",
    "records": "request records (prefixscope.request/v1)",
    "session_key": "records carry session_key",
    "block_hashes": "records carry block_hashes",
    "cached_tokens": "records carry engine-reported cached_tokens",
    "predicted_cached_tokens": "records carry the router's predicted_cached_tokens",
    "prefill_timing": "records carry prefill_s",
    "async_prefill": "records carry async_wait_s",
    "walk_latency": "records carry walk_s (router tree-walk latency)",
    "topology": "a topology file is loaded",
    "warm_pool": "the topology names warm-pool workers",
    "migrations": "records carry migrated_from / migration_kind",
    "expert_signature": "records carry expert_signature",
    "spec_decode": "workers export speculative-decoding counters",
    "affinity_admission": "records carry admitted_by_affinity",
    "router_metrics": "router /metrics scraped (sglang-router or vllm-router)",
}

STEPS: tuple[Step, ...] = (
    Step(0, "Telemetry", "Is the telemetry itself healthy — targets up, KV-event stream fresh, no gaps?", "Step 0 — telemetry health"),
    Step(1, "Cache", "Is the cache itself broken?", "Step 1 — prefix cache health"),
    Step(2, "Affinity", "Did sticky sessions or migration fail?", "Step 2 — request affinity"),
    Step(3, "Cold-miss cost", "Is the cold-miss cost out of control?", "Step 3 — cold prefill economics"),
    Step(4, "Router & topology", "Is the router or the topology dragging?", "Step 4 — router and topology"),
    Step(5, "Coupled optimisations", "Is a coupled optimisation cancelling locality?", "Step 5 — coupled optimisations"),
)

W = "worker"
M = "model"


def _m(name: str, type_: MetricType, unit: str, help_: str, labels: Iterable[str], group: int | None,
       source: str, buckets: tuple[float, ...] | None = None) -> Metric:
    return Metric(f"{NAMESPACE}_{name}", type_, unit, help_, tuple(labels), group, source, buckets)


METRICS: tuple[Metric, ...] = (
    # ---- group 0: telemetry health --------------------------------------------------------
    _m("up", "gauge", "", "1 if the last scrape of the target succeeded, 0 if it failed.", ("target", "kind"), 0, "exporter"),
    _m("scrape_duration_seconds", "gauge", "seconds", "Duration of the last scrape of the target.", ("target", "kind"), 0, "exporter"),
    _m("telemetry_blind_targets", "gauge", "", "Scrape targets failing while traffic still reaches them (a router target, or a worker that served after its scrapes began to fail); a worker that left the pool is not counted.", (), 0, "exporter"),
    _m("signal_available", "gauge", "", "1 if the named input signal has a source, 0 if it is not instrumented.", ("signal",), 0, "exporter"),
    _m("ingest_errors", "counter", "", "Inputs rejected, by source and kind of error (the rest of each batch is kept).", ("source", "kind"), 0, "exporter"),
    _m("records_ingested", "counter", "", "Request records accepted, by transport.", ("transport",), 0, "records"),
    _m("kv_event_batches", "counter", "", "KV-event batches received per worker.", (W,), 0, "kv_events"),
    _m("kv_events_applied", "counter", "", "KV-cache events applied to the index per worker, by event type.", (W, "event"), 0, "kv_events"),
    _m("kv_event_sequence_gaps", "counter", "", "Gaps detected in a worker's KV-event sequence numbers.", (W,), 0, "kv_events"),
    _m("kv_event_missed_batches", "counter", "", "Batches missing after sequence gaps (before replay).", (W,), 0, "kv_events"),
    _m("kv_event_replays", "counter", "", "Replay requests sent after gaps, by result (recovered, partial, failed).", (W, "result"), 0, "kv_events"),
    _m("kv_event_last_timestamp_seconds", "gauge", "seconds", "Wall-clock time the last KV-event batch from the worker was received (or of the last scrape that found the worker idle, with no events to send).", (W,), 0, "kv_events"),
    _m("kv_event_lag_seconds", "gauge", "seconds", "Receive time minus the batch timestamp of the worker's last KV-event batch.", (W,), 0, "kv_events"),
    _m("kv_event_unknown_parent", "counter", "", "BlockStored events whose parent block is not in the worker's view.", (W,), 0, "kv_events"),
    _m("kv_event_unknown_block_removals", "counter", "", "BlockRemoved hashes that the worker's view did not hold.", (W,), 0, "kv_events"),
    _m("worker_restarts", "counter", "", "Worker restarts detected (sequence restarted at 0); the worker's view was cleared.", (W,), 0, "kv_events"),
    _m("index_staleness_tokens", "counter", "tokens", "Tokens the router predicted as cached but the engine did not report (predicted − achieved, floored at 0).", (M,), 0, "records"),
    # ---- group 1: prefix cache health ----------------------------------------------------
    _m("prefix_cache_queried_tokens", "counter", "tokens", "Prompt tokens looked up in the worker's prefix cache (engine counter, normalised).", (W, M), 1, "worker_metrics"),
    _m("prefix_cache_hit_tokens", "counter", "tokens", "Prompt tokens found in the worker's prefix cache (engine counter, normalised).", (W, M), 1, "worker_metrics"),
    _m("worker_kv_cache_usage_ratio", "gauge", "ratio", "KV-cache usage reported by the engine (0–1).", (W, M), 1, "worker_metrics"),
    _m("session_followup_prompt_tokens", "counter", "tokens", "Prompt tokens of follow-up requests (turn ≥ 2) of keyed sessions.", (M,), 1, "records"),
    _m("session_followup_cached_tokens", "counter", "tokens", "Engine-reported cached tokens of follow-up requests (turn ≥ 2) of keyed sessions.", (M,), 1, "records"),
    _m("session_hit_ratio", "gaugehistogram", "ratio", "Distribution over sessions active in the window of Σcached/Σprompt over their follow-up requests.", (), 1, "records", RATIO_BUCKETS),
    _m("worker_resident_blocks", "gauge", "blocks", "Blocks resident on the worker, from its KV events.", (W,), 1, "kv_events"),
    _m("worker_capacity_blocks", "gauge", "blocks", "The worker's KV-cache capacity (num_gpu_blocks from cache_config_info, or the topology).", (W,), 1, "worker_metrics"),
    _m("worker_block_size_tokens", "gauge", "tokens", "The worker's KV block size in tokens.", (W,), 1, "worker_metrics"),
    _m("prefix_tree_leaf_depth", "gaugehistogram", "edges", "Leaf depth of the radix-compressed cluster prefix tree (runs without branching are one edge).", (), 1, "kv_events", DEPTH_BUCKETS),
    _m("prefix_tree_leaf_block_depth", "gaugehistogram", "blocks", "Leaf depth of the cluster prefix tree in blocks.", (), 1, "kv_events", DEPTH_BUCKETS),
    _m("prefix_tree_node_fanout", "gaugehistogram", "", "Children per branching node of the radix-compressed prefix tree.", (), 1, "kv_events", FANOUT_BUCKETS),
    _m("prefix_tree_root_fanout", "gauge", "", "Distinct first blocks in the cluster prefix tree (a broken shared prefix shows as a jump).", (), 1, "kv_events"),
    _m("prefix_tree_nodes", "gauge", "", "Nodes (radix edges) in the cluster prefix tree.", (), 1, "kv_events"),
    _m("prefix_tree_blocks", "gauge", "blocks", "Distinct blocks in the cluster prefix tree.", (), 1, "kv_events"),
    _m("prefix_tree_block_replicas", "gaugehistogram", "", "Number of workers holding each distinct block (duplication across workers).", (), 1, "kv_events", REPLICA_BUCKETS),
    # ---- group 2: request affinity -------------------------------------------------------
    _m("followup_requests", "counter", "", "Follow-up requests (turn ≥ 2) of keyed sessions.", (M,), 2, "records"),
    _m("sticky_collisions", "counter", "", "Follow-up requests whose session was last served by a different, still-healthy worker.", (M,), 2, "records"),
    _m("warm_pool_utilization_ratio", "gauge", "ratio", "Utilisation of a warm-pool worker: max(KV-cache usage, running / max concurrency).", (W,), 2, "worker_metrics"),
    _m("session_migrations", "counter", "", "Sessions moved because their worker left, drained or failed, by kind (soft, hard).", ("kind",), 2, "records"),
    _m("session_rekeys", "counter", "", "New session keys whose first prompt matches another recent session's chain (re-keyed sessions), by segment.", ("segment",), 2, "records"),
    _m("worker_pool_size", "gauge", "", "Workers currently seen healthy.", (), 2, "exporter"),
    _m("worker_pool_changes", "counter", "", "Changes of the healthy worker set.", (), 2, "exporter"),
    _m("session_reshuffle_ratio", "gauge", "ratio", "Share of sessions seen both before and after the last pool change whose worker changed.", (), 2, "records"),
    # ---- group 3: cold prefill economics -------------------------------------------------
    _m("cold_prefill_seconds", "histogram", "seconds", "Prefill time of cold requests (reused share at most cold_reuse_share).", (M, "gpu_class"), 3, "records", PREFILL_BUCKETS),
    _m("prefill_seconds_per_token", "histogram", "seconds", "Prefill time per computed prompt token, by path (cold, warm).", (M, "path"), 3, "records", PER_TOKEN_BUCKETS),
    _m("cold_requests", "counter", "", "Cold requests.", (M,), 3, "records"),
    _m("cold_prefill_gpu_seconds", "counter", "seconds", "GPU-seconds spent on cold prefill (prefill time × GPUs per worker).", (M,), 3, "records"),
    _m("cold_prefill_cost_usd", "counter", "usd", "Cost of cold prefill (GPU-seconds × price per GPU-hour / 3600).", (M,), 3, "records"),
    _m("async_prefill_wait_seconds", "histogram", "seconds", "Wait of requests sent to the async prefill path.", (M,), 3, "records", WAIT_BUCKETS),
    _m("prefix_miss_cost_seconds", "histogram", "seconds", "Miss cost of requests that missed (T_prefill + T_queue + T_migrate, seed §5).", (M,), 3, "records", PREFILL_BUCKETS),
    # ---- group 4: router and topology ----------------------------------------------------
    _m("router_tree_walk_seconds", "histogram", "seconds", "Router prefix-tree lookup latency.", (), 4, "records", WALK_BUCKETS),
    _m("placement_decisions", "counter", "", "Requests whose longest cached prefix was resident somewhere in the cluster.", (M,), 4, "records"),
    _m("placement_domain_hits", "counter", "", "Of those, requests placed in the NVLink domain that holds their longest cached prefix.", (M,), 4, "records"),
    _m("cross_node_migrations", "counter", "", "Session migrations whose old and new worker are on different nodes, by kind.", ("kind",), 4, "records"),
    _m("router_decisions", "counter", "", "Routing decisions per worker, from the router's own /metrics.", ("router", W), 4, "router_metrics"),
    _m("router_prefix_outcomes", "counter", "", "Router prefix-match outcomes (hit, miss), from the router's own /metrics.", ("router", "outcome"), 4, "router_metrics"),
    _m("router_worker_healthy", "gauge", "", "Worker health as the router sees it (1 healthy, 0 not).", ("router", W), 4, "router_metrics"),
    # ---- group 5: coupled optimisations --------------------------------------------------
    _m("moe_prefix_hits", "counter", "", "Requests with a prefix hit that carry an expert signature.", (M,), 5, "records"),
    _m("moe_expert_aligned_hits", "counter", "", "Of those, hits whose expert signature matches the cached prefix's.", (M,), 5, "records"),
    _m("spec_decode_draft_tokens", "counter", "tokens", "Speculative-decoding draft tokens (engine counter, normalised).", (W, M), 5, "worker_metrics"),
    _m("spec_decode_accepted_tokens", "counter", "tokens", "Speculative-decoding accepted tokens (engine counter, normalised).", (W, M), 5, "worker_metrics"),
    _m("batch_admissions", "counter", "", "Continuous-batching admissions.", (M,), 5, "records"),
    _m("batch_affinity_admissions", "counter", "", "Admissions chosen for prefix affinity.", (M,), 5, "records"),
    # ---- beyond the checklist -------------------------------------------------------------
    _m("request_prompt_tokens", "counter", "tokens", "Prompt tokens of recorded requests.", (M,), None, "records"),
    _m("reuse_available_tokens", "counter", "tokens", "Tokens reusable at best: the longest cached match on any worker, from the index.", (M,), None, "records"),
    _m("reuse_predicted_tokens", "counter", "tokens", "Tokens the router believed cached on the chosen worker.", (M,), None, "records"),
    _m("reuse_achieved_tokens", "counter", "tokens", "Tokens the engine reported as cached.", (M,), None, "records"),
    _m("worker_effective_cache_value_tokens", "gauge", "tokens", "Resident tokens × the worker's recent hit ratio (affinity-aware autoscaling signal).", (W,), None, "kv_events"),
    _m("worker_removal_rank", "gauge", "", "Safe-to-remove ranking by effective cache value (1 = safest to remove).", (W,), None, "kv_events"),
    _m("worker_info", "gauge", "", "Topology of each worker (value 1): its node, NVLink domain, GPU class and warm-pool membership.", (W, "node", "nvlink_domain", "gpu_class", "warm_pool"), None, "topology"),
    _m("fallback_requests", "counter", "", "Requests served through a fallback tier of the ladder.", ("tier",), None, "records"),
    _m("fallback_active", "gauge", "", "1 while a fallback tier is in use (used in the window and its exit condition not met).", ("tier",), None, "records"),
    _m("hot_branch_hit_tokens", "gauge", "tokens", "Hit tokens in the window of the top-K hottest prefix branches (bounded: rank 1..K).", ("rank", "branch"), None, "records"),
    _m("exporter_build_info", "gauge", "", "prefixscope build information (value 1).", ("version",), None, "exporter"),
)

METRICS_BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}

P = NAMESPACE


def _ratio(num: str, den: str, by: str, window: str = "5m") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({num}[{window}])) / {agg} (rate({den}[{window}]))"


def _quantile(q: float, metric: str, by: str = "", window: str = "5m") -> str:
    labels = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket[{window}])))"


RECORDING_RULES: tuple[RecordingRule, ...] = (
    # group 1
    RecordingRule("cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  _ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", ""),
                  1, "Cluster-wide prefix-cache hit ratio (tokens)."),
    RecordingRule("model:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  _ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", "model"),
                  1, "Prefix-cache hit ratio per model."),
    RecordingRule("worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  _ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", "worker"),
                  1, "Prefix-cache hit ratio per worker."),
    RecordingRule("cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m",
                  _ratio(f"{P}_session_followup_cached_tokens_total", f"{P}_session_followup_prompt_tokens_total", ""),
                  1, "Session hit ratio over follow-up turns, pooled over sessions."),
    RecordingRule("cluster:prefixscope_session_hit_ratio:p50",
                  f"histogram_quantile(0.5, sum by (le) ({P}_session_hit_ratio_bucket))",
                  1, "Median session hit ratio over sessions active in the window."),
    RecordingRule("worker:prefixscope_worker_resident_blocks_per_capacity:ratio",
                  f"{P}_worker_resident_blocks / on (worker) {P}_worker_capacity_blocks",
                  1, "Resident blocks against capacity per worker."),
    RecordingRule("cluster:prefixscope_prefix_tree_leaf_depth:p99",
                  f"histogram_quantile(0.99, sum by (le) ({P}_prefix_tree_leaf_depth_bucket))",
                  1, "p99 leaf depth of the radix-compressed prefix tree."),
    # group 2
    RecordingRule("cluster:prefixscope_sticky_collisions_per_followup_requests:ratio_rate5m",
                  _ratio(f"{P}_sticky_collisions_total", f"{P}_followup_requests_total", ""),
                  2, "Share of follow-ups served away from their session's still-healthy worker."),
    RecordingRule("cluster:prefixscope_warm_pool_utilization_ratio:avg",
                  f"avg({P}_warm_pool_utilization_ratio)",
                  2, "Average utilisation of the warm pool."),
    RecordingRule("cluster:prefixscope_session_migrations:rate5m_per_minute",
                  f"sum(rate({P}_session_migrations_total[5m])) * 60",
                  2, "Session migrations per minute."),
    # group 3
    RecordingRule("cluster:prefixscope_cold_prefill_seconds:p50_5m", _quantile(0.5, f"{P}_cold_prefill_seconds"), 3, "Cold prefill p50."),
    RecordingRule("cluster:prefixscope_cold_prefill_seconds:p95_5m", _quantile(0.95, f"{P}_cold_prefill_seconds"), 3, "Cold prefill p95."),
    RecordingRule("cluster:prefixscope_cold_prefill_seconds:p99_5m", _quantile(0.99, f"{P}_cold_prefill_seconds"), 3, "Cold prefill p99."),
    RecordingRule("cluster:prefixscope_cold_prefill_seconds_per_token:p99_5m",
                  f'histogram_quantile(0.99, sum by (le) (rate({P}_prefill_seconds_per_token_bucket{{path="cold"}}[5m])))',
                  3, "Cold prefill time per computed token, p99."),
    RecordingRule("cluster:prefixscope_warm_prefill_seconds_per_token:p50_1h",
                  f'histogram_quantile(0.5, sum by (le) (rate({P}_prefill_seconds_per_token_bucket{{path="warm"}}[1h])))',
                  3, "Warm baseline: warm prefill time per computed token, p50 over 1h."),
    RecordingRule("cluster:prefixscope_cold_prefill_cost_usd_per_cold_request:ratio_rate5m",
                  _ratio(f"{P}_cold_prefill_cost_usd_total", f"{P}_cold_requests_total", ""),
                  3, "Cold prefill cost per cold request."),
    RecordingRule("cluster:prefixscope_async_prefill_wait_seconds:p99_5m", _quantile(0.99, f"{P}_async_prefill_wait_seconds"), 3, "Async prefill wait p99."),
    RecordingRule("cluster:prefixscope_prefix_miss_cost_seconds:p95_5m", _quantile(0.95, f"{P}_prefix_miss_cost_seconds"), 3, "Prefix miss cost p95."),
    # group 4
    RecordingRule("cluster:prefixscope_router_tree_walk_seconds:p99_5m", _quantile(0.99, f"{P}_router_tree_walk_seconds"), 4, "Router tree-walk p99."),
    RecordingRule("cluster:prefixscope_placement_domain_hits_per_placement_decisions:ratio_rate5m",
                  _ratio(f"{P}_placement_domain_hits_total", f"{P}_placement_decisions_total", ""),
                  4, "Topology-aware placement hit ratio."),
    RecordingRule("cluster:prefixscope_cross_node_migrations:rate5m_per_minute",
                  f"sum(rate({P}_cross_node_migrations_total[5m])) * 60",
                  4, "Cross-node migrations per minute."),
    # group 5
    RecordingRule("cluster:prefixscope_moe_expert_aligned_hits_per_moe_prefix_hits:ratio_rate5m",
                  _ratio(f"{P}_moe_expert_aligned_hits_total", f"{P}_moe_prefix_hits_total", ""),
                  5, "MoE expert alignment ratio."),
    RecordingRule("cluster:prefixscope_spec_decode_accepted_tokens_per_draft_tokens:ratio_rate5m",
                  _ratio(f"{P}_spec_decode_accepted_tokens_total", f"{P}_spec_decode_draft_tokens_total", ""),
                  5, "Speculative-decoding acceptance ratio."),
    RecordingRule("cluster:prefixscope_batch_affinity_admissions_per_batch_admissions:ratio_rate5m",
                  _ratio(f"{P}_batch_affinity_admissions_total", f"{P}_batch_admissions_total", ""),
                  5, "Continuous-batching affinity admission ratio."),
    # beyond: reuse decomposition
    RecordingRule("cluster:prefixscope_reuse_available_tokens_per_prompt_tokens:ratio_rate5m",
                  _ratio(f"{P}_reuse_available_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  None, "Reusable share of prompt tokens (best worker)."),
    RecordingRule("cluster:prefixscope_reuse_predicted_tokens_per_prompt_tokens:ratio_rate5m",
                  _ratio(f"{P}_reuse_predicted_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  None, "Share of prompt tokens the router believed cached."),
    RecordingRule("cluster:prefixscope_reuse_achieved_tokens_per_prompt_tokens:ratio_rate5m",
                  _ratio(f"{P}_reuse_achieved_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  None, "Share of prompt tokens the engines reported cached."),
    RecordingRule("cluster:prefixscope_index_staleness_tokens_per_prompt_tokens:ratio_rate5m",
                  _ratio(f"{P}_index_staleness_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  0, "Share of prompt tokens predicted cached but not achieved (stale index)."),
)

RULES_BY_NAME: dict[str, RecordingRule] = {r.record: r for r in RECORDING_RULES}

CHECKS: tuple[Check, ...] = (
    # ---- step 0: telemetry health ---------------------------------------------------------
    Check("targets_up", 0, "Scrape targets up", "PrefixTelemetryTargetDown",
          f"max({P}_telemetry_blind_targets)", ">", "targets_up", "targets", (),
          "A router, or a worker that still serves traffic, fails its /metrics scrape: the chain would "
          "read part of the fleet blind. (A worker that failed and left the pool shows in step 2.)", "health"),
    Check("kv_event_staleness", 0, "KV-event stream fresh", "PrefixTelemetryKvEventsStale",
          f"max(time() - {P}_kv_event_last_timestamp_seconds)", ">", "kv_event_staleness", "seconds", ("kv_events",),
          "A worker's KV-event stream has gone quiet while it serves traffic; the index is going stale.", "health"),
    Check("kv_event_gaps", 0, "KV-event sequence gaps", "PrefixTelemetryKvEventGaps",
          f"sum(increase({P}_kv_event_missed_batches_total[5m]))", ">", "kv_event_gaps", "batches", ("kv_events",),
          "KV-event batches were lost in the last 5 minutes.", "health"),
    Check("index_staleness", 0, "Index staleness (predicted − achieved)", "PrefixTelemetryIndexStale",
          "cluster:prefixscope_index_staleness_tokens_per_prompt_tokens:ratio_rate5m", ">", "index_staleness", "ratio",
          ("predicted_cached_tokens", "cached_tokens"),
          "The router believes blocks are cached that the engines do not have.", "health"),
    Check("ingest_errors", 0, "Ingest errors", "PrefixTelemetryIngestErrors",
          f"sum(rate({P}_ingest_errors_total[5m]))", ">", "ingest_errors", "per_second", (),
          "prefixscope is rejecting malformed input from a source.", "health"),
    # ---- step 1 -----------------------------------------------------------------------------
    Check("prefix_hit_rate_total", 1, "Prefix hit rate (cluster)", "PrefixHitRateLow",
          "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m", "<", "prefix_hit_rate_total", "ratio",
          ("worker_metrics",), "Σ hit tokens / Σ queried tokens across the cluster."),
    Check("prefix_hit_rate_per_session", 1, "Session hit rate (follow-up turns)", "PrefixSessionHitRateLow",
          "cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m", "<", "prefix_hit_rate_per_session", "ratio",
          ("session_key", "cached_tokens"), "Σ cached / Σ prompt tokens over follow-up turns of keyed sessions."),
    Check("prefix_block_count_per_worker", 1, "Resident blocks vs capacity", "PrefixCacheNearCapacity",
          "max(worker:prefixscope_worker_resident_blocks_per_capacity:ratio)", ">", "prefix_block_count_per_worker", "ratio",
          ("kv_events",), "Resident blocks per worker from KV events against num_gpu_blocks."),
    Check("prefix_tree_depth_p99", 1, "Prefix-tree depth p99", "PrefixTreeTooDeep",
          "cluster:prefixscope_prefix_tree_leaf_depth:p99", ">", "prefix_tree_depth_p99", "depth",
          ("kv_events",), "p99 leaf depth of the radix-compressed prefix tree."),
    # ---- step 2 -----------------------------------------------------------------------------
    Check("sticky_session_collision_rate", 2, "Sticky-session collisions", "PrefixStickyCollisionsHigh",
          "cluster:prefixscope_sticky_collisions_per_followup_requests:ratio_rate5m", ">", "sticky_session_collision_rate", "ratio",
          ("session_key",), "Share of follow-ups whose session was last served by a different, still-healthy worker."),
    Check("warm_pool_utilization", 2, "Warm-pool utilisation", "PrefixWarmPoolSaturated",
          "cluster:prefixscope_warm_pool_utilization_ratio:avg", ">", "warm_pool_utilization", "ratio",
          ("warm_pool", "worker_metrics"), "Average of max(KV usage, running / max concurrency) over warm-pool workers."),
    Check("session_migration_count_per_minute", 2, "Session migrations per minute", "PrefixSessionMigrationsHigh",
          "cluster:prefixscope_session_migrations:rate5m_per_minute", ">", "session_migration_count_per_minute", "per_minute",
          ("migrations",), "Sessions moved because their worker left, drained or failed."),
    # ---- step 3 -----------------------------------------------------------------------------
    Check("cold_prefill_time_p99", 3, "Cold prefill p99 vs warm baseline", "PrefixColdPrefillSlow",
          "cluster:prefixscope_cold_prefill_seconds_per_token:p99_5m", ">", "cold_prefill_time_p99", "ratio_to_baseline",
          ("prefill_timing",), "Cold prefill time per computed token (p99) against the warm baseline (p50 over 1h).",
          baseline="cluster:prefixscope_warm_prefill_seconds_per_token:p50_1h"),
    Check("cold_prefill_cost_per_request", 3, "Cold prefill cost per request", "PrefixColdPrefillCostHigh",
          "cluster:prefixscope_cold_prefill_cost_usd_per_cold_request:ratio_rate5m", ">", "cold_prefill_cost_per_request", "usd",
          ("prefill_timing", "topology"), "Cold prefill GPU-seconds × price per GPU-hour."),
    Check("async_prefill_wait_time_p99", 3, "Async prefill wait p99", "PrefixAsyncPrefillBacklog",
          "cluster:prefixscope_async_prefill_wait_seconds:p99_5m", ">", "async_prefill_wait_time_p99", "seconds",
          ("async_prefill",), "Wait of requests sent to the async prefill path."),
    # ---- step 4 -----------------------------------------------------------------------------
    Check("prefix_tree_walk_latency", 4, "Router tree-walk p99", "PrefixRouterTreeWalkSlow",
          "cluster:prefixscope_router_tree_walk_seconds:p99_5m", ">", "prefix_tree_walk_latency", "seconds",
          ("walk_latency",), "Router prefix-tree lookup latency."),
    Check("topology_aware_placement_hit_rate", 4, "Topology-aware placement", "PrefixPlacementTopologyBlind",
          "cluster:prefixscope_placement_domain_hits_per_placement_decisions:ratio_rate5m", "<", "topology_aware_placement_hit_rate", "ratio",
          ("topology", "block_hashes"), "Share of requests placed in the NVLink domain holding their longest cached prefix."),
    Check("cross_node_migration_count_per_minute", 4, "Cross-node migrations per minute", "PrefixCrossNodeMigrationStorm",
          "cluster:prefixscope_cross_node_migrations:rate5m_per_minute", ">", "cross_node_migration_count_per_minute", "per_minute",
          ("migrations", "topology"), "Migrations whose old and new worker sit on different nodes."),
    # ---- step 5 -----------------------------------------------------------------------------
    Check("moe_expert_alignment_rate", 5, "MoE expert alignment", "PrefixMoeExpertMisaligned",
          "cluster:prefixscope_moe_expert_aligned_hits_per_moe_prefix_hits:ratio_rate5m", "<", "moe_expert_alignment_rate", "ratio",
          ("expert_signature",), "Share of prefix hits whose expert signature matches the cached prefix's."),
    Check("speculative_decoding_acceptance_rate", 5, "Speculative-decoding acceptance", "PrefixSpecDecodeAcceptanceLow",
          "cluster:prefixscope_spec_decode_accepted_tokens_per_draft_tokens:ratio_rate5m", "<", "speculative_decoding_acceptance_rate", "ratio",
          ("spec_decode",), "Accepted / draft tokens."),
    Check("continuous_batching_affinity_admission_rate", 5, "Affinity admissions", "PrefixBatchingAffinityBlind",
          "cluster:prefixscope_batch_affinity_admissions_per_batch_admissions:ratio_rate5m", "<", "continuous_batching_affinity_admission_rate", "ratio",
          ("affinity_admission",), "Share of admissions chosen for prefix affinity."),
    # ---- SLOs (seed §7, corollary 4) ---------------------------------------------------------
    Check("slo_session_hit_rate", 1, "SLO: session hit rate ≥ 85%", "PrefixSessionHitRateSloBurn",
          "cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m", "<", "slo_session_hit_rate", "ratio",
          ("session_key", "cached_tokens"), "Multi-turn session hit rate against its SLO target.", "slo"),
    Check("slo_prefix_miss_cost", 3, "SLO: miss cost p95 ≤ 1.5 × cold baseline", "PrefixMissCostSloBurn",
          "cluster:prefixscope_prefix_miss_cost_seconds:p95_5m", ">", "slo_prefix_miss_cost", "ratio_to_baseline",
          ("prefill_timing",), "Prefix miss cost (T_prefill + T_queue + T_migrate) p95 against the cold-prefill p95 "
          "(queueing and migration must not amplify the cold-prefill tail).", "slo",
          baseline="cluster:prefixscope_cold_prefill_seconds:p95_5m"),
)

CHECKS_BY_KEY: dict[str, Check] = {c.key: c for c in CHECKS}
CHECKS_BY_ALERT: dict[str, Check] = {c.alert: c for c in CHECKS}


def checks_for_step(step: int) -> list[Check]:
    return [c for c in CHECKS if c.group == step]


def as_dict() -> dict:
    """The catalogue as plain data (for ``prefixscope catalog --format json`` and the API)."""
    return {
        "namespace": NAMESPACE,
        "signals": SIGNALS,
        "steps": [asdict(s) for s in STEPS],
        "metrics": [asdict(m) | {"sample_name": m.sample_name} for m in METRICS],
        "recording_rules": [asdict(r) for r in RECORDING_RULES],
        "checks": [asdict(c) for c in CHECKS],
    }


def to_json() -> str:
    return json.dumps(as_dict(), indent=2, ensure_ascii=False)


def to_table() -> str:
    """A fixed-width table of the exported metrics, grouped by checklist group."""
    rows = [("group", "name", "type", "unit", "labels", "source")]
    for m in METRICS:
        rows.append((str(m.group if m.group is not None else "+"), m.name, m.type, m.unit or "-",
                     ",".join(m.labels) or "-", m.source))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    lines.append("checks (seed checklist name → alert, threshold key in alerts/thresholds.yaml):")
    for c in CHECKS:
        lines.append(f"  step {c.group}  {c.key:<45} {c.op} {c.threshold:<45} {c.alert}")
    return "\n".join(lines)


__all__ = [
    "CHECKS", "CHECKS_BY_ALERT", "CHECKS_BY_KEY", "METRICS", "METRICS_BY_NAME", "NAMESPACE",
    "RECORDING_RULES", "RULES_BY_NAME", "SIGNALS", "STEPS", "Check", "Metric", "RecordingRule", "Step",
    "as_dict", "checks_for_step", "to_json", "to_table",
]
