"""Generated rule files: structure, naming, annotations, and freshness of the committed copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alerts import generate, promtests, rules
from prefixscope import thresholds as config
from prefixscope.catalog import BURN_WINDOWS, CHECKS, CHECKS_BY_ALERT, RECORDING_RULES

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "alerts" / "generated"
TH = config.load()


def _rules() -> dict:
    return yaml.safe_load((GEN / "prefixscope.rules.yaml").read_text(encoding="utf-8"))


def test_committed_files_are_fresh(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--check"]) == 0, capsys.readouterr().err


def test_check_lists_stale_files_when_thresholds_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load((ROOT / "alerts" / "thresholds.yaml").read_text(encoding="utf-8"))
    data["checks"]["prefix_hit_rate_total"]["value"] = 0.5
    changed = tmp_path / "thresholds.yaml"
    changed.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert generate.main(["--check", "--thresholds", str(changed)]) == 1
    err = capsys.readouterr().err
    assert "stale: alerts/generated/prefixscope.rules.yaml" in err
    assert "stale: docs/metrics.md" in err
    assert "stale: alerts/generated/prefixscope.prometheusrule.yaml" in err
    assert "stale: alerts/generated/grafana-alerting.yaml" in err
    # The threshold line of the hit-rate panel moves with the config.
    assert "stale: dashboards/generated/diagnosis_chain.json" in err
    assert "prefix_tree.json" not in err


def test_catalogue_rules_are_well_formed() -> None:
    assert rules.recording_rule_problems() == []
    assert rules.alert_problems() == []


def test_division_before_aggregation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = rules.RECORDING_RULES[0].__class__(
        record="cluster:bad_ratio:ratio_rate5m", expr="rate(a_total[5m]) / sum (rate(b_total[5m]))", group=1,
        help="bad")
    monkeypatch.setattr(rules, "RECORDING_RULES", (bad,))
    assert rules.recording_rule_problems() == [
        "cluster:bad_ratio:ratio_rate5m: 'rate(a_total[5m])' is divided before it is aggregated "
        "(sum numerator and denominator first, so shards and workers pool)"]


def test_recording_rules_come_first_in_catalogue_order() -> None:
    groups = _rules()["groups"]
    assert groups[0]["name"] == "prefixscope.recording"
    assert [r["record"] for r in groups[0]["rules"]] == [r.record for r in RECORDING_RULES]


def _alert_names() -> list[str]:
    """Catalogue order by step; an SLO has one rule per burn-rate pair under the same name."""
    return [c.alert for c in sorted(CHECKS, key=lambda c: c.group) for _ in (BURN_WINDOWS if c.slo else [None])]


def test_every_alert_has_labels_and_annotations() -> None:
    alerts = [r for g in _rules()["groups"][1:-1] for r in g["rules"]]
    assert [a["alert"] for a in alerts] == _alert_names()
    th = config.load()
    for a in alerts:
        check = next(c for c in CHECKS if c.alert == a["alert"])
        assert a["alert"].startswith("Prefix")
        tier = {"burn_tier"} if check.slo else set()
        assert set(a["labels"]) == {"severity", "step"} | tier and a["labels"]["step"] == str(check.group)
        ann = a["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}
        assert ann["summary"].endswith(".") and "{{" not in ann["summary"]
        assert "{{ $value" in ann["description"]
        assert ann["runbook_url"] == th.runbook_url(a["alert"])
        assert ann["dashboard_url"].startswith(th.dashboard_url_base + "prefixscope-diagnosis-chain?viewPanel=")
        assert a["for"] == th.checks[check.threshold].for_
    severities = {(a["alert"], a["labels"]["severity"]) for a in alerts}
    for slo in ("PrefixHitRateSloBurn", "PrefixSessionHitRateSloBurn", "PrefixMissCostSloBurn"):
        assert {(slo, "critical"), (slo, "warning")} <= severities  # pages and tickets


def test_the_watchdog_always_fires_in_its_own_group() -> None:
    meta = _rules()["groups"][-1]
    assert meta["name"] == "prefixscope.meta"
    (dog,) = meta["rules"]
    assert dog["alert"] == "PrefixWatchdog" and dog["expr"] == "vector(1)" and dog["labels"] == {"severity": "none"}
    assert set(dog["annotations"]) == {"summary", "description", "runbook_url"}


# Every recording rule that pools exported series is withheld while a family shard is missing.
SHARD_GUARD = (" unless on (cluster) (max by (cluster) (prefixscope_exporter_shards) - "
               "count by (cluster) (count by (cluster, shard) (prefixscope_exporter_shards)) > 0)")


def test_alert_expressions() -> None:
    by_name = {r["alert"]: r for g in _rules()["groups"][1:] for r in g["rules"]}
    assert by_name["PrefixHitRateLow"]["expr"] == (
        "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m < 0.6")
    assert by_name["PrefixColdPrefillSlow"]["expr"] == (
        "max by (cluster) (prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline) > 3")
    assert by_name["PrefixRouterTreeWalkSlow"]["expr"].endswith("> 0.005")
    # per scope: a cluster whose exporter vanished while others report, or none at all
    assert by_name["PrefixExporterDown"]["expr"] == (
        "(max by (cluster) (max_over_time(prefixscope_exporter_build_info[1h])) unless "
        "max by (cluster) (prefixscope_exporter_build_info)) or absent(prefixscope_exporter_build_info) "
        "or vector(0) > 0")
    # per-worker checks alert per worker
    assert by_name["PrefixTelemetryKvEventsStale"]["expr"] == (
        "max by (cluster, worker) (time() - prefixscope_kv_event_last_timestamp_seconds) > 120")
    assert by_name["PrefixCacheNearCapacity"]["expr"].startswith("max by (cluster, worker) (")
    records = {r["record"]: r["expr"] for r in _rules()["groups"][0]["rules"]}
    # the baseline is the long window ending where the current window begins, per prompt class, over
    # its healthy windows only (the plain one where none is left)
    assert records["prompt_class:prefixscope_cold_prefill_seconds:p99_baseline"] == (
        "(histogram_quantile(0.99, sum by (cluster, le, model, prompt_class) "
        "(avg_over_time(prompt_class:prefixscope_cold_prefill_seconds_bucket:rate5m_healthy[1d] offset 5m))) or "
        "histogram_quantile(0.99, sum by (cluster, le, model, prompt_class) "
        "(rate(prefixscope_cold_prefill_seconds_bucket[1d] offset 5m))))" + SHARD_GUARD)
    assert records["prompt_class:prefixscope_cold_prefill_seconds_bucket:rate5m_healthy"] == (
        "(sum by (cluster, le, model, prompt_class) (rate(prefixscope_cold_prefill_seconds_bucket[5m])) "
        "unless on (cluster, model, prompt_class) "
        "(prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline > 3 "
        "or prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_budget > 1))" + SHARD_GUARD)
    # the absolute budgets come from the threshold file, one constant per prompt class
    assert records["prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_budget"] == (
        "prompt_class:prefixscope_cold_prefill_seconds:p99_5m / on (prompt_class) group_left () ("
        'label_replace(vector(1), "prompt_class", "0-1k", "", "") or '
        'label_replace(vector(2.5), "prompt_class", "1k-4k", "", "") or '
        'label_replace(vector(10), "prompt_class", "4k-16k", "", "") or '
        'label_replace(vector(40), "prompt_class", "16k+", "", ""))')
    assert records["cluster:prefixscope_session_hit_ratio_below_0_8:share"] == (
        '(sum by (cluster) (prefixscope_session_hit_ratio_bucket{le="0.8"}) / '
        'sum by (cluster) (prefixscope_session_hit_ratio_bucket{le="+Inf"}))' + SHARD_GUARD)
    assert records["worker:prefixscope_worker_resident_blocks_per_capacity:ratio"] == (
        "(sum by (cluster, worker) (prefixscope_worker_resident_blocks) / on (cluster, worker) "
        "max by (cluster, worker) (prefixscope_worker_capacity_blocks))" + SHARD_GUARD)
    # a rule that reads only other rules inherits their absence
    assert records["prompt_class:prefixscope_cold_prefill_seconds_p99:ratio_baseline"] == (
        "prompt_class:prefixscope_cold_prefill_seconds:p99_5m / prompt_class:prefixscope_cold_prefill_seconds:p99_baseline")
    # one alert per missing shard (seen within the hour, gone now, of the plan its peers run), else per scope
    assert by_name["PrefixExporterShardDown"]["expr"] == (
        "count by (cluster, shard) ((max by (cluster, shard) (max_over_time(prefixscope_exporter_shards[1h])) "
        "unless on (cluster, shard) prefixscope_exporter_shards) == on (cluster) group_left "
        "max by (cluster) (prefixscope_exporter_shards)) or on (cluster) (max by (cluster) "
        "(prefixscope_exporter_shards) - count by (cluster) (count by (cluster, shard) "
        "(prefixscope_exporter_shards))) > 0")


def test_no_scope_labels_leaves_the_catalogue_expressions_as_written() -> None:
    data = yaml.safe_load((ROOT / "alerts" / "thresholds.yaml").read_text(encoding="utf-8"))
    data["scope_labels"] = []
    th = config.parse(data)
    assert rules.alert_rule(next(c for c in CHECKS if c.key == "exporter_up"), th, "u")["expr"] == (
        "absent(prefixscope_exporter_build_info) or vector(0) > 0")
    data["scope_labels"] = ["cluster", "router_domain"]
    th = config.parse(data)
    stale = rules.alert_rule(next(c for c in CHECKS if c.key == "kv_event_staleness"), th, "u")
    assert stale["expr"].startswith("max by (cluster, router_domain, worker) (")


def test_slo_alerts_are_multiwindow_multi_burn_rate_tiers() -> None:
    slo = [r for g in _rules()["groups"][1:] for r in g["rules"] if r["alert"] == "PrefixSessionHitRateSloBurn"]
    e = "cluster:prefixscope_slo_session_hit_rate_errors:ratio_rate"
    # budget 15%: pages at 6 and 4 × 15%, tickets at 2 and 1 ×, over the workbook's window pairs
    assert [(r["expr"], r["labels"]["severity"], r["labels"]["burn_tier"]) for r in slo] == [
        (f"{e}1h > 0.9 and {e}5m > 0.9", "critical", "page_1h"),
        (f"{e}6h > 0.6 and {e}30m > 0.6", "critical", "page_6h"),
        (f"{e}1d > 0.3 and {e}2h > 0.3", "warning", "ticket_1d"),
        (f"{e}3d > 0.15 and {e}6h > 0.15", "warning", "ticket_3d")]
    assert "exceed 4 × the 15% error budget (60%)" in slo[1]["annotations"]["description"]
    miss = [r for g in _rules()["groups"][1:] for r in g["rules"] if r["alert"] == "PrefixMissCostSloBurn"]
    assert [r["expr"].split(" and ")[0] for r in miss] == [
        "cluster:prefixscope_slo_prefix_miss_cost_errors:ratio_rate1h > 0.72",
        "cluster:prefixscope_slo_prefix_miss_cost_errors:ratio_rate6h > 0.2",
        "cluster:prefixscope_slo_prefix_miss_cost_errors:ratio_rate1d > 0.15",
        "cluster:prefixscope_slo_prefix_miss_cost_errors:ratio_rate3d > 0.05"]
    records = {r["record"]: r["expr"] for r in _rules()["groups"][0]["rules"]}
    # (an SLO's error ratio is not withheld while a shard is missing: a dead shard never silences a page)
    assert records["cluster:prefixscope_slo_prefix_miss_cost_errors:ratio_rate1h"] == (
        "(sum by (cluster) (rate(prefixscope_missed_requests_total[1h])) - "
        "sum by (cluster) (rate(prefixscope_missed_requests_within_baseline_total[1h]))) / "
        "sum by (cluster) (rate(prefixscope_missed_requests_total[1h]))")
    # the engines' own counters are enough for one SLO
    engine = [r for g in _rules()["groups"][1:] for r in g["rules"] if r["alert"] == "PrefixHitRateSloBurn"]
    assert len(engine) == 4 and records["cluster:prefixscope_slo_prefix_hit_rate_errors:ratio_rate3d"] == (
        "(sum by (cluster) (rate(prefixscope_prefix_cache_queried_tokens_total[3d])) - "
        "sum by (cluster) (rate(prefixscope_prefix_cache_hit_tokens_total[3d]))) / "
        "sum by (cluster) (rate(prefixscope_prefix_cache_queried_tokens_total[3d]))")


@pytest.mark.parametrize("alert", [c.alert for c in CHECKS if c.slo is not None])
def test_hours_of_burn_open_a_ticket_or_page_in_the_generated_promtool_cases(alert: str) -> None:
    """Every SLO: 8 hours at 1.2 × the budget's pace open a ticket and page nobody; a 5 × burn
    pages (a budget of 20 % or more has no 5 × burn: its fastest burns page instead)."""
    tests = yaml.safe_load((GEN / "prefixscope.rules.test.yaml").read_text(encoding="utf-8"))["tests"]
    mine = [t["alert_rule_test"][0] | {"name": t["name"]} for t in tests if t["name"].startswith(f"{alert}: an 8-hour")]
    slow, fast = mine
    assert slow["name"] == f"{alert}: an 8-hour burn at 1.2 × opens a ticket and pages nobody"
    assert slow["eval_time"] == fast["eval_time"] == "480m"
    assert [(a["exp_labels"]["burn_tier"], a["exp_labels"]["severity"], a["exp_labels"]["cluster"])
            for a in slow["exp_alerts"]] == [("ticket_3d", "warning", "sick")]
    check = CHECKS_BY_ALERT[alert]
    entry = TH.checks[check.threshold]
    reachable = 5 * (1 - entry.value) < 1
    assert fast["name"].startswith(f"{alert}: an 8-hour burn at 5 ×") == reachable
    tiers = {a["exp_labels"]["burn_tier"]: a["exp_labels"]["severity"] for a in fast["exp_alerts"]}
    assert tiers.get("page_6h") == "critical" and {"ticket_1d", "ticket_3d"} <= set(tiers), tiers
    assert {a["exp_labels"]["cluster"] for a in fast["exp_alerts"]} == {"sick"}


def test_configured_window_drives_every_generated_rule(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "alerts" / "thresholds.yaml").read_text(encoding="utf-8"))
    data["window"], data["baseline_window"] = "10m", "2d"
    th = config.parse(data)
    files = generate.build(th)
    rule_file = files[GEN / "prefixscope.rules.yaml"]
    exprs = [r["expr"] for g in yaml.safe_load(rule_file)["groups"] for r in g["rules"]
             if not r.get("record", "").startswith("cluster:prefixscope_slo_")]
    assert not [e for e in exprs if "[5m]" in e] and any("[10m]" in e for e in exprs)
    assert any("[2d] offset 10m" in e for e in exprs) and not [e for e in exprs if "[1d]" in e]
    # the SLO burn windows are the workbook's, not the rate window; rule names keep their suffix
    assert "[30m]" in rule_file and "[6h]" in rule_file and ":ratio_rate5m" in rule_file
    slo_short = "cluster:prefixscope_slo_session_hit_rate_errors:ratio_rate5m"
    assert "sum by (cluster) (rate(prefixscope_session_followup_prompt_tokens_total[5m]))" in yaml.safe_load(rule_file)[
        "groups"][0]["rules"][[r.record for r in RECORDING_RULES].index(slo_short)]["expr"]
    assert yaml.safe_load(files[GEN / "prefixscope.prometheusrule.yaml"])["spec"] == yaml.safe_load(rule_file)
    grafana_exprs = [d["model"].get("expr", "") for g in yaml.safe_load(files[GEN / "grafana-alerting.yaml"])["groups"]
                     for r in g["rules"] for d in r["data"]]
    assert not [e for e in grafana_exprs if "[5m]" in e] and any("[10m]" in e for e in grafana_exprs)
    for path, text in files.items():
        if path.suffix == ".json":  # dashboards: every rate over the configured window
            assert "[5m]" not in text, path
    assert "sum by (cluster) (increase(prefixscope_kv_index_repairs_total[10m]))" in files[ROOT / "docs" / "metrics.md"]
    # and the generated promtool cases still build for the new window
    assert promtests.test_file(th, generate.RULES_FILE, {c.alert: "u" for c in CHECKS})["tests"]


def test_prometheusrule_wraps_the_same_groups() -> None:
    manifest = yaml.safe_load((GEN / "prefixscope.prometheusrule.yaml").read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == "prefixscope"
    assert manifest["spec"] == _rules()


def test_generated_promtool_tests_cover_every_alert_both_ways() -> None:
    tests = yaml.safe_load((GEN / "prefixscope.rules.test.yaml").read_text(encoding="utf-8"))["tests"]
    for check in CHECKS:
        mine = [t for t in tests if t["alert_rule_test"][0]["alertname"] == check.alert]
        fired = [t for t in mine if t["alert_rule_test"][0]["exp_alerts"]]
        silent = [t for t in mine if not t["alert_rule_test"][0]["exp_alerts"]]
        if check.slo is not None:  # no tier, then each tier with those below it; then hours of burn
            assert [len(t["alert_rule_test"][0]["exp_alerts"]) for t in mine][:5] == [0, 1, 2, 3, 4], check.alert
            assert mine[1]["alert_rule_test"][0]["exp_alerts"][0]["exp_labels"]["severity"] == "warning"
            continue
        assert len(fired) == 1 and len(silent) == 1, check.alert
        exp = fired[0]["alert_rule_test"][0]["exp_alerts"][0]
        assert "{{" not in exp["exp_annotations"]["description"]
