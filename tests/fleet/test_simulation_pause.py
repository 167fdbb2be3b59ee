"""A simulation paused before a moment and continued, as itself or as a scenario sharing its start,
is the same run as one that never paused (records, engine samples, events, caches)."""

from __future__ import annotations

import pytest

from fleet.clock import VirtualClock
from fleet.scenarios import Scenario, parse_scenario
from fleet.simulation import SimResult, Simulation, requests_digest
from fleet.topology import load_topology

TOPOLOGY = load_topology().with_workers(3)


def _scenario(name: str, **extra: object) -> Scenario:
    return parse_scenario({"name": name, "description": "a short run", "fault": "see below", "fault_at_s": 60,
                           "duration_s": 150, "expected_step": None, "expected_alerts": [],
                           "workload": {"chat_sessions_per_s": 1.0, "doc_per_s": 0, "extract_per_s": 0}, **extra})


# three scenarios with the same first minute: none changes anything before it
HEALTHY = _scenario("same-start-healthy")
KNOB = _scenario("same-start-knob", actions=[
    {"at": 60, "action": "set_knob", "workers": ["w1"], "knob": "spec_acceptance", "value": 0.4},
    {"at": 90, "action": "reset_cache", "workers": ["w0"]}])
DRAIN = _scenario("same-start-drain", actions=[{"at": 75, "action": "drain", "workers": ["w2"], "restore_after": 30}])


def _sim(sc: Scenario, duration_s: float | None = None) -> Simulation:
    return Simulation(sc, TOPOLOGY, clock=VirtualClock(), duration_s=duration_s, sample_every_s=15.0)


def _same(a: SimResult, b: SimResult) -> None:
    assert a.records == b.records
    assert a.samples == b.samples
    assert a.events == b.events
    assert a.placements == b.placements and a.evictions == b.evictions
    for name, eng in a.engines.items():
        other = b.engines[name]
        assert (eng.cache.resident_blocks, eng.counters) == (other.cache.resident_blocks, other.counters), name


def test_a_run_paused_and_run_on_is_the_run_that_never_paused() -> None:
    whole = _sim(KNOB).run()
    paused = _sim(KNOB)
    paused.pause_before(60.0)
    assert paused.records and all(r["ts"] - paused.start < 60.0 for r in paused.records)
    assert [s.t for s in paused.samples] == [0.0, 15.0, 30.0, 45.0]  # the scrape at 60 s is the fault's
    _same(paused.run(), whole)


@pytest.mark.parametrize("other", [KNOB, DRAIN], ids=lambda s: s.name)
def test_continuing_as_a_scenario_that_shares_the_start_is_that_scenario_s_run(other: Scenario) -> None:
    shared = _sim(HEALTHY)
    shared.pause_before(60.0)
    shared.continue_as(other, duration_s=165.0)
    got = shared.run()
    assert got.scenario is other
    _same(got, _sim(other, duration_s=165.0).run())


def test_scenarios_that_change_the_start_cannot_continue_it() -> None:
    assert requests_digest(HEALTHY, 60.0) == requests_digest(KNOB, 60.0)
    other_workload = _scenario("busier", workload={"chat_sessions_per_s": 2.0, "doc_per_s": 0, "extract_per_s": 0})
    assert requests_digest(HEALTHY, 60.0) != requests_digest(other_workload, 60.0)
    early = _scenario("early", actions=[{"at": 30, "action": "reset_cache", "workers": ["w0"]}])
    # a later workload phase moves the stream's draws before it: the requests differ before the fault
    phased = _scenario("phased", fault_workload={"extract_per_s": 0.05})
    cases = [(other_workload, "its workload differs"), (early, "changes the fleet at 30 s, before the pause"),
             (phased, "requests before 60 s differ")]
    for sc, why in cases:
        sim = _sim(HEALTHY)
        sim.pause_before(60.0)
        with pytest.raises(ValueError, match=why):
            sim.continue_as(sc)
    with pytest.raises(ValueError, match="needs a run paused"):
        _sim(HEALTHY).continue_as(KNOB)
