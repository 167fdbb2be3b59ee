"""The metric catalogue: every series prefixscope exports, every recording rule, every check.

This module is the single source of truth. The exporter's collector, the generated rule
files, the dashboards, the runbook index, docs/metrics.md and the console all read it; a
metric or threshold that is not declared here does not exist. Threshold *values* live in
``alerts/thresholds.yaml`` (keyed by ``Check.threshold``) and nowhere else.

Groups follow the seed's SRE checklist: 0 is telemetry health (the step added in front of
the diagnosis chain), 1–5 are the five checklist groups, and ``None`` marks the
"beyond the checklist" series (reuse decomposition, hotspots, autoscaling, fallback ladder).

Rows name every field (the row types are keyword-only), so whoever edits a table sees what each
value is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

NAMESPACE = "prefixscope"
# The always-firing alert of a dead-man's switch: it says the alerting pipeline is alive, never
# that the fleet is sick, so the chain, the console and the scenario verdicts leave it out.
WATCHDOG_ALERT = "PrefixWatchdog"

MetricType = Literal["counter", "gauge", "histogram", "gaugehistogram", "info"]

# Bucket layouts. Chosen so each checklist threshold falls exactly on a boundary, which keeps
# histogram_quantile's interpolation from moving an alert across its threshold.
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
DEPTH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
FANOUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPLICA_BUCKETS = (1, 2, 3, 4, 8, 16)
# Prefill times step by about 1.5× so a p99 read off the buckets stays near the real one: with
# 2–2.5× steps a 2.4× shift (cold work moving to a GPU class half as fast) read as 4× the
# baseline and crossed PrefixColdPrefillSlow's 3×.
PREFILL_BUCKETS = (0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0,
                   15.0, 25.0, 40.0, 60.0, 100.0)
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
EVICTION_AGE_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 14400.0)
WALK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
# Wall time of one batch of the exporter's own work (a KV drain takes sub-milliseconds, a scrape
# round of a large fleet or a statistics reading of a large tree seconds).
DUTY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Time to first token per worker (records and OTLP spans): from a warm short prompt to a cold long one.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 20.0, 40.0, 80.0)
# A router's KV-event lag, publisher stamp to apply (smg): sub-millisecond when healthy, seconds when behind.
# The router's own time per routing phase: microseconds of hashing up to the scheduler's queueing.
OVERHEAD_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                    5e-2, 0.1, 0.25, 0.5, 1.0)
LAG_BUCKETS = (5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's sampled KV-block residency (--kv-cache-metrics): bounds its default kv_cache_residency buckets
# also have, so "≤ bound" counts stay exact under vLLM's defaults, thinned below a tenth of a second
# (a block that lives a millisecond says nothing a tenth of a second would not).
RESIDENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
# LMCache's retrieve, store and lookup times: its retrieve/store bounds (1 ms to 10 s) and, below
# them, the lookups' (a lookup in the local index takes microseconds, one over the network milliseconds).
LMCACHE_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The operations of LMCache's latency histograms, the bounded values of the ``operation`` label.
LMCACHE_OPERATIONS = ("retrieve", "store", "lookup")

# The exporter's duties, the bounded values of the ``duty`` label of its self-measurement series
# (``exporter.loops.duty_clock``): KV-event ingest, worker/router scrapes, request records over HTTP,
# OTLP spans, /metrics rendering, the background tree-statistics reading and the breach loop.
DUTY_NAMES = ("kv_ingest", "scrape", "records", "otlp", "render", "tree_statistics", "breach")

# Range selectors are written with these defaults; ``configure`` rewrites them to the ``window``
# and ``baseline_window`` of alerts/thresholds.yaml, so those two settings drive every generated
# rule and alert while the catalogue stays plain, runnable PromQL (and rule names keep "rate5m").
DEFAULT_WINDOW = "5m"
DEFAULT_BASELINE_WINDOW = "1d"

# Prompt-length classes of the cold-prefill histogram: prefill time grows with the prompt, so a
# baseline compares like with like only within a class. Four classes keep the label bounded.
PROMPT_CLASSES: tuple[tuple[float, str], ...] = (
    (1024, "0-1k"), (4096, "1k-4k"), (16384, "4k-16k"), (float("inf"), "16k+"))

# The line of the per-session distribution the spec asks about (share of sessions below it). It
# must be a bound of RATIO_BUCKETS: a gauge-histogram share is read off one bucket.
# A KV-event store whose parent ended one of the same worker's stores this recently continues that
# request (chunked prefill; decode blocks fill every 16 tokens, well under this even at 100 ms a
# token): placement is judged at a request's first store only (exporter.core.index.prefix_index_ref),
# and a store naming a session is a turn of it only there (exporter.core.record_accounting.kv_sessions).
PLACEMENT_CONTINUATION_S = 2.0
SESSION_HIT_LINE = 0.8

# Multi-window, multi-burn-rate SLO alerts (Google SRE workbook, "Alerting on SLOs", table 5-8):
# each tier fires when both its long and its short window burn the error budget faster than the
# tier's factor (alerts/thresholds.yaml, per SLO). The long window makes the alert significant,
# the short one makes it reset soon after the burn stops. Two tiers page (a fast burn within the
# hour, a steady one within six), two open a ticket (a slow burn a day or three long would spend
# the budget before the period ends, yet never reaches a page's factor).
BurnPair = Literal["page_1h", "page_6h", "ticket_1d", "ticket_3d"]


@dataclass(frozen=True, kw_only=True)
class BurnWindows:
    pair: BurnPair
    long: str
    short: str
    severity: str  # a page is critical, a ticket a warning

    @property
    def pages(self) -> bool:
        return self.pair.startswith("page")


BURN_WINDOWS: tuple[BurnWindows, ...] = (
    BurnWindows(pair="page_1h", long="1h", short="5m", severity="critical"),
    BurnWindows(pair="page_6h", long="6h", short="30m", severity="critical"),
    BurnWindows(pair="ticket_1d", long="1d", short="2h", severity="warning"),
    BurnWindows(pair="ticket_3d", long="3d", short="6h", severity="warning"),
)


def prompt_class(prompt_tokens: int) -> str:
    """The bounded prompt-length class label of a request."""
    return next(label for bound, label in PROMPT_CLASSES if prompt_tokens < bound)


_RANGE = re.compile(r"\[(\w+)\](?: offset (\w+))?")
# Scope labels (``scope_labels`` in alerts/thresholds.yaml, default ``cluster``): the catalogue is
# written for one cluster, as the exporter sees it; one Prometheus watching several clusters or
# router domains keeps them apart only if every aggregation keeps the labels that tell them apart
# (kubernetes-mixin's clusterLabel). ``scope_expr`` adds them to every aggregation and vector match.
_BARE_AGG = re.compile(r"\b(sum|max|min|avg|count|quantile)\s*\(")
_BY_AGG = re.compile(r"\b(sum|max|min|avg|count|quantile) by \(([^)]*)\)")
_ON = re.compile(r"\bon \(([^)]*)\)")
_ABSENT_OR_ZERO = re.compile(r"absent\((\w+)\) or vector\(0\)")
# How long a scope's vanished exporter keeps alerting (a decommissioned cluster stops after this).
SCOPE_MEMORY = "1h"

# Family shards (``exporter.core.sharding``): every shard exports ``prefixscope_exporter_shards{shard}``
# with the shard count as its value. A dead shard's series go stale at its first failed scrape, but
# its counters stay in every ``rate()`` range for a window, then leave it: a ratio pooled over the
# shards would slide to the survivors' value (a dead home shard moved the cluster hit rate from 0.50
# to 0.80). So "a shard is missing" is one expression, and every recording rule that pools exported
# series is withheld in the scopes where it holds (``shard_guarded``): empty, never re-weighted.
_SHARDS = f"{NAMESPACE}_exporter_shards"
# The count the reporting shards expect minus the distinct shards reporting (0 when all report).
SHARDS_MISSING = f"max({_SHARDS}) - count(count by (shard) ({_SHARDS}))"
# Per missing shard (1 each, labelled by its index): seen within SCOPE_MEMORY, not now, and of the
# plan its peers still run (a plan scaled in from 4 to 3 shards does not miss its old shard 3);
# else, per scope, SHARDS_MISSING (a shard never seen since Prometheus started).
SHARDS_MISSING_BY_SHARD = (
    f"count by (shard) ((max by (shard) (max_over_time({_SHARDS}[{SCOPE_MEMORY}])) unless on (shard) {_SHARDS}) "
    f"== on () group_left max({_SHARDS})) or on () ({SHARDS_MISSING})")
_EXPORTED = re.compile(rf"(?<![\w:]){NAMESPACE}_\w+")


def pools_exported(expr: str) -> bool:
    """Whether an expression reads exported series itself (not only other recording rules)."""
    return _EXPORTED.search(expr) is not None


def shard_guarded(expr: str) -> str:
    """``expr`` withheld while a shard is missing (written for one scope, like the catalogue; scope
    it with ``scope_expr`` afterwards). Without shard series at all (an exporter older than them) the
    expression stands: ``unless`` removes only what a known missing shard makes partial."""
    return f"({expr}) unless on () ({SHARDS_MISSING} > 0)"


def configure(expr: str, window: str, baseline_window: str) -> str:
    """``expr`` with the default range selectors replaced by the configured windows.

    ``[5m]`` becomes ``[window]``, ``[1d] offset 5m`` becomes ``[baseline_window] offset window``;
    any other range (the SLO burn windows) is left as written.
    """
    def sub(m: re.Match[str]) -> str:
        rng, offset = m[1], m[2]
        rng = {DEFAULT_WINDOW: window, DEFAULT_BASELINE_WINDOW: baseline_window}.get(rng, rng)
        if offset is None:
            return f"[{rng}]"
        return f"[{rng}] offset {window if offset == DEFAULT_WINDOW else offset}"
    return _RANGE.sub(sub, expr)


def _with(labels: Sequence[str], existing: str = "") -> str:
    names = [*labels, *(x.strip() for x in existing.split(",") if x.strip())]
    return ", ".join(dict.fromkeys(names))


def scope_expr(expr: str, labels: Sequence[str]) -> str:
    """``expr`` with ``labels`` kept by every aggregation (``sum by (cluster, …)``) and every
    ``on (…)`` match, so one rule serves every cluster a Prometheus watches.

    ``absent(x) or vector(0)`` cannot carry a label; scoped, it also reads 1 for each scope whose
    series vanished within ``SCOPE_MEMORY`` while others still report.
    """
    if not labels:
        return expr

    def absent(m: re.Match[str]) -> str:
        by = _with(labels)
        return (f"(max by ({by}) (max_over_time({m[1]}[{SCOPE_MEMORY}])) unless max by ({by}) ({m[1]})) "
                f"or absent({m[1]}) or vector(0)")

    pos, parts = 0, []
    for m in _ABSENT_OR_ZERO.finditer(expr):
        parts.append(_scope_plain(expr[pos:m.start()], labels))
        parts.append(absent(m))
        pos = m.end()
    parts.append(_scope_plain(expr[pos:], labels))
    return "".join(parts)


# A catalogue series or recording rule in PromQL text (not inside a string), and its matchers' brace.
_SERIES_REF = re.compile(r'(?<![\w:"])((?:[a-z_]+:)?prefixscope_[A-Za-z0-9_]+(?::[A-Za-z0-9_]+)?)(?![\w:])(\{)?')


def add_matchers(expr: str, matchers: str) -> str:
    """``expr`` with ``matchers`` (PromQL label matchers, e.g. ``cluster="a"``) added to every
    prefixscope series and recording rule it reads: a query narrowed to one scope."""
    if not matchers:
        return expr
    return _SERIES_REF.sub(lambda m: f"{m[1]}{{{matchers}, " if m[2] else f"{m[1]}{{{matchers}}}", expr)


def _scope_plain(expr: str, labels: Sequence[str]) -> str:
    expr = _BY_AGG.sub(lambda m: f"{m[1]} by ({_with(labels, m[2])})", expr)
    expr = _BARE_AGG.sub(lambda m: f"{m[1]} by ({_with(labels)}) (", expr)
    return _ON.sub(lambda m: f"on ({_with(labels, m[1])})", expr)


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One exported metric family (the name is the family name, without ``_total``)."""

    name: str
    type: MetricType
    unit: str
    help: str
    labels: tuple[str, ...]
    group: int | None
    # which input feeds it: worker_metrics, kv_events, records, router_metrics, topology, exporter, or
    # self (the exporter measuring its own process, rendered apart from the cluster state's series)
    source: str
    buckets: tuple[float, ...] | None = None

    @property
    def sample_name(self) -> str:
        """The name a PromQL query uses for the plain series (``_total`` for counters)."""
        return self.name + "_total" if self.type == "counter" else self.name


@dataclass(frozen=True, kw_only=True)
class RecordingRule:
    """A recording rule named ``level:metric:operations``."""

    record: str
    expr: str
    group: int | None
    help: str
    # Ranges are the SLO burn windows as written, not the configurable rate window.
    fixed_windows: bool = False


@dataclass(frozen=True, kw_only=True)
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
    unit: str  # a unit of prefixscope.units: ratio, ratio_to_baseline, seconds, usd, per_minute, per_second, depth, …
    signals: tuple[str, ...]
    meaning: str  # what the key number is (the alert description and the docs open with it)
    summary: str  # what it means when it fires, for people; ``{threshold}`` is filled in by wording.summary
    kind: Literal["checklist", "slo", "health"] = "checklist"
    # Multiplier applied to the threshold in the alert expression, for relative thresholds
    # ("p99 > 3 × warm baseline"): the alert compares value > threshold * baseline.
    baseline: str | None = None
    # For kind "slo": the events whose error ratio the burn-rate alerts watch. ``value`` is then
    # the SLI over the window (good / total) and the threshold's value the objective.
    slo: Slo | None = None
    # Labels the check alerts per, beyond the scope labels: ("worker",) for a check about one
    # worker (its stream, its cache), so the alert names the worker and one worker's fault is one
    # alert of its own.
    per: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Slo:
    """An SLO's events as two counters: the error ratio is 1 − Σgood / Σtotal over a window."""

    good: str  # counter sample name (with _total)
    total: str
    budget_unit: str  # what one event is, for people: "follow-up prompt tokens", "missed requests"
    # The exporter judges each event against ``baseline_factor`` × a baseline (thresholds file).
    judged_against_baseline: bool = False

    def error_ratio_rule(self, key: str, window: str) -> str:
        return f"cluster:prefixscope_{key}_errors:ratio_rate{window}"


@dataclass(frozen=True, kw_only=True)
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
    "kv_token_ids": "KV events carry the stored blocks' token_ids",
    "records": "request records (prefixscope.request/v1)",
    "session_key": "records carry session_key, or vLLM's KV events name the request's session (BlockStored.session_id, "
                   "vLLM ≥ 0.30)",
    "block_hashes": "records carry block_hashes",
    "placements": "placements are judged: records carry block_hashes, or KV events arrive with a topology loaded",
    "cached_tokens": "records carry engine-reported cached_tokens",
    "predicted_cached_tokens": "records carry the router's predicted_cached_tokens",
    "prefill_timing": "records carry prefill_s",
    "async_prefill": "records carry async_wait_s",
    "walk_latency": "records carry walk_s (router tree-walk latency)",
    "topology": "a topology file is loaded",
    "warm_pool": "the topology names warm-pool workers",
    "migrations": "records carry migrated_from / migration_kind; or sessions from spans or KV events (a follow-up "
                  "that left an unhealthy worker)",
    "expert_signature": "records carry expert_signature",
    "spec_decode": "workers export speculative-decoding counters",
    "affinity_admission": "records carry admitted_by_affinity",
    "router_metrics": "router /metrics scraped (SGLang gateway, vllm-router, Dynamo KV router or llm-d scheduler)",
    "router_predicted_reuse": "the router exports the reuse it predicted per request (match ratio)",
    "otlp_spans": "request spans received over OTLP (vLLM's llm_request)",
    "attribution": "records or spans name the LoRA adapter or tenant (lora_name, tenant)",
    "affinity_outcomes": "what became of follow-ups' affinity: records, spans or KV events with session keys, or the "
                         "router's own sticky and prefix-hash policy branches (SGLang gateway)",
    "router_index_health": "the router reports its own prefix index's KV-event health (Dynamo's applied events by "
                           "status, the SGLang gateway's unrecovered gaps and stream resyncs)",
    "kv_residency": "workers export vLLM's sampled KV-block residency histograms (lifetime, idle before eviction, "
                    "reuse gap)",
}

# Where each signal can come from, in the words of the table in README.md and docs/routers.md.
SOURCE_NAMES: dict[str, str] = {
    "engine_metrics": "engine /metrics",
    "kv_events": "KV events",
    "router_metrics": "router metrics",
    "otlp_spans": "OTLP spans",
    "records": "records",
    "topology": "topology file",
}
SIGNAL_SOURCES: dict[str, tuple[str, ...]] = {
    "worker_metrics": ("engine_metrics",),
    "kv_events": ("kv_events",),
    "kv_token_ids": ("kv_events",),
    "records": ("records", "otlp_spans"),
    "session_key": ("records", "otlp_spans", "kv_events"),
    "block_hashes": ("records",),
    "placements": ("records", "kv_events"),
    "cached_tokens": ("records", "otlp_spans"),
    "predicted_cached_tokens": ("records",),
    "prefill_timing": ("records", "otlp_spans"),
    "async_prefill": ("records",),
    "walk_latency": ("records", "router_metrics"),
    "topology": ("topology",),
    "warm_pool": ("topology",),
    "migrations": ("records", "otlp_spans", "kv_events"),
    "expert_signature": ("records",),
    "spec_decode": ("engine_metrics",),
    "affinity_admission": ("records",),
    "router_metrics": ("router_metrics",),
    "router_predicted_reuse": ("router_metrics",),
    "otlp_spans": ("otlp_spans",),
    "attribution": ("records", "otlp_spans"),
    "affinity_outcomes": ("records", "otlp_spans", "kv_events", "router_metrics"),
    "router_index_health": ("router_metrics",),
    "kv_residency": ("engine_metrics",),
}
# What each router's own /metrics feeds (exporter/codecs/routers/ implements it; docs/routers.md is generated
# from it): prefixscope series -> router kind -> the router's series, or None when it exports none.
ROUTER_KINDS: tuple[str, ...] = ("sglang-router", "vllm-router", "dynamo", "llm-d")
ROUTER_FEEDS: dict[str, dict[str, str | None]] = {
    f"{NAMESPACE}_router_decisions": {
        "sglang-router": "`smg_worker_requests_total` Σ model (smg ≥ 1.13), else `smg_worker_cb_outcomes_total` "
                         "Σ outcome (≤ 0.2.4: `sgl_router_policy_decisions_total`)",
        "vllm-router": "`vllm_router_policy_decisions_total` Σ policy",
        "dynamo": None, "llm-d": None},
    f"{NAMESPACE}_router_prefix_outcomes": {
        "sglang-router": "`smg_cache_aware_policy_branch_total` (smg ≥ 1.11; `tree_match` = hit); "
                         "≤ 0.2.4: `sgl_router_cache_hits_total`/`_misses_total`; none in 0.3.0–0.3.2",
        "vllm-router": "`vllm_router_prefix_routing_decisions_total` (`prefix_hit`/`prefix_miss`)",
        "dynamo": None,
        "llm-d": "`llm_d_epp_kv_cache_index_lookup_hits_total` of `…_lookup_requests_total`"},
    f"{NAMESPACE}_router_worker_healthy": {
        "sglang-router": "`smg_worker_health`", "vllm-router": "`vllm_router_worker_health`",
        "dynamo": None, "llm-d": None},
    f"{NAMESPACE}_router_predicted_hit_ratio": {
        "sglang-router": "`smg_cache_aware_match_ratio` (smg ≥ 1.11)", "vllm-router": None,
        "dynamo": "`dynamo_component_router_kv_hit_rate`", "llm-d": None},
    f"{NAMESPACE}_router_tree_walk_seconds": {
        "sglang-router": "`smg_kv_index_lookup_seconds` Σ index (smg ≥ 1.13, KV-event-fed cache-aware routing)",
        "vllm-router": None,
        "dynamo": "`dynamo_router_overhead_indexer_find_matches_ms` (ms → s)",
        "llm-d": "`llm_d_epp_kv_cache_index_lookup_latency_seconds`"},
    f"{NAMESPACE}_router_sticky_followups": {
        "sglang-router": "`smg_manual_policy_branch_total` (`occupied_hit` kept, `occupied_miss` migration, "
                         "`cap_respill` collision) and `smg_prefix_hash_policy_branch_total` (`ring_hit` kept, "
                         "`load_balance_walk` collision), smg ≥ 1.13",
        "vllm-router": None, "dynamo": None, "llm-d": None},
    f"{NAMESPACE}_router_regret_selections": {
        "sglang-router": None, "vllm-router": None,
        "dynamo": "`dynamo_component_router_non_max_overlap_selections_total` Σ labels (prefill picks)", "llm-d": None},
    f"{NAMESPACE}_router_regret_blocks": {
        "sglang-router": None, "vllm-router": None,
        "dynamo": "`dynamo_component_router_overlap_blocks_lost_sum` Σ labels", "llm-d": None},
    f"{NAMESPACE}_router_overhead_seconds": {
        "sglang-router": None, "vllm-router": None,
        "dynamo": "`dynamo_router_overhead_{block_hashing,seq_hashing,indexer_find_matches,scheduling,total,"
                  "shared_cache_query}_ms` (ms → s; before: `dynamo_routing_overhead_*_ms`), `phase` the name's",
        "llm-d": None},
    f"{NAMESPACE}_router_routed_requests": {
        "sglang-router": None, "vllm-router": None,
        "dynamo": "`dynamo_component_router_requests_total`", "llm-d": None},
    f"{NAMESPACE}_router_kv_index_faults": {
        "sglang-router": "`smg_kv_event_gaps_total{outcome=~\"unrecovered_.*\"}` (`gap_unrecovered`), "
                         "`smg_kv_event_resyncs_total{reason=~\"out_of_range|data_loss\"}` (`stream_resync`), smg ≥ 1.13",
        "vllm-router": None,
        "dynamo": "`dynamo_component_kv_cache_events_applied{status!=\"ok\"}` (`apply_failed`)", "llm-d": None},
    f"{NAMESPACE}_router_kv_event_lag_seconds": {
        "sglang-router": "`smg_kv_event_lag_seconds` Σ worker (smg ≥ 1.13)", "vllm-router": None, "dynamo": None,
        "llm-d": None},
    f"{NAMESPACE}_router_engine_hit_ratio": {
        "sglang-router": "`smg_engine_cache_hit_rate` mean over model, dp_rank (smg ≥ 1.10.1, engines the gateway "
                         "polls for load; a removed worker's −1 dropped)",
        "vllm-router": None, "dynamo": None, "llm-d": None},
    f"{NAMESPACE}_router_tree_fill_ratio": {
        "sglang-router": "the largest of `smg_cache_tree_chars` / `smg_cache_tree_tokens` (smg ≥ 1.10.1; "
                         "≤ 0.2.4: `sgl_router_tree_size`) ÷ `--max-tree-size`",
        "vllm-router": None,  # src/metrics.rs has vllm_router_tree_size (read if set); the 0.1.17 wheel never sets it
        "dynamo": None, "llm-d": None},
}
# The signal each router series instruments (a router that feeds the series feeds the signal).
ROUTER_SERIES_SIGNALS: dict[str, str] = {
    f"{NAMESPACE}_router_tree_walk_seconds": "walk_latency",
    f"{NAMESPACE}_router_predicted_hit_ratio": "router_predicted_reuse",
    f"{NAMESPACE}_router_sticky_followups": "affinity_outcomes",
    f"{NAMESPACE}_router_kv_index_faults": "router_index_health",
    f"{NAMESPACE}_router_kv_event_lag_seconds": "router_index_health",
}
# What a deployment behind a router feeds with no request record and no span: the engines' pages, their
# KV events (with token ids, as vLLM sends them), speculative decoding where it is on, the router's page.
NO_RECORDS_SIGNALS: frozenset[str] = frozenset({"worker_metrics", "kv_events", "kv_token_ids", "spec_decode",
                                                "kv_residency", "router_metrics"})


# What vLLM's KV events add when the requests carry a ``session_id`` (vLLM ≥ 0.30 copies it into every
# ``BlockStored``): sessions, and what becomes of their follow-ups (collisions, migrations).
KV_SESSION_SIGNALS: frozenset[str] = frozenset({"session_key", "affinity_outcomes", "migrations"})


def router_signals(kind: str) -> frozenset[str]:
    """The signals router ``kind``'s own /metrics feeds (beyond router_metrics itself)."""
    return frozenset(sig for series, sig in ROUTER_SERIES_SIGNALS.items() if ROUTER_FEEDS[series].get(kind))


def lit_without_records(kind: str, topology: bool = False) -> list[Check]:
    """The checks whose every signal has a source behind router ``kind`` with no record and no span
    (``topology``: with a topology file that names the warm pool, so placement is judged from KV events)."""
    fed = NO_RECORDS_SIGNALS | router_signals(kind)
    if topology:
        fed |= {"topology", "warm_pool", "placements"}
    return [c for c in CHECKS if set(c.signals) <= fed]


# How to turn each signal on, shown next to "not instrumented" in the console.
SIGNAL_ENABLE: dict[str, str] = {
    "worker_metrics": "list each worker's metrics_url under workers: in the exporter config",
    "kv_events": "start vLLM with --kv-events-config (publisher zmq) and set kv_events: per worker",
    "kv_token_ids": "use an engine whose BlockStored events carry token_ids (vLLM does), and keep them "
                    "through any relay",
    "records": "POST prefixscope.request/v1 NDJSON to /api/v1/records, tail a file, or export vLLM's "
               "OTLP spans to /v1/traces",
    "session_key": "records: add session_key; spans: set otlp.session_attributes to the attribute that "
                   "holds the session (e.g. gen_ai.conversation.id on the client's span); or send vLLM ≥ 0.30 the "
                   "request's session_id, which its KV events carry",
    "block_hashes": "records: add block_hashes (the router's chained block hashes)",
    "placements": "records: add block_hashes (exact, per request); or subscribe to the workers' KV events "
                  "(vLLM --kv-events-config) with a topology file loaded (judged at each request's first block store)",
    "cached_tokens": "records: cached_tokens from usage.prompt_tokens_details.cached_tokens "
                     "(vLLM --enable-prompt-tokens-details); spans: gen_ai.usage.cache_read.input_tokens",
    "predicted_cached_tokens": "records: predicted_cached_tokens from a router plugin",
    "prefill_timing": "records: prefill_s; or vLLM --otlp-traces-endpoint http://EXPORTER/v1/traces "
                      "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)",
    "async_prefill": "records: async_wait_s from the async prefill path",
    "walk_latency": "records: walk_s; or scrape a router that exports its lookup latency "
                    "(smg ≥ 1.13 with KV-event-fed routing, Dynamo KV router, llm-d with "
                    "kvBlockIndexConfig.enableMetrics)",
    "topology": "set topology: to a topology file in the exporter config",
    "warm_pool": "mark warm-pool workers (warm_pool: true) in the topology file",
    "migrations": "records: migrated_from / migration_kind; spans: a session attribute, or vLLM ≥ 0.30 KV events "
                  "with the request's session_id (migrations are follow-ups that left an unhealthy worker)",
    "expert_signature": "records: expert_signature from the MoE engine",
    "spec_decode": "run vLLM with speculative decoding (--speculative-config)",
    "affinity_admission": "records: admitted_by_affinity from the scheduler",
    "router_metrics": "list the router under routers: with its Prometheus metrics_url",
    "router_predicted_reuse": "scrape a router that exports its match ratio (SGLang gateway ≥ 1.11, Dynamo)",
    "otlp_spans": "vLLM --otlp-traces-endpoint http://EXPORTER/v1/traces with "
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
    "attribution": "records: add lora_name and/or tenant (e.g. the request's cache_salt); spans: set "
                   "otlp.adapter_attributes (gen_ai.request.model names a LoRA request's adapter) or "
                   "otlp.tenant_attributes",
    "affinity_outcomes": "records, spans or KV events with session keys (see session_key); or scrape an SGLang gateway (smg ≥ 1.13) "
                         "routing with --policy manual (X-SMG-Routing-Key) or --policy prefix_hash",
    "router_index_health": "scrape the router that keeps a KV-event-fed prefix index: Dynamo's frontend or standalone "
                           "router, or the SGLang gateway (smg ≥ 1.13) with cache-aware routing fed by KV events",
    "kv_residency": "start vLLM (≥ 0.14) with --kv-cache-metrics; --kv-cache-metrics-sample sets the share of "
                    "blocks sampled (default 0.01)",
}

STEPS: tuple[Step, ...] = (
    Step(number=0, title="Telemetry", dashboard_row="Step 0 — telemetry health",
         question="Is the telemetry itself healthy — targets up, KV-event stream fresh, no gaps?"),
    Step(number=1, title="Cache", dashboard_row="Step 1 — prefix cache health",
         question="Is the cache itself broken?"),
    Step(number=2, title="Affinity", dashboard_row="Step 2 — request affinity",
         question="Did sticky sessions or migration fail?"),
    Step(number=3, title="Cold-miss cost", dashboard_row="Step 3 — cold prefill economics",
         question="Is the cold-miss cost out of control?"),
    Step(number=4, title="Router & topology", dashboard_row="Step 4 — router and topology",
         question="Is the router or the topology dragging?"),
    Step(number=5, title="Coupled optimisations", dashboard_row="Step 5 — coupled optimisations",
         question="Is a coupled optimisation cancelling locality?"),
)

W = "worker"
M = "model"


def _metric(*, name: str, type: MetricType, unit: str, help: str, labels: Iterable[str], group: int | None,
            source: str, buckets: tuple[float, ...] | None = None) -> Metric:
    """A catalogue row: ``name`` without the namespace prefix, which is added here."""
    return Metric(name=f"{NAMESPACE}_{name}", type=type, unit=unit, help=help, labels=tuple(labels),
                  group=group, source=source, buckets=buckets)


METRICS: tuple[Metric, ...] = (
    # ---- group 0: telemetry health --------------------------------------------------------
    _metric(name="up", type="gauge", unit="", labels=("target", "kind"), group=0, source="exporter",
            help="1 if the last scrape of the target succeeded, 0 if it failed."),
    _metric(name="scrape_duration_seconds", type="gauge", unit="seconds", labels=("target", "kind"), group=0, source="exporter",
            help="Duration of the last scrape of the target."),
    _metric(name="telemetry_blind_targets", type="gauge", unit="", labels=(), group=0, source="exporter",
            help="Scrape targets failing while traffic still reaches them (a router target, or a worker that served after its scrapes began to fail); a worker that left the pool is not counted."),
    _metric(name="signal_available", type="gauge", unit="", labels=("signal",), group=0, source="exporter",
            help="1 if the named input signal has a source, 0 if it is not instrumented."),
    _metric(name="ingest_errors", type="counter", unit="", labels=("source", "kind"), group=0, source="exporter",
            help="Inputs rejected, by source and kind of error (the rest of each batch is kept)."),
    _metric(name="records_ingested", type="counter", unit="", labels=("transport",), group=0, source="records",
            help="Request records accepted, by transport."),
    _metric(name="kv_event_batches", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="KV-event batches received per worker."),
    _metric(name="kv_events_applied", type="counter", unit="", labels=(W, "event"), group=0, source="kv_events",
            help="KV-cache events applied to the index per worker, by event type."),
    _metric(name="kv_event_sequence_gaps", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="Gaps detected in a worker's KV-event sequence numbers."),
    _metric(name="kv_event_missed_batches", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="Batches missing after sequence gaps (before replay)."),
    _metric(name="kv_event_replays", type="counter", unit="", labels=(W, "result"), group=0, source="kv_events",
            help="Replay requests sent after gaps, by result (recovered, partial, failed)."),
    _metric(name="kv_event_lost_batches", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="Missed batches that no replay recovered (no replay endpoint, or the worker's buffer no longer held them): lost for good."),
    _metric(name="kv_index_repairs", type="counter", unit="", labels=(W, "reason"), group=0, source="kv_events",
            help="Repairs of a worker's view after unhealed loss or drift, by reason (lost_batches, over_capacity): "
                 "a rebuild from the worker's replay, or the view marked unreliable when no replay could rebuild it."),
    _metric(name="kv_view_unreliable", type="gauge", unit="", labels=(W,), group=0, source="kv_events",
            help="1 while a worker's view may be wrong (events lost, no complete rebuild) until a complete rebuild, "
                 "a reset of its cache or a restart confirms it, 0 otherwise."),
    _metric(name="kv_event_last_timestamp_seconds", type="gauge", unit="seconds", labels=(W,), group=0, source="kv_events",
            help="Wall-clock time the last KV-event batch from the worker was received (or of the last scrape that found the worker idle, with no events to send)."),
    _metric(name="kv_event_lag_seconds", type="gauge", unit="seconds", labels=(W,), group=0, source="kv_events",
            help="Receive time minus the batch timestamp of the worker's last KV-event batch; a lag of a second or "
                 "more reads 0 once nothing of the worker waits to be applied (ZMQ and NATS alike)."),
    _metric(name="kv_event_unknown_parent", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="BlockStored events whose parent block is not in the worker's view."),
    _metric(name="kv_event_unknown_block_removals", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="BlockRemoved hashes that the worker's view did not hold."),
    _metric(name="worker_restarts", type="counter", unit="", labels=(W,), group=0, source="kv_events",
            help="Worker restarts detected (a KV-event sequence that went back, judged by the source: see docs/operating.md); the worker's view was cleared."),
    _metric(name="index_staleness_tokens", type="counter", unit="tokens", labels=(M,), group=0, source="records",
            help="Tokens the router predicted as cached but the engine did not report (predicted − achieved, floored at 0)."),
    # ---- group 1: prefix cache health ----------------------------------------------------
    _metric(name="prefix_cache_queried_tokens", type="counter", unit="tokens", labels=(W, M), group=1, source="worker_metrics",
            help="Prompt tokens looked up in the worker's prefix cache (engine counter, normalised)."),
    _metric(name="prefix_cache_hit_tokens", type="counter", unit="tokens", labels=(W, M), group=1, source="worker_metrics",
            help="Prompt tokens found in the worker's prefix cache (engine counter, normalised)."),
    _metric(name="worker_kv_cache_usage_ratio", type="gauge", unit="ratio", labels=(W, M), group=1, source="worker_metrics",
            help="KV-cache usage reported by the engine (0–1)."),
    _metric(name="session_followup_prompt_tokens", type="counter", unit="tokens", labels=(M,), group=2, source="records",
            help="Prompt tokens of follow-up requests (turn ≥ 2) of keyed sessions."),
    _metric(name="session_followup_cached_tokens", type="counter", unit="tokens", labels=(M,), group=2, source="records",
            help="Engine-reported cached tokens of follow-up requests (turn ≥ 2) of keyed sessions."),
    _metric(name="session_hit_ratio", type="gaugehistogram", unit="ratio", labels=(), group=2, source="records", buckets=RATIO_BUCKETS,
            help="Distribution over sessions active in the window of Σcached/Σprompt over their follow-up requests (never a session label)."),
    _metric(name="worker_resident_blocks", type="gauge", unit="blocks", labels=(W,), group=1, source="kv_events",
            help="Blocks resident on the worker's GPU (medium GPU), from its KV events: what its capacity is compared with; "
                 "other tiers in worker_medium_resident_blocks."),
    _metric(name="worker_capacity_blocks", type="gauge", unit="blocks", labels=(W,), group=1, source="worker_metrics",
            help="The worker's KV-cache capacity (num_gpu_blocks from cache_config_info, or the topology)."),
    # ---- cache tiers and attribution (resident blocks by medium, LoRA adapter, tenant) ------
    _metric(name="worker_medium_resident_blocks", type="gauge", unit="blocks", labels=(W, "medium"), group=None,
            source="kv_events",
            help="Blocks resident on the worker per cache tier (the KV events' medium: GPU, CPU, STORAGE, …)."),
    _metric(name="worker_medium_capacity_blocks", type="gauge", unit="blocks", labels=(W, "medium"), group=None,
            source="worker_metrics",
            help="The worker's capacity per cache tier: GPU from num_gpu_blocks (or the topology); the CPU offload "
                 "tier estimated as its resident blocks ÷ vLLM's kv_offload_cpu_cache_usage_perc (from 5 % used); "
                 "absent when unknown."),
    _metric(name="worker_offload_usage_ratio", type="gauge", unit="ratio", labels=(W, "medium"), group=None,
            source="worker_metrics",
            help="Share of the worker's offload tier in use (vLLM's kv_offload_cpu_cache_usage_perc: medium CPU)."),
    _metric(name="lmcache_operation_seconds", type="histogram", unit="seconds", labels=(W, "operation"), group=None,
            source="worker_metrics", buckets=LMCACHE_BUCKETS,
            help="LMCache's time per operation on the worker: retrieve (load into the GPU), store (save from it), "
                 "lookup (how much of a prompt it holds); lmcache:time_to_{retrieve,store,lookup} summed over its "
                 "ranks and roles, each LMCache bucket's observations placed inside it by the bucket's sum."),
    _metric(name="lmcache_lookup_queried_tokens", type="counter", unit="tokens", labels=(W, M), group=None,
            source="worker_metrics",
            help="Prompt tokens LMCache was asked to look up (lmcache:num_lookup_tokens); absent without LMCache."),
    _metric(name="lmcache_lookup_hit_tokens", type="counter", unit="tokens", labels=(W, M), group=None,
            source="worker_metrics",
            help="Of those, tokens LMCache held (lmcache:num_lookup_hits): its lookup hit rate ÷ the queried tokens."),
    _metric(name="adapter_resident_blocks", type="gauge", unit="blocks", labels=("adapter", "medium"), group=None,
            source="kv_events",
            help="Resident blocks cluster-wide per LoRA adapter (BlockStored lora_name; none: the base model), "
                 "top adapters by blocks, the rest summed under other. Absent with attribution: false."),
    _metric(name="tenant_resident_blocks", type="gauge", unit="blocks", labels=("tenant", "medium"), group=None,
            source="kv_events",
            help="Resident blocks cluster-wide per tenant: the cache_salt in the first block's extra_keys, inherited "
                 "along the chain (none: unsalted), top tenants by blocks, the rest under other."),
    _metric(name="adapter_prefix_cache_queried_tokens", type="counter", unit="tokens", labels=("adapter",), group=None,
            source="attribution",
            help="Prompt tokens of requests that report cached tokens, per LoRA adapter (records' lora_name; none: "
                 "no adapter; other: past limits.adapters)."),
    _metric(name="adapter_prefix_cache_hit_tokens", type="counter", unit="tokens", labels=("adapter",), group=None,
            source="attribution",
            help="Engine-reported cached prompt tokens per LoRA adapter (hit rate: ÷ the queried tokens)."),
    _metric(name="tenant_prefix_cache_queried_tokens", type="counter", unit="tokens", labels=("tenant",), group=None,
            source="attribution",
            help="Prompt tokens of requests that report cached tokens, per tenant (records' tenant; none: no tenant; "
                 "other: past limits.tenants)."),
    _metric(name="tenant_prefix_cache_hit_tokens", type="counter", unit="tokens", labels=("tenant",), group=None,
            source="attribution",
            help="Engine-reported cached prompt tokens per tenant (hit rate: ÷ the queried tokens)."),
    _metric(name="kv_blocks_stored", type="counter", unit="blocks", labels=(W,), group=1, source="kv_events",
            help="GPU blocks stored on the worker (BlockStored events)."),
    _metric(name="kv_blocks_evicted", type="counter", unit="blocks", labels=(W,), group=1, source="kv_events",
            help="GPU blocks evicted from the worker (BlockRemoved events)."),
    _metric(name="kv_blocks_restored_after_eviction", type="counter", unit="blocks", labels=(W,), group=1, source="kv_events",
            help="Stored GPU blocks that the same worker had evicted within the window (thrash: eviction that cost a recomputation)."),
    _metric(name="kv_block_eviction_age_seconds", type="histogram", unit="seconds", labels=(W, "reused"), group=1, source="kv_events",
            buckets=EVICTION_AGE_BUCKETS,
            help="How long sampled evicted GPU blocks were resident, by whether any reuse was seen before eviction (true, false)."),
    _metric(name="external_prefix_cache_queried_tokens", type="counter", unit="tokens", labels=(W, M), group=1, source="worker_metrics",
            help="Prompt tokens looked up in the worker's external (KV-connector / offload) cache; absent when the engine does not export it."),
    _metric(name="external_prefix_cache_hit_tokens", type="counter", unit="tokens", labels=(W, M), group=1, source="worker_metrics",
            help="Prompt tokens found in the worker's external (KV-connector / offload) cache; absent when the engine does not export it."),
    _metric(name="prefix_cache_tier_hit_tokens", type="counter", unit="tokens", labels=(W, M, "tier"), group=1, source="worker_metrics",
            help="Cached prompt tokens by the tier that served them (vLLM: device, host, p2p, disk, external_unspecified; "
                 "SGLang: its cache_source); absent when the engine does not export them."),
    _metric(name="kv_block_lifetime_seconds", type="histogram", unit="seconds", labels=(W,), group=1,
            source="worker_metrics", buckets=RESIDENCY_BUCKETS,
            help="Lifetime of sampled evicted KV blocks, allocation to eviction (vLLM --kv-cache-metrics: "
                 "vllm:kv_block_lifetime_seconds, summed over engines); absent without the flag."),
    _metric(name="kv_block_idle_before_evict_seconds", type="histogram", unit="seconds", labels=(W,), group=1,
            source="worker_metrics", buckets=RESIDENCY_BUCKETS,
            help="How long sampled evicted KV blocks sat untouched before eviction, last access to eviction "
                 "(vllm:kv_block_idle_before_evict_seconds): the cache's retention horizon; absent without the flag."),
    _metric(name="kv_block_reuse_gap_seconds", type="histogram", unit="seconds", labels=(W,), group=1,
            source="worker_metrics", buckets=RESIDENCY_BUCKETS,
            help="Gaps between consecutive accesses of sampled KV blocks while resident, reported at eviction "
                 "(vllm:kv_block_reuse_gap_seconds); absent without the flag."),
    _metric(name="worker_block_size_tokens", type="gauge", unit="tokens", labels=(W,), group=1, source="worker_metrics",
            help="The worker's KV block size in tokens."),
    _metric(name="prefix_tree_leaf_depth", type="gaugehistogram", unit="edges", labels=(), group=1, source="kv_events", buckets=DEPTH_BUCKETS,
            help="Leaf depth of the radix-compressed cluster prefix tree (runs without branching are one edge)."),
    _metric(name="prefix_tree_leaf_block_depth", type="gaugehistogram", unit="blocks", labels=(), group=1, source="kv_events", buckets=DEPTH_BUCKETS,
            help="Leaf depth of the cluster prefix tree in blocks."),
    _metric(name="prefix_tree_node_fanout", type="gaugehistogram", unit="", labels=(), group=1, source="kv_events", buckets=FANOUT_BUCKETS,
            help="Children per branching node of the radix-compressed prefix tree."),
    _metric(name="prefix_tree_root_fanout", type="gauge", unit="", labels=(), group=1, source="kv_events",
            help="Distinct first blocks in the cluster prefix tree (a broken shared prefix shows as a jump)."),
    _metric(name="prefix_root_branches", type="counter", unit="", labels=(), group=1, source="kv_events",
            help="Root branches stored (GPU BlockStored without a parent, carrying token ids), cluster-wide."),
    _metric(name="prefix_unstable_root_branches", type="counter", unit="", labels=(), group=1, source="kv_events",
            help="Of those, new root branches (first block not seen as a root within the window) whose opening tokens "
                 "equal a recent root's but for a short early span: a timestamp or request id in the system prompt."),
    _metric(name="prefix_tree_nodes", type="gauge", unit="", labels=(), group=1, source="kv_events",
            help="Nodes (radix edges) in the cluster prefix tree."),
    _metric(name="prefix_tree_blocks", type="gauge", unit="blocks", labels=(), group=1, source="kv_events",
            help="Distinct blocks in the cluster prefix tree."),
    _metric(name="prefix_tree_block_replicas", type="gaugehistogram", unit="", labels=(), group=1, source="kv_events", buckets=REPLICA_BUCKETS,
            help="Number of workers holding each distinct block (duplication across workers)."),
    # ---- group 2: request affinity -------------------------------------------------------
    _metric(name="followup_requests", type="counter", unit="", labels=(M,), group=2, source="records",
            help="Follow-up requests (turn ≥ 2) of keyed sessions."),
    _metric(name="sticky_collisions", type="counter", unit="", labels=(M,), group=2, source="records",
            help="Follow-up requests whose session was last served by a different, still-healthy worker."),
    _metric(name="warm_pool_utilization_ratio", type="gauge", unit="ratio", labels=(W,), group=2, source="worker_metrics",
            help="Utilisation of a warm-pool worker: max(KV-cache usage, running / max concurrency)."),
    _metric(name="session_migrations", type="counter", unit="", labels=("kind",), group=2, source="records",
            help="Sessions moved because their worker left, drained or failed, by kind (soft, hard)."),
    _metric(name="session_rekeys", type="counter", unit="", labels=("segment",), group=2, source="records",
            help="New session keys whose first prompt matches another recent session's chain (re-keyed sessions), by segment."),
    _metric(name="worker_pool_size", type="gauge", unit="", labels=(), group=2, source="exporter",
            help="Workers currently seen healthy."),
    _metric(name="worker_pool_changes", type="counter", unit="", labels=(), group=2, source="exporter",
            help="Changes of the healthy worker set."),
    _metric(name="session_reshuffle_ratio", type="gauge", unit="ratio", labels=(), group=2, source="records",
            help="Share of sessions seen both before and after the last pool change whose worker changed."),
    # ---- group 3: cold prefill economics -------------------------------------------------
    _metric(name="cold_prefill_seconds", type="histogram", unit="seconds", labels=(M, "gpu_class", "prompt_class"), group=3, source="records", buckets=PREFILL_BUCKETS,
            help="Prefill time of cold requests (reused share at most cold_reuse_share), by GPU class and prompt-length class (0-1k, 1k-4k, 4k-16k, 16k+ tokens)."),
    _metric(name="cold_requests", type="counter", unit="", labels=(M,), group=3, source="records",
            help="Cold requests."),
    _metric(name="cold_prefill_gpu_seconds", type="counter", unit="seconds", labels=(M,), group=3, source="records",
            help="GPU-seconds spent on cold prefill (prefill time × GPUs per worker)."),
    _metric(name="cold_prefill_cost_usd", type="counter", unit="usd", labels=(M,), group=3, source="records",
            help="Cost of cold prefill (GPU-seconds × price per GPU-hour / 3600)."),
    _metric(name="async_prefill_wait_seconds", type="histogram", unit="seconds", labels=(M,), group=3, source="records", buckets=WAIT_BUCKETS,
            help="Wait of requests sent to the async prefill path."),
    _metric(name="prefix_miss_cost_seconds", type="histogram", unit="seconds", labels=(M,), group=3, source="records", buckets=PREFILL_BUCKETS,
            help="Miss cost (T_prefill + T_queue + T_migrate, seed §5) of requests that missed part of their available prefix or migrated (without block hashes: of cold requests)."),
    _metric(name="missed_requests", type="counter", unit="", labels=(M,), group=3, source="records",
            help="Missed requests (as for prefix_miss_cost_seconds) judged against a cold-prefill baseline of their model and prompt-length class."),
    _metric(name="missed_requests_within_baseline", type="counter", unit="", labels=(M,), group=3, source="records",
            help="Of those, requests whose miss cost stayed within the SLO factor × the baseline (the long-window cold-prefill p95, ending one window ago)."),
    # ---- group 4: router and topology ----------------------------------------------------
    _metric(name="router_tree_walk_seconds", type="histogram", unit="seconds", labels=(), group=4, source="records", buckets=WALK_BUCKETS,
            help="Router prefix-tree lookup latency."),
    _metric(name="placement_decisions", type="counter", unit="", labels=(M,), group=4, source="records",
            help="Requests whose longest cached prefix was resident somewhere in the cluster."),
    _metric(name="placement_domain_hits", type="counter", unit="", labels=(M,), group=4, source="records",
            help="Of those, requests placed in the NVLink domain that holds their longest cached prefix."),
    _metric(name="kv_placement_decisions", type="counter", unit="", labels=(M,), group=4, source="kv_events",
            help="GPU block stores of topology workers whose longer cached prefix was resident somewhere in the cluster "
                 f"(a request's first store; its later ones, within {PLACEMENT_CONTINUATION_S:g} s under its own last block, are left out; "
                 "judged against the index before it; without records' block hashes)."),
    _metric(name="kv_placement_domain_hits", type="counter", unit="", labels=(M,), group=4, source="kv_events",
            help="Of those, stores on a worker whose NVLink domain held the longest cached prefix."),
    _metric(name="cross_node_migrations", type="counter", unit="", labels=("kind",), group=4, source="records",
            help="Session migrations whose old and new worker are on different nodes, by kind."),
    _metric(name="router_decisions", type="counter", unit="", labels=("router", W), group=4, source="router_metrics",
            help="Routing decisions per worker, from the router's own /metrics."),
    _metric(name="router_prefix_outcomes", type="counter", unit="", labels=("router", "outcome"), group=4, source="router_metrics",
            help="Router prefix-match outcomes (hit, miss), from the router's own /metrics."),
    _metric(name="router_worker_healthy", type="gauge", unit="", labels=("router", W), group=4, source="router_metrics",
            help="Worker health as the router sees it (1 healthy, 0 not)."),
    _metric(name="router_predicted_hit_ratio", type="histogram", unit="ratio", labels=("router",), group=None,
            source="router_metrics", buckets=RATIO_BUCKETS,
            help="Per request, the share of the prompt the router predicted cached on its pick (SGLang gateway "
                 "match ratio, Dynamo kv_hit_rate); each router bucket's requests placed inside it by the bucket's sum."),
    # ---- the routers' own signals: what each router says of its decisions and its index -------
    _metric(name="router_sticky_followups", type="counter", unit="", labels=("router", "policy", "outcome"), group=2,
            source="router_metrics",
            help="Requests whose routing key already had a worker (SGLang gateway: a session key under --policy "
                 "manual, the prompt's head under prefix_hash), by what the router did: kept (sent to that worker), "
                 "collision (sent elsewhere though it was healthy: a load walk off the hash ring, a sticky "
                 "respill at the key cap), migration (sent elsewhere because it was unhealthy or gone)."),
    _metric(name="router_regret_selections", type="counter", unit="", labels=("router",), group=4,
            source="router_metrics",
            help="Routing regret: picks the router made with less cached overlap than the best eligible worker "
                 "(Dynamo's non-max-overlap selections; observed for prefill picks)."),
    _metric(name="router_regret_blocks", type="counter", unit="blocks", labels=("router",), group=4,
            source="router_metrics",
            help="Cached blocks those picks gave up: the best eligible worker's overlap minus the chosen one's, summed."),
    _metric(name="router_engine_hit_ratio", type="gauge", unit="ratio", labels=("router", W), group=1,
            source="router_metrics",
            help="Each engine's prefix-cache hit ratio as the router last polled it (SGLang gateway: the engine's own "
                 "figure, averaged over its models and DP ranks): the per-worker hit rate where the engines' own "
                 "/metrics are not scraped."),
    _metric(name="router_tree_fill_ratio", type="gauge", unit="ratio", labels=("router",), group=4,
            source="router_metrics",
            help="The router's largest prefix tree against the bound its eviction keeps each tree under "
                 "(--max-tree-size: characters for HTTP routing, tokens for gRPC); near 1 the walks are as long "
                 "as the router allows and eviction is trimming live prefixes."),
    _metric(name="router_overhead_seconds", type="histogram", unit="seconds", labels=("router", "phase"), group=4,
            source="router_metrics", buckets=OVERHEAD_BUCKETS,
            help="The router's own time per request by routing phase (Dynamo: block_hashing, seq_hashing, "
                 "indexer_find_matches — the prefix-index lookup, also the tree-walk latency —, scheduling, "
                 "shared_cache_query, total); each router bucket's requests placed inside it by the bucket's sum."),
    _metric(name="router_routed_requests", type="counter", unit="", labels=("router",), group=4,
            source="router_metrics",
            help="Requests the router routed, by its own count (the denominator of routing regret)."),
    _metric(name="router_kv_index_faults", type="counter", unit="", labels=("router", "kind"), group=0,
            source="router_metrics",
            help="Faults of the router's own KV-event-fed prefix index, by kind: apply_failed (an event the index "
                 "could not apply: parent or block not found, invalid block), gap_unrecovered (events lost for "
                 "good, the worker's view kept or cleared), stream_resync (the stream was reset and the worker's "
                 "view rebuilt: out of range, data loss)."),
    _metric(name="router_kv_event_lag_seconds", type="histogram", unit="seconds", labels=("router",), group=0,
            source="router_metrics", buckets=LAG_BUCKETS,
            help="Time from a KV-event batch's publisher stamp to the router applying it (SGLang gateway), all "
                 "workers; each router bucket's batches placed inside it by the bucket's sum."),
    # ---- group 5: coupled optimisations --------------------------------------------------
    _metric(name="moe_prefix_hits", type="counter", unit="", labels=(M,), group=5, source="records",
            help="Requests with a prefix hit that carry an expert signature."),
    _metric(name="moe_expert_aligned_hits", type="counter", unit="", labels=(M,), group=5, source="records",
            help="Of those, hits whose expert signature matches the cached prefix's."),
    _metric(name="spec_decode_draft_tokens", type="counter", unit="tokens", labels=(W, M), group=5, source="worker_metrics",
            help="Speculative-decoding draft tokens (engine counter, normalised)."),
    _metric(name="spec_decode_accepted_tokens", type="counter", unit="tokens", labels=(W, M), group=5, source="worker_metrics",
            help="Speculative-decoding accepted tokens (engine counter, normalised)."),
    _metric(name="batch_admissions", type="counter", unit="", labels=(M,), group=5, source="records",
            help="Continuous-batching admissions."),
    _metric(name="batch_affinity_admissions", type="counter", unit="", labels=(M,), group=5, source="records",
            help="Admissions chosen for prefix affinity."),
    # ---- beyond the checklist -------------------------------------------------------------
    _metric(name="requests", type="counter", unit="", labels=(M,), group=None, source="records",
            help="Recorded requests."),
    _metric(name="worker_requests", type="counter", unit="", labels=(W,), group=None, source="records",
            help="Requests per worker as request records or OTLP request spans reported them (a span is a record)."),
    _metric(name="worker_ttft_seconds", type="histogram", unit="seconds", labels=(W,), group=None, source="records",
            buckets=TTFT_BUCKETS,
            help="Time to first token per worker, from records' ttft_s or spans' gen_ai.latency.time_to_first_token."),
    _metric(name="request_prompt_tokens", type="counter", unit="tokens", labels=(M,), group=None, source="records",
            help="Prompt tokens of recorded requests."),
    _metric(name="reuse_available_tokens", type="counter", unit="tokens", labels=(M,), group=None, source="records",
            help="Tokens reusable at best: the longest cached match on any worker, from the index."),
    _metric(name="reuse_predicted_tokens", type="counter", unit="tokens", labels=(M,), group=None, source="records",
            help="Tokens the router believed cached on the chosen worker."),
    _metric(name="reuse_achieved_tokens", type="counter", unit="tokens", labels=(M,), group=None, source="records",
            help="Tokens the engine reported as cached."),
    _metric(name="worker_effective_cache_value_tokens", type="gauge", unit="tokens", labels=(W,), group=None, source="kv_events",
            help="Resident tokens × the worker's recent hit ratio (affinity-aware autoscaling signal)."),
    _metric(name="worker_removal_rank", type="gauge", unit="", labels=(W,), group=None, source="kv_events",
            help="Safe-to-remove ranking by effective cache value (1 = safest to remove)."),
    _metric(name="worker_info", type="gauge", unit="", labels=(W, "node", "nvlink_domain", "gpu_class", "warm_pool"), group=None, source="topology",
            help="Topology of each worker (value 1): its node, NVLink domain, GPU class and warm-pool membership."),
    _metric(name="fallback_requests", type="counter", unit="", labels=("tier",), group=None, source="records",
            help="Requests served through a fallback tier of the ladder."),
    _metric(name="fallback_active", type="gauge", unit="", labels=("tier",), group=None, source="records",
            help="1 while a fallback tier is in use (used in the window and its exit condition not met)."),
    _metric(name="hot_branch_hit_tokens", type="gauge", unit="tokens", labels=("rank", "branch"), group=None, source="records",
            help="Hit tokens in the window of the top-K hottest prefix branches (bounded: rank 1..K)."),
    # ---- the exporter's own cost (source "self": rendered by exporter.web.process_metrics next to
    # the standard process_* series, not from the cluster state)
    _metric(name="exporter_duty_cpu_seconds", type="counter", unit="seconds", labels=("duty",), group=None, source="self",
            help="CPU seconds the exporter's threads spent on each duty (thread CPU time around each batch of work): "
                 "kv_ingest, scrape, records, otlp, render, tree_statistics, breach."),
    _metric(name="exporter_duty_seconds", type="histogram", unit="seconds", labels=("duty",), group=None, source="self",
            buckets=DUTY_BUCKETS,
            help="Wall time of one batch of each duty's work (a drained KV poll, a scrape round, a records body, "
                 "a /metrics render, a statistics reading, a breach evaluation), waits for I/O included."),
    _metric(name="discovery_targets", type="gauge", unit="", labels=("provider",), group=0, source="exporter",
            help="Workers a service-discovery provider gives now (after relabelling; its last good answer while it fails)."),
    _metric(name="discovery_refresh_failures", type="counter", unit="", labels=("provider",), group=0, source="exporter",
            help="Refreshes of a service-discovery provider that failed (unreachable, an error answer, a file or answer "
                 "that is not the format); its last good workers are kept."),
    _metric(name="discovery_last_success_timestamp_seconds", type="gauge", unit="seconds", labels=("provider",), group=0,
            source="exporter",
            help="When a service-discovery provider last answered in full (Unix time): the fleet it describes is this old."),
    _metric(name="config_last_reload_successful", type="gauge", unit="", labels=(), group=None, source="exporter",
            help="1 if the last reload of the config file (SIGHUP, POST /-/reload or a watched change) succeeded, 0 "
                 "if it failed and the running configuration was kept."),
    _metric(name="config_last_reload_success_timestamp_seconds", type="gauge", unit="seconds", labels=(), group=None,
            source="exporter", help="When the config was last loaded successfully (at start or a reload; Unix time)."),
    _metric(name="exporter_build_info", type="gauge", unit="", labels=("version", "core"), group=None, source="exporter",
            help="prefixscope build information (value 1); core: the prefix index in use, compiled or reference."),
    _metric(name="exporter_shards", type="gauge", unit="", labels=("shard",), group=0, source="exporter",
            help="The shard plan this exporter runs in: the number of family shards the cluster is split into (1: "
                 "not sharded); label shard: this exporter's index (0 to count − 1). Prometheus compares the shards "
                 "reporting with the count they expect."),
)

METRICS_BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}

P = NAMESPACE


def _ratio(num: str, den: str, by: str, window: str = "5m") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({num}[{window}])) / {agg} (rate({den}[{window}]))"


def _quantile(q: float, metric: str, by: str = "", window: str = "5m", offset: str | None = None) -> str:
    labels = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    shift = f" offset {offset}" if offset else ""
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket[{window}]{shift})))"


def _observed(quantile: str) -> str:
    """A quantile only where the window observed something: ``histogram_quantile`` over buckets that
    did not move is NaN, which a chart draws as a number and the exporter reads as missing. A
    quantile of durations or sizes is never negative, so ``>= 0`` keeps every real value."""
    return f"({quantile}) >= 0"


def _baseline_quantile(q: float, metric: str, by: str) -> str:
    """The baseline: the long window that ends where the current window begins, so a fault is
    never compared with itself."""
    return _quantile(q, metric, by, DEFAULT_BASELINE_WINDOW, DEFAULT_WINDOW)


CLASS_BY = "model, prompt_class"
# The router's sticky and prefix-hash keys it moved off a still-healthy worker (sticky collisions).
ROUTER_COLLISIONS = f'{P}_router_sticky_followups_total{{outcome="collision"}}'


# The cold-prefill bucket rates of the windows in which no cold-prefill check breached (neither
# PrefixColdPrefillSlow nor the absolute budget), per model and prompt class.
COLD_HEALTHY_RATE = "prompt_class:prefixscope_cold_prefill_seconds_bucket:rate5m_healthy"


def _healthy_baseline_quantile(q: float) -> str:
    """The cold-prefill baseline that does not absorb incidents: the quantile of the bucket rates
    averaged over the baseline window's healthy windows only (a window in which a cold-prefill
    check breached is left out), so a slowdown that lasts hours is still compared with the fleet
    before it. Where the baseline window holds no healthy window at all (the exporter's first
    window, or a change that has breached for a whole baseline window and so is the new normal),
    the plain baseline over every window stands in."""
    healthy = (f"histogram_quantile({q}, sum by (le, {CLASS_BY}) "
               f"(avg_over_time({COLD_HEALTHY_RATE}[{DEFAULT_BASELINE_WINDOW}] offset {DEFAULT_WINDOW})))")
    return f"{healthy} or {_baseline_quantile(q, f'{P}_cold_prefill_seconds', CLASS_BY)}"

SLO_SESSION_HIT_RATE = Slo(good=f"{P}_session_followup_cached_tokens_total",
                           total=f"{P}_session_followup_prompt_tokens_total",
                           budget_unit="follow-up prompt tokens")
SLO_PREFIX_MISS_COST = Slo(good=f"{P}_missed_requests_within_baseline_total", total=f"{P}_missed_requests_total",
                           budget_unit="missed requests", judged_against_baseline=True)
# The engines' own prefix-cache counters (vLLM prefix_cache_hits/queries, SGLang cached tokens): a
# deployment with engine /metrics alone (no records, no spans) still has an SLO that pages.
SLO_PREFIX_HIT_RATE = Slo(good=f"{P}_prefix_cache_hit_tokens_total", total=f"{P}_prefix_cache_queried_tokens_total",
                          budget_unit="prompt tokens looked up in the engines' prefix caches")
SLOS: dict[str, Slo] = {"slo_prefix_hit_rate": SLO_PREFIX_HIT_RATE, "slo_session_hit_rate": SLO_SESSION_HIT_RATE,
                        "slo_prefix_miss_cost": SLO_PREFIX_MISS_COST}
SLO_GROUPS: dict[str, int] = {"slo_prefix_hit_rate": 1, "slo_session_hit_rate": 2, "slo_prefix_miss_cost": 3}


def burn_window_ranges() -> list[str]:
    """Every window of the burn-rate tiers, shortest first."""
    seconds = {"m": 60, "h": 3600, "d": 86400}
    return sorted({w for b in BURN_WINDOWS for w in (b.long, b.short)}, key=lambda w: int(w[:-1]) * seconds[w[-1]])


def _slo_rules() -> tuple[RecordingRule, ...]:
    windows = burn_window_ranges()
    out = []
    for key, slo in SLOS.items():
        for w in windows:
            total = f"sum(rate({slo.total}[{w}]))"
            out.append(RecordingRule(
                record=slo.error_ratio_rule(key, w), fixed_windows=True,
                expr=f"({total} - sum(rate({slo.good}[{w}]))) / {total}",
                group=SLO_GROUPS[key],
                help=f"Error ratio of the SLO {key} over {w}: share of {slo.budget_unit} that were not good."))
    return tuple(out)


RECORDING_RULES: tuple[RecordingRule, ...] = (
    # group 1
    RecordingRule(record="cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", ""),
                  group=1, help="Cluster-wide prefix-cache hit ratio (tokens)."),
    RecordingRule(record="model:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", "model"),
                  group=1, help="Prefix-cache hit ratio per model."),
    RecordingRule(record="worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_prefix_cache_hit_tokens_total", f"{P}_prefix_cache_queried_tokens_total", "worker"),
                  group=1, help="Prefix-cache hit ratio per worker."),
    RecordingRule(record="worker:prefixscope_prefix_cache_queried_tokens:rate5m",
                  expr=f"sum by (worker) (rate({P}_prefix_cache_queried_tokens_total[5m]))",
                  group=1, help="Prompt tokens looked up in each worker's prefix cache per second (its traffic)."),
    # One broken cache among healthy ones barely moves the cluster's ratio (one worker in eight at
    # 0.13 among 0.94: 0.87): each worker against the median worker of its cluster, on comparable
    # traffic (at least threshold(worker_peer_traffic) of the median worker's lookups: a worker
    # that barely serves, is draining or gets a spill of new prompts has a hit ratio of its own).
    RecordingRule(record="worker:prefixscope_prefix_cache_hit_ratio_per_peer_median:ratio",
                  expr="(worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m / on () group_left () "
                       "quantile(0.5, worker:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m)) "
                       "and on (worker) (worker:prefixscope_prefix_cache_queried_tokens:rate5m >= on () group_left () "
                       "(threshold(worker_peer_traffic) * quantile(0.5, worker:prefixscope_prefix_cache_queried_tokens:rate5m)))",
                  group=1, help="Each worker's prefix-cache hit ratio against the median worker's of its cluster, "
                                "for workers whose traffic is comparable (absent for the others)."),
    RecordingRule(record="worker:prefixscope_worker_resident_blocks_per_capacity:ratio",
                  # summed by worker: each family shard exports its part of a worker's blocks
                  expr=f"sum by (worker) ({P}_worker_resident_blocks) / on (worker) max by (worker) ({P}_worker_capacity_blocks)",
                  group=1, help="Resident blocks against capacity per worker."),
    RecordingRule(record="worker:prefixscope_kv_thrash:ratio_rate5m",
                  expr=_ratio(f"{P}_kv_blocks_restored_after_eviction_total", f"{P}_kv_blocks_stored_total", "worker"),
                  group=1, help="Thrash per worker: share of stored GPU blocks the worker had evicted within the window."),
    RecordingRule(record="worker:prefixscope_kv_evicted_before_reuse:ratio_rate5m",
                  expr=_ratio(f'{P}_kv_block_eviction_age_seconds_count{{reused="false"}}',
                              f"{P}_kv_block_eviction_age_seconds_count", "worker"),
                  group=1, help="Share of (sampled) evicted blocks with no reuse seen while resident."),
    RecordingRule(record="worker:prefixscope_kv_block_eviction_age_seconds:p50_5m",
                  expr=_quantile(0.5, f"{P}_kv_block_eviction_age_seconds", "worker"),
                  group=1, help="Median residency of evicted blocks per worker."),
    # A full cache is normal; thrash on a full one is pressure. The fullness limit is the threshold
    # entry named in threshold(...), filled in when the rule file is generated (one place for it).
    RecordingRule(record="worker:prefixscope_kv_thrash_of_full_cache:ratio_rate5m",
                  expr="worker:prefixscope_kv_thrash:ratio_rate5m * on (worker) "
                       "(worker:prefixscope_worker_resident_blocks_per_capacity:ratio > bool threshold(prefix_block_count_per_worker))",
                  group=1, help="Thrash of workers whose cache is full (0 for the others)."),
    # vLLM's own residency samples (--kv-cache-metrics): how long an untouched block survives, how
    # long blocks live, and how far apart a block's reuses are while it lives.
    RecordingRule(record="worker:prefixscope_kv_block_idle_before_evict_seconds:p50_5m",
                  expr=_observed(_quantile(0.5, f"{P}_kv_block_idle_before_evict_seconds", "worker")),
                  group=1, help="Median time evicted blocks sat untouched before eviction, per worker (the cache's "
                                "retention horizon)."),
    RecordingRule(record="worker:prefixscope_kv_block_lifetime_seconds:p50_5m",
                  expr=_observed(_quantile(0.5, f"{P}_kv_block_lifetime_seconds", "worker")),
                  group=1, help="Median lifetime of evicted blocks, allocation to eviction, per worker (engine samples)."),
    RecordingRule(record="worker:prefixscope_kv_block_reuse_gap_seconds:p90_5m",
                  expr=_observed(_quantile(0.9, f"{P}_kv_block_reuse_gap_seconds", "worker")),
                  group=1, help="p90 gap between a resident block's consecutive accesses, per worker."),
    RecordingRule(record="cluster:prefixscope_prefix_unstable_root_branches_per_requests:ratio_rate5m",
                  expr=_ratio(f"{P}_prefix_unstable_root_branches_total", f"{P}_requests_total", ""),
                  group=1, help="Prefix instability: new root branches that near-duplicate a recent root, per request."),
    RecordingRule(record="cluster:prefixscope_prefix_tree_leaf_depth:p99",
                  expr=f"histogram_quantile(0.99, sum by (le) ({P}_prefix_tree_leaf_depth_bucket))",
                  group=1, help="p99 leaf depth of the radix-compressed prefix tree."),
    # group 2
    RecordingRule(record="cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_session_followup_cached_tokens_total", f"{P}_session_followup_prompt_tokens_total", ""),
                  group=2, help="Session hit ratio over follow-up turns, pooled over sessions."),
    RecordingRule(record="cluster:prefixscope_session_hit_ratio:p50",
                  expr=f"histogram_quantile(0.5, sum by (le) ({P}_session_hit_ratio_bucket))",
                  group=2, help="Median session hit ratio over sessions active in the window."),
    RecordingRule(record="cluster:prefixscope_session_hit_ratio_below_0_8:share",
                  expr=(f'sum({P}_session_hit_ratio_bucket{{le="{SESSION_HIT_LINE:g}"}}) / '
                        f'sum({P}_session_hit_ratio_bucket{{le="+Inf"}})'),
                  group=2, help="Share of sessions active in the window whose follow-up hit ratio is at most 80%."),
    # Records' (or spans') per-session judgement where session keys feed it (a window without
    # follow-ups reads NaN, dropped by ``>= 0``), else the router's own count of the keys it moved
    # off a healthy worker (the SGLang gateway's sticky and prefix-hash branches).
    RecordingRule(record="cluster:prefixscope_sticky_collisions_per_followup_requests:ratio_rate5m",
                  expr=f"({_ratio(f'{P}_sticky_collisions_total', f'{P}_followup_requests_total', '')} >= 0) "
                       f"or ({_ratio(ROUTER_COLLISIONS, f'{P}_router_sticky_followups_total', '')})",
                  group=2, help="Share of follow-ups served away from their session's (or prefix's) still-healthy "
                                "worker (request records or spans, else the router's policy branches)."),
    RecordingRule(record="policy:prefixscope_router_sticky_collisions_per_followups:ratio_rate5m",
                  expr=_ratio(ROUTER_COLLISIONS, f"{P}_router_sticky_followups_total", "router, policy"),
                  group=2, help="Share of the keyed follow-ups the router sent off their key's healthy worker, per "
                                "router and policy (SGLang gateway: sticky respills, walks off the hash ring)."),
    RecordingRule(record="policy:prefixscope_router_sticky_migrations_per_followups:ratio_rate5m",
                  expr=_ratio(f'{P}_router_sticky_followups_total{{outcome="migration"}}',
                              f"{P}_router_sticky_followups_total", "router, policy"),
                  group=2, help="Share of the keyed follow-ups the router moved because their key's worker was "
                                "unhealthy or gone, per router and policy."),
    RecordingRule(record="cluster:prefixscope_warm_pool_utilization_ratio:avg",
                  expr=f"avg({P}_warm_pool_utilization_ratio)",
                  group=2, help="Average utilisation of the warm pool."),
    RecordingRule(record="cluster:prefixscope_session_migrations:rate5m_per_minute",
                  expr=f"sum(rate({P}_session_migrations_total[5m])) * 60",
                  group=2, help="Session migrations per minute."),
    # group 3
    RecordingRule(record="cluster:prefixscope_cold_prefill_seconds:p50_5m",
                  expr=_quantile(0.5, f"{P}_cold_prefill_seconds"),
                  group=3, help="Cold prefill p50."),
    RecordingRule(record="cluster:prefixscope_cold_prefill_seconds:p95_5m",
                  expr=_quantile(0.95, f"{P}_cold_prefill_seconds"),
                  group=3, help="Cold prefill p95."),
    RecordingRule(record="cluster:prefixscope_cold_prefill_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_cold_prefill_seconds"),
                  group=3, help="Cold prefill p99."),
    RecordingRule(record="prompt_class:prefixscope_cold_prefill_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_cold_prefill_seconds", CLASS_BY),
                  group=3, help="Cold prefill p99 per model and prompt-length class."),
    RecordingRule(record="prompt_class:prefixscope_cold_prefill_seconds:p99_baseline",
                  expr=_healthy_baseline_quantile(0.99),
                  group=3, help="Cold-prefill baseline: p99 per model and prompt-length class over the healthy windows "
                                "of the baseline window ending one window ago."),
    RecordingRule(record="prompt_class:prefixscope_cold_prefill_seconds:p95_baseline",
                  expr=_healthy_baseline_quantile(0.95),
                  group=3, help="Cold-prefill baseline of the miss-cost SLO: p95 per model and prompt-length class over "
                                "the healthy windows of the baseline window ending one window ago."),
    RecordingRule(record="prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline",
                  expr="prompt_class:prefixscope_cold_prefill_seconds:p99_5m / "
                       "prompt_class:prefixscope_cold_prefill_seconds:p99_baseline",
                  group=3, help="Cold prefill p99 of the window against its baseline, per model and prompt-length class."),
    # The absolute budget backs the relative check: a baseline learnt from a fleet that was slow
    # all along, or a slowdown in a class without a baseline yet, still has a line to cross.
    RecordingRule(record="prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_budget",
                  expr="per_prompt_class_budget(prompt_class:prefixscope_cold_prefill_seconds:p99_5m, "
                       "cold_prefill_seconds_budget)",
                  group=3, help="Cold prefill p99 of the window against the absolute budget of its prompt-length class "
                                "(alerts/thresholds.yaml), per model and prompt-length class."),
    # Read one window later by the baselines above (the offset): the windows in which neither
    # cold-prefill check breached. Evaluated after the ratios, so it reads this evaluation's.
    RecordingRule(record=COLD_HEALTHY_RATE,
                  expr=f"sum by (le, {CLASS_BY}) (rate({P}_cold_prefill_seconds_bucket[5m])) "
                       f"unless on ({CLASS_BY}) "
                       "(prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline > threshold(cold_prefill_time_p99) "
                       "or prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_budget > "
                       "threshold(cold_prefill_seconds_budget))",
                  group=3, help="Cold-prefill bucket rates of the window, per model and prompt-length class, kept only "
                                "while no cold-prefill check breaches (relative to the baseline or over the budget): "
                                "what the baselines average."),
    RecordingRule(record="cluster:prefixscope_cold_prefill_cost_usd_per_cold_request:ratio_rate5m",
                  expr=_ratio(f"{P}_cold_prefill_cost_usd_total", f"{P}_cold_requests_total", ""),
                  group=3, help="Cold prefill cost per cold request."),
    RecordingRule(record="cluster:prefixscope_async_prefill_wait_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_async_prefill_wait_seconds"),
                  group=3, help="Async prefill wait p99."),
    RecordingRule(record="cluster:prefixscope_prefix_miss_cost_seconds:p50_5m",
                  expr=_quantile(0.5, f"{P}_prefix_miss_cost_seconds"),
                  group=3, help="Prefix miss cost p50."),
    RecordingRule(record="cluster:prefixscope_prefix_miss_cost_seconds:p95_5m",
                  expr=_quantile(0.95, f"{P}_prefix_miss_cost_seconds"),
                  group=3, help="Prefix miss cost p95."),
    RecordingRule(record="cluster:prefixscope_missed_requests_within_baseline_per_missed_requests:ratio_rate5m",
                  expr=_ratio(f"{P}_missed_requests_within_baseline_total", f"{P}_missed_requests_total", ""),
                  group=3, help="Share of missed requests whose miss cost stayed within the SLO factor × the baseline."),
    # group 4
    RecordingRule(record="cluster:prefixscope_router_tree_walk_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_router_tree_walk_seconds"),
                  group=4, help="Router tree-walk p99."),
    # Records' exact per-request ratio where records with block hashes feed it (a window without
    # any reads NaN, dropped by ``>= 0``), else the ratio judged from KV events' stored chains.
    RecordingRule(record="cluster:prefixscope_placement_domain_hits_per_placement_decisions:ratio_rate5m",
                  expr=f"({_ratio(f'{P}_placement_domain_hits_total', f'{P}_placement_decisions_total', '')} >= 0) "
                       f"or ({_ratio(f'{P}_kv_placement_domain_hits_total', f'{P}_kv_placement_decisions_total', '')})",
                  group=4, help="Topology-aware placement hit ratio (request records, else KV events)."),
    RecordingRule(record="router:prefixscope_router_regret_selections_per_routed_requests:ratio_rate5m",
                  expr=_ratio(f"{P}_router_regret_selections_total", f"{P}_router_routed_requests_total", "router"),
                  group=4, help="Routing regret per router: share of its routed requests sent to a worker with less "
                                "cached overlap than the best eligible one."),
    RecordingRule(record="cluster:prefixscope_router_regret_selections_per_routed_requests:ratio_rate5m",
                  expr=_ratio(f"{P}_router_regret_selections_total", f"{P}_router_routed_requests_total", ""),
                  group=4, help="Routing regret over every router: share of routed requests sent to a worker with "
                                "less cached overlap than the best eligible one."),
    RecordingRule(record="cluster:prefixscope_router_predicted_hit_ratio:p50_5m",
                  expr=_quantile(0.5, f"{P}_router_predicted_hit_ratio"),
                  group=4, help="Median share of the prompt the routers predicted cached on their picks (their belief)."),
    RecordingRule(record="router:prefixscope_router_regret_blocks_per_routed_requests:ratio_rate5m",
                  expr=_ratio(f"{P}_router_regret_blocks_total", f"{P}_router_routed_requests_total", "router"),
                  group=4, help="Cached blocks given up by the router's picks, per routed request."),
    RecordingRule(record="cluster:prefixscope_cross_node_migrations:rate5m_per_minute",
                  expr=f"sum(rate({P}_cross_node_migrations_total[5m])) * 60",
                  group=4, help="Cross-node migrations per minute."),
    # group 5
    RecordingRule(record="cluster:prefixscope_moe_expert_aligned_hits_per_moe_prefix_hits:ratio_rate5m",
                  expr=_ratio(f"{P}_moe_expert_aligned_hits_total", f"{P}_moe_prefix_hits_total", ""),
                  group=5, help="MoE expert alignment ratio."),
    RecordingRule(record="cluster:prefixscope_spec_decode_accepted_tokens_per_draft_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_spec_decode_accepted_tokens_total", f"{P}_spec_decode_draft_tokens_total", ""),
                  group=5, help="Speculative-decoding acceptance ratio."),
    RecordingRule(record="cluster:prefixscope_batch_affinity_admissions_per_batch_admissions:ratio_rate5m",
                  expr=_ratio(f"{P}_batch_affinity_admissions_total", f"{P}_batch_admissions_total", ""),
                  group=5, help="Continuous-batching affinity admission ratio."),
    # beyond: reuse decomposition
    RecordingRule(record="cluster:prefixscope_reuse_available_tokens_per_prompt_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_reuse_available_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  group=None, help="Reusable share of prompt tokens (best worker)."),
    RecordingRule(record="cluster:prefixscope_reuse_predicted_tokens_per_prompt_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_reuse_predicted_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  group=None, help="Share of prompt tokens the router believed cached."),
    RecordingRule(record="cluster:prefixscope_reuse_achieved_tokens_per_prompt_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_reuse_achieved_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  group=None, help="Share of prompt tokens the engines reported cached."),
    # beyond: the KV connector's own view (LMCache)
    RecordingRule(record="worker:prefixscope_lmcache_lookup_hit_tokens_per_queried_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_lmcache_lookup_hit_tokens_total", f"{P}_lmcache_lookup_queried_tokens_total",
                              "worker"),
                  group=None, help="LMCache's lookup hit ratio per worker: tokens it held of those it was asked for."),
    RecordingRule(record="cluster:prefixscope_lmcache_lookup_hit_tokens_per_queried_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_lmcache_lookup_hit_tokens_total", f"{P}_lmcache_lookup_queried_tokens_total", ""),
                  group=None, help="LMCache's lookup hit ratio over the cluster."),
    RecordingRule(record="operation:prefixscope_lmcache_operation_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_lmcache_operation_seconds", "operation"),
                  group=None, help="p99 of LMCache's retrieve, store and lookup times over the cluster, per operation."),
    # One worker's silent KV stream blinds the index for that worker only; the share of a cluster's
    # streamed workers that are silent says when the cluster's picture as a whole is untrustworthy
    # (PrefixTelemetryFleetBlind, the step-0 alert that holds the chain back).
    RecordingRule(record="cluster:prefixscope_kv_event_stale_workers:ratio",
                  expr=f"sum((time() - {P}_kv_event_last_timestamp_seconds) > bool threshold(kv_event_staleness)) / "
                       f"count({P}_kv_event_last_timestamp_seconds)",
                  group=0, help="Share of the workers streaming KV events whose stream is silent past the staleness "
                                "threshold."),
    RecordingRule(record="router:prefixscope_router_kv_event_lag_seconds:p99_5m",
                  expr=_quantile(0.99, f"{P}_router_kv_event_lag_seconds", "router"),
                  group=0, help="p99 of the router's own KV-event lag (publisher stamp to apply), per router."),
    RecordingRule(record="cluster:prefixscope_index_staleness_tokens_per_prompt_tokens:ratio_rate5m",
                  expr=_ratio(f"{P}_index_staleness_tokens_total", f"{P}_request_prompt_tokens_total", ""),
                  group=0, help="Share of prompt tokens predicted cached but not achieved (stale index)."),
    *_slo_rules(),
)

RULES_BY_NAME: dict[str, RecordingRule] = {r.record: r for r in RECORDING_RULES}
# The SLOs' error ratios are shares of events (bad over all), which the surviving shards' workers
# still estimate while a shard is missing: they are not withheld, so a dead shard never silences a
# page (PrefixExporterShardDown says the answer is partial beside it).
SLO_ERROR_RATIO_RULES: frozenset[str] = frozenset(r.record for r in _slo_rules())

if set(SIGNAL_SOURCES) != set(SIGNALS) or set(SIGNAL_ENABLE) != set(SIGNALS):  # each signal says where it comes from
    raise ImportError(f"signals without sources or how-to: {sorted(set(SIGNALS) ^ set(SIGNAL_SOURCES))}, "
                      f"{sorted(set(SIGNALS) ^ set(SIGNAL_ENABLE))}")


# A recording rule may compare with a threshold: ``threshold(key)`` names the alerts/thresholds.yaml
# entry, and the rule file is generated with its value (so the value still lives in one place).
THRESHOLD_REF = re.compile(r"threshold\((\w+)\)")


def rule_threshold_refs() -> dict[str, str]:
    """Threshold key -> the first recording rule that reads it."""
    out: dict[str, str] = {}
    for r in RECORDING_RULES:
        for key in THRESHOLD_REF.findall(r.expr):
            out.setdefault(key, r.record)
    return out


# ``per_prompt_class_budget(rule, key)``: a per-prompt-class rule divided by the budget of its class
# (the ``budgets`` of the threshold entry ``key``), filled in when the rule file is generated, so the
# budgets too live in the threshold file only.
BUDGET_REF = re.compile(r"per_prompt_class_budget\(([\w:]+), (\w+)\)")


def budget_expr(rule: str, budgets: Mapping[str, float]) -> str:
    """``rule`` per prompt class divided by that class's budget (classes without one are left out):
    the budgets as one constant series per class, matched on the class alone (many to one)."""
    consts = " or ".join(f'label_replace(vector({budgets[label]:g}), "prompt_class", "{label}", "", "")'
                         for _bound, label in PROMPT_CLASSES if label in budgets)
    return f"{rule} / on (prompt_class) group_left () ({consts})"


def render_expr(expr: str, values: Mapping[str, float],
                budgets: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """``expr`` with every ``threshold(key)`` replaced by the value of that threshold, and every
    ``per_prompt_class_budget(rule, key)`` by the rule over the entry's per-class budgets."""
    expr = BUDGET_REF.sub(lambda m: budget_expr(m[1], (budgets or {})[m[2]]), expr)
    return THRESHOLD_REF.sub(lambda m: f"{values[m[1]]:g}", expr)

CHECKS: tuple[Check, ...] = (
    # ---- step 0: telemetry health ---------------------------------------------------------
    Check(key="exporter_up", group=0, kind="health", title="prefixscope exporter up", alert="PrefixExporterDown",
          value=f"absent({P}_exporter_build_info) or vector(0)",
          op=">", threshold="exporter_up", unit="targets", signals=(),
          meaning="Prometheus has no prefixscope exporter to scrape (1; 0 while it is scraped): every prefixscope "
                  "series is gone, so every other check reads no data (not instrumented), never a failure.",
          summary="The prefixscope exporter is not being scraped: the whole diagnosis chain is blind."),
    Check(key="exporter_shards", group=0, kind="health", title="Exporter shards all reporting",
          alert="PrefixExporterShardDown", value=SHARDS_MISSING_BY_SHARD,
          op=">", threshold="exporter_shards", unit="shards", signals=(),
          meaning="Family shards of the exporter that Prometheus no longer scrapes: 1 for each shard seen within "
                  f"{SCOPE_MEMORY} that no longer reports while its peers still run the same shard plan, else the "
                  "shard count the reporting shards expect minus the shards reporting (0 when every shard "
                  "reports). Each shard owns part of the prefix families and part of the workers' scrapes: "
                  "without one, every pooled number is partial, so the pooled recording rules are withheld "
                  "(empty) until it is back.",
          summary="An exporter shard is not being scraped: the cluster's numbers are partial and its pooled "
                  "rules are withheld."),
    Check(key="targets_up", group=0, kind="health", title="Scrape targets up", alert="PrefixTelemetryTargetDown",
          value=f"max({P}_telemetry_blind_targets)",
          op=">", threshold="targets_up", unit="targets", signals=(),
          meaning="A router, or a worker that still serves traffic, fails its /metrics scrape: the chain would "
                  "read part of the fleet blind. (A worker that failed and left the pool shows in step 2.)",
          summary="A scrape target that still serves traffic is down: part of the fleet is unobserved."),
    Check(key="kv_event_staleness", group=0, kind="health", title="KV-event stream fresh", alert="PrefixTelemetryKvEventsStale",
          value=f"max(time() - {P}_kv_event_last_timestamp_seconds)",
          op=">", threshold="kv_event_staleness", unit="seconds", signals=("kv_events",), per=(W,),
          meaning="A worker's KV-event stream has gone quiet while it serves traffic; the index is going stale.",
          summary="A worker's KV-event stream has been silent for more than {threshold}."),
    # A stream can be fresh (batches keep arriving) while the exporter applies them ever later: the
    # staleness above never fires then. Lag is receive time − the publisher's batch stamp, so a worker
    # clock off by a little adds to it: the threshold is seconds (NTP keeps clocks within milliseconds)
    # and the subscriber reads a worker's lag of a second or more as 0 once nothing of it waits.
    Check(key="kv_ingest_lag", group=0, kind="health", title="KV-event ingest keeping up",
          alert="PrefixTelemetryKvIngestLagging",
          value=f"max({P}_kv_event_lag_seconds)",
          op=">", threshold="kv_ingest_lag", unit="seconds", signals=("kv_events",), per=(W,),
          meaning="Seconds between a worker's publishing of a KV-event batch and prefixscope reading it, for the "
                  "worker's last batch (0 once nothing of the worker waits to be applied): the exporter falling "
                  "behind the stream — more block events than its core applies — not the worker going quiet. "
                  "Past its receive queues it sheds what it cannot hold into sequence gaps that the worker's "
                  "replay heals.",
          summary="prefixscope is more than {threshold} behind a worker's KV-event stream: its prefix index "
                  "lags the worker's cache."),
    Check(key="kv_event_blind_share", group=0, kind="health", title="KV-event streams silent (share of the fleet)",
          alert="PrefixTelemetryFleetBlind",
          value="max(cluster:prefixscope_kv_event_stale_workers:ratio)",
          op=">", threshold="kv_event_blind_share", unit="ratio", signals=("kv_events",),
          meaning="Share of the workers streaming KV events whose stream has been silent past the staleness threshold: "
                  "one silent worker blinds the index for that worker, this share blinds it for the cluster.",
          summary="More than {threshold} of the workers' KV-event streams are silent: the cluster's prefix index is "
                  "going stale."),
    Check(key="kv_event_gaps", group=0, kind="health", title="KV-event loss and index drift", alert="PrefixTelemetryKvEventGaps",
          value=f"sum(increase({P}_kv_index_repairs_total[5m]))",
          op=">", threshold="kv_event_gaps", unit="repairs", signals=("kv_events",),
          meaning="A worker's view had to be repaired in the last 5 minutes: KV-event batches were lost and no replay "
                  "recovered them, or the view drifted from what the worker reports (more resident blocks than its "
                  "capacity). Gaps that the replay healed are counted but are not a failure.",
          summary="The prefix index lost KV events it could not recover, or drifted from a worker's own cache."),
    Check(key="index_staleness", group=0, kind="health", title="Index staleness (predicted − achieved)", alert="PrefixTelemetryIndexStale",
          value="cluster:prefixscope_index_staleness_tokens_per_prompt_tokens:ratio_rate5m",
          op=">", threshold="index_staleness", unit="ratio", signals=("predicted_cached_tokens", "cached_tokens"),
          meaning="The router believes blocks are cached that the engines do not have.",
          summary="The router's prefix index predicts cache hits the engines do not deliver."),
    Check(key="router_kv_index_faults", group=0, kind="health", title="Router's prefix index faults",
          alert="PrefixTelemetryRouterIndexFaults",
          value=f"sum(increase({P}_router_kv_index_faults_total[5m]))",
          op=">", threshold="router_kv_index_faults", unit="events", signals=("router_index_health",),
          meaning="KV events the router's own prefix index failed to apply (Dynamo: parent or block not found, "
                  "invalid block) or lost for good (the SGLang gateway: unrecovered gaps, stream resyncs) in the "
                  "last 5 minutes: the router routes on a view of the caches that is wrong until they turn over.",
          summary="The router's own prefix index lost or failed to apply KV events: its routing works from a "
                  "wrong view of the caches."),
    Check(key="ingest_errors", group=0, kind="health", title="Ingest errors", alert="PrefixTelemetryIngestErrors",
          value=f"sum(rate({P}_ingest_errors_total[5m]))",
          op=">", threshold="ingest_errors", unit="per_second", signals=(),
          meaning="prefixscope is rejecting malformed input from a source.",
          summary="prefixscope is rejecting more than {threshold} of its input."),
    # Per provider, so it inhibits nothing (one provider's stale list is not cluster-wide blindness);
    # a deployment without discovery has no such series: no data, never firing.
    Check(key="discovery_freshness", group=0, kind="health", title="Service discovery current",
          alert="PrefixTelemetryDiscoveryFailing",
          value=f"max(time() - {P}_discovery_last_success_timestamp_seconds)",
          op=">", threshold="discovery_staleness", unit="seconds", signals=(), per=("provider",),
          meaning="Seconds since a service-discovery provider last answered in full. A provider that fails keeps its "
                  "last good workers: the exporter goes on following a fleet that is getting older — workers that "
                  "joined since are neither scraped nor indexed, workers that left since are still targets.",
          summary="A service-discovery provider has not answered in full for more than {threshold}: the fleet "
                  "prefixscope follows is out of date."),
    # ---- step 1 -----------------------------------------------------------------------------
    Check(key="prefix_hit_rate_total", group=1, title="Prefix hit rate (cluster)", alert="PrefixHitRateLow",
          value="cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
          op="<", threshold="prefix_hit_rate_total", unit="ratio", signals=("worker_metrics",),
          meaning="Σ hit tokens / Σ queried tokens across the cluster.",
          summary="Cluster prefix-cache hit rate is below {threshold}."),
    Check(key="prefix_hit_rate_worker_outlier", group=1, title="Worker hit rate against its peers' median",
          alert="PrefixWorkerHitRateOutlier",
          value="min(worker:prefixscope_prefix_cache_hit_ratio_per_peer_median:ratio)",
          op="<", threshold="prefix_hit_rate_worker_outlier", unit="ratio_to_peers", signals=("worker_metrics",), per=(W,),
          meaning="A worker's prefix-cache hit ratio (engine counters) as a multiple of the median worker's of its "
                  "cluster, among workers whose traffic is comparable: one worker whose cache is wiped or "
                  "misconfigured stands out here while the cluster's ratio barely moves.",
          summary="A worker's prefix-cache hit rate is below {threshold} the median of its peers': its cache, not "
                  "the workload, is failing."),
    Check(key="prefix_block_count_per_worker", group=1, title="Cache pressure (full and thrashing)", alert="PrefixCacheNearCapacity",
          value="max(worker:prefixscope_kv_thrash_of_full_cache:ratio_rate5m)",
          op=">", threshold="prefix_cache_thrash", unit="ratio", signals=("kv_events",), per=(W,),
          meaning="Thrash of the workers whose cache is full (resident blocks from KV events above the "
                  "prefix_block_count_per_worker share of num_gpu_blocks): the share of stored blocks the worker had "
                  "itself evicted within the window. A full cache alone is normal (vLLM evicts only on demand).",
          summary="A worker's full KV cache evicts blocks it needs again: more than {threshold} of its stored blocks "
                  "were evicted and stored again within the window."),
    Check(key="prefix_cache_retention", group=1, title="Cache retention (idle time before eviction, p50)",
          alert="PrefixCacheRetentionShort",
          value="min(worker:prefixscope_kv_block_idle_before_evict_seconds:p50_5m)",
          op="<", threshold="prefix_cache_retention", unit="seconds", signals=("kv_residency",), per=(W,),
          meaning="How long a block the engine evicted had sat untouched before it went, median over the window "
                  "(vLLM's own sampled residency, --kv-cache-metrics): the cache's retention horizon. A prefix "
                  "reused after a longer pause (a conversation's next turn, an agent's next step) is gone by then "
                  "and prefilled again. vLLM evicts only on demand: a cache with room evicts nothing and reads no "
                  "data.",
          summary="A worker's KV cache keeps an untouched block for less than {threshold} before evicting it: "
                  "prefixes reused after a longer pause are recomputed."),
    Check(key="prefix_tree_depth_p99", group=1, title="Prefix-tree depth p99", alert="PrefixTreeTooDeep",
          value="cluster:prefixscope_prefix_tree_leaf_depth:p99",
          op=">", threshold="prefix_tree_depth_p99", unit="depth", signals=("kv_events",),
          meaning="p99 leaf depth of the radix-compressed prefix tree.",
          summary="The cluster prefix tree is deeper than {threshold} at p99."),
    Check(key="prefix_root_instability", group=1, title="Prefix instability (near-duplicate new roots per request)",
          alert="PrefixRootUnstable",
          value="cluster:prefixscope_prefix_unstable_root_branches_per_requests:ratio_rate5m",
          op=">", threshold="prefix_root_instability", unit="ratio", signals=("kv_events", "kv_token_ids", "records"),
          meaning="New root branches of the prefix tree per request, counting only those whose opening tokens equal "
                  "a recent root's but for a short early span: a first block that changes on every request (a "
                  "timestamp or request id rendered into the system prompt), so nothing after it is ever reused. "
                  "Genuinely new prompts (documents, a session's own system prompt) open new roots too but are "
                  "no near-duplicates.",
          summary="More than {threshold} of requests open a new prefix-tree root that repeats a recent prompt but for "
                  "a short early span: something early in the prompt changes on every request."),
    # ---- step 2 -----------------------------------------------------------------------------
    # The session hit rate is the effect of stickiness (seed §7): the seed lists it in group 1,
    # the chain reads it in step 2.
    Check(key="prefix_hit_rate_per_session", group=2, title="Session hit rate (follow-up turns)", alert="PrefixSessionHitRateLow",
          value="cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m",
          op="<", threshold="prefix_hit_rate_per_session", unit="ratio", signals=("session_key", "cached_tokens"),
          meaning="Σ cached / Σ prompt tokens over follow-up turns of keyed sessions (the effect of sticky routing).",
          summary="Follow-up turns of multi-turn sessions hit the prefix cache less than {threshold} of the time."),
    Check(key="sticky_session_collision_rate", group=2, title="Sticky-session collisions", alert="PrefixStickyCollisionsHigh",
          value="cluster:prefixscope_sticky_collisions_per_followup_requests:ratio_rate5m",
          op=">", threshold="sticky_session_collision_rate", unit="ratio", signals=("affinity_outcomes",),
          meaning="Share of follow-ups whose session was last served by a different, still-healthy worker (from "
                  "records or spans with session keys; else the router's own count of the keys it moved off a "
                  "healthy worker: the SGLang gateway's sticky respills and walks off the hash ring).",
          summary="More than {threshold} of follow-up requests leave their session's healthy worker."),
    Check(key="warm_pool_utilization", group=2, title="Warm-pool utilisation", alert="PrefixWarmPoolSaturated",
          value="cluster:prefixscope_warm_pool_utilization_ratio:avg",
          op=">", threshold="warm_pool_utilization", unit="ratio", signals=("warm_pool", "worker_metrics"),
          meaning="Average of max(KV usage, running / max concurrency) over warm-pool workers.",
          summary="The warm pool that absorbs cache misses is more than {threshold} busy."),
    Check(key="session_migration_count_per_minute", group=2, title="Session migrations per minute", alert="PrefixSessionMigrationsHigh",
          value="cluster:prefixscope_session_migrations:rate5m_per_minute",
          op=">", threshold="session_migration_count_per_minute", unit="per_minute", signals=("migrations",),
          meaning="Sessions moved because their worker left, drained or failed.",
          summary="Sessions are migrating between workers at more than {threshold}."),
    # ---- step 3 -----------------------------------------------------------------------------
    Check(key="cold_prefill_time_p99", group=3, title="Cold prefill p99 vs its long-window baseline", alert="PrefixColdPrefillSlow",
          value="max(prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline)",
          op=">", threshold="cold_prefill_time_p99", unit="ratio_to_baseline", signals=("prefill_timing",),
          meaning="Cold prefill p99 of the window against the cold p99 of the baseline window that ends where "
                  "this one begins, for the same model and prompt-length class (the worst class).",
          summary="Cold prefill p99 exceeds {threshold} its long-window baseline for comparable prompt lengths."),
    Check(key="cold_prefill_budget", group=3, title="Cold prefill p99 vs its absolute budget",
          alert="PrefixColdPrefillOverBudget",
          value="max(prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_budget)",
          op=">", threshold="cold_prefill_seconds_budget", unit="ratio_to_budget", signals=("prefill_timing",),
          meaning="Cold prefill p99 of the window against the absolute budget of its prompt-length class "
                  "(seconds, from the threshold file), for the worst model and class: a line that does not move "
                  "with the fleet's own history.",
          summary="Cold prefill p99 exceeds the absolute budget of its prompt-length class."),
    Check(key="cold_prefill_cost_per_request", group=3, title="Cold prefill cost per request", alert="PrefixColdPrefillCostHigh",
          value="cluster:prefixscope_cold_prefill_cost_usd_per_cold_request:ratio_rate5m",
          op=">", threshold="cold_prefill_cost_per_request", unit="usd", signals=("prefill_timing", "topology"),
          meaning="Cold prefill GPU-seconds × price per GPU-hour.",
          summary="Cold prefill costs more than {threshold} per request."),
    Check(key="async_prefill_wait_time_p99", group=3, title="Async prefill wait p99", alert="PrefixAsyncPrefillBacklog",
          value="cluster:prefixscope_async_prefill_wait_seconds:p99_5m",
          op=">", threshold="async_prefill_wait_time_p99", unit="seconds", signals=("async_prefill",),
          meaning="Wait of requests sent to the async prefill path.",
          summary="Requests on the async prefill path wait longer than {threshold} at p99."),
    # ---- step 4 -----------------------------------------------------------------------------
    Check(key="prefix_tree_walk_latency", group=4, title="Router tree-walk p99", alert="PrefixRouterTreeWalkSlow",
          value="cluster:prefixscope_router_tree_walk_seconds:p99_5m",
          op=">", threshold="prefix_tree_walk_latency", unit="seconds", signals=("walk_latency",),
          meaning="Router prefix-tree lookup latency.",
          summary="The router's prefix-tree lookup p99 exceeds {threshold}."),
    Check(key="topology_aware_placement_hit_rate", group=4, title="Topology-aware placement", alert="PrefixPlacementTopologyBlind",
          value="cluster:prefixscope_placement_domain_hits_per_placement_decisions:ratio_rate5m",
          op="<", threshold="topology_aware_placement_hit_rate", unit="ratio", signals=("topology", "placements"),
          meaning="Share of requests placed in the NVLink domain holding their longest cached prefix (from "
                  "records with block hashes; else judged at each request's first KV-event block store).",
          summary="Fewer than {threshold} of requests land in the NVLink domain holding their prefix."),
    Check(key="cross_node_migration_count_per_minute", group=4, title="Cross-node migrations per minute", alert="PrefixCrossNodeMigrationStorm",
          value="cluster:prefixscope_cross_node_migrations:rate5m_per_minute",
          op=">", threshold="cross_node_migration_count_per_minute", unit="per_minute", signals=("migrations", "topology"),
          meaning="Migrations whose old and new worker sit on different nodes.",
          summary="Session migrations across nodes exceed {threshold}."),
    # ---- step 5 -----------------------------------------------------------------------------
    Check(key="moe_expert_alignment_rate", group=5, title="MoE expert alignment", alert="PrefixMoeExpertMisaligned",
          value="cluster:prefixscope_moe_expert_aligned_hits_per_moe_prefix_hits:ratio_rate5m",
          op="<", threshold="moe_expert_alignment_rate", unit="ratio", signals=("expert_signature",),
          meaning="Share of prefix hits whose expert signature matches the cached prefix's.",
          summary="Fewer than {threshold} of prefix hits keep their MoE expert signature."),
    Check(key="speculative_decoding_acceptance_rate", group=5, title="Speculative-decoding acceptance", alert="PrefixSpecDecodeAcceptanceLow",
          value="cluster:prefixscope_spec_decode_accepted_tokens_per_draft_tokens:ratio_rate5m",
          op="<", threshold="speculative_decoding_acceptance_rate", unit="ratio", signals=("spec_decode",),
          meaning="Accepted / draft tokens.",
          summary="Speculative-decoding acceptance is below {threshold}."),
    Check(key="continuous_batching_affinity_admission_rate", group=5, title="Affinity admissions", alert="PrefixBatchingAffinityBlind",
          value="cluster:prefixscope_batch_affinity_admissions_per_batch_admissions:ratio_rate5m",
          op="<", threshold="continuous_batching_affinity_admission_rate", unit="ratio", signals=("affinity_admission",),
          meaning="Share of admissions chosen for prefix affinity.",
          summary="Fewer than {threshold} of batch admissions follow prefix affinity."),
    # ---- SLOs (seed §7, corollary 4) ---------------------------------------------------------
    # ``value`` is the SLI over the window against the objective; the alerts are the burn-rate
    # pairs of BURN_WINDOWS over the SLO's error-ratio rules.
    Check(key="slo_prefix_hit_rate", group=1, kind="slo", title="SLO: engine prefix hit rate", alert="PrefixHitRateSloBurn",
          value="cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m",
          op="<", threshold="slo_prefix_hit_rate", unit="ratio", signals=("worker_metrics",),
          meaning="Share of prompt tokens the engines looked up in their prefix caches and did not find, from the "
                  "engines' own counters (the prefix hit-rate SLO's error ratio; needs nothing but engine /metrics).",
          summary="The engines' prefix hit-rate SLO ({threshold}) is burning its error budget.",
          slo=SLO_PREFIX_HIT_RATE),
    Check(key="slo_session_hit_rate", group=2, kind="slo", title="SLO: session hit rate ≥ 85%", alert="PrefixSessionHitRateSloBurn",
          value="cluster:prefixscope_session_followup_cached_tokens_per_prompt_tokens:ratio_rate5m",
          op="<", threshold="slo_session_hit_rate", unit="ratio", signals=("session_key", "cached_tokens"),
          meaning="Uncached share of follow-up prompt tokens of multi-turn sessions (the session hit-rate SLO's "
                  "error ratio).",
          summary="The multi-turn session hit-rate SLO ({threshold}) is burning its error budget.",
          slo=SLO_SESSION_HIT_RATE),
    Check(key="slo_prefix_miss_cost", group=3, kind="slo", title="SLO: miss cost p95 ≤ 1.5 × cold baseline", alert="PrefixMissCostSloBurn",
          value="cluster:prefixscope_missed_requests_within_baseline_per_missed_requests:ratio_rate5m",
          op="<", threshold="slo_prefix_miss_cost", unit="ratio", signals=("prefill_timing", "cached_tokens"),
          meaning="Share of missed requests whose miss cost (T_prefill + T_queue + T_migrate) exceeded the SLO "
                  "factor × the long-window cold-prefill p95 of their prompt-length class (the miss-cost SLO's "
                  "error ratio).",
          summary="The prefix miss-cost SLO ({threshold} of misses within the cold-prefill baseline) is burning its error budget.",
          slo=SLO_PREFIX_MISS_COST),
)

CHECKS_BY_KEY: dict[str, Check] = {c.key: c for c in CHECKS}
CHECKS_BY_ALERT: dict[str, Check] = {c.alert: c for c in CHECKS}


def checks_for_step(step: int) -> list[Check]:
    return [c for c in CHECKS if c.group == step]


def check_sources(check: Check) -> list[str]:
    """The sources (``SOURCE_NAMES`` keys) that feed any of the check's signals, in table order."""
    wanted = {src for sig in check.signals for src in SIGNAL_SOURCES[sig]}
    return [src for src in SOURCE_NAMES if src in wanted]


def as_dict() -> dict:
    """The catalogue as plain data (for ``prefixscope catalog --format json`` and the API)."""
    return {
        "namespace": NAMESPACE,
        "signals": SIGNALS,
        "signal_sources": {k: list(v) for k, v in SIGNAL_SOURCES.items()},
        "signal_enable": SIGNAL_ENABLE,
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
    "BUDGET_REF",
    "BURN_WINDOWS",
    "CHECKS",
    "CHECKS_BY_ALERT",
    "CHECKS_BY_KEY",
    "COLD_HEALTHY_RATE",
    "DEFAULT_BASELINE_WINDOW",
    "DEFAULT_WINDOW",
    "DUTY_BUCKETS",
    "DUTY_NAMES",
    "KV_SESSION_SIGNALS",
    "LMCACHE_BUCKETS",
    "LMCACHE_OPERATIONS",
    "METRICS",
    "METRICS_BY_NAME",
    "NAMESPACE",
    "NO_RECORDS_SIGNALS",
    "PROMPT_CLASSES",
    "RECORDING_RULES",
    "RESIDENCY_BUCKETS",
    "ROUTER_FEEDS",
    "ROUTER_KINDS",
    "ROUTER_SERIES_SIGNALS",
    "RULES_BY_NAME",
    "SCOPE_MEMORY",
    "SESSION_HIT_LINE",
    "SHARDS_MISSING",
    "SHARDS_MISSING_BY_SHARD",
    "SIGNALS",
    "SIGNAL_ENABLE",
    "SIGNAL_SOURCES",
    "SLOS",
    "SOURCE_NAMES",
    "STEPS",
    "THRESHOLD_REF",
    "BurnWindows",
    "Check",
    "Metric",
    "RecordingRule",
    "Slo",
    "Step",
    "as_dict",
    "budget_expr",
    "burn_window_ranges",
    "check_sources",
    "checks_for_step",
    "configure",
    "lit_without_records",
    "pools_exported",
    "prompt_class",
    "render_expr",
    "router_signals",
    "rule_threshold_refs",
    "scope_expr",
    "shard_guarded",
    "to_json",
    "to_table",
]
