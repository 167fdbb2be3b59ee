"""Every generated dashboard validates, panel by panel, against Grafana's own schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dashboards.common import SCHEMA_VERSION
from prefixscope import thresholds as config
from prefixscope.catalog import CHECKS, STEPS

ROOT = Path(__file__).resolve().parents[2]
GENERATED = sorted((ROOT / "dashboards" / "generated").glob("*.json"))
SCHEMA = json.loads((ROOT / "dashboards" / "schema" / "dashboard.schema.json").read_text(encoding="utf-8"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _strip_nulls(node: Any, key: str = "") -> Any:
    """grafanalib writes null for unset fields, which the TS-derived schema types as absent.

    Threshold step values stay: Grafana types them `number | null` (the base step is null).
    """
    if isinstance(node, dict):
        return {k: _strip_nulls(v, k) for k, v in node.items() if v is not None or (k == "value" and key == "steps")}
    if isinstance(node, list):
        return [_strip_nulls(v, key) for v in node]
    return node


def _validator(definition: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator({**SCHEMA, "$ref": f"#/definitions/{definition}"})


def _errors(validator: jsonschema.Draft7Validator, doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_there_are_three_dashboards() -> None:
    assert [p.stem for p in GENERATED] == ["diagnosis_chain", "prefix_tree", "workers_topology"]


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_dashboard_level_fields_validate(path: Path) -> None:
    doc = _strip_nulls(_load(path))
    doc["panels"] = []  # panels are validated one by one below, for readable errors
    assert _errors(_validator("Dashboard"), doc) == []


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_every_panel_validates(path: Path) -> None:
    panel_v, row_v = _validator("Panel"), _validator("RowPanel")
    problems = []
    for panel in _load(path)["panels"]:
        doc = _strip_nulls(panel)
        # Panel data links are {title, url, targetBlank}; the schema types panel links as
        # dashboard links, so they are checked separately (test_panel_links_are_data_links).
        doc.pop("links", None)
        validator = row_v if panel["type"] == "row" else panel_v
        problems += [f"{panel['title']}: {e}" for e in _errors(validator, doc)]
    assert problems == []


def test_validation_catches_grafanalib_gauge_defect() -> None:
    """The schema is strict enough to reject what ecosystem notes found wrong in grafanalib."""
    from grafanalib import core as g

    gauge = g.GaugePanel(title="x", thresholds=[g.Threshold("green", 0, 0.0)]).to_json_data()
    bad = json.loads(json.dumps(gauge, cls=__import__("grafanalib._gen", fromlist=["x"]).DashboardEncoder))
    assert any("'null' is not of type" in e for e in _errors(_validator("Panel"), _strip_nulls(bad)))


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_house_style(path: Path) -> None:
    doc = _load(path)
    assert doc["uid"] == "prefixscope-" + path.stem.replace("_", "-")
    assert doc["schemaVersion"] == SCHEMA_VERSION >= 39
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names == ["datasource", "cluster", "model", "node", "worker"]  # the scope label (thresholds: scope_labels) first
    for panel in doc["panels"]:
        assert "gridPos" in panel and panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert t["expr"]
        assert panel["type"] in {"timeseries", "stat", "table", "bargauge"}


def test_uids_are_unique() -> None:
    uids = [_load(p)["uid"] for p in GENERATED]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_panel_links_are_data_links(path: Path) -> None:
    for panel in _load(path)["panels"]:
        for link in panel.get("links") or []:
            assert set(link) == {"title", "url", "targetBlank"} and link["url"].startswith("http")


def test_diagnosis_chain_rows_follow_the_steps() -> None:
    doc = _load(ROOT / "dashboards" / "generated" / "diagnosis_chain.json")
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows == [f"{s.dashboard_row}: {s.question}" for s in STEPS]


def test_every_check_has_a_panel_with_threshold_and_runbook() -> None:
    doc = _load(ROOT / "dashboards" / "generated" / "diagnosis_chain.json")
    th = config.load()
    row_of: dict[str, str] = {}
    current = ""
    for p in doc["panels"]:
        if p["type"] == "row":
            current = p["title"]
        else:
            row_of[p["title"]] = current
    by_title = {p["title"]: p for p in doc["panels"]}
    for check in CHECKS:
        panel = by_title[check.title]
        step = next(s for s in STEPS if s.number == check.group)
        assert row_of[check.title].startswith(step.dashboard_row)
        steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        value = th.checks[check.threshold].value
        assert steps[0]["value"] is None and steps[1]["value"] == value
        assert [s["color"] for s in steps] == (["red", "green"] if check.op == "<" else ["green", "red"])
        assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line+area"
        url = th.runbook_url(check.alert)
        assert f"]({url})" in panel["description"]
        assert panel["links"] == [{"title": f"Runbook: {check.alert}", "url": url, "targetBlank": True}]
