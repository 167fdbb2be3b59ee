"""The parts a :class:`~exporter.core.state.ClusterState` is a facade over, built before it.

:func:`build_parts` makes each part once and hands each the parts it works with (the record and
KV accounting get the index, the pool, the store, the trackers and the state's one lock), the way
``exporter.bootstrap`` builds the exporter: a part's collaborators arrive, none is reached into
afterwards. What only the composition root knows is an argument: a shard's shared root tracker
(``exporter.core.sharding.SharedRoots``), the KV source's rebuild requests, a replay's run-long
window.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from exporter.core.attribution import Attribution
from exporter.core.cardinality import RecordLabels
from exporter.core.health import Health
from exporter.core.health_window import HealthIncreases
from exporter.core.hotspots import Hotspots
from exporter.core.index.eviction import DEFAULT_MEMORY
from exporter.core.index.prefix_index import EvictionTracker, PrefixIndex
from exporter.core.index.prefix_instability import RootTracker
from exporter.core.input_time import InputTime
from exporter.core.kv_accounting import KV_MISSED, KV_REPAIRS, KvAccounting
from exporter.core.metric_store import MetricStore
from exporter.core.record_accounting import RecordAccounting, miss_cost_factor
from exporter.core.scrape_accounting import ScrapeAccounting
from exporter.core.sessions import SessionTable
from exporter.core.sharding import UNSHARDED, ShardSpec
from exporter.core.worker_pool import WorkerPool
from exporter.model import Limits, RebuildRequest
from prefixscope import catalog
from prefixscope.thresholds import Thresholds
from prefixscope.topology import Topology

_INGEST_ERRORS = catalog.METRICS_BY_NAME[f"{catalog.NAMESPACE}_ingest_errors"].name


@dataclass(frozen=True)
class StateParts:
    health: Health
    thresholds: Thresholds
    topology: Topology | None
    window_s: float  # the windows' length (store, trackers, labels)
    clock: Callable[[], float]
    top_k: int
    lock: threading.Lock  # the state's one lock: every part is read and written under it
    time: InputTime
    index: PrefixIndex
    sessions: SessionTable
    store: MetricStore
    worker_pool: WorkerPool
    hotspots: Hotspots
    accounting: RecordAccounting
    attribution: Attribution
    kv: KvAccounting
    scrapes: ScrapeAccounting
    health_increases: HealthIncreases
    # the reads divide by the time since the first input instead (a replay's answer for the whole run)
    run_window: bool = False
    # which family shard of how many this state is (exported, so Prometheus sees a missing shard)
    shard: ShardSpec = UNSHARDED


def build_parts(health: Health, thresholds: Thresholds, topology: Topology | None = None, *,
                window_s: float = 300.0, clock: Callable[[], float] = time.time, top_k: int = 10,
                max_sessions: int | None = None, health_recency_s: float = 60.0, limits: Limits | None = None,
                eviction_memory: int = DEFAULT_MEMORY, roots: RootTracker | None = None,
                rebuild_request: RebuildRequest | None = None, pinned_workers: Iterable[str] = (),
                run_window: bool = False, down_grace_s: float = math.inf,
                shard: ShardSpec = UNSHARDED) -> StateParts:
    """Every part of a state. ``roots``: the root tracker (a fresh one over the window unless a
    shard hands in its shared one); ``rebuild_request``: where a drifted view is sent to be rebuilt
    (the KV source's), None without one; ``pinned_workers``: workers the config names, whose
    records are never folded into "other"; ``run_window``: the reads cover the whole run so far;
    ``down_grace_s``: a worker target down this long has left the pool (never blind); ``shard``: this
    state's family shard (exported as ``prefixscope_exporter_shards``)."""
    limits = limits or Limits()
    window_s = float(window_s)
    lock, now = threading.Lock(), InputTime()
    index = PrefixIndex()
    sessions = SessionTable(max_sessions=max_sessions or limits.sessions)
    store = MetricStore(window_s, getattr(thresholds, "baseline_window_s", 86400.0),
                        thresholds if isinstance(thresholds, Thresholds) else None)  # the healthy baseline's judge
    pool = WorkerPool(health, now, health_recency_s, topology, down_grace_s)
    hotspots = Hotspots(index, limits.hit_history)
    labels = RecordLabels(limits, window_s)
    labels.pin_workers(pinned_workers)
    accounting = RecordAccounting(now, store, pool, index, sessions, hotspots, topology,
                                  float(getattr(thresholds, "cold_reuse_share", 0.1)), labels,
                                  miss_cost_factor(thresholds))
    # resident blocks and hits per LoRA adapter and tenant (KV events' raw fields, records)
    attribution = Attribution(store, limits.adapters, limits.tenants, max(float(limits.label_idle), window_s))
    kv = KvAccounting(now, store, pool, index, EvictionTracker(window_s, eviction_memory),
                      roots if roots is not None else RootTracker(window_s), attribution.kv, health, lock,
                      topology=topology, window_s=window_s, rebuild_request=rebuild_request)
    return StateParts(health=health, thresholds=thresholds, topology=topology, window_s=window_s, clock=clock,
                      top_k=top_k, lock=lock, time=now, index=index, sessions=sessions, store=store,
                      worker_pool=pool, hotspots=hotspots, accounting=accounting, attribution=attribution, kv=kv,
                      scrapes=ScrapeAccounting(store, pool, index, accounting.field_seen,
                                               max(float(limits.label_idle), window_s)),
                      health_increases=HealthIncreases(health, now, window_s, (KV_MISSED, KV_REPAIRS, _INGEST_ERRORS)),
                      run_window=run_window, shard=shard)
