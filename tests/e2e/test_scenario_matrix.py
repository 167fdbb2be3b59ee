"""The acceptance matrix: every fault scenario of the SPEC ends in the right alert and diagnosis.

Each preset of fleet/scenarios runs on the virtual clock through the exporter's real adapters
(KV events on vLLM's wire format, rendered worker /metrics through the scraper, NDJSON records
through the intake); the exporter's /metrics, as the real collector renders it every 15 s,
goes through Prometheus's own rule engine (``promtool test rules``) with the generated rules.
See docs/scenario-matrix.md for what is asserted and why.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleet.scenarios import load_preset, parse_scenario, preset_names
from fleet.topology import load_topology
from lab.harness import ScrapeHistory, duration_seconds, run_through_exporter, series_key, settled_duration
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds
from tests.e2e.harness import (
    BackfilledPrometheus,
    Row,
    allowed_alongside,
    discover,
    expanded,
)
from tests.support import require_tool

# The SPEC's acceptance matrix: scenario -> the step the chain must name (None: healthy).
SPEC_MATRIX: dict[str, int | None] = {
    "healthy": None,
    "cache-pressure": 1,
    "timestamp-in-system-prompt": 1,
    "hash-mod-reshuffle": 2,
    "autoscaling": 2,
    "session-key-churn": 2,
    "warm-pool-saturation": 2,
    "worker-failures": 2,
    "slow-gpu-long-prompts": 3,
    "async-prefill-backlog": 3,
    "slow-tree-walk": 4,
    "topology-blind-placement": 4,
    "cross-node-migration-storm": 4,
    "spec-decode-drift": 5,
    "moe-expert-misalignment": 5,
    "affinity-blind-batching": 5,
    "dropped-kv-events": 0,
}

SCENARIOS = preset_names()
# Scenarios whose verdict the product does not get right yet: strict, so a fix turns them red
# until the mark goes. Each reason says what happens and where the fix belongs.
KNOWN_WRONG: dict[str, str] = {
}


def _row(rows: dict[str, Row | BaseException], scenario: str) -> Row:
    row = rows[scenario]
    if isinstance(row, BaseException):
        pytest.fail(f"{scenario} could not be replayed: {type(row).__name__}: {row}")
    return row


def _params() -> list:
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[n])) if n in KNOWN_WRONG else n
            for n in SCENARIOS]


def test_every_spec_scenario_has_a_preset_with_its_step() -> None:
    assert sorted(SCENARIOS) == sorted(SPEC_MATRIX)
    for name, step in SPEC_MATRIX.items():
        sc = load_preset(name)
        assert sc.expected_step == step, name
        assert bool(sc.expected_alerts) == (step is not None), name


@pytest.mark.slow  # the whole matrix takes two to three minutes on two cores
@pytest.mark.parametrize("scenario", _params())
def test_prometheus_fires_the_expected_alerts_and_nothing_unrelated(scenario: str, matrix_rows: dict) -> None:
    row = _row(matrix_rows, scenario)
    assert row.confirmed, f"promtool did not confirm the firing sets:\n{row.promtool_output}"
    for alert, step in row.warmup_firing | row.firing:  # the rule files label each alert with its catalogue step
        assert step == str(catalog.CHECKS_BY_ALERT[alert].group), (alert, step)
    assert not row.warmup_firing, f"alerts fired before the fault: {sorted(row.warmup_firing)}\n{row.describe()}"
    names = {a for a, _step in row.firing}
    if row.expected_step is None:
        assert names == set(), row.describe()
        return
    missing = set(row.expected_alerts) - names
    assert not missing, f"expected alerts did not fire: {sorted(missing)}\n{row.describe()}"
    # a preset's side effects are of its step or later (the preset loader checks): never the verdict
    unrelated = names - allowed_alongside(row.expected_step) - set(load_preset(scenario).side_effects)
    assert not unrelated, f"alerts of other steps fired: {sorted(unrelated)}\n{row.describe()}"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", _params())
def test_the_chain_names_the_expected_step(scenario: str, matrix_rows: dict) -> None:
    row = _row(matrix_rows, scenario)
    verdicts = {
        "exporter (checks.py)": row.exporter_verdict,
        "console from /api/v1/groups": row.console_exporter_verdict,
        "console from Prometheus": row.console_prometheus_verdict,
    }
    wrong = {k: v for k, v in verdicts.items() if v != row.expected_step}
    assert not wrong, f"expected step {row.expected_step}, got {wrong}\n{row.describe()}"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_exporter_measures_what_the_fleet_did(scenario: str, matrix_rows: dict) -> None:
    """Every windowed ratio the exporter derives from its inputs equals the fleet's own recount
    from its records and engine counters over the same five minutes (window edges aside)."""
    row = _row(matrix_rows, scenario)
    wrong = []
    for key, (truth, measured) in row.truth.items():
        if truth is None or measured is None:
            # the fleet counts an empty share as 0 where the exporter says "no data" (e.g. no
            # router prediction under a hash policy); a missing value is only wrong the other way
            if measured is None and truth:
                wrong.append(f"{key}: fleet {truth:.4g}, exporter missing")
            continue
        if measured != pytest.approx(truth, rel=0.1, abs=0.01):
            wrong.append(f"{key}: fleet {truth:.4g}, exporter {measured:.4g}")
    assert not wrong, "\n".join(wrong)


# ---- steady state: every preset after a warm-up of healthy traffic, caches full ------------------
# The exporter's verdict (exporter.core.checks.evaluate over a state fed through the real inputs) just
# before the fault must be all clear, and at the end of the fault it must name the expected step.
# The evaluation is instantaneous (no `for`): a check past its threshold counts at once.
# Presets whose steady-state verdict is wrong today: strict, so a fix turns them red until the
# mark goes; each reason names the cause.
KNOWN_WRONG_STEADY: dict[str, str] = {
}


def _steady_params() -> list:
    # raises=AssertionError: only a wrong verdict is the known failure; a run that breaks is an error
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_WRONG_STEADY[n]))
            if n in KNOWN_WRONG_STEADY else n for n in SCENARIOS]


@pytest.mark.slow  # 17 presets after 15 simulated minutes each: ~4 minutes of CPU on two worker processes
@pytest.mark.timeout(3600)  # the first test waits for every row: no wall-clock budget a loaded box misses
@pytest.mark.parametrize("scenario", _steady_params())
def test_steady_state_all_clear_before_the_fault_and_the_expected_step_during_it(scenario: str,
                                                                                  steady_rows: dict) -> None:
    row = steady_rows[scenario]
    if isinstance(row, BaseException):
        pytest.fail(f"{scenario} could not be run after the warm-up: {type(row).__name__}: {row}")
    if scenario == "healthy":  # the warm-up did its job: every cache is full
        assert min(row["cache_fill"].values()) > 0.9, row["cache_fill"]
    warm, fault = row["warmup"], row["fault"]
    assert warm["verdict"]["step"] is None, f"not all clear after the warm-up, before the fault: {warm}"
    assert fault["verdict"]["step"] == row["expected_step"], f"expected step {row['expected_step']}, got {fault}"


# ---- the exporter's own numbers against a real Prometheus over the same scrapes --------------------
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["healthy", "dropped-kv-events"])
def test_exporter_check_values_agree_with_prometheus(scenario: str, tmp_path: Path) -> None:
    """/api/v1/groups says it computes the catalogue's PromQL over its own windows; Prometheus,
    querying the scraped history, must read the same numbers (rate extrapolation and window edges
    aside) at the moment the chain is read."""
    require_tool("prometheus"), require_tool("promtool")
    sc = load_preset(scenario)
    start = float(int(time.time() - 2 * 3600) // 900 * 900)  # recent, on the scrape grid
    run = run_through_exporter(sc, load_topology(), start=start, checkpoints=[sc.duration_s])
    ev, _groups = run.checkpoints[sc.duration_s]
    prom = BackfilledPrometheus(run.history, start, tmp_path)
    compared, disagree = [], []
    try:
        for key, res in ev.results.items():
            check = res.check
            exprs = [("value", check.value, res.value)]
            if check.baseline is not None:
                exprs.append(("baseline", check.baseline, res.baseline))
            for what, expr, mine in exprs:
                theirs = prom.query(expanded(expr), start + sc.duration_s)
                if mine is None or theirs is None:
                    if (mine is None) != (theirs is None):
                        disagree.append(f"{key} {what}: exporter {mine}, Prometheus {theirs}")
                    continue
                compared.append(key)
                if theirs != pytest.approx(mine, rel=0.1, abs=0.01):
                    disagree.append(f"{key} {what}: exporter {mine:.4g}, Prometheus {theirs:.4g}")
    finally:
        prom.close()
    assert not disagree, "\n".join(disagree)
    assert len(compared) >= 12, compared  # most checks have data in both scenarios


# ---- the harness's own pieces, by hand ------------------------------------------------------------
def test_scrape_history_writes_missing_and_stale_points_for_promtool() -> None:
    h = ScrapeHistory(15.0)
    h.add(0.0, {"a": 1.0})
    h.add(15.0, {"a": 2.5, 'b{w="x"}': 7.0})
    h.add(30.0, {'b{w="x"}': float("nan")})
    h.add(45.0, {})
    assert h.input_series() == [
        {"series": "a", "values": "1.0 2.5 stale _"},
        {"series": 'b{w="x"}', "values": "_ 7.0 NaN stale"},
    ]
    assert h.openmetrics(start=1000.0).splitlines() == [
        "a 1.0 1000.000", "a 2.5 1015.000", 'b{w="x"} 7.0 1015.000', 'b{w="x"} NaN 1030.000', "# EOF"]


def test_scrape_history_refuses_uneven_scrapes() -> None:
    h = ScrapeHistory(15.0)
    h.add(0.0, {"a": 1.0})
    h.add(20.0, {"a": 1.0})
    with pytest.raises(ValueError, match=r"scrape 1 at 20\.0s"):
        h.input_series()


def test_series_keys_sort_and_escape_labels() -> None:
    assert series_key("m", {}) == "m"
    assert series_key("m", {"z": "1", "a": 'q"\\'}) == 'm{a="q\\"\\\\",z="1"}'


def test_durations_and_settled_run_length() -> None:
    assert duration_seconds("0m") == 0 and duration_seconds("1h30m") == 5400 and duration_seconds("15s") == 15
    th = load_thresholds()
    moe = load_preset("moe-expert-misalignment")  # PrefixMoeExpertMisaligned: for 10m
    # fault 300 s + window 300 s + for 600 s + two scrapes, on the 15 s grid
    assert settled_duration(moe, th, 15.0) == 300 + 300 + 600 + 30
    # healthy runs as long as the slowest cause alert would need
    assert settled_duration(load_preset("healthy"), th, 15.0) == 1230


def test_promtool_failure_report_is_read_per_window() -> None:
    output = """  FAILED:
    expr: "group by (alertname, step) (max_over_time(ALERTS{alertstate=\\"firing\\", alertname!=\\"PrefixWatchdog\\"}[300s]))", time: 5m,
        exp: nil
        got: {alertname="PrefixHitRateLow", step="1"} 1E+00
    expr: "group by (alertname, step) (max_over_time(ALERTS{alertstate=\\"firing\\", alertname!=\\"PrefixWatchdog\\"}[930s]))", time: 20m30s,
        exp: nil
        got: {alertname="A", step="2"} 1E+00, {alertname="B", step="0"} 1E+00
"""
    assert discover(output, [(0.0, 300.0), (300.0, 1230.0)]) == {
        (0.0, 300.0): {("PrefixHitRateLow", "1")}, (300.0, 1230.0): {("A", "2"), ("B", "0")}}
    assert discover("error: yaml: line 3: mapping values are not allowed", [(0.0, 300.0)]) is None


def test_unrelated_alerts_are_those_of_other_steps_that_name_a_cause() -> None:
    allowed = allowed_alongside(2)
    assert {"PrefixStickyCollisionsHigh", "PrefixWarmPoolSaturated", "PrefixSessionMigrationsHigh"} <= allowed
    assert {"PrefixHitRateLow", "PrefixSessionHitRateSloBurn", "PrefixMissCostSloBurn"} <= allowed  # symptom, SLOs
    assert "PrefixSessionHitRateLow" in allowed  # the effect of stickiness is a step-2 check
    assert "PrefixTelemetryTargetDown" not in allowed and "PrefixCacheNearCapacity" not in allowed


# ---- the harness feeds the exporter as the live wire would ----------------------------------------
def _expected_stream_health(timeline: list[tuple[int, bool]]) -> tuple[int, int, int]:
    """(gaps, missed batches, restarts) a subscriber must count for one worker's batches.

    Lost batches show up only when a later batch of the same process arrives (a gap of that many);
    lost batches before a process's first delivered batch look like joining late, not a gap;
    a sequence back at 0 after delivered batches is a restart.
    """
    gaps = missed = restarts = 0
    pending, seen, prev_seq = 0, False, -1
    for seq, delivered in timeline:
        if seq <= prev_seq:  # a new process
            pending = 0
            if seen:
                restarts += delivered  # noticed only if its batch arrives ...
                seen = seen and not delivered
        prev_seq = seq
        if not delivered:
            pending += 1
            continue
        if seen and pending:
            gaps, missed = gaps + 1, missed + pending
        pending, seen = 0, True
    return gaps, missed, restarts


def test_kv_stream_health_matches_what_the_publishers_lost() -> None:
    sc = parse_scenario({
        "name": "kv-faults", "description": "partial KV-event loss and a worker restart", "fault": "see actions",
        "fault_at_s": 60, "duration_s": 240, "expected_step": 0, "expected_alerts": ["PrefixTelemetryKvEventGaps"],
        "workload": {"chat_sessions_per_s": 1.0},
        "actions": [
            {"at": 60, "action": "set_knob", "workers": ["w1", "w2"], "knob": "drop_kv_events", "value": 0.3},
            {"at": 120, "action": "fail", "workers": ["w3"], "restore_after": 20},
        ],
    })
    run = run_through_exporter(sc, load_topology(), checkpoints=[240.0])
    counters = run.health.snapshot()[0]

    def counted(metric: str, worker: str) -> float:
        return counters.get(f"{catalog.NAMESPACE}_{metric}", {}).get((worker,), 0.0)

    assert run.kv_batches_lost.get("w1", 0) > 10 and run.kv_batches_lost.get("w2", 0) > 10  # the fault bit
    restarted = 0
    for worker, timeline in run.kv_timeline.items():
        gaps, missed, restarts = _expected_stream_health(timeline)
        assert counted("kv_event_sequence_gaps", worker) == gaps, worker
        assert counted("kv_event_missed_batches", worker) == missed, worker
        assert counted("worker_restarts", worker) == restarts, worker
        restarted += restarts
    assert restarted == 1  # w3 came back and published again
    # A worker whose every batch arrived: the exporter's view holds exactly the engine's blocks.
    assert all(delivered for _seq, delivered in run.kv_timeline["w0"])
    assert run.state.index.resident_blocks("w0") == run.result.engines["w0"].cache.resident_blocks
    ev, _groups = run.checkpoints[240.0]
    assert ev.results["kv_event_gaps"].status == "firing"
