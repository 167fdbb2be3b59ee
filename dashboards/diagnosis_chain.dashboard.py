"""Prefix locality — diagnosis chain: one row per step, 0 (telemetry) then the seed's groups 1–5."""

from dashboards import queries as q
from dashboards.common import check_panel, finalize, row, stat, target, timeseries
from prefixscope.catalog import STEPS, checks_for_step

TITLE = "Prefix locality — diagnosis chain"


def _step_extras(step: int) -> list:
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
                target(q.ratio_by("prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "worker"), "{{worker}}")],
                unit="ratio", description="Σ hit / Σ queried tokens per worker: one bad worker or all of them?"),
        ]
    return []


panels = []
for s in STEPS:
    panels += row(f"{s.dashboard_row}: {s.question}",
                  [check_panel(c) for c in checks_for_step(s.number)] + _step_extras(s.number))

dashboard = finalize(TITLE, __file__, panels, description=(
    "Walk the steps top to bottom when the prefix hit rate falls: the verdict is the first step "
    "whose own checks fail. Each panel links its runbook."))
