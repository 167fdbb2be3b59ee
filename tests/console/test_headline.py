"""The headline (firing, pending, clear), pending alerts, culprits and the runbook's first step.

The rule is prefixscope.diagnosis.headline, shared by the exporter's /api/v1/groups and the
console; the exporter's breach record turns its instantaneous status into pending or firing as
Prometheus's ``for`` would.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from streamlit.testing.v1 import AppTest

from console.alertmanager import parse_alerts, table_rows
from console.chain import Reuse, chain_from_exporter, chain_from_prometheus
from console.limits import limits_from_file
from console.links import RUNBOOK_DIR
from console.runbook_steps import first_mitigation
from console.settings import EXPORTER_ENV, PROMETHEUS_ENV
from exporter.core.breaches import BreachClock
from exporter.loops.breach_loop import BreachLoop
from exporter.web.api import ApiBuilders
from prefixscope import catalog
from prefixscope.diagnosis import SETTLE_S, headline
from prefixscope.thresholds import load_thresholds as load_exporter_thresholds
from tests.console import cluster
from tests.console.conftest import _serve
from tests.console.test_pages import APP, texts


def test_firing_beats_pending_beats_clear_and_the_step_follows_the_verdict_rule() -> None:
    assert headline({}, ()).state == "clear"
    h = headline({"sticky_session_collision_rate": "pending", "kv_event_staleness": "pending",
                  "prefix_hit_rate_total": "firing"}, (),
                 {"sticky_session_collision_rate": 20.0, "kv_event_staleness": 5.0})
    assert (h.state, h.step, h.checks) == ("firing", None, ("prefix_hit_rate_total",))  # the symptom alone
    h = headline({"sticky_session_collision_rate": "pending", "kv_event_staleness": "pending"}, (),
                 {"sticky_session_collision_rate": 20.0, "kv_event_staleness": 5.0})
    assert (h.state, h.step.number, h.checks, h.fires_in_s) == ("pending", 0, ("kv_event_staleness",), 5.0)
    h = headline({"sticky_session_collision_rate": "firing", "kv_event_staleness": "pending"}, ())
    assert (h.state, h.step.number, h.fires_in_s) == ("firing", 2, None)
    assert headline({"slo_session_hit_rate": "firing"}, ()).state == "clear"  # SLOs do not take the headline
    # A context check (severity info) is shown but never takes the headline's step.
    h = headline({"ingest_errors": "firing", "sticky_session_collision_rate": "pending"}, ("ingest_errors",))
    assert (h.state, h.step.number, h.checks) == ("pending", 2, ("sticky_session_collision_rate",))


def test_every_runbook_has_a_first_mitigation_step() -> None:
    for check in catalog.CHECKS:
        text = (RUNBOOK_DIR / f"{check.alert}.md").read_text(encoding="utf-8")
        assert first_mitigation(text), check.alert
    md = "# X\n## Mitigation\n1. Roll back the\n   template change.\n2. Then this.\n## Next\n"
    assert first_mitigation(md) == "Roll back the template change."
    assert first_mitigation("# X\n## Impact\n- not this\n") is None


def test_the_exporter_turns_a_breach_pending_then_firing_after_its_for() -> None:
    th = load_exporter_thresholds()  # `for: 5m` on both breached checks
    now = [cluster.NOW]
    state = cluster.build_state(th)
    state.clock = lambda: now[0]
    record = BreachClock()
    loop = BreachLoop(state, record)  # the exporter's background evaluation, stepped by hand
    groups = ApiBuilders(state, breaches=record).routes()["groups"]
    loop.evaluate_once()
    first = groups({})
    checks = {c["key"]: c for s in first["steps"] for c in s["checks"]}
    sticky = checks["sticky_session_collision_rate"]
    assert (sticky["status"], sticky["alert_state"], sticky["breaching_since"], sticky["for_s"],
            sticky["fires_in_s"]) == ("firing", "pending", cluster.NOW, 300.0, 300.0)
    assert first["headline"] == {"state": "pending", "step": 2, "title": "Affinity",
                                 "checks": ["sticky_session_collision_rate"], "fires_in_s": 300.0, "settled": []}
    assert first["verdict"]["step"] == 2  # the instantaneous verdict is unchanged
    # Culprits of a breaching check: the sessions that came back on w1 and reused half.
    culprits = sticky["culprits"]
    assert [s["session"] for s in culprits["sessions"]] == ["s0", "s1", "s2"]
    assert {s["worker"] for s in culprits["sessions"]} == {"w1"}
    assert culprits["sessions"][0]["why"] == ("s0: 50.0% of its follow-up tokens cached; the other sessions' "
                                              "median 100.0%")
    # Collisions have no per-worker series, and the shared chain's hits did not change: neither is named.
    assert culprits["workers"] == [] and culprits["prefixes"] == []
    assert checks["prefix_block_count_per_worker"]["culprits"] is None  # within its limit
    now[0] += 300
    later = groups({})  # the record keeps the loop's start: 300 s on, the alert fires
    assert later["headline"]["state"] == "firing" and later["headline"]["fires_in_s"] is None


def test_the_culprits_endpoint_answers_named_checks_and_refuses_unknown_ones() -> None:
    api = ApiBuilders(cluster.build_state()).routes()["culprits"]
    got = api({"checks": "kv_event_staleness,prefix_block_count_per_worker"})["checks"]
    assert set(got) == {"kv_event_staleness", "prefix_block_count_per_worker"}
    # No worker's KV stream departs from the others' (both last sent at 940 s): none is named.
    assert got["kv_event_staleness"]["workers"] == []
    with pytest.raises(ValueError, match="unknown check keys nope"):
        api({"checks": "nope"})


def test_the_console_reads_pending_from_either_source_alike() -> None:
    th = limits_from_file(load_exporter_thresholds())
    raw = {"steps": [{"checks": [{"key": "sticky_session_collision_rate", "value": 0.3, "threshold": 0.05,
                                  "status": "firing", "alert_state": "pending", "fires_in_s": 42.0}]}]}
    exp = chain_from_exporter(raw)
    alerts = [{"labels": {"alertname": "PrefixStickyCollisionsHigh"}, "state": "pending",
               "activeAt": "2024-05-01T10:00:00.123456789Z"}]
    active = 1714557600.123456
    prom = chain_from_prometheus({"sticky_session_collision_rate": 0.3}, {}, {s: True for s in catalog.SIGNALS},
                                 alerts, th, Reuse(None, None, None), {"PrefixStickyCollisionsHigh": 60.0},
                                 now=active + 18)
    for chain, wait in ((exp, 42.0), (prom, 42.0)):
        h = chain.headline
        assert (h.state, h.step.number, h.checks) == ("pending", 2, ("sticky_session_collision_rate",))
        assert h.fires_in_s == pytest.approx(wait, abs=1e-3)


@pytest.fixture
def pending_exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The crafted cluster with the packaged `for: 5m`: its breaches are pending, not firing."""
    for url in _serve(cluster.build_state(load_exporter_thresholds())):
        monkeypatch.setenv(EXPORTER_ENV, url)
        monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
        yield url


def test_a_pending_fault_is_amber_at_the_top_and_on_the_alerts_page(pending_exporter: str) -> None:
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception
    assert not at.error  # nothing has fired yet: no red
    top = at.warning[-1].value
    assert top.startswith("**PENDING** · Verdict: step 2 — Affinity.")
    assert "alert fires in 5 m if it holds" in top, top
    body = texts(at)
    assert "### Step 2 — Affinity · :orange[:material/pending: PENDING]" in body
    assert "**Sessions**: s0: 50.0% of its follow-up tokens cached; the other sessions' median 100.0% (on w1)" in body
    at.switch_page("app_pages/alerts.py").run()
    assert not at.exception
    body = texts(at)
    assert "### PrefixStickyCollisionsHigh · warning · step 2 · 1 pending" in body
    # the symptom, the cause, and the engines' hit-rate SLO the low hit rate breaks
    assert {m.label: m.value for m in at.metric}["Pending alert groups"] == "3"


def test_alertmanager_rows_say_what_inhibits_an_alert() -> None:
    held = parse_alerts([
        {"labels": {"alertname": "PrefixTelemetryKvEventsStale", "step": "0"}, "fingerprint": "aa",
         "status": {"state": "active", "inhibitedBy": [], "silencedBy": []}, "startsAt": "t0"},
        {"labels": {"alertname": "PrefixHitRateLow", "step": "1"}, "fingerprint": "bb",
         "status": {"state": "suppressed", "inhibitedBy": ["aa"], "silencedBy": []}, "startsAt": "t1"},
        {"labels": {"alertname": "PrefixTreeTooDeep", "step": "1"}, "fingerprint": "cc",
         "status": {"state": "suppressed", "inhibitedBy": [], "silencedBy": ["s-1"]}, "startsAt": "t2"},
    ])
    states = {r["alert"]: r["state"] for r in table_rows(held)}
    assert states == {"PrefixTelemetryKvEventsStale": "paging",
                      "PrefixHitRateLow": "inhibited by PrefixTelemetryKvEventsStale (step 0)",
                      "PrefixTreeTooDeep": "silenced (s-1)"}


def test_a_fault_that_ended_leaves_the_headline_once_its_last_minute_settles() -> None:
    """The collisions stopped: over the 5-minute window they still read 15% (past 5%), over the last
    minute none. After SETTLE_S within the limit they no longer hold the headline, while the check
    (and its alert) still fires on its window."""
    state = cluster.build_recovered_state()
    now = [1050.0]
    state.clock = lambda: now[0]
    record = BreachClock()
    loop = BreachLoop(state, record)
    groups = ApiBuilders(state, breaches=record).routes()["groups"]

    def sticky(g: dict) -> dict:
        return next(c for s in g["steps"] for c in s["checks"] if c["key"] == "sticky_session_collision_rate")

    loop.evaluate_once()
    g = groups({})
    assert (g["headline"]["step"], g["headline"]["settled"]) == (2, [])
    assert (sticky(g)["status"], sticky(g)["value"], sticky(g)["settled"]) == ("firing", pytest.approx(0.15), False)
    now[0] += SETTLE_S - 5
    loop.evaluate_once()
    assert groups({})["headline"]["step"] == 2  # not settled yet
    now[0] += 5
    loop.evaluate_once()
    g = groups({})
    assert g["headline"] == {"state": "clear", "step": None, "title": None, "checks": [], "fires_in_s": None,
                             "settled": ["sticky_session_collision_rate"]}
    assert (sticky(g)["status"], sticky(g)["alert_state"], sticky(g)["settled"]) == ("firing", "firing", True)
    assert g["verdict"]["step"] == 2  # the window's instantaneous verdict is unchanged


def test_a_fault_still_under_way_never_settles() -> None:
    """The original cluster: collisions inside the last minute (and, later, none measured at all)."""
    state = cluster.build_state()
    now = [cluster.NOW]
    state.clock = lambda: now[0]
    record = BreachClock()
    loop = BreachLoop(state, record)
    groups = ApiBuilders(state, breaches=record).routes()["groups"]
    for _ in range(4):  # 1 000 s to 1 060 s: the last minute holds collisions, then nothing measured
        loop.evaluate_once()
        assert groups({})["headline"]["step"] == 2
        now[0] += 20


@pytest.fixture
def recovered_exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The recovered cluster served with its breach record advanced past the settle time."""
    state = cluster.build_recovered_state()
    now = [1050.0]
    state.clock = lambda: now[0]
    record = BreachClock()
    loop = BreachLoop(state, record)
    for _ in range(2):
        loop.evaluate_once()
        now[0] += SETTLE_S
    for url in _serve(state, record):
        monkeypatch.setenv(EXPORTER_ENV, url)
        monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
        yield url


def test_the_console_says_which_checks_settled_and_the_alerts_page_reads_the_same_evaluation(
        recovered_exporter: str) -> None:
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception
    assert at.success[-1].value.startswith("**CLEAR**")
    body = texts(at)
    assert ("Settled, no longer the headline: Sticky-session collisions (step 2) — back within the limit over "
            "the last minute for 30 s; the alert clears when the 5-minute window does.") in body
    assert ("**Sticky-session collisions**: 15.0% (alert when > 5.0%) — :red[:material/error: FIRING] · settled: "
            "within its limit over the last minute for 30 s; its alert clears when its 5-minute window does") in body
    at.switch_page("app_pages/alerts.py").run()
    assert not at.exception
    assert "### PrefixStickyCollisionsHigh · warning · step 2 · 1 firing" in texts(at)
