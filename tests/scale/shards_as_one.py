"""N shard states read as Prometheus reads their series: the test instrument for "one answer".

Prometheus evaluates the generated rules over every shard's series: ``sum`` pools counters,
histogram buckets and the per-worker parts of family-split gauges, a per-process gauge is the
same on every shard (``max``). ``ShardsAsOne`` gives :func:`exporter.checks.evaluate` that view of
N ``ClusterState``s, so the checks, the five groups' statuses and the chain's verdict computed over
the shards can be compared with one exporter's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from exporter.series_view import Series
from exporter.state import ClusterState
from prefixscope import catalog

T = TypeVar("T")
P = catalog.NAMESPACE
# Gauges a family shard exports its part of (Prometheus sums them); every other gauge comes from
# the one shard that owns it (a worker's home shard) or is the same on every shard: max.
SUMMED_GAUGES = {f"{P}_worker_resident_blocks", f"{P}_prefix_tree_root_fanout", f"{P}_prefix_tree_nodes",
                 f"{P}_prefix_tree_blocks"}


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


class _Store:
    def __init__(self, stores: Sequence) -> None:
        self.stores = stores

    def window_by_worker(self, metric: str) -> dict[str, float]:
        return _sum([s.window_by_worker(metric) for s in self.stores])

    def window_rows(self, metric: str) -> dict:
        return _rows([s.window_rows(metric) for s in self.stores])

    def baseline_rows(self, metric: str) -> dict:
        return _rows([s.baseline_rows(metric) for s in self.stores])


class _Cum:
    def __init__(self, cums: Sequence) -> None:
        self.counters = {}
        for c in cums:
            for name, series in c.counters.items():
                self.counters.setdefault(name, {}).update(series)


class ShardsAsOne:
    """The read side of a ClusterState that ``exporter.checks`` uses, over N shard states."""

    def __init__(self, states: Sequence[ClusterState]) -> None:
        self.states = states
        first = states[0]
        self.thresholds, self.window_s, self.clock = first.thresholds, first.window_s, first.clock
        self.store = _Store([s.store for s in states])
        self.cum = _Cum([s.cum for s in states])

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

    def window_counter(self, metric: str, where=None) -> float | None:
        got = [v for s in self.states if (v := s.window_counter(metric, where)) is not None]
        return sum(got) if got else None

    def window_buckets(self, metric: str, window_s: float | None = None, where=None):
        got = [b for s in self.states if (b := s.window_buckets(metric, window_s, where))]
        if not got:
            return None
        return got[0][0], [sum(c) for c in zip(*(b[1] for b in got), strict=True)]

    def health_increase(self, name: str) -> float | None:
        got = [v for s in self.states if (v := s.health_increase(name)) is not None]
        return sum(got) if got else None
