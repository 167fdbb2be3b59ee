"""Storylines: the short one's compressed presets, and fresh sessions in every run."""

from __future__ import annotations

import pytest

from fleet.scenarios import load_preset, preset_names
from fleet.storyline import SHORT, SHORT_PHASES, compress, full, runs, short, storyline
from fleet.workloads import WorkloadGenerator


def test_full_is_every_preset_healthy_first() -> None:
    names = [s.name for s in full()]
    assert names[0] == "healthy" and sorted(names) == preset_names() and names[1:] == sorted(names[1:])


def test_short_is_three_faults_along_the_chain_in_under_half_an_hour() -> None:
    scenarios = short()
    assert [s.name for s in scenarios] == list(SHORT)
    assert [s.expected_step for s in scenarios] == [0, 2, 4]
    assert sum(s.duration_s for s in scenarios) == sum(w + f for w, f in SHORT_PHASES.values()) == 1740
    assert [(s.fault_at_s, s.duration_s - s.fault_at_s) for s in scenarios] == list(SHORT_PHASES.values())
    with pytest.raises(ValueError, match="unknown storyline 'nope'"):
        storyline("nope")


def test_compress_scales_the_warm_up_and_keeps_the_fault_s_own_rhythm() -> None:
    sc = load_preset("cross-node-migration-storm")  # drains at 300 and 360, every 120 s, back after 60 s
    c = compress(sc, 120, 180)
    assert (c.fault_at_s, c.duration_s) == (120, 300)
    assert [(a.at, a.every, a.restore_after) for a in c.actions] == [(120, 120, 60), (180, 120, 60)]
    assert compress(load_preset("session-key-churn"), 120, 180).phases()[-1][0] == 120  # with the fault
    late = compress(load_preset("worker-failures"), 60, 30)
    assert all(a.at <= late.duration_s for a in late.actions)


def test_every_run_gets_its_own_seed_so_no_session_key_comes_back() -> None:
    """One seed for all presets made the next run replay the last one's session keys (and first
    prompts) on other, healthy workers: spurious sticky collisions in every healthy warm-up."""
    scenarios = [load_preset("healthy"), load_preset("dropped-kv-events")]
    seeded = list(zip(range(4), runs(scenarios, None, repeat=True), strict=False))
    assert [seed for _, (_, seed) in seeded] == [0, 1, 2, 3]
    assert [seed for _, seed in runs(scenarios, 7, repeat=False)] == [7, 8]
    keys = []
    for _, (sc, seed) in seeded:
        gen = WorkloadGenerator(sc.phases(), 120, seed, 16)
        keys.append({r.session_key for r in gen.requests() if r.session_key})
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert a and not a & b
