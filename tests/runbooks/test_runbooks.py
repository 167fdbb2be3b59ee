"""Every alert has its runbook, with the four sections, real PromQL and a console page to open."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefixscope.catalog import CHECKS, STEPS
from tests.dashboards.promql_names import metric_names, unknown

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "runbooks"
SECTIONS = ["Meaning", "Impact", "Diagnosis", "Mitigation"]
CONSOLE_PAGES = ("Diagnosis chain", "Prefix tree", "Workers & topology", "Alerts")
ALERTS = [c.alert for c in CHECKS]


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_runbook_file_belongs_to_an_alert() -> None:
    files = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README", "diagnosis-chain"}
    assert files == set(ALERTS) | {"PrefixWatchdog"}  # the Watchdog checks the pipeline, not the fleet


@pytest.mark.parametrize("alert", ALERTS)
def test_runbook_structure(alert: str) -> None:
    text = (RUNBOOKS / f"{alert}.md").read_text(encoding="utf-8")
    assert text.splitlines()[0] == f"# {alert}"
    sections = _sections(text)
    assert list(sections) == SECTIONS
    for name, body in sections.items():
        assert len(body.split()) >= 25, f"{alert}: section {name} is too thin"
    diagnosis = sections["Diagnosis"]
    assert any(page in diagnosis for page in CONSOLE_PAGES), f"{alert}: no console page to open"
    queries = re.findall(r"`([^`]+)`", diagnosis)
    used = set().union(*(metric_names(q) for q in queries))
    assert used, f"{alert}: Diagnosis has no PromQL"
    assert {q: unknown(q) for q in queries if unknown(q)} == {}


def test_runbooks_name_the_metrics_of_their_own_check() -> None:
    """A runbook is specific: its Diagnosis queries the check's own value (or its inputs)."""
    from prefixscope.catalog import RULES_BY_NAME

    for check in CHECKS:
        diagnosis = _sections((RUNBOOKS / f"{check.alert}.md").read_text(encoding="utf-8"))["Diagnosis"]
        own = metric_names(check.value)
        for name in list(own):
            if name in RULES_BY_NAME:
                own |= metric_names(RULES_BY_NAME[name].expr)
        assert own & metric_names(diagnosis), check.alert


def test_diagnosis_chain_walks_the_steps_in_order() -> None:
    text = (RUNBOOKS / "diagnosis-chain.md").read_text(encoding="utf-8")
    positions = [text.index(f"## Step {s.number} — {s.title}: ") for s in STEPS]
    assert positions == sorted(positions)
    for alert in ALERTS:
        assert f"]({alert}.md)" in text, alert
    for leg in ("available", "predicted", "achieved"):
        assert f"cluster:prefixscope_reuse_{leg}_tokens_per_prompt_tokens:ratio_rate5m" in text
    assert "symptom" in text and "verdict" in text


def test_readme_index_lists_every_alert() -> None:
    text = (RUNBOOKS / "README.md").read_text(encoding="utf-8")
    for alert in ALERTS:
        assert f"[{alert}]({alert}.md)" in text
