"""The series view: every catalogue series as plain data, built from the state in one pass.

The collector and the text exposition render a :class:`Series`; the checks read it. Counters and
histograms come from the metric store and the exporter's ``Health``; gauges are derived here from
the worker pool, the index, the tree statistics and the hotspots. A value without a source is
left out (missing), never written as 0.

``build_series`` runs under the state lock (``ClusterState.series`` is called via ``snapshot_for``).

What it costs per scrape, and what it does not depend on: a copy of each counter and histogram
family and one pass over the workers (both linear in the series /metrics shows, which the
cardinality limits bound); the session hit ratios of the sessions active in the window
(``SessionTable.active_since``: not the hour of sessions the table keeps); the hot branches of
the window's distinct hit chains (``Hotspots.hot_branch_tokens``: not the hour of hits the
history keeps, and nothing at all while neither the hits nor the tree changed); the tree
statistics are the background pass's, never computed here. So a scrape of an exporter that
has run for hours costs what one of a fresh exporter with the same window traffic costs.
Rendering the text is ``exporter.web.exposition``'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from exporter.core.hotspots import branch_label
from exporter.core.index.prefix_index import CORE
from exporter.core.index.tiers import GPU, gpu_resident, medium_capacity
from exporter.core.windows import LabelValues
from exporter.core.worker_pool import DEFAULT_BLOCK_SIZE
from prefixscope import __version__, catalog

if TYPE_CHECKING:
    from exporter.core.state import ClusterState
    from prefixscope.topology import Topology

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
    # the shard plan: Prometheus counts the shards reporting against the count they expect
    out.gauges[f"{P}_exporter_shards"] = {(str(st.shard.index),): float(st.shard.count)}
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
    g[f"{P}_fallback_active"] = {(t,): v for t, v in st.accounting.fallback_active().items()}


def _worker_gauges(st: ClusterState, out: Series) -> None:
    g, topology = out.gauges, st.topology
    seen = st.workers_seen()
    workers = st.worker_pool.workers
    media = st.index.resident_by_medium()
    usage: dict[LabelValues, float] = {}
    capacity: dict[LabelValues, float] = {}
    block_size: dict[LabelValues, float] = {}
    medium_cap: dict[LabelValues, float] = {}
    offload_usage: dict[LabelValues, float] = {}
    # One pass over the workers, reading each one's snapshot once, with
    # WorkerPool.worker_capacity and worker_block_size inlined: a scrape reads them for every
    # worker, and a live scrape reads a thousand workers (exporter.web.exposition's docstring).
    default_block_size = float(getattr(topology, "block_size", 0) or DEFAULT_BLOCK_SIZE)
    topo_of = st.worker_pool.topo_of
    for w in seen:
        lab = (w,)
        info = workers.get(w)
        snap = info.snapshot if info is not None else None
        if snap is not None:
            if snap.kv_usage_ratio is not None:
                usage[(w, snap.model or UNKNOWN)] = snap.kv_usage_ratio
            cap = snap.num_gpu_blocks or None
            offload = snap.offload_usage_ratio
        else:
            cap = offload = None
        if cap is None:
            t = topo_of(w)
            cap = t.kv_blocks if t is not None else None
        if cap is not None:
            capacity[lab] = float(cap)
        if info is not None and info.block_size:
            block_size[lab] = float(info.block_size)
        elif topology is not None and topology.block_size:  # (one only discovery placed has none)
            block_size[lab] = default_block_size
        if offload:
            for m, c in medium_capacity(cap, offload, media.get(w)).items():
                medium_cap[(w, m)] = c
            for m, u in offload.items():
                offload_usage[(w, m)] = u
        elif cap:  # medium_capacity without offload tiers: the GPU's alone
            medium_cap[(w, GPU)] = float(cap)
    for name, values in ((f"{P}_worker_kv_cache_usage_ratio", usage), (f"{P}_worker_capacity_blocks", capacity),
                         (f"{P}_worker_block_size_tokens", block_size)):
        if values:
            g.setdefault(name, {}).update(values)
    if topology is not None:
        g[f"{P}_worker_info"] = _worker_info(topology, seen)
    resident = {(w,): float(n) for w, n in gpu_resident(st.index).items()}  # against GPU capacity
    if resident:
        g.setdefault(f"{P}_worker_resident_blocks", {}).update(resident)
    _media_gauges(st, g, media, medium_cap, offload_usage)
    warm = {(w,): u for w, u in st.worker_pool.warm_pool_utilization().items()}
    if warm:
        g.setdefault(f"{P}_warm_pool_utilization_ratio", {}).update(warm)
    values = st.scrapes.effective_cache_values()
    ranks = st.scrapes.removal_ranks(values)
    g[f"{P}_worker_effective_cache_value_tokens"] = {(w,): v for w, v in values.items()}
    # In the workers' order, not the ranks' (which moves with every value): the renderer reads a
    # family fastest when its label sets come in the same order as at the last scrape.
    g[f"{P}_worker_removal_rank"] = {(w,): float(ranks[w]) for w in values}


# The worker_info series of the last scrape: they change only with the topology or the workers
# seen, and a scrape would otherwise build a thousand five-value label sets each time.
_info_cache: tuple[object, tuple[str, ...], dict[LabelValues, float]] | None = None


def _worker_info(topology: Topology, seen: list[str]) -> dict[LabelValues, float]:
    global _info_cache
    key = tuple(seen)
    cached = _info_cache
    if cached is not None and cached[0] is topology and cached[1] == key:
        return dict(cached[2])
    by_name = {t.name: t for t in topology.workers}
    info = {(t.name, t.node, t.nvlink_domain, t.gpu_class, "true" if t.warm_pool else "false"): 1.0
            for t in (by_name[w] for w in seen if w in by_name)}
    _info_cache = (topology, key, info)
    return dict(info)


def _media_gauges(st: ClusterState, g: dict[str, dict[LabelValues, float]], media: dict[str, dict[str, int]],
                  capacity: dict[LabelValues, float], usage: dict[LabelValues, float]) -> None:
    """Resident blocks per cache tier (medium) and per LoRA adapter and tenant, from KV events;
    each tier's capacity and offload usage (gathered by ``_worker_gauges``' pass)."""
    g.update(st.attribution.gauges(media))
    g[f"{P}_worker_medium_resident_blocks"] = {(w, m): float(n) for w, by in media.items() for m, n in by.items()}
    g.setdefault(f"{P}_worker_medium_capacity_blocks", {}).update(capacity)
    if usage:
        g[f"{P}_worker_offload_usage_ratio"] = usage


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
    c, g = out.counters, out.gauges
    for snap in st.worker_pool.routers.values():
        r = snap.router
        for name, into, values in ((f"{P}_router_decisions", c, snap.decisions),
                                   (f"{P}_router_prefix_outcomes", c, snap.prefix_outcomes),
                                   (f"{P}_router_worker_healthy", g, snap.healthy),
                                   (f"{P}_router_engine_hit_ratio", g, snap.engine_hit_ratio)):
            if values:
                into.setdefault(name, {}).update({(r, k): v for k, v in values.items()})
        if snap.largest_tree is not None and snap.tree_bound:
            g.setdefault(f"{P}_router_tree_fill_ratio", {})[(r,)] = snap.largest_tree / snap.tree_bound
