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
    return []


def build(drawing: Drawing) -> Drawn:
    panels = []
    for s in STEPS:
        panels += row(f"{s.dashboard_row}: {s.question}",
                      [check_panel(c, drawing) for c in checks_for_step(s.number)] + _step_extras(s.number, drawing))

    return finalize(TITLE, __file__, panels, drawing=drawing, description=(
        "Walk the steps top to bottom when the prefix hit rate falls: the verdict is the first step "
        "whose own checks fail. Each panel links its runbook."))
