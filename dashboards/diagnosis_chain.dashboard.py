"""Prefix locality — diagnosis chain: one row per step, 0 (telemetry) then the seed's groups 1–5."""

from dashboards import queries as q
from dashboards.common import check_panel, finalize, row, slo_burn_panel, stat, target, timeseries
from dashboards.drawing import Drawing, Drawn
from prefixscope.catalog import CHECKS_BY_KEY, SESSION_HIT_LINE, STEPS, checks_for_step

TITLE = "Prefix locality — diagnosis chain"


def _step_extras(step: int, drawing: Drawing) -> list:
    """Context panels that help read a step's checks (never alerting by themselves)."""
    if step == 0:
        return [
            stat("Signals instrumented", [target(q.metric("signal_available"), "{{signal}}")],
                 description="1 = the input has a source; 0 = not instrumented (its checks show no data, not OK)."),
            timeseries("KV-event lag", [target(q.series("kv_event_lag_seconds"), "{{worker}}")], unit="seconds",
                       description="Receive time minus batch timestamp of each worker's last KV-event batch."),
            timeseries("Router's own index: faults and lag", [
                target(q.router_index_faults(), "{{router}} {{kind}} /s"),
                target(q.rule("router:prefixscope_router_kv_event_lag_seconds:p99_5m"), "{{router}} lag p99 (s)"),
            ], description=(
                "The index the router routes on: KV events it failed to apply or lost for good, per second by kind "
                "(Dynamo's apply statuses, the SGLang gateway's unrecovered gaps and stream resyncs), and how far "
                "behind the gateway applies events (p99, seconds).")),
        ]
    if step == 1:
        return [
            timeseries("Reuse decomposition", [
                target(q.rule("cluster:prefixscope_reuse_available_tokens_per_prompt_tokens:ratio_rate5m"), "available"),
                target(q.rule("cluster:prefixscope_reuse_predicted_tokens_per_prompt_tokens:ratio_rate5m"), "predicted"),
                target(q.rule("cluster:prefixscope_reuse_achieved_tokens_per_prompt_tokens:ratio_rate5m"), "achieved"),
            ], unit="ratio", description=(
                "Share of prompt tokens reusable at best (available), believed cached by the router (predicted) "
                "and reported cached by the engines (achieved). available − achieved = routing regret; "
                "predicted − achieved = stale index; a low *available* means the workload itself stopped sharing.")),
            timeseries("Hit rate per worker", [
                target(q.ratio_by("prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "worker", drawing.window), "{{worker}}")],
                unit="ratio", description="Σ hit / Σ queried tokens per worker: one bad worker or all of them?"),
            timeseries("Block residency per worker (vLLM's samples)", [
                target(q.quantile(0.5, "kv_block_idle_before_evict_seconds", "worker", over=drawing.window),
                       "{{worker}} idle before eviction p50"),
                target(q.quantile(0.5, "kv_block_lifetime_seconds", "worker", over=drawing.window),
                       "{{worker}} lifetime p50"),
                target(q.quantile(0.9, "kv_block_reuse_gap_seconds", "worker", over=drawing.window),
                       "{{worker}} reuse gap p90"),
            ], unit="seconds", description=(
                "vLLM's own sampled residency (--kv-cache-metrics): how long an evicted block had sat untouched "
                "(the cache's retention horizon), how long it lived, and how far apart a resident block's reuses "
                "were. Reuse gaps reaching the horizon: the workload's reuses are at the edge of what the cache "
                "holds. Without the flag: no data.")),
        ]
    if step == 2:
        return [
            timeseries("Session hit rate across sessions", [
                target(q.rule("cluster:prefixscope_session_hit_ratio:p50"), "p50 over sessions"),
                target(q.rule("cluster:prefixscope_session_hit_ratio_below_0_8:share"),
                       f"share of sessions at or below {SESSION_HIT_LINE:.0%}"),
            ], unit="ratio", description=(
                "The distribution over sessions active in the window of each session's follow-up hit ratio "
                "(no session label anywhere): the pooled rate can hide a minority of sessions that never "
                "stick, the median and the share below the line cannot.")),
            slo_burn_panel(CHECKS_BY_KEY["slo_session_hit_rate"], drawing),
            timeseries("Router's keyed follow-ups", [
                target(q.router_followups_by_outcome(), "{{router}} {{policy}} {{outcome}}")],
                unit="per_second", stack=True, description=(
                    "What the router did with requests whose key (a session under sticky routing, the prompt's head "
                    "under prefix hashing) already had a worker: kept it, moved it off a healthy worker (collision: "
                    "a load walk off the ring, a sticky respill) or off an unhealthy one (migration). The sticky "
                    "check reads the collision share when no record or span names sessions.")),
        ]
    if step == 3:
        return [
            timeseries("Cold prefill time", [
                target(q.rule("cluster:prefixscope_cold_prefill_seconds:p50_5m"), "p50"),
                target(q.rule("cluster:prefixscope_cold_prefill_seconds:p95_5m"), "p95"),
                target(q.rule("cluster:prefixscope_cold_prefill_seconds:p99_5m"), "p99"),
            ], unit="seconds", description="Prefill time in seconds of cold requests (nothing reused beyond "
                                           "cold_reuse_share), all prompt lengths."),
            timeseries("Cold prefill p99 ÷ baseline by prompt length", [
                target(q.rule("prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline"),
                       "{{model}} {{prompt_class}}"),
            ], unit="ratio_to_baseline", description=(
                "Per model and prompt-length class: the window's cold p99 over the baseline window's (ending "
                "one window ago). A healthy fleet reads about 1; all classes up = a uniform slowdown, one "
                "class = e.g. long prompts landing on a slow GPU class.")),
            timeseries("Prefix miss cost", [
                target(q.rule("cluster:prefixscope_prefix_miss_cost_seconds:p50_5m"), "p50"),
                target(q.rule("cluster:prefixscope_prefix_miss_cost_seconds:p95_5m"), "p95"),
            ], unit="seconds", description="T_prefill + T_queue + T_migrate of requests that missed part of "
                                           "their available prefix (migrations included)."),
            slo_burn_panel(CHECKS_BY_KEY["slo_prefix_miss_cost"], drawing),
        ]
    if step == 4:
        return [
            timeseries("Router: predicted reuse and regret", [
                target(q.router_predicted_hit_ratio_mean(drawing.window), "{{router}} predicted hit ratio"),
                target(q.rule("router:prefixscope_router_regret_selections_per_routed_requests:ratio_rate5m"),
                       "{{router}} regret (picks below the best overlap)"),
                target(q.rule("cluster:prefixscope_reuse_achieved_tokens_per_prompt_tokens:ratio_rate5m"),
                       "achieved (engines)"),
            ], unit="ratio", description=(
                "The router's belief against what happened: the mean share of the prompt it predicted cached on "
                "its picks (SGLang gateway match ratio, Dynamo kv_hit_rate), the share of its picks that went to a "
                "worker with less cached overlap than the best eligible one (Dynamo's non-max-overlap selections), "
                "and the share the engines reported cached. A high prediction over a low achieved share localises "
                "the fault to the router's index; regret says the router chose to give reuse up (load).")),
            timeseries("Router: cached blocks given up per request", [
                target(q.rule("router:prefixscope_router_regret_blocks_per_routed_requests:ratio_rate5m"),
                       "{{router}}")], unit="blocks", description=(
                "Cached blocks the router's picks gave up (best eligible overlap − chosen), per routed request.")),
            timeseries("Router: prefix tree against its bound", [
                target(q.router_tree_fill(), "{{router}}")], unit="ratio", description=(
                "The router's largest prefix tree (characters of an HTTP tree, tokens of a gRPC one) against "
                "its --max-tree-size, set at each eviction pass (SGLang gateway ≥ 1.10.1). Near 1 with a slow "
                "tree walk: the tree is as large as the router allows, so lower the bound or evict more often; "
                "low: the walk is slow for another reason (depth, CPU).")),
            timeseries("Router: time per routing phase (p99)", [
                target(q.quantile(0.99, "router_overhead_seconds", "router,phase", over=drawing.window),
                       "{{router}} {{phase}}")], unit="seconds", description=(
                "The router's own time per request in each routing phase (Dynamo's frontend: block and "
                "sequence hashing, the prefix-index lookup indexer_find_matches — the tree walk of "
                "prefix_tree_walk_latency —, scheduling, a shared cache's query, and their total). A slow "
                "lookup localises the step-4 drag to the index; a slow scheduling phase to the queue.")),
        ]
    return []


def build(drawing: Drawing) -> Drawn:
    panels = []
    for s in STEPS:
        panels += row(f"{s.dashboard_row}: {s.question}",
                      [check_panel(c, drawing) for c in checks_for_step(s.number)] + _step_extras(s.number, drawing))

    return finalize(TITLE, __file__, panels, drawing=drawing, description=(
        "Walk the steps top to bottom when the prefix hit rate falls: the verdict is the first step "
        "whose own checks fail. Each panel links its runbook."))
