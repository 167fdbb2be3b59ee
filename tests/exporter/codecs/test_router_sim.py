"""The exporter's router source against the simulated router speaking each real router's /metrics.

The fleet runs a scenario on a virtual clock behind the reference router, which serves its own
/metrics over real HTTP in one flavour (fleet/router_metrics.py). The exporter's scraper reads it
as a router target with ``kind: auto``, once before the traffic (the baseline) and once after.
The catalogue's router series must then say what the router did: its decisions per worker and
the health of its pool, its prefix hit/miss outcomes, its predicted hit ratios and its index-walk
latencies — recounted here from the run's request records (the router's decisions as it made
them), at the resolution of the router's own histogram buckets.
"""

from __future__ import annotations

import math
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from exporter.codecs.normalize import worker_names_by_url
from exporter.core import checks
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.core.windows import histogram_quantile
from exporter.sources.scrape import Scraper, ScrapeTarget
from fleet import router_metrics as rm
from fleet.router_http import RouterMetricsServer
from fleet.scenarios import load_preset
from fleet.simulation import SimResult, Simulation
from fleet.topology import load_topology
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds
from tests.support import require_tool

P = catalog.NAMESPACE
ROUTER = "gateway"
# slow-tree-walk: index walks of a few microseconds, then from 300 s on 8 ms longer (two latency regimes)
SCENARIO, DURATION_S = "slow-tree-walk", 420.0


@dataclass
class Run:
    flavour: str
    result: SimResult
    state: ClusterState
    page: str

    @property
    def lookups(self) -> list[dict]:
        """Records of requests whose routing walked the index (every one under a prefix-aware policy)."""
        return [r for r in self.result.records if r["walk_s"] is not None]

    def rows(self, value: str) -> list[rm.RouterSeries]:
        return [s for s in rm.series_of(self.flavour) if s.value == value]

    @property
    def snapshot(self):
        return self.state.worker_pool.routers[ROUTER]


def simulate(flavour: str) -> Run:
    topology = load_topology(None).with_workers(4)
    metrics = rm.RouterMetrics(flavour)
    sim = Simulation(load_preset(SCENARIO), topology, duration_s=DURATION_S, router_metrics=metrics)
    # the router labels workers by URL, as the real ones do; the exporter maps a URL to the worker's name
    urls = {w: f"http://10.0.0.{i + 5}:8000" for i, w in enumerate(topology.names)}
    names = tuple(worker_names_by_url((w, u + "/metrics") for w, u in urls.items()).items())
    health = Health()
    state = ClusterState.build(health, load_thresholds(), window_s=300.0)
    with RouterMetricsServer(lambda: sim.router.metrics_page(urls.__getitem__)) as server:
        scraper = Scraper([ScrapeTarget(ROUTER, server.metrics_url, "router", "auto", names)], state, health,
                          timeout=10.0)
        assert [o.error for o in scraper.scrape_once()] == [None]  # the baseline, before any traffic
        result = sim.run()
        sim.fail_worker(topology.names[-1])  # one worker the router holds unhealthy
        assert [o.error for o in scraper.scrape_once()] == [None]
        page = sim.router.metrics_page(urls.__getitem__)
    assert result.router.rejected == 0  # every decision has its record
    return Run(flavour, result, state, page)


@pytest.fixture(scope="module", params=sorted(rm.FLAVOURS))
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    yield simulate(request.param)


def carries(run: Run, signal: str) -> bool:
    return any(s.signal == signal for s in rm.series_of(run.flavour))


def test_auto_detection_picks_the_flavours_router(run: Run) -> None:
    assert run.snapshot.kind == rm.FLAVOURS[run.flavour].adapter


def test_decisions_per_worker_are_the_routers(run: Run) -> None:
    got = run.state.series().counters.get(f"{P}_router_decisions", {})
    if not carries(run, "decisions"):
        assert got == {}  # the router exports none: missing, not 0
        return
    truth = Counter(r["worker"] for r in run.result.records)
    assert len(truth) > 1
    assert got == {(ROUTER, w): float(n) for w, n in truth.items()}


def test_worker_health_is_the_routers_pool(run: Run) -> None:
    got = run.state.series().gauges.get(f"{P}_router_worker_healthy", {})
    if not carries(run, "healthy"):
        assert got == {}
        return
    router = run.result.router
    assert got == {(ROUTER, w): float(w in router.healthy) for w in router.pool}
    assert 0.0 in got.values()


def test_prefix_outcomes_are_the_routers(run: Run) -> None:
    got = {o: v for (_r, o), v in run.state.series().counters.get(f"{P}_router_prefix_outcomes", {}).items()}
    if not carries(run, "prefix_outcomes"):
        assert got == {}
        return
    lookups = run.lookups
    assert lookups and len(lookups) == len(run.result.records)
    if run.rows(rm.LOOKUPS):
        # llm-d: a lookup hits when some pod held a prefix (its best candidate), whichever was picked
        hits = run.result.router.metrics.totals[rm.LOOKUP_HITS]
        assert sum(r["predicted_cached_tokens"] > 0 for r in lookups) <= hits <= len(lookups)
        assert got == {"hit": float(hits), "miss": float(len(lookups) - hits)}
    else:
        # a hit: the router picked a worker it predicted to hold part of the prompt
        hits = sum(r["predicted_cached_tokens"] > 0 for r in lookups)
        assert got.get("hit", 0.0) == hits and got.get("miss", 0.0) == len(lookups) - hits
    assert 0 < hits < len(lookups)


def _catalogue_buckets(run: Run, metric: str) -> tuple[tuple[float, ...], list[int]]:
    got = run.state.store.window_buckets(metric)
    assert got is not None, f"{metric} has no observations"
    return got


def _in_router_buckets(truth: list[float], row: rm.RouterSeries, bounds: tuple[float, ...],
                       counts: list[int]) -> None:
    """Every observation stays inside the router bucket it was counted in: per router bucket, the
    catalogue's counts between the catalogue bounds around it hold at least the bucket's own, and
    the quantiles read within the router buckets of the true ones."""
    edges = [b / row.scale for b in row.buckets]
    lower = 0.0
    for upper in edges:
        n = sum(lower < v <= upper for v in truth)
        lo = max((b for b in bounds if b <= lower), default=0.0)
        hi = min((b for b in bounds if b >= upper), default=math.inf)
        within = sum(c for b, c in zip((*bounds, math.inf), counts, strict=True) if lo < b <= hi)
        assert within >= n, (lower, upper)
        lower = upper
    for q in (0.5, 0.9):
        true = sorted(truth)[min(len(truth) - 1, int(q * len(truth)))]
        i = next((i for i, b in enumerate(edges) if true <= b), len(edges) - 1)
        lo, hi = (edges[i - 1] if i else 0.0), edges[i]
        lo = max((b for b in bounds if b <= lo), default=0.0)
        hi = min((b for b in bounds if b >= hi), default=bounds[-1])
        got = histogram_quantile(q, bounds, counts)
        assert got is not None and lo - 1e-12 <= got <= hi + 1e-12, (q, true, got)


def _cumulative_at(bounds: tuple[float, ...], counts: list[int], bound: float) -> int:
    return sum(c for b, c in zip(bounds, counts, strict=False) if b <= bound)


def test_predicted_hit_ratio_is_the_routers(run: Run) -> None:
    metric = f"{P}_router_predicted_hit_ratio"
    if not carries(run, "predicted_hit_ratio"):
        assert run.state.store.window_buckets(metric) is None and run.snapshot.predicted_hit_ratio is None
        return
    (row,) = run.rows(rm.PREDICTED_RATIO)
    truth = [min(1.0, r["predicted_cached_tokens"] / max(1, r["prompt_tokens"])) for r in run.lookups]
    bounds, counts = _catalogue_buckets(run, metric)
    assert sum(counts) == len(truth)
    _in_router_buckets(truth, row, bounds, counts)
    # where the router's bounds are the catalogue's, "≤ bound" counts are exact
    shared = [b for b in bounds if b in row.buckets]
    assert len(shared) >= 5
    for b in shared:
        assert _cumulative_at(bounds, counts, b) == sum(v <= b for v in truth), b


def test_tree_walk_latency_is_the_routers(run: Run) -> None:
    metric = f"{P}_router_tree_walk_seconds"
    if not carries(run, "lookup_seconds"):
        assert run.state.store.window_buckets(metric) is None and run.snapshot.lookup_seconds is None
        return
    (row,) = run.rows(rm.WALK_SECONDS)
    truth = [r["walk_s"] for r in run.lookups]
    assert min(truth) < 1e-3 < 8e-3 <= max(truth)  # both regimes of the scenario
    bounds, counts = _catalogue_buckets(run, metric)
    assert sum(counts) == len(truth)
    _in_router_buckets(truth, row, bounds, counts)
    seen = run.snapshot.lookup_seconds
    assert seen.count == len(truth) and seen.sum == pytest.approx(sum(truth))  # in seconds, whatever the unit
    for b in (b for b in bounds if b * row.scale in row.buckets):
        assert _cumulative_at(bounds, counts, b) == sum(v <= b for v in truth), b


def test_walk_latency_check_lights_up_without_records(run: Run) -> None:
    result = checks.evaluate(run.state).results["prefix_tree_walk_latency"]
    if carries(run, "lookup_seconds"):  # Dynamo, llm-d
        assert result.missing_signals == [] and result.value is not None and result.value > 0
    else:
        assert result.missing_signals == ["walk_latency"] and result.value is None


def test_promtool_accepts_the_page(run: Run) -> None:
    out = subprocess.run([require_tool("promtool"), "check", "metrics"], input=run.page, capture_output=True,
                         text=True, timeout=30)
    # promtool's linter objects to unit abbreviations in some real routers' own names (Dynamo's
    # `_ms`, llm-d's `llm_d_`); they are kept as the routers spell them. Nothing else may fail.
    problems = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    allowed = {f"{n} metric names should not contain abbreviated units" for n in
               {s.name for s in rm.series_of(run.flavour)}}
    assert out.returncode in (0, 3) and set(problems) <= allowed, out.stdout + out.stderr
