"""One row of the scenario matrix: a preset through the exporter into Prometheus's rule engine.

:func:`run_row` replays a scenario with :func:`lab.harness.run_through_exporter` (long enough
for its alerts' ``for`` to elapse), evaluates the generated alerting and recording rules over
the scraped history with ``promtool test rules``, and reads the diagnosis chain three ways:
the exporter's own check evaluation, the console's chain from the exporter's /api/v1/groups,
and the console's chain from Prometheus's firing alerts. Everything it returns is plain data,
so rows can run in worker processes.

How the firing set is read: promtool only compares, so a first run expects no firing alert;
when alerts fire, promtool's failure report lists them ("got: {alertname=..., step=...}"), and a
second run must then pass expecting exactly that set — so the set used by the assertions is one
promtool itself confirmed.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from console.chain import Reuse, chain_from_exporter, chain_from_prometheus
from console.limits import limits_from_groups
from fleet.scenarios import Scenario, load_preset
from fleet.topology import Topology, load_topology
from lab.family import Member, start_key
from lab.harness import (
    SCRAPE_EVERY_S,
    ScenarioRun,
    ScrapeHistory,
    duration_seconds,
    promtool_test,
    run_through_exporter,
    settled_duration,
)
from lab.recount import signals
from lab.steady import run_steady, run_steady_many, with_capacity
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds, window_seconds
from tests.support import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "generated" / "prefixscope.rules.yaml"
PROMTOOL = shutil.which("promtool")
# Checks whose value the fleet's own recount (lab.recount.signals: records and engine
# counters over the same window) defines the same way: a windowed ratio or rate. Quantiles are
# left out (the exporter interpolates in histogram buckets, as Prometheus does), and so are
# gauges the fleet averages or maxes over the window where the exporter reads the current value.
GROUND_TRUTH_KEYS = (
    "prefix_hit_rate_total", "prefix_hit_rate_worker_outlier", "prefix_hit_rate_per_session", "sticky_session_collision_rate",
    "session_migration_count_per_minute", "cold_prefill_cost_per_request", "topology_aware_placement_hit_rate",
    "cross_node_migration_count_per_minute", "speculative_decoding_acceptance_rate",
    "continuous_batching_affinity_admission_rate", "moe_expert_alignment_rate", "index_staleness",
)
_GOT = re.compile(r'alertname="([^"]+)", step="([^"]*)"')
_TIME = re.compile(r"time: (\w+),")


@dataclass
class Row:
    name: str
    expected_step: int | None
    expected_alerts: tuple[str, ...]
    chain_at_s: float  # when the chain was read (the scenario's own end)
    end_s: float  # when the run ended (every expected alert's `for` elapsed)
    warmup_firing: set[tuple[str, str]]  # (alertname, step) that fired before the fault
    firing: set[tuple[str, str]]  # ... that fired from the fault to the end; both promtool-confirmed
    confirmed: bool
    promtool_output: str
    exporter_verdict: int | None
    exporter_firing: list[str]
    console_exporter_verdict: int | None
    console_prometheus_verdict: int | None
    values: dict[str, float | None]
    kv_batches_lost: int
    kv_missed_batches: float
    seconds: float
    truth: dict[str, tuple[float | None, float | None]]  # key -> (the fleet's ground truth, the exporter's value)

    def describe(self) -> str:
        vals = ", ".join(f"{k}={v:.3g}" for k, v in self.values.items() if v is not None)
        return (f"{self.name}: fired in Prometheus before the fault {sorted(self.warmup_firing)}, after it "
                f"{sorted(self.firing)}; exporter verdict at {self.chain_at_s:g}s: step {self.exporter_verdict} "
                f"(firing {self.exporter_firing}); values: {vals}")


def _promtool(workdir: Path, doc: dict) -> subprocess.CompletedProcess[str]:
    (workdir / "matrix.test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "test", "rules", "matrix.test.yaml"], cwd=workdir, capture_output=True,
                          text=True, timeout=300)


Window = tuple[float, float]  # (since_s, until_s]
Fired = dict[Window, set[tuple[str, str]]]


def discover(output: str, windows: list[Window]) -> Fired | None:
    """The firing sets promtool reported per failed expectation (by eval time), or None if it said something else."""
    by_end = {until: (since, until) for since, until in windows}
    found: Fired = {w: set() for w in windows}
    current: Window | None = None
    failures = 0
    for line in output.splitlines():
        if m := _TIME.search(line):
            current = by_end.get(duration_seconds(m.group(1)))
        elif "got:" in line and current is not None:
            found[current] |= set(_GOT.findall(line))
            failures += 1
    return found if failures else None


def fired_in_prometheus(history, windows: list[Window], workdir: Path) -> tuple[Fired, bool, str]:
    """Alerts that fired in each window under Prometheus's own rule engine (see the module docstring)."""
    shutil.copy(RULES, workdir / RULES.name)
    first = _promtool(workdir, promtool_test(history, [RULES.name], [(a, b, ()) for a, b in windows]))
    if first.returncode == 0:
        return {w: set() for w in windows}, True, first.stdout
    found = discover(first.stdout + first.stderr, windows)
    if found is None:  # not an assertion failure: a bad input file or rule; say what promtool said
        return {w: set() for w in windows}, False, first.stdout + first.stderr
    second = _promtool(workdir, promtool_test(history, [RULES.name], [(a, b, found[(a, b)]) for a, b in windows]))
    return found, second.returncode == 0, second.stdout + second.stderr


def row_member(name: str) -> Member:
    """The preset, run until its slowest expected alert's `for` has surely elapsed; the chain is
    read where the scenario ends (its fault has filled the 5m window)."""
    scenario = load_preset(name)
    chain_at = math.floor(scenario.duration_s / SCRAPE_EVERY_S) * SCRAPE_EVERY_S
    return Member(scenario, settled_duration(scenario, load_thresholds(), SCRAPE_EVERY_S), (chain_at,))


def share_hint(scenario: Scenario) -> tuple:
    """Presets that probably share their start (:mod:`lab.family`), cheaply: the start's
    configuration, and whether a workload phase follows (it moves the stream's random draws
    before the fault). Only a hint for handing families to workers: :func:`lab.family.families`
    groups exactly, by the requests themselves."""
    return (*start_key(scenario), scenario.fault_workload is None)


def run_row(name: str, workdir: Path) -> Row:
    started = time.perf_counter()
    m = row_member(name)
    run = run_through_exporter(m.scenario, load_topology(), scrape_every_s=SCRAPE_EVERY_S,
                               checkpoints=m.checkpoints, duration_s=m.duration_s)
    return row_of(run, workdir, time.perf_counter() - started)


def row_of(run: ScenarioRun, workdir: Path, run_s: float) -> Row:
    """A finished run of a preset read three ways (see the module docstring)."""
    started = time.perf_counter()
    scenario = run.scenario
    (chain_at,) = row_member(scenario.name).checkpoints
    warmup, fault = (0.0, scenario.fault_at_s), (scenario.fault_at_s, run.end_s)
    fired, confirmed, output = fired_in_prometheus(run.history, [warmup, fault], workdir)

    ev, groups = run.checkpoints[chain_at]
    console_exp = chain_from_exporter(groups)
    limits = limits_from_groups(groups)  # the console reads the limits in force from the exporter
    values = {k: r.value for k, r in ev.results.items()}
    baselines = {k: r.baseline for k, r in ev.results.items()}
    # The console's Prometheus reading: rule values (the exporter computes the same expressions
    # over its windows) with the alerts Prometheus's engine fired for the fault.
    alerts = [{"labels": {"alertname": a, "step": s}, "state": "firing"} for a, s in sorted(fired[fault])]
    console_prom = chain_from_prometheus(values, baselines, ev.signals, alerts, limits, Reuse(None, None, None))
    truth = signals(run.result, chain_at - window_seconds(load_thresholds()), chain_at, load_thresholds())
    missed = sum(run.health.snapshot()[0].get(f"{catalog.NAMESPACE}_kv_event_missed_batches", {}).values())
    return Row(
        name=scenario.name, expected_step=scenario.expected_step, expected_alerts=scenario.expected_alerts,
        chain_at_s=chain_at, end_s=run.end_s, warmup_firing=fired[warmup], firing=fired[fault],
        confirmed=confirmed, promtool_output=output,
        exporter_verdict=ev.verdict["step"] if ev.verdict else None,
        exporter_firing=[k for k, r in ev.results.items() if r.status == "firing"],
        console_exporter_verdict=console_exp.verdict.number if console_exp.verdict else None,
        console_prometheus_verdict=console_prom.verdict.number if console_prom.verdict else None,
        values={k: (None if v is None else float(v)) for k, v in values.items()},
        kv_batches_lost=sum(run.kv_batches_lost.values()), kv_missed_batches=float(missed),
        seconds=run_s + time.perf_counter() - started,
        truth={k: (truth.get(k), values.get(k)) for k in GROUND_TRUTH_KEYS},
    )


# Steady state for the matrix: caches 8× smaller are over 99 % full after 15 simulated minutes of
# warm-up plus the preset's own 5 healthy minutes, which keeps the 17 presets within a few minutes
# on two cores (the CLI's default: 2 h, full size). Presets that share their healthy start share
# its run (lab.family): seven warm-ups for the seventeen.
STEADY_WARMUP_S = 900.0
STEADY_CAPACITY_DIVISOR = 8


def _steady_topology() -> Topology:
    return with_capacity(load_topology(), STEADY_CAPACITY_DIVISOR)


def run_steady_rows(names: Sequence[str]) -> dict[str, dict | BaseException]:
    """``names`` after the warm-up, read by the exporter's own evaluation (plain data); presets
    that share their warm-up (:mod:`lab.family`) run it once."""
    runs = run_steady_many([load_preset(n) for n in names], _steady_topology(), STEADY_WARMUP_S)
    return {n: r if isinstance(r, BaseException) else r.as_dict() for n, r in runs.items()}


def run_steady_row(name: str) -> dict:
    """One preset after the steady-state warm-up, on its own."""
    return run_steady(load_preset(name), _steady_topology(), STEADY_WARMUP_S).as_dict()


def allowed_alongside(step: int) -> set[str]:
    """Alerts that may fire with a fault of ``step``: the step's own, the symptom, and the SLOs.

    The cluster hit rate is the symptom that starts the walk and the SLOs measure what users
    feel; neither names a step, so either may co-fire with any fault. Any other step's cause
    alert must stay silent — the chain would otherwise name the wrong step.
    """
    own = {c.alert for c in catalog.checks_for_step(step)}
    symptom = {catalog.CHECKS_BY_KEY["prefix_hit_rate_total"].alert}
    slos = {c.alert for c in catalog.CHECKS if c.kind == "slo"}
    return own | symptom | slos


# ---- a real Prometheus over the backfilled history ---------------------------------------------
PROMETHEUS = shutil.which("prometheus")


class BackfilledPrometheus:
    """``/usr/bin/prometheus`` on 127.0.0.1 over a scrape history written as TSDB blocks."""

    def __init__(self, history: ScrapeHistory, start: float, workdir: Path) -> None:
        assert PROMETHEUS is not None and PROMTOOL is not None
        self.workdir = workdir
        (workdir / "history.om").write_text(history.openmetrics(start), encoding="utf-8")
        subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", "history.om", "data"], cwd=workdir,
                       check=True, capture_output=True, timeout=120)
        (workdir / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n", encoding="utf-8")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, "--config.file=prometheus.yml", "--storage.tsdb.path=data",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--storage.tsdb.retention.time=2d"],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            wait_for(self._ready, "prometheus to be ready", timeout=120, every=0.2, ignore=(requests.RequestException,))
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        return requests.get(f"{self.url}/-/ready", timeout=5).status_code == 200

    def query(self, expr: str, at: float) -> float | None:
        """An instant query; the single result's value, or None when the result is empty."""
        r = requests.get(f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=10)
        r.raise_for_status()
        result = r.json()["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def expanded(expr: str) -> str:
    """A check's expression with recording-rule names replaced by their expressions.

    A Prometheus serving backfilled blocks evaluates rules only from now on, so the history is
    queried with the rules' own expressions instead. A rule read over a range (a baseline
    averaging a recorded rate) becomes a subquery of its expression; a rule read over a range
    from inside its own expression (its own past: the healthy-window baseline) reads nothing, so
    the expression's fallback stands in at that depth.
    """
    return _render(_expand(expr, ()))


def _render(expr: str) -> str:
    """As the generated rule file has them: threshold(key) and budgets filled in from the threshold file."""
    th = load_thresholds()
    return catalog.render_expr(expr, th.values(), th.budgets())


_RULE_READ = re.compile(r"(?<![\w:])([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)(?![\w:])(\[\w+\])?")
SUBQUERY_STEP = "1m"


def _expand(expr: str, stack: tuple[str, ...], past: frozenset[str] = frozenset()) -> str:
    """``stack``: the rules being expanded at this instant (a cycle among them is an error);
    ``past``: the rules read over a range on the way here (read again over a range: nothing)."""
    rule = catalog.RULES_BY_NAME.get(expr)
    if rule is not None:
        return _expand(rule.expr, (*stack, expr), past)
    expr = _render(expr)  # budgets name a rule inside a placeholder: rendered before it is expanded

    def sub(m: re.Match[str]) -> str:
        name, rng = m[1], m[2]
        rule = catalog.RULES_BY_NAME.get(name)
        if rule is None:
            return m[0]
        if rng is None:
            if name in stack:
                raise ValueError(f"recording rules read each other in a cycle through {name}")
            return f"({_expand(rule.expr, (*stack, name), past)})"
        inner = "absent(vector(1))" if name in past else _expand(rule.expr, (name,), past | {name})
        return f"({inner})[{rng[1:-1]}:{SUBQUERY_STEP}]"
    return _RULE_READ.sub(sub, expr)
