"""How alerts read: the summary sentence per alert and unit-aware value formatting.

Summaries are static (Alertmanager groups notifications by them); only the threshold, read
from alerts/thresholds.yaml, is filled in at generation time. Descriptions carry the live
value through Prometheus's template functions, chosen per unit.
"""

from __future__ import annotations

from prefixscope.catalog import RULES_BY_NAME, Check

SUMMARIES: dict[str, str] = {
    "PrefixTelemetryTargetDown": "A scrape target that still serves traffic is down: part of the fleet is unobserved.",
    "PrefixTelemetryKvEventsStale": "A worker's KV-event stream has been silent for more than {threshold}.",
    "PrefixTelemetryKvEventGaps": "KV-event batches are being lost before the index sees them.",
    "PrefixTelemetryIndexStale": "The router's prefix index predicts cache hits the engines do not deliver.",
    "PrefixTelemetryIngestErrors": "prefixscope is rejecting more than {threshold} of its input.",
    "PrefixHitRateLow": "Cluster prefix-cache hit rate is below {threshold}.",
    "PrefixSessionHitRateLow": "Follow-up turns of multi-turn sessions hit the prefix cache less than {threshold} of the time.",
    "PrefixCacheNearCapacity": "A worker's KV cache holds more than {threshold} of its block capacity.",
    "PrefixTreeTooDeep": "The cluster prefix tree is deeper than {threshold} at p99.",
    "PrefixStickyCollisionsHigh": "More than {threshold} of follow-up requests leave their session's healthy worker.",
    "PrefixWarmPoolSaturated": "The warm pool that absorbs cache misses is more than {threshold} busy.",
    "PrefixSessionMigrationsHigh": "Sessions are migrating between workers at more than {threshold}.",
    "PrefixColdPrefillSlow": "Cold prefill p99 per token exceeds {threshold} the warm baseline.",
    "PrefixColdPrefillCostHigh": "Cold prefill costs more than {threshold} per request.",
    "PrefixAsyncPrefillBacklog": "Requests on the async prefill path wait longer than {threshold} at p99.",
    "PrefixRouterTreeWalkSlow": "The router's prefix-tree lookup p99 exceeds {threshold}.",
    "PrefixPlacementTopologyBlind": "Fewer than {threshold} of requests land in the NVLink domain holding their prefix.",
    "PrefixCrossNodeMigrationStorm": "Session migrations across nodes exceed {threshold}.",
    "PrefixMoeExpertMisaligned": "Fewer than {threshold} of prefix hits keep their MoE expert signature.",
    "PrefixSpecDecodeAcceptanceLow": "Speculative-decoding acceptance is below {threshold}.",
    "PrefixBatchingAffinityBlind": "Fewer than {threshold} of batch admissions follow prefix affinity.",
    "PrefixSessionHitRateSloBurn": "Multi-turn session hit rate misses its {threshold} SLO target.",
    "PrefixMissCostSloBurn": "Prefix miss cost p95 exceeds its SLO of {threshold} the cold-prefill baseline.",
}


def threshold_text(check: Check, value: float) -> str:
    """The threshold as a person reads it, in the check's unit."""
    unit = check.unit
    if unit == "ratio":
        return f"{value * 100:g}%"
    if unit == "seconds":
        return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"
    if unit == "usd":
        return f"{value:g} USD"
    if unit == "per_minute":
        return f"{value:g} per minute"
    if unit == "per_second":
        return f"{value:g} per second"
    if unit == "ratio_to_baseline":
        return f"{value:g} ×"
    if unit == "batches":
        return f"{value:g} batches"
    if unit == "targets":
        return f"{value:g} targets"
    return f"{value:g}"


def value_template(check: Check) -> str:
    """A Prometheus template rendering the alert's ``$value`` in the check's unit."""
    unit = check.unit
    if unit == "ratio":
        return "{{ $value | humanizePercentage }}"
    if unit in ("seconds", "ratio_to_baseline"):
        # For baseline checks $value is the left-hand side of `value > k * baseline`: a time.
        return "{{ $value | humanizeDuration }}"
    if unit == "usd":
        return '{{ $value | printf "%.3f" }} USD'
    return "{{ $value | humanize }}"


def summary(check: Check, value: float) -> str:
    return SUMMARIES[check.alert].format(threshold=threshold_text(check, value))


def description(check: Check, value: float) -> str:
    word = "below" if check.op == "<" else "above"
    limit = threshold_text(check, value)
    if check.baseline:
        baseline = RULES_BY_NAME[check.baseline].help.rstrip(".")
        limit = f"{value:g} × the baseline ({baseline[0].lower()}{baseline[1:]})"
    return f"{check.meaning} Now {value_template(check)}; the alert fires {word} {limit}."
