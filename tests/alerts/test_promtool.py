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
