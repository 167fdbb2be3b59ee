"""Fault scenarios: named presets (``fleet/scenarios/*.yaml``) and their validation.

A scenario runs a healthy warm-up, then injects its fault at ``fault_at_s``: a change of the
workload (``fault_workload``, and ``later_workloads`` after it), of the router (``fault_router``)
and/or timed fleet ``actions`` (engine knobs, cache resets, failures, drains, scale-out, scale-in,
rolling restarts). Each preset states which diagnosis
step (0–5) it must trip and which alerts of ``prefixscope/catalog.py`` (``expected_step``,
``expected_alerts``); the format is documented in docs/scenarios.md.

The file's shape is ``prefixscope/schemas/scenario.v1.json`` (times are numbers of seconds or
Prometheus durations such as ``90s`` or ``1h30m``); the code adds the checks that span fields
and the catalogue. Invalid files raise :class:`ScenarioError` with every ``file: field:
problem`` line at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fleet.engine import Knobs
from fleet.workloads import WorkloadParams
from prefixscope.catalog import CHECKS_BY_ALERT
from prefixscope.durations import seconds
from prefixscope.validation import InvalidFile, Problems, read_yaml, show

SCHEMA = "prefixscope.scenario/v1"
SCHEMA_FILE = "scenario.v1.json"
PRESET_DIR = Path(__file__).resolve().parent

ACTIONS = ("set_knob", "reset_cache", "fail", "drain", "add_worker", "remove_worker", "restart_worker")
KNOBS = tuple(f.name for f in fields(Knobs))
ROUTER_FIELDS = ("walk_delay_s", "placement", "class_routing", "async_slots", "async_share")


class ScenarioError(InvalidFile):
    """An invalid scenario file; the message lists ``file: field: problem`` lines."""


@dataclass(frozen=True, slots=True)
class Action:
    at: float
    action: str
    workers: tuple[str, ...] = ()
    node: str | None = None  # every worker of the node ("*": every worker of the fleet)
    knob: str | None = None
    value: Any = None
    every: float | None = None  # repeat every this many seconds ...
    until: float | None = None  # ... until this time (default: the end of the run)
    rotate: bool = False  # each repetition takes the next worker of ``workers``
    restore_after: float | None = None  # fail/drain/restart_worker: the worker comes back after this long


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    fault: str
    fault_at_s: float
    duration_s: float
    expected_step: int | None
    expected_alerts: tuple[str, ...]
    # alerts of other checks the fault drags along by its nature (documented, never earlier
    # in the chain than expected_step, so the verdict stays expected_step)
    side_effects: tuple[str, ...] = ()
    policy: str = "topology-aware"
    initial_workers: int | None = None  # active at start (the rest join through add_worker)
    workload: WorkloadParams = field(default_factory=WorkloadParams)
    fault_workload: WorkloadParams | None = None
    # (at, workload) after the fault's: each on top of the one before (a load that ends, say)
    later_workloads: tuple[tuple[float, WorkloadParams], ...] = ()
    router: Mapping[str, Any] = field(default_factory=dict)
    fault_router: Mapping[str, Any] = field(default_factory=dict)
    actions: tuple[Action, ...] = ()
    seed: int = 0
    source: str = "<scenario>"

    def phases(self) -> list[tuple[float, WorkloadParams]]:
        out = [(0.0, self.workload)]
        if self.fault_workload is not None:
            out.append((self.fault_at_s, self.fault_workload))
        return out + list(self.later_workloads)


_WORKLOAD_DEFAULTS = {f.name: f.default for f in fields(WorkloadParams)}


def _time(value: Any) -> float:
    """A validated time field: a number of seconds or a Prometheus duration."""
    return seconds(value, positive=False)


def _workload_value(name: str, value: Any) -> Any:
    """A validated workload field in the type :class:`WorkloadParams` holds."""
    default = _WORKLOAD_DEFAULTS[name]
    if name == "segments":
        return tuple((str(n), float(w)) for n, w in value.items())
    if isinstance(default, tuple):
        return tuple(value)
    if isinstance(default, bool | str):
        return value
    if isinstance(default, int):
        return int(value)
    return _time(value)  # a rate or a time; times may be written as durations


def _workload(problems: Problems, where: str, raw: Any, base: WorkloadParams) -> WorkloadParams:
    raw = raw if isinstance(raw, Mapping) else {}
    for name, value in raw.items():
        if (isinstance(_WORKLOAD_DEFAULTS.get(name), tuple) and name != "segments" and isinstance(value, list)
                and len(value) == 2 and all(isinstance(x, int | float) for x in value) and value[0] > value[1]):
            problems.add(f"{where}.{name}", f"expected [low, high] with low ≤ high, got {show(value)}")
    if problems.has(where):
        return base
    return base.with_overrides({k: _workload_value(k, v) for k, v in raw.items()})


def _router(raw: Any) -> dict[str, Any]:
    out = dict(raw or {})
    if "walk_delay_s" in out:
        out["walk_delay_s"] = _time(out["walk_delay_s"])
    if "async_slots" in out:
        out["async_slots"] = int(out["async_slots"])
    if "async_share" in out:
        out["async_share"] = float(out["async_share"])
    return out


def _actions(problems: Problems, raw: Any, duration: float | None) -> tuple[Action, ...]:
    out = []
    for i, a in enumerate(raw if isinstance(raw, list) else []):
        where = f"actions[{i}]"
        if not isinstance(a, Mapping):
            continue
        if not a.get("workers") and a.get("node") is None:
            problems.add(f"{where}.workers", "name the workers (or a node) the action applies to")
        if problems.has(where):
            continue
        at = _time(a["at"])
        if duration is not None and at > duration:
            problems.add(f"{where}.at", f"must be within the run (duration_s {duration:g}), got {show(a['at'])}")
        value = a.get("value")
        opt = {k: _time(a[k]) if a.get(k) is not None else None for k in ("every", "until", "restore_after")}
        out.append(Action(at=at, action=a["action"], workers=tuple(a.get("workers", ())), node=a.get("node"),
                          knob=a.get("knob"), value=float(value) if _is_number(value) else value,
                          rotate=bool(a.get("rotate", False)), **opt))
    return tuple(out)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _alerts(problems: Problems, where: str, raw: Any, problem: Callable[[str, int], str | None]) -> tuple[str, ...]:
    """A list of catalogue alert names; ``problem(alert, step)`` adds a check of its own."""
    if not isinstance(raw, list):
        return ()
    for i, a in enumerate(raw):
        check = CHECKS_BY_ALERT.get(a) if isinstance(a, str) else None
        if check is None:
            problems.add(f"{where}[{i}]", f"unknown alert {show(a)} (not in prefixscope/catalog.py)")
        elif (msg := problem(a, check.group)) is not None:
            problems.add(f"{where}[{i}]", msg)
    return tuple(raw)


def _checked_time(problems: Problems, data: Mapping[str, Any], key: str, default: float) -> float | None:
    return None if problems.has(key) else _time(data.get(key, default))


def parse_scenario(data: Mapping[str, Any], source: str = "<scenario>") -> Scenario:
    """Validate plain data (``schemas/scenario.v1.json``, then what spans fields); every problem at once."""
    problems = Problems(source)
    problems.check_schema(data, SCHEMA_FILE)
    if not isinstance(data, Mapping):
        problems.raise_if_any(ScenarioError)
    duration = _checked_time(problems, data, "duration_s", 600)
    fault_at = _checked_time(problems, data, "fault_at_s", 0)
    if duration is not None and fault_at is not None and fault_at >= duration:
        problems.add("fault_at_s", f"must be before duration_s ({duration:g}), got {show(data.get('fault_at_s'))}")
    step = None if problems.has("expected_step") else data.get("expected_step")

    def same_step(a: str, group: int) -> str | None:
        return None if step is None or group == step else f"{a} belongs to step {group}, not expected_step {step}"

    def not_earlier(a: str, group: int) -> str | None:
        return (f"{a} is step {group}, before expected_step {step}: it would take the verdict"
                if step is not None and group < step else None)

    alerts = _alerts(problems, "expected_alerts", data.get("expected_alerts", []), same_step)
    if data.get("expected_step") is None and alerts:
        problems.add("expected_alerts", "a scenario without expected_step (healthy) must not expect alerts")
    side = _alerts(problems, "side_effects", data.get("side_effects", []), not_earlier)
    workload = _workload(problems, "workload", data.get("workload"), WorkloadParams())
    fault_workload = None
    if data.get("fault_workload") is not None:
        fault_workload = _workload(problems, "fault_workload", data.get("fault_workload"), workload)
    later: list[tuple[float, WorkloadParams]] = []
    previous = fault_workload or workload
    for i, entry in enumerate(data.get("later_workloads") or []):
        where = f"later_workloads[{i}]"
        if not isinstance(entry, Mapping) or problems.has(where):
            continue
        at = _time(entry["at"])
        after = later[-1][0] if later else fault_at
        if after is not None and at <= after:
            problems.add(f"{where}.at", f"must come after {'the previous phase' if later else 'fault_at_s'} "
                         f"({after:g}), got {show(entry['at'])}")
        if duration is not None and at >= duration:
            problems.add(f"{where}.at", f"must be before duration_s ({duration:g}), got {show(entry['at'])}")
        previous = _workload(problems, f"{where}.workload", entry.get("workload"), previous)
        later.append((at, previous))
    actions = _actions(problems, data.get("actions"), duration)
    problems.raise_if_any(ScenarioError)
    return Scenario(name=data["name"], description=data["description"], fault=data.get("fault", "none"),
                    fault_at_s=fault_at, duration_s=duration, expected_step=step, expected_alerts=alerts,
                    side_effects=side, policy=data.get("policy", "topology-aware"),
                    initial_workers=_int_or_none(data.get("initial_workers")), workload=workload, fault_workload=fault_workload,
                    later_workloads=tuple(later),
                    router=_router(data.get("router")), fault_router=_router(data.get("fault_router")),
                    actions=actions, seed=int(data.get("seed", 0)), source=source)


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(read_yaml(p, p.name, ScenarioError), p.name)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> Scenario:
    """A preset by name, or a scenario file by path."""
    p = PRESET_DIR / f"{name}.yaml"
    if p.is_file():
        return load_scenario(p)
    if Path(name).is_file():
        return load_scenario(name)
    raise ScenarioError(f"{name}: unknown scenario (presets: {', '.join(preset_names())})")


def presets() -> list[Scenario]:
    return [load_preset(n) for n in preset_names()]
