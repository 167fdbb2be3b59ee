"""Storylines: the presets the fleet runs one after another (``prefixscope sim --storyline``).

``full`` is every preset at its own length (healthy first, then the faults alphabetically: a
bit over two and a half hours). ``short`` is a few faults along the diagnosis chain, each
compressed to a healthy warm-up and a fault phase of its own length (29 minutes in all). The
lengths follow the 5-minute rate window: a windowed check crosses its line once the fault fills
its share of the window (a mild fault late: the re-keyed sessions' collision share, 6.5 % against
a 5 % line, needs about four minutes) and lingers after the fault until healthy traffic dilutes
the window again (about as long as the window minus that; a p99 stays up while the window holds
more than 1 % slow requests, so the slow walk's lingers the whole window). Each fault lasts until
its alert has fired with a minute to spare (with the demo's threshold profile,
alerts/profiles/demo.yaml), and each warm-up outlasts the previous fault's alerts, so the pass
leaves a quiet gap before every fault (docs/demo.md lists the measured times).

Consecutive runs get consecutive seeds. Every preset seeds its workload with 0, and a new run's
router remembers nothing of the last one: with one seed a session key (and a first prompt) of
the previous run would come back on another, healthy worker, and whoever follows sessions
across the runs (the exporter) would count it as a sticky-session collision.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from fleet.scenarios import Action, Scenario, load_preset, preset_names

STORYLINES = ("short", "full")
# One fault per part of the chain a short pass can show: telemetry (0), affinity (2), router (4),
# each with (seconds of healthy warm-up, seconds of fault) as it needs them (see above).
SHORT_PHASES: dict[str, tuple[float, float]] = {
    "dropped-kv-events": (360.0, 300.0),  # the pass before ended on the slow walk: its p99 holds ~5 min
    "session-key-churn": (240.0, 360.0),
    "slow-tree-walk": (240.0, 240.0),
}
SHORT = tuple(SHORT_PHASES)


def compress(sc: Scenario, warmup_s: float, fault_s: float) -> Scenario:
    """``sc`` with its warm-up squeezed to ``warmup_s`` and its fault phase cut to ``fault_s``.

    Warm-up times scale; fault-phase times keep their distance from the fault (periods and
    restore delays are the fault itself); actions that would start after the end are dropped.
    """
    scale = warmup_s / sc.fault_at_s if sc.fault_at_s else 1.0
    duration = warmup_s + fault_s

    def at(t: float) -> float:
        return t * scale if t < sc.fault_at_s else warmup_s + (t - sc.fault_at_s)

    actions: list[Action] = []
    for a in sc.actions:
        start = at(a.at)
        if start > duration:
            continue
        actions.append(replace(a, at=start, until=None if a.until is None else min(duration, at(a.until))))
    later = tuple((at(t), params) for t, params in sc.later_workloads if at(t) < duration)
    return replace(sc, fault_at_s=warmup_s, duration_s=duration, actions=tuple(actions), later_workloads=later)


def full() -> list[Scenario]:
    scenarios = [load_preset(n) for n in preset_names()]
    return sorted(scenarios, key=lambda s: (s.name != "healthy", s.name))


def short() -> list[Scenario]:
    return [compress(load_preset(n), *SHORT_PHASES[n]) for n in SHORT]


def storyline(name: str) -> list[Scenario]:
    if name == "short":
        return short()
    if name == "full":
        return full()
    raise ValueError(f"unknown storyline {name!r}; choose one of {', '.join(STORYLINES)}")


def runs(scenarios: Sequence[Scenario], seed: int | None, repeat: bool) -> Iterator[tuple[Scenario, int]]:
    """Each run in order (over and over with ``repeat``) with its seed: the scenario's own (or
    ``seed``) for the first run, then one more for each run after it."""
    k = 0
    while True:
        for sc in scenarios:
            yield sc, (sc.seed if seed is None else seed) + k
            k += 1
        if not repeat:
            return
