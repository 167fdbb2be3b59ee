"""lab.family: scenarios continued from one shared, forked start read exactly as their own runs.

The scenario matrix runs its presets this way (tests/e2e/conftest.py), so what it proves holds
only if a member's run is the run it would have had alone: every checkpoint's evaluation and
groups payload, every scraped series, every KV batch and record. The family runs in a fresh
worker process, as the matrix's do (a fork copies only the calling thread; pytest's own process
may have others).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from fleet.scenarios import Scenario, parse_scenario
from fleet.topology import load_topology
from lab.family import Member, can_fork, families, run_family
from lab.harness import ScenarioRun, run_through_exporter
from prefixscope import catalog

TOPOLOGY = load_topology().with_workers(3)


def _scenario(name: str, **extra: Any) -> Scenario:
    return parse_scenario({"name": name, "description": "a short run", "fault": "see below", "fault_at_s": 60,
                           "duration_s": 120, "expected_step": None, "expected_alerts": [],
                           "workload": {"chat_sessions_per_s": 1.0, "doc_per_s": 0, "extract_per_s": 0},
                           **extra})


MEMBERS = [
    Member(_scenario("family-healthy"), checkpoints=(45.0, 120.0)),
    Member(_scenario("family-drops", actions=[
        {"at": 60, "action": "set_knob", "workers": ["w1"], "knob": "drop_kv_events", "value": 0.5},
        {"at": 75, "action": "fail", "workers": ["w2"], "restore_after": 20}]), 135.0, (45.0, 135.0)),
    Member(_scenario("family-broken", actions=[
        {"at": 60, "action": "set_knob", "workers": ["w0"], "knob": "spec_acceptance", "value": 0.5}]),
        checkpoints=(45.0, 120.0)),  # its finish fails
]


def _reading(run: ScenarioRun, _cpu_s: float = 0.0, _wall_s: float = 0.0) -> dict[str, Any]:
    """Everything a row reads of a run, as plain data."""
    if run.scenario.name == "family-broken":
        raise KeyError("a reading that fails")
    return {
        "scenario": run.scenario.name,
        "checkpoints": {t: (ev.verdict, {k: (r.status, r.value, r.baseline) for k, r in ev.results.items()}, groups)
                        for t, (ev, groups) in run.checkpoints.items()},
        # the scraper times its own scrapes on the real clock: the one series no two runs share
        "history": (run.history.times, {k: v for k, v in run.history.series.items()
                                        if not k.startswith(f"{catalog.NAMESPACE}_scrape_duration_seconds")}),
        "kv": (run.kv_batches_sent, run.kv_batches_lost, run.kv_timeline),
        "records": run.result.records,
        "health": run.health.snapshot()[0],
    }


def _in_family() -> tuple[list[dict | BaseException], bool]:
    return run_family(MEMBERS, TOPOLOGY, _reading), can_fork()


@pytest.fixture(scope="module")
def alone() -> dict[str, dict]:
    out = {}
    for m in MEMBERS[:2]:
        out[m.scenario.name] = _reading(run_through_exporter(m.scenario, TOPOLOGY, duration_s=m.duration_s,
                                                             checkpoints=m.checkpoints))
    return out


def test_a_family_member_reads_as_its_own_run(alone: dict[str, dict]) -> None:
    assert len(families(MEMBERS)) == 1
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got, forked = pool.submit(_in_family).result()
    assert forked  # the worker process runs one thread: the members continued from forks
    healthy, drops, broken = got
    assert healthy == alone["family-healthy"]
    assert drops == alone["family-drops"]
    assert drops["kv"][1]  # the fault happened after the shared start: batches were lost
    assert isinstance(broken, KeyError) and "fails" in str(broken)  # its own failure, nobody else's
