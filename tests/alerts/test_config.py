"""The threshold config loader: good config loads, bad ones name the bad entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alerts import generate
from prefixscope import SCHEMAS_DIR
from prefixscope import thresholds as config
from prefixscope.catalog import CHECKS, rule_threshold_refs

ROOT = Path(__file__).resolve().parents[2]


def _data() -> dict:
    return yaml.safe_load((ROOT / "alerts" / "thresholds.yaml").read_text(encoding="utf-8"))


def _problems(data: dict, runbooks_dir: Path | None = None) -> list[str]:
    with pytest.raises(config.ConfigError) as exc:
        config.parse(data, runbooks_dir=runbooks_dir)
    return exc.value.problems


def test_committed_config_loads_with_the_seed_thresholds() -> None:
    th = config.load(runbooks_dir=config.RUNBOOKS_DIR)
    assert th.checks["prefix_hit_rate_total"].value == 0.60
    assert th.checks["prefix_tree_walk_latency"].value == 0.005
    assert th.checks["cross_node_migration_count_per_minute"].for_ == "2m"
    slo = th.checks["slo_session_hit_rate"]
    assert slo.severity == "critical" and slo.value == 0.85
    assert slo.burn_rates == {"page_1h": 6, "page_6h": 4, "ticket_1d": 2, "ticket_3d": 1}
    assert slo.burn_limit("page_6h") == 0.6 and slo.baseline_factor is None
    assert th.checks["slo_prefix_miss_cost"].burn_rates == {"page_1h": 14.4, "page_6h": 4, "ticket_1d": 3,
                                                            "ticket_3d": 1}  # the workbook's but a 6h page at 4: a 5 x burn pages
    assert th.scope_labels == ("cluster",)
    assert th.checks["slo_prefix_miss_cost"].baseline_factor == 1.5
    assert th.window == "5m" and th.cold_reuse_share == 0.1
    assert th.baseline_window == "1d" and th.baseline_window_s == 86400
    assert set(th.checks) == {c.threshold for c in CHECKS} | set(rule_threshold_refs())
    assert th.runbook_url("PrefixHitRateLow").endswith("/runbooks/PrefixHitRateLow.md")


def test_wrong_type_names_the_entry() -> None:
    data = _data()
    data["checks"]["prefix_hit_rate_total"]["value"] = "high"
    assert _problems(data) == [
        'alerts/thresholds.yaml: checks.prefix_hit_rate_total.value: expected a number, got "high"']


def test_boolean_is_not_a_number() -> None:
    data = _data()
    data["checks"]["kv_event_gaps"]["value"] = True
    assert _problems(data) == ["alerts/thresholds.yaml: checks.kv_event_gaps.value: expected a number, got true"]


def test_unknown_keys_at_every_level() -> None:
    data = _data()
    data["thresholds_extra"] = 1
    data["checks"]["not_a_check"] = {"value": 1, "for": "1m", "severity": "info"}
    data["checks"]["targets_up"]["labels"] = {"team": "x"}
    problems = _problems(data)
    assert len(problems) == 3
    assert problems[0].startswith("alerts/thresholds.yaml: thresholds_extra: unknown field (allowed: schema, window, ")
    assert any("checks.not_a_check: unknown key: no check or recording rule in prefixscope/catalog.py" in p
               for p in problems)
    assert "alerts/thresholds.yaml: checks.targets_up.labels: unknown field (allowed: value, for, severity, burn_rates, baseline_factor, keep_firing_for, budgets)" in problems


def test_missing_entry_names_the_check_and_alert() -> None:
    data = _data()
    del data["checks"]["warm_pool_utilization"]
    assert _problems(data) == [
        "alerts/thresholds.yaml: checks.warm_pool_utilization: missing: the catalogue check "
        "warm_pool_utilization (PrefixWarmPoolSaturated) needs it"]


def test_bad_duration_and_severity() -> None:
    data = _data()
    data["checks"]["ingest_errors"]["for"] = "five minutes"
    data["checks"]["ingest_errors"]["severity"] = "page"
    assert _problems(data) == [
        'alerts/thresholds.yaml: checks.ingest_errors.for: expected a duration like 5m or 1h30m, got "five minutes"',
        'alerts/thresholds.yaml: checks.ingest_errors.severity: expected one of critical, warning, info, got "page"',
    ]


def test_missing_runbook_names_the_file(tmp_path: Path) -> None:
    for check in CHECKS:
        if check.alert != "PrefixTreeTooDeep":
            (tmp_path / f"{check.alert}.md").write_text(f"# {check.alert}\n")
    problems = _problems(_data(), runbooks_dir=tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("alerts/thresholds.yaml: checks.prefix_tree_depth_p99: runbook ")
    assert problems[0].endswith("PrefixTreeTooDeep.md for PrefixTreeTooDeep is missing")


def test_generate_stops_on_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data()
    data["checks"]["prefix_hit_rate_total"]["value"] = "high"
    bad = tmp_path / "thresholds.yaml"
    bad.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert generate.main(["--check", "--thresholds", str(bad)]) == 2
    err = capsys.readouterr().err
    assert 'checks.prefix_hit_rate_total.value: expected a number, got "high"' in err


def test_not_yaml_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "thresholds.yaml"
    bad.write_text("checks: [unclosed\n", encoding="utf-8")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(bad)


def test_every_problem_is_reported_at_once_with_file_and_path() -> None:
    data = _data()
    data["window"] = 5
    data["cold_reuse_share"] = 1.5
    del data["dashboard_url_base"]
    data["runbook_url_base"] = "https://example.com/runbooks"
    data["checks"]["prefix_hit_rate_total"]["value"] = "high"
    del data["checks"]["targets_up"]["severity"]
    data["checks"]["kv_event_gaps"] = "warning"
    assert set(_problems(data)) == {
        "alerts/thresholds.yaml: dashboard_url_base: missing",
        "alerts/thresholds.yaml: window: expected a positive duration like 5m or 1h30m, got 5",
        "alerts/thresholds.yaml: cold_reuse_share: expected a number between 0 and 1, got 1.5",
        'alerts/thresholds.yaml: runbook_url_base: expected a URL ending in /, got "https://example.com/runbooks"',
        'alerts/thresholds.yaml: checks.prefix_hit_rate_total.value: expected a number, got "high"',
        "alerts/thresholds.yaml: checks.targets_up.severity: missing",
        'alerts/thresholds.yaml: checks.kv_event_gaps: expected a mapping, got "warning"',
    }


def test_top_level_must_be_a_mapping() -> None:
    assert _problems([1, 2]) == ["alerts/thresholds.yaml: (top level): expected a mapping, got [1, 2]"]  # type: ignore[arg-type]


@pytest.mark.parametrize("duration", ["1h30m", "90s", "1d", "500ms"])
def test_any_prometheus_duration_is_accepted(duration: str) -> None:
    data = _data()
    data["window"] = duration
    data["baseline_window"] = "1w"  # longer than the window
    data["checks"]["prefix_hit_rate_total"]["for"] = duration
    th = config.parse(data)
    assert th.window == duration and th.checks["prefix_hit_rate_total"].for_ == duration
    if duration == "1h30m":
        assert th.window_s == 5400.0


@pytest.mark.parametrize("duration", ["1.5h", "30m1h", "5 m", "-5m"])
def test_what_is_not_a_prometheus_duration_is_refused(duration: str) -> None:
    data = _data()
    data["window"] = duration
    assert _problems(data) == [f'alerts/thresholds.yaml: window: expected a positive duration like 5m or 1h30m, got "{duration}"']


def test_the_schema_knows_the_severities() -> None:
    schema = json.loads((SCHEMAS_DIR / config.SCHEMA_FILE).read_text())
    assert tuple(schema["$defs"]["check"]["properties"]["severity"]["enum"]) == config.SEVERITIES
    assert schema["properties"]["schema"]["const"] == config.SCHEMA


def test_slo_entries_need_reachable_burn_rates() -> None:
    data = _data()
    # budget 15%: a burn rate above 1 / 0.15 ≈ 6.67 can never happen
    data["checks"]["slo_session_hit_rate"]["burn_rates"] = {"page_1h": 14.4, "page_6h": 6, "ticket_1d": 3,
                                                            "ticket_3d": 1}
    data["checks"]["slo_prefix_miss_cost"]["burn_rates"] = {"page_1h": 2, "page_6h": 6, "ticket_1d": 3,
                                                            "ticket_3d": 1, "email": 1}
    del data["checks"]["slo_prefix_miss_cost"]["baseline_factor"]
    assert set(_problems(data)) == {
        "alerts/thresholds.yaml: checks.slo_session_hit_rate.burn_rates.page_1h: unreachable: with an objective of "
        "0.85 the burn rate is at most 6.67, got 14.4",
        "alerts/thresholds.yaml: checks.slo_prefix_miss_cost.baseline_factor: missing",
        "alerts/thresholds.yaml: checks.slo_prefix_miss_cost.burn_rates.email: unknown field (allowed: page_1h, "
        "page_6h, ticket_1d, ticket_3d)",
        "alerts/thresholds.yaml: checks.slo_prefix_miss_cost.burn_rates: expected factors falling from tier to "
        "tier (page_1h, page_6h, ticket_1d, ticket_3d), got page_1h 2, page_6h 6, ticket_1d 3, ticket_3d 1",
    }


def test_slo_fields_belong_to_slo_entries_and_baseline_window_is_long() -> None:
    data = _data()
    data["checks"]["prefix_hit_rate_total"]["burn_rates"] = {"page_1h": 2, "ticket_3d": 1}
    data["baseline_window"] = "5m"
    problems = _problems(data)
    assert problems == [
        "alerts/thresholds.yaml: baseline_window: expected a window longer than window (5m), got \"5m\"",
        "alerts/thresholds.yaml: checks.prefix_hit_rate_total.burn_rates: unknown key (burn_rates and "
        "baseline_factor belong to SLO entries)",
    ]
