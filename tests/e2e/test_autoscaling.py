"""The ``autoscaling`` preset read moment by moment: the exporter follows the fleet through its
discovery file alone and the chain reads each pool change for what it is.

The preset runs on the virtual clock through the exporter's real inputs (``lab.harness``: the
harness writes the listed workers to a ``file_sd`` file, the exporter's own discovery reads and
relabels it, its FleetFollower applies it). The run is paused at each phase of the story and
the exporter's own evaluation, /api/v1/workers and /metrics are read there:

- the surge, before the first scale-out: the warm pool is saturated (step 2), five workers;
- the scale-out: each new worker is a target and a KV stream from the moment it is listed,
  what it cached before is indexed, and each join is a pool change;
- the scale-in: the workers that left are no target, no KV stream, never blind, "left";
- the rolling restart: the worker being restarted is out, then back with an empty cache;
- at no moment a step-0 verdict, and at the end the reshuffles of hash-mod are step 2.
"""

from __future__ import annotations

import pytest

from exporter.core.checks import evaluate
from exporter.web import api
from fleet.scenarios import load_preset
from fleet.topology import load_topology
from lab.harness import SD_PROVIDER, Replay, exporter_samples
from prefixscope.diagnosis import FIRING

pytestmark = pytest.mark.slow  # a 23-minute story on the virtual clock: ~30 s of CPU


def _firing(replay: Replay) -> tuple[int | None, set[str]]:
    ev = evaluate(replay.state, now=replay.clock.now())
    return (ev.verdict["step"] if ev.verdict else None), {k for k, r in ev.results.items() if r.status == FIRING}


def _liveness(replay: Replay) -> dict[str, str]:
    return {row["worker"]: row["liveness"] for row in api.workers(replay.state)["workers"]}


def _metric(replay: Replay, series: str) -> float | None:
    return exporter_samples(replay.state, replay.health).get(series)


def _targets(replay: Replay) -> set[str]:
    return {t.name for t in replay.feed.scraper.targets}


def test_the_exporter_follows_an_autoscaled_fleet_and_reads_each_change() -> None:
    sc = load_preset("autoscaling")
    replay = Replay(sc, load_topology())
    steps: dict[float, int | None] = {}

    def at(t: float) -> set[str]:
        replay.pause_before(t)
        step, firing = _firing(replay)
        steps[t] = step
        assert _metric(replay, "prefixscope_telemetry_blind_targets") == 0, t
        return firing

    # The surge, one scrape before the first scale-out: the warm pool is full, the pool is five.
    firing = at(655)
    assert "warm_pool_utilization" in firing and steps[655] == 2
    assert _targets(replay) == {"w0", "w1", "w2", "w3", "w4"}
    assert _metric(replay, f'prefixscope_discovery_targets{{provider="{SD_PROVIDER}"}}') == 5
    assert _metric(replay, "prefixscope_worker_pool_size") == 5
    changes = _metric(replay, "prefixscope_worker_pool_changes_total") or 0.0

    # Scale-out: three joins, each a pool change; what the new workers cached is indexed.
    at(800)
    assert _targets(replay) == {f"w{i}" for i in range(8)}
    assert _metric(replay, "prefixscope_worker_pool_size") == 8
    assert (_metric(replay, "prefixscope_worker_pool_changes_total") or 0.0) >= changes + 3
    for w in ("w5", "w6", "w7"):
        assert replay.state.index.resident_blocks(w) == replay.sim.engines[w].cache.resident_blocks, w
    changes = _metric(replay, "prefixscope_worker_pool_changes_total") or 0.0

    # Scale-in when idle: w7 and w6 left — gone from the targets, their streams and the index.
    at(1100)
    left = {"w6", "w7"}
    assert not left & _targets(replay)
    assert {w: _liveness(replay)[w] for w in left} == {"w6": "left", "w7": "left"}
    assert not left & set(replay.feed.subscriber.endpoints)
    assert all(replay.state.index.resident_blocks(w) == 0 for w in left)
    samples = exporter_samples(replay.state, replay.health)
    assert not [k for k in samples if k.startswith(("prefixscope_up{", "prefixscope_kv_event_last_timestamp"))
                and any(f'"{w}"' in k for w in left)]
    assert _metric(replay, "prefixscope_worker_pool_size") == 6
    assert (_metric(replay, "prefixscope_worker_pool_changes_total") or 0.0) >= changes + 2

    # The rolling restart: w0 is out (not blind, not a stream), then back with an empty cache.
    at(1150)
    assert "w0" not in _targets(replay) and _liveness(replay)["w0"] == "left"
    at(1175)
    assert "w0" in _targets(replay) and _liveness(replay)["w0"] == "up"
    assert replay.state.index.resident_blocks("w0") == replay.sim.engines["w0"].cache.resident_blocks

    run = replay.finish()
    ev = evaluate(run.state, now=run.clock.now())
    steps[sc.duration_s] = ev.verdict["step"] if ev.verdict else None
    assert ev.results["sticky_session_collision_rate"].status == FIRING
    assert steps[sc.duration_s] == 2
    assert 0 not in steps.values(), steps  # no step-0 verdict at any moment, whoever left
    assert run.health.snapshot()[0].get("prefixscope_discovery_refresh_failures", {}) == {(SD_PROVIDER,): 0.0}
