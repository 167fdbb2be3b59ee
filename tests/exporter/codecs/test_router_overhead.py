"""Dynamo's routing overhead per phase (tests/fixtures/routers/dynamo_router_overhead.txt: Dynamo's own
names, const label and bucket layouts, from the source file and commit its header names): every phase
exported in seconds by phase, its find_matches phase the tree-walk latency of step 4."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.codecs import normalize
from exporter.core import checks
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.core.windows import histogram_quantile
from exporter.web.exposition import render_state
from prefixscope import catalog
from prefixscope.thresholds import load_thresholds

P = catalog.NAMESPACE
PAGE = (Path(__file__).resolve().parents[2] / "fixtures" / "routers" / "dynamo_router_overhead.txt").read_text()
BASELINE = re.sub(r"(_bucket\{[^}]*\}|_sum\{[^}]*\}|_count\{[^}]*\}) \S+$", r"\1 0", PAGE, flags=re.M)


def _scraped(*pages: str) -> ClusterState:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300.0, clock=lambda: 1000.0)
    for i, page in enumerate(pages):
        snap, errors = normalize.parse_router("dynamo-frontend", page)
        assert errors == [] and snap.kind == "dynamo"
        st.observe_router(snap, 1000.0 + 5 * i)
    return st


def _quantile(st: ClusterState, metric: str, q: float, phase: str | None = None) -> float:
    got = st.store.window_buckets(metric, where=None if phase is None else (lambda labels: labels[1] == phase))
    assert got is not None
    value = histogram_quantile(q, *got)
    assert value is not None
    return value


def test_every_phase_is_read_in_seconds_with_dynamos_own_buckets() -> None:
    snap, errors = normalize.parse_router("dynamo-frontend", PAGE)
    assert errors == []
    assert set(snap.overhead_seconds) == {"block_hashing", "seq_hashing", "indexer_find_matches", "scheduling",
                                          "total", "shared_cache_query"}
    hashing = snap.overhead_seconds["block_hashing"]
    assert hashing.bounds[0] == pytest.approx(1e-6) and len(hashing.bounds) == 16  # 0.001 ms × 2ⁿ, 15 and +Inf
    lookup = snap.overhead_seconds["indexer_find_matches"]
    assert lookup.bounds[5:7] == pytest.approx((2.43e-3, 7.29e-3)) and lookup.sum == pytest.approx(0.35)
    assert snap.lookup_seconds == lookup  # the same histogram feeds the tree-walk latency


def test_phases_are_exported_by_phase_and_the_lookup_lights_the_tree_walk_check() -> None:
    st = _scraped(BASELINE, PAGE)
    metric = f"{P}_router_overhead_seconds"
    for phase, ms in (("block_hashing", 0.012), ("seq_hashing", 0.02), ("indexer_find_matches", 3.5),
                      ("scheduling", 0.5), ("total", 4.1)):
        bounds = (0.0, *catalog.METRICS_BY_NAME[metric].buckets)
        i = next(i for i, b in enumerate(bounds) if ms / 1000 <= b)
        assert bounds[i - 1] <= _quantile(st, metric, 0.5, phase) <= bounds[i], phase  # inside its bucket
    assert st.store.window_buckets(metric, where=lambda labels: labels[1] == "shared_cache_query")[1] == \
        [0] * (len(catalog.METRICS_BY_NAME[metric].buckets) + 1)  # registered, never used: no observation
    walk = _quantile(st, f"{P}_router_tree_walk_seconds", 0.99)
    assert 0.0025 <= walk <= 0.005  # 3.5 ms inside the catalogue's (2.5, 5] ms bucket, not Dynamo's 7.29 ms bound
    result = checks.evaluate(st).results["prefix_tree_walk_latency"]
    assert result.value == pytest.approx(walk) and result.status != "fail"
    text = render_state(st).decode()
    assert f'{metric}_count{{phase="total",router="dynamo-frontend"}} 100' in text


def test_the_former_names_are_read_too_and_a_new_phase_starts_from_its_baseline() -> None:
    former = PAGE.replace("dynamo_router_overhead_", "dynamo_routing_overhead_")
    snap, errors = normalize.parse_router("dynamo-frontend", former)
    assert errors == [] and len(snap.overhead_seconds) == 6
    without = "\n".join(line for line in BASELINE.splitlines() if "scheduling" not in line) + "\n"
    st = _scraped(without, PAGE)  # scheduling first appears with 100 counted: its baseline, not 100 new
    metric = f"{P}_router_overhead_seconds"
    assert sum(st.store.window_buckets(metric, where=lambda labels: labels[1] == "scheduling")[1]) == 0
    assert sum(st.store.window_buckets(metric, where=lambda labels: labels[1] == "total")[1]) == 100
