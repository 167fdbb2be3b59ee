"""Every fault scenario, run on the accelerated clock, moves its own raw signal past its
threshold (and nothing earlier in the diagnosis chain), while a healthy run moves nothing."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import yaml

from fleet.engine import Knobs
from fleet.policies import POLICIES
from fleet.scenarios import (
    ACTIONS,
    KNOBS,
    PRESET_DIR,
    ROUTER_FIELDS,
    SCHEMA_FILE,
    ScenarioError,
    load_preset,
    load_scenario,
    parse_scenario,
    preset_names,
)
from fleet.simulation import SimResult, Simulation, run_scenario
from fleet.topology import load_topology
from fleet.workloads import WORKLOAD_FIELDS
from lab.harness import settled_duration
from lab.recount import Window, cold_prefill_budget, cold_prefill_ratio, signals
from prefixscope import SCHEMAS_DIR
from prefixscope.catalog import CHECKS, CHECKS_BY_ALERT, CHECKS_BY_KEY
from prefixscope.thresholds import load as load_thresholds

SPEC_MATRIX = {  # SPEC.md's acceptance matrix: scenario -> diagnosis step (None: no alert)
    "healthy": None, "cache-pressure": 1, "timestamp-in-system-prompt": 1, "hash-mod-reshuffle": 2,
    "session-key-churn": 2, "warm-pool-saturation": 2, "worker-failures": 2, "slow-gpu-long-prompts": 3,
    "async-prefill-backlog": 3, "slow-tree-walk": 4, "topology-blind-placement": 4,
    "cross-node-migration-storm": 4, "spec-decode-drift": 5, "moe-expert-misalignment": 5,
    "affinity-blind-batching": 5, "dropped-kv-events": 0, "autoscaling": 2,
}
# Presets whose expected alerts take turns instead of holding together: each must cross in one of
# the two windows read, the verdict in each must still be the expected step.
TAKE_TURNS = {"autoscaling": "the surge saturates the warm pool before the scale-out; the reshuffles follow it"}
SYMPTOM = "PrefixHitRateLow"  # starts the walk, never the verdict
TH = load_thresholds()
_RUNS: dict[str, SimResult] = {}


def _run(name: str) -> SimResult:
    """A run long enough for every expected alert's window and ``for`` to elapse."""
    if name not in _RUNS:
        sc = load_preset(name)
        _RUNS[name] = run_scenario(sc, load_topology(), duration_s=settled_duration(sc, TH))
    return _RUNS[name]


def _crossed(values: dict[str, float | None]) -> set[str]:
    out = set()
    for key, v in values.items():
        check = CHECKS_BY_KEY.get(key)
        if check is None or v is None or check.kind == "slo":
            continue
        t = TH.checks[check.threshold].value
        if (v > t) if check.op == ">" else (v < t):
            out.add(check.alert)
    return out


def test_the_presets_are_the_acceptance_matrix() -> None:
    assert set(preset_names()) == set(SPEC_MATRIX)
    for name, step in SPEC_MATRIX.items():
        sc = load_preset(name)
        assert sc.name == name and sc.expected_step == step
        assert sc.fault and sc.description
        assert all(CHECKS_BY_ALERT[a].group == step for a in sc.expected_alerts)
        if step is not None:
            assert sc.expected_alerts and 0 < sc.fault_at_s < sc.duration_s


_KNOWN_WRONG: dict[str, str] = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_WRONG[n]))
                                  if n in _KNOWN_WRONG else n for n in sorted(SPEC_MATRIX)])
def test_scenario_trips_its_own_checks_and_nothing_earlier(name: str) -> None:
    sc = load_preset(name)
    result = _run(name)
    end = settled_duration(sc, TH)
    warm = _crossed(signals(result, 0.0, sc.fault_at_s, TH))
    assert warm == set(), f"the healthy warm-up already crosses {warm}"
    # the first five minutes of the fault, and the last five of the run: the fault holds
    crossed: set[str] = set()
    for lo, hi in ((sc.fault_at_s, sc.fault_at_s + 300), (end - 300, end)):
        fault = _crossed(signals(result, lo, hi, TH))
        crossed |= fault
        if name not in TAKE_TURNS:
            assert set(sc.expected_alerts) <= fault, (lo, hi, fault)
        assert fault <= set(sc.expected_alerts) | set(sc.side_effects) | {SYMPTOM}, (lo, hi, fault)
        if sc.expected_step is not None:
            verdict = min(CHECKS_BY_ALERT[a].group for a in fault if a != SYMPTOM)
            assert verdict == sc.expected_step
    assert set(sc.expected_alerts) <= crossed, crossed


def test_healthy_has_every_signal_it_can_measure() -> None:
    """A healthy run is not quiet because signals are missing: each one has a value."""
    result = _run("healthy")
    end = result.samples[-1].t
    values = signals(result, end - 300, end, TH)
    measured = {k for k, v in values.items() if v is not None}
    checklist = {c.key for c in CHECKS if c.kind == "checklist"}
    # cache retention reads vLLM's sampled block residency (--kv-cache-metrics), which the engines of
    # these simulations do not export (fleet.simulation.KV_CACHE_METRICS), so it has no input here
    assert checklist - measured == {"prefix_cache_retention"}
    # the radix depth is a snapshot of every cache, which the run has at its end only
    assert signals(result, end - 600, end - 300, TH)["prefix_tree_depth_p99"] is None


def test_a_worker_whose_cache_is_wiped_stands_out_of_its_peers_in_the_recount() -> None:
    """The worker outlier from the engines' own counters: behind a router that does not steer by
    prefix (a prefix-aware one sends the wiped worker too little traffic to compare), a worker
    wiped every two seconds reads a small fraction of the median worker's hit ratio, while the
    cluster's ratio barely moves."""
    data = yaml.safe_load((PRESET_DIR / "healthy.yaml").read_text())
    sc = parse_scenario(data | {"policy": "round-robin",
                                "actions": [{"at": 300, "action": "reset_cache", "workers": ["w2"], "every": 2}]},
                        "wiped.yaml")
    result = run_scenario(sc, load_topology(), duration_s=600)
    values = signals(result, 300, 600, TH)
    assert values["prefix_hit_rate_worker_outlier"] < TH.checks["prefix_hit_rate_worker_outlier"].value
    assert values["prefix_hit_rate_total"] > TH.checks["prefix_hit_rate_total"].value
    assert signals(result, 0, 300, TH)["prefix_hit_rate_worker_outlier"] > 0.8


def test_cold_prefill_budget_is_the_worst_class_p99_over_its_own_budget() -> None:
    """As the exporter's check: cold requests only, p99 seconds per model and prompt-length class
    over that class's budget from the threshold file, the worst one."""
    def rec(ts: float, prompt: int, prefill: float, cached: int = 0, model: str = "m") -> dict:
        return {"ts": ts, "model": model, "prompt_tokens": prompt, "cached_tokens": cached, "prefill_s": prefill}
    budgets = TH.checks["cold_prefill_seconds_budget"].budgets
    records = [rec(10 + i, 500, 0.5 * budgets["0-1k"]) for i in range(50)]
    records += [rec(70 + i, 2000, 1.5 * budgets["1k-4k"], model="n") for i in range(3)]
    records += [rec(80, 500, 9 * budgets["0-1k"], cached=400)]  # warm: not cold, whatever it took
    result = cast(SimResult, SimpleNamespace(start=0.0, records=records, samples=[]))
    window = Window(result, 0, 300, TH)
    assert cold_prefill_budget(window) == pytest.approx(1.5)
    assert cold_prefill_budget(Window(result, 200, 300, TH)) is None  # no cold request


def test_raw_signals_by_hand_for_two_faults() -> None:
    """Spot checks against values computed directly from records and engine counters."""
    r = _run("slow-tree-walk")
    walks = sorted(x["walk_s"] for x in r.records if x["ts"] >= r.start + 300)
    assert walks[0] >= 0.008  # every walk after the fault carries the 8 ms delay
    r = _run("spec-decode-drift")
    s300 = next(s for s in r.samples if s.t == 300)
    s600 = next(s for s in r.samples if s.t == 600)
    drafts = sum(s600.workers[w]["spec_draft_tokens"] - s300.workers[w]["spec_draft_tokens"] for w in r.engines)
    accepted = sum(s600.workers[w]["spec_accepted_tokens"] - s300.workers[w]["spec_accepted_tokens"]
                   for w in r.engines)
    # per-position acceptance 0.45 with 3 draft tokens: (0.45 + 0.45² + 0.45³) / 3 ≈ 0.249
    assert accepted / drafts == pytest.approx((0.45 + 0.45**2 + 0.45**3) / 3, abs=0.02)


def test_cold_prefill_signal_is_seconds_per_prompt_class_against_the_window_before() -> None:
    """As the exporter's check: cold p99 in seconds of the window over the cold p99 of the long
    window before it, per model and prompt-length class, the worst class; warm requests and
    classes without a baseline do not count, and prefill time is not divided by tokens."""
    def rec(ts: float, prompt: int, prefill: float, cached: int = 0) -> dict:
        return {"ts": ts, "model": "m", "prompt_tokens": prompt, "cached_tokens": cached, "prefill_s": prefill}
    records = [rec(10 + i, 2000, 0.1) for i in range(50)] + [rec(10 + i, 10000, 0.5) for i in range(50)]
    records += [rec(400 + i, 2000, 0.25) for i in range(20)]  # 1k-4k: 2.5x its baseline
    records += [rec(400 + i, 12000, 0.6) for i in range(20)]  # 4k-16k: longer prompts, 1.2x
    records += [rec(450, 2000, 9.0, cached=1500)]  # warm: not cold, whatever it took
    records += [rec(460, 40000, 3.0)]  # 16k+: no baseline for this class
    result = cast(SimResult, SimpleNamespace(start=0.0, records=records))
    assert cold_prefill_ratio(result, 300, 600, 0.1, TH.baseline_window_s) == pytest.approx(2.5)
    assert cold_prefill_ratio(result, 0, 300, 0.1, TH.baseline_window_s) is None  # nothing before the first window


def _bad(tmp_path: Path, changes: dict) -> Path:
    data = yaml.safe_load((PRESET_DIR / "worker-failures.yaml").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize(("changes", "message"), [
    ({"expected_step": 7}, "bad.yaml: expected_step: expected an integer between 0 and 5, got 7"),
    ({"expected_alerts": ["PrefixNope"]}, 'bad.yaml: expected_alerts[0]: unknown alert "PrefixNope" (not in prefixscope/catalog.py)'),
    ({"expected_alerts": ["PrefixRouterTreeWalkSlow"]},
     "bad.yaml: expected_alerts[0]: PrefixRouterTreeWalkSlow belongs to step 4, not expected_step 2"),
    ({"side_effects": ["PrefixCacheNearCapacity"]},
     "bad.yaml: side_effects[0]: PrefixCacheNearCapacity is step 1, before expected_step 2: it would take the verdict"),
    ({"policy": "sticky"}, 'bad.yaml: policy: expected one of random, round-robin, hash-mod, consistent-hash, prefix-tree, topology-aware, got "sticky"'),
    ({"fault_at_s": 900}, "bad.yaml: fault_at_s: must be before duration_s (600), got 900"),
    ({"workload": {"chat_sessions_per_s": "lots"}}, 'bad.yaml: workload.chat_sessions_per_s: expected a number ≥ 0, got "lots"'),
    ({"workload": {"turns": [5, 2]}}, "bad.yaml: workload.turns: expected [low, high] with low ≤ high, got [5, 2]"),
    ({"workload": {"rekey_prob": 1.5}}, "bad.yaml: workload.rekey_prob: expected a number between 0 and 1, got 1.5"),
    ({"fault_router": {"placement": "random"}}, 'bad.yaml: fault_router.placement: expected one of aware, blind, got "random"'),
    ({"actions": [{"at": 300, "action": "explode", "workers": ["w1"]}]},
     'bad.yaml: actions[0].action: expected one of set_knob, reset_cache, fail, drain, add_worker, remove_worker, '
     'restart_worker, got "explode"'),
    ({"actions": [{"at": 300, "action": "set_knob", "workers": ["w1"], "knob": "turbo", "value": 1}]},
     'bad.yaml: actions[0].knob: expected one of prefill_slowdown, spec_acceptance, expert_misalignment, affinity_admission, drop_kv_events, healthy, got "turbo"'),
    ({"actions": [{"at": 300, "action": "fail"}]}, "bad.yaml: actions[0].workers: name the workers (or a node) the action applies to"),
    ({"name": ""}, 'bad.yaml: name: expected a non-empty string, got ""'),
    ({"colour": "red"}, "bad.yaml: colour: unknown field (allowed: schema, name, description, "),
    ({"workload": {"turns": [3, -1]}}, "bad.yaml: workload.turns[1]: expected an integer ≥ 0, got -1"),
    ({"actions": [{"at": 300, "action": "set_knob", "workers": ["w1"], "knob": "healthy"}]},
     "bad.yaml: actions[0].value: missing"),
    ({"actions": [{"at": 300, "action": "set_knob", "workers": ["w1"], "knob": "healthy", "value": 0}]},
     "bad.yaml: actions[0].value: expected true or false, got 0"),
    ({"actions": [{"at": "700s", "action": "fail", "workers": ["w1"]}]},
     'bad.yaml: actions[0].at: must be within the run (duration_s 600), got "700s"'),
    ({"duration_s": "ten minutes"},
     'bad.yaml: duration_s: expected a positive number of seconds or a duration like 500ms, 5m or 1h30m, got "ten minutes"'),
])
def test_invalid_scenario_files_name_file_field_and_problem(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as e:
        load_scenario(_bad(tmp_path, changes))
    assert message in str(e.value).splitlines() or str(e.value).startswith(message)


def test_every_problem_of_a_scenario_file_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as e:
        load_scenario(_bad(tmp_path, {"description": None, "fault_at_s": "soon", "expected_step": 2,
                                      "expected_alerts": ["PrefixNope", "PrefixRouterTreeWalkSlow"],
                                      "workload": {"turns": [5, 2], "tenants": -1},
                                      "router": {"async_slots": 0},
                                      "actions": [{"at": 300, "action": "drain"}, {"action": "fail", "workers": ["w1"]}]}))
    assert set(e.value.problems) == {
        "bad.yaml: description: missing",
        'bad.yaml: fault_at_s: expected a number of seconds ≥ 0 or a duration like 500ms, 5m or 1h30m, got "soon"',
        'bad.yaml: expected_alerts[0]: unknown alert "PrefixNope" (not in prefixscope/catalog.py)',
        "bad.yaml: expected_alerts[1]: PrefixRouterTreeWalkSlow belongs to step 4, not expected_step 2",
        "bad.yaml: workload.turns: expected [low, high] with low ≤ high, got [5, 2]",
        "bad.yaml: workload.tenants: expected an integer ≥ 0, got -1",
        "bad.yaml: router.async_slots: expected a positive integer, got 0",
        "bad.yaml: actions[0].workers: name the workers (or a node) the action applies to",
        "bad.yaml: actions[1].at: missing",
    }


def test_times_take_seconds_or_prometheus_durations(tmp_path: Path) -> None:
    sc = load_scenario(_bad(tmp_path, {
        "fault_at_s": "5m", "duration_s": "1h30m", "router": {"walk_delay_s": "8ms"},
        "workload": {"think_s": "1m30s"},
        "actions": [{"at": "10m", "action": "fail", "workers": ["w1"], "every": "1m", "until": "1h",
                     "restore_after": "500ms"}]}))
    assert (sc.fault_at_s, sc.duration_s, sc.router["walk_delay_s"], sc.workload.think_s) == (300.0, 5400.0, 0.008, 90.0)
    a = sc.actions[0]
    assert (a.at, a.every, a.until, a.restore_after) == (600.0, 60.0, 3600.0, 0.5)
    numbers = load_scenario(_bad(tmp_path, {"fault_at_s": 300, "duration_s": 5400}))
    assert (numbers.fault_at_s, numbers.duration_s) == (300.0, 5400.0)


def test_the_schema_names_what_the_simulator_knows() -> None:
    """The scenario schema's lists are the simulator's: a new knob, policy or workload field
    must be added to prefixscope/schemas/scenario.v1.json too."""
    schema = json.loads((SCHEMAS_DIR / SCHEMA_FILE).read_text())
    defs, props = schema["$defs"], schema["properties"]
    assert set(defs["workload"]["properties"]) == WORKLOAD_FIELDS
    assert tuple(props["policy"]["enum"]) == POLICIES
    assert tuple(defs["action"]["properties"]["knob"]["enum"]) == KNOBS
    assert tuple(defs["action"]["properties"]["action"]["enum"]) == ACTIONS
    assert tuple(defs["router"]["properties"]) == ROUTER_FIELDS
    bool_knobs = {f.name for f in fields(Knobs) if isinstance(f.default, bool)}
    assert set(defs["action"]["allOf"][1]["if"]["properties"]["knob"]["enum"]) == bool_knobs


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ScenarioError, match=r"^nope: unknown scenario \(presets: affinity-blind-batching, "):
        load_preset("nope")


def test_docs_list_every_preset_with_its_step_and_alerts() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scenarios.md").read_text()
    for name in preset_names():
        sc = load_preset(name)
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in row.split("|")]
        assert cells[2] == ("—" if sc.expected_step is None else str(sc.expected_step))
        assert all(f"`{a}`" in cells[3] for a in sc.expected_alerts)


def test_a_saturated_run_records_every_request_once_admitted_and_hands_each_on() -> None:
    topo = load_topology()
    topo = replace(topo, workers=tuple(replace(w, max_concurrency=1) for w in topo.workers))
    sc = load_preset("healthy")
    handed: list[dict] = []
    res = run_scenario(sc, topo, duration_s=60, prewarm=False, track_placement=False)
    ids = [r["request_id"] for r in res.records]
    assert res.router.deferred > 0 and res.router.waiting == 0  # requests queued, none left behind
    assert len(ids) == len(set(ids)) == res.router.served
    assert max(r["queue_s"] for r in res.records) > 0
    # out of ts order only by how long a request waited for its slot (until the next arrival)
    late = max(a["ts"] - b["ts"] for a, b in pairwise(res.records))
    ts = sorted(r["ts"] for r in res.records)
    gap = max(b - a for a, b in pairwise(ts))
    assert 0 < late <= max(r["queue_s"] for r in res.records) + gap + 1e-6
    sim = Simulation(sc, topo, duration_s=60, prewarm=False, track_placement=False)
    sim.run(on_request=lambda r: handed.append(r) if r is not None else None)
    assert sorted(r["request_id"] for r in handed) == sorted(ids)


def test_a_scenario_gives_its_tenants_adapters_and_cache_salts() -> None:
    data = yaml.safe_load((PRESET_DIR / "healthy.yaml").read_text())
    data["workload"] = {**(data.get("workload") or {}), "tenant_loras": ["billing-v2", None],
                        "tenant_salts": ["acme", None]}
    sc = parse_scenario(data, "tenants.yaml")
    assert (sc.workload.tenant_loras, sc.workload.tenant_salts) == (("billing-v2", None), ("acme", None))
    data["workload"]["tenant_salts"] = [""]
    with pytest.raises(ScenarioError, match="tenant_salts"):
        parse_scenario(data, "tenants.yaml")


def test_the_routers_default_cold_share_is_the_packaged_threshold_files() -> None:
    from fleet.router import RouterConfig

    assert RouterConfig().cold_share == TH.cold_reuse_share
