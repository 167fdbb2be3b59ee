"""Dashboards are drawn with the threshold file handed in, and say which panel shows each alert."""

from __future__ import annotations

from dataclasses import replace

from alerts import generate
from prefixscope.catalog import CHECKS, CHECKS_BY_KEY
from prefixscope.thresholds import load_thresholds

CHAIN = generate.ROOT / "dashboards" / "diagnosis_chain.dashboard.py"


def test_every_alert_has_the_panel_that_links_its_runbook() -> None:
    drawn = generate.draw(CHAIN, load_thresholds())
    assert set(drawn.alert_panels) == {c.alert for c in CHECKS}
    panels = {int(p.id): p for p in drawn.dashboard.panels}
    for alert, panel_id in drawn.alert_panels.items():
        assert [link.title for link in panels[panel_id].links] == [f"Runbook: {alert}"], alert


def test_two_drawings_with_two_files_do_not_share_a_threshold() -> None:
    packaged = load_thresholds()
    key = CHECKS_BY_KEY["sticky_session_collision_rate"].threshold
    site = replace(packaged, checks={**packaged.checks, key: replace(packaged.checks[key], value=0.2)})

    def steps(th) -> list:
        drawn = generate.draw(CHAIN, th)
        panel = {int(p.id): p for p in drawn.dashboard.panels}[drawn.alert_panels["PrefixStickyCollisionsHigh"]]
        return panel.extraJson["fieldConfig"]["defaults"]["thresholds"]["steps"]

    assert steps(site)[1]["value"] == 0.2
    assert steps(packaged)[1]["value"] == packaged.checks[key].value  # the site's drawing left nothing behind
