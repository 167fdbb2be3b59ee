"""Scenarios that share their healthy start, replayed through the exporter with one warm-up between them.

Most presets differ only from their fault on: before it they run the same fleet, router and
workload. :func:`run_family` runs that shared start once (:class:`lab.harness.Replay` paused just
before the earliest fault), then, for each scenario, forks the paused process and lets the child
continue as that scenario to its end (:meth:`fleet.simulation.Simulation.continue_as`) and hand
back what ``finish`` makes of the run. The fork is the snapshot: the child starts from the exact
state of the simulated fleet and of the exporter, nothing is copied by hand. Continuing is the
same as running the scenario from the start; ``tests/fleet/test_simulation_pause.py`` and
``tests/e2e/test_family.py`` hold that.

:func:`families` groups scenarios by what their runs share before the pause: configuration
and the request stream itself (by digest). Without ``os.fork``, or with other threads running
in the process (a fork copies only the calling thread), every scenario runs on its own instead.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fleet.scenarios import Scenario
from fleet.simulation import requests_digest, shared_prefix_problems
from fleet.topology import Topology
from lab.harness import Replay, ScenarioRun

R = TypeVar("R")
Finish = Callable[[ScenarioRun, float, float], R]  # (the run, its own CPU seconds, its own wall seconds)


@dataclass(frozen=True)
class Member:
    """One scenario of a family: how long it runs and the checkpoints it reads."""

    scenario: Scenario
    duration_s: float | None = None  # default: the scenario's own
    checkpoints: tuple[float, ...] = ()

    @property
    def end_s(self) -> float:
        return self.scenario.duration_s if self.duration_s is None else self.duration_s


def first_change(sc: Scenario) -> float:
    """When ``sc`` first changes its fleet (its fault, or an earlier action)."""
    return min([sc.fault_at_s, *(a.at for a in sc.actions)])


def start_key(sc: Scenario, pause_at: float | None = None, seed: int | None = None) -> tuple:
    """What a run up to its pause (default: its first change) depends on besides its requests:
    the pause itself, router, pool, seed and first workload. Cheap; :func:`family_key` adds the
    requests."""
    t = first_change(sc) if pause_at is None else pause_at
    return (t, sc.policy, sc.initial_workers, sc.workload, tuple(sorted(sc.router.items())),
            sc.seed if seed is None else seed)


def family_key(m: Member, pause_at: float | None = None, seed: int | None = None, block_size: int = 16) -> tuple:
    """Members with equal keys share everything before their pause: :func:`start_key` and the
    requests up to it (by digest)."""
    sc = m.scenario
    key = start_key(sc, pause_at, seed)
    return (*key, requests_digest(sc, key[0], m.end_s, seed, block_size))


def families(members: Sequence[Member], seed: int | None = None, block_size: int = 16) -> list[list[Member]]:
    """``members`` grouped by :func:`family_key` (each paused at its first change), order kept."""
    groups: dict[tuple, list[Member]] = {}
    for m in members:
        groups.setdefault(family_key(m, seed=seed, block_size=block_size), []).append(m)
    return list(groups.values())


def run_families(members: Sequence[Member], topology: Topology, finish: Finish[R], *, seed: int | None = None,
                 **replay: Any) -> list[R | BaseException]:
    """:func:`run_family` over each of the :func:`families` of ``members``; results in ``members``' order."""
    out: dict[int, R | BaseException] = {}
    for family in families(members, seed=seed, block_size=topology.block_size):
        for m, r in zip(family, run_family(family, topology, finish, seed=seed, **replay), strict=True):
            out[id(m)] = r
    return [out[id(m)] for m in members]


@dataclass
class _Outcome(Generic[R]):
    value: R | None = None
    error: BaseException | None = None


def can_fork() -> bool:
    """A fork copies only the calling thread: safe when it is the only one."""
    return hasattr(os, "fork") and threading.active_count() == 1


def run_family(family: Sequence[Member], topology: Topology, finish: Finish[R], *,
               pause_at: float | None = None, **replay: Any) -> list[R | BaseException]:
    """``finish(run, cpu_s, wall_s)`` for each member, in order; a member whose run fails gives its
    exception. ``cpu_s`` and ``wall_s`` are the member's own part (after the shared warm-up).

    ``replay`` are :class:`lab.harness.Replay`'s keywords (``scrape_every_s``, ``thresholds_path``,
    ``keep_history`` …). The members must share everything before ``pause_at`` (default: the
    first member's first change; see :func:`families`); ``finish`` runs in the child and its
    result must pickle.
    """
    if not family:
        return []
    if len(family) == 1 or not can_fork():
        return [_alone(m, topology, finish, replay) for m in family]
    t = first_change(family[0].scenario) if pause_at is None else pause_at
    for m in family:
        if problems := shared_prefix_problems(family[0].scenario, m.scenario, t):
            raise ValueError(f"{m.scenario.name} is not of {family[0].scenario.name}'s family: {'; '.join(problems)}")
    lead = family[0]
    run = Replay(lead.scenario, topology, duration_s=lead.duration_s,
                 checkpoints=sorted({c for m in family for c in m.checkpoints}), **replay)
    run.pause_before(t)
    out: list[R | BaseException] = []
    for m in family:
        def go(m: Member = m) -> R:
            cpu, wall = time.process_time(), time.perf_counter()
            run.continue_as(m.scenario, m.duration_s, m.checkpoints)
            return finish(run.finish(), time.process_time() - cpu, time.perf_counter() - wall)
        out.append(_in_child(go))
    run.feed.close()
    run.sim.close()
    return out


def _alone(m: Member, topology: Topology, finish: Finish[R], replay: dict[str, Any]) -> R | BaseException:
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        run = Replay(m.scenario, topology, duration_s=m.duration_s, checkpoints=m.checkpoints, **replay).finish()
        return finish(run, time.process_time() - cpu, time.perf_counter() - wall)
    except Exception as exc:
        return exc


def _in_child(work: Callable[[], R]) -> R | BaseException:
    """``work()`` in a forked child; its result (or exception) comes back pickled through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            os.close(read)
            try:
                outcome: _Outcome = _Outcome(value=work())
            except Exception as exc:
                outcome = _Outcome(error=exc)
            try:
                data = pickle.dumps(outcome)
            except Exception as exc:  # an unpicklable result or exception: say what it was
                data = pickle.dumps(_Outcome(error=RuntimeError(f"{outcome!r:.2000} did not pickle: {exc}")))
            with os.fdopen(write, "wb") as f:
                f.write(data)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return RuntimeError(f"the forked run (pid {pid}) ended without a result (wait status {status})")
    got: _Outcome = pickle.loads(data)
    return got.error if got.error is not None else got.value  # type: ignore[return-value]
