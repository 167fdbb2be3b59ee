"""The generated rule files pass the real promtool: syntax, and unit tests of every alert."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support import require_tool

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "alerts" / "generated"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_rules_on_the_rule_file() -> None:
    done = _promtool("check", "rules", "prefixscope.rules.yaml", cwd=GEN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_check_rules_on_the_prometheusrule_spec(tmp_path: Path) -> None:
    manifest = yaml.safe_load((GEN / "prefixscope.prometheusrule.yaml").read_text(encoding="utf-8"))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(manifest["spec"]), encoding="utf-8")
    done = _promtool("check", "rules", "spec.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_unit_tests_pass() -> None:
    done = _promtool("test", "rules", "prefixscope.rules.test.yaml", cwd=GEN)
    assert done.returncode == 0, done.stdout + done.stderr


def test_handwritten_unit_tests_pass() -> None:
    here = Path(__file__).resolve().parent
    done = _promtool("test", "rules", "handwritten.test.yaml", cwd=here)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The generated cases are not vacuous: a changed expected description makes promtool fail."""
    tests = yaml.safe_load((GEN / "prefixscope.rules.test.yaml").read_text(encoding="utf-8"))
    fired = next(t for t in tests["tests"] if t["alert_rule_test"][0]["exp_alerts"])
    fired["alert_rule_test"][0]["exp_alerts"][0]["exp_annotations"]["description"] += " (changed)"
    silent = next(t for t in tests["tests"] if not t["alert_rule_test"][0]["exp_alerts"])
    silent["alert_rule_test"][0]["exp_alerts"] = fired["alert_rule_test"][0]["exp_alerts"]
    shutil.copy(GEN / "prefixscope.rules.yaml", tmp_path)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({**tests, "tests": [fired, silent]}), encoding="utf-8")
    done = _promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout.count("FAILED") + done.stderr.count("FAILED") >= 1
    assert "(changed)" in done.stdout + done.stderr


def _run_case(tmp_path: Path, case: dict) -> subprocess.CompletedProcess[str]:
    shutil.copy(GEN / "prefixscope.rules.yaml", tmp_path)
    doc = {"rule_files": ["prefixscope.rules.yaml"], "evaluation_interval": "1m", "tests": [case]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return _promtool("test", "rules", "t.yaml", cwd=tmp_path)


def _firing(alert: str, at: str, labels: dict[str, str]) -> dict:
    """ALERTS as Prometheus keeps it: one firing sample with the alert's labels (or none, with {})."""
    samples = [{"labels": "ALERTS" + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(
        {"alertname": alert, "alertstate": "firing", **labels}.items())) + "}", "value": 1}] if labels else []
    return {"expr": f'ALERTS{{alertname="{alert}", alertstate="firing"}}', "eval_time": at, "exp_samples": samples}


def test_a_stray_kv_batch_during_a_fault_does_not_resolve_the_alert(tmp_path: Path) -> None:
    """keep_firing_for: a silent publisher that sends one stray batch at minute 10 keeps its alert
    (per worker, in its cluster) instead of resolving and firing again; the healthy cluster stays quiet."""
    labels = {"cluster": "a", "severity": "warning", "step": "0", "worker": "w0"}
    case = {
        "interval": "1m",
        "input_series": [
            # silent from the start, one batch received at minute 10, silent again
            {"series": 'prefixscope_kv_event_last_timestamp_seconds{cluster="a", worker="w0"}',
             "values": "0x9 600x20"},
            {"series": 'prefixscope_kv_event_last_timestamp_seconds{cluster="b", worker="w0"}',
             "values": "0+60x30"},
        ],
        "promql_expr_test": [_firing("PrefixTelemetryKvEventsStale", "9m", labels),
                             _firing("PrefixTelemetryKvEventsStale", "12m", labels),
                             _firing("PrefixTelemetryKvEventsStale", "14m", labels)],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr
