"""N shard states read as Prometheus reads their series: the test instrument for "one answer".

Prometheus evaluates the generated rules over every shard's series: ``sum`` pools counters,
histogram buckets and the per-worker parts of family-split gauges, a per-process gauge is the
same on every shard (``max``). ``ShardsAsOne`` gives :func:`exporter.core.checks.evaluate` that view of
N ``ClusterState``s, so the checks, the five groups' statuses and the chain's verdict computed over
the shards can be compared with one exporter's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.series_view import Series
from exporter.core.state import ClusterState
from exporter.web.collector import PrefixscopeCollector
from prefixscope import catalog

T = TypeVar("T")
P = catalog.NAMESPACE
# Gauges a family shard exports its part of (Prometheus sums them); every other gauge comes from
# the one shard that owns it (a worker's home shard) or is the same on every shard: max.
SUMMED_GAUGES = {f"{P}_worker_resident_blocks", f"{P}_prefix_tree_root_fanout", f"{P}_prefix_tree_nodes",
                 f"{P}_prefix_tree_blocks"}

# Per-process gauges: every shard exports its own, equal on all (max over shards is the cluster's).
PER_PROCESS = {f"{P}_exporter_build_info", f"{P}_signal_available", f"{P}_worker_pool_size",
               f"{P}_worker_pool_changes_total"}
# Not pooled by a sum: top-K lists (the top K of the shards' top-K lists is the cluster's), and
# per-worker values computed from a shard's part (docs/operating.md).
NOT_SUMMED = {f"{P}_hot_branch_hit_tokens", f"{P}_worker_effective_cache_value_tokens",
              f"{P}_worker_removal_rank", f"{P}_session_reshuffle_ratio",
              # the shard plan: each process its own index, the count as value (one exporter: 0 of 1)
              f"{P}_exporter_shards"}


def samples(collector: PrefixscopeCollector) -> dict[tuple, float]:
    """A collector's exposition: (sample name, sorted labels) -> value."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}


def pooled_differences(one: dict[tuple, float], shards: Sequence[dict[tuple, float]],
                       timed: frozenset[str] = frozenset()) -> tuple[list, int]:
    """Where the shards' samples, pooled as Prometheus pools them, differ from one exporter's
    (zero-valued samples aside), and how many metric names were compared. ``timed``: samples
    measured on each process's own clock (lag, ages): only their label sets must agree."""
    total: Counter = Counter()
    peak: dict[tuple, float] = {}
    for part in shards:
        for k, v in part.items():
            total[k] += v
            peak[k] = max(peak.get(k, v), v)
    diffs, compared = [], 0
    for name in sorted(({k[0] for k in one} | set(k[0] for k in total)) - NOT_SUMMED):
        got = peak if name in PER_PROCESS else total
        want = {k: v for k, v in one.items() if k[0] == name and v}
        have = {k: v for k, v in got.items() if k[0] == name and v}
        compared += 1
        if name in timed:
            diffs += [(k, "label set") for k in want.keys() ^ have.keys()]
            continue
        for k in want.keys() | have.keys():
            if not math.isclose(have.get(k, 0.0), want.get(k, 0.0), rel_tol=1e-9):
                diffs.append((k, want.get(k), have.get(k)))
    return diffs, compared


def _sum(dicts: Sequence[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _rows(dicts: Sequence[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, row in d.items():
            acc = out.setdefault(k, [0] * len(row))
            for i, c in enumerate(row):
                acc[i] += c
    return out


class _Cum:
    def __init__(self, cums: Sequence) -> None:
        self.counters = {}
        for c in cums:
            for name, series in c.counters.items():
                self.counters.setdefault(name, {}).update(series)


class _Store:
    def __init__(self, stores: Sequence) -> None:
        self.stores = stores
        self.cum = _Cum([s.cum for s in stores])

    def window_by_worker(self, metric: str) -> dict[str, float]:
        return _sum([s.window_by_worker(metric) for s in self.stores])

    def window_rows(self, metric: str) -> dict:
        return _rows([s.window_rows(metric) for s in self.stores])

    def baseline_rows(self, metric: str) -> dict:
        return _rows([s.baseline_rows(metric) for s in self.stores])

    def healthy_baseline_rows(self, metric: str) -> dict | None:
        # every shard keeps the cluster's baseline (it sees every record's cold prefill): summed, as above
        parts = [s.healthy_baseline_rows(metric) for s in self.stores]
        return None if any(p is None for p in parts) else _rows(parts)  # type: ignore[arg-type]

    def window_counter(self, metric: str, where=None) -> float | None:
        got = [v for s in self.stores if (v := s.window_counter(metric, where)) is not None]
        return sum(got) if got else None

    def window_buckets(self, metric: str, window_s: float | None = None, where=None):
        got = [b for s in self.stores if (b := s.window_buckets(metric, window_s, where))]
        if not got:
            return None
        return got[0][0], [sum(c) for c in zip(*(b[1] for b in got), strict=True)]


class _HealthIncreases:
    def __init__(self, parts: Sequence) -> None:
        self.parts = parts
        self.names = frozenset().union(*(p.names for p in parts))  # the exporter's own health counters

    def increase(self, name: str) -> float | None:
        got = [v for p in self.parts if (v := p.increase(name)) is not None]
        return sum(got) if got else None


class ShardsAsOne:
    """The read side of a ClusterState that ``exporter.core.checks`` uses, over N shard states."""

    def __init__(self, states: Sequence[ClusterState]) -> None:
        self.states = states
        first = states[0]
        self.thresholds, self.window_s, self.clock = first.thresholds, first.window_s, first.clock
        self.store = _Store([s.store for s in states])
        self.health_increases = _HealthIncreases([s.health_increases for s in states])

    def snapshot_for(self, fn: Callable[[ShardsAsOne], T]) -> T:
        return fn(self)

    def series(self) -> Series:
        parts = [s.series() for s in self.states]
        out = Series()
        out.signals = {k: any(p.signals.get(k, False) for p in parts) for k in parts[0].signals}
        for name in {n for p in parts for n in p.counters}:
            out.counters[name] = _sum([p.counters.get(name, {}) for p in parts])
        for name in {n for p in parts for n in p.histograms}:
            out.histograms[name] = _rows([p.histograms.get(name, {}) for p in parts])
        for name in {n for p in parts for n in p.gauges}:
            values = [p.gauges.get(name, {}) for p in parts]
            if name in SUMMED_GAUGES:
                out.gauges[name] = _sum(values)
            else:
                merged: dict = {}
                for d in values:
                    for k, v in d.items():
                        merged[k] = max(merged.get(k, v), v)
                out.gauges[name] = merged
        for name in {n for p in parts for n in p.gaugehistograms}:
            obs = [p.gaugehistograms[name] for p in parts if name in p.gaugehistograms]
            if all(isinstance(o, Counter) for o in obs):
                out.gaugehistograms[name] = sum(obs, Counter())
            else:
                out.gaugehistograms[name] = [v for o in obs for v in (o.elements() if isinstance(o, Counter) else o)]
        return out
