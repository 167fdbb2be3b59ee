"""The series view: every catalogue series as plain data, built from the state in one pass.

The collector and the text exposition render a :class:`Series`; the checks read it. Counters and
histograms come from the metric store and the exporter's ``Health``; gauges are derived here from
the worker pool, the index, the tree statistics and the hotspots. A value without a source is
left out (missing), never written as 0.

``build_series`` runs under the state lock (``ClusterState.series`` is called via ``snapshot_for``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from exporter.hotspots import branch_label
from exporter.prefix_index import CORE
from exporter.windows import LabelValues
from prefixscope import __version__, catalog

if TYPE_CHECKING:
    from exporter.state import ClusterState

P = catalog.NAMESPACE
UNKNOWN = "unknown"
# Freshness series of a worker's KV stream, dropped once it has left the pool.
KV_FRESHNESS = (f"{P}_kv_event_last_timestamp_seconds", f"{P}_kv_event_lag_seconds")

# A gauge-histogram's observations: the values, or a value -> count map.
GaugeHistogramObservations = Sequence[float] | Counter[int]


@dataclass
class Series:
    """Current values: counters and gauges per label values, histogram rows
    ([per-bucket counts..., +Inf, sum]) and gauge-histogram observations (values or value counts)."""

    counters: dict[str, dict[LabelValues, float]] = field(default_factory=dict)
    gauges: dict[str, dict[LabelValues, float]] = field(default_factory=dict)
    histograms: dict[str, dict[LabelValues, list[float]]] = field(default_factory=dict)
    gaugehistograms: dict[str, GaugeHistogramObservations] = field(default_factory=dict)
    signals: dict[str, bool] = field(default_factory=dict)


def build_series(st: ClusterState) -> Series:
    """Every catalogue series as plain data, from the state and the exporter's Health."""
    out = Series()
    _counters_and_histograms(st, out)
    _pool_gauges(st, out)
    _worker_gauges(st, out)
    _tree_and_hotspots(st, out)
    _routers(st, out)
    signals = st.signals_locked()
    out.gauges[f"{P}_signal_available"] = {(s,): 1.0 if v else 0.0 for s, v in signals.items()}
    out.gauges[f"{P}_exporter_build_info"] = {(__version__, CORE): 1.0}
    out.gaugehistograms[f"{P}_session_hit_ratio"] = st.session_hit_ratios()
    out.signals = signals
    return out


def _counters_and_histograms(st: ClusterState, out: Series) -> None:
    h_counters, h_gauges = st.health.snapshot()
    for name, s in st.store.cum.counters.items():
        out.counters[name] = dict(s)
    for name, s in h_counters.items():
        out.counters.setdefault(name, {}).update(s)
    for name, s in h_gauges.items():
        out.gauges[name] = dict(s)
    for name, s in st.store.cum.histograms.items():
        out.histograms[name] = {k: list(v) for k, v in s.items()}


def _pool_gauges(st: ClusterState, out: Series) -> None:
    g, pool = out.gauges, st.worker_pool
    if f"{P}_up" in g:
        pool.track_down_targets()
        g[f"{P}_telemetry_blind_targets"] = {(): float(pool.blind_targets())}
        # A worker that left the pool has no KV stream to keep fresh: its silence is the
        # fleet event step 2 reads, not a stale index, so its freshness series go away.
        for target, _kind in pool.left_pool_targets():
            for name in KV_FRESHNESS:
                g.get(name, {}).pop((target,), None)
    g[f"{P}_worker_pool_size"] = {(): float(len(pool.pool))}
    out.counters.setdefault(f"{P}_worker_pool_changes", {}).setdefault((), 0.0)
    if pool.changes and pool.changes[-1].reshuffled_share is not None:
        g[f"{P}_session_reshuffle_ratio"] = {(): pool.changes[-1].reshuffled_share}
    g[f"{P}_fallback_active"] = {(t,): v for t, v in st.fallback_active().items()}


def _worker_gauges(st: ClusterState, out: Series) -> None:
    g, topology = out.gauges, st.topology
    seen = st.workers_seen()
    for w in seen:
        info = st.worker_pool.workers.get(w)
        snap = info.snapshot if info else None
        if snap is not None and snap.kv_usage_ratio is not None:
            g.setdefault(f"{P}_worker_kv_cache_usage_ratio", {})[(w, snap.model or UNKNOWN)] = snap.kv_usage_ratio
        cap = st.worker_capacity(w)
        if cap is not None:
            g.setdefault(f"{P}_worker_capacity_blocks", {})[(w,)] = float(cap)
        if (info and info.block_size) or topology is not None:
            g.setdefault(f"{P}_worker_block_size_tokens", {})[(w,)] = float(st.worker_block_size(w))
    if topology is not None:
        g[f"{P}_worker_info"] = {
            (t.name, t.node, t.nvlink_domain, t.gpu_class, "true" if t.warm_pool else "false"): 1.0
            for t in (topology.worker(w) for w in seen if w in topology)}
    for w, n in st.index.resident_by_worker().items():
        g.setdefault(f"{P}_worker_resident_blocks", {})[(w,)] = float(n)
    for w, u in st.warm_pool_utilization().items():
        g.setdefault(f"{P}_warm_pool_utilization_ratio", {})[(w,)] = u
    values = st.effective_cache_values()
    ranks = st.removal_ranks(values)
    g[f"{P}_worker_effective_cache_value_tokens"] = {(w,): v for w, v in values.items()}
    g[f"{P}_worker_removal_rank"] = {(w,): float(r) for w, r in ranks.items()}


def _tree_and_hotspots(st: ClusterState, out: Series) -> None:
    g, gh = out.gauges, out.gaugehistograms
    stats = st.tree_stats()  # the latest background pass; None (missing) before the first
    if stats is not None:
        g[f"{P}_prefix_tree_root_fanout"] = {(): float(stats.root_fanout)}
        g[f"{P}_prefix_tree_nodes"] = {(): float(stats.nodes)}
        g[f"{P}_prefix_tree_blocks"] = {(): float(stats.blocks)}
        gh[f"{P}_prefix_tree_leaf_depth"] = stats.leaf_depths
        gh[f"{P}_prefix_tree_leaf_block_depth"] = stats.leaf_block_depths
        gh[f"{P}_prefix_tree_node_fanout"] = stats.fanouts
        gh[f"{P}_prefix_tree_block_replicas"] = stats.replicas
    g[f"{P}_hot_branch_hit_tokens"] = {(str(i + 1), branch_label(b)): tok
                                     for i, (b, tok) in enumerate(st.hot_branch_tokens(stats))}


def _routers(st: ClusterState, out: Series) -> None:
    for snap in st.worker_pool.routers.values():
        for w, v in snap.decisions.items():
            out.counters.setdefault(f"{P}_router_decisions", {})[(snap.router, w)] = v
        for o, v in snap.prefix_outcomes.items():
            out.counters.setdefault(f"{P}_router_prefix_outcomes", {})[(snap.router, o)] = v
        for w, v in snap.healthy.items():
            out.gauges.setdefault(f"{P}_router_worker_healthy", {})[(snap.router, w)] = v
