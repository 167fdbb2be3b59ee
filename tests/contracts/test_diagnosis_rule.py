"""One diagnosis rule: the exporter and the console colour the chain the same way.

For the same check values and signals, the exporter's evaluation (what /api/v1/groups says),
the console's chain built from that payload, and the console's chain built from Prometheus
(recording-rule values and the alerts that fire) give the same status for every step and the
same verdict. The values are fed in under the exporter's expression evaluator, so everything
from a value to the verdict runs the real code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.chain import Reuse, chain_from_exporter, chain_from_prometheus
from console.limits import limits_from_groups
from exporter.core import checks
from exporter.core.health import Health
from exporter.core.state import ClusterState, Series
from exporter.web import api
from prefixscope import diagnosis
from prefixscope.catalog import CHECKS, CHECKS_BY_ALERT, SIGNALS, STEPS
from prefixscope.thresholds import CheckThreshold, load_thresholds

# Every `for` at 0 s: a check past its limit has fired, in the exporter's breach record as in the
# Prometheus alerts below, so the instantaneous evaluation and both chains describe the same alerts.
TH = replace(load_thresholds(), checks={k: CheckThreshold(c.value, "0s", c.severity)
                                        for k, c in load_thresholds().checks.items()})
SYMPTOM = CHECKS_BY_ALERT["PrefixHitRateLow"]
ALL_SIGNALS = frozenset(SIGNALS)


def _ok_value(check) -> float:
    thr = TH.value(check)
    return thr + abs(thr) + 1.0 if check.op == "<" else thr / 2.0


def _firing_value(check) -> float:
    thr = TH.value(check)
    return thr / 2.0 if check.op == "<" else thr + abs(thr) + 1.0


# Two checks may share a value expression (the session hit rate and its SLO): values are per expression.
def _values_by_expr(values: Mapping[str, float | None], baselines: Mapping[str, float | None]) -> dict:
    by_expr: dict[str, float | None] = {}
    for check in CHECKS:
        if check.key in values:
            by_expr[check.value] = values[check.key]
        if check.baseline is not None and check.key in baselines:
            by_expr[check.baseline] = baselines[check.key]
    return by_expr


def three_chains(values: Mapping[str, float | None], baselines: Mapping[str, float | None],
                 signals: frozenset[str], monkeypatch: pytest.MonkeyPatch):
    """The exporter's evaluation, the console from its /api/v1/groups, the console from Prometheus."""
    by_expr = _values_by_expr(values, baselines)
    state = ClusterState.build(Health(), TH, window_s=300, clock=lambda: 200.0)
    monkeypatch.setattr(state, "series", lambda: Series(signals={s: s in signals for s in SIGNALS}))
    monkeypatch.setattr(checks._Evaluator, "value", lambda self, expr: by_expr.get(expr))
    ev = checks.evaluate(state)
    groups = api.groups(state)
    from_exporter = chain_from_exporter(groups)
    # Prometheus: recording rules give the values (absent when a signal is missing: no series),
    # the alerts that fire are the checks over their limit (their `for` elapsed).
    present = {c.key for c in CHECKS if set(c.signals) <= signals}
    prom_values = {c.key: by_expr.get(c.value) if c.key in present else None for c in CHECKS}
    prom_bases = {c.key: by_expr.get(c.baseline) for c in CHECKS if c.baseline is not None}
    alerts = [{"labels": {"alertname": r.check.alert, "severity": "warning"}, "state": "firing"}
              for r in ev.results.values() if r.status == diagnosis.FIRING]
    from_prometheus = chain_from_prometheus(prom_values, prom_bases, {s: s in signals for s in SIGNALS},
                                            alerts, limits_from_groups(groups), Reuse(None, None, None))
    return ev, from_exporter, from_prometheus


def assert_same_chain(ev, *chains) -> tuple[dict[int, str], int | None]:
    exporter_steps = dict(ev.step_status)
    exporter_verdict = ev.verdict["step"] if ev.verdict else None
    for chain in chains:
        assert {s.number: s.status for s in chain.steps} == exporter_steps, chain.source
        assert (chain.verdict.number if chain.verdict else None) == exporter_verdict, chain.source
        if chain.verdict is not None:
            assert [c.check.key for c in chain.verdict.firing_causes] == ev.verdict["checks"], chain.source
    return exporter_steps, exporter_verdict


def all_ok() -> dict[str, float | None]:
    return {c.key: _ok_value(c) for c in CHECKS}


BASELINES = {c.key: 1.0 for c in CHECKS if c.baseline is not None}


def test_only_the_symptom_firing_colours_no_step_and_names_no_verdict(monkeypatch) -> None:
    # the engines' hit-rate SLO reads the symptom's expression: it burns with it
    values = all_ok() | {c.key: _firing_value(SYMPTOM) for c in CHECKS if c.value == SYMPTOM.value}
    ev, *chains = three_chains(values, BASELINES, ALL_SIGNALS, monkeypatch)
    assert ev.results[SYMPTOM.key].status == "firing"
    steps, verdict = assert_same_chain(ev, *chains)
    assert steps == dict.fromkeys((s.number for s in STEPS), "ok") and verdict is None


def test_the_symptom_alone_leaves_an_uninstrumented_step_1_uninstrumented(monkeypatch) -> None:
    ev, *chains = three_chains({SYMPTOM.key: _firing_value(SYMPTOM)}, {}, ALL_SIGNALS, monkeypatch)
    steps, verdict = assert_same_chain(ev, *chains)
    assert steps[1] == "not_instrumented" and verdict is None


def test_slo_checks_alone_firing_name_no_verdict(monkeypatch) -> None:
    slos = [c for c in CHECKS if c.kind == "slo"]
    assert slos
    values = all_ok() | {c.key: _firing_value(c) for c in slos}
    for slo in slos:
        # An SLO sharing its value with a cause (session hit rate, target 85% vs 80%) gets a
        # value that breaks the SLO and not the cause.
        for cause in (c for c in CHECKS if c.kind != "slo" and c.value == slo.value):
            lo, hi = sorted((TH.value(slo), TH.value(cause)))
            assert lo < hi and slo.op == cause.op == "<" and TH.value(slo) == hi, (slo.key, cause.key)
            values[slo.key] = values[cause.key] = (lo + hi) / 2
    ev, *chains = three_chains(values, BASELINES, ALL_SIGNALS, monkeypatch)
    assert all(ev.results[c.key].status == "firing" for c in slos)
    steps, verdict = assert_same_chain(ev, *chains)
    assert verdict is None and set(steps.values()) == {"ok"}


def test_context_checks_firing_are_shown_but_name_no_verdict(monkeypatch) -> None:
    """Severity ``info`` in the threshold file makes a check context: a few rejected inputs or a
    deep tree on a healthy cluster must not send the on-call person to step 0 or step 1."""
    context = [c for c in CHECKS if c.key in diagnosis.context_checks(TH.severities)]
    assert {c.key for c in context} == {"ingest_errors", "prefix_tree_depth_p99"}
    sticky = CHECKS_BY_ALERT["PrefixStickyCollisionsHigh"]
    values = all_ok() | {c.key: _firing_value(c) for c in context}
    ev, *chains = three_chains(values, BASELINES, ALL_SIGNALS, monkeypatch)
    assert all(ev.results[c.key].status == "firing" for c in context)
    steps, verdict = assert_same_chain(ev, *chains)
    assert verdict is None and set(steps.values()) == {"ok"}
    assert all(not c.cause and c.context for chain in chains for s in chain.steps for c in s.checks
               if c.check.key in {k.key for k in context})
    # with a real cause firing later in the chain, that cause takes the verdict
    ev, *chains = three_chains(values | {sticky.key: _firing_value(sticky)}, BASELINES, ALL_SIGNALS, monkeypatch)
    assert assert_same_chain(ev, *chains)[1] == 2


def test_mixed_missing_and_ok_is_ok_and_a_later_cause_takes_the_verdict(monkeypatch) -> None:
    sticky = CHECKS_BY_ALERT["PrefixStickyCollisionsHigh"]
    values = all_ok() | {SYMPTOM.key: _firing_value(SYMPTOM), sticky.key: _firing_value(sticky)}
    values["prefix_tree_depth_p99"] = None  # no data for one step-1 cause, the others ok
    ev, *chains = three_chains(values, BASELINES, ALL_SIGNALS, monkeypatch)
    steps, verdict = assert_same_chain(ev, *chains)
    assert steps[1] == "ok" and steps[2] == "firing" and verdict == 2
    assert ev.verdict == {"step": 2, "title": "Affinity", "checks": [sticky.key]}


def test_everything_missing_is_not_instrumented_everywhere(monkeypatch) -> None:
    ev, *chains = three_chains({}, {}, frozenset(), monkeypatch)
    steps, verdict = assert_same_chain(ev, *chains)
    assert set(steps.values()) == {"not_instrumented"} and verdict is None


def _candidates(expr: str) -> list[float | None]:
    out: list[float | None] = [None]
    for c in CHECKS:
        if c.value == expr:
            out += [_ok_value(c), _firing_value(c)]
    return out


EXPRESSIONS = sorted({c.value for c in CHECKS})
BASELINE_EXPRESSIONS = sorted({c.baseline for c in CHECKS if c.baseline is not None})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.fixed_dictionaries({e: st.sampled_from(_candidates(e)) for e in EXPRESSIONS}),
    baselines=st.fixed_dictionaries({e: st.sampled_from([None, 1.0, 2.0]) for e in BASELINE_EXPRESSIONS}),
    missing=st.sets(st.sampled_from(sorted(SIGNALS)), max_size=4),
)
def test_any_values_give_the_same_chain_in_exporter_and_console(values, baselines, missing, monkeypatch) -> None:
    per_check = {c.key: values[c.value] for c in CHECKS}
    per_base = {c.key: baselines[c.baseline] for c in CHECKS if c.baseline is not None}
    with monkeypatch.context() as m:
        ev, *chains = three_chains(per_check, per_base, ALL_SIGNALS - missing, m)
        assert_same_chain(ev, *chains)
