"""Generated rule files: structure, naming, annotations, and freshness of the committed copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alerts import generate, rules
from prefixscope import thresholds as config
from prefixscope.catalog import CHECKS, RECORDING_RULES

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "alerts" / "generated"


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


def test_every_alert_has_labels_and_annotations() -> None:
    alerts = [r for g in _rules()["groups"][1:] for r in g["rules"]]
    assert [a["alert"] for a in alerts] == [c.alert for c in sorted(CHECKS, key=lambda c: c.group)]
    th = config.load()
    for a in alerts:
        check = next(c for c in CHECKS if c.alert == a["alert"])
        assert a["alert"].startswith("Prefix")
        assert set(a["labels"]) == {"severity", "step"} and a["labels"]["step"] == str(check.group)
        ann = a["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}
        assert ann["summary"].endswith(".") and "{{" not in ann["summary"]
        assert "{{ $value" in ann["description"]
        assert ann["runbook_url"] == th.runbook_url(a["alert"])
        assert ann["dashboard_url"].startswith(th.dashboard_url_base + "prefixscope-diagnosis-chain?viewPanel=")
        assert a["for"] == th.checks[check.threshold].for_


def test_alert_expressions() -> None:
    by_name = {r["alert"]: r for g in _rules()["groups"][1:] for r in g["rules"]}
    assert by_name["PrefixHitRateLow"]["expr"] == (
        "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m < 0.6")
    assert by_name["PrefixColdPrefillSlow"]["expr"] == (
        "cluster:prefixscope_cold_prefill_seconds_per_token:p99_5m > 3 * "
        "cluster:prefixscope_warm_prefill_seconds_per_token:p50_1h")
    assert by_name["PrefixRouterTreeWalkSlow"]["expr"].endswith("> 0.005")


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
        assert len(fired) == 1 and len(silent) == 1, check.alert
        exp = fired[0]["alert_rule_test"][0]["exp_alerts"][0]
        assert "{{" not in exp["exp_annotations"]["description"]
