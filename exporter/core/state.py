"""ClusterState: the exporter's pure core. Sources call it (``StateSink``); the collector, the
checks and the JSON API read it.

The state is a facade over parts that each hold one thing, all on the same input-time clock
(``exporter.core.input_time``) and all guarded by the state's one lock — sources hand over whole
batches, so it is taken once per batch:

- ``store`` (``exporter.core.metric_store``): every counter and histogram of the catalogue, kept
  twice — cumulative for /metrics and in a sliding window for the exporter's own checks;
- ``worker_pool`` (``exporter.core.worker_pool``): known workers and routers, the healthy set, pool
  changes, and which down targets have left the pool;
- ``accounting`` (``exporter.core.record_accounting``): what one request record adds to which series;
- ``hotspots`` (``exporter.core.hotspots``): the hit and new-session history behind hot branches and
  "what changed";
- the series view (``exporter.core.series_view``): the ``Series`` snapshot the collector renders.

The state itself applies KV batches and scrapes, and owns the prefix index, the session table
and the tree statistics. Tree statistics (depths, fan-out, duplication) are never computed by a
reader: ``refresh_tree_stats`` reads them under the lock in short holds (the compiled index keeps
the counters at apply time and walks its live tree for the depths, a slice per hold — the only
ingest pause) and builds the result outside it; /metrics, the checks and the API read the latest
completed one. The exporter's runtime calls it in the background (``exporter.loops.tree_refresher``);
tests and offline replays call it explicitly.

KV-event stream health split: sources count what they see on the wire (sequence gaps, missed
batches, replays, decode errors); the state counts what applying the events did (batches,
events applied, unknown parents and removals, restarts, last batch time and lag).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from exporter.core.attribution import Attribution
from exporter.core.cardinality import RecordLabels
from exporter.core.health import Health, LabelValues
from exporter.core.health_window import HealthIncreases
from exporter.core.hotspots import HISTORY_S, MAX_HISTORY_EVENTS, Hotspots, branch_label
from exporter.core.index.eviction import DEFAULT_MEMORY, BatchEvictions
from exporter.core.index.prefix_index import (
    EvictionTracker,
    PrefixIndex,
    TreeStats,
    compute_stats,
    pass_in_slices,
)
from exporter.core.index.prefix_instability import (
    COMPARED_BLOCKS,
    EARLY_SPAN_BLOCKS,
    MIN_SHARED_BLOCKS,
    ROOT_KEYS,
    RootBatch,
    RootTracker,
)
from exporter.core.index.tiers import GPU
from exporter.core.input_time import InputTime
from exporter.core.metric_store import LabelFilter, MetricStore
from exporter.core.record_accounting import (
    DEFAULT_BLOCK_SIZE,
    EVENT_FIELDS,
    MIGRATION_KINDS,
    RECORD_FIELD_SIGNALS,
    UNKNOWN,
    RecordAccounting,
    miss_cost_factor,
)
from exporter.core.series_view import Series, build_series
from exporter.core.sessions import SessionTable
from exporter.core.windows import Cumulative, WindowedBuckets, WindowedSum, increase
from exporter.core.worker_pool import PoolChange, WorkerInfo, WorkerPool
from exporter.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    Limits,
    RouterSnapshot,
    WorkerSnapshot,
    new_root_event,
    unlabelled_events,
)
from prefixscope import catalog
from prefixscope.records import InvalidRecord, RequestRecord
from prefixscope.thresholds import Thresholds
from prefixscope.topology import Topology, WorkerTopo

__all__ = [
    "DEFAULT_BLOCK_SIZE", "EVENT_FIELDS", "HISTORY_S", "MAX_HISTORY_EVENTS", "MIGRATION_KINDS", "NO_TREE",
    "RECORD_FIELD_SIGNALS", "SNAPSHOT_COUNTERS", "TREE_CHILDREN_DEPTH", "UNKNOWN", "ClusterState", "PoolChange",
    "Series", "TreeStatsTiming", "WorkerInfo", "branch_label",
]

P = catalog.NAMESPACE
# Radix edges whose runs and child lists every statistics pass keeps: the API's default tree depth,
# which also covers the hot branches' runs (radix depth ≤ 2). A deeper tree request runs a pass of its own.
TREE_CHILDREN_DEPTH = 4
NO_TREE = TreeStats(version=-1)  # before the first pass: no branching known, chains map to their first block

# WorkerSnapshot counter field -> catalogue counter it is exported as (labels worker, model).
SNAPSHOT_COUNTERS: dict[str, str] = {
    "prefix_queried_tokens": f"{P}_prefix_cache_queried_tokens",
    "prefix_hit_tokens": f"{P}_prefix_cache_hit_tokens",
    "spec_draft_tokens": f"{P}_spec_decode_draft_tokens",
    "spec_accepted_tokens": f"{P}_spec_decode_accepted_tokens",
    "external_queried_tokens": f"{P}_external_prefix_cache_queried_tokens",
    "external_hit_tokens": f"{P}_external_prefix_cache_hit_tokens",
}
_TIER_HITS = f"{P}_prefix_cache_tier_hit_tokens"  # labels worker, model, tier


def _m(name: str) -> catalog.Metric:
    return catalog.METRICS_BY_NAME[f"{P}_{name}"]


# Series every KV batch updates, looked up in the catalogue once (a missing one fails at import).
_KV_BATCHES = _m("kv_event_batches").name
_KV_APPLIED = _m("kv_events_applied").name
_KV_UNKNOWN_PARENT = _m("kv_event_unknown_parent").name
_KV_UNKNOWN_REMOVALS = _m("kv_event_unknown_block_removals").name
_KV_MISSED = _m("kv_event_missed_batches").name
_KV_LOST = _m("kv_event_lost_batches").name
_KV_REPAIRS = _m("kv_index_repairs").name
_KV_UNRELIABLE = _m("kv_view_unreliable").name
_BLOCKS_STORED = _m("kv_blocks_stored").name
_BLOCKS_EVICTED = _m("kv_blocks_evicted").name
_BLOCKS_RESTORED = _m("kv_blocks_restored_after_eviction").name
_EVICTION_AGE = _m("kv_block_eviction_age_seconds").name
_ROOT_BRANCHES = _m("prefix_root_branches").name
_UNSTABLE_ROOTS = _m("prefix_unstable_root_branches").name
_KV_LAST_TS = _m("kv_event_last_timestamp_seconds").name
_KV_LAG = _m("kv_event_lag_seconds").name
_KV_PLACEMENTS = _m("kv_placement_decisions").name
_KV_PLACEMENT_HITS = _m("kv_placement_domain_hits").name
_WORKER_RESTARTS = _m("worker_restarts").name
_INGEST_ERRORS = _m("ingest_errors").name
_POOL_CHANGES = _m("worker_pool_changes").name
_STORED, _REMOVED, _CLEARED = BlockStored.__name__, BlockRemoved.__name__, AllBlocksCleared.__name__  # event label

# RouterSnapshot histogram -> the catalogue histogram it feeds, the signal it instruments, its labels.
ROUTER_HISTOGRAMS: tuple[tuple[str, str, str, Callable[[RouterSnapshot], tuple[str, ...]]], ...] = (
    ("lookup_seconds", _m("router_tree_walk_seconds").name, "walk_latency", lambda _snap: ()),
    ("predicted_hit_ratio", _m("router_predicted_hit_ratio").name, "router_predicted_reuse",
     lambda snap: (snap.router,)),
)

# Why a worker's view was repaired (the reason label of prefixscope_kv_index_repairs_total).
LOST_BATCHES = "lost_batches"  # batches lost on the wire that no replay recovered
OVER_CAPACITY = "over_capacity"  # the view holds more GPU blocks than the worker has: provably wrong
REPAIR_REASONS = (LOST_BATCHES, OVER_CAPACITY)
# Asks the KV source to rebuild a worker's view from its replay; False when it cannot (no replay
# endpoint). The source calls ``ClusterState.view_repaired`` when the rebuild is done.
RebuildRequest = Callable[[str, str], bool]

T = TypeVar("T")
RecordInput = RequestRecord | Mapping[str, Any]


@dataclass(frozen=True)
class TreeStatsTiming:
    """Cost of the latest statistics reading: its steps under the state lock (all of them, and the
    longest, which is the ingest pause), and the rest outside it."""

    held_s: float
    pass_s: float
    blocks: int
    max_hold_s: float = 0.0
    slices: int = 1



class _KvLabels:
    """One worker's label tuples for its per-batch series, built once instead of per batch."""

    __slots__ = ("applied_cleared", "applied_removed", "applied_stored", "batches", "lab", "reused_false",
                 "reused_true")

    def __init__(self, worker: str) -> None:
        self.lab = (worker,)
        self.batches = (_KV_BATCHES, self.lab, 1.0)
        self.applied_stored = (worker, _STORED)
        self.applied_removed = (worker, _REMOVED)
        self.applied_cleared = (worker, _CLEARED)
        self.reused_true = (worker, "true")
        self.reused_false = (worker, "false")

def _split_ages(ages: list[tuple[float, bool]]) -> tuple[bool, list[float], list[float]]:
    """(first observation reused, reused ages, fresh ages), each in order (``_prefix_core.split_ages``
    does the same in C)."""
    return (bool(ages) and bool(ages[0][1]), [age for age, r in ages if r is True],
            [age for age, r in ages if r is False])


try:
    from exporter.core.index._prefix_core import split_ages
except ImportError:  # no compiled core in this install
    split_ages = _split_ages


class ClusterState:
    """The cluster-wide prefix index, session table and windows behind every exported number."""

    def __init__(self, health: Health, thresholds: Thresholds, topology: Topology | None = None,
                 window_s: float = 300.0, clock: Callable[[], float] = time.time, top_k: int = 10,
                 max_sessions: int | None = None, health_recency_s: float = 60.0,
                 limits: Limits | None = None, eviction_memory: int = DEFAULT_MEMORY) -> None:
        limits = limits or Limits()
        self.health = health
        self.thresholds = thresholds
        self.topology = topology
        self.window_s = float(window_s)
        self.clock = clock
        self.top_k = top_k
        self.health_recency_s = health_recency_s
        self.cold_reuse_share = float(getattr(thresholds, "cold_reuse_share", 0.1))
        self.lock = threading.Lock()
        self.time = InputTime()
        self.index = PrefixIndex()
        self._tree_stats: TreeStats | None = None  # the latest completed pass (swapped whole)
        self._refresh_lock = threading.Lock()  # one pass at a time
        self.tree_stats_timing: TreeStatsTiming | None = None
        self.sessions = SessionTable(max_sessions=max_sessions or limits.sessions)
        self.store = MetricStore(self.window_s, getattr(thresholds, "baseline_window_s", 86400.0))
        self.worker_pool = WorkerPool(health, self.time, health_recency_s)
        self.hotspots = Hotspots(self.index, limits.hit_history)
        self.accounting = RecordAccounting(self.time, self.store, self.worker_pool, self.index, self.sessions,
                                           self.hotspots, topology, self.cold_reuse_share,
                                           RecordLabels(limits, self.window_s), miss_cost_factor(thresholds))
        self.health_increases = HealthIncreases(health, self.time, self.window_s,
                                                (_KV_MISSED, _KV_REPAIRS, _INGEST_ERRORS))
        self.evictions = EvictionTracker(self.window_s, eviction_memory)
        self.roots = RootTracker(self.window_s)  # new root branches that near-duplicate a recent one
        # resident blocks and hits per LoRA adapter and tenant (KV events' raw fields, records)
        self.attribution = Attribution(self.store, limits.adapters, limits.tenants,
                                       max(float(limits.label_idle), self.window_s))
        self.kv_seen = False
        self.spec_seen = False
        self._kv_workers: set[str] = set()  # workers whose KV health series exist
        self._kv_labels: dict[str, _KvLabels] = {}  # a worker's label tuples, built once (per-batch series)
        # Views that may be wrong: worker -> GPU blocks stored since it was marked.
        self._unreliable: dict[str, int] = {}
        self._rebuilding: set[str] = set()  # workers whose rebuild the KV source is running
        # worker -> input time of its last repair: drift is not checked again within a window (a
        # complete rebuild that still shows the drift means the stream itself says so: no loop)
        self._repaired_at: dict[str, float] = {}
        self._other_media: set[str] = set()  # workers that sent CPU/disk events (the index counts every medium)
        self.rebuild_request: RebuildRequest | None = None  # set by the runtime to the KV subscriber's
        # Batches the compiled reader scanned are applied from its arrays when both parts are compiled.
        self._applies_scans = hasattr(self.index, "apply_scan") and hasattr(self.evictions, "apply_scan")
        # Placement judged from KV events (exporter.core.index.prefix_index_ref's docstring), only with a topology.
        self._placement_out: frozenset[str] = frozenset()  # workers that left the pool, as the index has them
        if topology is not None:
            self.index.set_placement_domains({w.name: w.nvlink_domain for w in topology.workers})

    # ---- the parts' state, under the names readers and tests use -------------------------------
    @property
    def now(self) -> float:
        """The newest input timestamp."""
        return self.time.now

    @property
    def started_at(self) -> float | None:
        return self.time.started_at

    @property
    def cum(self) -> Cumulative:
        return self.store.cum

    @property
    def win(self) -> WindowedSum:
        return self.store.win

    @property
    def hwin(self) -> dict[str, WindowedBuckets]:
        return self.store.hwin

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return self.worker_pool.workers

    @property
    def routers(self) -> dict[str, RouterSnapshot]:
        return self.worker_pool.routers

    @property
    def down_since(self) -> dict[tuple[str, ...], float]:
        return self.worker_pool.down_since

    @property
    def pool(self) -> frozenset[str]:
        """The healthy workers."""
        return self.worker_pool.pool

    @property
    def pool_epoch(self) -> int:
        return self.worker_pool.epoch

    @property
    def pool_changes(self) -> deque[PoolChange]:
        return self.worker_pool.changes

    @property
    def field_seen(self) -> dict[str, float]:
        return self.accounting.field_seen

    @property
    def fallback_last(self) -> dict[str, float]:
        return self.accounting.fallback_last

    @property
    def hit_events(self) -> deque[tuple[float, tuple[int, ...], float, str | None]]:
        return self.hotspots.hit_events

    @property
    def session_events(self) -> deque[tuple[float, str, bool]]:
        return self.hotspots.session_events

    # ---- primitives ----------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.time.now
        if self.worker_pool.departed:
            self._retire_departed(now)
        self.health_increases.sample()
        self.store.expire(now)
        self.accounting.expire_labels(now)
        self.hotspots.expire(now)
        self.sessions.expire(now, HISTORY_S)

    def _update_pool(self, ts: float) -> None:
        if self.worker_pool.update(ts):
            self.store.inc(ts, _POOL_CHANGES, ())

    def topo_of(self, worker: str) -> WorkerTopo | None:
        """The worker's topology entry, if a topology is configured and names it."""
        return self.accounting.topo(worker)


    # ---- health and pool -----------------------------------------------------------------------
    def is_healthy(self, worker: str, down: set[str] | None = None) -> bool:
        """Seen alive recently (record, scrape or KV batch) and not reported down by a scrape or router."""
        return self.worker_pool.is_healthy(worker, down)

    def blind_targets(self) -> int:
        """Targets that fail their scrape while traffic still reaches them (see ``WorkerPool.blind_targets``)."""
        return self.worker_pool.blind_targets()

    def health_increase(self, name: str) -> float | None:
        """Increase of a health counter over the window (None before any sample)."""
        return self.health_increases.increase(name)

    # ---- StateSink -----------------------------------------------------------------------------
    def apply_kv_batch(self, batch: KvBatch, received_at: float, stream: bool = True) -> None:
        """``stream`` False (a family shard that is not the worker's home, exporter.core.sharding): apply
        the events but leave the worker's stream-health series (batches, lag, last timestamp) to its
        home shard, so each exists once across shards."""
        worker = batch.worker
        scan = batch.scan if self._applies_scans else None
        with self.lock:
            self.time.advance(received_at)
            self.kv_seen = True
            w = self.worker_pool.worker(worker, received_at)
            if self.topology is not None:
                self._placement_pool()
                self.index.set_placement_clock(batch.ts)
            if scan is not None:  # the compiled reader's arrays, applied without event objects
                res = self.index.apply_scan(worker, scan)
                if batch.attributed:  # type: ignore[attr-defined]  # (a labelled batch never comes scanned then)
                    if self.attribution.kv.holds_labels(worker):
                        self.attribution.kv.apply_unlabelled(worker, unlabelled_events(batch))
                    else:
                        self.attribution.kv.note_batch()
                ev = self.evictions.apply_scan(worker, scan, received_at)
                got = None
                if scan.roots:  # prefix instability reads root stores only
                    roots = self.roots
                    if type(roots) is RootTracker and ROOT_KEYS:  # their keys computed from the payload in C
                        got = roots.apply_keyed(worker, scan.root_keys(COMPARED_BLOCKS, EARLY_SPAN_BLOCKS,
                                                                       MIN_SHARED_BLOCKS), received_at)
                    else:  # (a shard's shared tracker is fed the events by its sink)
                        got = roots.apply(worker, scan.root_events(new_root_event, COMPARED_BLOCKS), received_at)
                if not w.block_size:
                    w.block_size = scan.block_size
            else:
                events = batch.events
                res = self.index.apply(worker, events)
                if batch.label_events is not None:
                    self.attribution.kv.apply(worker, batch.label_events)
                ev = self.evictions.apply(worker, events, received_at)
                got = self.roots.apply(worker, events, received_at)
                if not w.block_size:
                    w.block_size = next((ev.block_size for ev in events
                                         if isinstance(ev, BlockStored) and ev.block_size), None)
            self._count_evictions(worker, ev, received_at, got,
                                  self._placement_incs(w, res.placements, res.placement_hits) if res.placements else None)
            if not self.worker_pool.unchanged_for(worker):
                self._update_pool(received_at)
            self._expire()
            first = worker not in self._kv_workers
            self._kv_workers.add(worker)
            reliable_again = worker in self._unreliable and self._turnover(worker, ev.stored, res.cleared > 0)
            drift = self._drift(worker, w)
        kl = self._kv_labels.get(worker)
        if kl is None:
            kl = self._kv_labels[worker] = _KvLabels(worker)
        lab = kl.lab
        # The batch's whole health accounting in one Health call (one lock round trip).
        if stream:
            incs = [kl.batches]
            sets = [(_KV_LAST_TS, lab, received_at), (_KV_LAG, lab, max(0.0, received_at - batch.ts))]
        else:
            incs, sets = [], []
        if first and stream:  # these series exist from a worker's first batch: a stream with no gap reads 0, not missing
            incs += [(_WORKER_RESTARTS, lab, 0), (_KV_MISSED, lab, 0), (_KV_LOST, lab, 0), (_KV_UNKNOWN_PARENT, lab, 0),
                     (_KV_UNKNOWN_REMOVALS, lab, 0), *((_KV_REPAIRS, (worker, r), 0) for r in REPAIR_REASONS)]
            sets.append((_KV_UNRELIABLE, lab, 0.0))
        if reliable_again:
            sets.append((_KV_UNRELIABLE, lab, 0.0))
        if res.unknown_parent:
            incs.append((_KV_UNKNOWN_PARENT, lab, res.unknown_parent))
        if res.unknown_removals:
            incs.append((_KV_UNKNOWN_REMOVALS, lab, res.unknown_removals))
        if res.stored_events:
            incs.append((_KV_APPLIED, kl.applied_stored, res.stored_events))
        if res.removed_events:
            incs.append((_KV_APPLIED, kl.applied_removed, res.removed_events))
        if res.cleared:
            incs.append((_KV_APPLIED, kl.applied_cleared, res.cleared))
        self.health.update(incs, sets)
        if drift is not None:
            self._repair(worker, drift)

    def _placement_pool(self) -> None:
        """Tell the index which workers left the pool: their blocks are no placement's prefix, as
        for records (``RecordAccounting._prefix``). Usually none, so this is one empty-dict test."""
        pool = self.worker_pool
        out = frozenset(t for t, kind in pool.left_pool_targets() if kind == "worker") if pool.down_since \
            else frozenset()
        if out != self._placement_out:
            self._placement_out = out
            self.index.set_placement_excluded(out)

    def _placement_incs(self, w: WorkerInfo, placements: int, hits: int) -> list[tuple[str, LabelValues, float]]:
        """A batch's placements judged from its GPU stores, under the worker's model (its scrape's,
        else the topology's)."""
        snap = w.snapshot
        model = (snap.model if snap is not None else None) or getattr(self.topology, "model", None) or UNKNOWN
        lab = (model,)  # (the hits series exists with the decisions: a ratio's numerator reads 0, not missing)
        return [(_KV_PLACEMENTS, lab, placements), (_KV_PLACEMENT_HITS, lab, hits)]

    def _count_evictions(self, worker: str, ev: BatchEvictions, ts: float, roots: RootBatch | None = None,
                         more: list[tuple[str, LabelValues, float]] | None = None) -> None:
        """The eviction and prefix-instability series of one batch (under the lock), the counters in
        one write with the batch's ``more`` (its placements). Both instability counters exist from
        the first judgeable root on, so a fleet without unstable prefixes reads 0; thrash (restored)
        exists wherever stores do."""
        if ev.other_media:
            self._other_media.add(worker)
        stored, evicted, ages = ev.stored, ev.evicted, ev.ages
        if roots is not None and roots.roots:
            incs = [(_ROOT_BRANCHES, (), roots.roots), (_UNSTABLE_ROOTS, (), roots.unstable)]
        elif not (stored or evicted or ages or more):
            return
        else:
            incs = []
        if more:
            incs += more
        kl = self._kv_labels.get(worker)
        if kl is None:
            kl = self._kv_labels[worker] = _KvLabels(worker)
        lab = kl.lab
        store = self.store
        if stored:
            incs += [(_BLOCKS_STORED, lab, stored), (_BLOCKS_RESTORED, lab, ev.restored)]
        if evicted:
            incs.append((_BLOCKS_EVICTED, lab, evicted))
        if incs:
            store.inc_many(ts, incs)
        if ages:  # each label's observations in event order, the label seen first first: as one at a time
            reused_first, reused, fresh = split_ages(ages)
            if reused_first:
                store.observe_many(ts, _EVICTION_AGE, kl.reused_true, reused)
                if fresh:
                    store.observe_many(ts, _EVICTION_AGE, kl.reused_false, fresh)
            else:
                store.observe_many(ts, _EVICTION_AGE, kl.reused_false, fresh)
                if reused:
                    store.observe_many(ts, _EVICTION_AGE, kl.reused_true, reused)

    # ---- view truth: unhealed loss, drift, repair ---------------------------------------------
    def _turnover(self, worker: str, stored: int, cleared: bool) -> bool:
        """Count stores towards an unreliable view's turnover; True when it became reliable again.

        A view marked unreliable may hold blocks the worker evicted and miss blocks it stored. Once
        the worker has stored as many GPU blocks as it has capacity (or its cache was reset), every
        block it held at the mark has most likely been evicted or announced again: reliable again.
        (A block hit all along without being announced again can outlive that; it is one block the
        view misses, not a phantom.) Without a known capacity only a reset or a restart ends it.
        """
        since = self._unreliable.get(worker)
        if since is None:
            return False
        since += stored
        cap = self.worker_capacity(worker)
        if cleared or (cap and since >= cap):
            del self._unreliable[worker]
            return True
        self._unreliable[worker] = since
        return False

    def _drift(self, worker: str, w: WorkerInfo | None = None) -> str | None:
        """A reason to repair the worker's view now, or None (under the lock).

        The only sound check against the worker's own report is an impossible count: more GPU
        blocks resident than ``num_gpu_blocks``. ``kv_cache_usage_perc`` is no bound either way
        (it counts blocks allocated to running requests, cached or not, and counts cached blocks
        nobody references as free: vllm.md §1.4), so it is not compared. Workers that send other
        media (CPU, disk) are skipped: the index counts their blocks together.
        """
        if worker in self._unreliable or worker in self._rebuilding or worker in self._other_media:
            return None
        last = self._repaired_at.get(worker)
        if last is not None and self.time.now - last < self.window_s:
            return None
        cap = self.worker_capacity(worker, w)
        if not cap:  # no bound known: nothing to compare (the resident count is not read)
            return None
        resident = self.index.resident_blocks(worker, GPU)  # the GPU's blocks against the GPU's capacity
        if resident is not None and resident > cap:
            return OVER_CAPACITY
        return None

    def _repair(self, worker: str, reason: str) -> None:
        """Repair a drifted view (outside the lock): it is provably wrong, so it is cleared; the KV
        source rebuilds it from the worker's replay, or, if it cannot, it stays unreliable."""
        with self.lock:
            if worker in self._rebuilding:
                return
            self._rebuilding.add(worker)
        request = self.rebuild_request
        if request is None or not request(worker, reason):
            self.reset_view(worker)
            self.view_repaired(worker, reason, reliable=False)

    def reset_view(self, worker: str) -> None:
        """Forget the worker's view before a rebuild (not a restart: nothing is counted)."""
        with self.lock:
            self.index.clear_worker(worker)
            self.evictions.clear_worker(worker)
            self.attribution.kv.clear_worker(worker)
            self._rebuilding.add(worker)

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """Count one repair; ``reliable`` False leaves the view marked until its cache turns over."""
        with self.lock:
            self._rebuilding.discard(worker)
            self._repaired_at[worker] = self.time.now
            if reliable:
                self._unreliable.pop(worker, None)
            else:
                self._unreliable[worker] = 0
        self.health.update([(_KV_REPAIRS, (worker, reason), 1.0)],
                           [(_KV_UNRELIABLE, (worker,), 0.0 if reliable else 1.0)])

    def unreliable_views(self) -> list[str]:
        with self.lock:
            return sorted(self._unreliable)

    def worker_restarted(self, worker: str, stream: bool = True) -> None:
        """``stream`` False: clear the view without counting the restart (counted by the home shard)."""
        with self.lock:
            self.index.clear_worker(worker)
            self.evictions.clear_worker(worker)
            self.attribution.kv.clear_worker(worker)
            was_unreliable = self._unreliable.pop(worker, None) is not None  # an empty cache is known exactly
        if stream:
            self.health.inc(_WORKER_RESTARTS, (worker,))
        if was_unreliable:
            self.health.set(_KV_UNRELIABLE, (worker,), 0.0)

    # ---- the fleet as service discovery changes it ---------------------------------------------
    def workers_left(self, names: Iterable[str]) -> None:
        """Workers that service discovery (or a reload) dropped. Their caches went with them: their
        views leave the index now, they leave the pool now (a pool change, as any departure), their
        gauges (up, KV freshness) go now, so no check reads a gone worker as down, stale or blind;
        their counters stay until ``label_idle`` (as a worker records stop naming), then go too."""
        names = list(names)
        if not names:
            return
        with self.lock:
            ts = self.time.now
            for name in names:
                self.worker_pool.depart(name, ts)
                self.index.clear_worker(name)
                self.evictions.clear_worker(name)
                self.attribution.kv.clear_worker(name)
                self._unreliable.pop(name, None)
                self._rebuilding.discard(name)
                self._kv_workers.discard(name)
            self._update_pool(ts)
        for name in names:
            self.health.drop_worker(name, counters=False)

    def workers_joined(self, names: Iterable[str], announced: bool = True) -> None:
        """Workers that service discovery (or a reload) added: they keep their own series (never
        folded into ``other``); one that had left is a worker again. ``announced`` (not for the
        fleet found at start): its entering the pool is a pool change."""
        names = list(names)
        with self.lock:
            for name in names:
                self.worker_pool.rejoin(name, announced)
            self.accounting.labels.pin_workers(names)

    def _retire_departed(self, now: float) -> None:
        """Forget departed workers gone for ``label_idle``: their series and their entry."""
        pool, labels = self.worker_pool, self.accounting.labels
        for name, left_at in list(pool.departed.items()):
            if now - left_at < labels.worker.idle_s:
                continue
            del pool.departed[name]
            pool.workers.pop(name, None)
            self.store.drop_label_value("worker", name)
            self.health.drop_worker(name)
            labels.worker.pinned = labels.worker.pinned - {name}
            self._kv_labels.pop(name, None)
            self._repaired_at.pop(name, None)

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        with self.lock:
            self.time.advance(scraped_at)
            w = self.worker_pool.worker(snapshot.worker, scraped_at)
            w.snapshot, w.scraped_at = snapshot, scraped_at
            if snapshot.block_size:
                w.block_size = snapshot.block_size
            model = snapshot.model or UNKNOWN
            prev_queries = w.last_counters.get("prefix_queried_tokens")
            counters = [(fld, metric, (snapshot.worker, model), getattr(snapshot, fld))
                        for fld, metric in SNAPSHOT_COUNTERS.items()]
            counters += [(f"tier:{tier}", _TIER_HITS, (snapshot.worker, model, tier), value)
                         for tier, value in (snapshot.tier_hit_tokens or {}).items()]
            for fld, metric, labels, value in counters:
                if value is None:
                    continue
                if fld.startswith("spec_"):
                    self.spec_seen = True
                prev = w.last_counters.get(fld)
                # A counter that went down was reset (engine restart): its new value is the increase.
                delta = value if prev is None or value < prev else value - prev
                w.last_counters[fld] = value
                self.store.set_total(metric, labels, value, (scraped_at, delta) if prev is not None else None)
                if prev is not None:
                    self.store.add_own(scraped_at, ("worker_delta", fld, snapshot.worker), delta)
            # One worker's scrape: the pool is brought up to date for it alone (no walk over all
            # workers per scrape, which made a round O(W²)).
            if self.worker_pool.note(snapshot.worker, scraped_at):
                self.store.inc(scraped_at, _POOL_CHANGES, ())
            self._expire()
            drift = self._drift(snapshot.worker) if snapshot.worker in self._kv_workers else None
        if drift is not None:
            self._repair(snapshot.worker, drift)
        # An idle worker (nothing running, no prefix-cache query since the last scrape) has no KV
        # events to send: its stream is current as of this scrape, not stale.
        idle = (snapshot.running == 0 and prev_queries is not None
                and snapshot.prefix_queried_tokens == prev_queries)
        last = self.health.gauges.get(_KV_LAST_TS, {}).get((snapshot.worker,))
        if idle and last is not None and last < scraped_at:
            self.health.set(_KV_LAST_TS, (snapshot.worker,), scraped_at)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        with self.lock:
            self.time.advance(scraped_at)
            self._router_histograms(snapshot, self.worker_pool.routers.get(snapshot.router), scraped_at)
            self.worker_pool.observe_router(snapshot, scraped_at)
            self._update_pool(scraped_at)
            self._expire()

    def _router_histograms(self, snap: RouterSnapshot, prev: RouterSnapshot | None, ts: float) -> None:
        """A router's histograms, scrape over scrape: the new observations go into the catalogue's
        histogram (each placed inside its router bucket, windows.increase) and the signal is instrumented. The
        first scrape of a router is its baseline: what it counted before is not in the window."""
        for fld, metric, signal, labels in ROUTER_HISTOGRAMS:
            new = getattr(snap, fld)
            if new is None:
                continue
            self.accounting.field_seen[signal] = ts
            if prev is None:
                continue
            lab = labels(snap)
            for value, n in increase(new, getattr(prev, fld)):
                for _ in range(round(n)):
                    self.store.observe(ts, metric, lab, value)

    def signal_seen(self, signal: str, ts: float) -> None:
        """A source other than records or scrapes carried ``signal`` at ``ts`` (e.g. OTLP spans)."""
        with self.lock:
            self.accounting.field_seen[signal] = max(ts, self.accounting.field_seen.get(signal, 0.0))

    def ingest_records(self, records: Iterable[RecordInput], received_at: float) -> None:
        """Request records that passed the ``prefixscope.request/v1`` schema.

        The intake hands over :class:`RequestRecord` values; a plain JSON object (replays, tests,
        the lab) is converted here, and one that cannot be is counted and skipped.
        """
        labels = self.accounting.labels
        with self.lock:
            self.time.advance(received_at)
            folded = labels.folded()
            update_pool = False
            account, attribute, now = self.accounting.account, self.attribution.records.account, self.time.now
            # Workers whose records cannot change the pool: the pool, the input time and the
            # scrape targets' up states stay as they are until the loop ends.
            unchanged: set[str] = set()
            with self.store.batch():  # counter writes once per key and slot, at the end
                for rec in records:
                    try:
                        record = rec if isinstance(rec, RequestRecord) else RequestRecord.from_json(rec)
                        worker = account(record)
                        attribute(record, now)
                        if record.block_hashes and record.cached_tokens:  # reuse seen on that worker
                            hit = record.cached_tokens // self.worker_block_size(record.worker)
                            self.evictions.hits(record.worker, record.block_hashes[:hit])
                    except (TypeError, ValueError, KeyError) as exc:  # InvalidRecord is a ValueError
                        # Schema-valid records should not fail here; if one does, keep the rest.
                        rid = rec.request_id if isinstance(rec, RequestRecord) else rec.get("request_id")
                        detail = str(exc) if isinstance(exc, InvalidRecord) else repr(exc)
                        self.health.error("records", "unprocessable", f"{detail} in record {rid!r}")
                        continue
                    # Only a worker outside the pool (or an aged pool) can change it: no walk per record.
                    if not update_pool and worker not in unchanged:
                        update_pool = self.worker_pool.needs_update(worker)
                        if not update_pool:
                            unchanged.add(worker)
            if update_pool:
                self._update_pool(self.time.now)
            self._expire()
            folded = labels.folded() - folded
        if folded:
            self.health.error("records", "label_limit", f"{folded} record(s) named a model, segment or worker "
                              "beyond the configured limits (limits:); counted under the value \"other\"", folded)

    def observe_cold_baselines(self, records: Iterable[RequestRecord], received_at: float) -> None:
        """Records another family shard keeps: only their cold prefill, into the cold-prefill
        baseline (exporter.core.sharding.ShardRecords)."""
        with self.lock:
            self.time.advance(received_at)
            for rec in records:
                self.accounting.observe_cold_baseline(rec)

    # ---- reads (callers hold no lock; each takes it once) --------------------------------------
    def signals(self) -> dict[str, bool]:
        with self.lock:
            return self.signals_locked()

    def signals_locked(self) -> dict[str, bool]:
        """Which signals are available now (the caller holds the lock)."""
        cutoff = self.time.now - self.window_s
        out = {name: False for name in catalog.SIGNALS}
        for signal, ts in self.accounting.field_seen.items():
            out[signal] = ts > cutoff
        out["kv_events"] = self.kv_seen
        out["kv_token_ids"] = self.roots.tokens_seen
        out["worker_metrics"] = any(w.snapshot is not None for w in self.workers.values())
        out["spec_decode"] = self.spec_seen
        out["router_metrics"] = bool(self.routers)
        out["topology"] = self.topology is not None
        out["placements"] = out["block_hashes"] or (self.kv_seen and self.topology is not None)
        out["warm_pool"] = self.topology is not None and bool(self.topology.warm_pool)
        return out


    def tree_stats(self) -> TreeStats | None:
        """The latest completed statistics pass (None before the first one): never computes."""
        return self._tree_stats

    def refresh_tree_stats(self) -> TreeStats:
        """Run a statistics pass now if the index changed since the latest one; return the latest.

        Only the reading's steps hold the state lock, in short slices (``pass_in_slices``); the
        result is built outside it and swapped in whole, so readers see either the previous one or this one.
        """
        with self._refresh_lock:  # a concurrent caller waits, then finds the statistics current
            with self.lock:
                latest = self._tree_stats
                if latest is not None and latest.version == self.index.version:
                    return latest
            tree, held = pass_in_slices(self.index, self.lock)
            t1 = time.perf_counter()
            stats = compute_stats(tree, TREE_CHILDREN_DEPTH)
            self.tree_stats_timing = TreeStatsTiming(held.total_s, time.perf_counter() - t1, stats.blocks,
                                                     held.max_hold_s, held.slices)
            self._tree_stats = stats
            return stats

    def tree_stats_with_children(self, depth: int) -> TreeStats | None:
        """The latest statistics if they keep the runs ``depth`` edges deep, else a pass of
        their own for this one request (stepped under the lock, built outside it).
        None before the first pass: the tree is missing until the statistics exist."""
        latest = self._tree_stats
        if latest is None or latest.children_depth >= depth:
            return latest
        with self._refresh_lock:  # one reading at a time (each holds its walk's working memory)
            tree, _held = pass_in_slices(self.index, self.lock)
        return compute_stats(tree, depth)

    def worker_capacity(self, name: str, w: WorkerInfo | None = None) -> int | None:
        """GPU blocks of the worker (its scrape, else its topology class); ``w``: its entry, when at hand."""
        if w is None:
            w = self.workers.get(name)
        if w is not None and w.snapshot is not None and w.snapshot.num_gpu_blocks:
            return w.snapshot.num_gpu_blocks
        t = self.topo_of(name)
        return t.kv_blocks if t is not None else None

    def worker_block_size(self, name: str) -> int:
        w = self.workers.get(name)
        if w is not None and w.block_size:
            return w.block_size
        return int(getattr(self.topology, "block_size", 0) or DEFAULT_BLOCK_SIZE)

    def warm_pool_utilization(self) -> dict[str, float]:
        """max(KV usage, running / max concurrency) per warm-pool worker with a scrape."""
        out: dict[str, float] = {}
        if self.topology is None:
            return out
        for name in self.topology.warm_pool:
            w = self.workers.get(name)
            snap = w.snapshot if w is not None else None
            if snap is None:
                continue
            parts = [snap.kv_usage_ratio] if snap.kv_usage_ratio is not None else []
            cap = snap.max_running or getattr(self.topo_of(name), "max_concurrency", None)
            if snap.running is not None and cap:
                parts.append(snap.running / cap)
            if parts:
                out[name] = max(parts)
        return out

    def worker_hit_ratio(self, name: str) -> float | None:
        """The worker's recent hit ratio: engine counters in the window, else its records."""
        get = self.store.own_sum
        q = get(("worker_delta", "prefix_queried_tokens", name))
        h = get(("worker_delta", "prefix_hit_tokens", name))
        if q:
            return (h or 0.0) / q
        p = get(("record_prompt", name))
        c = get(("record_cached", name))
        return (c or 0.0) / p if p else None

    def worker_hit_tokens(self, name: str) -> float | None:
        """The worker's hit tokens in the window, from the same source as :meth:`worker_hit_ratio`
        (engine counters, else its records); None when neither measured it."""
        get = self.store.own_sum
        if get(("worker_delta", "prefix_queried_tokens", name)):
            return get(("worker_delta", "prefix_hit_tokens", name)) or 0.0
        if get(("record_prompt", name)):
            return get(("record_cached", name)) or 0.0
        return None

    def worker_tier_hit_tokens(self, name: str) -> dict[str, float] | None:
        """The worker's cached tokens in the window by the tier that served them (None: the engine
        does not report tiers)."""
        out: dict[str, float] = {}
        for key, v in self.store.win.sums.items():
            if key[0] == _TIER_HITS and len(key) == 2 and key[1] and key[1][0] == name:
                tier = key[1][-1]
                out[tier] = out.get(tier, 0.0) + v
        return out or None

    def effective_cache_values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, blocks in self.index.resident_by_worker().items():
            ratio = self.worker_hit_ratio(name)
            if ratio is not None:
                out[name] = blocks * self.worker_block_size(name) * ratio
        return out

    @staticmethod
    def removal_ranks(values: dict[str, float]) -> dict[str, int]:
        """1 = safest to remove (least effective cache value; ties by name)."""
        order = sorted(values, key=lambda w: (values[w], w))
        return {w: i + 1 for i, w in enumerate(order)}

    def session_hit_ratios(self) -> list[float]:
        cutoff = self.time.now - self.window_s
        return [s.followup_cached / s.followup_prompt for s in self.sessions.active_since(cutoff)
                if s.followup_prompt > 0]

    def branch_hits(self, start: float, end: float, stats: TreeStats | None = None) -> dict[int, tuple[float, set]]:
        """Hit tokens and sessions per branch for hits with start < ts ≤ end."""
        return self.hotspots.branch_hits(start, end, stats or self._tree_stats or NO_TREE)

    def hot_branches(self, k: int | None = None, stats: TreeStats | None = None) -> list[tuple[int, float, int]]:
        """Top-k branches of the window: (first block, hit tokens, sessions)."""
        now = self.time.now
        return self.hotspots.hot_branches(self.top_k if k is None else k, now - self.window_s, now,
                                          stats or self._tree_stats or NO_TREE)

    def hot_branch_tokens(self, stats: TreeStats | None = None) -> list[tuple[int, float]]:
        """Top-k branches of the window by hit tokens, kept incrementally (what /metrics renders)."""
        now = self.time.now
        return self.hotspots.hot_branch_tokens(self.top_k, now - self.window_s, now,
                                               stats or self._tree_stats or NO_TREE)

    def fallback_active(self) -> dict[str, float]:
        return self.accounting.fallback_active()

    def window_counter(self, metric: str, where: LabelFilter | None = None) -> float | None:
        """Σ over the window of a catalogue counter (all label sets, or those ``where`` accepts)."""
        return self.store.window_counter(metric, where)

    def window_buckets(self, metric: str, window_s: float | None = None,
                       where: LabelFilter | None = None) -> tuple[tuple[float, ...], list[int]] | None:
        return self.store.window_buckets(metric, window_s, where)

    def snapshot_for(self, fn: Callable[[ClusterState], T]) -> T:
        """Run a read under the lock (the collector and API builders use this)."""
        with self.lock:
            self._expire()
            return fn(self)

    def workers_seen(self) -> list[str]:
        names = set(self.workers) | set(self.index.workers)
        return sorted(names)

    # ---- current series (the collector renders them; the checks read them) ---------------------
    def series(self) -> Series:
        """Every catalogue series as plain data, from the state and the exporter's Health."""
        return build_series(self)
