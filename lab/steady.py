"""Steady state: a fault scenario after hours of healthy traffic, read by the exporter's own checks.

A scenario's presets inject their fault five minutes into a fresh fleet, while the caches are
still filling; the diagnosis chain has to hold hours in, with every cache full, too.
:func:`with_warmup` shifts a scenario by a warm-up: the scenario's own healthy workload, router
and fleet run for ``warmup_s`` first, then everything happens as in the preset (fault, actions,
end), ``warmup_s`` later. :func:`run_steady` runs that through the exporter's real inputs
(:func:`lab.harness.run_through_exporter`) and keeps the exporter's evaluation
(:func:`exporter.core.checks.evaluate`) at two moments: just before the fault, and at the end of the
fault (its window filled).

"firing" lists the checks past their threshold at that instant: the exporter evaluates
instantaneously, a check's ``for`` is Prometheus's business (an alert needs it on top).

A long warm-up is cheap enough because only the two evaluations are read: no /metrics page is
rendered per scrape and the tree-statistics pass runs only at the two checkpoints.

``prefixscope steady --scenario NAME [--warmup 2h] [--json]`` runs this (see :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exporter.core.checks import Evaluation
from fleet.scenarios import Scenario, ScenarioError, load_preset
from fleet.topology import Topology, TopologyError, load_topology
from lab.family import Member, run_families
from lab.harness import SCRAPE_EVERY_S, ScenarioRun, run_through_exporter
from prefixscope.diagnosis import FIRING
from prefixscope.durations import parse_duration

DEFAULT_WARMUP = "2h"  # --json without --warmup: caches full, as in production


def with_warmup(scenario: Scenario, warmup_s: float, scrape_every_s: float = SCRAPE_EVERY_S) -> Scenario:
    """``scenario`` preceded by ``warmup_s`` of its own healthy traffic (rounded up to the scrape grid).

    Everything timed (fault, workload phase, actions, end) moves by the warm-up; the pre-fault
    workload, router and pool are the scenario's own, so the warm-up is its healthy fleet.
    """
    if warmup_s < 0:
        raise ValueError(f"warm-up must be ≥ 0, got {warmup_s:g}")
    w = math.ceil(warmup_s / scrape_every_s) * scrape_every_s
    actions = tuple(replace(a, at=a.at + w, until=None if a.until is None else a.until + w) for a in scenario.actions)
    later = tuple((at + w, params) for at, params in scenario.later_workloads)
    return replace(scenario, fault_at_s=scenario.fault_at_s + w, duration_s=scenario.duration_s + w, actions=actions,
                   later_workloads=later)


def phase(ev: Evaluation) -> dict[str, Any]:
    """The exporter's verdict and the checks past threshold at one instant (JSON-ready)."""
    verdict = dict(ev.verdict) if ev.verdict else {"step": None}
    return {"at": ev.evaluated_at, "verdict": verdict,
            "firing": sorted(k for k, r in ev.results.items() if r.status == FIRING)}


@dataclass
class SteadyRun:
    scenario: Scenario  # the preset as given (not shifted)
    warmup_s: float
    warmup: dict[str, Any]  # phase() just before the fault
    fault: dict[str, Any]  # phase() at the end of the fault
    requests: int
    cache_fill: dict[str, float]  # per worker, resident / capacity blocks of its engine at the end
    cpu_s: float
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {"scenario": sc.name, "expected_step": sc.expected_step, "expected_alerts": list(sc.expected_alerts),
                "warmup_s": self.warmup_s, "fault_at_s": self.warmup_s + sc.fault_at_s,
                "end_s": self.warmup_s + sc.duration_s, "warmup": self.warmup, "fault": self.fault,
                "requests": self.requests, "cache_fill": self.cache_fill, "cpu_s": round(self.cpu_s, 2), "wall_s": round(self.wall_s, 2),
                "evaluation": "instantaneous: firing = past threshold now; alerts add their `for` in Prometheus"}


def _grid(t: float, every: float) -> float:
    return math.floor(t / every) * every


def _marks(shifted: Scenario, scrape_every_s: float) -> tuple[float, float]:
    """The two checkpoints: the last scrape strictly before the fault (at the fault's own instant
    its actions have run) and the end of the fault."""
    before = max(0.0, math.ceil(shifted.fault_at_s / scrape_every_s) * scrape_every_s - scrape_every_s)
    return before, _grid(shifted.duration_s, scrape_every_s)


def _steady_run(scenario: Scenario, shifted: Scenario, run: ScenarioRun, cpu_s: float, wall_s: float,
                scrape_every_s: float) -> SteadyRun:
    before, end = _marks(shifted, scrape_every_s)
    fill = {name: round(eng.cache.resident_blocks / eng.spec.num_gpu_blocks, 4)
            for name, eng in run.result.engines.items()}
    return SteadyRun(scenario, shifted.fault_at_s - scenario.fault_at_s, phase(run.checkpoints[before][0]),
                     phase(run.checkpoints[end][0]), len(run.result.records), fill, cpu_s, wall_s)


def run_steady(scenario: Scenario, topology: Topology, warmup_s: float, *, seed: int | None = None,
               thresholds_path: str | Path | None = None, flavour: str = "vllm",
               scrape_every_s: float = SCRAPE_EVERY_S) -> SteadyRun:
    """``scenario`` after ``warmup_s`` of healthy traffic, through the exporter; see the module docstring."""
    cpu, wall = time.process_time(), time.perf_counter()
    shifted = with_warmup(scenario, warmup_s, scrape_every_s)
    run = run_through_exporter(shifted, topology, scrape_every_s=scrape_every_s, flavour=flavour,
                               thresholds_path=thresholds_path, seed=seed,
                               checkpoints=_marks(shifted, scrape_every_s), keep_history=False)
    return _steady_run(scenario, shifted, run, time.process_time() - cpu, time.perf_counter() - wall, scrape_every_s)


def steady_member(scenario: Scenario, warmup_s: float, scrape_every_s: float = SCRAPE_EVERY_S) -> Member:
    """``scenario`` after the warm-up, with its two checkpoints, as a member of a :mod:`lab.family`."""
    shifted = with_warmup(scenario, warmup_s, scrape_every_s)
    return Member(shifted, checkpoints=_marks(shifted, scrape_every_s))


def run_steady_many(scenarios: Sequence[Scenario], topology: Topology, warmup_s: float, *,
                    thresholds_path: str | Path | None = None, flavour: str = "vllm",
                    scrape_every_s: float = SCRAPE_EVERY_S) -> dict[str, SteadyRun | BaseException]:
    """:func:`run_steady` for each scenario, by name (a run that fails gives its exception); the
    scenarios that share their warm-up (:mod:`lab.family`) run it once. A member's ``cpu_s`` and
    ``wall_s`` count its own part after the shared warm-up."""
    original = {sc.name: sc for sc in scenarios}
    members = [steady_member(sc, warmup_s, scrape_every_s) for sc in scenarios]
    shifted = {m.scenario.name: m.scenario for m in members}

    def finish(run: ScenarioRun, cpu_s: float, wall_s: float) -> SteadyRun:
        name = run.scenario.name
        return _steady_run(original[name], shifted[name], run, cpu_s, wall_s, scrape_every_s)

    results = run_families(members, topology, finish, thresholds_path=thresholds_path, flavour=flavour,
                           scrape_every_s=scrape_every_s, keep_history=False)
    return {sc.name: r for sc, r in zip(scenarios, results, strict=True)}


def with_capacity(topology: Topology, divisor: int) -> Topology:
    """Every worker's KV cache ``divisor`` times smaller: caches fill that much sooner (tests)."""
    workers = tuple(replace(w, kv_blocks=max(1, w.kv_blocks // divisor)) for w in topology.workers)
    return replace(topology, workers=workers)


def text_report(r: SteadyRun) -> str:
    def line(name: str, p: dict[str, Any]) -> str:
        step = p["verdict"]["step"]
        return f"  {name:<8} t={p['at']:g} s: verdict {'all clear' if step is None else f'step {step}'}; " \
               f"past threshold: {', '.join(p['firing']) or 'none'}"
    sc = r.scenario
    expected = "all clear" if sc.expected_step is None else f"step {sc.expected_step}"
    return "\n".join([
        f"== {sc.name} after {r.warmup_s:g} s of healthy traffic: {r.requests} requests in {r.cpu_s:.1f} s CPU; "
        f"expected {expected}; caches {min(r.cache_fill.values()):.0%}–{max(r.cache_fill.values()):.0%} full",
        line("warm-up", r.warmup), line("fault", r.fault),
        "  (the exporter evaluates instantaneously: an alert also needs its `for` in Prometheus)"])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixscope steady", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="healthy", help="a preset name or a scenario file (default: %(default)s)")
    p.add_argument("--topology", type=Path, default=None, help="topology file (default: the packaged 8-worker fleet)")
    p.add_argument("--workers", type=int, default=None, help="use the first N workers (or grow the fleet to N)")
    p.add_argument("--warmup", default=DEFAULT_WARMUP,
                   help="healthy traffic before the scenario, a Prometheus duration (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--thresholds", type=Path, default=None, help="thresholds file (default: the packaged one)")
    p.add_argument("--metrics-flavour", choices=("vllm", "vllm-legacy", "sglang"), default="vllm")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        warmup_s = parse_duration(args.warmup)
    except ValueError as exc:
        print(f"prefixscope steady: --warmup: {exc}", file=sys.stderr)
        return 2
    try:
        topology = load_topology(args.topology)
        if args.workers:
            topology = topology.with_workers(args.workers)
        scenario = load_preset(args.scenario)
    except (TopologyError, ScenarioError) as exc:
        print(f"prefixscope steady: {exc}", file=sys.stderr)
        return 2
    r = run_steady(scenario, topology, warmup_s, seed=args.seed, thresholds_path=args.thresholds,
                   flavour=args.metrics_flavour)
    print(json.dumps(r.as_dict(), indent=2) if args.json else text_report(r))
    return 0
