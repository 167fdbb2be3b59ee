"""The diagnosis chain from Prometheus results: statuses, verdict, symptom and reuse (pure)."""

from __future__ import annotations

from console.chain import NO_DATA, Reuse, chain_from_prometheus, reuse_reading
from console.limits import limits_from_file
from prefixscope.catalog import CHECKS, SIGNALS
from prefixscope.thresholds import load_thresholds

ALL_SIGNALS = dict.fromkeys(SIGNALS, True)
# Healthy: a ratio well above its floor, anything else at 0; a floor in seconds (cache retention:
# idle time before eviction) is met by minutes.
HEALTHY = {c.key: (0.95 if c.op == "<" else 0.0) for c in CHECKS} | {
    c.key: 600.0 for c in CHECKS if c.op == "<" and c.unit == "seconds"}
TH = limits_from_file(load_thresholds())
GOOD_REUSE = Reuse(0.9, 0.9, 0.9)


def firing(*alerts: str) -> list[dict]:
    return [{"labels": {"alertname": a, "severity": "warning"}, "state": "firing"} for a in alerts]


def chain(values=None, alerts=(), signals=None, baselines=None, reuse=GOOD_REUSE):
    return chain_from_prometheus(HEALTHY | (values or {}), baselines or {}, ALL_SIGNALS | (signals or {}),
                                 list(alerts), TH, reuse)


def test_healthy_cluster_has_no_verdict() -> None:
    c = chain(baselines={"cold_prefill_time_p99": 1.0, "slo_prefix_miss_cost": 1.0})
    assert c.verdict is None
    assert [s.status for s in c.steps] == ["ok"] * 6


def test_falling_hit_rate_alone_is_a_symptom_not_a_verdict() -> None:
    c = chain({"prefix_hit_rate_total": 0.41}, firing("PrefixHitRateLow", "PrefixSessionHitRateSloBurn"))
    assert c.symptom is not None and c.symptom.status == "firing" and c.symptom.value == 0.41
    assert c.verdict is None
    assert c.steps[1].status == "ok"


def test_verdict_is_the_first_step_whose_cause_fires() -> None:
    c = chain({"sticky_session_collision_rate": 0.12, "moe_expert_alignment_rate": 0.3},
              firing("PrefixHitRateLow", "PrefixMoeExpertMisaligned", "PrefixStickyCollisionsHigh"))
    assert c.verdict is not None and c.verdict.number == 2
    assert [x.check.key for x in c.verdict.firing_causes] == ["sticky_session_collision_rate"]
    assert c.steps[5].status == "firing"


def test_missing_signal_is_not_instrumented_even_if_the_value_looks_bad() -> None:
    c = chain({"async_prefill_wait_time_p99": 0.0}, signals={"async_prefill": False})
    state = next(x for x in c.steps[3].checks if x.check.key == "async_prefill_wait_time_p99")
    assert state.status == "not_instrumented" and state.missing == ("async_prefill",)


def test_absent_signal_series_counts_as_missing() -> None:
    c = chain_from_prometheus(HEALTHY, {}, {}, [], TH, Reuse(None, None, None))
    assert all(s.status == "not_instrumented" for s in c.steps[1:])
    # targets_up needs no signal: it has a value, so step 0 is measured.
    assert c.steps[0].status == "ok"


def test_no_value_is_not_instrumented_not_zero() -> None:
    c = chain({"prefix_tree_walk_latency": None})
    state = next(x for x in c.steps[4].checks if x.check.key == "prefix_tree_walk_latency")
    assert (state.status, state.value, state.missing) == ("not_instrumented", None, (NO_DATA,))


def test_over_threshold_without_firing_alert_is_pending() -> None:
    c = chain({"prefix_tree_walk_latency": 0.009})
    state = next(x for x in c.steps[4].checks if x.check.key == "prefix_tree_walk_latency")
    assert state.status == "ok" and state.pending and state.breaches


def test_baseline_checks_compare_the_ratio() -> None:
    # the cold p99 of the window is 4× the long-window baseline of its prompt class: 4× > 3×.
    c = chain({"cold_prefill_time_p99": 4.0}, firing("PrefixColdPrefillSlow"))
    state = next(x for x in c.steps[3].checks if x.check.key == "cold_prefill_time_p99")
    assert abs(state.value - 4.0) < 1e-9 and state.threshold == 3.0 and state.status == "firing"
    assert c.verdict is not None and c.verdict.number == 3


def test_reuse_reading_tells_workload_routing_and_stale_index_apart() -> None:
    assert reuse_reading(Reuse(0.30, 0.25, 0.25), TH).startswith("Workload:")
    assert reuse_reading(Reuse(0.80, 0.75, 0.40), TH).startswith("Stale index:")
    routing = Reuse(0.80, 0.42, 0.40)
    assert reuse_reading(routing, TH).startswith("Routing: 80% was reusable somewhere but only 40%")
    assert abs(routing.routing_regret - 0.40) < 1e-9
    assert reuse_reading(Reuse(0.80, 0.72, 0.70), TH).startswith("Reuse is healthy")
    assert reuse_reading(Reuse(None, None, None), TH).startswith("Not instrumented")
