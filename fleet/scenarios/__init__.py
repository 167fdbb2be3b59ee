"""Fault scenarios: named presets (``fleet/scenarios/*.yaml``) and their validation.

A scenario runs a healthy warm-up, then injects its fault at ``fault_at_s``: a change of the
workload (``fault_workload``), of the router (``fault_router``) and/or timed fleet ``actions``
(engine knobs, cache resets, failures, drains, scale-out). Each preset states which diagnosis
step (0–5) it must trip and which alerts of ``prefixscope/catalog.py`` (``expected_step``,
``expected_alerts``); the format is documented in docs/scenarios.md.

Invalid files raise :class:`ScenarioError` with ``file: field: problem`` lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fleet.engine import Knobs
from fleet.policies import POLICIES
from fleet.workloads import WorkloadParams
from prefixscope.catalog import CHECKS_BY_ALERT
from prefixscope.topology import FieldErrors, check_keys, check_value, load_yaml_mapping, show_value

SCHEMA = "prefixscope.scenario/v1"
PRESET_DIR = Path(__file__).resolve().parent

ACTIONS = ("set_knob", "reset_cache", "fail", "drain", "add_worker")
KNOBS = tuple(f.name for f in fields(Knobs))
ROUTER_FIELDS = {"walk_delay_s": "non_negative", "placement": ("aware", "blind"), "class_routing": "bool",
                 "async_slots": "positive_int", "async_share": "ratio"}


class ScenarioError(ValueError):
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
    restore_after: float | None = None  # fail/drain: the worker comes back after this long


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
    router: Mapping[str, Any] = field(default_factory=dict)
    fault_router: Mapping[str, Any] = field(default_factory=dict)
    actions: tuple[Action, ...] = ()
    seed: int = 0
    source: str = "<scenario>"

    def phases(self) -> list[tuple[float, WorkloadParams]]:
        if self.fault_workload is None:
            return [(0.0, self.workload)]
        return [(0.0, self.workload), (self.fault_at_s, self.fault_workload)]


_WORKLOAD_KINDS: dict[str, str] = {}
for _f in fields(WorkloadParams):
    _d = _f.default
    _WORKLOAD_KINDS[_f.name] = ("bool" if isinstance(_d, bool) else "range" if isinstance(_d, tuple) and len(_d) == 2
                                and all(isinstance(x, int) for x in _d) else "segments" if _f.name == "segments"
                                else "names" if _f.name in ("rekey_segments", "timestamp_segments") else "choice" if _f.name == "rekey_mode"
                                else "non_negative_int" if isinstance(_d, int) else "non_negative")


def _workload(e: FieldErrors, where: str, raw: Any, base: WorkloadParams) -> WorkloadParams | None:
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        e.add(where, f"must be a mapping of workload fields, got {type(raw).__name__}")
        return None
    check_keys(e, where + ".", raw, _WORKLOAD_KINDS)
    out: dict[str, Any] = {}
    for k, v in raw.items():
        kind = _WORKLOAD_KINDS.get(k)
        f = f"{where}.{k}"
        if kind is None:
            continue
        if kind == "range":
            if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                 and x >= 0 for x in v) or v[0] > v[1]):
                e.add(f, f"must be [low, high] with integers 0 ≤ low ≤ high, got {show_value(v)}")
                continue
            out[k] = (v[0], v[1])
        elif kind == "segments":
            if (not isinstance(v, Mapping) or not v or not all(isinstance(w, int | float) and not isinstance(w, bool)
                                                               and w > 0 for w in v.values())):
                e.add(f, f"must map segment names to positive weights, got {show_value(v)}")
                continue
            out[k] = tuple((str(n), float(w)) for n, w in v.items())
        elif kind == "names":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                e.add(f, f"must be a list of segment names, got {show_value(v)}")
                continue
            out[k] = tuple(v)
        elif kind == "choice":
            if v not in ("cookie", "title"):
                e.add(f, f'must be "cookie" or "title", got {show_value(v)}')
                continue
            out[k] = v
        else:
            val = check_value(e, f, v, kind)
            if val is not None:
                out[k] = val
    if k_prob := [k for k in ("rekey_prob", "fork_prob") if k in out and out[k] > 1]:
        for k in k_prob:
            e.add(f"{where}.{k}", f"must be a probability between 0 and 1, got {show_value(raw[k])}")
    try:
        return base.with_overrides(out)
    except TypeError as exc:  # pragma: no cover - keys were checked above
        e.add(where, str(exc))
        return None


def _router(e: FieldErrors, where: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        e.add(where, f"must be a mapping, got {type(raw).__name__}")
        return {}
    check_keys(e, where + ".", raw, ROUTER_FIELDS)
    out: dict[str, Any] = {}
    for k, v in raw.items():
        kind = ROUTER_FIELDS.get(k)
        if kind is None:
            continue
        if isinstance(kind, tuple):
            if v not in kind:
                e.add(f"{where}.{k}", f"must be one of {', '.join(kind)}, got {show_value(v)}")
            else:
                out[k] = v
        else:
            val = check_value(e, f"{where}.{k}", v, kind)
            if val is not None:
                out[k] = val
    return out


def _actions(e: FieldErrors, raw: Any, duration: float) -> tuple[Action, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        e.add("actions", f"must be a list, got {type(raw).__name__}")
        return ()
    out = []
    allowed = ("at", "action", "workers", "node", "knob", "value", "every", "until", "rotate", "restore_after")
    for i, a in enumerate(raw):
        where = f"actions[{i}]"
        if not isinstance(a, Mapping):
            e.add(where, f"must be a mapping, got {type(a).__name__}")
            continue
        check_keys(e, where + ".", a, allowed)
        at = check_value(e, f"{where}.at", a.get("at"), "non_negative")
        if at is not None and at > duration:
            e.add(f"{where}.at", f"must be within the run (duration_s {duration:g}), got {show_value(a.get('at'))}")
        kind = a.get("action")
        if kind not in ACTIONS:
            e.add(f"{where}.action", f"must be one of {', '.join(ACTIONS)}, got {show_value(kind)}")
            continue
        workers = a.get("workers", [])
        if not isinstance(workers, list) or not all(isinstance(w, str) and w for w in workers):
            e.add(f"{where}.workers", f"must be a list of worker names, got {show_value(workers)}")
            workers = []
        node = a.get("node")
        if node is not None:
            node = check_value(e, f"{where}.node", node, "name")
        if not workers and node is None:
            e.add(f"{where}.workers", "name the workers (or a node) the action applies to")
        knob = a.get("knob")
        value = a.get("value")
        if kind == "set_knob":
            if knob not in KNOBS:
                e.add(f"{where}.knob", f"must be one of {', '.join(KNOBS)}, got {show_value(knob)}")
            elif knob in ("affinity_admission", "healthy"):
                check_value(e, f"{where}.value", value, "bool")
            else:
                value = check_value(e, f"{where}.value", value, "non_negative")
        every = a.get("every")
        if every is not None:
            every = check_value(e, f"{where}.every", every, "positive")
        until = a.get("until")
        if until is not None:
            until = check_value(e, f"{where}.until", until, "non_negative")
        restore = a.get("restore_after")
        if restore is not None:
            restore = check_value(e, f"{where}.restore_after", restore, "positive")
        rotate = check_value(e, f"{where}.rotate", a.get("rotate", False), "bool")
        if at is None:
            continue
        out.append(Action(at=at, action=kind, workers=tuple(workers), node=node, knob=knob, value=value,
                          every=every, until=until, rotate=bool(rotate), restore_after=restore))
    return tuple(out)


def _alerts(e: FieldErrors, field: str, raw: Any, problem: Callable[[str, int], str | None]) -> list[str]:
    """A list of catalogue alert names; ``problem(alert, step)`` adds a check of its own."""
    if not isinstance(raw, list):
        e.add(field, f"must be a list of alert names, got {show_value(raw)}")
        return []
    for i, a in enumerate(raw):
        check = CHECKS_BY_ALERT.get(a) if isinstance(a, str) else None
        if check is None:
            e.add(f"{field}[{i}]", f"unknown alert {show_value(a)} (not in prefixscope/catalog.py)")
        elif (msg := problem(a, check.group)) is not None:
            e.add(f"{field}[{i}]", msg)
    return raw


def parse_scenario(data: Mapping[str, Any], source: str = "<scenario>") -> Scenario:
    e = FieldErrors(source)
    allowed = ("schema", "name", "description", "fault", "fault_at_s", "duration_s", "expected_step",
               "expected_alerts", "side_effects", "policy", "initial_workers", "workload", "fault_workload", "router",
               "fault_router", "actions", "seed")
    check_keys(e, "", data, allowed)
    if data.get("schema", SCHEMA) != SCHEMA:
        e.add("schema", f"must be {SCHEMA!r}, got {show_value(data.get('schema'))}")
    name = check_value(e, "name", data.get("name"), "name")
    description = check_value(e, "description", data.get("description"), "name")
    fault = check_value(e, "fault", data.get("fault", "none"), "name")
    duration = check_value(e, "duration_s", data.get("duration_s", 600), "positive")
    fault_at = check_value(e, "fault_at_s", data.get("fault_at_s", 0), "non_negative")
    if duration is not None and fault_at is not None and fault_at >= duration:
        e.add("fault_at_s", f"must be before duration_s ({duration:g}), got {show_value(data.get('fault_at_s'))}")
    step = data.get("expected_step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 5):
        e.add("expected_step", f"must be a diagnosis step 0–5 (or null for a healthy run), got {show_value(step)}")
        step = None
    def same_step(a: str, group: int) -> str | None:
        return None if step is None or group == step else f"{a} belongs to step {group}, not expected_step {step}"

    def not_earlier(a: str, group: int) -> str | None:
        return (f"{a} is step {group}, before expected_step {step}: it would take the verdict"
                if step is not None and group < step else None)

    alerts = _alerts(e, "expected_alerts", data.get("expected_alerts", []), same_step)
    if step is None and alerts:
        e.add("expected_alerts", "a scenario without expected_step (healthy) must not expect alerts")
    side = _alerts(e, "side_effects", data.get("side_effects", []), not_earlier)
    policy = data.get("policy", "topology-aware")
    if policy not in POLICIES:
        e.add("policy", f"must be one of {', '.join(POLICIES)}, got {show_value(policy)}")
    initial = data.get("initial_workers")
    if initial is not None:
        initial = check_value(e, "initial_workers", initial, "positive_int")
    workload = _workload(e, "workload", data.get("workload"), WorkloadParams())
    fault_workload = None
    if data.get("fault_workload") is not None and workload is not None:
        fault_workload = _workload(e, "fault_workload", data.get("fault_workload"), workload)
    router = _router(e, "router", data.get("router"))
    fault_router = _router(e, "fault_router", data.get("fault_router"))
    actions = _actions(e, data.get("actions"), duration or 0.0)
    seed = check_value(e, "seed", data.get("seed", 0), "non_negative_int")
    e.raise_if_any(ScenarioError)
    return Scenario(name=name, description=description, fault=fault, fault_at_s=fault_at, duration_s=duration,
                    expected_step=step, expected_alerts=tuple(alerts), side_effects=tuple(side), policy=policy, initial_workers=initial,
                    workload=workload, fault_workload=fault_workload, router=router, fault_router=fault_router,
                    actions=actions, seed=seed or 0, source=source)


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(load_yaml_mapping(p, ScenarioError), p.name)


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
